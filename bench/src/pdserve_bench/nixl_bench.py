"""NIXL transfer bandwidth between two processes on this host: DRAM→DRAM (CPU engines) against a
single-thread memcpy, or VRAM→VRAM on one GPU (``memory=VRAM``, GPU engines on one node) against the GPU's own
device-to-device copy.

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
#: GPU KV moves in larger pieces (a 7-8B model's KV is ~128 KiB per token): up to 1 GiB.
VRAM_SIZES_MB = (4, 16, 64, 256, 1024)
MEMORY = ("DRAM", "VRAM")


def _sizes(memory: str) -> tuple[int, ...]:
    return VRAM_SIZES_MB if memory == "VRAM" else SIZES_MB


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


class _Buffer:
    """``nbytes`` of host memory (numpy) or of GPU 0's memory (torch), filled with ``fill``; ``dev`` is the
    device id NIXL's descriptors name (0 for host memory too)."""

    dev = 0

    def __init__(self, memory: str, nbytes: int, fill: int) -> None:
        if memory == "VRAM":
            import torch

            self.data = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda:0")
            self.addr = self.data.data_ptr()
        else:
            import numpy as np

            self.data = np.full(nbytes, fill, dtype=np.uint8)
            self.addr = self.data.ctypes.data

    def all_equal(self, upto: int, value: int) -> bool:
        return bool((self.data[:upto] == value).all())

    def zero(self) -> None:
        self.data[:] = 0


def _holder(conn: Any, nbytes: int, memory: str = "DRAM") -> None:
    agent = _agent("holder")
    buf = _Buffer(memory, nbytes, 1)
    agent.register_memory([(buf.addr, nbytes, buf.dev, "")], memory)
    conn.send((agent.get_agent_metadata(), buf.addr))
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


def _device_copy_gbs(nbytes: int) -> float:
    """GPU 0's own device-to-device copy of ``nbytes`` (median of 15, CUDA events)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def _reader(iters: int, memory: str = "DRAM") -> list[dict[str, Any]]:
    sizes = _sizes(memory)
    top = max(sizes) << 20
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_holder, args=(child, top, memory))
    proc.start()
    agent = _agent("reader")
    local = _Buffer(memory, top, 0)
    agent.register_memory([(local.addr, top, local.dev, "")], memory)
    meta, addr = parent.recv()
    peer = agent.add_remote_agent(meta)
    parent.send(agent.get_agent_metadata())
    rows = []
    try:
        for mb in sizes:
            n = mb << 20
            # vLLM moves one descriptor per layer and K/V: 60 for SmolLM2; the same shape here.
            ndesc = 60
            chunk = n // ndesc
            lx = agent.get_xfer_descs([(local.addr + i * chunk, chunk, local.dev) for i in range(ndesc)], memory)
            rx = agent.get_xfer_descs([(addr + i * chunk, chunk, local.dev) for i in range(ndesc)], memory)
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
            ok = local.all_equal(chunk * ndesc, 1)
            local.zero()
            med = sorted(times)[len(times) // 2]
            gbs = chunk * ndesc / med / 1e9
            # Measured right after the transfer, in the same process: both see the same machine state.
            copy = _device_copy_gbs(n) if memory == "VRAM" else _memcpy_gbs(n)
            rows.append({"mb": mb, "ms": 1000 * med, "gbs": gbs, "best_gbs": chunk * ndesc / min(times) / 1e9,
                         "memcpy_gbs": copy, "pct_of_memcpy": 100 * gbs / copy, "data_ok": ok})
    finally:
        parent.send("done")
        proc.join(10)
    return rows


def measure_kv_transfer(settings: dict[str, dict[str, str]] | None = None, iters: int = 10,
                        plan: Any = None, memory: str = "DRAM") -> dict[str, Any]:
    """Bandwidth for each UCX setting (name -> environment), each in fresh processes; ``memory`` is DRAM
    (host buffers) or VRAM (buffers on GPU 0, which needs torch with CUDA). With a dry-run ``plan``, returns
    it without starting anything."""
    from pdserve.engine.launcher import CPU_UCX_TLS

    if memory not in MEMORY:
        raise ValueError(f"memory must be one of {', '.join(MEMORY)}, not {memory!r}")
    if settings is None:
        settings = ({"ucx-default": {}, "cuda_ipc": {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}} if memory == "VRAM"
                    else {"ucx-default": {}, "pdserve": {"UCX_TLS": CPU_UCX_TLS}})
    argv = [sys.executable, "-m", "pdserve_bench.nixl_bench", str(iters), memory]
    against = ("GPU 0's device-to-device copy of the same size (CUDA events)" if memory == "VRAM"
               else "single-thread memcpy of the same size, in the reader process")
    if plan is not None:
        plan.set(iters=iters, memory=memory, sizes_mb=list(_sizes(memory)),
                 descriptors_per_transfer=60)
        plan.require("nixl", "torch" if memory == "VRAM" else "numpy")
        for name, env in settings.items():
            plan.system(name, {"kind": "reader + holder processes", "argv": argv, "env": env})
            plan.phase(name, system=name, transfers=f"{iters} READs per size, after one untimed",
                       against=against)
        if plan.dry_run:
            return dict(plan.as_dict())
    out: dict[str, Any] = {"settings": {}, "memory": memory, "against": against,
                           "kv_bytes_per_token_smollm2": 23040}
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
    print(json.dumps(_reader(int(sys.argv[1]) if len(sys.argv) > 1 else 10,
                             sys.argv[2] if len(sys.argv) > 2 else "DRAM")))
