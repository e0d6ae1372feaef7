"""The NIXL checks: which backends load, and which transport a KV pull between two engines really uses.

The silent fall back to TCP is the most reported P/D problem: everything works, only slower, and no log
says so. So the doctor does not guess from configuration; it runs a real READ between two processes
(:mod:`pdserve.doctor.loopback`) under the environment pdserve gives its engines on this host and reads
UCX's own account of the transport that carried the bytes (:mod:`pdserve.doctor.ucx_log`).

Two paths are tried, because they answer two questions:

- *same host*: the engines' own ``UCX_TLS`` (CPU engines: ``tcp,self,sm``). Two engines on one node
  should move KV through shared memory (``cma``/``posix``/``sysv``/``xpmem``) or, on GPUs, ``cuda_ipc``.
- *network path*: the same setting minus the intra-node transports, so UCX must pick what it would
  use between two nodes: ``tcp``, ``rc``/``ud`` (InfiniBand/RoCE verbs) or ``srd`` (AWS EFA). A loopback
  over a NIC is the closest one host can come to two nodes.

On a GPU host both are repeated with GPU memory (VRAM).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from pdserve.doctor import probes, ucx_log
from pdserve.doctor.checks import DoctorContext
from pdserve.doctor.loopback import DESCRIPTORS
from pdserve.doctor.result import CheckResult

#: Transfer size: about 700 tokens of SmolLM2's KV cache; large enough for a bandwidth figure.
PROBE_BYTES = 16 << 20
PROBE_ITERS = 5
PROBE_TIMEOUT_S = 60.0
#: UCX transport names (and aliases) that only reach processes on the same node.
INTRA_NODE_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "mm", "cuda_ipc", "rocm_ipc"}
_SHM_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "mm"}
#: Passed from the engine environment to the probe (the rest of the engine env is about vLLM).
_TRANSPORT_ENV = ("UCX_", "FI_", "NIXL_")


def network_tls(tls: str | None) -> str | None:
    """``UCX_TLS`` without intra-node transports; ``None`` when nothing able to cross nodes is left."""
    if not tls or tls.strip() == "all":
        return "^sm,cuda_ipc"
    if tls.startswith("^"):
        return tls + ",sm,cuda_ipc"
    kept = [t.strip() for t in tls.split(",") if t.strip() and t.strip() not in INTRA_NODE_TLS]
    return ",".join(kept) if any(t != "self" for t in kept) else None


def allows_shm(tls: str | None) -> bool:
    if not tls or tls.strip() == "all":
        return True
    names = {t.strip() for t in tls.lstrip("^").split(",")}
    return not (names & _SHM_TLS) if tls.startswith("^") else bool(names & _SHM_TLS)


def probe_env(ctx: DoctorContext) -> tuple[dict[str, str], str | None]:
    """The loopback's environment (this one + the engines' transport settings + UCX diagnostics) and its UCX_TLS."""
    env = dict(os.environ)
    env.update({k: v for k, v in ctx.engine_env().items() if k.startswith(_TRANSPORT_ENV)})
    env["UCX_PROTO_INFO"] = "y"
    if env.get("UCX_LOG_LEVEL", "").lower() not in ("info", "debug", "trace", "trace_req", "trace_data"):
        env["UCX_LOG_LEVEL"] = "info"
    env.pop("UCX_LOG_FILE", None)  # the tables must reach the loopback's output
    return env, env.get("UCX_TLS")


def probe_spec(ctx: DoctorContext, tls: str | None) -> dict[str, Any]:
    mems = ["DRAM"] + (["VRAM"] if ctx.gpus else [])
    paths: list[dict[str, Any]] = []
    if ctx.args.nixl.backend == "LIBFABRIC":
        env = {} if os.environ.get("FI_LOG_LEVEL") else {"FI_LOG_LEVEL": "info"}
        paths += [{"name": f"libfabric-{m.lower()}", "backend": "LIBFABRIC", "mem": m, "env": env} for m in mems]
    else:
        net = network_tls(tls)
        for m in mems:
            paths.append({"name": f"same-host-{m.lower()}", "backend": "UCX", "mem": m, "env": {}})
            if net is not None:
                paths.append({"name": f"network-{m.lower()}", "backend": "UCX", "mem": m, "env": {"UCX_TLS": net}})
    return {"bytes": PROBE_BYTES, "iters": PROBE_ITERS, "paths": paths}


def check_nixl(ctx: DoctorContext) -> Iterable[CheckResult]:
    if probes.distribution_version("nixl") is None:
        yield CheckResult("nixl: backends", "fail", "nixl is not installed", "pip install -c constraints.txt nixl")
        return
    if not ctx.run_transfer:
        yield CheckResult("nixl: transfer", "skip", "skipped (--no-transfer)")
        return
    env, tls = probe_env(ctx)
    spec = probe_spec(ctx, tls)
    run = probes.run_loopback(spec, env, PROBE_TIMEOUT_S)
    yield from interpret(ctx, spec, run, tls)


def interpret(ctx: DoctorContext, spec: dict[str, Any], run: dict[str, Any], tls: str | None) -> Iterable[CheckResult]:
    """Rows from one loopback run (separate from running it, so tests feed recorded runs)."""
    result, log = run.get("result"), run.get("log", "")
    diag = ucx_log.parse(log)
    if result is None or (result.get("error") and not result.get("plugins")):
        why = (result or {}).get("error") or ("timed out" if run.get("timed_out") else f"exit {run.get('returncode')}")
        yield CheckResult("nixl: backends", "fail", f"the NIXL probe failed: {why}",
                          "check that `python -c 'import nixl'` works (nixl and nixl-cu12 installed)",
                          {"log_tail": log[-3000:]})
        return
    yield _plugins_row(ctx, result, diag)
    backend = ctx.args.nixl.backend
    if not result.get("plugins", {}).get(backend, {}).get("loadable"):
        return
    rdma = probes.rdma_devices()
    done = {p["name"]: p for p in result.get("paths", [])}
    for path in spec["paths"]:
        row = done.get(path["name"])
        label = _label(path)
        if row is None:
            why = result.get("error") or ("timed out" if run.get("timed_out") else "did not run")
            yield CheckResult(label, "fail", f"no result: {why}",
                              "a transfer that never completes is the 'decode hangs waiting for KV' symptom: "
                              "check UCX_TLS / UCX_NET_DEVICES and firewalls between engines",
                              {"log_tail": log[-3000:]})
            continue
        if path["backend"] == "LIBFABRIC":
            yield _libfabric_row(label, row, log)
        else:
            yield _ucx_row(label, path, row, diag, tls, rdma, unreachable="Destination is unreachable" in log)


def _label(path: dict[str, Any]) -> str:
    where = "same host" if path["name"].startswith("same-host") else \
        "network path" if path["name"].startswith("network") else "libfabric"
    return f"nixl: {where} ({path['mem']})"


def _plugins_row(ctx: DoctorContext, result: dict[str, Any], diag: ucx_log.UcxDiagnostics) -> CheckResult:
    plugins = result.get("plugins", {})
    usable = sorted(p for p, v in plugins.items() if v.get("loadable"))
    missing = sorted(p for p, v in plugins.items() if not v.get("loadable"))
    detail = f"usable: {', '.join(usable) or 'none'}"
    if missing:
        detail += f"; present but not loadable (missing libraries): {', '.join(missing)}"
    detail += f" [{result.get('nixl_module') or 'nixl'}" + (f", UCX {diag.version}]" if diag.version else "]")
    data = {"plugins": plugins, "nixl_module": result.get("nixl_module"), "ucx_version": diag.version}
    backend = ctx.args.nixl.backend
    if backend not in usable:
        fix = ("install libfabric with the EFA provider in the image (aws-efa-installer), or set nixl.backend: UCX"
               if backend == "LIBFABRIC" else "reinstall nixl: pip install -c constraints.txt --force-reinstall nixl")
        return CheckResult("nixl: backends", "fail", f"nixl.backend {backend} cannot load; {detail}", fix, data)
    return CheckResult("nixl: backends", "ok", detail, data=data)


def _speed(row: dict[str, Any]) -> str:
    return f"{row['gbs']:.2f} GB/s ({row['bytes'] >> 20} MiB READ in {row['ms']:.1f} ms, median of {PROBE_ITERS})"


def _ucx_row(label: str, path: dict[str, Any], row: dict[str, Any], diag: ucx_log.UcxDiagnostics,
             tls: str | None, rdma: list[dict[str, str]], *, unreachable: bool = False) -> CheckResult:
    mem = "cuda" if path["mem"] == "VRAM" else "host"
    transports, source = diag.data_path(row["agent"], mem=mem, size=row["bytes"] // DESCRIPTORS)
    kinds = list(dict.fromkeys(ucx_log.transport_kind(t) for t in transports))
    path_tls = path["env"].get("UCX_TLS", tls)
    data = {"transports": transports, "kinds": kinds, "source": source, "UCX_TLS": path_tls,
            "control": diag.control_path(row["agent"]),
            **{k: row.get(k) for k in ("gbs", "best_gbs", "ms", "bytes", "data_ok", "first_ms", "error")}}
    same_host = path["name"].startswith("same-host")
    if not row.get("ok"):
        err = row.get("error", "failed")
        fix = (f"UCX found no transport that reaches the other engine under UCX_TLS={path_tls}: allow tcp (and sm "
               "on one host) in nixl.ucx_tls" if unreachable else
               "check UCX_TLS / UCX_NET_DEVICES and firewalls between engines; rerun with UCX_LOG_LEVEL=debug")
        return CheckResult(label, "fail", f"transfer failed: {err}", fix, data)
    if not transports:
        return CheckResult(label, "warn", f"transfer ok, {_speed(row)}, but UCX did not say which transport",
                           "rerun with UCX_LOG_LEVEL=info UCX_PROTO_INFO=y to see it", data)
    what = f"{' + '.join(kinds)} ({', '.join(transports)}), {_speed(row)}, bytes verified"
    if same_host:
        if "tcp" not in kinds:
            return CheckResult(label, "ok", what, data=data)
        if not allows_shm(path_tls):
            fix = f"UCX_TLS={path_tls} excludes shared memory: add sm (nixl.ucx_tls: tcp,self,sm)"
        else:
            fix = ("UCX could not use shared memory between the two processes: CMA needs ptrace permission "
                   "(same user, kernel.yama.ptrace_scope <= 1; in a container CAP_SYS_PTRACE or privileged) "
                   "and posix/sysv need a large enough /dev/shm")
        return CheckResult(label, "warn", what + ": engines on this host move KV over TCP", fix, data)
    # Network path: TCP is right only when nothing better exists.
    if "tcp" in kinds and rdma:
        devs = ", ".join(f"{d['name']} ({d['driver'] or '?'})" for d in rdma)
        fix = (f"UCX_TLS={path_tls} keeps UCX off RDMA: set nixl.ucx_tls to allow it (rc,ud,sm,self,cuda_copy,"
               "cuda_ipc,tcp), " if path_tls and not path_tls.startswith("^") else "") + \
            ("check the pod is privileged with vpc.amazonaws.com/efa, /dev/infiniband is present and memlock is "
             "unlimited; on EFA prefer nixl.backend: LIBFABRIC")
        return CheckResult(label, "warn", f"{what}: KV between nodes would go over TCP although RDMA devices "
                                          f"exist ({devs})", fix, data)
    if "tcp" in kinds:
        return CheckResult(label, "ok", f"{what} (no RDMA/EFA device here: between nodes KV moves over TCP)",
                           data=data)
    return CheckResult(label, "ok", what, data=data)


def _libfabric_row(label: str, row: dict[str, Any], log: str) -> CheckResult:
    # libfabric's log lines: "libfabric:<pid>:<time>:<provider>:<subsystem>:<function>():<line><message>".
    seen = [m for m in re.findall(r"^libfabric:\d+:\d+:([a-z0-9_;]+):", log, re.MULTILINE) if m not in ("core",)]
    providers = sorted(set(seen))
    data = {"providers_in_log": providers,
            **{k: row.get(k) for k in ("gbs", "ms", "bytes", "data_ok", "error")}}
    if not row.get("ok"):
        return CheckResult(label, "fail", f"transfer failed: {row.get('error')}",
                           "check the EFA device, FI_PROVIDER and that the pod is privileged", data)
    what = f"{_speed(row)}, bytes verified; providers in libfabric's log: {', '.join(providers) or 'none'}"
    if any("efa" in p for p in providers):
        return CheckResult(label, "ok", what, data=data)
    if any(p.startswith(("tcp", "sockets")) for p in providers):
        return CheckResult(label, "warn", what + ": libfabric fell back to TCP",
                           "EFA not usable: see the efa row; FI_PROVIDER=efa makes this an error instead", data)
    return CheckResult(label, "ok", what, data=data)
