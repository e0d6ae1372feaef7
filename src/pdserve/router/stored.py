"""Where stored Responses live: the decode engine that answered each one.

vLLM keeps a Responses API answer (``store``, the default) in the memory of the engine that generated it,
which in P/D is the decode engine. A follow-up naming it (``previous_response_id``), a retrieval
(``GET /v1/responses/{id}``) or a cancellation must reach that engine: the router notes the id of every
answer it passes (read from a non-streamed body, or from the stream's ``response.created`` event) with its
engine, for the most recent :data:`KEEP` responses.

Each stored response belongs to the API key that created it (its ``owner``: a digest of the key, ``""``
when the app has no keys): a retrieval, a cancellation or a ``previous_response_id`` by another key finds
nothing (404, as for an id that never existed), and a new request may not take a known id as its own
(vLLM makes a body's ``request_id`` the response's id).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator

from pdserve.router import sse
from pdserve.router.pool import Endpoint

#: Responses whose engine the router remembers (the oldest is forgotten first).
KEEP = 50_000
#: Bytes of a stream read for its response id before giving up on finding one.
SNIFF_BYTES = 64 * 1024


class StoredResponses:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._at: OrderedDict[str, tuple[str, str]] = OrderedDict()  # response id -> (engine url, owner)
        self._tokens: dict[str, int] = {}  # response id -> its conversation's tokens (input + output)

    def remember(self, response_id: str, ep: Endpoint, owner: str = "") -> None:
        known = self._at.get(response_id)
        if known is not None and known[1] != owner:
            return  # never hand another key's id over (the router refuses such a request before this)
        self._at[response_id] = (ep.url, owner)
        self._at.move_to_end(response_id)
        while len(self._at) > self.keep:
            gone, _ = self._at.popitem(last=False)
            self._tokens.pop(gone, None)

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

    def known(self, response_id: str) -> bool:
        return response_id in self._at

    def owned_by_another(self, response_id: str, owner: str) -> bool:
        known = self._at.get(response_id)
        return known is not None and known[1] != owner

    def where(self, response_id: str, candidates: list[Endpoint], owner: str = "") -> Endpoint | None:
        """The engine among ``candidates`` (the healthy engines) that holds ``response_id`` for ``owner``."""
        known = self._at.get(response_id)
        if known is None or known[1] != owner:
            return None
        return next((e for e in candidates if e.url == known[0]), None)

    def from_body(self, raw: bytes | None, ep: Endpoint, owner: str = "") -> None:
        try:
            answer = json.loads(raw or b"{}")
            rid = answer.get("id")
        except (ValueError, AttributeError):
            return
        if isinstance(rid, str) and rid:
            self.remember(rid, ep, owner)
            self._usage(answer)

    async def sniff(self, stream: AsyncIterator[bytes], ep: Endpoint, owner: str = "") -> AsyncIterator[bytes]:
        """``stream`` unchanged; the id in its first ``response.*`` event is remembered with ``ep``."""
        events = sse.Splitter()
        found = False
        tail = b""  # from the ``response.completed`` event on: its usage is the conversation's length
        async for chunk in stream:
            rest = chunk
            if not found:
                got = events.feed(chunk)
                for i, event in enumerate(got):
                    if self._event_id(event, ep, owner):
                        found = True
                        rest = b"".join(e + sse.SEP for e in got[i + 1:]) + events.rest
                        break
                else:
                    rest = b""
                    if len(events.rest) > SNIFF_BYTES:
                        found = True  # not a Responses stream as known: stop looking
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

    def _event_id(self, event: bytes, ep: Endpoint, owner: str) -> bool:
        data = sse.json_of(event)
        resp = data.get("response") if isinstance(data, dict) else None
        rid = resp.get("id") if isinstance(resp, dict) else None
        if isinstance(rid, str) and rid:
            self.remember(rid, ep, owner)
            return True
        return False
