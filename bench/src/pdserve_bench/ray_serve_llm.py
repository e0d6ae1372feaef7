"""Ray Serve LLM's P/D app as a system ``--scenario vs-ray-serve-llm`` starts and stops: the modules it needs,
its config on CPU with pdserve's engine arguments and environment, and its child process.

``ray.serve.llm.build_pd_openai_app`` with one prefill and one decode replica, run by a child process
(``python -m pdserve_bench.vs_ray_serve_llm --serve-ray-llm CONFIG.json``,
:func:`~pdserve_bench.ray_serve_llm_child.serve_ray_llm`) that starts a Ray instance of its own
(``address="local"``, its own temporary directory, ports the kernel picks), runs the app on a free port,
prints a ready line and blocks. Stopping it: SIGTERM (``serve.shutdown()``, ``ray.shutdown()``), then SIGKILL
to its process group and to every process of that Ray instance (its descendants, and anything whose command
line names its temporary directory). No other Ray is touched.

Ray Serve LLM runs without a GPU through its CPU accelerator backend: ``accelerator_config: {kind: cpu}``,
no ``accelerator_type``, and ``placement_group_config: {bundle_per_worker: {CPU: 1}}`` (a bundle without
GPU), which makes it run vLLM with the ``mp`` executor. Each engine gets one core through the environment
pdserve's launcher gives its engines (:func:`~pdserve.engine.launcher.engine_env`), passed as the replicas'
``runtime_env.env_vars``; ``ray_env=pdserve`` adds pdserve's engine guard as a Ray worker setup hook
(:func:`~pdserve_bench.ray_serve_llm_child.replica_setup`), ``ray_env=vllm`` keeps only vLLM's, UCX's and
the allocator's variables.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import ENGINE_KEY_ENV, EnginePlacement, engine_env, engine_kwargs_for
from pdserve.engine.vllm_plugin import ENV_FILE as ENV_KV_EVENTS
from pdserve.errors import ConfigError, EngineStartError
from pdserve_bench.ray_serve_llm_child import READY_PREFIX
from pdserve_bench.systems import _say, model_path, model_ready

#: Modules Ray Serve LLM imports (``ray[llm]`` lists them, but that extra pins another vLLM and NIXL, so
#: bench/pyproject.toml names them one by one), and vLLM for its engines. Found, not imported.
RAY_LLM_MODULES = ("pyarrow", "pandas", "jsonref", "smart_open", "mmh3", "typer", "fsspec", "colorful", "vllm")
#: Ray worker setup hook of the Ray Serve LLM replicas with ``ray_env=pdserve`` (the scenario's module
#: imports it from :mod:`pdserve_bench.ray_serve_llm_child`).
SETUP_HOOK = "pdserve_bench.vs_ray_serve_llm.replica_setup"
#: The module the child process runs (its ``main`` dispatches ``--serve-ray-llm``).
CHILD_MODULE = "pdserve_bench.vs_ray_serve_llm"
RAY_ENV_MODES = ("pdserve", "vllm")


# --- dependencies ------------------------------------------------------------------------------------


def missing_ray_llm_modules() -> list[str]:
    import importlib.util

    return [m for m in RAY_LLM_MODULES if importlib.util.find_spec(m) is None]


def missing_message(missing: list[str]) -> str:
    return ("--scenario vs-ray-serve-llm runs Ray Serve LLM (ray.serve.llm), which needs modules that are not "
            f"installed: {', '.join(missing)}. Install the benchmarks with their dependencies, from pdserve's "
            "repository: .venv/bin/pip install -c constraints.txt -e bench (or `make setup`).")


def check_ray_llm_modules() -> None:
    """Raises :class:`ConfigError` naming the missing modules and the install command."""
    missing = missing_ray_llm_modules()
    if missing:
        raise ConfigError(missing_message(missing))

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
    kw = engine_kwargs_for(role, args, on_cpu=True, model_path=model)  # type: ignore[arg-type]
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
        return [sys.executable, "-m", CHILD_MODULE, "--serve-ray-llm", config_path]

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
