"""The OpenAI-compatible HTTP API of the router.

``build_app`` returns a FastAPI app around an :class:`~pdserve.router.orchestrator.Orchestrator`; the same
app runs inside the Ray Serve router deployment and, in tests, in front of fake engines.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve import __version__
from pdserve.config.schema import RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.errors import BadRequest, ModelNotFound, NotFound, PayloadTooLarge, RequestError, ShuttingDown
from pdserve.router import handoff, heap, validate
from pdserve.router.auth import ANONYMOUS, ApiKeys, Caller
from pdserve.router.flight import Flight
from pdserve.router.http_errors import error_body, to_response
from pdserve.router.models import ServedModels
from pdserve.router.orchestrator import EngineAnswer, Orchestrator
from pdserve.router.pool import EnginePool

REQUEST_ID_HEADER = validate.REQUEST_ID_HEADER


class OwnedStream(StreamingResponse):
    """A streamed answer that gives its request's claims back when the response is over, however it
    ends: sent in full, the client gone before the first byte, or the task cancelled."""

    def __init__(self, content: Any, flight: Flight | None, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.flight is not None:
                self.flight.release()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _request_id(request: Request) -> str:
    """The client's request id, or a new one when it sent none (:class:`BadRequest` for one that cannot be
    used: it goes into engine request ids, headers and log lines)."""
    return validate.request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex


def _caller(request: Request) -> Caller:
    """Who sent the request, as :meth:`ApiKeys.check` named it (:data:`ANONYMOUS` when the app has no keys)."""
    return getattr(request.state, "caller", None) or ANONYMOUS


def _owner(request: Request) -> str:
    return _caller(request).owner


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body is {length} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from e
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError:
        raise BadRequest(f"request body nests arrays and objects deeper than {validate.MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def build_app(
    model_id: str, pool: EnginePool, orchestrator: Orchestrator, cfg: RouterConfig, *, echo_request_id: bool = True,
    lora_root: str | None = None,
) -> FastAPI:
    """``echo_request_id=False`` when a proxy in front (Ray Serve's) already echoes ``X-Request-Id``.
    ``lora_root``: the LoRA adapter store (``lora_config.dynamic_lora_loading_path``), when adapters are served."""
    app = FastAPI(title="pdserve", version=__version__, docs_url=None, redoc_url=None)
    created = int(time.time())
    served = ServedModels(model_id, created, lora_root)
    metrics = orchestrator.metrics
    metrics.watch_engines(pool.endpoints)
    keys = ApiKeys(cfg)
    # vLLM's request models take seconds to import: now, at start, rather than in the first request. (The
    # router replica then freezes its heap: app/deployments.py.)
    validate.warm_up()
    heap.watch_pauses(metrics.gc_pause)

    if keys.enabled:
        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Response:
            try:
                request.state.caller = keys.check(request.url.path, request.headers.get("authorization"),
                                                  request.headers.get("x-api-key"))
            except RequestError as e:
                metrics.errors.labels("Unauthorized").inc()
                return to_response(e)
            return await call_next(request)

    @app.on_event("shutdown")
    async def _close() -> None:
        await orchestrator.close()

    async def completion(route: str, request: Request) -> Response:
        try:
            rid = _request_id(request)
        except BadRequest as e:
            metrics.errors.labels(type(e).__name__).inc()
            resp: Response = to_response(e, uuid.uuid4().hex if echo_request_id else None)
        else:
            hdr = {REQUEST_ID_HEADER: rid} if echo_request_id else {}
            resp = await _completion(route, request, rid, hdr)
        metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    async def _completion(route: str, request: Request, rid: str, hdr: dict[str, str]) -> Response:
        try:
            body = await _read_json(request, cfg.max_body_bytes)
            body["model"] = served.check(body.get("model"))
            reply = await orchestrator.handle(route, body, rid,  # type: ignore[arg-type]
                                              session=request.headers.get("x-session-id"), owner=_owner(request),
                                              tenant=_caller(request).tenant)
        except EngineAnswer as e:
            metrics.errors.labels(f"engine_{e.status}").inc()
            return Response(e.body, status_code=e.status, media_type=e.content_type, headers=hdr)
        except RequestError as e:
            metrics.errors.labels(type(e).__name__).inc()
            return to_response(e, rid if echo_request_id else None)
        except Exception as e:  # noqa: BLE001 - a bug still gets an OpenAI error (and its traceback in the log)
            if orchestrator.closing and isinstance(e, RuntimeError):
                # aiohttp's "Session is closed": the connection pool closed under a request in flight.
                e = ShuttingDown()
            metrics.errors.labels(type(e).__name__).inc()
            return to_response(e, rid if echo_request_id else None)
        headers = dict(hdr)
        if reply.stream is not None:
            headers["Cache-Control"] = "no-cache"
            headers["X-Accel-Buffering"] = "no"
            return OwnedStream(reply.stream, reply.flight, status_code=reply.status,
                               media_type="text/event-stream", headers=headers)
        return Response(reply.body or b"", status_code=reply.status, media_type=reply.content_type or None,
                        headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion("completions", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await completion("responses", request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await completion("messages", request)

    async def stored(method: str, response_id: str, suffix: str, request: Request) -> Response:
        """A stored Responses answer, from the decode engine that keeps it (router/stored.py)."""
        try:
            rid = _request_id(request)
            got = await orchestrator.stored_response(method, response_id, suffix, rid, owner=_owner(request))
        except RequestError as e:
            metrics.errors.labels(type(e).__name__).inc()
            resp: Response = to_response(e)
        else:
            if got is None:
                resp = to_response(NotFound(f"Response with id '{response_id}' not found.", param="response_id"))
            else:
                resp = Response(got[1], status_code=got[0], media_type=got[2] or None)
        metrics.requests.labels("responses", str(resp.status_code)).inc()
        return resp

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return await stored("GET", response_id, "", request)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        return await stored("POST", response_id, "/cancel", request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": served.cards()})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        try:
            return JSONResponse(served.card(served.check(model)))
        except ModelNotFound as e:
            return to_response(e)

    async def one_engine(path: str, what: str, request: Request) -> Response:
        """Requests one engine answers whole, passed to it as they are (after the router's own checks)."""
        try:
            rid = _request_id(request)
            body = await _read_json(request, cfg.max_body_bytes)
            validate.check_depth(body)
            # A tokenize request renders the chat template on the engine: never a client's template.
            handoff.check_chat_template(body)
            body["model"] = served.check(body.get("model"))
            status, raw, ctype = await orchestrator.forward(path, body, rid)
        except RequestError as e:
            metrics.errors.labels(type(e).__name__).inc()
            resp: Response = to_response(e)
        else:
            if status in (404, 405):
                # The engine has no such route: its model does not do this task.
                resp = to_response(BadRequest(f"The model `{model_id}` does not support {what} ({path}); it "
                                              "serves text generation", param="model"))
            else:
                resp = Response(raw, status_code=status, media_type=ctype or None)
        metrics.requests.labels(what, str(resp.status_code)).inc()
        return resp

    def one_engine_route(path: str, what: str) -> None:
        async def handler(request: Request) -> Response:
            return await one_engine(path, what, request)

        app.add_api_route(path, handler, methods=["POST"], name=what)

    for path, what in (("/tokenize", "tokenize"), ("/detokenize", "detokenize"),
                       ("/v1/embeddings", "embeddings"), ("/v1/score", "score")):
        one_engine_route(path, what)

    @app.get("/health")
    async def health() -> Response:
        # Up while some engine can answer: without a decode engine, prefill engines answer whole requests
        # (router/admission.py) unless prefill_fallback is `error`.
        if pool.has("decode") or (pool.has("prefill") and orchestrator.cfg.prefill_fallback != "error"):
            return Response(status_code=200)
        return JSONResponse(error_body("no healthy decode engine", "service_unavailable", 503), status_code=503)

    @app.get("/metrics")
    async def prometheus(engines: int = 1) -> Response:
        """The router's metrics, then (``engines=1``) every engine's ``vllm:*`` metrics with
        ``pdserve_role`` / ``pdserve_replica`` labels."""
        body = metrics.exposition()
        if engines:
            from pdserve.router.metrics import scrape_engines

            body += await scrape_engines(await orchestrator.session(), pool.endpoints())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def kv_status(caller: Caller) -> dict[str, Any]:
        """The KV index's figures; a named tenant does not see the router's cache-hit counters (they count
        every tenant's requests)."""
        summary = pool.kv_index.summary()
        if orchestrator.tenants.enabled and caller.tenant != DEFAULT_TENANT:
            for k in ("routed_blocks", "routed_hit_blocks", "expected_hit_rate"):
                summary.pop(k, None)
        return summary

    @app.get("/pdserve/status")
    async def status(request: Request) -> JSONResponse:
        from pdserve.router.effect import decode_token_sources
        from pdserve.router.metrics import scrape_engines

        decodes = pool.endpoints("decode")
        text = await scrape_engines(await orchestrator.session(), decodes, timeout_s=2.0,
                                    families=("vllm:prompt_tokens_by_source",))
        pulled, local = decode_token_sources(text.decode())
        return JSONResponse({
            "pd_in_effect": orchestrator.effect.summary(pulled, local),
            "model": model_id,
            "version": __version__,
            "engines": [e.as_dict() for e in pool.endpoints()],
            "ingress": getattr(app.state, "ingress", {"mode": "standalone"}),
            "decisions": dict(orchestrator.stats),
            "local_prefill_below_tokens": orchestrator.local_below(),
            **({"kv_cache_routing": kv_status(_caller(request))} if pool.kv_index.engines() else {}),
            # With tenants, each sees its own figures only.
            "tenants": orchestrator.tenants.summary(_caller(request).tenant if orchestrator.tenants.enabled
                                                    else None),
            "router": {"pid": os.getpid(), "rss_bytes": _rss_bytes(), "inflight": orchestrator.admitted["decode"],
                       "request_checks": orchestrator.validator.summary()},
        })

    return app
