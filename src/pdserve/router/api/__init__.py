"""The OpenAI-compatible HTTP API of the router, one FastAPI router per concern.

``build_app`` returns a FastAPI app around an :class:`~pdserve.router.orchestrator.Orchestrator`; the same
app runs inside the Ray Serve router deployment and, in tests and the bench, in front of other engines
(:func:`pdserve.router.build.build_router` assembles both).

- :mod:`.generate`: chat and completions (OpenAI), Responses (with its stored answers), Messages (Anthropic)
- :mod:`.one_engine`: tokenize, detokenize, embeddings, score
- :mod:`.status`: health, metrics, status, models
- :mod:`.common`: request ids, callers, bodies, replies; errors only through :mod:`pdserve.router.http_errors`
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from pdserve._version import __version__
from pdserve.config.schema import RouterConfig
from pdserve.errors import BadRequest, RequestError
from pdserve.router import heap
from pdserve.router.api.common import REQUEST_ID_HEADER, Api, OwnedStream
from pdserve.router.api.generate import messages_routes, openai_routes, responses_routes
from pdserve.router.api.one_engine import one_engine_routes
from pdserve.router.api.status import model_routes, status_routes
from pdserve.router.auth import ApiKeys
from pdserve.router.http_errors import to_response
from pdserve.router.models import ServedModels
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool

__all__ = ["REQUEST_ID_HEADER", "OwnedStream", "build_app"]


def build_app(
    model_id: str, pool: EnginePool, orchestrator: Orchestrator, cfg: RouterConfig, *, echo_request_id: bool = True,
    lora_root: str | None = None,
) -> FastAPI:
    """``echo_request_id=False`` when a proxy in front (Ray Serve's) already echoes ``X-Request-Id``.
    ``lora_root``: the LoRA adapter store (``lora_config.dynamic_lora_loading_path``), when adapters are served."""
    app = FastAPI(title="pdserve", version=__version__, docs_url=None, redoc_url=None)
    metrics = orchestrator.metrics
    api = Api(model_id, pool, orchestrator, cfg, ServedModels(model_id, int(time.time()), lora_root), metrics,
              echo_request_id)
    metrics.watch_engines(pool.endpoints)
    keys = ApiKeys(cfg)
    heap.watch_pauses(metrics.gc_pause)

    if keys.enabled:
        orchestrator.stored.secret = keys.id_secret()  # the same in every router replica: ids carry their owner

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Response:
            try:
                request.state.caller = keys.check(request.url.path, request.headers.get("authorization"),
                                                  request.headers.get("x-api-key"))
            except RequestError as e:
                metrics.errors.labels("Unauthorized").inc()
                return to_response(e)
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # A query parameter FastAPI could not read (``/metrics?engines=x``): an OpenAI error, as any other.
        first = (exc.errors() or [{}])[0]
        name = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path")) or None
        why = first.get("msg", "not valid")
        return to_response(BadRequest(f"invalid parameter {name}: {why}" if name else f"invalid request: {why}",
                                      param=name))

    @app.on_event("shutdown")
    async def _close() -> None:
        await orchestrator.close()

    for routes in (openai_routes(api), responses_routes(api), messages_routes(api), one_engine_routes(api),
                   model_routes(api), status_routes(api, app)):
        app.include_router(routes)
    return app
