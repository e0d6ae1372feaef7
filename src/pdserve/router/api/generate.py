"""The generation routes, one per API the engines speak: OpenAI's chat and completions, OpenAI's Responses,
Anthropic's Messages. Each runs the P/D flow (:meth:`Orchestrator.handle`); a stored Responses answer is
read or cancelled on the engine that keeps it."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.errors import BadRequest, NotFound, RequestError
from pdserve.router.api.common import Api, caller, engine_request_id, read_json, request_id
from pdserve.router.http_errors import to_response
from pdserve.router.tracing import TRACE_HEADERS


async def generate(api: Api, route: str, request: Request) -> Response:
    """One generation request, answered whole or streamed; every failure as an OpenAI error."""
    try:
        rid = request_id(request)
    except BadRequest as e:
        resp = api.failed(e, uuid.uuid4().hex)
    else:
        try:
            who = caller(request)
            # A tenant over a limit, or a full router, refuses before the body is read and parsed (the costly part).
            api.orchestrator.gate.before_body(who.tenant)
            body = await read_json(request, api.cfg.max_body_bytes)
            body["model"] = api.served.check(body.get("model"))
            traced = {h: request.headers[h] for h in TRACE_HEADERS if h in request.headers}
            reply = await api.orchestrator.handle(route, body,  # type: ignore[arg-type]
                                                  engine_request_id(request, rid),
                                                  session=request.headers.get("x-session-id"), owner=who.owner,
                                                  tenant=who.tenant, trace_from=traced)
        except Exception as e:  # noqa: BLE001 - a bug still gets an OpenAI error (and its traceback in the log)
            resp = api.failed(e, rid)
        else:
            resp = api.reply(reply, rid)
    api.metrics.requests.labels(route, str(resp.status_code)).inc()
    return resp


def openai_routes(api: Api) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(api, "chat", request)

    @r.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(api, "completions", request)

    return r


def messages_routes(api: Api) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generate(api, "messages", request)

    return r


def responses_routes(api: Api) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate(api, "responses", request)

    async def stored(method: str, response_id: str, suffix: str, request: Request) -> Response:
        """A stored Responses answer, from the decode engine that keeps it (router/stored.py)."""
        try:
            rid = request_id(request)
            who = caller(request)
            # A request as any other to its tenant (asking where an id is kept asks every engine): charged, and
            # refused for a tenant over a limit or a full router.
            gate = api.orchestrator.gate
            gate.before_body(who.tenant)
            ticket = gate.tenants.admit(who.tenant, 0, 0)
            try:
                got = await api.orchestrator.stored_response(method, response_id, suffix, rid, owner=who.owner)
            finally:
                gate.tenants.release(ticket)
        except RequestError as e:
            api.metrics.errors.labels(type(e).__name__).inc()
            resp: Response = to_response(e)
        else:
            if got is None:
                resp = to_response(NotFound(f"Response with id '{response_id}' not found.", param="response_id"))
            else:
                resp = Response(got[1], status_code=got[0], media_type=got[2] or None)
        api.metrics.requests.labels("responses", str(resp.status_code)).inc()
        return resp

    @r.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return await stored("GET", response_id, "", request)

    @r.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        return await stored("POST", response_id, "/cancel", request)

    return r
