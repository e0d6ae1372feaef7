"""Session-wide test settings, and the host's memory during the run.

A sampler reads the host's memory in use (total minus available) twice a second for the whole session;
``make test`` prints its peak (and the test running then) at the end, and a failed test that ran while
the host was short of memory says so beside its failure: Ray's memory monitor kills workers at 95 % of the
host's memory, which shows up as unrelated-looking errors (503s, dead replicas) far from the cause."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

# Never reach a model hub from tests: everything runs on the packaged model or fakes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GIB = 1024**3
#: Share of the host's memory in use above which a failed test's report names memory as a suspect
#: (Ray's memory monitor acts at 0.95).
TIGHT_SHARE = 0.9


class MemoryWatch:
    """The host's peak memory in use, overall and during the current test."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.total = psutil.virtual_memory().total
        self.peak = 0
        self.peak_test = ""
        self.test = ""
        self.test_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> None:
        vm = psutil.virtual_memory()
        used = vm.total - vm.available
        self.test_peak = max(self.test_peak, used)
        if used > self.peak:
            self.peak, self.peak_test = used, self.test

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def begin(self, nodeid: str) -> None:
        self.test, self.test_peak = nodeid, 0
        self.sample()


_watch = MemoryWatch()


class PerTest:
    """The per-test hooks, registered as a plugin (:func:`pytest_configure`) so that they see every test of the
    session, bench/tests' too: a conftest's own per-test hooks see only the tests under its directory. Each
    module's wall time (its tests' setup, call and teardown: a module's own system included) is added up for
    the summary, so a CI run near its time budget says where the time went."""

    def __init__(self) -> None:
        self.by_module: dict[str, float] = {}

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        _watch.begin(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.by_module[module] = self.by_module.get(module, 0.0) + report.duration

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        report = outcome.get_result()
        _watch.sample()
        if report.failed and _watch.test_peak > TIGHT_SHARE * _watch.total:
            report.sections.append(("host memory", (
                f"the host had {_watch.test_peak / GIB:.1f} of {_watch.total / GIB:.1f} GiB in use during this "
                f"test: Ray's memory monitor kills workers above 95 %, which may be why it failed")))


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("pdserve-memory-watch"):
        config.pluginmanager.register(PerTest(), "pdserve-memory-watch")


#: Modules listed in the summary, the slowest first.
SLOWEST_MODULES = 15


def pytest_sessionstart(session: pytest.Session) -> None:
    _watch.start()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _watch.stop()
    _watch.sample()
    terminalreporter.write_line(
        f"peak host memory in use during the tests: {_watch.peak / GIB:.1f} GiB of {_watch.total / GIB:.1f} GiB"
        + (f" (during {_watch.peak_test})" if _watch.peak_test else ""))
    per = terminalreporter.config.pluginmanager.get_plugin("pdserve-memory-watch")
    times = sorted(per.by_module.items(), key=lambda kv: -kv[1]) if per is not None else []
    if len(times) > 1:
        terminalreporter.write_line(f"time per module (s), of {sum(t for _, t in times):.0f} s in all: " + ", ".join(
            f"{m.removeprefix('tests/')} {t:.0f}" for m, t in times[:SLOWEST_MODULES]))


@pytest.fixture
def no_gpu(monkeypatch):
    """A host without NVIDIA GPUs and outside any Ray cluster, as `pdserve doctor` probes it."""
    from pdserve.doctor import probes

    monkeypatch.setattr(probes, "nvidia_gpus", lambda: None)
    monkeypatch.setattr(probes, "nvidia_device_nodes", list)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
