import pytest

from pdserve.engine import cpu_dtype, cpu_host
from pdserve.engine.dtype_fidelity import FidelityProbe

#: What unit tests see instead of timing real matmuls: an AVX2-like host where bf16 is 6.4x slower.
FAKE_PROBE = cpu_host.MatmulProbe(cpu_model="Test CPU", isa=["avx", "avx2", "fma"], torch_version="0.0",
                                  fp32_ms=75.0, bf16_ms=480.0, measured_at="2026-01-01T00:00:00+00:00")
#: ... and a model that bf16 keeps faithful (the tests that need another answer give their own).
FAKE_FIDELITY = FidelityProbe(model="/test/model", tokens=400, disagreements=0)


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """Builder, doctor and CLI tests would otherwise time matmuls in a subprocess (and cache the result in
    the user's pdserve cache). tests/unit/test_cpu_host.py runs the real probe once, on purpose."""
    monkeypatch.setattr(cpu_host, "probe_matmul", lambda cache_dir=None, *, refresh=False: FAKE_PROBE)
    monkeypatch.setattr(cpu_dtype, "model_fidelity", lambda args: FAKE_FIDELITY)
