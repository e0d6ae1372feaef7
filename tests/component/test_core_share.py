"""Prefill and decode engines sharing a core (engine/core_share.py) with real processes: the prefill engine's
whole tree (every thread, children included) goes behind, whichever of the two replicas starts first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from pdserve.engine.allocator import Claim, claim_cores
from pdserve.engine.core_share import renice_tree, settle

#: A stand-in engine: a thread besides its main one, and a child process (as vLLM's engine core is).
ENGINE = ("import subprocess, sys, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")


@pytest.fixture
def engines():
    started: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        p = subprocess.Popen([sys.executable, "-c", ENGINE], start_new_session=True)
        started.append(p)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # its thread and its child are up
            proc = psutil.Process(p.pid)
            if proc.num_threads() >= 2 and proc.children():
                return p.pid
            time.sleep(0.05)
        raise AssertionError("the stand-in engine did not start")

    yield start
    for p in started:
        os.killpg(p.pid, 9)
        p.wait()


def nices(pid: int) -> set[int]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {os.getpriority(os.PRIO_PROCESS, t.id) for p in procs for t in p.threads()}


def test_renice_tree_reaches_every_thread_and_child(engines):
    pid = engines()
    assert nices(pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert renice_tree(pid, 7) >= 3  # main thread, its other thread, the child
    assert nices(pid) == {7}
    assert renice_tree(pid, 3) == 0 and nices(pid) == {7}  # only ever up


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_the_prefill_engine_beside_a_decode_engine_goes_behind(tmp_path, monkeypatch, engines, first):
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    roles = [first, "decode" if first == "prefill" else "prefill"]
    claims = {r: Claim() for r in roles}
    for r in roles:  # two replicas on one core
        assert claim_cores(claims[r], 1, [0], r) == [0]
    pids = {r: engines() for r in roles}
    for r in roles:  # each notes its engine once it is running; the later one sees the other
        settle(claims[r], r, pids[r], 10, f"{r} engine")
    assert nices(pids["prefill"]) == {max(base, 10)}
    assert nices(pids["decode"]) == {base}  # the decode engine is never put behind
    # cpu.shared_core_nice: 0 leaves a third engine of either role level with the rest.
    third = Claim()
    assert claim_cores(third, 1, [0], "prefill") == [0]
    pid = engines()
    assert settle(third, "prefill", pid, 0, "prefill engine") == [] and nices(pid) == {base}
    for c in [*claims.values(), third]:
        c.release()


def test_engines_alone_on_their_cores_stay_level(tmp_path, monkeypatch, engines):
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    p, d = Claim(), Claim()
    assert claim_cores(p, 1, [0, 1], "prefill") == [0]
    assert claim_cores(d, 1, [1, 0], "decode") == [1]
    pp, dp = engines(), engines()
    assert settle(p, "prefill", pp, 10, "prefill engine") == []
    assert settle(d, "decode", dp, 10, "decode engine") == []
    assert nices(pp) == nices(dp) == {base}
    # Two engines of one role sharing a core: neither goes behind the other.
    p2 = Claim()
    assert claim_cores(p2, 1, [0, 1], "prefill") == [1]  # the core without a prefill engine
    p3 = Claim()
    assert claim_cores(p3, 1, [0, 1], "prefill") == [0]
    assert settle(p3, "prefill", engines(), 10, "prefill engine") == []
    for c in (p, d, p2, p3):
        c.release()
