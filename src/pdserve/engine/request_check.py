"""Whether a request body is one this vLLM accepts, by vLLM's own request models and sampling checks.

The router checks every body before the prefill leg (router/validate.py): a body only the decode engine
refuses would cost a full prefill and hold the prompt's KV blocks on the prefill engine until their lease
runs out. vLLM's request models are the exact rule, but importing them imports torch: half a GiB and seconds
in a router that computes no tensor. So they run where vLLM is imported anyway: each engine's API server
answers ``POST /pdserve/check`` (engine/vllm_plugin.py) with :func:`answer`, and the router asks an engine
(a prefill engine first: its server streams no tokens) before it spends anything.

For one body: vLLM's model for its route (``CompletionRequest``, ``ChatCompletionRequest``,
``ResponsesRequest``, ``AnthropicMessagesRequest``) parses a copy of it, then for chat and completions the
sampling parameters vLLM's serving code derives from it (``to_sampling_params``), so that vLLM's own checks
fire. The answer names the refused field, or gives the decided fields as the engine parsed them
(:data:`DECIDED_FIELDS`), so that the router's decisions read the engine's values.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdserve.errors import BadRequest

log = logging.getLogger(__name__)

#: vLLM's ``CompletionRequest.max_tokens`` default.
COMPLETION_DEFAULT_MAX_TOKENS = 16
ROUTES = ("chat", "completions", "responses", "messages")

_MESSAGE_MAX_CHARS = 300
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
#: Scalar fields the router decides on after the checks (P/D or not, streaming, the output budget, the early
#: first token, whether a stream may move): written back into the body as vLLM's request model parsed them,
#: so every decision reads the engine's value (``"2"`` -> 2, ``"false"`` -> False), never the client's
#: spelling of it. (``{"best_of": "2"}`` passed the check and then failed a comparison in the router.)
DECIDED_FIELDS = ("stream", "n", "best_of", "max_tokens", "max_completion_tokens", "max_output_tokens",
                  "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids",
                  "return_tokens_as_token_ids", "use_beam_search", "ignore_eos", "temperature", "seed")
# What vLLM's sampling parameters call a request field, where the names differ.
_PARAM_ALIASES = {"extra_args": "vllm_xargs"}


@dataclass(frozen=True)
class EngineModels:
    """vLLM's request models and the exceptions their checks raise."""

    completion: Any
    chat: Any
    validation_error: type[Exception]
    vllm_error: type[Exception]
    responses: Any = None
    messages: Any = None


_lock = threading.Lock()
_loaded: list[EngineModels | None] = []  # empty until the first try; then [models] or [None]


def engine_models() -> EngineModels | None:
    """vLLM's request models, imported on the first call (once per process); None when vLLM cannot be
    imported, which is logged once."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            t = time.perf_counter()
            models: EngineModels | None = None
            try:
                from pydantic import ValidationError
                from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
                from vllm.entrypoints.openai.completion.protocol import CompletionRequest
                from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
                from vllm.exceptions import VLLMValidationError

                models = EngineModels(CompletionRequest, ChatCompletionRequest, ValidationError, VLLMValidationError,
                                      ResponsesRequest, AnthropicMessagesRequest)
                log.info("vLLM's request models loaded in %.1fs", time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - any failure to import means: check without them
                log.warning("vLLM's request models cannot be imported (%s: %s); no request is checked by them",
                            type(e).__name__, e)
            _loaded.append(models)
    return _loaded[0]


def check(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """Raise :class:`BadRequest` naming the field when vLLM would refuse ``body`` on ``route``; else the
    :data:`DECIDED_FIELDS` the body gives, as vLLM's model parsed them (``"2"`` -> 2). Raises
    ``RuntimeError`` when vLLM cannot be imported here."""
    models = engine_models()
    if models is None:
        raise RuntimeError("vLLM's request models cannot be imported")
    request = _engine_request(models, route, body, json.dumps(body, ensure_ascii=False))
    decided = _as_parsed(request, body)
    if route in ("chat", "completions"):
        # (Responses and Messages requests are turned into sampling parameters by their own serving code,
        # with the model's defaults, which the check does not know.)
        _engine_sampling(models, request, body, _requested_tokens(route, request))
    return decided


#: In every answer of the check endpoint: the router trusts a refusal only with it (an engine's API server
#: also answers 400 for failures of its own, which must not refuse a client's request).
VERDICT = "pdserve_check"


def answer(data: Any) -> tuple[int, dict[str, Any]]:
    """The check endpoint's answer to ``{"route": ..., "body": {...}}``: 200 ``{"decided": {...}}``, or 400 with
    an OpenAI error naming the refused field; 422 for an envelope that is not a check (not the client's fault:
    the router decides without the engine then)."""
    if not isinstance(data, dict) or data.get("route") not in ROUTES or not isinstance(data.get("body"), dict):
        wrong = BadRequest("a check is {\"route\": one of " + ", ".join(ROUTES) + ", \"body\": {...}}")
        return 422, {**_error(wrong), VERDICT: False}
    try:
        return 200, {"decided": check(data["route"], data["body"]), VERDICT: True}
    except BadRequest as e:
        return 400, {**_error(e), VERDICT: True}


def _error(e: BadRequest) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": 400}}


def _requested_tokens(route: str, request: Any) -> int | None:
    """The output tokens the body asks for, as vLLM's serving code reads them (the router bounds them by the
    context: router/validate.py)."""
    n = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
    return COMPLETION_DEFAULT_MAX_TOKENS if n is None and route == "completions" else n


def _engine_request(models: EngineModels, route: str, body: dict[str, Any], text: str) -> Any:
    """The body (``text``: as JSON) through vLLM's request model for ``route``: the engine's own field types
    and checks."""
    cls = {"chat": models.chat, "completions": models.completion, "responses": models.responses,
           "messages": models.messages}[route]
    # vLLM's validators rewrite parts of what they are given (message fields, tool_choice): they get a copy,
    # and the engines get the client's body as sent.
    data = json.loads(text)
    try:
        return cls.model_validate(data)
    except models.validation_error as e:
        raise _from_pydantic(e, body) from None
    except models.vllm_error as e:
        raise _from_vllm(e, body) from None
    except (ValueError, TypeError, LookupError, AttributeError, OverflowError, RecursionError) as e:
        # A validator of vLLM's tripping over an unexpected shape: the engine would fail the same way.
        raise BadRequest(f"the request does not fit vLLM's request format: {_message(e)}") from None


def _as_parsed(request: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The :data:`DECIDED_FIELDS` the client gave, as ``request`` (vLLM's model of the body) holds them: the
    engine reads the same values either way, and the router's decisions read the engine's."""
    decided: dict[str, Any] = {}
    for k in DECIDED_FIELDS:
        if body.get(k) is not None and k in type(request).model_fields:
            v = getattr(request, k)
            if v is None or isinstance(v, (bool, int, float, str)):
                decided[k] = v
    return decided


def _engine_sampling(models: EngineModels, request: Any, body: dict[str, Any], max_tokens: int | None) -> None:
    """Derive the sampling parameters as vLLM's serving code does (``to_sampling_params`` with the output
    budget; the OpenAI defaults, as the router does not know the model's generation config), so that
    ``SamplingParams``' own checks run."""
    try:
        if getattr(request, "use_beam_search", False):
            request.to_beam_search_params(max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, {})
        else:
            request.to_sampling_params(max_tokens, {})
    except models.vllm_error as e:
        raise _from_vllm(e, body) from None
    except (ValueError, TypeError, LookupError, AttributeError, OverflowError) as e:
        raise BadRequest(f"invalid sampling parameters: {_message(e)}", param=_param_from_message(str(e), body)) \
            from None


def _message(e: BaseException) -> str:
    text = str(e.args[0]) if e.args else type(e).__name__
    return text if len(text) <= _MESSAGE_MAX_CHARS else text[:_MESSAGE_MAX_CHARS] + "..."


def _from_vllm(e: Any, body: dict[str, Any]) -> BadRequest:
    msg = _message(e)
    param = getattr(e, "parameter", None) or _param_from_message(msg, body)
    return BadRequest(msg, param=_PARAM_ALIASES.get(param, param) if param else None)


def _param_from_message(msg: str, body: dict[str, Any]) -> str | None:
    """vLLM's sampling checks begin their messages with the field's name ("min_tokens must be ..."); that
    name, when the client sent such a field."""
    m = _FIELD_NAME.match(msg)
    if m is None:
        return None
    name = _PARAM_ALIASES.get(m.group(0), m.group(0))
    return name if name in body else None



# Names pydantic puts in an error's location that are not fields: union members, validator kinds.
_INTERNAL_LOC = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none",
                           "union", "nullable", "default", "chain", "call", "arguments", "json-or-python",
                           "lax-or-strict", "tagged-union", "function-wrap", "function-after",
                           "function-before", "function-plain"})


def _loc_param(loc: tuple[Any, ...], body: Any) -> str | None:
    """A pydantic error location as the client's field path: the segments found in the body, plus a last
    one that names a missing field."""
    parts: list[str] = []
    node = body
    for i, seg in enumerate(loc):
        if isinstance(node, dict) and isinstance(seg, str) and seg in node:
            parts.append(seg)
            node = node[seg]
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            parts.append(str(seg))
            node = node[seg]
        elif (i == len(loc) - 1 and isinstance(node, dict) and isinstance(seg, str)
              and _FIELD_NAME.fullmatch(seg) and seg not in _INTERNAL_LOC):
            parts.append(seg)
    return ".".join(parts) or None


def _from_pydantic(e: Any, body: dict[str, Any]) -> BadRequest:
    errors = e.errors(include_url=False, include_input=False)
    if not errors:
        return BadRequest("invalid request")

    def param_of(err: Any) -> str | None:
        ctx_error = (err.get("ctx") or {}).get("error")
        return getattr(ctx_error, "parameter", None) or _loc_param(tuple(err.get("loc", ())), body)

    param = param_of(errors[0])
    # A value that fits no member of a union fails once per member, the first usually with a wrong-type
    # error; an error of another kind at the same field says more ("at most 4 items").
    same = [err for err in errors if param_of(err) == param]
    first = next((err for err in same if not str(err.get("type", "")).endswith("_type")), same[0])
    msg = str(first.get("msg") or "invalid value")
    if len(msg) > _MESSAGE_MAX_CHARS:
        msg = msg[:_MESSAGE_MAX_CHARS] + "..."
    more = len(errors) - 1
    text = f"'{param}': {msg}" if param else msg
    if more:
        text += f" (and {more} more {'error' if more == 1 else 'errors'})"
    return BadRequest(text, param=param)
