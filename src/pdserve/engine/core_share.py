"""Engines of both roles on one core: the decode engine goes first.

On a host with more engines than cores (two prefill and two decode replicas on a 2-core laptop), the
allocator puts one engine of each role on a core (engine/allocator.py). Left equal, the two split the core
while both have work, and every stream on the decode engine waits through each slice the prefill engine
takes: with four engines on two cores, decode's time per output token went from ~88 ms (one engine a core)
to 130 ms, past any SLO an idle engine sets. A prompt waits for its first token only; a stream waits on every
step. So the prefill engine sharing a core with a decode engine runs at niceness ``cpu.shared_core_nice``:
the kernel gives the decode engine's steps the core whenever they want it, and the prefill engine the rest
(all of it while decode is idle).

Which of the two replicas sees the other depends on the order they start in, so both look once their engine
is running (:func:`settle`): the later of the two finds the other's claim under the host's claiming lock
and puts the prefill engine behind, whichever it is. Niceness only goes up (an unprivileged process cannot
lower it): a prefill engine stays behind after the decode engine beside it is gone.
"""

from __future__ import annotations

import logging
import os

from pdserve.engine.allocator import Claim, note_engine

log = logging.getLogger(__name__)


def renice_tree(pid: int, nice: int) -> int:
    """Raise every thread of ``pid`` and of all its descendants to niceness ``nice`` (niceness is a thread's
    on Linux; threads and processes started later inherit it). Returns the threads changed."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    changed = 0
    for proc in procs:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    changed += 1
            except OSError:  # (the thread ended, or not ours to change)
                continue
    return changed


def settle(claim: Claim, role: str, engine_pid: int, nice: int, name: str) -> list[int]:
    """This replica's engine is running as ``engine_pid``: note it in its core claims and, where a decode
    engine and a prefill engine share a core, put the prefill engine behind (niceness ``nice``; 0: not).
    Returns the pids of the prefill engines it put behind."""
    others = note_engine(claim, role, engine_pid)
    if nice <= 0 or not claim.cores:
        return []
    if role == "prefill":
        behind = [engine_pid] if any(r == "decode" for r, _ in others) else []
    else:
        behind = [pid for r, pid in others if r == "prefill" and pid is not None]
    for pid in behind:
        if renice_tree(pid, nice):
            log.info("%s: the prefill engine (pid %d) on cores %s shares them with a decode engine: it runs at "
                     "niceness %d (cpu.shared_core_nice)", name, pid, claim.cores, nice)
    return behind
