"""The app's footprint on its host, by part: processes told apart by command line."""

from __future__ import annotations

import pytest

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
