"""Standalone NIXL DRAM->DRAM bandwidth benchmark (two agents, two processes).

Usage:
  UCX_TLS=... python nixl_bench.py [--sizes-mb 16,64] [--ndesc 1] [--op READ,WRITE]
                                   [--threads 0] [--prog 1] [--iters 20]
                                   [--target-idle] [--pin-init 0 --pin-target 1]

The target process registers a buffer and then sleeps (it makes no NIXL calls
at all: like an idle vLLM prefill engine), so a READ that needs the target's
UCX worker to progress depends on the target's NIXL progress thread.
Prints one JSON line per (op, size) with GB/s (median and best) and the
single-thread numpy memcpy bandwidth for the same size.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np


def make_agent(name, threads, prog):
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(
        enable_prog_thread=bool(prog), num_threads=threads, backends=["UCX"]
    )
    return nixl_agent(name, cfg)


def target_main(conn, total_bytes, threads, prog, pin, progress_s):
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    agent = make_agent("target", threads, prog)
    buf = np.ones(total_bytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, total_bytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    # Add initiator metadata so notifications / WRITE-backs work both ways.
    meta = conn.recv()
    agent.add_remote_agent(meta)
    # Optionally make progress (poll notifications) for progress_s seconds,
    # like an engine that is still stepping, then go idle: no NIXL calls
    # until told to stop (like an idle vLLM engine).
    t_end = time.time() + progress_s
    while time.time() < t_end:
        agent.get_new_notifs()
        time.sleep(0.001)
    while not conn.poll(0.5):
        pass
    conn.recv()
    # check data the initiator wrote (WRITE test writes 2s)
    conn.send(int(buf[: min(total_bytes, 1 << 20)].sum()))


def run_initiator(args, sizes, ops):
    maxb = max(sizes)
    parent, child = mp.Pipe()
    p = mp.get_context("spawn").Process(
        target=target_main,
        args=(child, maxb, args.threads, args.prog, args.pin_target, args.target_progress_s),
    )
    p.start()
    if args.pin_init is not None:
        os.sched_setaffinity(0, {args.pin_init})
    agent = make_agent("initiator", args.threads, args.prog)
    local = np.zeros(maxb, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, maxb, 0, "")], "DRAM")
    tmeta, taddr = parent.recv()
    rname = agent.add_remote_agent(tmeta)
    parent.send(agent.get_agent_metadata())
    results = []
    if args.warmup_then_idle:
        # one transfer while the target still progresses, then wait until it is idle
        size = sizes[0]
        lx = agent.get_xfer_descs([(local.ctypes.data, size, 0)], "DRAM")
        rx = agent.get_xfer_descs([(taddr, size, 0)], "DRAM")
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", lx, rx, rname, b"warm")
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        print(f"# warm-up READ while target progresses: {st} in {time.perf_counter()-t0:.4f}s", flush=True)
        agent.release_xfer_handle(h)
        time.sleep(args.target_progress_s + 1)
    for size in sizes:
        chunk = size // args.ndesc
        ldescs = [(local.ctypes.data + i * chunk, chunk, 0) for i in range(args.ndesc)]
        rdescs = [(taddr + i * chunk, chunk, 0) for i in range(args.ndesc)]
        lx = agent.get_xfer_descs(ldescs, "DRAM")
        rx = agent.get_xfer_descs(rdescs, "DRAM")
        # memcpy baseline (single thread numpy)
        src = np.ones(size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        mt = []
        for _ in range(max(5, args.iters // 2)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            mt.append(time.perf_counter() - t0)
        mt.sort()
        memcpy_gbs = size / mt[len(mt) // 2] / 1e9
        for op in ops:
            if op == "WRITE":
                local[:size] = 2
            h = agent.initialize_xfer(op, lx, rx, rname, args.notif.encode())
            times = []
            first = None
            for it in range(args.iters + 1):
                t0 = time.perf_counter()
                st = agent.transfer(h)
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                dt = time.perf_counter() - t0
                if st != "DONE":
                    raise RuntimeError(f"transfer state {st}")
                if it == 0:
                    first = dt
                else:
                    times.append(dt)
                if dt > 5:
                    print(f"# slow iteration {dt:.2f}s", file=sys.stderr)
            agent.release_xfer_handle(h)
            times.sort()
            med = times[len(times) // 2]
            ok = None
            if op == "READ":
                ok = bool((local[:size] != 0).all())
                local[:size] = 0
            results.append(
                dict(
                    ucx_tls=os.environ.get("UCX_TLS", "default"),
                    threads=args.threads,
                    prog=args.prog,
                    op=op,
                    mb=size >> 20,
                    ndesc=args.ndesc,
                    first_s=round(first, 4),
                    med_ms=round(med * 1e3, 3),
                    gbs_med=round(size / med / 1e9, 2),
                    gbs_best=round(size / times[0] / 1e9, 2),
                    memcpy_gbs=round(memcpy_gbs, 2),
                    pct_memcpy=round(100 * size / med / 1e9 / memcpy_gbs, 1),
                    data_ok=ok,
                )
            )
            print(json.dumps(results[-1]), flush=True)
    parent.send("stop")
    s = parent.recv()
    p.join(10)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="16,64")
    ap.add_argument("--ndesc", type=int, default=1)
    ap.add_argument("--op", default="READ,WRITE")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prog", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--notif", default="bench", help="notification message; empty = none")
    ap.add_argument("--target-progress-s", type=float, default=0.0)
    ap.add_argument("--warmup-then-idle", action="store_true")
    ap.add_argument("--pin-init", type=int, default=None)
    ap.add_argument("--pin-target", type=int, default=None)
    args = ap.parse_args()
    sizes = [int(s) << 20 for s in args.sizes_mb.split(",")]
    run_initiator(args, sizes, args.op.split(","))


if __name__ == "__main__":
    main()
