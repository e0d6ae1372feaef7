"""What a running app costs its host: memory (PSS) and CPU time by part (each engine's processes, the router,
Ray Serve's controller and proxy, Ray's own daemons).

PSS (proportional set size) counts a page shared by several processes once in all, split between them, so
the parts add up to what the app takes from the host. The parts are told apart by command line; only the
processes of this host are seen (a cluster's other nodes report their own). Sampled CPU time is also split by
thread (``/proc/<pid>/task``, Linux), by part and thread name, the process's first thread named ``main``:
where an idle app's time goes, down to a library's timer thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: A process's part, from the first pattern its command line contains (checked in this order).
PARTS: tuple[tuple[str, str], ...] = (
    ("pdserve.engine.guard", "engine guard"),  # before the engine's: its command line holds the engine's
    ("pdserve.engine.forkserver", "engine forkserver"),
    ("VLLM::Worker", "engine worker"),
    ("VLLM::EngineCore", "engine core"),
    ("vllm.entrypoints.openai.api_server", "engine API server"),
    ("ServeReplica:", "replica:"),  # a Serve replica: the router, or an engine role's replica (see _part)
    ("ServeController", "Serve controller"),
    ("ProxyActor", "Serve proxy"),
    ("gcs_server", "Ray GCS"),
    ("raylet", "Ray raylet"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("ray::DashboardAgent", "Ray dashboard agent"),  # (the agents retitle themselves once started)
    ("runtime_env/agent", "Ray runtime-env agent"),
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("log_monitor.py", "Ray log monitor"),
    ("dashboard/dashboard.py", "Ray dashboard"),
    ("monitor.py", "Ray monitor"),
    ("pdserve serve", "pdserve serve (driver)"),
    ("ray::IDLE", "Ray idle worker"),
)


def _part(cmdline: str) -> str | None:
    for pattern, name in PARTS:
        if pattern in cmdline:
            if name == "replica:":
                # ray::ServeReplica:<app>:<deployment>
                deployment = cmdline.split("ServeReplica:", 1)[1].split()[0].split(":")[-1]
                return f"{deployment} replica"
            return name
    return None


@dataclass
class Footprint:
    #: Bytes of PSS per part.
    pss: dict[str, int] = field(default_factory=dict)
    #: Processes per part.
    processes: dict[str, int] = field(default_factory=dict)
    #: Share of one core per part, over the sampled interval (empty when not sampled).
    cpu: dict[str, float] = field(default_factory=dict)
    #: Share of one core per ``"part: thread"`` over the sampled interval (Linux; empty when not sampled).
    threads: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    #: How many of the busiest threads :meth:`as_dict` lists.
    TOP_THREADS = 16

    @property
    def total_pss(self) -> int:
        return sum(self.pss.values())

    @property
    def total_cpu(self) -> float:
        return sum(self.cpu.values())

    def as_dict(self) -> dict[str, Any]:
        return {"pss_bytes": dict(sorted(self.pss.items(), key=lambda kv: -kv[1])), "total_pss_bytes": self.total_pss,
                "processes": self.processes,
                **({"cpu_core_share": {k: round(v, 4) for k, v in sorted(self.cpu.items(), key=lambda kv: -kv[1])},
                    "total_cpu_core_share": round(self.total_cpu, 4), "cpu_seconds": self.seconds,
                    "cpu_by_thread": {k: round(v, 4) for k, v in sorted(self.threads.items(), key=lambda kv: -kv[1])
                                      [:self.TOP_THREADS] if round(v, 4) > 0}}
                   if self.seconds else {})}

    def table(self) -> str:
        """A plain-text table, largest part first."""
        rows = [f"{'part':<28}{'procs':>6}{'PSS GiB':>10}" + (f"{'% core':>9}" if self.seconds else "")]
        for name in sorted(self.pss, key=lambda k: -self.pss[k]):
            row = f"{name:<28}{self.processes.get(name, 0):>6}{self.pss[name] / 2**30:>10.2f}"
            if self.seconds:
                row += f"{100 * self.cpu.get(name, 0.0):>9.1f}"
            rows.append(row)
        total = f"{'total':<28}{sum(self.processes.values()):>6}{self.total_pss / 2**30:>10.2f}"
        if self.seconds:
            total += f"{100 * self.total_cpu:>9.1f}"
        return "\n".join(rows + [total])


def _app_processes(root: int | None = None) -> Iterable[tuple[Any, str]]:
    """The app's processes of this host with their parts: every one whose command line names a part, or,
    with ``root``, that process and those under it only (another app on the host is then not counted)."""
    import psutil

    if root is None:
        candidates: Iterable[Any] = psutil.process_iter(["cmdline"])
    else:
        try:
            top = psutil.Process(root)
            candidates = [top, *top.children(recursive=True)]
        except psutil.Error:
            return
    for p in candidates:
        try:
            cmd = " ".join(p.cmdline() or [])
        except psutil.Error:
            continue
        part = _part(cmd)
        if part is not None:
            yield p, part


def thread_times(pid: int, proc: str = "/proc") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, summed by thread name (``main``: the
    process's first thread, whatever its name); empty where ``/proc`` has no such process."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name_end = stat.rfind(")")
        name = "main" if tid == str(pid) else stat[stat.find("(") + 1:name_end]
        fields = stat[name_end + 2:].split()
        try:
            used = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + used
    return out


def thread_shares(part: str, before: Mapping[str, float], after: Mapping[str, float],
                  seconds: float) -> dict[str, float]:
    """Each thread name's share of one core between two :func:`thread_times`, keyed ``"part: name"``."""
    if seconds <= 0:
        return {}
    return {f"{part}: {name}": (t - before.get(name, 0.0)) / seconds for name, t in after.items()
            if t - before.get(name, 0.0) > 0}


def measure(cpu_seconds: float = 0.0, root: int | None = None) -> Footprint:
    """The app's footprint on this host; with ``cpu_seconds`` > 0 also each part's CPU use over that long
    (the caller waits that long). ``root``: count only that process and those under it (``pdserve serve``
    that started its own Ray instance: every process of its app is under it)."""
    import psutil

    procs = list(_app_processes(root))
    fp = Footprint()
    before: dict[int, float] = {}
    threads_before: dict[int, dict[str, float]] = {}
    for p, part in procs:
        try:
            fp.pss[part] = fp.pss.get(part, 0) + int(p.memory_full_info().pss)
            fp.processes[part] = fp.processes.get(part, 0) + 1
            if cpu_seconds:
                t = p.cpu_times()
                before[p.pid] = t.user + t.system
                threads_before[p.pid] = thread_times(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    if cpu_seconds:
        t0 = time.monotonic()
        time.sleep(cpu_seconds)
        fp.seconds = time.monotonic() - t0
        for p, part in procs:
            if p.pid not in before:
                continue
            try:
                t = p.cpu_times()
                used = t.user + t.system - before[p.pid]
            except psutil.NoSuchProcess:
                continue
            fp.cpu[part] = fp.cpu.get(part, 0.0) + used / fp.seconds
            for name, share in thread_shares(part, threads_before.get(p.pid, {}), thread_times(p.pid),
                                             fp.seconds).items():
                fp.threads[name] = fp.threads.get(name, 0.0) + share
    return fp
