"""A real NIXL transfer between two processes, the way a decode engine pulls KV blocks from a prefill engine.

Run as ``python -m pdserve.doctor.loopback SPEC_JSON RESULT_PATH`` (see :func:`pdserve.doctor.probes.run_loopback`).
This process (the *reader*, like decode) spawns a *holder* process (like prefill) that registers a
buffer and then only answers commands; the reader READs the buffer over NIXL and checks every byte.

Each entry of ``spec["paths"]`` is one agent pair with its own environment (UCX reads ``UCX_TLS`` when
an agent's backend is created, so one pair of processes can try several settings one after the other).
UCX's diagnostics (``UCX_PROTO_INFO``, ``UCX_LOG_LEVEL=info``) go to this program's output, where
:mod:`pdserve.doctor.ucx_log` reads which transport each agent pair used; the agents are named after
their path so their tables can be told apart.

Writes the result JSON after every step, so a hang still leaves what was learnt before it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

#: Descriptors per transfer: vLLM moves one per layer and K/V, so a pull is many medium-sized pieces.
DESCRIPTORS = 32
#: Longest wait for one transfer; a KV pull that takes longer is as good as hung.
TRANSFER_DEADLINE_S = 10.0


def agent_name(path: str, side: str) -> str:
    # UCX names its context after the agent but keeps only 31 characters; the name must survive that.
    return f"doctor-{path}-{side}"


def _quiet_nixl() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("nixl"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _apply_env(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _make_agent(name: str, backend: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl()
    return nixl_agent(name, nixl_agent_config(backends=[backend]))


def _alloc(mem: str, nbytes: int, fill: bool) -> tuple[Any, int, int]:
    """A buffer in host (DRAM) or GPU (VRAM) memory: (object, address, device id)."""
    if mem == "VRAM":
        import torch

        buf = (torch.arange(nbytes, dtype=torch.int64, device="cuda") % 251).to(torch.uint8) if fill else \
            torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        return buf, int(buf.data_ptr()), int(buf.device.index or 0)
    import numpy as np

    buf = np.resize(np.arange(251, dtype=np.uint8), nbytes) if fill else np.zeros(nbytes, dtype=np.uint8)
    return buf, int(buf.ctypes.data), 0


def _holder(conn: Any) -> None:
    """The prefill side: for each path, an agent with a registered, filled buffer; then idle."""
    held: dict[str, tuple[Any, Any]] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        try:
            if kind == "open":
                _, path, backend, env, mem, nbytes = msg
                saved = {k: os.environ.get(k) for k in env}
                _apply_env(env)
                try:
                    agent = _make_agent(agent_name(path, "holder"), backend)
                finally:
                    _apply_env(saved)
                buf, addr, dev = _alloc(mem, nbytes, fill=True)
                agent.register_memory([(addr, nbytes, dev, "")], mem)
                held[path] = (agent, buf)
                conn.send(("ok", agent.get_agent_metadata(), addr, dev))
            elif kind == "peer":
                _, path, meta = msg
                held[path][0].add_remote_agent(meta)
                conn.send(("ok",))
            elif kind == "exit":
                conn.send(("ok",))
                return
        except Exception as e:  # noqa: BLE001 - reported to the reader, which reports it to the doctor
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _ask(conn: Any, msg: tuple[Any, ...], timeout: float = 30.0) -> tuple[Any, ...]:
    conn.send(msg)
    if not conn.poll(timeout):
        raise TimeoutError(f"the holder process did not answer {msg[0]!r} within {timeout:.0f} s")
    reply = conn.recv()
    if reply[0] == "error":
        raise RuntimeError(f"holder: {reply[1]}")
    return tuple(reply)


def _wait(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + TRANSFER_DEADLINE_S
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer still in progress after {TRANSFER_DEADLINE_S:.0f} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended in state {state}")


def _run_path(conn: Any, path: dict[str, Any], nbytes: int, iters: int) -> dict[str, Any]:
    name, mem, env = path["name"], path.get("mem", "DRAM"), path.get("env", {})
    backend = path.get("backend", "UCX")
    row: dict[str, Any] = {"name": name, "mem": mem, "bytes": nbytes, "env": env, "backend": backend,
                           "agent": agent_name(name, "reader"), "ok": False}
    t0 = time.perf_counter()
    saved = {k: os.environ.get(k) for k in env}
    _apply_env(env)
    try:
        _, meta, raddr, rdev = _ask(conn, ("open", name, backend, env, mem, nbytes))
        agent = _make_agent(row["agent"], backend)
        local, laddr, ldev = _alloc(mem, nbytes, fill=False)
        agent.register_memory([(laddr, nbytes, ldev, "")], mem)
        peer = agent.add_remote_agent(meta)
        _ask(conn, ("peer", name, agent.get_agent_metadata()))
        chunk = nbytes // DESCRIPTORS
        lx = agent.get_xfer_descs([(laddr + i * chunk, chunk, ldev) for i in range(DESCRIPTORS)], mem)
        rx = agent.get_xfer_descs([(raddr + i * chunk, chunk, rdev) for i in range(DESCRIPTORS)], mem)
        handle = agent.initialize_xfer("READ", lx, rx, peer, b"")
        row["setup_ms"] = 1000 * (time.perf_counter() - t0)
        # The first transfer connects and picks protocols (that is when UCX prints its tables).
        t1 = time.perf_counter()
        _wait(agent, handle)
        row["first_ms"] = 1000 * (time.perf_counter() - t1)
        times = []
        for _ in range(iters):
            t1 = time.perf_counter()
            _wait(agent, handle)
            times.append(time.perf_counter() - t1)
        row["backend"] = agent.query_xfer_backend(handle)
        agent.release_xfer_handle(handle)
        moved = chunk * DESCRIPTORS
        if mem == "VRAM":
            import torch

            expect = (torch.arange(moved, dtype=torch.int64, device="cuda") % 251).to(torch.uint8)
            row["data_ok"] = bool(torch.equal(local[:moved], expect))
        else:
            import numpy as np

            row["data_ok"] = bool(np.array_equal(local[:moved], np.resize(np.arange(251, dtype=np.uint8), moved)))
        med = sorted(times)[len(times) // 2]
        row.update(ms=1000 * med, gbs=moved / med / 1e9, best_gbs=moved / min(times) / 1e9,
                   ok=row["data_ok"])
        if not row["data_ok"]:
            row["error"] = "the bytes read differ from the bytes held (corrupt transfer)"
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        _apply_env(saved)
    return row


def main(spec: dict[str, Any], out: Path) -> int:
    t0 = time.perf_counter()
    result: dict[str, Any] = {"paths": [], "plugins": {}}

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(result))

    try:
        if any(p.get("mem") == "VRAM" for p in spec["paths"]):
            import torch  # noqa: F401 - lets nixl pick the build matching torch's CUDA

        import nixl
        from nixl._api import nixl_agent, nixl_agent_config

        result["nixl_module"] = getattr(getattr(nixl, "_pkg", None), "__name__", None)
        _quiet_nixl()
        lister = nixl_agent("pdserve-doctor-plugins", nixl_agent_config(backends=[]))
        for plugin in lister.get_plugin_list():
            mems = list(lister.get_plugin_mem_types(plugin))
            # A plugin whose library is present but whose dependencies are not (libfabric, cuFile)
            # lists no memory types: it cannot be instantiated.
            result["plugins"][plugin] = {"loadable": bool(mems), "mem_types": mems}
    except Exception as e:  # noqa: BLE001
        result["error"] = f"NIXL unusable: {type(e).__name__}: {e}"
        save()
        return 1
    save()
    parent, child = mp.Pipe()
    holder = mp.get_context("spawn").Process(target=_holder, args=(child,), daemon=True)
    holder.start()
    try:
        for path in spec["paths"]:
            result["paths"].append(_run_path(parent, path, int(spec["bytes"]), int(spec["iters"])))
            save()
        _ask(parent, ("exit",), timeout=5)
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        holder.join(5)
        if holder.is_alive():
            holder.kill()
        save()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1]), Path(sys.argv[2])))
