"""Unit tests: in-process, no socket, no process (the base of the test pyramid).

Every test here runs under :class:`pdserve.testing.no_io.NoIO`, setup and teardown included: one that binds or
connects an INET or ZeroMQ socket, or starts a process, fails with "unit tests open no sockets and start no
processes: move this test to tests/component". Unix sockets (asyncio's own socket pair) stay allowed."""

from collections.abc import Generator

import pytest

from pdserve.testing.cpu_probe import stub_cpu_probes
from pdserve.testing.no_io import guard_phase

WHERE = "tests/component"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from guard_phase(WHERE))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from guard_phase(WHERE))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    return (yield from guard_phase(WHERE))


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """Builder, doctor and CLI tests would otherwise time matmuls in a subprocess (and cache the result in
    the user's pdserve cache). tests/component/test_cpu_host.py runs the real probe once, on purpose."""
    stub_cpu_probes(monkeypatch)
