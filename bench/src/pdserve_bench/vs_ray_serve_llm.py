"""``--scenario vs-ray-serve-llm``: pdserve against Ray Serve LLM's own P/D app, and one colocated engine.

Three systems on the same model, the same vLLM engine arguments and the same cores, started one after the
other (each stopped before the next starts):

* ``ray-serve-llm``: ``ray.serve.llm.build_pd_openai_app`` with one prefill and one decode replica, run by
  a child process (``python -m pdserve_bench.vs_ray_serve_llm --serve-ray-llm CONFIG.json``) that starts a
  Ray instance of its own (``address="local"``, its own temporary directory, ports the kernel picks), runs
  the app on a free port, prints a ready line and blocks. Stopping it: SIGTERM (``serve.shutdown()``,
  ``ray.shutdown()``), then SIGKILL to its process group and to every process of that Ray instance (its
  descendants, and anything whose command line names its temporary directory). No other Ray is touched.
* ``pdserve``: ``pdserve serve`` with the same config (:class:`~pdserve_bench.systems.ServedApp`).
* ``colocated``: one plain vLLM server with pdserve's prefill command line minus the KV connector, on the
  first core: the compute floor of a single request.

The engine arguments are the ones pdserve gives its engines
(:func:`~pdserve.engine.launcher.engine_kwargs_for`: dtype, ``max_model_len``, ``enforce_eager``,
``kv_transfer_config`` with NixlConnector and a CPU buffer, and the config's own ``engine_kwargs``), with
the CPU dtype decided once for all three. Ray Serve LLM runs
without a GPU through its CPU accelerator backend: ``accelerator_config: {kind: cpu}``, no
``accelerator_type``, and ``placement_group_config: {bundle_per_worker: {CPU: 1}}`` (a bundle without GPU),
which makes it run vLLM with the ``mp`` executor. Each engine gets one core through the environment
pdserve's launcher gives its engines (:func:`~pdserve.engine.launcher.engine_env`:
``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``, ``OMP_NUM_THREADS``, UCX transports, NIXL side
channel on loopback, tcmalloc),
passed as the replicas' ``runtime_env.env_vars``; with ``ray_env=pdserve`` (the default) the replicas also
get what pdserve's engine guard does for its engines (every thread on the engine's core, its niceness; a
Ray worker setup hook, :func:`replica_setup`) and pdserve's NIXL poll-delay fix, so that the serving layers
differ and nothing else. ``ray_env=vllm`` keeps only vLLM's, UCX's and the allocator's variables.

Loads, the same prompts on every system (streamed, greedy, ``ignore_eos``): after a warm-up, single
requests (concurrency 1) at each size, then a closed-loop concurrency sweep on the first size (a refused
request, 429, is sent again after its retry-after-ms and its wait counts). Per system and point: TTFT
p50/p90, TPOT p50, end-to-end p50/p90, and the ratios pdserve ÷ colocated, ray-serve-llm ÷ colocated,
ray-serve-llm ÷ pdserve. Ray Serve LLM runs with its own defaults, among them the 50 ms batching of
streamed chunks (``experimental_configs.stream_batching_interval_ms``; ``ray_stream_batching_ms=0`` turns
it off): it adds up to one interval to TTFT and bunches the inter-token gaps; TPOT, counted in tokens
between the first and the last, moves little.

Systems started one after the other meet the host in different moods: on a shared 2-core machine one
engine's speed drifts by tens of percent within minutes, more than the differences measured. So by default
(``paired=1``) the colocated floor is measured inside pdserve's run, on pdserve's own engines asked for
the whole answer (the same processes, arguments and cores; what the ``ttft`` scenario does with the prefill
engine): each point's requests go in rounds, a round to pdserve and a round of other prompts of the same
sizes to one engine alone, the order alternating, so both see the same moments of the host; the engine
alone is the prefill engine and the decode engine in turn, as the two cores of a shared host differ. ``paired=0`` starts the plain engine of
its own after pdserve instead.

``--opt requests=10 --opt sizes=long:600x32,short:16x8 --opt concurrencies=1,2,4 --opt sweep_requests=12
--opt systems=ray-serve-llm,pdserve,colocated --opt ray_env=pdserve --opt ray_stream_batching_ms=50
--opt start_timeout_s=900 --opt paired=1 --opt rounds=4``
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import ENGINE_KEY_ENV, EnginePlacement, engine_env, engine_kwargs_for
from pdserve.engine.vllm_plugin import ENV_FILE as ENV_KV_EVENTS
from pdserve.errors import ConfigError, EngineStartError
from pdserve.settings import ENGINE_CORES_ENV, ENGINE_NICE_ENV
from pdserve_bench.runner import Load, run_load
from pdserve_bench.scrape import add, delta, mean_ms, scrape
from pdserve_bench.stats import summarize
from pdserve_bench.systems import EnginePair, ServedApp, _say, model_path, model_ready
from pdserve_bench.workload import Lengths, PromptFactory, build_requests

SCENARIO = "vs-ray-serve-llm"
SYSTEMS = ("ray-serve-llm", "pdserve", "colocated")
#: Modules Ray Serve LLM imports (``ray[llm]`` lists them, but that extra pins another vLLM and NIXL, so
#: bench/pyproject.toml names them one by one), and vLLM for its engines. Found, not imported.
RAY_LLM_MODULES = ("pyarrow", "pandas", "jsonref", "smart_open", "mmh3", "typer", "fsspec", "colorful", "vllm")
#: The line the Ray Serve LLM child prints on stdout once ``serve.run`` has deployed the app.
READY_PREFIX = "ray-serve-llm ready:"
#: Ray worker setup hook of the Ray Serve LLM replicas with ``ray_env=pdserve``.
SETUP_HOOK = "pdserve_bench.vs_ray_serve_llm.replica_setup"
APP_NAME = "ray-serve-llm"
RAY_ENV_MODES = ("pdserve", "vllm")
#: Requests each system gets per size before it is measured (the first ones pay one-time costs).
WARMUP = 3
ONE = Load("concurrency", 1)
#: (figure, summary key, percentile) reported per point.
METRICS = (("ttft_p50", "ttft_ms", "p50"), ("ttft_p90", "ttft_ms", "p90"), ("tpot_p50", "tpot_ms", "p50"),
           ("e2e_p50", "e2e_ms", "p50"), ("e2e_p90", "e2e_ms", "p90"))
#: (name, numerator system, denominator system).
RATIOS = (("pdserve_over_colocated", "pdserve", "colocated"),
          ("ray_serve_llm_over_colocated", "ray-serve-llm", "colocated"),
          ("ray_serve_llm_over_pdserve", "ray-serve-llm", "pdserve"))


# --- dependencies ------------------------------------------------------------------------------------


def missing_ray_llm_modules() -> list[str]:
    import importlib.util

    return [m for m in RAY_LLM_MODULES if importlib.util.find_spec(m) is None]


def missing_message(missing: list[str]) -> str:
    return (f"--scenario {SCENARIO} runs Ray Serve LLM (ray.serve.llm), which needs modules that are not "
            f"installed: {', '.join(missing)}. Install the benchmarks with their dependencies, from pdserve's "
            "repository: .venv/bin/pip install -c constraints.txt -e bench (or `make setup`).")


def check_ray_llm_modules() -> None:
    """Raises :class:`ConfigError` naming the missing modules and the install command."""
    missing = missing_ray_llm_modules()
    if missing:
        raise ConfigError(missing_message(missing))


# --- the CPU dtype, decided once for the three systems --------------------------------------------------


def _cached_probe(cache_dir: str | None) -> Any:
    """This host's matmul probe when it is cached already (a dry run measures nothing), else None."""
    from pdserve.engine.cpu_host import MatmulProbe, probe_file, probe_key

    path = probe_file(cache_dir)
    try:
        entry = json.loads(path.read_text()).get("probes", {}).get(probe_key())
        return MatmulProbe.from_dict(entry) if isinstance(entry, dict) else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def with_dtype(args: PDServeArgs, *, dry_run: bool) -> tuple[PDServeArgs, str]:
    """``args`` with both roles' ``engine_kwargs.dtype`` decided as ``pdserve serve`` decides it, so the three
    systems compute in the same dtype; a dry run uses a cached probe only (otherwise the dtype stays open)."""
    from pdserve.engine.cpu_dtype import resolve_cpu_dtype

    pinned = args.cpu.dtype != "auto" or "dtype" in args.prefill_config.engine_kwargs
    if pinned or not dry_run:
        return resolve_cpu_dtype(args)
    probe = _cached_probe(args.cache_dir)
    if probe is None:
        return args, "decided at start by cpu.dtype auto (a matmul probe on this host), the same for all three"
    return resolve_cpu_dtype(args, probe=lambda: probe)


# --- Ray Serve LLM's config --------------------------------------------------------------------------


def engine_cores() -> tuple[int, int]:
    """(prefill core, decode core): the host's first two usable cores, as pdserve's engines claim them."""
    from pdserve.engine.allocator import usable_cores

    cores = usable_cores()
    return cores[0], cores[1 % len(cores)]


def check_mode(mode: str) -> None:
    if mode not in RAY_ENV_MODES:
        raise ConfigError(f"ray_env {mode!r}: pdserve (the environment pdserve gives its engines) or vllm "
                          "(vLLM's, UCX's and the allocator's variables only)")


def ray_engine_env(args: PDServeArgs, core: int, side_port: int, mode: str = "pdserve") -> dict[str, str]:
    """The environment of one Ray Serve LLM engine replica: what pdserve's launcher gives its engine on
    ``core`` (:func:`~pdserve.engine.launcher.engine_env`), less what only pdserve's router reads (the
    expired-lease log, its endpoint plugin, the engine key). ``mode="vllm"``: also less pdserve's own engine
    fixes (``PDSERVE_*`` and the ``PYTHONPATH`` of its sitecustomize)."""
    check_mode(mode)
    placement = EnginePlacement(http_port=0, side_channel_port=side_port, side_channel_host="127.0.0.1",
                                engine_id=f"ray-serve-llm-{core}", cores=[core], on_cpu=True)
    env = engine_env(args, placement)
    for key in (ENV_KV_EVENTS, "VLLM_PLUGINS", ENGINE_KEY_ENV, "VLLM_API_KEY"):
        env.pop(key, None)
    if mode == "vllm":
        env = {k: v for k, v in env.items() if not k.startswith("PDSERVE_") and k != "PYTHONPATH"}
    return env


def ray_llm_config(role: str, args: PDServeArgs, model: str, *, core: int, side_port: int,
                   mode: str = "pdserve", stream_batching_ms: float | None = None) -> dict[str, Any]:
    """One role's ``LLMConfig`` (as a dict) for ``build_pd_openai_app``: pdserve's engine arguments for that
    role, placed on CPU only, one replica, one core."""
    cfg = args.prefill_config if role == "prefill" else args.decode_config
    mlc = cfg.model_loading_config
    # Ray Serve LLM makes each replica's NIXL engine_id unique itself (id-host-port).
    kw = engine_kwargs_for(role, args, on_cpu=True)  # type: ignore[arg-type]
    loading: dict[str, Any] = {"model_id": mlc.model_id, "model_source": model}
    if mlc.tokenizer_source:
        loading["tokenizer_source"] = mlc.tokenizer_source
    runtime_env: dict[str, Any] = {"env_vars": ray_engine_env(args, core, side_port, mode)}
    if mode == "pdserve":
        runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    out: dict[str, Any] = {
        "model_loading_config": loading,
        "engine_kwargs": kw,
        # No accelerator_type: with one, Ray Serve LLM asks for a GPU. The CPU backend creates the placement
        # group from these bundles, builds the engine config in the replica and runs vLLM's mp executor.
        "accelerator_config": {"kind": "cpu"},
        "placement_group_config": {"bundle_per_worker": {"CPU": 1}, "strategy": "PACK"},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": runtime_env,
    }
    if stream_batching_ms is not None:
        out["experimental_configs"] = {"stream_batching_interval_ms": stream_batching_ms}
    return out


class RayServeLLMApp:
    """Ray Serve LLM's P/D app in a child process with a Ray instance of its own."""

    def __init__(self, args: PDServeArgs, *, mode: str = "pdserve", stream_batching_ms: float | None = None,
                 start_timeout_s: float = 900, log_dir: Path | None = None) -> None:
        self.args = args
        self.mode = mode
        self.stream_batching_ms = stream_batching_ms
        self.start_timeout_s = start_timeout_s
        self.log_path = (log_dir or Path(tempfile.gettempdir()) / "pdserve-bench-logs") / "ray-serve-llm.log"
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=80)
        self._ready = threading.Event()
        self._tmp: Path | None = None
        check_mode(mode)

    def serving_args(self, model: str, side_ports: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """The argument of ``build_pd_openai_app``."""
        cores = engine_cores()
        out: dict[str, Any] = {
            f"{role}_config": ray_llm_config(role, self.args, model, core=core, side_port=port, mode=self.mode,
                                             stream_batching_ms=self.stream_batching_ms)
            for role, core, port in zip(("prefill", "decode"), cores, side_ports)}
        # As many front replicas as pdserve's router has.
        out["ingress_deployment_config"] = {"num_replicas": self.args.router.num_replicas}
        return out

    def ray_cpus(self, serving: dict[str, Any]) -> int:
        """Logical CPUs for the Ray instance (Ray's accounting, not cores: the engines' cores are set by
        their environment): each replica's actor (1) and bundle, the front replicas, and room for Serve's
        own actors."""
        need = 0.0
        for role in ("prefill", "decode"):
            c = serving[f"{role}_config"]
            kw = c["engine_kwargs"]
            workers = int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))
            need += 1 + workers * float(c["placement_group_config"]["bundle_per_worker"]["CPU"])
        need += serving["ingress_deployment_config"]["num_replicas"]
        return int(math.ceil(need)) + 2

    @staticmethod
    def command(config_path: str) -> list[str]:
        return [sys.executable, "-m", "pdserve_bench.vs_ray_serve_llm", "--serve-ray-llm", config_path]

    def spec(self) -> dict[str, Any]:
        model = model_path(self.args)
        serving = self.serving_args(model)
        for role in ("prefill", "decode"):
            serving[f"{role}_config"]["runtime_env"]["env_vars"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "<free port>"
        cores = engine_cores()
        return {"kind": "Ray Serve LLM P/D app (ray.serve.llm.build_pd_openai_app)",
                "argv": self.command("<config.json>"), "model": model, "model_ready": model_ready(self.args),
                "engines": [{"name": "prefill", "core": cores[0]}, {"name": "decode", "core": cores[1]}],
                "ray_env": self.mode,
                "serve_config": {"pd_serving_args": serving, "http_port": "<free port>",
                                 "ray_init": {"address": "local", "num_cpus": self.ray_cpus(serving),
                                              "_temp_dir": "<temporary directory>", "include_dashboard": False}}}

    # -- running it --

    def __enter__(self) -> RayServeLLMApp:
        from pdserve.engine.allocator import free_ephemeral_port
        from pdserve.model.resolve import resolve_model
        from pdserve.testing.served import free_port

        check_ray_llm_modules()
        model = resolve_model(self.args.prefill_config.model_loading_config.model_source,
                              cache_dir=self.args.cache_dir)
        # A short path: Ray's Unix sockets live under it.
        self._tmp = Path(tempfile.mkdtemp(prefix="pdserve-rayllm-"))
        port = free_port()
        serving = self.serving_args(model, (free_ephemeral_port(), free_ephemeral_port()))
        cfg = {"pd_serving_args": serving, "http_port": port, "temp_dir": str(self._tmp),
               "num_cpus": self.ray_cpus(serving)}
        path = self._tmp / "config.json"
        path.write_text(json.dumps(cfg, indent=2))
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(str(path)), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        threading.Thread(target=self._pump, name="ray-serve-llm-log", daemon=True).start()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.__exit__()
            raise
        _say(f"Ray Serve LLM P/D app ready in {time.monotonic() - t0:.0f}s: {self.url} (log: {self.log_path})")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        from pdserve.engine.process import pump_lines

        def line(text: str) -> None:
            self.tail.append(text)
            if text.startswith(READY_PREFIX):
                self._ready.set()

        pump_lines(self.proc.stdout, Path(self.log_path), line)

    def _fail(self, why: str) -> EngineStartError:
        return EngineStartError(f"Ray Serve LLM {why}; log: {self.log_path}\n" + "\n".join(list(self.tail)[-40:]))

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        deadline = t0 + self.start_timeout_s
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise self._fail(f"not ready after {self.start_timeout_s:.0f}s")
        # Deployed; the endpoint must also list the model.
        while True:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            if self.args.model_id in self.models():
                return
            if time.monotonic() > deadline:
                raise self._fail(f"/v1/models does not list {self.args.model_id!r} after "
                                 f"{self.start_timeout_s:.0f}s")
            time.sleep(1.0)

    def models(self) -> list[str]:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
                return [m.get("id") for m in json.load(r).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return []

    def _processes(self) -> list[Any]:
        """Every process of this app's Ray instance: the child's descendants, and the processes whose command
        line names its temporary directory (Ray's own, which may have left the process group)."""
        import psutil

        found: dict[int, Any] = {}
        if self.proc is not None:
            try:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    found[p.pid] = p
            except psutil.Error:
                pass
        if self._tmp is not None:
            mark = str(self._tmp)
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if any(mark in part for part in p.info["cmdline"] or ()):
                        found[p.pid] = p
                except psutil.Error:
                    continue
        me = os.getpid()
        return [p for pid, p in found.items() if pid != me]

    def __exit__(self, *exc: object) -> None:
        import psutil

        if self.proc is None:
            return
        procs = self._processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # serve.shutdown(), ray.shutdown()
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs + self._processes():
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.proc = None


def replica_setup() -> None:
    """Ray worker setup hook of the Ray Serve LLM replicas (``ray_env=pdserve``): what pdserve's engine guard
    (pdserve/engine/guard.py) does for a pdserve engine, i.e. every thread of the process on the engine's
    cores and at the engine's niceness (threads started later inherit both, so do vLLM's engine processes),
    then Ray Serve LLM's own hook (importing ``ray.llm._internal.serve``)."""
    import ray.llm._internal.serve  # noqa: F401

    cores = {int(c) for c in os.environ.get(ENGINE_CORES_ENV, "").split(",") if c.strip().isdigit()}
    nice = int(os.environ.get(ENGINE_NICE_ENV) or 0)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(tid, cores)
            if nice:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            pass


# --- the child process: Ray + Ray Serve LLM ---------------------------------------------------------------


def serve_ray_llm(config_path: str) -> int:
    """Start a Ray instance of its own, deploy ``build_pd_openai_app`` on the configured port, print the ready
    line, block until SIGTERM/SIGINT, then shut Serve and Ray down."""
    from pdserve.app.ray_compat import RAY_WORKER_NICENESS_ENV, local_only_ray

    cfg = json.loads(Path(config_path).read_text())
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    def take_signals() -> None:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    take_signals()
    # As `pdserve serve` starts its own Ray: workers at niceness 0, everything on loopback.
    os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
    import ray
    from ray import serve

    local_only_ray(ray)
    ray.init(address="local", num_cpus=int(cfg["num_cpus"]), include_dashboard=False,
             _temp_dir=cfg["temp_dir"], namespace="pdserve-bench-ray-serve-llm", logging_level="WARNING",
             object_store_memory=256 * 1024 * 1024)
    take_signals()  # ray.init installs its own SIGTERM handler
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(cfg["http_port"])})
        from ray.serve.llm import build_pd_openai_app

        app = build_pd_openai_app(cfg["pd_serving_args"])
        err: list[BaseException] = []

        def run() -> None:
            try:
                serve.run(app, name=APP_NAME, route_prefix="/")
            except BaseException as e:  # noqa: BLE001 - reported below
                err.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while t.is_alive() and not stop.wait(0.5):
            pass
        if stop.is_set():
            return 1
        if err:
            print(f"ray-serve-llm: deployment failed: {err[0]!r}", flush=True)
            return 1
        print(f"{READY_PREFIX} http://127.0.0.1:{cfg['http_port']}", flush=True)
        stop.wait()
        return 0
    finally:
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            print(f"ray-serve-llm: serve.shutdown: {e!r}", flush=True)
        ray.shutdown()


# --- the scenario ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    name: str
    prompt: int
    out: int

    def label(self) -> str:
        return f"{self.name} ({self.prompt} -> {self.out} tokens)"


def parse_sizes(text: str) -> list[Size]:
    """``long:600x32,short:16x8``: NAME:PROMPT_TOKENSxNEW_TOKENS, the sweep runs on the first."""
    sizes = []
    for part in str(text).replace(";", ",").split(","):
        if not part.strip():
            continue
        try:
            name, shape = part.split(":")
            prompt, out = shape.lower().split("x")
            size = Size(name.strip(), int(prompt), int(out))
        except ValueError:
            raise ConfigError(f"sizes: bad entry {part!r}; use NAME:PROMPTxOUT, e.g. long:600x32") from None
        if size.prompt < 1 or size.out < 1 or not size.name:
            raise ConfigError(f"sizes: bad entry {part!r}; use NAME:PROMPTxOUT, e.g. long:600x32")
        sizes.append(size)
    if not sizes or len({s.name for s in sizes}) != len(sizes):
        raise ConfigError(f"sizes {text!r}: give one or more distinct NAME:PROMPTxOUT")
    return sizes


def _ints(text: Any, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a list of integers") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"{what}: {text!r}: give positive integers")
    return list(dict.fromkeys(vals))


def _systems(text: Any) -> list[str]:
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ConfigError(f"systems: {text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def point(size: str, concurrency: int) -> str:
    return f"{size}_c{concurrency}"


def _run(url: str, model: str, reqs: list[Any], load: Load, auth: Any = None) -> tuple[list[Any], float]:
    return asyncio.run(run_load(url, model, reqs, load, progress=False, retry_refused=True, auth=auth))


def _summary(results: list[Any], wall: float) -> dict[str, Any]:
    s = summarize(results, wall)
    s["results"] = [r.as_dict() for r in results]
    return s


def _load(url: str, model: str, reqs: list[Any], load: Load, auth: Any = None) -> dict[str, Any]:
    return _summary(*_run(url, model, reqs, load, auth))


def _paired(url: str, engines: list[str], auth: Any, model: str, reqs: list[Any], own: list[Any], load: Load,
            rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One point measured on pdserve (``url``) and on one of its engines alone (``own`` prompts) in
    alternating rounds: round k sends the k-th share of each list, pdserve first on even rounds, the
    engine alone being ``engines[k % len(engines)]``. Each summary counts the wall time of its own rounds
    only."""
    per = max(int(load.value) if load.kind == "concurrency" else 1, 1)
    k = max(1, min(rounds, len(reqs) // per))
    cut = [round(i * len(reqs) / k) for i in range(k + 1)]
    out: dict[str, tuple[list[Any], float]] = {"pd": ([], 0.0), "colo": ([], 0.0)}
    seen = {"pd": PhaseTimes(), "colo": PhaseTimes()}
    for i in range(k):
        ways = [("pd", url, reqs, None), ("colo", engines[i % len(engines)], own, auth)]
        for way, target, items, a in (ways if i % 2 == 0 else ways[::-1]):
            before = seen[way].scrape(url)
            res, wall = _run(target, model, items[cut[i]:cut[i + 1]], load, a)
            seen[way].add(before, seen[way].scrape(url))
            got, total = out[way]
            out[way] = (got + res, total + wall)
    pd, colo = _summary(*out["pd"]), _summary(*out["colo"])
    pd["phases"], colo["phases"] = seen["pd"].as_dict(), seen["colo"].as_dict()
    return pd, colo


#: Histograms read from pdserve's ``/metrics`` around each round: the router's P/D phases, and where the
#: engines' own time went (``vllm:*``, by pdserve role): whether a phase slows when P/D runs it.
PHASE_SERIES = (("pdserve_phase_duration_seconds", "phase", "router"),
                ("vllm:request_queue_time_seconds", "pdserve_role", "engine_queue"),
                ("vllm:request_prefill_time_seconds", "pdserve_role", "engine_prefill"),
                ("vllm:request_decode_time_seconds", "pdserve_role", "engine_decode"))


class PhaseTimes:
    """Histogram growth summed over the rounds of one way of a paired point. A failed scrape (the metrics
    are a side figure) leaves the round out and is counted."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float]] = {key: {} for _, _, key in PHASE_SERIES}
        self.counts: dict[str, dict[str, float]] = {key: {} for _, _, key in PHASE_SERIES}
        self.missed = 0

    def scrape(self, url: str) -> Any:
        try:
            return scrape(url, engines=True)
        except (OSError, ValueError):
            self.missed += 1
            return None

    def add(self, before: Any, after: Any) -> None:
        if before is None or after is None:
            return
        for name, label, key in PHASE_SERIES:
            add(self.sums[key], delta(before, after, name + "_sum", label))
            add(self.counts[key], delta(before, after, name + "_count", label))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: mean_ms(self.sums[key], self.counts[key]) for _, _, key in PHASE_SERIES}
        out["rounds_unread"] = self.missed
        return out


def figures(summary: dict[str, Any]) -> dict[str, float]:
    out = {name: summary[key][p] for name, key, p in METRICS}
    out["req_per_s"] = summary["request_throughput"]
    out["failed"] = summary["failed"]
    return out


def _ratio(a: float, b: float) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def compare(points: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """``points[system][point]``: a summary (:func:`~pdserve_bench.stats.summarize`). Returns per point each
    system's figures and the three ratios (where both systems ran)."""
    names = list(dict.fromkeys(p for sys_points in points.values() for p in sys_points))
    table: dict[str, Any] = {}
    for name in names:
        figs = {s: figures(sp[name]) for s, sp in points.items() if name in sp}
        ratios = {}
        for label, a, b in RATIOS:
            if a in figs and b in figs:
                ratios[label] = {m: _ratio(figs[a][m], figs[b][m]) for m, _, _ in METRICS}
        table[name] = {"figures": figs, "ratios": ratios}
    return table


def vs_ray_serve_llm(args: PDServeArgs, opts: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """The scenario; with a dry-run ``plan`` (:class:`pdserve_bench.plan.Plan`), returns the plan without
    starting anything."""
    from pdserve_bench.plan import Plan

    plan = plan or Plan(SCENARIO)
    found = plan.require(*RAY_LLM_MODULES)
    missing = [m for m, ok in found.items() if not ok]
    if missing and not plan.dry_run:
        raise ConfigError(missing_message(missing))
    n = int(opts.get("requests", 10))
    sizes = parse_sizes(opts.get("sizes", "long:600x32,short:16x8"))
    concurrencies = _ints(opts.get("concurrencies", "1,2,4"), "concurrencies")
    per_point = int(opts.get("sweep_requests", 12))
    order = _systems(opts.get("systems", ",".join(SYSTEMS)))
    mode = str(opts.get("ray_env", "pdserve"))
    batching = opts.get("ray_stream_batching_ms")
    batching_ms = float(batching) if batching not in (None, "") else None
    start_timeout_s = float(opts.get("start_timeout_s", 900))
    paired = str(opts.get("paired", "1")).lower() not in ("0", "false", "no", "off") and {
        "pdserve", "colocated"} <= set(order)
    rounds = int(opts.get("rounds", 4))
    if rounds < 1:
        raise ConfigError("rounds must be >= 1")
    if n < 1 or per_point < 1:
        raise ConfigError("requests and sweep_requests must be >= 1")
    if args.prefill_config.lora_config is not None or args.decode_config.lora_config is not None:
        raise ConfigError(f"--scenario {SCENARIO} compares the base model: remove lora_config from the config")
    args, dtype_reason = with_dtype(args, dry_run=plan.dry_run)
    sweep = sizes[0]
    model = args.model_id
    factory = PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0)))

    def build(count: int, size: Size) -> list[Any]:
        return build_requests(factory, count, Lengths.parse(str(size.prompt)), Lengths.parse(str(size.out)))

    warm = plan.workload("warm-up", [r for s in sizes for r in build(WARMUP, s)],
                         note=f"{WARMUP} of each size, concurrency 1, not measured")
    work: dict[str, tuple[list[Any], Load]] = {}
    # In paired mode the colocated floor runs on pdserve's prefill engine, which caches prefixes: it gets
    # prompts of its own (built right after pdserve's, the same sizes).
    own: dict[str, list[Any]] = {}
    for s in sizes:
        work[point(s.name, 1)] = (plan.workload(s.label(), build(n, s), stream=True, greedy=True), ONE)
        if paired:
            own[point(s.name, 1)] = build(n, s)
    for c in concurrencies:
        if c == 1:
            continue  # the single-request point of the first size
        count = int(math.ceil(max(per_point, c) / c)) * c
        work[point(sweep.name, c)] = (plan.workload(f"{sweep.label()}, concurrency {c}", build(count, sweep),
                                                    stream=True, greedy=True), Load("concurrency", c))
        if paired:
            own[point(sweep.name, c)] = build(count, sweep)
    labels = {point(s.name, 1): s.label() for s in sizes}
    labels.update({point(sweep.name, c): f"{sweep.label()}, concurrency {c}" for c in concurrencies if c != 1})
    cores = engine_cores()
    plan.set(requests=n, sizes={s.name: {"prompt_tokens": s.prompt, "max_tokens": s.out} for s in sizes},
             concurrencies=concurrencies, sweep_size=sweep.name, sweep_requests=per_point, systems=order,
             ray_env=mode, dtype=args.prefill_config.engine_kwargs.get("dtype", "auto"), dtype_reason=dtype_reason,
             ray_stream_batching_ms=batching_ms if batching_ms is not None else "Ray Serve LLM's default",
             cores={"ray-serve-llm": {"prefill": cores[0], "decode": cores[1]},
                    "pdserve": "one per engine, claimed from the same cores",
                    "colocated": "pdserve's two engines', in turn" if paired else cores[0]},
             paired=paired, rounds=rounds if paired else None,
             missing_modules=missing)
    systems: dict[str, Any] = {}
    for name in order:
        if name == "ray-serve-llm":
            systems[name] = plan.system(name, RayServeLLMApp(args, mode=mode, stream_batching_ms=batching_ms,
                                                             start_timeout_s=start_timeout_s))
        elif name == "pdserve":
            systems[name] = plan.system(name, ServedApp(args))
        elif paired:
            for key, (_, load) in work.items():
                plan.phase(f"colocated: {labels[key]}", system="pdserve", load=load, workload=labels[key],
                           point=key, to="pdserve's prefill and decode engines in turn, in rounds alternating "
                                         "with pdserve's, prompts of its own of the same sizes")
            continue
        else:
            systems[name] = plan.system(name, EnginePair(args, disaggregated=False, engines=1))
        plan.phase(f"{name}: warm-up", system=name, load=ONE, workload="warm-up")
        for key, (_, load) in work.items():
            plan.phase(f"{name}: {labels[key]}", system=name, load=load, workload=labels[key], point=key)
    if plan.dry_run:
        return plan.as_dict()

    from pdserve_bench.overload_long import host_cpu

    result: dict[str, Any] = {"host_cpu": host_cpu(), "settings": dict(plan.settings), "systems": {},
                              "points": {k: labels[k] for k in work}}
    measured: dict[str, dict[str, dict[str, Any]]] = {}
    for name, system in systems.items():
        t0 = time.monotonic()
        try:
            with system as live:
                url = live.urls[0] if isinstance(live, EnginePair) else live.url
                ready_s = time.monotonic() - t0
                _say(f"{name}: warm-up")
                _load(url, model, warm, ONE)
                got: dict[str, dict[str, Any]] = {}
                floor: dict[str, dict[str, Any]] = {}
                if paired and name == "pdserve":
                    # Both of pdserve's engines serve as the floor in turn: the two cores of a shared host
                    # differ (one engine's TPOT by 10-20 % against the other's, back to back), and pdserve
                    # decodes on one and computes prompts on the other.
                    roles = live.engines()
                    engines = [roles["prefill"], roles["decode"]]
                    for engine in engines:
                        _load(engine, model, warm, ONE, auth=live.auth)
                for key, (reqs, load) in work.items():
                    _say(f"{name}: {labels[key]} ({len(reqs)} requests)")
                    if paired and name == "pdserve":
                        got[key], floor[key] = _paired(url, engines, live.auth, model, reqs, own[key], load,
                                                       rounds)
                    else:
                        got[key] = _load(url, model, reqs, load)
                    for who, res in ((name, got), ("colocated", floor)):
                        if key in res:
                            f = figures(res[key])
                            _say(f"  {who}: TTFT p50 {f['ttft_p50']:.0f} ms, TPOT p50 {f['tpot_p50']:.1f} ms, "
                                 f"e2e p50 {f['e2e_p50']:.0f} ms, failed {f['failed']}")
                            if res[key].get("phases"):
                                _say(f"    mean times: {phase_line(res[key]['phases'])}")
        except EngineStartError as e:
            _say(f"{name} did not start: {str(e).splitlines()[0]}")
            result["systems"][name] = {"error": str(e)[-4000:]}
            continue
        measured[name] = got
        result["systems"][name] = {"ready_s": ready_s, "points": got}
        if floor:
            measured["colocated"] = floor
            result["systems"]["colocated"] = {"ready_s": None, "points": floor,
                                              "note": "pdserve's engines in turn, rounds alternating with pdserve"}
    if not measured:
        raise EngineStartError("no system started; see the errors above")
    result["compare"] = compare(measured)
    for key, row in result["compare"].items():
        for label, r in row["ratios"].items():
            _say(f"{key} {label}: TTFT p50 {_fmt(r['ttft_p50'])}, TPOT p50 {_fmt(r['tpot_p50'])}, "
                 f"e2e p50 {_fmt(r['e2e_p50'])}")
    return result


def phase_line(phases: dict[str, Any]) -> str:
    """``router prefill 812 ms (n 12), ...; engine_prefill prefill 640 ms, ...``: a paired way's means."""
    parts = []
    for key, by in phases.items():
        if isinstance(by, dict) and by:
            parts.append(f"{key} " + ", ".join(f"{k} {v['mean_ms']:.0f} ms (n {v['n']})" for k, v in by.items()))
    return "; ".join(parts) or "none recorded"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def plot(result: dict[str, Any], path: Any) -> Any:
    """Left: single requests per size (TTFT, TPOT, e2e p50 per system, bars). Right: the concurrency sweep
    (TTFT and e2e p50 against concurrency, a line per system)."""
    from pdserve_bench.plots import _plt, _save

    plt = _plt()
    table = result.get("compare", {})
    systems = [s for s in SYSTEMS if any(s in row["figures"] for row in table.values())]
    singles = [k for k in table if k.endswith("_c1")]
    sweep = result.get("settings", {}).get("sweep_size") or (singles[0].rsplit("_c", 1)[0] if singles else "")
    sweep_keys = sorted((k for k in table if k.rsplit("_c", 1)[0] == sweep), key=lambda k: int(k.rsplit("_c", 1)[1]))
    panels = len(singles) + 2
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False)
    metrics = (("ttft_p50", "TTFT"), ("tpot_p50", "TPOT"), ("e2e_p50", "e2e"))
    width = 0.8 / max(1, len(systems))
    for ax, key in zip(axes[0], singles):
        figs = table[key]["figures"]
        for i, s in enumerate(systems):
            ys = [figs.get(s, {}).get(m, float("nan")) for m, _ in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], ys, width, label=s)
        ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(metrics))])
        ax.set_xticklabels([f"{label} p50" for _, label in metrics])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(result.get("points", {}).get(key, key) + ", concurrency 1", fontsize=9)
        ax.grid(alpha=0.3, axis="y", which="both")
    for ax, (m, label) in zip(axes[0][len(singles):], (("ttft_p50", "TTFT p50 (ms)"), ("e2e_p50", "e2e p50 (ms)"))):
        for s in systems:
            pts = [(int(k.rsplit("_c", 1)[1]), table[k]["figures"][s][m]) for k in sweep_keys
                   if s in table[k]["figures"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{sweep}: {label} vs concurrency", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"pdserve vs Ray Serve LLM (P/D) vs one colocated engine on {result.get('host_cpu', '?')}",
                 fontsize=9)
    return _save(plt, fig, path)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pdserve_bench.vs_ray_serve_llm")
    p.add_argument("--serve-ray-llm", metavar="CONFIG.json", required=True,
                   help="run Ray Serve LLM's P/D app as the scenario's child process")
    ns = p.parse_args(argv)
    return serve_ray_llm(ns.serve_ray_llm)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
