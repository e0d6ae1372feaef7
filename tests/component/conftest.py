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


@pytest.fixture(autouse=True)
def _pythonpath_restored():
    """``pdserve serve`` run in-process (tests/component/test_serve_cluster.py) appends app/_ray_site to
    PYTHONPATH for its own Ray's processes, where pandas and pyarrow are not importable: a later test's
    subprocess (Ray Serve LLM's config check) must not inherit that."""
    import os

    before = os.environ.get("PYTHONPATH")
    yield
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before
