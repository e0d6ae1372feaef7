"""The one place that shapes the prefill and decode requests of the P/D handoff.

Flow (vLLM + NixlConnector):

1. prefill leg: the client's request with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params = {do_remote_decode: true, ...}``. The prefill engine computes the prompt's KV
   cache, keeps the blocks, and answers with ``kv_transfer_params`` that name them.
2. decode leg: the client's request unchanged plus those ``kv_transfer_params``; the decode engine pulls
   the blocks over NIXL and generates.

Some requests cannot be split and run on a decode engine alone; :func:`plan` says which.

Four APIs are split alike, each with its own names for the fields the prefill leg rewrites (vLLM 0.32 takes
``kv_transfer_params`` in all four request bodies and returns it in their non-streamed answers):

========================  =========================  =====================================================
route (path)              output budget              prefill leg also sets
========================  =========================  =====================================================
completions               ``max_tokens``
chat                      ``max_completion_tokens``  ``max_tokens`` (either may be given)
responses (Responses)     ``max_output_tokens``      ``store: false`` (the 1-token answer is not kept),
                                                     ``background: false``
messages (Anthropic)      ``max_tokens`` (required)
========================  =========================  =====================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdserve.errors import BadRequest
from pdserve.router import sse, structured
from pdserve.router.request import Request, Route

#: What the prefill engine needs to keep the blocks for a remote decode.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Keys of the prefill engine's answer that decode needs; without them vLLM silently recomputes.
REQUIRED_DECODE_KV_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")

# Fields that only matter for generation; dropped on the prefill leg so it stays a pure prompt pass.
_PREFILL_DROP = ("stream_options", "min_tokens", "logit_bias", "n", "best_of")

MAX_N = 128

#: Top-level fields only the router may set (vLLM reads them into the engine request's extra_args).
ROUTER_OWNED = ("kv_transfer_params", "ec_transfer_params")
#: ``vllm_xargs`` keys vLLM 0.32 reads internally (``vllm/v1/request.py``, ``v1/engine/output_processor.py``).
ENGINE_INTERNAL_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


@dataclass(frozen=True)
class Plan:
    disaggregate: bool
    reason: str


def _int_field(body: dict[str, Any], key: str, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer", param=key)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{key}' must be {bound}, got {value}", param=key)
    return value


def check_request(route: Route, body: dict[str, Any]) -> None:
    """Checks the router must make itself: the prefill leg rewrites these fields, so the engine on that
    leg never sees the client's values, and a bad value found only on the decode leg would strand KV
    blocks on the prefill engine."""
    if route in ("chat", "messages"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
    elif route == "responses":
        given = body.get("input")
        if not isinstance(given, (str, list)) or not given:
            raise BadRequest("'input' must be a non-empty string or array", param="input")
    else:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' must be a non-empty string or array", param="prompt")
    if route == "messages" and body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    _int_field(body, "max_tokens", lo=1)
    _int_field(body, "max_completion_tokens", lo=1)
    _int_field(body, "max_output_tokens", lo=1)
    _int_field(body, "n", lo=1, hi=MAX_N)
    _int_field(body, "best_of", lo=1, hi=MAX_N)
    _int_field(body, "min_tokens", lo=0)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    for key in ROUTER_OWNED:
        if key in body:
            raise BadRequest(f"'{key}' is set by the router, not by clients", param=key)
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or priority != 0):
        # With engines that schedule by priority, a client's own would put it ahead of (and preempt) every
        # other tenant's requests; the router's tenants have priorities of their own (router.tenants).
        raise BadRequest("'priority' is the router's to set (router.tenants.<name>.priority); send 0 or "
                         "leave it out", param="priority")
    if route == "responses" and body.get("background"):
        # vLLM answers a background request at once and generates on its own: the router would let go of its
        # claims (its in-flight caps, the tenant's limits) while the engine still works.
        raise BadRequest("'background' responses are not served through pdserve's router: send the request "
                         "without it (streamed if the answer is long)", param="background")
    check_chat_template(body)
    structured.check(body)
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise BadRequest("'vllm_xargs' must be an object", param="vllm_xargs")
        for key in ENGINE_INTERNAL_XARGS:
            if key in xargs:
                # vLLM copies vllm_xargs into its request's extra_args, where these steer the KV connector: a
                # wrong type there has killed a decode EngineCore.
                raise BadRequest(f"'vllm_xargs.{key}' steers vLLM's KV transfer and is set by the router only",
                                 param=f"vllm_xargs.{key}")


#: Keys of ``chat_template_kwargs`` that would replace the template or what it renders, not parametrise it:
#: every named parameter of transformers' ``apply_chat_template``, which vLLM passes on as given besides the
#: template's own variables (``padding: max_length`` with ``max_length: 6000`` made "hi" a 6,000-token prompt
#: the router counted as 6), and the request fields the template reads.
TEMPLATE_RESERVED_KWARGS = frozenset({
    "chat_template", "tokenize", "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "tokenizer_kwargs", "padding", "truncation",
    "max_length", "return_assistant_tokens_mask", "self", "kwargs",
})


def check_chat_template(body: dict[str, Any]) -> None:
    """A request may parametrise the model's chat template, never replace it: the router renders the
    template itself to route by cached prefix, and a client's template is a program (two nested loops held
    the router's event loop for minutes). vLLM refuses a request's template too unless started with
    ``--trust-request-chat-template``; pdserve refuses it before anything renders it."""
    if body.get("chat_template") is not None:
        raise BadRequest("'chat_template' cannot be set by a request: the model's own chat template applies",
                         param="chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for key in kwargs:
        if key in TEMPLATE_RESERVED_KWARGS:
            raise BadRequest(f"'chat_template_kwargs.{key}' cannot be set by a request (it would replace the "
                             "template or what it renders)", param=f"chat_template_kwargs.{key}")


#: The plan's reason for a prompt computed on decode because it is short (``local_prefill_below_tokens``).
SHORT_PROMPT = "short_prompt"
#: Requests that cannot be split whose work is mostly their prompt (one token of answer, the prompt's
#: logprobs, media, several prompts): where a decode engine streams, a prefill engine answers them whole
#: (router/admission.py).
PROMPT_BOUND = ("max_tokens=1", "prompt logprobs", "media_url", "batched prompts")
#: The plan's reason for a request run on the decode replica that holds most of its prompt
#: (``cache_aware_steps``, router/cache_aware.py).
CACHED_ON_DECODE = "cached_on_decode"


def plan(req: Request, *, local_below: int = 0, cached_on_decode: bool = False) -> Plan:
    """Decide whether a request is split into prefill and decode legs. ``cached_on_decode``: a decode
    replica holds all of its prompt but a part it computes in a few of its steps (router/cache_aware.py)."""
    if req.previous_response_id:
        # The conversation so far is stored on the decode engine that answered it: only that one can
        # build this prompt.
        return Plan(False, "previous_response")
    if req.builtin_tools:
        # After each call of a tool the engine runs itself, vLLM generates again with the first generation's
        # sampling params, KV params included: a decode leg would pull prefill's blocks again, long released.
        return Plan(False, "builtin_tools")
    if not req.sampled_once:
        # Several sequences cannot share one set of pulled blocks in vLLM's NIXL connector.
        return Plan(False, "n>1")
    if req.max_new_tokens == 1:
        # The prefill leg would already be the whole answer; the blocks would be held for nothing.
        return Plan(False, "max_tokens=1")
    if req.prompt_logits:
        # Prompt logprobs need the prompt's logits, which exist only where the prompt was computed.
        return Plan(False, "prompt logprobs")
    if req.media_fetched:
        # Each leg would fetch the media itself, and could get other bytes than the other (router/media.py).
        return Plan(False, "media_url")
    if req.prompts > 1:
        # A batch of prompts in one request returns several choices: one handoff each is not supported.
        return Plan(False, "batched prompts")
    if cached_on_decode:
        # The prompt is (nearly all) in that decode replica's cache already: a handoff would move it there again.
        return Plan(False, CACHED_ON_DECODE)
    if local_below and req.prompt_tokens < local_below:
        # Short prompts cost less to prefill in place than the hop and the handoff cost. Last: a request that
        # cannot be split says why above, and one that can may still be split (``auto`` when decode is busy).
        return Plan(False, SHORT_PROMPT)
    return Plan(True, "pd")


def prefill_body(route: Route, body: dict[str, Any], kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request sent to the prefill engine. ``kv``: the params of blocks a decode engine kept of the
    conversation's last turn, for prefill to read (router/handback.py); else prefill computes the prompt."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    if route == "responses":
        out.update(max_output_tokens=1, store=False, background=False)
    else:
        out["max_tokens"] = 1
    if route == "chat":
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(kv) if kv else dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The request sent to the decode engine: the client's own plus the prefill engine's answer."""
    out = dict(body)
    out["kv_transfer_params"] = kv_params
    return out


#: A whole answer's KV params as vLLM writes them: an object, not ``null`` (FastAPI's compact JSON).
_KV_PARAMS_SET = re.compile(rb'"kv_transfer_params"\s*:\s*\{')


def client_answer(raw: bytes | None) -> bytes | None:
    """A whole answer (or a stored Responses answer) as its client gets it: ``kv_transfer_params`` null, as one
    engine's. A decode engine that keeps a finished request's blocks for the next turn
    (``nixl.bidirectional``) writes their params into the answer: its NIXL address, engine id and block ids,
    which are the router's to use (it reads them from the engine's note, router/handback.py), never a
    client's to see."""
    if not raw or _KV_PARAMS_SET.search(raw) is None:
        return raw
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(data, dict) or data.get("kv_transfer_params") is None:
        return raw  # (the text was in a string of the answer's)
    data["kv_transfer_params"] = None
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _clean_event(event: bytes) -> bytes:
    """A Responses stream event (``response.completed`` carries the whole answer) without the KV params."""
    if _KV_PARAMS_SET.search(event) is None:
        return event
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(sse.DATA):
            try:
                data = json.loads(line[len(sse.DATA):])
            except ValueError:
                return event
            inner = data.get("response") if isinstance(data, dict) else None
            for obj in (data, inner):
                if isinstance(obj, dict) and obj.get("kv_transfer_params") is not None:
                    obj["kv_transfer_params"] = None
            lines[i] = sse.DATA + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    return b"\n".join(lines)


async def client_events(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A Responses stream as its client gets it: its last event (``response.completed``, the whole answer)
    with ``kv_transfer_params`` null, as :func:`client_answer` does for whole answers. Passed on by whole
    events."""
    splitter = sse.Splitter()
    async for chunk in stream:
        events = splitter.feed(chunk)
        if events:
            yield b"".join(_clean_event(e) + sse.SEP for e in events)
    if splitter.rest:
        yield splitter.rest


def usable_kv_params(kv: Any) -> dict[str, Any] | None:
    """The prefill answer's ``kv_transfer_params`` if decode can pull with them, else ``None``."""
    if not isinstance(kv, dict):
        return None
    if any(kv.get(k) in (None, "") for k in REQUIRED_DECODE_KV_KEYS):
        return None
    return kv
