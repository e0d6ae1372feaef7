import pytest

from pdserve.testing.cpu_probe import stub_cpu_probes


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """Builder, doctor and CLI tests would otherwise time matmuls in a subprocess (and cache the result in
    the user's pdserve cache). tests/unit/test_cpu_host.py runs the real probe once, on purpose."""
    stub_cpu_probes(monkeypatch)
