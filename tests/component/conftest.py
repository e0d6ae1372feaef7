"""Component tests: pdserve's parts against fakes that are real servers and processes (uvicorn fake engines
and routers on loopback, ZMQ publishers, ``python -m`` children, vLLM's shared-memory queue, the real CPU
probe). No vLLM engine, no Ray cluster: those are tests/integration's."""

import pytest

from pdserve.testing.cpu_probe import stub_cpu_probes


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """Doctor and CLI tests would otherwise time matmuls in a subprocess (and cache the result in the user's
    pdserve cache). tests/component/test_cpu_host.py runs the real probe once, on purpose."""
    stub_cpu_probes(monkeypatch)
