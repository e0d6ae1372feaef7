"""The one assembly of a router: engine pool, orchestrator and HTTP app from a router config.

The Serve deployment (app/deployments.py), the bench and the tests all build their router here, so a
router in a test or a benchmark is the router users run, with the same parts wired the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI

from pdserve.config.schema import RouterConfig
from pdserve.config.tracing import TracingConfig
from pdserve.router.api import build_app
from pdserve.router.endpoint import Endpoint
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool
from pdserve.router.prompt_length import PromptLength
from pdserve.router.validate import EngineLimits


@dataclass
class Router:
    app: FastAPI
    pool: EnginePool
    orchestrator: Orchestrator


def build_router(cfg: RouterConfig, model_id: str, *, endpoints: Sequence[Endpoint] = (),
                 lengths: PromptLength | None = None, limits: EngineLimits | None = None,
                 lease_s: float | None = None, lease_check_after_s: float | None = None,
                 on_calibrated: Callable[[Endpoint, float], None] | None = None, chat_parsers: bool = False,
                 echo_request_id: bool = True, lora_root: str | None = None,
                 metrics: RouterMetrics | None = None, tracing: TracingConfig | None = None,
                 handback_ttl_s: float | None = None) -> Router:
    """A router for ``model_id`` by ``cfg``.

    ``endpoints``: engines known from the start (the Serve deployment discovers them instead: ``pool.replace``);
    ``lengths``: the model's tokenizer for prompt lengths (else estimated); ``limits``: what the engines
    accept (checked before the first leg); ``lease_s``: the prefill engines' KV lease, and
    ``lease_check_after_s`` the handoff time after which a lease is checked (None: never);
    ``on_calibrated``: told each engine's measured prompt speed; ``chat_parsers``: the engines run a
    reasoning or tool-call parser; ``echo_request_id``: False behind a proxy that echoes ``X-Request-Id``;
    ``lora_root``: the LoRA adapter store, when adapters are served; ``tracing``: where traces go (none: off); ``handback_ttl_s``: how long decode engines keep a finished
    request's blocks for the next turn's prefill (``nixl.bidirectional``; none: they keep none)."""
    pool = EnginePool(list(endpoints), policy=cfg.policy, prefill_policy=cfg.prefill_policy,
                      decode_policy=cfg.decode_policy, plugins=cfg.plugins,
                      follow_all=cfg.cache_aware_steps > 0)
    orch = Orchestrator(pool, cfg, metrics, lengths, lease_check_after_s, lease_s=lease_s, model_id=model_id,
                        on_calibrated=on_calibrated, limits=limits, chat_parsers=chat_parsers, tracing=tracing,
                        engine_checks=True, handback_ttl_s=handback_ttl_s)
    app = build_app(model_id, pool, orch, cfg, echo_request_id=echo_request_id, lora_root=lora_root)
    return Router(app, pool, orch)
