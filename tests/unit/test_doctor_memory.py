"""``pdserve doctor``'s memory check on a CPU host: what it warns about and which levers its fix names."""

from __future__ import annotations

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.doctor import checks

GIB = 1 << 30


@pytest.fixture
def cpu_host(monkeypatch):
    monkeypatch.setattr(checks.probes, "nvidia_gpus", lambda: [])

    def with_available(gib: float) -> None:
        monkeypatch.setattr(checks.probes, "meminfo",
                            lambda: {"MemTotal": 24 * GIB, "MemAvailable": int(gib * GIB), "HugePages_Total": 0})

    return with_available


def memory(args: PDServeArgs):
    (result,) = list(checks.check_memory(checks.DoctorContext(args=args)))
    return result


def test_a_host_short_of_memory_is_told_every_lever_shared_weights_included(cpu_host):
    cpu_host(2.0)
    r = memory(PDServeArgs.model_validate({"cpu": {"share_weights": "off"}}))
    assert r.status == "warn" and "2 CPU engines need about" in r.detail
    assert "cpu.kv_cache_gib" in r.fix and "cpu.share_weights: packed" in r.fix


@pytest.mark.parametrize("mode", ["packed", "mapped"])
def test_shared_weights_is_not_suggested_when_on_already(cpu_host, mode: str):
    cpu_host(2.0)
    r = memory(PDServeArgs.model_validate({"cpu": {"share_weights": mode}}))
    assert r.status == "warn" and "share_weights" not in r.fix


def test_enough_memory_is_ok(cpu_host):
    cpu_host(20.0)
    assert memory(PDServeArgs()).status == "ok"
