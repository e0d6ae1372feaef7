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
