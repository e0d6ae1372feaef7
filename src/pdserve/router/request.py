"""One client request as the router decides on it: parsed once, after its checks (router/validate.py).

:class:`Request` holds the route, the body the engines get, and every value a later decision reads, typed:
whether it is split into prefill and decode (router/handoff.py), admitted (router/gate.py), started with the
prefill's first token (router/early.py) or allowed to move to another engine (router/migrate.py). Those read
the object, never the body: ``{"best_of": "2"}`` either becomes 2 here (as vLLM's request model parsed it,
router/validate.py writes it back) or is refused with a 400 naming the field; a string can no longer reach a
comparison.

The body stays a dict: it is what the engines receive, unknown fields included (vLLM's models take more
fields than the router reads). Stages that change what an engine is sent make a new :class:`Request`
(:meth:`Request.with_body`), so the values decided on and the body sent never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pdserve.errors import BadRequest

Route = Literal["chat", "completions", "responses", "messages"]
#: The output budget's field of each route (chat: ``max_completion_tokens`` or ``max_tokens``).
BUDGET: dict[str, str] = {"completions": "max_tokens", "chat": "max_completion_tokens",
                          "responses": "max_output_tokens", "messages": "max_tokens"}

#: Structured-output fields: the grammar's state lives in the engine (a stream with one cannot move).
STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "guided_decoding_backend", "guided_whitespace_pattern")


#: vLLM's ``CompletionRequest.max_tokens`` default.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Request:
    """A checked request; see the module's description. Build it with :meth:`parse`."""

    route: Route
    body: dict[str, Any] = field(repr=False, compare=False)
    #: The prompt's length as the router estimates it (router/prompt_length.py); stored context included
    #: for a Responses request that continues an earlier one (router/gate.py adds it).
    prompt_tokens: int = 0
    #: The output budget's field and value (None: not given; the engine's context bounds it).
    budget_field: str = "max_tokens"
    max_new_tokens: int | None = None
    #: The most tokens the engine may generate for each sequence, as the router mirrors vLLM's budget (the
    #: field, else the context left after the prompt); None where the router cannot tell.
    output_budget: int | None = None
    stream: bool = False
    n: int = 1
    best_of: int = 1
    min_tokens: int = 0
    #: Sampling: greedy (temperature 0) or the client's seed; either makes the first token deterministic.
    greedy: bool = False
    seed: int | None = None
    #: Per-token logprobs asked for (``logprobs`` / ``top_logprobs``); prompt logprobs or ``echo``.
    token_logprobs: bool = False
    prompt_logits: bool = False
    logit_bias: bool = False
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    stop: bool = False
    #: Usage on every event of a stream, or once at its end (``stream_options``).
    usage_per_event: bool = False
    usage_at_end: bool = False
    #: The model may answer with tool calls (tools given and ``tool_choice`` is not "none").
    tool_calls: bool = False
    #: A grammar constrains the answer (a JSON or regex response format, guided decoding).
    structured: bool = False
    #: Completions: the prompts of a batch (1 for one prompt); the prompt's token ids when given as ids.
    prompts: int = 1
    prompt_ids: tuple[int, ...] | None = None
    #: Responses: the stored response this one continues.
    previous_response_id: str | None = None
    #: An engine fetches a media URL of it (an allowed http(s) host: router/media.py).
    media_fetched: bool = False
    #: Its prompt holds more than text and token ids: a chat content part of another type (an image, audio,
    #: a video, a file), or completions' ``prompt_embeds``. Its ids alone do not say what the engine saw.
    multimodal: bool = False
    #: Responses: a tool the engine runs itself (web search, code interpreter, a container, an MCP server):
    #: vLLM generates again after each call with the first generation's sampling params, KV params included.
    builtin_tools: bool = False

    @classmethod
    def parse(cls, route: Route, body: dict[str, Any], prompt_tokens: int = 0,
              output_budget: int | None = None, media_fetched: bool = False) -> Request:
        """The typed view of ``body``. Raises :class:`BadRequest` naming a field of a type the router cannot
        decide on (vLLM's models, when an engine checked the body, have refused or converted these already)."""
        name = budget_field(route, body)
        n_prompts, ids = _prompts(route, body)
        opts = body.get("stream_options")
        fmt = body.get("response_format")
        temperature = _number(body, "temperature")
        prev = body.get("previous_response_id") if route == "responses" else None
        if prev is not None and not isinstance(prev, str):
            raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")
        return cls(
            route=route, body=body, prompt_tokens=prompt_tokens,
            budget_field=name, max_new_tokens=_int(body, name), output_budget=output_budget,
            stream=_bool(body, "stream"), n=_int(body, "n") or 1, best_of=_int(body, "best_of") or 1,
            min_tokens=_int(body, "min_tokens") or 0,
            greedy=temperature is not None and temperature == 0.0, seed=_int(body, "seed"),
            token_logprobs=_flag(body, "logprobs") or _flag(body, "top_logprobs"),
            prompt_logits=_bool(body, "echo") or _flag(body, "prompt_logprobs"),
            logit_bias=bool(body.get("logit_bias")),
            return_token_ids=_bool(body, "return_token_ids"),
            tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
            stop=bool(body.get("stop") or body.get("stop_sequences")),
            usage_per_event=isinstance(opts, dict) and opts.get("continuous_usage_stats") is True,
            usage_at_end=isinstance(opts, dict) and opts.get("include_usage") is True,
            tool_calls=bool(body.get("tools")) and body.get("tool_choice") != "none",
            structured=any(body.get(k) for k in STRUCTURED) or (
                isinstance(fmt, dict) and fmt.get("type") not in (None, "text")),
            prompts=n_prompts, prompt_ids=ids, previous_response_id=prev, media_fetched=media_fetched,
            multimodal=_multimodal(route, body), builtin_tools=_builtin_tools(route, body))

    def with_body(self, body: dict[str, Any]) -> Request:
        """The same request with another body (a seed of the router's, ids asked of the engine): parsed
        again, so the decided values follow what is sent."""
        return Request.parse(self.route, body, self.prompt_tokens, self.output_budget, self.media_fetched)

    def output_charge(self) -> int:
        """The output tokens a tenant's ``output_tokens_per_min`` is charged for this request: the budget of
        each sequence (a request without ``max_tokens`` may fill the context) times the sequences it asks
        for (``n`` or ``best_of`` of each prompt of a batch)."""
        per = self.output_budget if self.output_budget is not None else (self.max_new_tokens or 0)
        return per * self.sequences

    def with_prompt_tokens(self, prompt_tokens: int) -> Request:
        return replace(self, prompt_tokens=prompt_tokens)

    @property
    def sequences(self) -> int:
        """Sequences the engine generates at once for it: ``n`` (or ``best_of``) of each prompt of a batch."""
        return max(1, self.n, self.best_of) * max(1, self.prompts)

    @property
    def sampled_once(self) -> bool:
        """One sequence is generated (``n`` and ``best_of`` 1)."""
        return self.n == 1 and self.best_of == 1


def budget_field(route: Route, body: dict[str, Any]) -> str:
    """The field that holds this request's output budget."""
    if route == "chat" and body.get("max_completion_tokens") is None:
        return "max_tokens"
    return BUDGET[route]


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean", param=key)
    return v


def _flag(body: dict[str, Any], key: str) -> bool:
    """A field vLLM takes as a boolean on one route and a count on another (``logprobs``): whether it asks.
    A count asks whatever its value: vLLM returns the sampled token's logprob for ``logprobs: 0`` (it tests
    ``is not None``), so such a stream carries logprobs the early first token and a moved stream must keep."""
    v = body.get(key)
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if not isinstance(v, int):
        raise BadRequest(f"'{key}' must be a boolean or an integer", param=key)
    return True


def _int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer", param=key)
    return v


def _number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{key}' must be a number", param=key)
    return float(v)


def _prompts(route: Route, body: dict[str, Any]) -> tuple[int, tuple[int, ...] | None]:
    """A completions prompt: how many prompts it holds, and its token ids when it is one prompt of ids."""
    if route != "completions":
        return 1, None
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return 1, None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return 1, tuple(prompt)
    return len(prompt), None


#: The chat content parts that are text.
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")


def _multimodal(route: Route, body: dict[str, Any]) -> bool:
    """Whether a chat prompt has a content part that is not text, or a completions prompt ``prompt_embeds``."""
    if route == "completions":
        return body.get("prompt_embeds") is not None
    if route != "chat":
        return False
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS
                                             for p in content):
            return True
    return False


def _builtin_tools(route: Route, body: dict[str, Any]) -> bool:
    """Whether a Responses request offers a tool that is not a function (the engine calls it itself)."""
    tools = body.get("tools") if route == "responses" else None
    return isinstance(tools, list) and any(not isinstance(t, dict) or t.get("type") != "function" for t in tools)


def lora_adapter(body: dict[str, Any]) -> str | None:
    """The LoRA adapter a body's ``model`` names (``base:adapter``), under which the engines key its blocks."""
    model = str(body.get("model") or "")
    return model.split(":", 1)[1] if ":" in model else None
