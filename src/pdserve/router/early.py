"""The first token at once: a streamed P/D request gets the token the prefill leg already computed.

The prefill leg runs the prompt with ``max_tokens=1``, so its answer holds the request's first token. Without
this, the client waits for the decode leg to pull the KV cache and compute that same token again before it
sees anything. With it, the router sends the prefill's token as the stream's first event as soon as the decode
engine has taken the request, and removes that token from the decode stream when it arrives, so the client
reads every token once.

Exactness: the decode engine computes the first token from the same prompt, so it is the same token when the
choice is deterministic: greedy decoding, or sampling with a seed (both legs draw the first sample from a
generator seeded alike). For sampling without a seed the router gives both legs one random seed of its own
(:func:`seeded`), which keeps the answer random across requests and the two legs in agreement. If the decode
stream's first token still differs (floating-point ties between the two engines' computations), the decode
stream passes unchanged and ``pdserve_early_first_token_total{outcome="mismatch"}`` counts it.

Not used when the first token may not be plain content or the legs may see different sampling: logprobs,
``logit_bias`` and ``min_tokens`` (dropped from the prefill leg), stop strings, tools, per-chunk usage, a reasoning parser on
the engines, a first token that is not complete text (a partial UTF-8 character), or a prefill that stopped.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdserve.router.handoff import Route


@dataclass(frozen=True)
class FirstToken:
    """The prefill leg's token and what the stream's events are labelled with."""

    text: str
    id: str
    created: int
    model: str


def eligible(route: Route, body: dict[str, Any], *, chat_parsers: bool = False) -> bool:
    """Whether this request's stream may start with the prefill leg's token (see the module's description).
    ``chat_parsers``: the engines run a reasoning or tool-call parser, which may withhold chat content."""
    if route not in ("chat", "completions"):
        return False  # the Responses and Messages streams have their own event shapes
    if not body.get("stream") or (body.get("n") or 1) != 1:
        return False
    if body.get("logprobs") or body.get("top_logprobs") or body.get("logit_bias") or body.get("min_tokens"):
        return False
    if body.get("return_token_ids") or body.get("return_tokens_as_token_ids"):
        return False  # the first event would lack the ids the engine's events carry
    if body.get("stop"):
        return False  # a stream holds back text that may start a stop string; a prefill answer does not
    return plain_text_events(route, body, chat_parsers=chat_parsers)


def plain_text_events(route: Route, body: dict[str, Any], *, chat_parsers: bool) -> bool:
    """Whether each event of this stream carries its tokens as plain text only: no usage on every event, no
    tool calls, no reasoning or tool-call parser that may hold chat content back. The router may then make
    such events itself (the early first token, a moved stream's continuation)."""
    opts = body.get("stream_options") or {}
    if isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        return False
    if route == "chat":
        if chat_parsers:
            return False
        if body.get("tools") and body.get("tool_choice") != "none":
            return False
    return True


def seeded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a seed of the router's when it samples without one (see the module's description)."""
    temperature = body.get("temperature")
    greedy = temperature is not None and float(temperature) == 0.0
    if greedy or body.get("seed") is not None:
        return body
    return {**body, "seed": random.randrange(1 << 31)}


def from_prefill(route: Route, answer: dict[str, Any]) -> FirstToken | None:
    """The first token of a prefill answer, when the stream can start with it."""
    try:
        choice = answer["choices"][0]
        text = choice["text"] if route == "completions" else choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    if choice.get("finish_reason") != "length" or not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    return FirstToken(text=text, id=str(answer.get("id", "")), created=int(answer.get("created") or 0),
                      model=str(answer.get("model", "")))


def first_events(route: Route, tok: FirstToken) -> bytes:
    """The SSE events that carry the token, shaped as vLLM streams them."""
    head = {"id": tok.id, "created": tok.created, "model": tok.model}
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
    return b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)


async def splice(route: Route, tok: FirstToken, decode: AsyncIterator[bytes],
                 outcome: Any = None) -> AsyncIterator[bytes]:
    """The stream the client reads: the prefill's token, then the decode stream less that token.

    Decode events before its first token (chat's role event) are dropped, since the first events carried
    them; the text of the first token is taken off the events that carry it (one, or several when the engine
    holds text back). After that the decode stream passes through as bytes, unparsed. ``outcome(label)`` is
    told ``sent`` or ``mismatch``."""
    yield first_events(route, tok)
    cut = _Cut(route, tok.text, outcome)
    buf = b""
    it = decode.__aiter__()
    async for chunk in it:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            kept = cut.event(event + b"\n\n")
            if kept:
                yield kept
            if cut.done:
                if buf:
                    yield buf
                async for rest in it:
                    yield rest
                return
    if buf:
        yield buf


class _Cut:
    """Takes the first token's text off the decode events that carry it."""

    def __init__(self, route: Route, text: str, outcome: Any) -> None:
        self.route, self.pending, self.outcome = route, text, outcome
        self.done = False

    def _end(self, label: str | None) -> None:
        self.done = True
        if label and self.outcome is not None:
            self.outcome(label)

    def event(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            if line == b"data: [DONE]":
                self._end("mismatch")  # the stream ended before the token came back
            return event
        try:
            data = json.loads(line[6:])
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
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
        if self.pending.startswith(text):
            self.pending = self.pending[len(text):]  # the engine sent part of the token's text so far
            return b""
        self._end("mismatch")
        return event
