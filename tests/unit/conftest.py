"""Unit tests: in-process, no socket, no process (the base of the test pyramid).

Every test here runs under :class:`pdserve.testing.no_io.NoIO`, setup and teardown included: one that binds or
connects an INET or ZeroMQ socket, or starts a process, fails with "unit tests open no sockets and start no
processes: move this test to tests/component". Unix sockets (asyncio's own socket pair) stay allowed."""

import platform
from collections.abc import Generator

import cpuinfo  # noqa: F401  (see below)
import pytest
import urllib3.util.connection  # noqa: F401  (see below)

from pdserve.testing.cpu_probe import stub_cpu_probes
from pdserve.testing.no_io import guard_phase

# Libraries that ask about the host once and remember it do so here, before any test's guard, so a test that
# happens to import them first passes alone as in a full run: urllib3 (imported by Ray Serve, transformers)
# binds ::1 at its import to learn whether the host has IPv6; py-cpuinfo (imported by vLLM) runs `file -b`
# on Python at its import, and the platform module `uname -p`.
platform.processor()

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
