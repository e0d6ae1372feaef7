"""Where stored Responses live: the decode engine that answered each one.

vLLM keeps a Responses API answer (``store``, the default) in the memory of the engine that generated it,
which in P/D is the decode engine. A follow-up naming it (``previous_response_id``), a retrieval
(``GET /v1/responses/{id}``) or a cancellation must reach that engine: the router notes the id of every
answer it passes (read from a non-streamed body, or from the stream's ``response.created`` event) with its
engine, for the most recent :data:`KEEP` responses.

Each stored response belongs to the API key that created it (its ``owner``: a digest of the key, or its
tenant; ``""`` when the app has no keys): a retrieval, a cancellation or a ``previous_response_id`` by
another key finds nothing (404, as for an id that never existed), and a new request may not take a known id
as its own (vLLM makes a body's ``request_id`` the response's id).

The router names each new response itself (:meth:`StoredResponses.new_id`): a tag of its owner, a random
part and a seal of both and the owner, an HMAC under a secret every router replica of the app derives from
the same API keys (:meth:`pdserve.router.auth.ApiKeys.id_secret`). The tag is how the engines bound what
each owner keeps (engine/responses_store.py). A replica that never saw an id can so tell whether it was
made for the caller, and then asks the engines which one keeps it (:meth:`StoredResponses.locate`): a
conversation goes on through any router replica, and no key reaches another's responses.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

from pdserve.owned import OwnedOrder
from pdserve.router import sse
from pdserve.router.endpoint import Endpoint
from pdserve.settings import ANONYMOUS_TAG
from pdserve.settings import RESPONSE_ID_PREFIX as ID_PREFIX
from pdserve.settings import RESPONSE_RANDOM_HEX as RANDOM_HEX
from pdserve.settings import RESPONSE_SEAL_HEX as SEAL_HEX
from pdserve.settings import RESPONSE_TAG_HEX as TAG_HEX

#: Responses whose engine the router remembers (the oldest is forgotten first).
KEEP = 50_000
#: The most of them one key's responses may be (its own oldest are forgotten first past it): one key
#: creating many responses cannot push another's out.
KEEP_PER_OWNER = 10_000
#: Bytes of a stream read for its response id before giving up on finding one.
SNIFF_BYTES = 64 * 1024
#: A response id the router makes (:meth:`new_id`): ``ID_PREFIX``, then this many hex digits (the owner's tag
#: and a random part), then the seal's.
_NONCE_HEX = TAG_HEX + RANDOM_HEX
#: Seconds an engine has to say whether it keeps a response (an engine slower than that is passed over).
LOCATE_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)

#: Asks one engine for a stored response (``GET /v1/responses/{id}``): its status, body and content type.
Fetch = Callable[[Endpoint, str], Awaitable[tuple[int, bytes, str]]]


class StoredResponses:
    """``fetch``: how an engine is asked for a response this replica did not note (None: it is not asked);
    ``secret``: the key of the ids' seals, shared by the app's router replicas (by default one of this
    replica's own, which no other shares)."""

    def __init__(self, keep: int = KEEP, keep_per_owner: int = KEEP_PER_OWNER, *, fetch: Fetch | None = None,
                 secret: bytes | None = None) -> None:
        self.keep = keep
        self.keep_per_owner = keep_per_owner
        self.fetch = fetch
        self.secret = secret or secrets.token_bytes(32)
        self._at: dict[str, tuple[str, str]] = {}  # response id -> (engine url, owner)
        self._order: OwnedOrder[str] = OwnedOrder()  # the response ids by owner, the least recent first
        self._tokens: dict[str, int] = {}  # response id -> its conversation's tokens (input + output)

    def remember(self, response_id: str, ep: Endpoint, owner: str = "") -> None:
        """Note that ``ep`` keeps ``response_id`` for ``owner``. Past ``keep_per_owner``, a key's least recent
        record goes (without keys every response is the one owner's: the whole record is its own); past
        ``keep``, the key keeping the most gives way, its least recent first (as the engines' ledger does):
        under one LRU a few busy keys pushed a quiet key's records out."""
        known = self._at.get(response_id)
        if known is not None and known[1] != owner:
            return  # never hand another key's id over (the router refuses such a request before this)
        self._at[response_id] = (ep.url, owner)
        self._order.add(response_id, owner)
        gone = self._order.trim_owner(owner, self.keep_per_owner) if owner else []
        for rid in gone + self._order.trim(self.keep):
            self._drop(rid)

    def _drop(self, response_id: str) -> None:
        self._at.pop(response_id, None)
        self._tokens.pop(response_id, None)

    def context_tokens(self, response_id: str, owner: str = "") -> int:
        """Tokens of the conversation ``response_id`` ends (its input, the earlier turns included, and its
        output), as its engine reported them; 0 when unknown. A request continuing it
        (``previous_response_id``) makes the engine read all of them again: admission counts them."""
        known = self._at.get(response_id)
        return self._tokens.get(response_id, 0) if known is not None and known[1] == owner else 0

    def _usage(self, response: object) -> None:
        if not isinstance(response, dict):
            return
        rid, usage = response.get("id"), response.get("usage")
        if isinstance(rid, str) and rid in self._at and isinstance(usage, dict):
            total = usage.get("total_tokens")
            if not isinstance(total, int):
                parts = [usage.get("input_tokens"), usage.get("output_tokens")]
                total = sum(x for x in parts if isinstance(x, int))
            if total > 0:
                self._tokens[rid] = total

    def new_id(self, owner: str = "") -> str:
        """The id of a new response of ``owner``'s (the body's ``request_id``, which vLLM stores it under)."""
        nonce = self.owner_tag(owner) + secrets.token_hex(RANDOM_HEX // 2)
        return ID_PREFIX + nonce + self._seal(nonce, owner)

    def owner_tag(self, owner: str) -> str:
        """What an engine sees of ``owner`` in its ids: a keyed digest, the same in every router replica of the
        app and telling nothing of the owner without the secret; :data:`ANONYMOUS_TAG` for no owner."""
        return self._mac(f"owner\0{owner}", TAG_HEX) if owner else ANONYMOUS_TAG

    def _seal(self, nonce: str, owner: str) -> str:
        return self._mac(f"{nonce}\0{owner}", SEAL_HEX)

    def _mac(self, text: str, digits: int) -> str:
        """The first ``digits`` hex digits of an HMAC of ``text`` under the app's id secret."""
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()[:digits]

    def made_for(self, response_id: str, owner: str) -> bool:
        """Whether ``response_id`` is an id a router replica of this app made for ``owner`` (:meth:`new_id`)."""
        body = response_id[len(ID_PREFIX):]
        # (ASCII only: the router's ids are, and compare_digest refuses other strings, which a client may send)
        if not response_id.startswith(ID_PREFIX) or len(body) != _NONCE_HEX + SEAL_HEX or not body.isascii():
            return False
        return hmac.compare_digest(body[_NONCE_HEX:], self._seal(body[:_NONCE_HEX], owner))

    async def locate(self, response_id: str, candidates: list[Endpoint], owner: str = "") -> Endpoint | None:
        """The engine among ``candidates`` that keeps ``response_id`` for ``owner``: the one noted here, else,
        for an id this replica never noted, the one that has it when asked (with keys, only for an id made
        for ``owner``: :meth:`made_for`); None when none does or may."""
        known = self._at.get(response_id)
        if known is not None:
            return self.where(response_id, candidates, owner)
        if self.fetch is None or not candidates or (owner and not self.made_for(response_id, owner)):
            return None
        fetch = self.fetch

        async def ask(ep: Endpoint) -> tuple[Endpoint, object] | None:
            try:
                status, raw, _ = await asyncio.wait_for(fetch(ep, response_id), LOCATE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - an engine that cannot answer keeps nothing, as far as known
                log.debug("asking %s for response %r: %s", ep.url, response_id, e)
                return None
            answer = _json(raw) if status == 200 else None
            return (ep, answer) if answer_id(answer) == response_id else None

        for found in await asyncio.gather(*(ask(ep) for ep in candidates)):
            if found is not None:
                if self._at.get(response_id) is None:  # (not noted meanwhile by a request of this replica)
                    self.remember(response_id, found[0], owner)
                    self._usage(found[1])
                return self.where(response_id, candidates, owner)
        return None

    def known(self, response_id: str) -> bool:
        return response_id in self._at

    def where(self, response_id: str, candidates: list[Endpoint], owner: str = "") -> Endpoint | None:
        """The engine among ``candidates`` (the healthy engines) that holds ``response_id`` for ``owner``."""
        known = self._at.get(response_id)
        if known is None or known[1] != owner:
            return None
        return next((e for e in candidates if e.url == known[0]), None)

    def from_body(self, raw: bytes | None, ep: Endpoint, owner: str = "") -> None:
        answer = _json(raw)
        rid = answer_id(answer)
        if rid is not None:
            self.remember(rid, ep, owner)
            self._usage(answer)

    async def sniff(self, stream: AsyncIterator[bytes], ep: Endpoint, owner: str = "") -> AsyncIterator[bytes]:
        """``stream`` unchanged; the id in its first ``response.*`` event is remembered with ``ep``."""
        ids = IdReader()
        tail = b""  # from the ``response.completed`` event on: its usage is the conversation's length
        async for chunk in stream:
            looking = not ids.done
            rest = ids.feed(chunk)
            if looking and ids.id is not None:
                self.remember(ids.id, ep, owner)
            if rest and (tail or b"response.completed" in rest):
                tail += rest
                if len(tail) > SNIFF_BYTES:
                    tail = b""
                else:
                    self._completed(tail)
            yield chunk

    def _completed(self, text: bytes) -> None:
        for event in text.split(sse.SEP):
            if b"response.completed" in event and isinstance(data := sse.json_of(event), dict):
                self._usage(data.get("response"))


class IdReader:
    """The id of a Responses stream's answer, read from its first ``response.*`` event as the chunks pass
    (the one reader of it: the stored responses here, the handback in :mod:`pdserve.router.handback`)."""

    def __init__(self) -> None:
        self._events = sse.Splitter()
        self._read = 0
        self.id: str | None = None
        #: The id was found, or :data:`SNIFF_BYTES` were read without it (not a Responses stream as known).
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """Read ``chunk`` while looking; what of it follows the event that carried the id (``b""`` while
        looking, the whole chunk once done)."""
        if self.done:
            return chunk
        got = self._events.feed(chunk)
        for i, event in enumerate(got):
            rid = answer_id(_data(event).get("response"))
            if rid is not None:
                self.id, self.done = rid, True
                return b"".join(e + sse.SEP for e in got[i + 1:]) + self._events.rest
        self._read += len(chunk)
        self.done = self._read > SNIFF_BYTES
        return b""


def answer_id(answer: object) -> str | None:
    """A Responses answer's id (``answer``: its JSON object, a whole answer's body or an event's
    ``response``); None when it has none."""
    rid = answer.get("id") if isinstance(answer, dict) else None
    return rid if isinstance(rid, str) and rid else None


def body_id(raw: bytes | None) -> str | None:
    """The id of a whole (non-streamed) Responses answer, from its body."""
    return answer_id(_json(raw))


def _json(raw: bytes | None) -> object:
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return None


def _data(event: bytes) -> dict[str, object]:
    data = sse.json_of(event)
    return data if isinstance(data, dict) else {}
