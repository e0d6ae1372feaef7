"""NIXL DRAM→DRAM transfer bandwidth between two processes on this host, vs single-thread memcpy.

The holder process registers a buffer and then makes no NIXL calls (like an idle prefill engine whose
blocks a decode engine pulls); the reader process READs it. Each UCX transport setting runs in fresh
processes (UCX reads its environment once).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any

SIZES_MB = (1, 4, 16, 64)


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _holder(conn: Any, nbytes: int) -> None:
    import numpy as np

    agent = _agent("holder")
    buf = np.ones(nbytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    agent.add_remote_agent(conn.recv())
    conn.recv()  # wait, idle, until the reader is done


def _memcpy_gbs(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault every page in before timing
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def _reader(iters: int) -> list[dict[str, Any]]:
    import numpy as np

    top = max(SIZES_MB) << 20
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_holder, args=(child, top))
    proc.start()
    agent = _agent("reader")
    local = np.zeros(top, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, top, 0, "")], "DRAM")
    meta, addr = parent.recv()
    peer = agent.add_remote_agent(meta)
    parent.send(agent.get_agent_metadata())
    rows = []
    try:
        for mb in SIZES_MB:
            n = mb << 20
            # vLLM moves one descriptor per layer and K/V: 60 for SmolLM2; the same shape here.
            ndesc = 60
            chunk = n // ndesc
            lx = agent.get_xfer_descs([(local.ctypes.data + i * chunk, chunk, 0) for i in range(ndesc)], "DRAM")
            rx = agent.get_xfer_descs([(addr + i * chunk, chunk, 0) for i in range(ndesc)], "DRAM")
            handle = agent.initialize_xfer("READ", lx, rx, peer, b"")
            times = []
            for i in range(iters + 1):
                t0 = time.perf_counter()
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer ended in state {state}")
                if i:
                    times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            ok = bool((local[: chunk * ndesc] == 1).all())
            local[:] = 0
            med = sorted(times)[len(times) // 2]
            gbs = chunk * ndesc / med / 1e9
            # Measured right after the transfer, in the same process: both see the same machine state.
            memcpy = _memcpy_gbs(n)
            rows.append({"mb": mb, "ms": 1000 * med, "gbs": gbs, "best_gbs": chunk * ndesc / min(times) / 1e9,
                         "memcpy_gbs": memcpy, "pct_of_memcpy": 100 * gbs / memcpy, "data_ok": ok})
    finally:
        parent.send("done")
        proc.join(10)
    return rows


def measure_kv_transfer(settings: dict[str, dict[str, str]] | None = None, iters: int = 10,
                        plan: Any = None) -> dict[str, Any]:
    """Bandwidth for each UCX setting (name -> environment), each in fresh processes. With a dry-run
    ``plan``, returns it without starting anything."""
    from pdserve.engine.launcher import CPU_UCX_TLS

    settings = settings or {
        "ucx-default": {},
        "pdserve": {"UCX_TLS": CPU_UCX_TLS},
    }
    argv = [sys.executable, "-m", "pdserve_bench.nixl_bench", str(iters)]
    if plan is not None:
        plan.set(iters=iters, sizes_mb=list(SIZES_MB), descriptors_per_transfer=60)
        plan.require("nixl", "numpy")
        for name, env in settings.items():
            plan.system(name, {"kind": "reader + holder processes", "argv": argv, "env": env})
            plan.phase(name, system=name, transfers=f"{iters} READs per size, after one untimed",
                       against="single-thread memcpy of the same size, in the reader process")
        if plan.dry_run:
            return dict(plan.as_dict())
    out: dict[str, Any] = {"settings": {}, "kv_bytes_per_token_smollm2": 23040}
    for name, env in settings.items():
        e = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        e.update(env)
        r = subprocess.run(argv, env=e, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            out["settings"][name] = {"env": env, "error": r.stderr[-2000:]}
            continue
        out["settings"][name] = {"env": env, "rows": json.loads(r.stdout.strip().splitlines()[-1])}
    return out


if __name__ == "__main__":
    print(json.dumps(_reader(int(sys.argv[1]) if len(sys.argv) > 1 else 10)))
