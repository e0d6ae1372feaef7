"""A decode engine that dies mid-stream does not end the client's stream: the answer goes on elsewhere.

The decode leg of an eligible stream asks its engine for the token ids it generates (``return_token_ids``),
and a :class:`Tape` notes, event by event, the prompt's ids and every generated id the client has been sent
(the ids are taken off the events again unless the client asked for them). When the engine's connection
breaks, or its stream ends without ``[DONE]``, the router sends ``prompt ids + generated ids`` as a token-id
completion to another decode replica (or, with none left, a prefill engine: both run the same model), with
the output budget less what was generated, and turns that engine's events back into the client's API
(chat chunks, the first stream's id, created and model, usage counting every token). The client reads one
stream with each token once.

Exactness: greedy decoding continues with the very tokens one engine would have produced (the new engine
computes the same prompt + tokens). Seeded sampling continues validly but not identically (the new engine's
generator starts fresh), and ``frequency_penalty`` / ``presence_penalty`` count only the continuation's own
tokens as output.

Not eligible (their stream is ended with an in-band error event, as before): the Responses and Messages
APIs, ``n`` > 1, logprobs, ``echo``, stop strings (the engine holds back text that may start one, which the
ids already sent would not carry over), structured outputs (the grammar's state does not carry over), tools,
chat when the engines run a reasoning or tool-call parser, and prompts whose ids are not all the engine saw
(images, audio, embeddings; a prompt the engine cut).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pdserve.router import sse
from pdserve.router.early import continuable, plain_text_events
from pdserve.router.request import COMPLETION_DEFAULT_MAX_TOKENS, Request, Route
from pdserve.router.sse import StreamBroke

#: How many times one stream may move before it ends with an error event.
MAX_MOVES = 2

#: Sampling and output fields a continuation keeps (everything else is the first request's API shape).
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "length_penalty", "user",
            "priority", "vllm_xargs", "stream_options", "include_stop_str_in_output", "min_tokens",
            # a tenant's salt: the continuation's prompt is cached (and found) only under it
            "cache_salt")

def eligible(req: Request, *, chat_parsers: bool = False) -> bool:
    """Whether this request's stream can move to another engine (see the module's description)."""
    if req.route not in ("chat", "completions") or not req.stream or not req.sampled_once:
        return False
    if req.token_logprobs or req.prompt_logits or req.stop or req.tokens_as_ids:
        return False
    return continuable(req) and plain_text_events(req, chat_parsers=chat_parsers)


def tracked(req: Request) -> Request:
    """The decode leg's request: its engine returns the ids the tape needs."""
    return req if req.return_token_ids else req.with_body({**req.body, "return_token_ids": True})


class Tape:
    """What the client has been sent so far, and the events it reads, shaped for its API.

    ``feed`` takes the raw bytes of the first engine's stream (the client's own API) or of a continuation
    (a token-id completion stream, turned back into the client's API)."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.route = req.route
        self.wants_ids = req.return_token_ids
        self.prompt_ids: list[int] | None = list(req.prompt_ids) if req.prompt_ids else None
        self.ids: list[int] = []
        self.head: dict[str, Any] = {}  # id, created, model of the client's stream
        self.finish: str | None = None  # finish_reason once seen
        self.usage_sent = False
        self.done = False  # [DONE] was passed on
        self.sent_any = False  # an event reached the client
        self.broke = False  # the first engine's stream broke (the rest, if any, came from elsewhere)
        self._continuation = False
        self._before = 0  # generated ids before the current continuation
        self._events = sse.Splitter()

    @classmethod
    def sent(cls, req: Request, prompt_ids: Sequence[int], ids: Sequence[int], head: dict[str, Any]) -> Tape:
        """A tape for a stream whose client has read ``ids`` (after ``prompt_ids``) in events labelled
        ``head``, and nothing of an engine's stream yet."""
        tape = cls(req)
        tape.prompt_ids, tape.ids, tape.head, tape.sent_any = list(prompt_ids), list(ids), dict(head), True
        return tape

    def continuing(self) -> None:
        """The next bytes are a continuation's."""
        self.broke = True
        self._continuation = True
        self._before = len(self.ids)
        self._events = sse.Splitter()

    def restart(self) -> None:
        """The next bytes are the whole request again (nothing of the first stream reached the client)."""
        self.broke = True
        self.ids = []
        self.finish = None
        self.head = {}
        self.usage_sent = False
        self._events = sse.Splitter()

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for one chunk of the engine's stream (whole events only; the rest waits)."""
        return b"".join(self._event(event.strip()) for event in self._events.feed(chunk))

    def _event(self, line: bytes) -> bytes:
        if not line:
            return b""
        if sse.is_done(line):
            self.done = True
            return line + sse.SEP
        data = sse.json_of(line)
        if not isinstance(data, dict) or "error" in data:
            if isinstance(data, dict) and _server_error(data):
                raise StreamBroke(f"the engine sent an error event: {str(data['error'])[:200]}")
            return line + sse.SEP
        out = self._continued(data) if self._continuation else self._native(data)
        if out is None:
            return b""
        self.sent_any = True
        return sse.encode(out)

    def _native(self, data: dict[str, Any]) -> dict[str, Any] | None:
        if not self.head:
            self.head = {k: data.get(k) for k in ("id", "created", "model")}
        if self.prompt_ids is None and isinstance(data.get("prompt_token_ids"), list):
            self.prompt_ids = data["prompt_token_ids"]
        if not self.wants_ids:
            data.pop("prompt_token_ids", None)
        if data.get("usage"):
            self.usage_sent = True
        empty = True
        for choice in data.get("choices") or []:
            if self.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = choice["prompt_token_ids"]
            self.ids.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
            if not self.wants_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            delta = choice.get("delta") if self.route == "chat" else None
            if self.route != "chat" or delta or choice.get("finish_reason") is not None:
                empty = False
        if empty and data.get("choices") and not data.get("usage") and not self.wants_ids:
            return None  # an event the engine sent only to carry ids
        return data

    def _continued(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """A token-id completion's event as the client's API shapes it."""
        usage = data.get("usage")
        if usage:
            self.usage_sent = True
            n_out = int(usage.get("completion_tokens") or 0) + self._before
            n_in = len(self.prompt_ids or [])
            usage = {**usage, "prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        choices = []
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids") or []
            self.ids.extend(ids)
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finish = finish
            text = choice.get("text") or ""
            if self.route == "chat":
                if not text and finish is None and not (self.wants_ids and ids):
                    continue
                out: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                       "finish_reason": finish}
                if choice.get("stop_reason") is not None:
                    out["stop_reason"] = choice["stop_reason"]
            else:
                out = {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}
                out["index"] = 0
            if self.wants_ids:
                out["token_ids"] = ids
            choices.append(out)
        if not choices and not usage:
            return None
        obj = "chat.completion.chunk" if self.route == "chat" else "text_completion"
        return {**self.head, "object": obj, "choices": choices, **({"usage": usage} if usage else {})}

    def closing(self) -> bytes:
        """The end of a stream whose last token was sent before the engine failed: its finish event (if the
        engine had not sent it), the usage the client asked for, and ``[DONE]``."""
        self.broke = True
        out = b""
        obj = "chat.completion.chunk" if self.route == "chat" else "text_completion"
        if self.finish is None:
            self.finish = "length"
            choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
                                      if self.route == "chat" else
                                      {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
            out += sse.encode({**self.head, "object": obj, "choices": [choice]})
        if self.req.usage_at_end and not self.usage_sent:
            n_in, n_out = len(self.prompt_ids or []), len(self.ids)
            out += sse.encode({**self.head, "object": obj, "choices": [],
                          "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}})
        self.done = True
        return out + sse.DONE


def _server_error(data: dict[str, Any]) -> bool:
    """An in-band error event that says the engine failed (not that the request was wrong)."""
    err = data.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    try:
        return int(code) >= 500
    except (TypeError, ValueError):
        return False


def continuation(req: Request, tape: Tape) -> dict[str, Any] | None:
    """The token-id completion that goes on from what the client has; ``None`` when the budget is spent. Its
    ``max_tokens`` is what is left of the request's own budget, or, where the client gave none, of the
    budget one engine would have given it: 16 for completions, the context left after the prompt for chat
    (the router's mirror of vLLM's, ``output_budget``; the engine clamps it to the context). A completion's
    ``max_tokens`` left out (or null) is 16: a chat answer that would have run to its end stopped 16 tokens
    after the move. Where the router does not know the engines' context (no ``max_model_len`` in a GPU
    engine's arguments) a chat continuation still gets vLLM's 16."""
    assert tape.prompt_ids is not None
    total = req.max_new_tokens if req.max_new_tokens is not None else req.output_budget
    if total is None and req.route == "completions":
        total = COMPLETION_DEFAULT_MAX_TOKENS
    left = None if total is None else total - len(tape.ids)
    if left is not None and left <= 0:
        return None
    out = {k: req.body[k] for k in _CARRIED if req.body.get(k) is not None}
    out.update(prompt=tape.prompt_ids + tape.ids, stream=True, return_token_ids=True)
    if left is not None:
        out["max_tokens"] = left
    if req.min_tokens:
        out["min_tokens"] = max(0, req.min_tokens - len(tape.ids))
    return out


#: Starts a stream for (route, body) on an engine not yet tried; raises when none can take it.
Resume = Callable[[Route, dict[str, Any]], Awaitable[AsyncIterator[bytes]]]


async def resilient(req: Request, stream: AsyncIterator[bytes], resume: Resume,
                    on_move: Callable[[str], None] | None = None, tape: Tape | None = None) -> AsyncIterator[bytes]:
    """The client's stream: ``stream`` (the decode leg, asked for token ids) and, if it breaks, its
    continuations. ``req`` is the client's request; ``on_move(outcome)`` is told ``migrated``, ``restarted``
    (nothing had reached the client: the request ran again), ``completed`` (only the end was missing) or
    ``failed``. A failure that cannot be moved raises :class:`StreamBroke` to the caller. ``tape``: when
    ``stream`` is itself a continuation, the tape it continues (:meth:`Tape.sent`, then ``continuing``)."""
    tape = tape or Tape(req)
    source = stream
    moves = 0
    while True:
        try:
            async for chunk in source:
                out = tape.feed(chunk)
                if out:
                    yield out
            if tape.done:
                return
            why = "the engine's stream ended without [DONE]"
        except StreamBroke as e:
            why = str(e)
        if tape.finish is not None or (tape.sent_any and tape.prompt_ids is not None
                                       and continuation(req, tape) is None):
            if on_move:
                on_move("completed")
            yield tape.closing()
            return
        if moves >= MAX_MOVES:
            if on_move:
                on_move("failed")
            raise StreamBroke(f"{why}; moved {moves} times already")
        moves += 1
        try:
            if not tape.sent_any:
                tape.restart()
                source = await resume(req.route, tracked(req).body)
                if on_move:
                    on_move("restarted")
            elif tape.prompt_ids is not None:
                cbody = continuation(req, tape)
                assert cbody is not None
                tape.continuing()
                source = await resume("completions", cbody)
                if on_move:
                    on_move("migrated")
            else:
                raise StreamBroke(f"{why}; the stream's prompt ids are unknown")
        except StreamBroke:
            if on_move:
                on_move("failed")
            raise
        except Exception as e:  # noqa: BLE001 - no engine could take it: the caller ends the stream in-band
            if on_move:
                on_move("failed")
            raise StreamBroke(f"{why}; no engine could continue it: {e}") from e
