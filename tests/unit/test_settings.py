"""pdserve's environment variables: one typed module, read when used, documented in docs/environment.md."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from pdserve import settings as settings_mod
from pdserve.errors import ConfigError
from pdserve.settings import ENGINE_PROTOCOL, Settings, settings

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "pdserve"


def test_environment_page_is_current():
    doc = ROOT / "docs" / "environment.md"
    assert doc.read_text() == settings_mod.render_markdown(), \
        "run: python -m pdserve.settings > docs/environment.md"


def test_every_pdserve_variable_in_src_is_documented():
    documented = {v.name for v in Settings.variables()} | {e.name for e in ENGINE_PROTOCOL}
    used = set()
    for f in SRC.rglob("*.py"):
        used |= set(re.findall(r"PDSERVE_[A-Z0-9_]+", f.read_text()))
    assert used - documented == set(), "document them in src/pdserve/settings.py"
    assert documented - used == set(), "documented but never used"


def test_settings_are_the_only_reader_outside_the_engine_processes():
    # Code that runs inside the engines (the site hook) reads its protocol variables itself; everything
    # else goes through pdserve.settings.
    direct = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']PDSERVE_""")
    offenders = [str(f.relative_to(SRC)) for f in SRC.rglob("*.py")
                 if direct.search(f.read_text()) and f.parent.name != "_site"]
    assert offenders == []


def test_engine_protocol_names_match_the_engine_code():
    from pdserve.engine import launcher, vllm_plugin

    assert launcher.ENGINE_KEY_ENV == vllm_plugin.ENV_KEY == settings_mod.ENGINE_KEY_ENV
    assert vllm_plugin.ENV_FILE == settings_mod.KV_EVENTS_FILE_ENV
    site = (SRC / "engine" / "_site" / "sitecustomize.py").read_text()
    for name in (settings_mod.ENGINE_CORES_ENV, settings_mod.NIXL_PTHR_DELAY_US_ENV,
                 settings_mod.NIXL_PROG_THREAD_ENV, settings_mod.ENGINE_IDLE_SPIN_MS_ENV):
        assert f'"{name}"' in site


def test_defaults():
    s = settings({})
    assert s.cache_dir is None and s.constraints is None
    assert s.lock_dir == Path(tempfile.gettempdir()) / "pdserve-locks"
    assert s.log_dir == Path("/tmp/pdserve-logs")
    assert s.engine_start_timeout_s == 900.0
    assert s.api_keys == ""


def test_values_are_typed_and_empty_means_unset():
    s = settings({"PDSERVE_ENGINE_START_TIMEOUT_S": "12.5", "PDSERVE_LOG_DIR": "~/logs",
                  "PDSERVE_CACHE_DIR": "  ", "PDSERVE_LOCK_DIR": ""})
    assert s.engine_start_timeout_s == 12.5
    assert s.log_dir == Path.home() / "logs"
    assert s.cache_dir is None
    assert s.lock_dir == Path(tempfile.gettempdir()) / "pdserve-locks"


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ConfigError, match="PDSERVE_ENGINE_START_TIMEOUT_S"):
        _ = settings({"PDSERVE_ENGINE_START_TIMEOUT_S": value}).engine_start_timeout_s


def test_read_when_used_not_at_import(monkeypatch, tmp_path):
    from pdserve.engine import allocator
    from pdserve.engine.allocator import Claim, claim_port_block, lock_dir

    monkeypatch.setattr(allocator, "port_is_free", lambda port, host="0.0.0.0": True)  # no bind: a unit test
    s = settings()  # taken before the variable is set: still sees it
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path / "locks"))
    assert s.lock_dir == lock_dir() == tmp_path / "locks"
    claim = Claim()
    try:
        port = claim_port_block(claim, 40000, 1)
        assert (tmp_path / "locks" / "ports" / f"{port}.lock").exists()
    finally:
        claim.release()


def test_api_keys_variable_named_by_the_config(monkeypatch):
    from pdserve.config.schema import RouterConfig
    from pdserve.router.auth import ApiKeys

    monkeypatch.setenv("OTHER_KEYS", "k1,k2")
    monkeypatch.setenv("PDSERVE_API_KEYS", "k3")
    assert settings().named("OTHER_KEYS") == "k1,k2"
    assert ApiKeys(RouterConfig(api_keys_env="OTHER_KEYS")).enabled
    monkeypatch.delenv("PDSERVE_API_KEYS")
    assert not ApiKeys(RouterConfig()).enabled


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    from pdserve.model.cache import cache_root

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert cache_root("/explicit") == Path("/explicit")
