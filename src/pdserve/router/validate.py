"""Whether a request body is one the engines accept, decided before the prefill leg spends anything.

The prefill leg carries the client's body with the generation fields rewritten (``max_tokens=1``, no
streaming, ``stream_options`` / ``min_tokens`` / ``logit_bias`` / ``n`` dropped), so the prefill engine never
sees the client's values of those fields. A body only the decode engine refuses would cost a full prefill
and hold the prompt's KV blocks on the prefill engine until their lease runs out. So the router checks
each body the way the engines will, before the first leg, and answers 400 naming the field:

1. shape: nesting depth at most :data:`~pdserve.router.body.MAX_DEPTH` (checked without recursion; a body's
   bytes before that: router/body.py);
2. the router's own rules (:func:`pdserve.router.handoff.check_request`): fields only the router sets;
3. vLLM's own request models (``CompletionRequest`` / ``ChatCompletionRequest`` / ...), then the sampling
   parameters vLLM's serving code derives from them, so that vLLM's own checks fire. They run on an engine
   (engine/request_check.py, ``POST /pdserve/check`` on an engine's API server, where vLLM is imported
   anyway), never in the router: importing them takes seconds and half a GiB (torch comes with them). The
   engine also answers the decided fields as vLLM parsed them (``"2"`` -> 2), which the router writes into
   the body before any decision reads it;
4. what those models cannot know by themselves: token ids against the model's vocabulary, lengths against
   the engines' ``max_model_len``, logprobs against their ``max_logprobs``, and the combinations vLLM's
   serving code refuses (streaming with beam search).

When no engine can check a body (none is up, or one does not answer) step 3 is skipped, and step 4 also
checks the types of the fields only the decode leg carries; the engine that serves the request still refuses
what its models refuse.

The client's ``X-Request-Id`` is checked here as well (:func:`request_id`): it becomes part of engine
request ids, headers and log lines.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.errors import BadRequest
from pdserve.router import handoff, media
from pdserve.router.body import BIG_BODY_BYTES, BODY_BYTES, MAX_DEPTH, check_depth
from pdserve.router.prompt_length import PromptLength
from pdserve.router.request import COMPLETION_DEFAULT_MAX_TOKENS, Request, Route, budget_field
from pdserve.settings import NO_MEDIA_HOST, media_hosts

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_MAX_LEN = 128
REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]+")

#: vLLM's ``max_logprobs`` when the engine arguments do not set it.
VLLM_DEFAULT_MAX_LOGPROBS = 20

#: What the router asks an engine's check (step 3): the body on a route -> the decided fields as vLLM parsed
#: them, or None when no engine could check it; raises :class:`BadRequest` naming the refused field.
EngineCheck = Callable[[Route, dict[str, Any]], Awaitable[dict[str, Any] | None]]
#: An engine's check endpoint (engine/request_check.py, served by engine/vllm_plugin.py).
CHECK_PATH = "/pdserve/check"


def request_id(given: str | None) -> str | None:
    """The client's ``X-Request-Id`` when it can be used as is; None when there is none (the router makes
    one). Anything else is refused rather than replaced: the client would not find its answer under it."""
    if not given:
        return None
    if len(given) > REQUEST_ID_MAX_LEN or not REQUEST_ID_CHARS.fullmatch(given):
        raise BadRequest(f"header {REQUEST_ID_HEADER} must be 1 to {REQUEST_ID_MAX_LEN} characters from "
                         "A-Z a-z 0-9 . _ : -", param=REQUEST_ID_HEADER, code="invalid_request_id")
    return given


@dataclass(frozen=True)
class EngineLimits:
    """What the engines are configured to accept, where the router knows it (None: not checked)."""

    max_model_len: int | None = None
    max_logprobs: int | None = None
    #: Every role's engines schedule by request priority (vLLM's ``scheduling_policy: priority``): the router
    #: gives each request its tenant's.
    priority_scheduling: bool = False
    #: Distinct LoRA adapters one engine's batch runs at once (vLLM's ``max_loras``, the fewest of the roles
    #: serving adapters); None without adapters.
    max_loras: int | None = None
    #: Adapters one engine keeps loaded (vLLM's ``max_cpu_loras``, which defaults to ``max_loras``).
    lora_cache: int | None = None
    #: Hosts the engines may fetch media from (vLLM's ``allowed_media_domains``, those every role allows):
    #: the router refuses any other media URL (router/media.py). None named: none.
    media_domains: tuple[str, ...] = ()

    @classmethod
    def from_engine_kwargs(cls, *roles: Mapping[str, Any]) -> EngineLimits:
        """From each role's ``engine_kwargs`` (vLLM's engine arguments), the strictest of the roles. A role
        without ``max_model_len`` has the model's own, which the router does not know."""
        lens: list[int] = []
        logprobs: list[int] = []
        for kw in roles:
            n = _int_arg(kw.get("max_model_len"))
            if n is not None and n > 0:
                lens.append(n)
            v = kw.get("max_logprobs")
            n = VLLM_DEFAULT_MAX_LOGPROBS if v is None else _int_arg(v)
            if n is not None and n >= 0:  # -1: the whole vocabulary, no bound
                logprobs.append(n)
        loras: list[int] = []
        cached: list[int] = []
        for kw in roles:
            if not kw.get("enable_lora"):
                continue
            n = _int_arg(1 if kw.get("max_loras") is None else kw["max_loras"])  # (vLLM's default: one)
            if n is not None and n > 0:
                loras.append(n)
                c = _int_arg(kw.get("max_cpu_loras"))
                cached.append(c if c is not None and c >= n else n)
        hosts = [set(media_hosts(kw.get("allowed_media_domains"))) for kw in roles]
        media = set.intersection(*hosts) if hosts else set()
        return cls(max_model_len=min(lens) if lens else None, max_logprobs=min(logprobs) if logprobs else None,
                   max_loras=min(loras) if loras else None, lora_cache=min(cached) if cached else None,
                   media_domains=tuple(sorted(media - {NO_MEDIA_HOST})),
                   priority_scheduling=bool(roles) and all(
                       str(kw.get("scheduling_policy") or "fcfs") == "priority" for kw in roles))


def _int_arg(v: Any) -> int | None:
    """An integer engine argument as given in YAML: a number or a string of digits."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return v if isinstance(v, int) else None


class RequestValidator:
    """Checks request bodies against the engines' rules; see the module's description. ``engine_check``: how
    vLLM's own models are asked (step 3); None: they are not."""

    def __init__(self, lengths: PromptLength | None = None, limits: EngineLimits | None = None,
                 engine_check: EngineCheck | None = None) -> None:
        self.lengths = lengths or PromptLength()
        self.limits = limits or EngineLimits()
        self.engine_check = engine_check
        # Requests with much text are measured in a worker thread, one at a time: a flood of them waits here,
        # not on the event loop (prompt_length.py).
        self._big = asyncio.Semaphore(1)

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: EngineLimits) -> None:
        self._limits = limits
        # A text too long for the engines' context is refused by its length, never tokenized.
        self.lengths.context_tokens = limits.max_model_len

    def summary(self) -> dict[str, Any]:
        """What bodies are checked against (for the status endpoint)."""
        return {"engine_checks": self.engine_check is not None,
                "max_model_len": self.limits.max_model_len, "max_logprobs": self.limits.max_logprobs,
                "vocab_size": self.lengths.vocab_size, "max_depth": MAX_DEPTH}

    async def check(self, route: Route, body: dict[str, Any]) -> Request:
        """Raise :class:`BadRequest` for a body an engine would refuse. Returns the request as every later
        decision reads it, with the prompt's length estimate (:meth:`PromptLength.count`), which admission
        uses. The decided fields of ``body`` are rewritten in place as vLLM's model parsed them."""
        if BODY_BYTES.get() > BIG_BODY_BYTES:
            # Walking a body of millions of items is seconds of Python: off the event loop, one at a time.
            async with self._big:
                estimate, at_least, remote = await asyncio.to_thread(self._shape_and_length, route, body)
        else:
            remote = self._shape(route, body)
            if self.lengths.is_big(route, body):
                async with self._big:
                    estimate, at_least = await asyncio.to_thread(self.lengths.measure, route, body)
            else:
                estimate, at_least = self.lengths.measure(route, body)
        if body.get("truncate_prompt_tokens") is not None:
            at_least = None  # the engine shortens the prompt itself
        # The output budget against the context first, with the router's own message ("... leaves at most N
        # tokens"), then vLLM's verdict, then the budget again on the values as vLLM parsed them.
        self._lengths(route, body, at_least)
        decided = await self.engine_check(route, body) if self.engine_check is not None else None
        if decided is None:
            _decode_leg_types(body)
        else:
            # Only scalar fields the client gave, as scalars: the engine's parse of them, nothing else.
            scalar = (bool, int, float, str)
            body.update({k: v for k, v in decided.items()
                         if isinstance(body.get(k), scalar) and (v is None or isinstance(v, scalar))})
        budget = self._lengths(route, body, at_least)
        self._token_ids(body)
        self._logprobs(route, body)
        _decode_leg_rules(body)
        return Request.parse(route, body, estimate, output_budget=budget, media_fetched=remote)

    def _shape(self, route: Route, body: dict[str, Any]) -> bool:
        """The checks of a body's form (:func:`_shape`) and its media URLs (router/media.py): whether an engine
        would fetch one."""
        _shape(route, body)
        return media.check(body, self.limits.media_domains)

    def _shape_and_length(self, route: Route, body: dict[str, Any]) -> tuple[int, int | None, bool]:
        remote = self._shape(route, body)
        return (*self.lengths.measure(route, body), remote)

    def _lengths(self, route: Route, body: dict[str, Any], at_least: int | None) -> int | None:
        """Mirror vLLM's output budget (``get_max_tokens``): the requested tokens, within what the context
        leaves after the prompt. Refuses what cannot fit; returns an upper bound of the engine's budget
        (None: unbounded as far as the router knows)."""
        name = budget_field(route, body)
        requested = _int(body.get(name))
        said = f"'{name}' is {requested}"
        if requested is None and route == "completions":
            requested = COMPLETION_DEFAULT_MAX_TOKENS
            said = f"'{name}' is {requested} when not given"
        limit = self.limits.max_model_len
        budget = requested
        if limit is not None:
            if requested is not None and requested > limit:
                raise BadRequest(f"'{name}' is {requested}, more than the model's context of {limit} tokens; "
                                 "request fewer output tokens", param=name)
            if at_least is not None:
                if at_least >= limit:
                    field = {"completions": "prompt", "responses": "input"}.get(route, "messages")
                    raise BadRequest(f"the model's context is {limit} tokens, and the prompt has at least "
                                     f"{at_least}: no room for any output; shorten the prompt", param=field)
                room = limit - at_least
                budget = room if requested is None else min(requested, room)
            elif requested is None:
                budget = limit - 1  # (the prompt has a token at least)
        min_tokens = _int(body.get("min_tokens"))
        if min_tokens is not None and budget is not None and min_tokens > budget:
            why = said if budget == requested else \
                f"the model's context leaves at most {budget} tokens after the prompt"
            raise BadRequest(f"'min_tokens' is {min_tokens}, but {why}", param="min_tokens")
        return budget

    def _token_ids(self, body: dict[str, Any]) -> None:
        """Token ids the engine indexes its logits with must be within the model's vocabulary."""
        vocab = self.lengths.vocab_size
        bias = body.get("logit_bias")
        if isinstance(bias, dict):
            for key in bias:
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise BadRequest(f"'logit_bias' keys must be token ids, got {_short(key)}",
                                     param="logit_bias") from None
                if token < 0 or (vocab is not None and token >= vocab):
                    raise BadRequest(f"'logit_bias' names token id {token}, outside the model's vocabulary of "
                                     f"{vocab} tokens" if vocab else f"'logit_bias' names token id {token}",
                                     param="logit_bias")
        if body.get("allowed_token_ids") == []:
            raise BadRequest("'allowed_token_ids' is empty: no token could be generated", param="allowed_token_ids")
        if vocab is None:
            return
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            ids = body.get(name)
            if isinstance(ids, list):
                bad = [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t < vocab]
                if bad:
                    raise BadRequest(f"'{name}' has token ids outside the model's vocabulary of {vocab} tokens: "
                                     f"{_short(bad[:5])}", param=name)

    def _logprobs(self, route: Route, body: dict[str, Any]) -> None:
        cap = self.limits.max_logprobs
        if cap is None:
            return
        names = ["prompt_logprobs"]
        if route == "responses":
            names.append("top_logprobs")
        elif route == "chat":
            if body.get("logprobs") and not body.get("logprob_token_ids"):
                names.append("top_logprobs")
        elif not body.get("logprob_token_ids"):
            names.append("logprobs")
        for name in names:
            n = _int(body.get(name))
            if n is not None and (n > cap or n == -1):
                asked = "the whole vocabulary (-1)" if n == -1 else str(n)
                raise BadRequest(f"'{name}' asks for {asked}; the engines return at most {cap} logprobs per "
                                 "token", param=name)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _decode_leg_rules(body: dict[str, Any]) -> None:
    """Combinations of fields that vLLM refuses only where the client's values of them arrive: the prefill
    leg carries ``stream: false`` and no ``stream_options``."""
    stream = body.get("stream") is True
    if body.get("stream_options") and not stream:
        raise BadRequest("'stream_options' can only be set when 'stream' is true", param="stream_options")
    if stream and body.get("use_beam_search"):
        raise BadRequest("beam search cannot stream: set 'stream' or 'use_beam_search' to false",
                         param="use_beam_search")
    pl = _int(body.get("prompt_logprobs"))
    if stream and pl is not None and (pl > 0 or pl == -1):
        raise BadRequest("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")


def _decode_leg_types(body: dict[str, Any]) -> None:
    """Without vLLM's models: the types of the fields only the decode leg carries (handoff's rules check the
    others the router rewrites)."""
    opts = body.get("stream_options")
    if isinstance(opts, dict):
        for k in ("include_usage", "continuous_usage_stats"):
            if opts.get(k) is not None and not isinstance(opts[k], bool):
                raise BadRequest(f"'stream_options.{k}' must be a boolean", param=f"stream_options.{k}")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("'logit_bias' must be an object of token ids to numbers", param="logit_bias")
        for v in bias.values():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadRequest(f"'logit_bias' values must be numbers, got {_short(v)}", param="logit_bias")


def _shape(route: Route, body: dict[str, Any]) -> None:
    """The checks of a body's form: nesting, the fields no client may set, empty prompts, Unicode text."""
    check_depth(body)
    handoff.check_request(route, body)
    prompt = body.get("prompt")
    if route == "completions" and isinstance(prompt, list) and any(p in ("", []) for p in prompt):
        raise BadRequest("'prompt' holds an empty prompt", param="prompt")
    _id_lists(body)
    _unicode(body)


#: The most entries of the per-request id lists vLLM 0.32's GPU model runner takes (its sampler's tables,
#: ``v1/worker/gpu/sample/logit_bias.py``): past them it raises while adding the request to its batch, and the
#: engine core fails with every request on it. ``stop_token_ids`` is bounded there only with ``min_tokens``
#: (with the model's end-of-sequence ids, 128 in all); a CPU engine scans the whole list at every step
#: (2 million ids: 17 ms a step, each stream's), so it is bounded everywhere.
MAX_ID_LIST = {"logit_bias": 1024, "allowed_token_ids": 1024, "stop_token_ids": 1024}
#: ``stop_token_ids`` with ``min_tokens``: the GPU runner's 128 less room for the model's own end ids.
MAX_STOP_IDS_WITH_MIN_TOKENS = 120


def _id_lists(body: dict[str, Any]) -> None:
    """Bound the id lists a request sends (:data:`MAX_ID_LIST`)."""
    for name, cap in MAX_ID_LIST.items():
        if name == "stop_token_ids" and (_int(body.get("min_tokens")) or 0) > 0:
            cap = MAX_STOP_IDS_WITH_MIN_TOKENS
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > cap:
            why = " with 'min_tokens'" if cap == MAX_STOP_IDS_WITH_MIN_TOKENS else ""
            raise BadRequest(f"'{name}' has {len(value)} entries; at most {cap}{why} (vLLM's GPU engines fail "
                             "past it)", param=name)


def _unicode(body: dict[str, Any]) -> None:
    """Refuses strings that are not Unicode text: JSON's escapes can spell half of a
    surrogate pair alone, which no tokenizer takes."""
    text = json.dumps(body, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = next((k for k, v in body.items() if not _encodes(v)), None)
        raise BadRequest("the request has a string with an unpaired UTF-16 surrogate escape (\\ud800 to "
                         "\\udfff), which is not Unicode text", param=param) from None


def _encodes(v: Any) -> bool:
    try:
        json.dumps(v, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
