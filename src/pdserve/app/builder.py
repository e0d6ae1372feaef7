"""``build_pd_openai_app``: the Ray Serve application of a pdserve config.

Usable as ``import_path: pdserve:build_pd_openai_app`` with ``serve run`` / ``serve deploy`` and inside a
KubeRay ``serveConfigV2``: Ray calls it with the application's ``args``.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.app import placement
from pdserve.config.loader import parse_args
from pdserve.config.resources import multi_gpu_placement
from pdserve.config.schema import LLMConfig, PDServeArgs

log = logging.getLogger("pdserve")
#: Serve's ``graceful_shutdown_wait_loop_s`` of a router replica that serves its port directly.
ROUTER_STOP_LOOK_S = 0.25


def replica_options(role: str, cfg: LLMConfig, *, cpu_only: bool) -> dict[str, Any]:
    """Ray Serve deployment options of one engine role."""
    dc = cfg.deployment_config
    opts: dict[str, Any] = {
        "name": dc.name or role,
        "max_ongoing_requests": dc.max_ongoing_requests,
        "health_check_period_s": dc.health_check_period_s,
        "health_check_timeout_s": dc.health_check_timeout_s,
        "graceful_shutdown_timeout_s": dc.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": dc.graceful_shutdown_wait_loop_s,
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


def here() -> dict[str, float]:
    """A sliver of the resource Ray gives each node (``node:<its address>``) for this process's node: an
    actor asking for it runs on this host."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    addr = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)
    return {f"node:{addr}": 0.001}


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
    where = placement.decide(parsed)
    parsed, cpu_only = where.args, where.on_cpu
    if where.dtype_reason:
        log.info("pdserve: CPU engines: %s", where.dtype_reason)
    plain = parsed.model_dump(mode="json")

    prefill = serve.deployment(EngineServer).options(
        **replica_options("prefill", parsed.prefill_config, cpu_only=cpu_only)).bind("prefill", plain)
    decode = serve.deployment(EngineServer).options(
        **replica_options("decode", parsed.decode_config, cpu_only=cpu_only)).bind("decode", plain)
    router_cls = serve.ingress()(RouterServer)
    router_actor: dict[str, Any] = {"num_cpus": 0.01 if cpu_only else 1}
    if direct_ingress:
        # The router replicas serve the port themselves: on the host `pdserve serve` runs on (the address its
        # user reaches, and one host for SO_REUSEPORT), not wherever Ray would place them in a cluster.
        router_actor["resources"] = here()
    router_opts: dict[str, Any] = {}
    if direct_ingress:
        # Serve sees none of the requests a router serves directly (its own server finishes those as it
        # stops): Serve's wait before its first look for requests (2 s) would only delay every stop. Through
        # Serve's proxy, Serve's wait stands: it also covers the proxies learning the replica is going.
        router_opts["graceful_shutdown_wait_loop_s"] = ROUTER_STOP_LOOK_S
    router = serve.deployment(router_cls).options(
        name="router",
        num_replicas=parsed.router.num_replicas,
        max_ongoing_requests=4096,
        ray_actor_options=router_actor,
        **router_opts,
    ).bind(plain, prefill, decode, direct_ingress)
    return router
