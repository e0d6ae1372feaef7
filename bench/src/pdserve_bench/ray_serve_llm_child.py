"""Ray Serve LLM's side of ``--scenario vs-ray-serve-llm``: what runs in its child process and in its Ray
workers, never in the scenario's own process.

* :func:`serve_ray_llm`: the child process (``python -m pdserve_bench.vs_ray_serve_llm --serve-ray-llm
  CONFIG.json``, started by :class:`~pdserve_bench.ray_serve_llm.RayServeLLMApp`): a Ray instance of its own,
  ``build_pd_openai_app`` deployed on the configured port, a ready line on stdout, then blocked until SIGTERM.
* :func:`replica_setup`: the Ray worker setup hook of the replicas with ``ray_env=pdserve``, named by its
  old path ``pdserve_bench.vs_ray_serve_llm.replica_setup`` (that module imports it from here).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from pdserve.settings import ENGINE_CORES_ENV, ENGINE_NICE_ENV

#: The line the Ray Serve LLM child prints on stdout once ``serve.run`` has deployed the app.
READY_PREFIX = "ray-serve-llm ready:"
APP_NAME = "ray-serve-llm"


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
