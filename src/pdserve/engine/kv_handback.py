"""A decode engine hands a finished request's KV blocks back for the conversation's next turn.

With vLLM's ``bidirectional_kv_xfer`` (``nixl.bidirectional``), a decode engine keeps every finished
request's blocks -- the prompt's and the ones it generated -- for ``decoder_kv_blocks_ttl`` seconds and
returns, with the request's last output, the ``kv_transfer_params`` that name them. The next turn's prefill
leg, given those params, reads the blocks over NIXL instead of computing what it lacks (the last answer,
and the history's last partial block) and computes only the new tokens.

vLLM returns those params in a non-streamed answer only; streams, which is how agents talk, never carry
them. So this module, inside the decode engine's API server:

* :func:`install` (run by pdserve's general plugin when :data:`ENV_TTL` is set) notes the params of each
  request whose engine pinned its blocks, as the engine core's outputs arrive, under the request's external
  id (``chatcmpl-<X-Request-Id>``, ``cmpl-<X-Request-Id>-0``), until the pin runs out;
* :func:`take` answers ``GET /pdserve/kv-handback/{request_id}`` (engine/vllm_plugin.py) once per request:
  the router asks for them when the next turn extends that request's tokens (router/handback.py).

A pin that is never read runs out by itself (vLLM frees the blocks after the TTL); so do the notes here.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdserve.settings import KV_HANDBACK_TTL_ENV as ENV_TTL

#: Where the router asks (router/handback.py's ``PATH``).
PATH = "/pdserve/kv-handback/{request_id}"
#: Notes kept at most (the oldest go first); each holds its request's token ids, 4 bytes each.
MAX_NOTES = 256

_lock = threading.Lock()
_notes: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
#: The engine's KV block size (set when the API server starts: :func:`set_block_size`).
_block_size: int | None = None


def set_block_size(size: Any) -> None:
    global _block_size
    _block_size = int(size) if isinstance(size, int) and size > 0 else None


def ttl_s() -> float | None:
    """The pin's length this engine was started with (:data:`ENV_TTL`), or ``None`` when off."""
    raw = os.environ.get(ENV_TTL)
    try:
        ttl = float(raw) if raw else 0.0
    except ValueError:
        return None
    return ttl if ttl > 0 else None


def note(external_id: str, params: dict[str, Any], tokens: Sequence[int], lora: str | None, ttl: float,
         now: float | None = None) -> None:
    """Keep a pinned request's ``params``, its ``tokens`` (prompt and answer, the engine's own ids) and
    its LoRA adapter for ``external_id`` until the pin runs out."""
    now = time.monotonic() if now is None else now
    held = {"kv_transfer_params": params, "token_ids": array("l", tokens), "lora": lora}
    with _lock:
        _notes[external_id] = (now + ttl, held)
        _notes.move_to_end(external_id)
        while len(_notes) > MAX_NOTES:
            _notes.popitem(last=False)
        while _notes:  # the oldest first: they run out first
            first = next(iter(_notes.values()))
            if first[0] > now:
                break
            _notes.popitem(last=False)


def take(request_id: str, now: float | None = None) -> dict[str, Any] | None:
    """What the engine kept for the request the router sent as ``request_id`` (its ``X-Request-Id``): the
    params that name the blocks, the tokens those blocks hold (the router checks the next prompt against
    them), the adapter and the block size. Once: a second read of the same blocks would find them freed by
    the first."""
    now = time.monotonic() if now is None else now
    with _lock:
        for key in (f"chatcmpl-{request_id}", f"cmpl-{request_id}-0", f"cmpl-{request_id}", request_id):
            got = _notes.pop(key, None)
            if got is not None:
                deadline, held = got
                if deadline <= now:
                    return None
                return {"kv_transfer_params": held["kv_transfer_params"], "token_ids": held["token_ids"].tolist(),
                        "lora": held["lora"], "block_size": _block_size}
    return None


def pinned(params: Any) -> bool:
    """Whether an engine core output's ``kv_transfer_params`` name blocks a decode engine pinned for a
    later read (vLLM sets ``do_remote_decode`` on them, and lists the blocks)."""
    return (isinstance(params, dict) and bool(params.get("do_remote_decode"))
            and bool(params.get("remote_block_ids")) and bool(params.get("remote_engine_id")))


def install() -> bool:
    """Note pinned requests in this process's output processor (vLLM's API server). Safe to call
    repeatedly; ``False`` when off (:data:`ENV_TTL` unset) or when this process has no vLLM."""
    ttl = ttl_s()
    if ttl is None:
        return False
    import importlib

    try:
        op = importlib.import_module("vllm.v1.engine.output_processor")
    except Exception:  # noqa: BLE001 - not a vLLM process with an output processor
        return False
    cls = op.OutputProcessor
    if getattr(cls.process_outputs, "_pdserve_handback", False):
        return True
    original = cls.process_outputs

    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        ending = []
        for out in engine_core_outputs:
            params = out.kv_transfer_params
            if params is not None and out.finish_reason is not None and pinned(params):
                state = self.request_states.get(out.request_id)
                if state is not None and state.external_req_id and state.detokenizer is not None:
                    ending.append((state, params))
        got = original(self, engine_core_outputs, *args, **kwargs)
        for state, params in ending:  # after the original: the state now has the last tokens
            tokens = list(state.prompt_token_ids or ()) + list(state.detokenizer.output_token_ids)
            computed = params.get("remote_num_tokens")
            if isinstance(computed, int) and 0 < computed <= len(tokens):
                # (fewer tokens than the blocks hold: the answer was cut back at a stop string; not kept)
                note(state.external_req_id, params, tokens[:computed], state.lora_name, ttl)
        return got

    process_outputs._pdserve_handback = True  # type: ignore[attr-defined]
    cls.process_outputs = process_outputs
    return True
