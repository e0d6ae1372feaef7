"""bf16 only where it is faster and faithful: the decision (cpu_dtype) and the fidelity probe's cache and
figures, without loading a model (tests/integration/test_dtype_fidelity.py measures the packaged one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine import cpu_dtype, dtype_fidelity
from pdserve.engine.cpu_dtype import resolve_cpu_dtype
from pdserve.engine.cpu_host import CpuProbeError, MatmulProbe
from pdserve.engine.dtype_fidelity import MIN_AGREEMENT, FidelityProbe, probe_fidelity

FAST_BF16 = MatmulProbe(cpu_model="Xeon", isa=["amx_bf16"], torch_version="2.13.0", fp32_ms=33.2, bf16_ms=12.2)
SLOW_BF16 = MatmulProbe(cpu_model="EPYC", isa=["avx2"], torch_version="2.13.0", fp32_ms=75.0, bf16_ms=480.0)
# The packaged model as measured on an AMX host: 7 of 362 next tokens differ.
UNFAITHFUL = FidelityProbe(model="/m", tokens=362, disagreements=7)
FAITHFUL = FidelityProbe(model="/m", tokens=362, disagreements=1)


def _resolve(probe: MatmulProbe, fidelity) -> tuple[str, str]:
    out, reason = resolve_cpu_dtype(PDServeArgs(), probe=lambda: probe, fidelity=fidelity)
    assert out.prefill_config.engine_kwargs["dtype"] == out.decode_config.engine_kwargs["dtype"]
    return out.prefill_config.engine_kwargs["dtype"], reason


def test_fast_but_unfaithful_bf16_is_not_chosen_and_the_reason_gives_both_figures():
    dtype, reason = _resolve(FAST_BF16, lambda: UNFAITHFUL)
    assert dtype == "float32"
    assert "2.7x faster than fp32" in reason and "but bf16 agrees with float32 on 98.1 %" in reason
    assert "7 of 362 differ" in reason and reason.endswith("-> float32")


def test_fast_and_faithful_bf16_is_chosen():
    dtype, reason = _resolve(FAST_BF16, lambda: FAITHFUL)
    assert dtype == "bfloat16" and "and bf16 agrees with float32 on 99.7 %" in reason


def test_slow_bf16_is_not_chosen_and_fidelity_is_not_measured():
    def never() -> FidelityProbe:
        raise AssertionError("no fidelity probe where bf16 is slower anyway")

    dtype, reason = _resolve(SLOW_BF16, never)
    assert dtype == "float32" and "fidelity" not in reason


def test_fidelity_that_cannot_be_measured_leaves_speed_to_decide_and_says_so():
    def cannot() -> FidelityProbe:
        raise CpuProbeError("the model is not on this host yet")

    dtype, reason = _resolve(FAST_BF16, cannot)
    assert dtype == "bfloat16" and "bf16 fidelity not measured (the model is not on this host yet)" in reason


def test_threshold_and_figures():
    assert MIN_AGREEMENT == 0.99
    assert UNFAITHFUL.agreement == pytest.approx(0.9807, abs=1e-4) and not UNFAITHFUL.faithful
    assert FidelityProbe(model="/m", tokens=400, disagreements=4).faithful  # exactly 99 %
    with pytest.raises(ValueError):
        FidelityProbe.from_dict({"model": "/m", "tokens": 10, "disagreements": 11})


def _model_dir(tmp_path: Path, size: int = 1000) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * size)
    return d


def test_the_probe_is_cached_per_host_and_model_and_measured_again_when_the_weights_change(tmp_path, monkeypatch):
    runs: list[Path] = []

    def run(model_dir: Path) -> FidelityProbe:
        runs.append(model_dir)
        return FidelityProbe(model=str(model_dir), tokens=362, disagreements=7)

    monkeypatch.setattr(dtype_fidelity, "_run", run)
    d = _model_dir(tmp_path)
    cache = tmp_path / "cache"
    assert probe_fidelity(d, cache).disagreements == 7
    assert probe_fidelity(d, cache).disagreements == 7
    assert len(runs) == 1
    stored = json.loads((cache / "host" / dtype_fidelity.FIDELITY_FILE).read_text())
    assert len(stored["probes"]) == 1
    (d / "model.safetensors").write_bytes(b"\0" * 2000)  # new weights: another model for the cache
    probe_fidelity(d, cache)
    assert len(runs) == 2
    probe_fidelity(d, cache, refresh=True)
    assert len(runs) == 3


def test_models_too_big_or_without_weights_are_not_probed(tmp_path, monkeypatch):
    monkeypatch.setattr(dtype_fidelity, "_run", lambda d: pytest.fail("must not run"))
    d = _model_dir(tmp_path)
    monkeypatch.setattr(dtype_fidelity, "MAX_WEIGHT_BYTES", 10)
    with pytest.raises(CpuProbeError, match="over the probe"):
        probe_fidelity(d, tmp_path / "cache")
    (d / "model.safetensors").unlink()
    with pytest.raises(CpuProbeError, match="no safetensors"):
        probe_fidelity(d, tmp_path / "cache")


def test_a_model_not_on_this_host_is_not_prepared_or_downloaded_to_be_probed(tmp_path, monkeypatch):
    monkeypatch.undo()  # the unit suite fakes model_fidelity; this test is about the real one
    args = PDServeArgs.model_validate({"cache_dir": str(tmp_path / "empty")})
    with pytest.raises(CpuProbeError, match="not on this host"):
        cpu_dtype.model_fidelity(args)
    hub = PDServeArgs.model_validate({"prefill_config": {"model_loading_config": {"model_source": "org/some-model"}},
                                      "decode_config": {"model_loading_config": {"model_source": "org/some-model"}}})
    with pytest.raises(CpuProbeError, match="not on this host"):
        cpu_dtype.model_fidelity(hub)
    local = _model_dir(tmp_path)
    assert dtype_fidelity.local_model_dir(str(local), None) == local.resolve()


def test_a_hub_model_fetched_into_the_engines_hub_cache_is_found_there(tmp_path):
    """Once a hub model is in the engines' hub cache (``pdserve serve`` fetches it first on one host), its
    snapshot is the directory the fidelity probe reads; no network is asked either way."""
    snap = tmp_path / "huggingface" / "hub" / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc")
    assert dtype_fidelity.local_model_dir("org/m", str(tmp_path)) == snap
    assert dtype_fidelity.local_model_dir("org/other", str(tmp_path)) is None
    assert dtype_fidelity.local_model_dir("/no/such/dir", str(tmp_path)) is None
