"""Routes one engine answers whole (tokenize, detokenize, embeddings, score): no handoff, passed to a prefill
engine when there is one (they hold no streams), after the router's own checks and within the caller's
tenant limits (requests per second, concurrent requests, prompt tokens per minute at a quarter of the body's
bytes), as for generation: a tenant at its limits cannot go on loading an engine by these routes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.errors import BadRequest, RequestError
from pdserve.router import handoff, media
from pdserve.router.api.common import Api, caller, engine_request_id, read_json, request_id
from pdserve.router.body import BODY_BYTES
from pdserve.router.http_errors import to_response

ROUTES = (("/tokenize", "tokenize"), ("/detokenize", "detokenize"), ("/v1/embeddings", "embeddings"),
          ("/v1/score", "score"))
#: Routes whose engine runs the model over the prompt (vLLM's pooling requests), with a prefix cache a
#: tenant's salt keeps its own, as on generation.
SALTED = ("/v1/embeddings", "/v1/score")


def one_engine_routes(api: Api) -> APIRouter:
    r = APIRouter()

    async def one_engine(path: str, what: str, request: Request) -> Response:
        try:
            rid = request_id(request)
            tenants, tenant = api.orchestrator.gate.tenants, caller(request).tenant
            api.orchestrator.gate.before_body(tenant)
            body = await read_json(request, api.cfg.max_body_bytes)  # (its nesting checked there)
            # A tokenize request renders the chat template on the engine: never a client's template.
            handoff.check_chat_template(body)
            media.check(body, api.orchestrator.gate.validator.limits.media_domains)  # (the engine renders it)
            body["model"] = api.served.check(body.get("model"))
            # A token per 4 bytes of the body as read (a chunked body has no Content-Length to trust).
            ticket = tenants.admit(tenant, BODY_BYTES.get() // 4, 0)
            if path in SALTED and (salt := tenants.salt(tenant, body.get("cache_salt"))) is not None:
                body["cache_salt"] = salt
            try:
                status, raw, ctype = await api.orchestrator.forward(path, body, engine_request_id(request, rid))
            finally:
                tenants.release(ticket)
        except RequestError as e:
            api.metrics.errors.labels(type(e).__name__).inc()
            resp: Response = to_response(e)
        else:
            if status in (404, 405):
                # The engine has no such route: its model does not do this task.
                resp = to_response(BadRequest(f"The model `{api.model_id}` does not support {what} ({path}); "
                                              "it serves text generation", param="model"))
            else:
                resp = Response(raw, status_code=status, media_type=ctype or None)
        api.metrics.requests.labels(what, str(resp.status_code)).inc()
        return resp

    def add(path: str, what: str) -> None:
        async def handler(request: Request) -> Response:
            return await one_engine(path, what, request)

        r.add_api_route(path, handler, methods=["POST"], name=what)

    for path, what in ROUTES:
        add(path, what)
    return r
