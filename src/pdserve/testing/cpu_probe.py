"""Fixed readings instead of the CPU probes (a matmul timing and a dtype-fidelity run, each in a subprocess,
cached in the user's pdserve cache): what tests that resolve ``cpu.dtype: auto`` see."""

from __future__ import annotations

from typing import Any

from pdserve.engine import cpu_dtype, cpu_host
from pdserve.engine.dtype_fidelity import FidelityProbe

#: An AVX2-like host where bf16 is 6.4x slower.
FAKE_PROBE = cpu_host.MatmulProbe(cpu_model="Test CPU", isa=["avx", "avx2", "fma"], torch_version="0.0",
                                  fp32_ms=75.0, bf16_ms=480.0, measured_at="2026-01-01T00:00:00+00:00")
#: ... and a model that bf16 keeps faithful (the tests that need another answer give their own).
FAKE_FIDELITY = FidelityProbe(model="/test/model", tokens=400, disagreements=0)


def stub_cpu_probes(monkeypatch: Any) -> None:
    """With pytest's ``monkeypatch``: the probes answer :data:`FAKE_PROBE` and :data:`FAKE_FIDELITY`."""
    monkeypatch.setattr(cpu_host, "probe_matmul", lambda cache_dir=None, *, refresh=False: FAKE_PROBE)
    monkeypatch.setattr(cpu_dtype, "model_fidelity", lambda args: FAKE_FIDELITY)
