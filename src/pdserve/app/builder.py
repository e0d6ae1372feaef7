"""``build_pd_openai_app``: the Ray Serve application of a pdserve config.

Usable as ``import_path: pdserve:build_pd_openai_app`` with ``serve run`` / ``serve deploy`` and inside a
KubeRay ``serveConfigV2``: Ray calls it with the application's ``args``.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.config.loader import parse_args
from pdserve.config.resources import asks_for_gpus, multi_gpu_placement
from pdserve.config.schema import LLMConfig, PDServeArgs

log = logging.getLogger("pdserve")


def cpu_only_cluster(args: PDServeArgs | None = None) -> bool:
    """True when the engines are to run on CPU, i.e. get nominal Ray reservations and no GPU.

    With Ray initialised (``serve run FILE``, ``serve deploy``, KubeRay, ``pdserve serve``: the builder runs
    in or against the cluster), the cluster decides: CPU only when it has no GPU at all. Without Ray
    (``serve run pdserve:build_pd_openai_app key=value`` builds before it connects, or a plain Python
    call), the config decides: GPUs only when it asks for them (``accelerator_type``, ``num_gpus``, GPU
    placement bundles, ``kv_buffer_device: cuda``). The host that builds the app is not asked: it is not
    necessarily where the engines run.
    """
    ray_gpus = _ray_cluster_gpus()
    if ray_gpus is not None:
        return ray_gpus == 0
    return not asks_for_gpus(args if args is not None else PDServeArgs())


def _ray_cluster_gpus() -> float | None:
    """GPUs in the Ray cluster this process is connected to; ``None`` when Ray is not initialised."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return float(ray.cluster_resources().get("GPU", 0))


def replica_options(role: str, cfg: LLMConfig, *, cpu_only: bool) -> dict[str, Any]:
    """Ray Serve deployment options of one engine role."""
    dc = cfg.deployment_config
    opts: dict[str, Any] = {
        "name": dc.name or role,
        "max_ongoing_requests": dc.max_ongoing_requests,
        "health_check_period_s": dc.health_check_period_s,
        "health_check_timeout_s": dc.health_check_timeout_s,
        "graceful_shutdown_timeout_s": dc.graceful_shutdown_timeout_s,
    }
    if dc.autoscaling_config is not None:
        from pdserve.app.autoscaling import POLICY_PATHS

        auto = dc.autoscaling_config.model_dump(exclude_none=True)
        auto.pop("target_ttft_s", None)  # pdserve's own: the engine replicas turn it into "ttft_pressure"
        # Engines get no traffic through Serve handles; they report their own load (see autoscaling.py).
        auto.setdefault("policy", {"policy_function": POLICY_PATHS[role]})
        opts["autoscaling_config"] = auto
    else:
        opts["num_replicas"] = dc.num_replicas if dc.num_replicas is not None else 1
    if dc.max_constructor_retry_count is not None:
        opts["max_constructor_retry_count"] = dc.max_constructor_retry_count
    if dc.logging_config is not None:
        opts["logging_config"] = dc.logging_config
    actor: dict[str, Any] = dict(dc.ray_actor_options or {})
    if cfg.runtime_env:
        actor.setdefault("runtime_env", cfg.runtime_env)
    if cfg.accelerator_type:
        actor.setdefault("accelerator_type", cfg.accelerator_type)
    if cfg.placement_group_config is not None:
        pg = cfg.placement_group_config
        opts["placement_group_bundles"] = pg.bundles
        opts["placement_group_strategy"] = pg.strategy
    elif cpu_only:
        # CPU hosts: an engine's cores are claimed per host by pdserve itself (VLLM_CPU_OMP_THREADS_BIND),
        # so the Ray reservation is nominal; whole-CPU reservations would not fit 1P+1D+router on 2 cores.
        actor.setdefault("num_cpus", 0.01)
    else:
        multi = multi_gpu_placement(cfg)
        # One GPU: a plain actor holds it. Several: the bundles hold them (the actor takes the first).
        actor.setdefault("num_gpus", 0 if multi else 1)
        if multi:
            opts["placement_group_bundles"] = multi["bundles"]
            opts["placement_group_strategy"] = multi["strategy"]
        actor.setdefault("num_cpus", 1)
    opts["ray_actor_options"] = actor
    return opts


def build_pd_openai_app(args: dict[str, Any] | PDServeArgs | None = None, *,
                        direct_ingress: dict[str, Any] | None = None) -> Any:
    """Build the P/D OpenAI application: prefill engines, decode engines, and the router ingress.

    ``args`` is the ``args:`` mapping of a Serve application (Ray Serve LLM's shape plus pdserve's own
    sections), a :class:`PDServeArgs`, or ``None`` for the embedded default. ``direct_ingress``
    (``{"host", "port", "route_prefix"}``, given by ``pdserve serve`` once Ray's proxy listens elsewhere):
    the router replicas serve that address themselves (:mod:`pdserve.router.ingress`).
    """
    from ray import serve

    from pdserve.app.deployments import EngineServer, RouterServer

    parsed = args if isinstance(args, PDServeArgs) else parse_args(args or {}, source="build_pd_openai_app args")
    cpu_only = cpu_only_cluster(parsed)
    if cpu_only:
        # Decided here, once for the whole app: every replica of both roles must compute in the same dtype
        # (the KV layout crosses NIXL), so no replica may probe its own host and choose on its own.
        from pdserve.engine.cpu_dtype import resolve_cpu_dtype

        parsed, reason = resolve_cpu_dtype(parsed)
        log.info("pdserve: CPU engines: %s", reason)
    plain = parsed.model_dump(mode="json")

    prefill = serve.deployment(EngineServer).options(
        **replica_options("prefill", parsed.prefill_config, cpu_only=cpu_only)).bind("prefill", plain)
    decode = serve.deployment(EngineServer).options(
        **replica_options("decode", parsed.decode_config, cpu_only=cpu_only)).bind("decode", plain)
    router_cls = serve.ingress()(RouterServer)
    router = serve.deployment(router_cls).options(
        name="router",
        num_replicas=parsed.router.num_replicas,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0.01 if cpu_only else 1},
    ).bind(plain, prefill, decode, direct_ingress)
    return router
