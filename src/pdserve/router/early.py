"""The first token at once: a streamed P/D request gets the token the prefill leg already computed.

The prefill leg runs the prompt with ``max_tokens=1``, so its answer holds the request's first token. Without
this, the client waits for the decode leg to pull the KV cache and compute that same token again before it
sees anything. With it, the router sends the prefill's token as the stream's first event as soon as the decode
engine has taken the request, and removes that token from the decode stream when it arrives, so the client
reads every token once.

Exactness: the decode engine computes the first token from the same prompt, so it is the same token when the
choice is deterministic: greedy decoding, or sampling with a seed (both legs draw the first sample from a
generator seeded alike). For sampling without a seed the router gives both legs one random seed of its own
(:func:`seeded`), which keeps the answer random across requests and the two legs in agreement.

The two legs can still disagree: decode computes the prompt's last position on its own (one token over the
pulled KV cache, where prefill ran the whole prompt), and in bfloat16 a near-tie between the two best tokens
may fall the other way (about 2 in 100 requests measured on CPU). The client already holds the prefill's
token, so the answer must go on from it: the decode stream is dropped, and the decode engine continues from
the prompt's ids and that token's (a token-id completion, as a moved stream does, :mod:`.migrate`; its prefix
cache holds the pulled prompt blocks, so it recomputes at most the last partial block). The prefill leg is
asked for those ids (``return_token_ids``). ``pdserve_early_first_token_total{outcome="mismatch"}`` counts
these; ``outcome="mismatch_passed"`` counts the streams that could not go on so (no engine took the
continuation: a request that could not be continued gets no early token) and passed as decode computed
them, with one token more than the usage says. With greedy decoding the answer is then the one the prefill engine,
computing the whole request alone, gives; with a seed, a valid sample that differs from one engine's after
the first token (the continuation's generator starts afresh).

Not used when the first token may not be plain content or the legs may see different sampling: logprobs,
``logit_bias`` and ``min_tokens`` (dropped from the prefill leg), stop strings, tools, per-chunk usage, a reasoning parser on
the engines, a first token that is not complete text (a partial UTF-8 character), or a prefill that stopped;
nor where a mismatch could not be gone on from (:func:`continuable`: a grammar, media, a prompt the engine
cuts, a batch).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router import sse
from pdserve.router.request import Request, Route

log = logging.getLogger(__name__)

#: Starts the stream that goes on from the prefill's token (the client's API events after it).
Redo = Callable[[], Awaitable[AsyncIterator[bytes]]]


@dataclass(frozen=True)
class FirstToken:
    """The prefill leg's token and what the stream's events are labelled with. ``token_id`` and
    ``prompt_ids``: the ids the prefill engine computed (asked for with ``return_token_ids``), with which the
    stream can go on from this token when decode computed another."""

    text: str
    id: str
    created: int
    model: str
    token_id: int | None = None
    prompt_ids: tuple[int, ...] | None = None

    def head(self) -> dict[str, Any]:
        """The fields every event of the client's stream carries."""
        return {"id": self.id, "created": self.created, "model": self.model}


def eligible(req: Request, *, chat_parsers: bool = False) -> bool:
    """Whether this request's stream may start with the prefill leg's token (see the module's description).
    ``chat_parsers``: the engines run a reasoning or tool-call parser, which may withhold chat content."""
    if req.route not in ("chat", "completions"):
        return False  # the Responses and Messages streams have their own event shapes
    if not req.stream or req.n != 1:
        return False
    if req.token_logprobs or req.logit_bias or req.min_tokens:
        return False
    if req.return_token_ids or req.tokens_as_ids:
        return False  # the first event would lack the ids the engine's events carry
    if req.stop:
        return False  # a stream holds back text that may start a stop string; a prefill answer does not
    # Only where a mismatch can be gone on from (else the client would hold the prefill's token and then get
    # decode's stream whole: a doubled first token, JSON a grammar never allowed).
    return continuable(req) and plain_text_events(req, chat_parsers=chat_parsers)


def continuable(req: Request) -> bool:
    """Whether a token-id completion of the prompt's ids and the tokens so far goes on as the engine would:
    one prompt; no grammar (its state is not in the ids); not a prompt the engine cut
    (``truncate_prompt_tokens``: the ids the router holds are not the context it ran on); no image, audio or
    embeddings (a completion of ids would go on without them)."""
    if req.structured or req.prompts > 1 or req.multimodal:
        return False
    return req.body.get("truncate_prompt_tokens") is None


def plain_text_events(req: Request, *, chat_parsers: bool) -> bool:
    """Whether each event of this stream carries its tokens as plain text only: no usage on every event, no
    tool calls, no reasoning or tool-call parser that may hold chat content back. The router may then make
    such events itself (the early first token, a moved stream's continuation)."""
    if req.usage_per_event:
        return False
    return req.route != "chat" or not (chat_parsers or req.tool_calls)


def seeded(req: Request) -> Request:
    """``req`` with a seed of the router's when it samples without one (see the module's description)."""
    if req.greedy or req.seed is not None:
        return req
    return req.with_body({**req.body, "seed": random.randrange(1 << 31)})


def from_prefill(route: Route, answer: dict[str, Any]) -> FirstToken | None:
    """The first token of a prefill answer, when the stream can start with it."""
    try:
        choice = answer["choices"][0]
        text = choice["text"] if route == "completions" else choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    if choice.get("finish_reason") != "length" or not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    ids = choice.get("token_ids")
    prompt = choice.get("prompt_token_ids") if route == "completions" else answer.get("prompt_token_ids")
    token_id = ids[0] if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int) else None
    prompt_ids = (tuple(prompt) if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt)
                  else None)
    return FirstToken(text=text, id=str(answer.get("id", "")), created=int(answer.get("created") or 0),
                      model=str(answer.get("model", "")), token_id=token_id, prompt_ids=prompt_ids)


def first_events(route: Route, tok: FirstToken) -> bytes:
    """The SSE events that carry the token, shaped as vLLM streams them."""
    head = tok.head()
    if route == "completions":
        events = [{**head, "object": "text_completion",
                   "choices": [{"index": 0, "text": tok.text, "logprobs": None, "finish_reason": None,
                                "stop_reason": None}]}]
    else:
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {"content": tok.text}, "logprobs": None,
                                   "finish_reason": None}]},
        ]
    return b"".join(sse.encode(e) for e in events)


async def splice(route: Route, tok: FirstToken, decode: AsyncIterator[bytes],
                 outcome: Callable[[str], None] | None = None, redo: Redo | None = None) -> AsyncIterator[bytes]:
    """The stream the client reads: the prefill's token, then the decode stream less that token.

    Decode events before its first token (chat's role event) are dropped, since the first events carried
    them; the text of the first token is taken off the events that carry it (one, or several when the engine
    holds text back). After that the decode stream passes through as bytes, unparsed. When decode's first
    token is another, ``redo()`` starts the stream that goes on from the prefill's token and the decode
    stream is closed (its engine aborts the request); without ``redo``, or when it fails, the decode stream
    passes unchanged. ``outcome(label)`` is told ``sent``, ``mismatch`` and, when the decode stream passed
    after a mismatch, ``mismatch_passed``."""
    yield first_events(route, tok)
    cut = _Cut(route, tok.text, outcome)
    events = sse.Splitter()
    it = decode.__aiter__()
    async for chunk in it:
        for i, event in enumerate(got := events.feed(chunk)):
            kept = cut.event(event + sse.SEP)
            if cut.mismatch:
                again = await _redone(redo, outcome)
                if again is not None:
                    await it.aclose()  # type: ignore[attr-defined]
                    async for rest in again:
                        yield rest
                    return
            same = _as_first(tok, cut.created)
            if kept:
                yield same(kept)
            if cut.done:
                left = b"".join(e + sse.SEP for e in got[i + 1:]) + events.rest
                if left:
                    yield same(left)
                async for rest in it:
                    yield same(rest)
                return
    if events.rest:
        yield events.rest


def _as_first(tok: FirstToken, created: Any) -> Callable[[bytes], bytes]:
    """Decode's events with the first events' ``created`` (stamped when prefill started; decode's, a second
    or more later, would change mid-stream). A byte replace: inside a JSON string every quote is escaped, so
    ``"created":`` matches only the field."""
    if not isinstance(created, int) or isinstance(created, bool) or created == tok.created:
        return lambda b: b
    field = re.compile(rb'"created":\s*' + str(created).encode() + rb"(?=[,}\s])")
    new = b'"created":%d' % tok.created
    return lambda b: field.sub(new, b)


async def _redone(redo: Redo | None, outcome: Callable[[str], None] | None) -> AsyncIterator[bytes] | None:
    """The stream that goes on from the prefill's token, or ``None`` when the decode stream is to pass."""
    again = None
    if redo is not None:
        try:
            again = await redo()
        except Exception as e:  # noqa: BLE001 - any failure to start it leaves the decode stream as it was
            log.warning("the stream could not go on from the prefill's first token (%s); decode's passes", e)
    if again is None and outcome is not None:
        outcome("mismatch_passed")
    return again


class _Cut:
    """Takes the first token's text off the decode events that carry it."""

    def __init__(self, route: Route, text: str, outcome: Callable[[str], None] | None) -> None:
        self.route, self.pending, self.outcome = route, text, outcome
        self.done = False
        self.mismatch = False
        #: Decode's ``created``, from its first event with data.
        self.created: Any = None

    def _end(self, label: str | None) -> None:
        self.done = True
        self.mismatch = label == "mismatch"
        if label and self.outcome is not None:
            self.outcome(label)

    def event(self, event: bytes) -> bytes:
        if sse.is_done(event):
            self._end("mismatch")  # the stream ended before the token came back
            return event
        if sse.data_of(event) is None:
            return event
        try:
            data = sse.json_of(event)
            if self.created is None and isinstance(data, dict):
                self.created = data.get("created")
            choice = data["choices"][0]
            key = "text" if self.route == "completions" else "content"
            holder = choice if self.route == "completions" else choice["delta"]
            text = holder.get(key)
        except (ValueError, KeyError, IndexError, TypeError):
            self._end(None)  # an error event, or a shape this does not know: everything passes from here on
            return event
        if not text:
            if choice.get("finish_reason") is not None:
                self._end("mismatch")
                return event
            return b""  # chat's role event (sent already), or an empty delta
        if text.startswith(self.pending):
            self._end("sent")
            rest = text[len(self.pending):]
            if not rest and choice.get("finish_reason") is None and not data.get("usage"):
                return b""
            holder[key] = rest
            return sse.encode(data)
        if self.pending.startswith(text):
            self.pending = self.pending[len(text):]  # the engine sent part of the token's text so far
            return b""
        self._end("mismatch")
        return event
