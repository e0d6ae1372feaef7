"""The benchmarks' tests: self-contained, on pdserve's test harnesses (pdserve.testing). Nothing here reaches a
model hub or times real matmuls.

bench/tests holds unit tests: each runs under :class:`pdserve.testing.no_io.NoIO`, as tests/unit's do (no INET
or ZeroMQ socket, no process). Tests that run fake engines on loopback or child processes are in
bench/tests/component, which the guard leaves alone."""

from __future__ import annotations

import itertools
import os
import platform
from collections.abc import Generator
from pathlib import Path

import cpuinfo  # noqa: F401  (runs `file -b` at its import: before any guard)
import pytest
import urllib3.util.connection  # noqa: F401  (binds ::1 once at import, to learn about IPv6: before any guard)

from pdserve.testing.cpu_probe import stub_cpu_probes
from pdserve.testing.no_io import guard_phase

platform.processor()  # `uname -p`, asked once, before any guard (tests/unit/conftest.py says why)

# Never reach a model hub from tests: everything runs on the packaged model or fakes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
COMPONENT = HERE / "component"
WHERE = "bench/tests/component"


def _guarded(item: pytest.Item) -> bool:
    return COMPONENT not in Path(item.path).resolve().parents


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    if not _guarded(item):
        return (yield)
    return (yield from guard_phase(WHERE))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if not _guarded(item):
        return (yield)
    return (yield from guard_phase(WHERE))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    if not _guarded(item):
        return (yield)
    return (yield from guard_phase(WHERE))


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """A scenario's dry run resolves ``cpu.dtype: auto``; the probes would time matmuls in a subprocess."""
    stub_cpu_probes(monkeypatch)


@pytest.fixture
def nothing_starts(monkeypatch, tmp_path_factory):
    """A dry run: any process start or model preparation fails the test, and the ports a plan names are
    numbered (from 41000) instead of found free by binding them."""
    import subprocess

    def forbidden(*a, **kw):
        raise AssertionError(f"a dry run started something: {a[:1]}")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr("pdserve.model.resolve.prepare_embedded_model", forbidden)
    ports = itertools.count(41000)

    def numbered(host: str = "127.0.0.1") -> int:
        return next(ports)

    monkeypatch.setattr("pdserve.engine.allocator.free_ephemeral_port", numbered)
    monkeypatch.setattr("pdserve.engine.allocator.port_is_free", lambda port, host="0.0.0.0": True)
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))  # (ports are claimed there)
