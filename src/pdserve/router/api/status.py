"""The operator's routes: health, Prometheus metrics, the router's status, the served models."""

from __future__ import annotations

import os
from typing import Any

import psutil
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response

from pdserve._version import __version__
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.errors import Forbidden, ModelNotFound, NoEngineAvailable
from pdserve.router.api.common import Api, caller
from pdserve.router.auth import Caller
from pdserve.router.http_errors import to_response

#: What a named tenant's status shows of each engine (not its NIXL engine id, which KV params carry).
TENANT_ENGINE_FIELDS = ("role", "replica_id", "healthy")


def model_routes(api: Api) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": api.served.cards()})

    @r.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        try:
            return JSONResponse(api.served.card(api.served.check(model)))
        except ModelNotFound as e:
            return to_response(e)

    return r


def status_routes(api: Api, app: FastAPI) -> APIRouter:
    r = APIRouter()
    pool, orch = api.pool, api.orchestrator

    @r.get("/health")
    async def health() -> Response:
        # Up while some engine can answer: without a decode engine, prefill engines answer whole requests
        # (router/admission.py) unless prefill_fallback is `error`.
        if pool.has("decode") or (pool.has("prefill") and orch.cfg.prefill_fallback != "error"):
            return Response(status_code=200)
        return to_response(NoEngineAvailable("no healthy decode engine"))

    @r.get("/metrics")
    async def prometheus(request: Request, engines: int = 1) -> Response:
        """The router's metrics, then (``engines=1``) every engine's ``vllm:*`` metrics with
        ``pdserve_role`` / ``pdserve_replica`` labels. The operator's: a named tenant's key gets 403 (they
        count every tenant's requests, tokens and refusals by name, and the engines' every request)."""
        who = caller(request)
        if orch.gate.tenants.enabled and who.tenant != DEFAULT_TENANT:
            return to_response(Forbidden(
                f"tenant '{who.tenant}': /metrics counts every tenant's work; scrape it with a key of "
                "router.api_keys (its own figures are in /pdserve/status)"))
        body = api.metrics.exposition()
        if engines:
            from pdserve.router.metrics import scrape_engines

            body += await scrape_engines(await orch.session(), pool.endpoints())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def named(who: Caller) -> bool:
        return orch.gate.tenants.enabled and who.tenant != DEFAULT_TENANT

    def engine_view(engine: dict[str, Any], who: Caller) -> dict[str, Any]:
        """An engine as a caller sees it: a named tenant only its role, replica and health (where it runs is
        the operator's to know, and its load is every tenant's work: its queued prompt tokens rose by another
        tenant's prompt's length as it was sent)."""
        if named(who):
            return {k: engine[k] for k in TENANT_ENGINE_FIELDS if k in engine}
        return engine

    @r.get("/pdserve/status")
    async def status(request: Request, footprint: int = 0) -> JSONResponse:
        """The router's view of the app; ``footprint=1`` adds what the app's processes on the router's host
        take (PSS by part: engines, router, Ray; :mod:`pdserve.footprint`)."""
        from pdserve.router.effect import decode_token_sources
        from pdserve.router.metrics import scrape_engines, shared

        who = caller(request)
        host: dict[str, Any] = {}
        if footprint and who.tenant == DEFAULT_TENANT:
            import asyncio

            from pdserve.footprint import measure

            got = await shared(("footprint",), lambda: asyncio.to_thread(measure))
            host = {"host_footprint": got.as_dict()}
        await orch.current_engines()  # what the registry lists now, though the router was idle
        engines = [engine_view(e.as_dict(), who) for e in pool.endpoints()]
        # With tenants, each sees its own figures only.
        tenants = orch.gate.tenants.summary(who.tenant if orch.gate.tenants.enabled else None)
        if named(who):
            # Nothing that counts every tenant's work: decisions, the router's load, the engines' load.
            return JSONResponse({"model": api.model_id, "version": __version__, "engines": engines,
                                 "tenants": tenants})
        decodes = pool.endpoints("decode")
        text = await scrape_engines(await orch.session(), decodes, families=("vllm:prompt_tokens_by_source",))
        pulled, local = decode_token_sources(text.decode())
        return JSONResponse({
            "pd_in_effect": orch.effect.summary(pulled, local),
            "model": api.model_id,
            "version": __version__,
            "engines": engines,
            "ingress": getattr(app.state, "ingress", {"mode": "standalone"}),
            "decisions": dict(orch.stats),
            "local_prefill_below_tokens": orch.gate.local_below(),
            **({"kv_cache_routing": pool.kv_index.summary()} if pool.kv_index.engines() else {}),
            "tenants": tenants,
            "router": {"pid": os.getpid(), "rss_bytes": psutil.Process().memory_info().rss,
                       "inflight": orch.gate.admitted["decode"], "request_checks": orch.gate.validator.summary()},
            **host,
        })

    return r
