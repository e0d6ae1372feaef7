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

Pins are bounded (:func:`bound_pins`, in the engine core's NIXL scheduler): together they hold at most
:data:`ENV_SHARE` of the engine's KV blocks (``nixl.decode_pin_share``; a block two pins hold counts
once), so the streams it runs always have the rest. A finished request whose blocks would pass the bound is
not pinned: vLLM frees them at once, no params come out, nothing is noted, and its next turn's prefill
computes what it lacks (the router counts ``gone``).
A pin is never released early: a prefill engine may be reading it.

On the reading side, a prefill request reads kept blocks once at most (:func:`read_back_once`): a read vLLM
declined (the pin about to run out) is computed instead, not waited for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections.abc import Sequence
from typing import Any

from pdserve.owned import OwnedOrder, fair_share
from pdserve.settings import KV_HANDBACK_TTL_ENV as ENV_TTL
from pdserve.settings import KV_PIN_FAIR_ENV as ENV_FAIR
from pdserve.settings import KV_PIN_SHARE_ENV as ENV_SHARE

log = logging.getLogger(__name__)

#: Where the router asks (router/handback.py's ``PATH``).
PATH = "/pdserve/kv-handback/{request_id}"
#: Notes kept at most (the oldest go first); each holds its request's token ids, 4 bytes each.
MAX_NOTES = 256

_lock = threading.Lock()
#: A request's external id -> (when its pin ends, what the engine kept for it).
_notes: dict[str, tuple[float, dict[str, Any]]] = {}
#: The notes by their owners (:func:`pin_owner`), the oldest first: past MAX_NOTES the owner keeping the most
#: gives way (one tenant finishing 256 requests within a pin's time pushed out every other tenant's note).
_order: OwnedOrder[str] = OwnedOrder()
#: The engine's KV block size (set when the API server starts: :func:`set_block_size`).
_block_size: int | None = None


def set_block_size(size: Any) -> None:
    global _block_size
    _block_size = int(size) if isinstance(size, int) and size > 0 else None


def _positive(name: str) -> float:
    """The environment variable ``name`` as a number; 0 when unset, not a number or not positive."""
    try:
        value = float(os.environ.get(name) or 0.0)
    except ValueError:
        return 0.0
    return value if value > 0 else 0.0


def ttl_s() -> float | None:
    """The pin's length this engine was started with (:data:`ENV_TTL`), or ``None`` when off."""
    return _positive(ENV_TTL) or None


def pin_share() -> float | None:
    """The share of its KV blocks a decode engine's pins may hold (:data:`ENV_SHARE`), or ``None`` (no bound)."""
    share = _positive(ENV_SHARE)
    return share if 0.0 < share < 1.0 else None


#: With tenants (:data:`ENV_FAIR`), the share of the pins' bound kept for owners under their share of it.
PIN_RESERVE = 0.25


def pin_owner(cache_salt: Any, tenants: bool | None = None) -> str:
    """Whose pin (and note) a request's is: with tenants (``tenants``; None: :data:`ENV_FAIR` says), the tenant
    part of its ``cache_salt`` (the router gives every tenant's requests its own salt, with the client's after
    a ``:``); else "" for every request. Without tenants the salt is whatever the client sent: owners read
    from it would let one client pose as many, each keeping little, so every other client's notes gave way
    first."""
    if tenants is None:
        tenants = os.environ.get(ENV_FAIR) == "1"
    return cache_salt.split(":", 1)[0] if tenants and isinstance(cache_salt, str) else ""


class PinBudget:
    """The blocks a decode engine holds for next turns, against the most its pins may hold (``limit``). A
    block counts once however many pins hold it: a conversation's next turn reuses its last turn's cached
    blocks (decode's prefix cache), so a pin often holds blocks an unread older pin still holds. Each call
    costs the request's own blocks, not every pinned one (it runs in the engine core's scheduler).

    ``fair`` (an app with tenants): the last :data:`PIN_RESERVE` of the bound is kept for owners
    (:func:`pin_owner`) holding less than their share of it (the bound over the owners with pins, two at
    least). A pin cannot be given back early, so without it one tenant's turns filled the bound for a whole
    pin's time and no other tenant's turn was kept."""

    def __init__(self, limit: int, fair: bool = False) -> None:
        self.limit = limit
        self.fair = fair
        #: Pinned request id -> (its blocks, as (KV cache group, block id) pairs; when its pin runs out:
        #: ``time.perf_counter``, as vLLM's; its owner).
        self.held: dict[str, tuple[frozenset[tuple[int, int]], float, str]] = {}
        #: Each pinned block -> how many pins hold it.
        self._refs: dict[tuple[int, int], int] = {}
        #: Each owner's pinned blocks -> how many of its pins hold it.
        self._owned: dict[str, dict[tuple[int, int], int]] = {}

    @staticmethod
    def _unref(refs: dict[tuple[int, int], int], blocks: frozenset[tuple[int, int]]) -> None:
        for block in blocks:
            left = refs[block] - 1
            if left:
                refs[block] = left
            else:
                del refs[block]

    def _drop(self, request_id: str) -> None:
        got = self.held.pop(request_id, None)
        if got is None:
            return
        blocks, _, owner = got
        self._unref(self._refs, blocks)
        mine = self._owned.get(owner)
        if mine is not None:
            self._unref(mine, blocks)
            if not mine:
                del self._owned[owner]

    def _expire(self, now: float) -> None:
        """Pins past their end are dropped: vLLM frees them by then."""
        for rid in [rid for rid, (_, end, _) in self.held.items() if end <= now]:
            self._drop(rid)

    def in_use(self, now: float) -> int:
        """Blocks pinned now, each once."""
        self._expire(now)
        return len(self._refs)

    def admit(self, request_id: str, blocks: frozenset[tuple[int, int]], end: float, now: float,
              owner: str = "") -> bool:
        """Whether a finished request's ``blocks`` (:func:`block_keys`) may be pinned until ``end``; held if
        so. Only the blocks no live pin holds yet add to what is held."""
        self._expire(now)
        new = sum(1 for block in blocks if block not in self._refs)
        if len(self._refs) + new > self.limit:
            return False
        if self.fair and len(self._refs) + new > self.limit * (1.0 - PIN_RESERVE):
            mine = self._owned.get(owner, {})
            owners = len(self._owned) + (owner not in self._owned)
            if len(mine) + sum(1 for block in blocks if block not in mine) > fair_share(self.limit, owners):
                return False
        self._drop(request_id)  # (the same request pinned again: its new pin replaces the old)
        self.held[request_id] = (blocks, end, owner)
        mine = self._owned.setdefault(owner, {})
        for block in blocks:
            self._refs[block] = self._refs.get(block, 0) + 1
            mine[block] = mine.get(block, 0) + 1
        return True

    def release(self, request_ids: Any) -> None:
        """Pins that ended: read by a prefill engine, or run out (vLLM's ``finished_sending``)."""
        for rid in request_ids or ():
            self._drop(rid)


def block_keys(remote_block_ids: Any) -> frozenset[tuple[int, int]]:
    """A pin's blocks from its params' ``remote_block_ids`` (a list of block ids per KV cache group)."""
    return frozenset((g, int(b)) for g, group in enumerate(remote_block_ids or ()) for b in group)


def bound_pins(cls: Any, share: float, clock: Any = time.perf_counter, fair: bool = False) -> bool:
    """Bound the pins of vLLM's NIXL scheduler-side connector ``cls`` (the pull mode's) to ``share`` of the
    engine's KV blocks (``fair``: with the owners' reserve, :class:`PinBudget`). Safe to call repeatedly."""
    if getattr(cls.request_finished, "_pdserve_pin_share", None) == (share, fair):
        return True
    finished = getattr(cls.request_finished, "_pdserve_original", cls.request_finished)
    update = getattr(cls.update_connector_output, "_pdserve_original", cls.update_connector_output)

    def budget(self: Any) -> PinBudget:
        got = self.__dict__.get("_pdserve_pins")
        if got is None:
            got = self._pdserve_pins = PinBudget(int(self.kv_cache_config.num_blocks * share), fair)
        return got

    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        delay, params = finished(self, request, block_ids)
        if delay and pinned(params):
            rid = request.request_id
            blocks = block_keys(params["remote_block_ids"])
            end = self._reqs_need_send.get(rid, clock())
            pins = budget(self)
            if not pins.admit(rid, blocks, end, clock(), pin_owner(getattr(request, "cache_salt", None), fair)):
                self._reqs_need_send.pop(rid, None)  # not sent to the worker yet: vLLM frees the blocks now
                log.debug("request %s: its %d blocks are not kept for the next turn: kept blocks would pass %d "
                          "(nixl.decode_pin_share %g)", rid, len(blocks), pins.limit, share)
                return False, None
        return delay, params

    def update_connector_output(self: Any, connector_output: Any) -> Any:
        got = update(self, connector_output)
        pins = self.__dict__.get("_pdserve_pins")
        if pins is not None:
            pins.release(connector_output.finished_sending)
        return got

    request_finished._pdserve_pin_share = (share, fair)  # type: ignore[attr-defined]
    request_finished._pdserve_original = finished  # type: ignore[attr-defined]
    update_connector_output._pdserve_original = update  # type: ignore[attr-defined]
    cls.request_finished = request_finished
    cls.update_connector_output = update_connector_output
    return True


def read_back_once(cls: Any) -> bool:
    """A prefill request reads decode's kept blocks at most once (vLLM's NIXL pull scheduler-side connector
    ``cls``). Safe to call repeatedly.

    vLLM 0.32 marks such a request's params ``_remote_blocks_processed`` once its read is set up ("only
    trigger 1 KV transfer per request"), yet still offers the blocks to the scheduler when it looks again.
    After a declined read (the pin about to run out: "Declining expired remote read"), the scheduler sends
    the request back to the waiting queue to compute what it lacks (``kv_load_failure_policy: recompute``),
    looks again, is offered the blocks again, and parks the request waiting for a read nobody starts: no
    answer, "KV fetch: 1 in progress" for good, and, once the client gives up, its blocks held until the
    engine stops (measured: 17 % of a prefill engine's KV cache per such turn). Here, once read or tried, the
    request computes those tokens itself."""
    if getattr(cls.get_num_new_matched_tokens, "_pdserve_read_once", False):
        return True
    original = cls.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        params = request.kv_transfer_params
        if (isinstance(params, dict) and params.get("_remote_blocks_processed")
                and not params.get("do_remote_prefill")):
            return 0, False
        return original(self, request, num_computed_tokens)

    get_num_new_matched_tokens._pdserve_read_once = True  # type: ignore[attr-defined]
    cls.get_num_new_matched_tokens = get_num_new_matched_tokens
    return True


def _forget(external_id: str) -> tuple[float, dict[str, Any]] | None:
    """Drop a note (under ``_lock``)."""
    _order.discard(external_id)
    return _notes.pop(external_id, None)


def note(external_id: str, params: dict[str, Any], tokens: Sequence[int], lora: str | None, ttl: float,
         now: float | None = None, owner: str = "") -> None:
    """Keep a pinned request's ``params``, its ``tokens`` (prompt and answer, the engine's own ids) and
    its LoRA adapter for ``external_id`` until the pin runs out."""
    now = time.monotonic() if now is None else now
    held = {"kv_transfer_params": params, "token_ids": array("l", tokens), "lora": lora}
    with _lock:
        _notes[external_id] = (now + ttl, held)
        _order.add(external_id, owner)
        for gone in _order.trim(MAX_NOTES):
            del _notes[gone]
        while _order:  # the oldest first: they run out first
            oldest = next(iter(_order))
            if _notes[oldest][0] > now:
                break
            _forget(oldest)


def take(request_id: str, now: float | None = None) -> dict[str, Any] | None:
    """What the engine kept for the request the router sent as ``request_id`` (its ``X-Request-Id``): the
    params that name the blocks, the tokens those blocks hold (the router checks the next prompt against
    them), the adapter and the block size. Once: a second read of the same blocks would find them freed by
    the first."""
    now = time.monotonic() if now is None else now
    with _lock:
        for key in (f"chatcmpl-{request_id}", f"cmpl-{request_id}-0", f"cmpl-{request_id}", request_id):
            got = _forget(key)
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
    """Note pinned requests in this process's output processor (vLLM's API server), bound the pins of its
    NIXL connector and read kept blocks once at most (the engine core's, forked from it). Safe to call
    repeatedly; ``False`` when off (:data:`ENV_TTL` unset) or when this process has no vLLM."""
    ttl = ttl_s()
    if ttl is None:
        return False
    import importlib

    share = pin_share()
    try:
        pull = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler")
    except Exception:  # noqa: BLE001 - no NIXL connector here: nothing is pinned or read back
        pull = None
    if pull is not None:
        read_back_once(pull.NixlPullConnectorScheduler)  # prefill engines: a declined read is computed
        if share is not None:
            bound_pins(pull.NixlPullConnectorScheduler, share, fair=os.environ.get(ENV_FAIR) == "1")
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
                note(state.external_req_id, params, tokens[:computed], state.lora_name, ttl,
                     owner=getattr(state, "_pdserve_owner", ""))
        return got

    process_outputs._pdserve_handback = True  # type: ignore[attr-defined]
    cls.process_outputs = process_outputs
    add = getattr(cls, "add_request", None)
    if add is not None:
        def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            got = add(self, request, *args, **kwargs)
            state = self.request_states.get(getattr(request, "request_id", None))
            if state is not None:  # whose the request is: its notes give way to the owner keeping the most
                state._pdserve_owner = pin_owner(getattr(request, "cache_salt", None))
            return got

        cls.add_request = add_request
    return True
