"""The router's HTTP client for the engines' own OpenAI servers.

One pooled aiohttp session (keep-alive connections, no decompression), and one way to send: a request that
meets a kept-alive connection the engine closed as it was reused is sent once more on a new connection
(nothing was processed; see :func:`stale_connection`), any other failure becomes :class:`UpstreamError` or
:class:`UpstreamTimeout`. Every request holds a claim on its engine (``Endpoint.inflight``) for as long as it
runs, a stream until its last byte. Streaming bytes are passed on as they arrive, unparsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from pdserve.config.schema import RouterConfig
from pdserve.errors import BadRequest, EngineRefusedKey, ShuttingDown, UpstreamError, UpstreamTimeout
from pdserve.router import sse
from pdserve.router.endpoint import Endpoint
from pdserve.router.flight import Flight
from pdserve.router.request import Route

log = logging.getLogger(__name__)

# How long the router keeps an idle engine connection: below the engines' own keep-alive
# (pdserve.engine.launcher.ENGINE_KEEP_ALIVE_S), so the engine is not the side that closes it.
ROUTER_KEEP_ALIVE_S = 20.0

#: Marks an answer of an engine's check endpoint as its verdict (engine/request_check.py's ``VERDICT``).
CHECK_VERDICT = "pdserve_check"
#: An engine that gives no verdict is logged at most this often.
CHECK_WARN_EVERY_S = 60.0

PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                           "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class UpstreamReply:
    """What the router hands back: a finished body or a byte stream, with status and headers."""

    status: int
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    content_type: str = "application/json"
    flight: Flight | None = None  # a stream's claims, released when the response ends
    endpoint: Endpoint | None = None  # the decode engine that answered


#: What an engine answers a key it does not take (pdserve's engine plugin: 401).
REFUSED_KEY = (401, 403)


def refused_key(ep: Endpoint, status: int) -> EngineRefusedKey:
    """The engine at ``ep`` refused the router's key for it: taken out of rotation (``ep.refused_key``)
    until the registry names the replica anew, and the request goes elsewhere or gets a 502 (a 401 passed
    on would tell an authorized client it is not)."""
    if not ep.refused_key:
        log.error("%s engine %s: the server at %s refused this engine's key (HTTP %d): another process answers "
                  "there (or a new engine that replaced it); out of rotation until the app's registry names it "
                  "anew", ep.role, ep.replica_id or ep.engine_id, ep.url, status)
    ep.refused_key = True
    ep.healthy = False
    return EngineRefusedKey(f"a {ep.role} engine refused the router's key (HTTP {status}): another process "
                            "answers at its address")  # (the address itself only in the router's log)


def failed(ep: Endpoint, e: BaseException, request_id: str) -> UpstreamError:
    """An engine that could not be reached or broke off: what went wrong, with its address, in the router's log;
    the client's error names the role and the kind of failure only (an address of the app's inside is not the
    client's business)."""
    log.info("request %s: %s engine at %s failed: %s", request_id, ep.role, ep.url, e)
    return UpstreamError(f"{ep.role} engine failed ({type(e).__name__})")


def stale_connection(e: BaseException) -> bool:
    """Whether ``e`` is an engine closing a pooled keep-alive connection just as the router reused it: the
    write fails or the connection ends before any answer. Nothing was processed, so the same engine may
    get the request again on a new connection. A refused connection is not this: the engine is down."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return False
    return isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))


#: A whole answer past this many bytes has its ``usage`` read alone (:func:`usage`).
BIG_ANSWER_BYTES = 1 << 20


def usage(raw: bytes | None) -> dict[str, int]:
    """The ``usage`` object of a non-streamed answer (empty when there is none), in OpenAI's names (the
    Responses and Messages APIs say ``input_tokens`` / ``output_tokens``). Of an answer past
    :data:`BIG_ANSWER_BYTES`, only that object is parsed: prompt logprobs of a long prompt make tens of
    megabytes, whose whole parse holds the interpreter (and every stream the router serves) for seconds, in
    any thread. Its key as bytes, ``"usage":``, cannot occur inside a JSON string (quotes there are
    escaped); the last one is the answer's own."""
    try:
        if raw is not None and len(raw) > BIG_ANSWER_BYTES:
            at = raw.rfind(b'"usage":')
            found = json.JSONDecoder().raw_decode(raw[at + 8:].decode().lstrip())[0] if at >= 0 else {}
            found = found if isinstance(found, dict) else {}
        else:
            found = json.loads(raw or b"{}").get("usage") or {}
        out = {k: int(v) for k, v in found.items() if isinstance(v, (int, float))}
    except (ValueError, AttributeError, TypeError):
        return {}
    for theirs, ours in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
        if theirs in out:
            out.setdefault(ours, out[theirs])
    return out


@contextmanager
def claimed(ep: Endpoint) -> Iterator[None]:
    """``ep`` counts one more request in flight while the block runs."""
    ep.start_request()
    try:
        yield
    finally:
        ep.inflight -= 1


class EngineClient:
    def __init__(self, cfg: RouterConfig, on_broken: Callable[[Endpoint], None] | None = None) -> None:
        self.cfg = cfg
        #: Told of an engine whose stream broke mid-way (the pool marks it failed; its probe brings it back).
        self.on_broken = on_broken
        self._session: aiohttp.ClientSession | None = None
        #: Set when the router shuts down: new requests get a 503, not a new connection pool.
        self.closing = False
        self._check_warned: dict[str, float] = {}  # engine url -> when a missing verdict was last logged

    async def session(self) -> aiohttp.ClientSession:
        if self.closing:
            raise ShuttingDown()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # Idle connections are dropped well before the engines drop them (ENGINE_KEEP_ALIVE_S), so
                # the router rarely reuses one the engine is closing; stale_connection() covers the rest.
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=ROUTER_KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        self.closing = True
        if self._session is not None:
            await self._session.close()

    async def healthy(self, ep: Endpoint, timeout_s: float = 5.0) -> bool:
        """The engine's ``/health`` answered 200."""
        try:
            s = await self.session()
            async with s.get(ep.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ShuttingDown):
            return False

    async def check_body(self, ep: Endpoint, route: Route, body: dict[str, Any], path: str,
                         timeout_s: float) -> dict[str, Any] | None:
        """vLLM's own check of ``body`` on ``ep`` (router/validate.py, step 3): the decided fields as the
        engine parsed them; raises :class:`BadRequest` as the engine names the refused field; None when the
        engine gave no verdict (unreachable, slow, busy, without pdserve's check endpoint, or any answer not
        marked as the check's own: vLLM's server answers 400 for failures of its own too). Holds no claim: a
        check is not work the engine's load should count."""
        outcome = "no_verdict"
        try:
            s = await self.session()
            async with s.post(ep.url + path, data=json.dumps({"route": route, "body": body}),
                              headers={"Content-Type": "application/json", **ep.auth()},
                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                status, raw = r.status, await r.read()
            answer = json.loads(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            status, answer, outcome = 0, None, f"{type(e).__name__}: {e}"
        verdict = isinstance(answer, dict) and answer.get(CHECK_VERDICT) is True
        if verdict and status == 400 and isinstance(answer.get("error"), dict):
            err = answer["error"]
            param = err.get("param")
            raise BadRequest(str(err.get("message") or "invalid request"),
                             param=param if isinstance(param, str) else None)
        decided = answer.get("decided") if verdict and status == 200 else None
        if isinstance(decided, dict):
            return decided
        now = time.monotonic()
        if now - self._check_warned.get(ep.url, -CHECK_WARN_EVERY_S) >= CHECK_WARN_EVERY_S:
            self._check_warned[ep.url] = now
            log.warning("%s engine %s gave no verdict on a request (HTTP %s, %s); the router's own rules decide "
                        "(logged once a minute per engine)", ep.role, ep.url, status or "-", outcome)
        return None

    async def _send(self, ep: Endpoint, method: str, path: str, body: dict[str, Any] | None, request_id: str,
                    timeout_s: float, extra: Mapping[str, str] | None = None) -> aiohttp.ClientResponse:
        """The engine's response (headers read, body not yet), sent again once on a new connection when a
        kept-alive one turned out closed. Raises :class:`UpstreamError` / :class:`UpstreamTimeout`."""
        s = await self.session()
        headers = {"X-Request-Id": request_id, **ep.auth(), **(extra or {})}
        if body is not None:
            headers["Content-Type"] = "application/json"
        data = json.dumps(body) if body is not None else None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.cfg.connect_timeout_s)
        for attempt in (1, 2):
            try:
                resp = await s.request(method, ep.url + path, data=data, headers=headers, timeout=timeout)
            except aiohttp.ConnectionTimeoutError as e:
                # Not reached at all: the engine's failure (another replica may take the request), unlike a
                # timeout while it works on the request (UpstreamTimeout).
                raise UpstreamError(f"{ep.role} engine could not be reached within "
                                    f"{self.cfg.connect_timeout_s:g}s") from e
            except asyncio.TimeoutError as e:
                raise UpstreamTimeout(f"{ep.role} engine did not answer within {timeout_s:g}s") from e
            except (aiohttp.ClientError, OSError) as e:
                if attempt == 1 and stale_connection(e):
                    log.info("request %s: %s engine %s closed a kept-alive connection as it was reused (%s); "
                             "sending again on a new one", request_id, ep.role, ep.url, e)
                    continue
                raise failed(ep, e, request_id) from e
            if resp.status in REFUSED_KEY and ep.api_key:
                resp.release()
                raise refused_key(ep, resp.status)
            return resp
        raise AssertionError("unreachable")

    async def call(self, ep: Endpoint, method: str, path: str, body: dict[str, Any] | None, request_id: str,
                   timeout_s: float, headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str]:
        """One whole request and answer: status, body, content type. ``headers``: more to send (a trace's)."""
        with claimed(ep):
            resp = await self._send(ep, method, path, body, request_id, timeout_s, headers)
            try:
                raw = await resp.read()
            except asyncio.TimeoutError as e:
                raise UpstreamTimeout(f"{ep.role} engine did not answer within {timeout_s:g}s") from e
            except (aiohttp.ClientError, OSError) as e:
                raise failed(ep, e, request_id) from e
            finally:
                resp.release()
            return resp.status, raw, resp.headers.get("Content-Type", "application/json")

    async def post(self, ep: Endpoint, route: Route | str, body: dict[str, Any], request_id: str,
                   timeout_s: float, headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str]:
        """POST ``body`` at a route's path (or a path given as such): status, body, content type."""
        path = PATHS[route] if route in PATHS else route  # type: ignore[index]
        return await self.call(ep, "POST", path, body, request_id, timeout_s, headers)

    async def stored(self, ep: Endpoint, method: str, response_id: str, suffix: str, request_id: str,
                     ) -> tuple[int, bytes, str]:
        """A stored Responses answer's route on the engine that keeps it (GET it, or POST ``/cancel``)."""
        path = f"/v1/responses/{quote(response_id, safe='')}{suffix}"
        return await self.call(ep, method, path, None, request_id, self.cfg.decode_timeout_s)

    async def stream(self, ep: Endpoint, route: Route, body: dict[str, Any], request_id: str,
                     headers: Mapping[str, str] | None = None) -> UpstreamReply:
        """A streamed answer: its bytes as they arrive (the claim on ``ep`` lasts until the last one), or the
        engine's error answer whole. A stream that outlives ``decode_timeout_s`` ends with an in-band error
        event; a connection that breaks raises :class:`~pdserve.router.sse.StreamBroke` to the reader (the
        engine is reported to ``on_broken``)."""
        timeout = self.cfg.decode_timeout_s
        ep.start_request()
        try:
            resp = await self._send(ep, "POST", PATHS[route], body, request_id, timeout, headers)
        except BaseException:
            ep.inflight -= 1
            raise
        if resp.status != 200:
            try:
                raw = await resp.read()
            finally:
                resp.release()
                ep.inflight -= 1
            return UpstreamReply(status=resp.status, body=raw, content_type=resp.headers.get("Content-Type", ""))

        async def relay() -> AsyncIterator[bytes]:
            started = time.monotonic()
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except asyncio.TimeoutError:
                # The stream outlived decode_timeout_s: it ends here, in-band (it is not moved elsewhere).
                log.warning("request %s: decode stream on %s passed %gs", request_id, ep.url, timeout)
                yield sse.error_event(f"decode engine did not finish within {timeout:g}s", 504)
            except (aiohttp.ClientError, OSError) as e:
                log.warning("request %s: decode stream on %s broke after %.1fs: %s", request_id, ep.url,
                            time.monotonic() - started, e)
                if self.on_broken is not None:
                    self.on_broken(ep)
                raise sse.StreamBroke(f"decode engine failed mid-stream: {e}") from e
            finally:
                if resp.content.at_eof():
                    resp.release()
                else:
                    # The client left (or the stream broke): closing the connection makes the decode
                    # engine abort the request and free its blocks.
                    resp.close()
                ep.inflight -= 1

        return UpstreamReply(status=200, stream=relay(), content_type="text/event-stream")
