"""The app's footprint on its host, by part: processes told apart by command line."""

from __future__ import annotations

import os

import pytest

from pdserve import footprint
from pdserve.footprint import Footprint, _part


@pytest.mark.parametrize("cmdline, part", [
    ("/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m --port 1", "engine API server"),
    ("VLLM::EngineCore", "engine core"),
    ("VLLM::Worker", "engine worker"),
    ("/venv/bin/python3 -m pdserve.engine.guard 12 -- /venv/bin/python3 -m vllm.entrypoints.openai.api_server",
     "engine guard"),
    ("/venv/bin/python3 -m pdserve.engine.forkserver /tmp/pdserve-forks-x/engines.sock", "engine forkserver"),
    ("/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m --port 1 --host 127.0.0.1",
     "engine API server"),  # a server forked by the forkserver: retitled, its arguments apart by spaces
    ("ray::ServeReplica:pdserve:router", "router replica"),
    ("ray::ServeReplica:pdserve:decode", "decode replica"),
    ("ray::ServeController.listen_for_change", "Serve controller"),
    ("ray::ProxyActor", "Serve proxy"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", "Ray GCS"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "Ray raylet"),
    ("/venv/bin/python3 -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py", "Ray log monitor"),
    ("/venv/bin/python3 .venv/bin/pdserve serve", "pdserve serve (driver)"),
    ("ray::DashboardAgent", "Ray dashboard agent"),  # as Ray's agents retitle themselves
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("/usr/bin/bash -c make test", None),
])
def test_parts_are_told_apart_by_command_line(cmdline, part):
    assert _part(cmdline) == part


def test_the_table_adds_up():
    fp = Footprint(pss={"engine worker": 3 << 30, "router replica": 1 << 29}, processes={"engine worker": 2,
                   "router replica": 1}, cpu={"engine worker": 0.05, "router replica": 0.02}, seconds=30.0)
    assert fp.total_pss == (3 << 30) + (1 << 29) and fp.total_cpu == pytest.approx(0.07)
    lines = fp.table().splitlines()
    assert lines[1].startswith("engine worker") and lines[-1].split()[1:] == ["3", "3.50", "7.0"]
    assert list(fp.as_dict()["pss_bytes"]) == ["engine worker", "router replica"]


def _stat(tid: int, name: str, utime: int, stime: int) -> str:
    # /proc/<pid>/task/<tid>/stat: pid (comm) state, then fields 4-52; utime and stime are fields 14 and 15.
    rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime)] + ["0"] * 30
    return f"{tid} ({name}) " + " ".join(rest)


def test_cpu_time_by_thread_name(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    task = tmp_path / "42" / "task"
    for tid, name, u, s in [(42, "ray::ServeRepli", 3 * tick, tick), (43, "gloo_tcp_loop", tick, 0),
                            (44, "worker (io) )", tick, tick), (45, "worker (io) )", 0, tick)]:
        (task / str(tid)).mkdir(parents=True)
        (task / str(tid) / "stat").write_text(_stat(tid, name, u, s))
    got = footprint.thread_times(42, proc=str(tmp_path))
    # The first thread is "main" whatever its name; a name with spaces and parentheses is read whole;
    # threads of one name add up.
    assert got == {"main": 4.0, "gloo_tcp_loop": 1.0, "worker (io) )": 3.0}
    assert footprint.thread_times(7, proc=str(tmp_path)) == {}
    shares = footprint.thread_shares("decode replica", {"main": 1.0, "gloo_tcp_loop": 1.0}, got, 10.0)
    assert shares == {"decode replica: main": 0.3, "decode replica: worker (io) )": 0.3}  # the idle one left out
    fp = Footprint(pss={"x": 1}, cpu={"x": 0.6}, threads=shares, seconds=10.0)
    assert list(fp.as_dict()["cpu_by_thread"]) == ["decode replica: main", "decode replica: worker (io) )"]


class _Proc:
    def __init__(self, pid: int, cmd: str, kids: list[_Proc] | None = None) -> None:
        self.pid, self.cmd, self.kids = pid, cmd, kids or []

    def cmdline(self) -> list[str]:
        return self.cmd.split()

    def children(self, recursive: bool = False) -> list[_Proc]:
        return [d for k in self.kids for d in (k, *k.children(recursive=True))] if recursive else list(self.kids)


def test_an_apps_processes_are_those_under_its_pdserve_serve_when_given(monkeypatch):
    """With ``root`` only that process and those under it count: a second app on the same host is left out
    (stand-in processes; without ``root`` every process of the host whose command line names a part)."""
    import psutil

    raylet = _Proc(2, "/venv/ray/core/src/ray/raylet/raylet --x", [_Proc(5, "ray::ServeReplica:pdserve:decode")])
    mine = _Proc(1, "/venv/bin/python3 .venv/bin/pdserve serve", [
        raylet, _Proc(3, "/venv/bin/python3 -m pdserve.engine.forkserver /tmp/s",
                      [_Proc(4, "/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m")]),
        _Proc(6, "/usr/bin/bash -c true")])
    other = _Proc(9, "/venv/bin/python3 .venv/bin/pdserve serve --port 8001",
                  [_Proc(10, "/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m")])
    procs = {1: mine, 9: other}

    def process(pid: int) -> _Proc:
        if pid not in procs:
            raise psutil.NoSuchProcess(pid)
        return procs[pid]

    monkeypatch.setattr(psutil, "Process", process)
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: [mine, *mine.children(True), other, *other.kids])
    assert sorted(p.pid for p, _ in footprint._app_processes(root=1)) == [1, 2, 3, 4, 5]
    assert dict((p.pid, part) for p, part in footprint._app_processes(root=9)) == {
        9: "pdserve serve (driver)", 10: "engine API server"}
    assert sorted(p.pid for p, _ in footprint._app_processes()) == [1, 2, 3, 4, 5, 9, 10]
    assert list(footprint._app_processes(root=77)) == []  # gone
