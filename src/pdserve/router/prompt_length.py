"""How long a request's prompt is, in tokens, cheaply enough to decide per request.

Token-id prompts are counted exactly. Text is counted with the model's ``tokenizer.json`` (Rust
``tokenizers``, tens of microseconds) when the router can find it, else estimated at 4 characters per
token. Chat adds a few tokens per message for the template, and counts what it renders besides text (tools,
documents, tool calls and results) as their JSON.

Besides that estimate (for admission), :meth:`PromptLength.measure` gives a lower bound the engine's own
count cannot be under (for refusing prompts that cannot fit the engines' context), and
:attr:`PromptLength.vocab_size` the number of token ids the model has.

A client chooses how much text there is to count, up to the router's body limit (16 MiB: ~17 s of
tokenizing on one core), and the tokenizer holds the GIL while it encodes one text. So: a text longer than
the engines' context could hold even at the model's longest token (:attr:`PromptLength.max_token_chars`
characters each) is not encoded at all, since its length alone proves it does not fit; a request with more than
:data:`BIG_TEXT_CHARS` characters of text is measured in a worker thread (:meth:`PromptLength.is_big`, the
validator), one at a time, with the tokenizer's batch call, which lets the GIL go: the event loop keeps
serving every other request meanwhile.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pdserve.router.handoff import TEMPLATE_RESERVED_KWARGS

log = logging.getLogger(__name__)

_TEMPLATE_TOKENS_PER_MESSAGE = 5
#: Characters of text in one request above which it is measured off the event loop (~10-20 ms of tokenizing).
BIG_TEXT_CHARS = 16_384


def _config_vocab_size(model_dir: Path) -> int | None:
    """``vocab_size`` of the model's ``config.json`` (its text part for multimodal models): the width of
    the logits the engine checks token ids against."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    for c in (cfg, cfg.get("text_config")):
        v = c.get("vocab_size") if isinstance(c, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


class PromptLength:
    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._dir = tokenizer_dir
        self._chat: Any = None  # the model's chat template (router/chat_template.py), loaded on first use
        self._chat_error: str | None = None  # why it could not be loaded (not tried again)
        self._tok: Any = None
        # The last text encoded and its encoding: a request's prompt is measured for admission and, for a
        # role routed by cached prefix, turned into ids for routing; one encoding serves both.
        self._memo: tuple[str, Any] | None = None
        #: Token ids are below this; None when the router cannot tell.
        self.vocab_size: int | None = None
        #: The most characters one token of the model stands for (its longest vocabulary entry; byte-level
        #: entries have a character per byte, at least as many as the text they decode to); None unknown.
        self.max_token_chars: int | None = None
        #: The engines' context in tokens, when known (set with the validator's limits): a text longer than this many
        #: of the longest tokens is not encoded.
        self.context_tokens: int | None = None
        if tokenizer_dir:
            path = Path(tokenizer_dir) / "tokenizer.json"
            if path.exists():
                try:
                    from tokenizers import Tokenizer

                    self._tok = Tokenizer.from_file(str(path))
                except Exception as e:  # noqa: BLE001 - an estimate is still useful
                    log.warning("cannot load %s (%s); estimating prompt lengths", path, e)
            self.vocab_size = _config_vocab_size(Path(tokenizer_dir))
            if self.vocab_size is None and self._tok is not None:
                self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
            if self._tok is not None:
                try:
                    self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=0) or None
                except Exception:  # noqa: BLE001 - then every text is encoded, as before
                    self.max_token_chars = None

    def _encode(self, text: str) -> Any:
        """``text``'s encoding without special tokens, or None (no tokenizer, or text it refuses)."""
        if self._tok is None:
            return None
        memo = self._memo
        if memo is not None and memo[0] == text:
            return memo[1]
        try:
            if len(text) > BIG_TEXT_CHARS:  # the batch call encodes without the GIL (off the loop: is_big)
                enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
            else:
                enc = self._tok.encode(text, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - text the tokenizer refuses (e.g. lone surrogates): unknown
            return None
        self._memo = (text, enc)
        return enc

    def _past_context(self, text: str) -> int | None:
        """A number of tokens ``text`` certainly exceeds the engines' context by its length alone (each token
        stands for at most :attr:`max_token_chars` characters), else None."""
        most, ctx = self.max_token_chars, self.context_tokens
        if most and ctx and len(text) > ctx * most:
            return -(-len(text) // most)
        return None

    def _text(self, text: str) -> tuple[int, int | None]:
        """``(estimate, tokens)``: ``tokens`` exact, or a lower bound for a text too long for the context
        (not encoded), or None without a tokenizer."""
        floor = self._past_context(text)
        if floor is not None:
            return floor, floor
        enc = self._encode(text)
        n = None if enc is None else len(enc.ids)
        return (max(1, len(text) // 4) if n is None else n), n

    def is_big(self, route: str, body: dict[str, Any]) -> bool:
        """More than :data:`BIG_TEXT_CHARS` characters of text to encode in what :meth:`measure` reads (a
        text too long for the context is not encoded and does not count): measure it off the event loop."""
        if self._tok is None:
            return False
        total = 0
        for text in _texts(route, body):
            if self._past_context(text) is None:
                total += len(text)
                if total > BIG_TEXT_CHARS:
                    return True
        return False

    def count(self, route: str, body: dict[str, Any]) -> int:
        return self.measure(route, body)[0]

    def measure(self, route: str, body: dict[str, Any]) -> tuple[int, int | None]:
        """``(estimate, at_least)``: the prompt's length for admission, and a number of tokens the engine's
        own count is certainly not below (for a batch of prompts: the longest one's), or None when the
        router cannot tell (text without a tokenizer)."""
        if route in ("messages", "responses"):
            return self._conversation(route, body)
        if route == "chat":
            total, floor = 0, 0
            exact = True
            for role, parts, extra in _messages(route, body):
                user = role == "user"
                total += sum(est for est, _ in map(self._text, extra))
                for est, n in map(self._text, parts):
                    total += est
                    exact = exact and n is not None
                    if user:
                        floor += n or 0
                total += _TEMPLATE_TOKENS_PER_MESSAGE
                if user:
                    # Only users' words count towards the floor: a template may shorten other messages (drop
                    # earlier reasoning, say), never those. It wraps each message in special tokens, which never
                    # merge with its text; the parts of one message may merge where they meet (one token per seam).
                    floor -= max(0, len(parts) - 1)
            return total, (max(0, floor) if exact else None)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int):
                return len(prompt), len(prompt)
            if prompt and all(isinstance(p, list) for p in prompt):
                return sum(len(p) for p in prompt), max(len(p) for p in prompt)
            counted = [self._text(str(p)) for p in prompt]
            floors = [n for _, n in counted]
            longest = None if None in floors else max((n or 0 for n in floors), default=0)
            return sum(est for est, _ in counted), longest
        return self._text(str(prompt or ""))

    def token_ids(self, route: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will compute them, or None when the router cannot tell
        (no tokenizer, a batch of prompts, a conversation the chat template refuses, a Responses or Messages
        conversation with more than text: :func:`as_chat_messages`). For routing by cached prefix: a wrong
        answer costs cache hits, never correctness."""
        if _rendered_otherwise(route, body):
            return None
        prompt = body.get("prompt")
        if route == "completions":
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            enc = self._encode(prompt) if isinstance(prompt, str) else None
            if enc is None:
                return None
            try:
                return list(self._tok.post_process(enc, None, True).ids)  # the engine adds special tokens
            except Exception:  # noqa: BLE001 - a tokenizer without a post-processor it can apply
                return None
        if route in ("responses", "messages"):
            msgs = as_chat_messages(route, body)
            if msgs is None:
                return None
            route, body = "chat", {"messages": msgs}
        if route != "chat" or self._tok is None or not self._dir or self._chat_error:
            return None
        given = body.get("chat_template_kwargs") or {}
        if body.get("chat_template") is not None or not isinstance(given, dict):
            return None  # never a client's template (the validator refuses it before this)
        # Only plain values (flags such as enable_thinking) under keys that cannot replace the template; a
        # request with others is rendered by the engine alone.
        kwargs = {k: v for k, v in given.items() if k not in TEMPLATE_RESERVED_KWARGS and _plain(v)}
        if len(kwargs) != len(given):
            return None
        try:
            self.load_chat_template()
            text = self._chat.render(
                body.get("messages") or [], tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                **kwargs)
            enc = self._encode(text)
            return None if enc is None else list(enc.ids)
        except Exception as e:  # noqa: BLE001 - a template the messages do not fit: route by load
            log.debug("no token ids for a chat prompt: %s", e)
            return None

    def load_chat_template(self) -> None:
        """Load the model's chat template: at the router's start when routing needs chat prompts' token ids, so
        that the first chat request does not wait for it on the event loop."""
        if self._chat is None and self._dir:
            if self._chat_error:
                raise RuntimeError(self._chat_error)
            from pdserve.router.chat_template import ChatTemplate

            try:
                self._chat = ChatTemplate.load(self._dir)
            except Exception as e:
                # Not tried again: each try takes the event loop for as long as the load does.
                self._chat_error = f"cannot load the chat template from {self._dir}: {e}"
                raise

    def _conversation(self, route: str, body: dict[str, Any]) -> tuple[int, int | None]:
        """Anthropic Messages (``system`` + ``messages``) and Responses (``instructions`` + ``input``): an
        estimate only (the text of every content block plus the template's tokens per message)."""
        total = 0
        for _, parts, extra in _messages(route, body):
            total += sum(est for est, _ in map(self._text, parts + extra)) + _TEMPLATE_TOKENS_PER_MESSAGE
        return total, None


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 256)


#: Fields by which the engine's prompt differs from the one the router renders from the same body (the
#: engine cuts it, adds or leaves out special tokens, renders documents), with the value that changes nothing.
_RENDER_FIELDS = {"truncate_prompt_tokens": None, "truncation_side": None, "documents": None}


def _rendered_otherwise(route: str, body: dict[str, Any]) -> bool:
    """Whether the engine computes another prompt than :meth:`PromptLength.token_ids` would render: ids the
    router then offered for a KV handback read (router/handback.py) would have the prefill engine load blocks
    of tokens it is not computing (vLLM's pull loads them without comparing tokens), and an answer over a
    context the client never sent."""
    if any(body.get(k, unchanged) != unchanged for k, unchanged in _RENDER_FIELDS.items()):
        return True
    special = body.get("add_special_tokens")
    return special is not None and bool(special) != (route == "completions")


#: Content parts the template renders from their ``text``.
TEXT_PARTS = ("text", "input_text", "output_text")
#: Media parts: not counted as text (their tokens are the engine's processor's to count).
_MEDIA = ("image", "audio", "video", "file")
#: A message's keys besides its text: what else of it the template may render (tool calls and their
#: arguments, a tool result's output, a call id) is counted as its JSON.
_PLAIN_KEYS = ("role", "content", "type")


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _messages(route: str, body: dict[str, Any]) -> list[tuple[Any, list[str], list[str]]]:
    """Each message of a conversation (chat ``messages``; Messages ``system`` + ``messages``; Responses
    ``instructions`` + ``input``) as :meth:`PromptLength.measure` reads it: its role (None for a system
    field or the request's tools), the texts of its content (a string, or the ``text`` of each part), and
    the rest the template renders from it, as text: a part that is not text or media (a tool call, a tool
    result), the message's other fields (``tool_calls`` and their arguments, a Responses
    ``function_call_output``'s ``output``), and the request's ``tools`` and ``documents``. Counting only
    the text let a prompt of thousands of tokens count as a few (a tool's description, a tool's output) past
    admission and the tenant's prompt limit."""
    items: list[Any]
    if route == "chat":
        items = list(body.get("messages") or [])
    elif route == "messages":
        items = ([{"content": body.get("system")}] if body.get("system") else []) + list(body.get("messages") or [])
    else:
        given = body.get("input")
        items = [{"content": body.get("instructions")}] if body.get("instructions") else []
        items += [{"content": given}] if isinstance(given, str) else list(given or [])
    out: list[tuple[Any, list[str], list[str]]] = []
    for m in items:
        content = m.get("content") if isinstance(m, dict) else None
        parts: list[str] = []
        extra: list[str] = []
        if isinstance(content, list):
            for p in content:
                if not isinstance(p, dict):
                    continue
                kind = str(p.get("type", "text"))
                if kind in TEXT_PARTS:
                    parts.append(str(p.get("text", "")))
                elif not any(media in kind for media in _MEDIA):
                    extra.append(_as_text(p))
        else:
            parts.append(str(content or ""))
        if isinstance(m, dict):
            rest = {k: v for k, v in m.items() if k not in _PLAIN_KEYS and v is not None}
            if rest:
                extra.append(_as_text(rest))
        out.append((m.get("role") if isinstance(m, dict) else None, parts, extra))
    given = [body.get(k) for k in ("tools", "documents") if body.get(k)]
    if given:
        out.append((None, [], [_as_text(v) for v in given]))
    return out


def _texts(route: str, body: dict[str, Any]) -> list[str]:
    """The texts :meth:`PromptLength.measure` encodes in ``body`` (without encoding them)."""
    if route in ("chat", "messages", "responses"):
        return [text for _, parts, extra in _messages(route, body) for text in parts + extra]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and (isinstance(prompt[0], int) or all(isinstance(p, list) for p in prompt)):
            return []
        return [str(p) for p in prompt]
    return [str(prompt or "")]


def _text_of(content: Any, joiner: str) -> str | None:
    """A message's text: a string, or text parts (``text``, ``input_text``, ``output_text``) joined; None when
    it has anything else (images, tool calls and results: their rendering is the engine's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text")
                and isinstance(part.get("text"), str)):
            return None
        texts.append(part["text"])
    return joiner.join(texts)


def as_chat_messages(route: str, body: dict[str, Any]) -> list[dict[str, str]] | None:
    """A Responses (``instructions`` + ``input``) or Anthropic Messages (``system`` + ``messages``) text
    conversation as the chat messages vLLM renders it from (a system message first, then each message's text);
    None when it has tools or content other than text."""
    if body.get("tools"):
        return None
    out: list[dict[str, str]] = []
    system = body.get("instructions") if route == "responses" else body.get("system")
    if system:
        text = _text_of(system, "")
        if text is None:
            return None
        out.append({"role": "system", "content": text})
    given = body.get("input") if route == "responses" else body.get("messages")
    if isinstance(given, str):
        return out + [{"role": "user", "content": given}]
    if not isinstance(given, list):
        return None
    for m in given:
        if not isinstance(m, dict) or m.get("type", "message") != "message":
            return None
        role, text = m.get("role"), _text_of(m.get("content"), "\n")
        if role not in ("system", "user", "assistant") or text is None:
            return None
        out.append({"role": str(role), "content": text})
    return out
