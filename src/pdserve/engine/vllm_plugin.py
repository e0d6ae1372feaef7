"""vLLM plugins that let the router see expired KV leases on a prefill engine.

A prefill engine keeps a finished request's KV blocks for the decode engine to pull, for
``kv_lease_duration`` seconds (renewed by decode heartbeats). When the lease runs out first, vLLM frees
the blocks and logs ``Releasing expired KV blocks for request <id> ...``; a decode engine that pulls them
afterwards may read blocks already reused by another request and answer wrong tokens with HTTP 200. vLLM
itself only logs it.

Two plugins, both inert unless ``PDSERVE_KV_EVENTS_FILE`` is set (pdserve's launcher sets it per engine):

* ``vllm.general_plugins`` entry (loaded in every vLLM process, so also where the NIXL worker runs):
  :func:`record_kv_lease_events` appends the request id of every expired lease, and of every pull
  reported after expiry, to the events file.
* ``vllm.endpoint_plugins`` entry (API server process): :class:`KvLeaseEndpoint` answers
  ``GET /pdserve/kv-lease/{request_id}`` from that file, so the router can ask, for a slow handoff,
  whether the blocks it used were still leased — and recompute the prompt when they were not. It also
  answers ``POST /pdserve/check``: vLLM's own request models on a body (engine/request_check.py), which the
  router asks before the prefill leg instead of importing vLLM itself, and ``GET /pdserve/kv-handback/{id}``:
  the blocks a decode engine kept of a finished request, for the next turn's prefill (engine/kv_handback.py,
  ``nixl.bidirectional``; the general plugin installs the note-taking). It puts vLLM's store of Responses
  answers under pdserve's bounds (engine/responses_store.py). With
  ``PDSERVE_ENGINE_KEY`` set it also puts every path but health and metrics behind that bearer key
  (:class:`EngineKeyGuard`): vLLM's own ``--api-key`` covers only ``/v1``, and an engine also answers
  ``/pdserve/kv-lease``, ``/tokenize``, ``/scale_elastic_ep`` and more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from pdserve.settings import KV_EVENTS_CURVE_ENV, kv_events_curve_keys

ENV_FILE = "PDSERVE_KV_EVENTS_FILE"
ENV_KEY = "PDSERVE_ENGINE_KEY"
#: Paths an engine answers without its key: liveness and read-only metrics.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
PLUGIN_NAME = "pdserve_kv_lease"
#: Where the engine checks request bodies for the router (router/validate.py's ``CHECK_PATH``).
CHECK_PATH = "/pdserve/check"

#: vLLM loggers and message prefixes of the two events (vllm/.../nixl/base_worker.py, pull_worker.py).
_EVENTS = {
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker": (
        "Releasing expired KV blocks for request", "expired"),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker": (
        "Potentially invalid KV blocks for", "read_after_expiry"),
}

#: The events file is rotated once past this size (one older file is kept and still read).
MAX_BYTES = 4 << 20

_lock = threading.Lock()


def append_event(path: str, kind: str, request_id: str) -> None:
    """Append one ``kind request_id`` line; rotate to ``path.1`` past :data:`MAX_BYTES`."""
    line = f"{kind} {request_id}\n"
    with _lock:
        try:
            if os.path.getsize(path) > MAX_BYTES:
                os.replace(path, path + ".1")
        except OSError:
            pass
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)


def read_events(path: str, request_id: str) -> dict[str, bool]:
    """Which events the file (and its rotated predecessor) holds for ``request_id``."""
    found = {"expired": False, "read_after_expiry": False}
    for p in (path + ".1", path):
        try:
            with open(p, encoding="utf-8") as f:
                for line in f:
                    kind, _, rid = line.rstrip("\n").partition(" ")
                    if rid == request_id and kind in found:
                        found[kind] = True
        except FileNotFoundError:
            continue
    return found


class _LeaseEventFilter(logging.Filter):
    def __init__(self, path: str, prefix: str, kind: str) -> None:
        super().__init__()
        self.path, self.prefix, self.kind = path, prefix, kind

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith(self.prefix) and isinstance(record.args, tuple) and record.args:
            try:
                append_event(self.path, self.kind, str(record.args[0]))
            except OSError:
                pass  # never break the engine over bookkeeping
        return True  # the message is still logged as usual


def record_kv_lease_events() -> None:
    """General plugin: record lease events of this process's NIXL worker, and keep the KV cache events'
    TCP publisher behind CURVE keys (:func:`secure_kv_events`). Safe to call repeatedly."""
    secure_kv_events()
    from pdserve.engine import kv_handback, kv_memory

    kv_memory.install(os.environ.get(kv_memory.ENV_LAZY))  # CPU engines: KV pages resident as they fill
    kv_handback.install()  # decode engines with nixl.bidirectional: the next turn's blocks (a no-op when off)
    path = os.environ.get(ENV_FILE)
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for name, (prefix, kind) in _EVENTS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LeaseEventFilter) for f in logger.filters):
            logger.addFilter(_LeaseEventFilter(path, prefix, kind))


_authenticators: dict[int, Any] = {}


def curve_bind(sock: Any, engine_key: str) -> None:
    """Make ``sock`` (not yet bound) a CURVE server with the engine's derived keys that accepts only
    clients holding the router's derived key (a ZAP handler on the socket's context, one per context)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq/libzmq has no CURVE support: KV cache events would travel in the clear")
    keys = kv_events_curve_keys(engine_key)
    ctx = sock.context
    if id(ctx) not in _authenticators:
        auth = ThreadAuthenticator(ctx)
        auth.start()

        class RouterOnly:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == keys["client_public"]

        auth.configure_curve_callback(domain="*", credentials_provider=RouterOnly())
        _authenticators[id(ctx)] = auth
    sock.curve_server = True
    sock.curve_secretkey = keys["server_secret"]
    sock.curve_publickey = keys["server_public"]


def secure_kv_events() -> None:
    """With ``PDSERVE_KV_EVENTS_CURVE=1``: vLLM's ZeroMQ KV-event publisher binds TCP endpoints only as a
    CURVE server (:func:`curve_bind`). vLLM's ``BlockStored`` events carry every cached block's token ids,
    ``cache_salt`` values, adapter and session ids; unauthenticated, anyone who reaches the port reads
    every tenant's prompts. Raises (the engine does not start) when it cannot be applied."""
    if os.environ.get(KV_EVENTS_CURVE_ENV) != "1":
        return
    key = os.environ.get(ENV_KEY)
    if not key:
        raise RuntimeError(f"{KV_EVENTS_CURVE_ENV}=1 needs {ENV_KEY}: the KV events' keys derive from it")
    from vllm.distributed import kv_events

    publisher = kv_events.ZmqEventPublisher
    if getattr(publisher, "_pdserve_curve", False):
        return
    vllm_bind = publisher._bind

    def bind(sock: Any, endpoint: str) -> str:
        if endpoint.startswith("tcp://"):
            curve_bind(sock, key)
        return vllm_bind(sock, endpoint)

    publisher._bind = staticmethod(bind)
    publisher._pdserve_curve = True


class EngineKeyGuard:
    """ASGI middleware: a request to any path outside :data:`OPEN_PATHS` must carry ``Authorization: Bearer
    <key>``, else 401 (an OpenAI-style error body)."""

    def __init__(self, app: Any, key: str) -> None:
        import hashlib

        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: dict[str, Any]) -> bool:
        import hashlib
        import hmac

        path = scope.get("path", "")
        if path in OPEN_PATHS and scope.get("method") in ("GET", "HEAD"):
            return True  # fail closed: every other method and path, OPTIONS too, needs the key
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        body = {"error": {"message": "this engine answers only its pdserve router", "type": "unauthorized",
                          "param": None, "code": 401}}
        await JSONResponse(body, status_code=401)(scope, receive, send)


class KvLeaseEndpoint:
    """Endpoint plugin: ``GET /pdserve/kv-lease/{request_id}`` -> ``{"expired": bool, ...}``, and ``POST
    /pdserve/check`` -> vLLM's own verdict on a request body (engine/request_check.py), which the router asks
    for before it spends anything on a request."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        key = os.environ.get(ENV_KEY)
        if key:
            app.add_middleware(EngineKeyGuard, key=key)
        path = os.environ.get(ENV_FILE)

        async def kv_lease(request_id: str) -> JSONResponse:
            if not path:
                return JSONResponse({"error": {"message": f"{ENV_FILE} is not set on this engine",
                                               "type": "not_found", "param": None, "code": 404}},
                                    status_code=404)
            # (up to 8 MiB of events to scan: off the engine's event loop, which serves its streams)
            found = await asyncio.to_thread(read_events, path, request_id)
            return JSONResponse({"request_id": request_id, **found})

        app.add_api_route("/pdserve/kv-lease/{request_id}", kv_lease, methods=["GET"])

        from pdserve.engine import kv_handback

        async def handback(request_id: str) -> JSONResponse:
            kept = kv_handback.take(request_id)
            if kept is None:
                return JSONResponse({"error": {"message": f"no blocks kept for {request_id}", "type": "not_found",
                                               "param": None, "code": 404}}, status_code=404)
            return JSONResponse({"request_id": request_id, **kept})

        app.add_api_route(kv_handback.PATH, handback, methods=["GET"])

        add_check_route(app)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from pdserve.engine import kv_handback, responses_store

        try:
            kv_handback.set_block_size(engine_client.vllm_config.cache_config.block_size)
        except AttributeError:  # no engine behind this server (vLLM's render-only server)
            pass
        bounds = responses_store.bounds_from_env()
        if bounds is not None:  # (vLLM's Responses server exists by now: its state is set before the plugins')
            responses_store.bound(getattr(state, "openai_serving_responses", None), bounds)


#: Checks one engine runs at once (each in a worker thread, so its streams' event loop never waits on one);
#: past that it answers 503 and the router decides with its own rules.
CHECKS_AT_ONCE = 4


def add_check_route(app: Any) -> None:
    """``POST /pdserve/check`` on ``app`` (an engine's API server; the test fakes mount the same route)."""
    import asyncio

    from fastapi import Request
    from fastapi.responses import JSONResponse

    from pdserve.engine import request_check

    # Imported now, not on the first check: the router waits for a verdict only so long (gate.py,
    # ENGINE_CHECK_TIMEOUT_S), and a process that has not imported vLLM's API yet (a test's fake engine)
    # took longer on its first, which then went unchecked. In an engine's API server they are loaded already.
    request_check.engine_models()
    slots = asyncio.Semaphore(CHECKS_AT_ONCE)

    async def check(request: Request) -> JSONResponse:
        if slots.locked():
            return JSONResponse({"error": {"message": "checks are busy on this engine", "type": "busy",
                                           "param": None, "code": 503}}, status_code=503)
        async with slots:
            try:
                data = await request.json()
            except ValueError:
                data = None
            # vLLM's models parse a body of up to the router's size limit: off this loop, which streams tokens.
            status, out = await asyncio.to_thread(request_check.answer, data)
        return JSONResponse(out, status_code=status)

    # (This module's annotations are strings, and FastAPI resolves them in the module's namespace, where
    # Request is not: without the class itself it took ``request`` for a query parameter.)
    check.__annotations__ = {"request": Request, "return": JSONResponse}
    app.add_api_route(CHECK_PATH, check, methods=["POST"])


def plugins_env(current: str | None) -> str:
    """``VLLM_PLUGINS`` for a pdserve engine: endpoint plugins load only when named there, and naming any
    plugin makes it an allow-list, so keep every other general plugin installed (and the user's list)."""
    if current is not None:
        names = [n for n in current.split(",") if n]
    else:
        from importlib.metadata import entry_points

        names = [e.name for g in ("vllm.general_plugins", "vllm.platform_plugins", "vllm.stat_logger_plugins",
                           "vllm.io_processor_plugins")
                 for e in entry_points(group=g)]
    from pdserve.engine.lora import PLUGIN_NAME as LORA_PLUGIN

    names += [PLUGIN_NAME, LORA_PLUGIN]
    return ",".join(dict.fromkeys(names))
