"""Where a stream goes on when it cannot go on where it is: another engine after its decode engine failed
(router/migrate.py), or a token-id continuation from the prefill leg's first token when decode computed
another (router/early.py). Both start a stream on an engine not yet tried; the flow (orchestrator.py) wraps
the client's stream with them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from pdserve.errors import NoEngineAvailable, UpstreamError, UpstreamTimeout
from pdserve.router import early, migrate, sse
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient
from pdserve.router.flight import Flight
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import EnginePool
from pdserve.router.request import Request, Route

log = logging.getLogger(__name__)


class Moves:
    def __init__(self, client: EngineClient, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.client = client
        self.pool = pool
        self.metrics = metrics

    def from_first(self, req: Request, first: early.FirstToken, ep: Endpoint, request_id: str, flight: Flight,
                   movable: bool) -> early.Redo:
        """The stream that goes on from the prefill's first token on decode engine ``ep`` when decode
        computed another first token (router/early.py): a token-id completion of the prompt's ids and that
        token, its events in the client's API. It may move on if ``ep`` fails (when ``movable``)."""

        async def redo() -> AsyncIterator[bytes]:
            assert first.prompt_ids is not None and first.token_id is not None
            log.info("request %s: decode's first token differs from the prefill's; going on from the prefill's",
                     request_id)
            tape = migrate.Tape.sent(req, first.prompt_ids, [first.token_id], first.head())
            cbody = migrate.continuation(req, tape)
            if cbody is None:  # the one token was the whole answer
                return sse.once(tape.closing())
            tape.continuing()
            flight.trace.event("early_token_redo", engine=ep.url)
            reply = await self.client.stream(ep, "completions", cbody, request_id, flight.trace.headers("decode"))
            if reply.status != 200 or reply.stream is None:
                log.warning("request %s: the continuation on decode engine %s answered %d: %r", request_id, ep.url,
                            reply.status, (reply.body or b"")[:200])
                raise UpstreamError(f"decode engine answered {reply.status} to the continuation")
            if movable:
                resume = self.resumer(request_id, {ep.url}, flight)
                on_move = lambda outcome: self.metrics.migrations.labels(outcome).inc()  # noqa: E731
            else:
                resume, on_move = _no_resume, None
            return sse.in_band(migrate.resilient(req, reply.stream, resume, on_move, tape=tape), request_id)

        return redo

    def resumer(self, request_id: str, tried: set[str], flight: Flight) -> migrate.Resume:
        """Where a broken stream goes on: another decode replica, else a prefill engine (the same model)."""

        async def resume(route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
            for role in ("decode", "prefill"):
                while True:
                    try:
                        # (one whose batch can run the request's adapter now, where one can)
                        ep = self.pool.pick(role, exclude=tried, prefer=flight.lora_fits)  # type: ignore[arg-type]
                    except NoEngineAvailable:
                        break
                    tried.add(ep.url)
                    try:
                        flight.trace.event("migration", role=role, engine=ep.url)
                        reply = await self.client.stream(ep, route, body, request_id,
                                                         flight.trace.headers("decode"))
                    except (UpstreamError, UpstreamTimeout) as e:
                        log.warning("request %s: %s engine %s cannot continue the stream: %s", request_id, role,
                                    ep.url, e)
                        self.pool.mark_failed(ep)
                        continue
                    if reply.status != 200 or reply.stream is None:
                        log.warning("request %s: %s engine %s answered %d to the stream's continuation: %s",
                                    request_id, role, ep.url, reply.status, (reply.body or b"")[:200])
                        continue
                    log.warning("request %s: the stream goes on on %s engine %s", request_id, role, ep.url)
                    flight.start_stream(ep)
                    return reply.stream
            raise NoEngineAvailable("no other engine is healthy")

        return resume


async def _no_resume(route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A stream's continuation when streams do not move (``router.migrate_streams: false``)."""
    raise NoEngineAvailable("streams do not move to other engines (router.migrate_streams is false)")
