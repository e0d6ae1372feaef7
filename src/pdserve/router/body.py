"""A request's body, from its bytes to the JSON object the checks read (router/validate.py).

Parsing and walking a body is Python work, and the router's event loop serves every stream and ``/health``
too: a 16 MiB body of empty arrays took 7 s of it. So a body is first sized up by its bytes (arrays and
objects as ``[`` and ``{``, items as ``,``: over-counts, a string's count too) and refused past the bounds
before it is parsed; a body past :data:`BIG_BODY_BYTES` is parsed, and later checked, in a worker thread,
one at a time.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from contextvars import ContextVar
from typing import Any

from pdserve.errors import BadRequest

#: Deepest nesting of arrays and objects a body may have (the top-level object is level 1). The deepest
#: part of a real request is a JSON schema (a tool's parameters, a response format): vLLM takes schemas up
#: to 64 levels deep, and a tool's schema starts 5 levels down in the body.
MAX_DEPTH = 80
#: Arrays and objects a body may hold, as its ``[`` and ``{`` bytes: a 16 MiB body of empty arrays
#: (``"prompt": [[], [], ...]``, 5.6 million) took 7 s of the loop to parse and walk. A 128k-token prompt of
#: code holds some tens of thousands.
MAX_CONTAINERS = 200_000
#: Items a body may hold, as its ``,`` bytes: Python's JSON parser holds the interpreter for the whole parse,
#: in whatever thread, and 8.4 million numbers (a 16 MiB token-id prompt) held the loop for 1.1 s. Two
#: million is past any model's context as token ids.
MAX_ITEMS = 2_000_000
#: Bodies larger than this are parsed in a worker thread, one at a time (:func:`parse_body_off_loop`).
BIG_BODY_BYTES = 1 << 20
#: One big parse at a time, per event loop: the others wait on the loop, not in the worker threads that
#: chat rendering and the engines' metrics need too (a thread waiting its turn held one of the few).
_BIG_PARSE: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
#: The size of the body the request being handled came in (set where it is parsed, read by
#: :meth:`RequestValidator.check` in the same task): a big one is checked in a worker thread too.
BODY_BYTES: ContextVar[int] = ContextVar("pdserve_body_bytes", default=0)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as the JSON object it must be, or :class:`BadRequest` saying what is wrong with it:
    empty, more than :data:`MAX_CONTAINERS` arrays and objects or :data:`MAX_ITEMS` items, not UTF-8, not
    JSON, nested deeper than :data:`MAX_DEPTH`, or not an object."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_CONTAINERS:
        raise BadRequest(f"request body holds {containers} arrays and objects (counting '[' and '{{' bytes); "
                         f"at most {MAX_CONTAINERS}")
    items = raw.count(b",")
    if items > MAX_ITEMS:
        raise BadRequest(f"request body holds {items} items (counting ',' bytes); at most {MAX_ITEMS}")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from e
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError:
        raise BadRequest(f"request body nests arrays and objects deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    check_depth(body)
    return body


async def parse_body_off_loop(raw: bytes) -> dict[str, Any]:
    """:func:`parse_body`, in a worker thread for a body past :data:`BIG_BODY_BYTES`, one such body at a time
    (the others wait their turn on the loop): a few large bodies together cannot hold the event loop, and
    the streams and probes it serves, for the seconds their parsing takes."""
    BODY_BYTES.set(len(raw))
    if len(raw) <= BIG_BODY_BYTES:
        return parse_body(raw)
    loop = asyncio.get_running_loop()
    turn = _BIG_PARSE.get(loop)
    if turn is None:
        turn = _BIG_PARSE[loop] = asyncio.Semaphore(1)
    async with turn:
        return await asyncio.to_thread(parse_body, raw)


def check_depth(body: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse a body nested deeper than ``limit`` levels, naming the top-level field it is under."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    containers = (dict, list)
    while stack:
        node, depth, top = stack.pop()
        if depth > limit:
            raise BadRequest(f"the request nests arrays and objects deeper than {limit} levels", param=top)
        if isinstance(node, dict):
            stack.extend((v, depth + 1, top if top is not None else str(k))
                         for k, v in node.items() if type(v) in containers)
        else:
            stack.extend((v, depth + 1, top) for v in node if type(v) in containers)
