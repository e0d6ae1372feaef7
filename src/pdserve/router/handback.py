"""The next turn's prefill reads what decode kept of the last one (``nixl.bidirectional``).

A conversation's next turn sends the whole history again: the last turn's prompt, its answer, a few new
tokens. Plain P/D prefills it on a prefill engine, which holds the last prompt in its prefix cache (all but
its last partial block) but never saw the answer, which decode generated: it computes the answer and that
partial block again. With vLLM's ``bidirectional_kv_xfer`` the decode engine keeps a finished request's
blocks for a while (``nixl.decode_blocks_ttl_s``), and the next prefill leg, given their
``kv_transfer_params``, reads them over NIXL and computes only the new tokens.

The flow, one P/D turn to the next:

1. a finished request is noted here under its decode replica and the id its engine knows it by
   (:meth:`Handbacks.record`), keyed by the chain of its leading tokens: a stream with a tape (chat and
   completions streams that may move, router/migrate.py) by its prompt and answer ids, the engine's own;
   every other answer of any API -- tools, stop strings, the Responses and Messages APIs, whole
   (non-streamed) answers -- by the prompt's ids as the router rendered them (:meth:`Handbacks.noting_events`,
   :meth:`Handbacks.note_answer`), once the engine's answer ended whole;
2. the next request whose prompt starts with a noted request's tokens, from the same tenant, finds it
   (:meth:`Handbacks.find`), and the router asks that decode engine for what it kept
   (``GET /pdserve/kv-handback/{request_id}``, engine/kv_handback.py: the params, the tokens the blocks
   hold, the adapter, the block size), once;
3. :func:`prefill_params` checks the new prompt against the engine's own tokens, not the router's note:
   the blocks are read only for the prompt's leading tokens that equal them exactly, under the same
   adapter, cut to whole blocks of those tokens; nothing else is read. The prefill engine pulls them
   (what its own cache holds it keeps) and computes the rest.

A pin that runs out before prefill reads it is declined by vLLM itself (the params carry its deadline):
vLLM declines from 5 s before the pin's end, so the router finds a note only when the prefill leg would
start within :func:`read_window_s` of its request's end, and counts a later turn ``none``. Where the queue
drained later than estimated, vLLM 0.32 declines the read and never answers the leg: a leg that reads is
given up after :func:`read_guard_s` and sent again to the same engine without the read (``stalled``). A
request noted whose engine kept nothing (it was cut short, or cut back at a stop string) costs one question
and reads nothing (``gone``). Not noted: a Responses request that
continues a stored response (``previous_response_id``: it runs on the engine that holds the conversation).
"""

from __future__ import annotations

import json
import logging
import math
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pdserve.config.host import HANDBACK_SLACK_S, VLLM_READ_MARGIN_S
from pdserve.errors import UpstreamError, UpstreamTimeout
from pdserve.owned import OwnedOrder
from pdserve.router import stored
from pdserve.router.endpoint import Endpoint
from pdserve.router.request import Request, lora_adapter

if TYPE_CHECKING:
    from pdserve.router.migrate import Tape

log = logging.getLogger(__name__)

#: Where a decode engine answers (engine/kv_handback.py's ``PATH``).
PATH = "/pdserve/kv-handback/{request_id}"
#: The router's own grain for a noted request's key (tokens); independent of the engines' block size.
GRAIN = 64
#: Grains noted at most (the oldest go first), and requests noted under one grain.
MAX_NOTED = 1024
PER_KEY = 8
#: Fewer tokens than this read from decode are not worth a NIXL read: prefill computes them.
MIN_TOKENS = 16
#: What an engine's stream sends last when it ended whole, per API (a stream cut short never sends it).
ENDS = {"chat": b"data: [DONE]", "completions": b"data: [DONE]", "messages": b"message_stop",
        "responses": b"response.completed"}


def read_window_s(ttl_s: float) -> float:
    """How long after a request finished its kept blocks can still be read: decode's pin
    (``nixl.decode_blocks_ttl_s``) less vLLM's read margin (a prefill engine declines a read that late and
    computes the tokens) and the router's slack; 0 when never. A read must also start within it: a note is
    found only if the prefill engine's queue drains before the window ends (:meth:`Handbacks.find`)."""
    return max(0.0, ttl_s - VLLM_READ_MARGIN_S - HANDBACK_SLACK_S)


#: A prefill leg that reads decode's kept blocks and has not answered within this many times its expected
#: time (its engine's queue, then the whole prompt at the engine's measured speed: the worst case, every token
#: computed) plus :data:`READ_STALL_SLACK_S` is given up and sent again without the read (:func:`read_guard_s`).
READ_STALL_FACTOR = 2.0
READ_STALL_SLACK_S = 10.0


def read_guard_s(ep: Endpoint, prompt_tokens: int, cap_s: float) -> float:
    """How long a prefill leg on ``ep`` that reads kept blocks may take before it is given up and sent
    again without them; ``cap_s`` (``router.prefill_timeout_s``) while ``ep``'s speed is unknown (a leg that
    reads nothing has ``cap_s`` itself).

    vLLM 0.32 declines a read whose pin ran out while the request waited in the prefill engine's queue
    ("Declining expired remote read"), and then left the request in "KV fetch in progress" for good: no
    answer, no error (seen under agent load on one CPU core per engine, ``pdserve bench --scenario multiturn
    --opt systems=adaptive_bidir``: a turn's prefill leg ran into the 120-s ``prefill_timeout_s``, its engine
    was marked failed, and the turn took 124 s). pdserve's engine plugin now has such a request compute those
    tokens at once (engine/kv_handback.py ``read_back_once``); this guard bounds whatever else keeps a reading
    leg silent."""
    svc = ep.load.service_s(prompt_tokens)
    if svc is None:
        return cap_s
    return min(cap_s, READ_STALL_FACTOR * (ep.load.wait_s() + svc) + READ_STALL_SLACK_S)


@dataclass(frozen=True)
class Noted:
    """A finished request whose decode engine keeps its blocks."""

    ep: Endpoint
    request_id: str
    tokens: int  # prompt and answer ids noted
    owner: str
    adapter: str | None
    deadline: float
    #: What it is found by: a grain's key -> the noted ids after that grain.
    #: (8 bytes a token: as tuples of ints, 36 each, 1,024 keys of 8 notes with 4,000-token answers would
    #: take 1.2 GB of the router's memory)
    tails: dict[int, array[int]] = field(default_factory=dict)


def scope(owner: str, body: Mapping[str, Any]) -> str:
    """What a request's notes are kept and found under, as their ``owner``: its tenant, and its ``cache_salt``
    as the engines get it (the tenant's, with the client's inside: router/tenants.py). vLLM hashes the salt
    into a prompt's blocks, so two requests of one tenant with different salts share no cached block; a
    read of kept blocks is a copy NIXL makes without those hashes, so the router must not offer one salt's
    blocks to another's prompt (a faster first token would tell that client another sent that prefix)."""
    salt = body.get("cache_salt")
    return f"{owner}\0salt\0{salt}" if isinstance(salt, str) and salt else owner


def _key_owner(scope_: str) -> str:
    """The API key's owner a :func:`scope` belongs to (its salts are one owner's)."""
    return scope_.split("\0", 1)[0]


def prefix_keys(tokens: Sequence[int], owner: str, adapter: str | None) -> list[int]:
    """The keys of ``tokens``' leading whole grains under a tenant and an adapter: key ``i`` stands for
    ``tokens[:(i + 1) * GRAIN]`` (one tenant's notes never take the place of another's)."""
    out: list[int] = []
    key = hash((owner, adapter))
    for start in range(0, len(tokens) - GRAIN + 1, GRAIN):
        key = hash((key, tuple(tokens[start:start + GRAIN])))
        out.append(key)
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Handbacks:
    """The finished requests whose blocks decode engines keep, by their tokens' leading grains."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_noted: int = MAX_NOTED) -> None:
        self.ttl_s = ttl_s
        #: A note is found for this long after its request finished (:func:`read_window_s`).
        self.window_s = read_window_s(ttl_s)
        self.clock = clock
        self.max_noted = max_noted
        #: A grain's key -> the requests noted under it, oldest first (conversations that share a system
        #: prompt share its grains).
        self._by_key: dict[int, list[Noted]] = {}
        #: The grain keys by their API key's owner, the least recent first: past ``max_noted`` the owner
        #: keeping the most gives way (one tenant's flood of finished requests pushed every other tenant's
        #: notes out of one shared LRU).
        self._order: OwnedOrder[int] = OwnedOrder()
        self.counts: dict[str, int] = {}

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def record(self, ep: Endpoint, request_id: str, tokens: Sequence[int], owner: str, adapter: str | None,
               prompt_tokens: int = 0) -> None:
        """Note a stream that ended on ``ep`` with these prompt and answer ids (``prompt_tokens`` of them the
        prompt's). Found by the last whole grain of both, and of the prompt alone (a next prompt that renders
        the answer with other ids than the engine generated still finds it), each with the ids after it: among
        the requests under one grain, the one whose ids go on furthest with the prompt's is found. Only a
        decode engine keeps blocks: an answer a prefill engine gave whole (by load) is not noted."""
        keys = prefix_keys(tokens, owner, adapter)
        if not keys or self.window_s <= 0 or ep.role != "decode":
            return
        whole = prompt_tokens // GRAIN
        at = {len(keys)} | ({whole} if 0 < whole <= len(keys) else set())
        tails = {keys[i - 1]: array("q", tokens[i * GRAIN:]) for i in at}
        noted = Noted(ep, request_id, len(tokens), owner, adapter, self.clock() + self.window_s, tails)
        for key in tails:
            here = self._by_key.setdefault(key, [])
            here.append(noted)
            del here[:-PER_KEY]
            self._order.add(key, _key_owner(owner))
        for key in self._order.trim(self.max_noted):
            self._by_key.pop(key, None)

    def find(self, prompt: Sequence[int], owner: str, adapter: str | None, *, take: bool = True,
             wait_s: float = 0.0) -> Noted | None:
        """The noted request with the most leading tokens in common with ``prompt``, from the same tenant and
        adapter, whose blocks are still kept and can still be read by a prefill leg that starts ``wait_s``
        from now (its engine's queue); taken out (its blocks are read once) unless ``take`` is false."""
        keys = prefix_keys(prompt, owner, adapter)
        now = self.clock()
        for i in range(len(keys) - 1, -1, -1):
            here = self._by_key.get(keys[i])
            if not here:
                continue
            rest = prompt[(i + 1) * GRAIN:]
            best, best_n = None, -1
            for got in list(here):
                if got.deadline <= now or not got.ep.healthy:
                    self._drop(got)
                    continue
                if got.deadline <= now + wait_s:  # the prefill leg would start too late to read it
                    continue
                if got.owner != owner or got.adapter != adapter:
                    continue
                n = _common(got.tails[keys[i]], rest)
                if n >= best_n:  # (the later of equals)
                    best, best_n = got, n
            if best is not None:
                if take:
                    self._drop(best)
                return best
        return None

    def _drop(self, noted: Noted) -> None:
        """Forget ``noted`` under each of its keys."""
        for key in noted.tails:
            here = self._by_key.get(key)
            if here is None:
                continue
            here[:] = [n for n in here if n is not noted]
            if not here:
                del self._by_key[key]
                self._order.discard(key)

    def peek(self, prompt: Sequence[int], owner: str, adapter: str | None) -> int:
        """About how many of ``prompt``'s leading tokens a prefill leg would read from a decode engine's kept
        blocks (:meth:`find`, not taken): the noted request's, less its last (decode computed all but that
        one), at most all but the prompt's last; 0 when none is noted. An estimate for placement and
        admission: the read itself checks the engine's tokens."""
        got = self.find(prompt, owner, adapter, take=False)
        return 0 if got is None else max(0, min(got.tokens - 1, len(prompt) - 1))

    def __len__(self) -> int:
        return len(self._by_key)

    async def read_for(self, client: Any, prompt: Sequence[int], owner: str, adapter: str | None, request_id: str,
                       timeout_s: float, wait_s: float = 0.0) -> tuple[str, dict[str, Any] | None]:
        """What a prefill leg for ``prompt`` that starts in about ``wait_s`` reads: ``(outcome, params)``, the
        outcome ``read`` (params given), ``none`` (no request noted, or none still readable then), ``gone``
        (its engine kept nothing by then) or ``differs``."""
        noted = self.find(prompt, owner, adapter, wait_s=wait_s)
        outcome, params = "none", None
        if noted is not None:
            kept = await kept_params(client, noted, request_id, timeout_s)
            params = prefill_params(kept, prompt, adapter) if kept is not None else None
            outcome = "read" if params is not None else ("gone" if kept is None else "differs")
            if params is not None:
                log.debug("request %s: prefill reads %d tokens of request %s from %s (prompt %d tokens)",
                          request_id, params["remote_num_tokens"], noted.request_id, noted.ep.url, len(prompt))
        self.count(outcome)
        return outcome, params

    async def noting_events(self, stream: AsyncIterator[bytes], route: str, ep: Endpoint, request_id: str,
                            prompt: Sequence[int], owner: str, adapter: str | None) -> AsyncIterator[bytes]:
        """``stream`` (an engine's stream in the client's API, without a tape) as it is; once it has ended whole
        (its API's last event, :data:`ENDS`), the request is noted by ``prompt``, the ids the router rendered:
        the engine's own prompt and answer ids are checked when the next turn reads."""
        end = ENDS.get(route)
        ids = stored.IdReader() if route == "responses" else None
        seen, last = False, b""
        async for chunk in stream:
            yield chunk
            if ids is not None:
                ids.feed(chunk)
            if end is not None and not seen:
                seen = end in last + chunk
                last = chunk[-len(end):]
        engine_id = request_id if ids is None else _engine_response_id(ids.id)
        if seen and engine_id is not None:
            self.record(ep, engine_id, prompt, owner, adapter, prompt_tokens=len(prompt))

    def note_answer(self, req: Request, raw: bytes | None, ep: Endpoint, request_id: str, prompt: Sequence[int] | None,
                    owner: str) -> None:
        """Note a whole (non-streamed) answer to ``req`` that ``ep`` gave, by ``prompt`` (the ids the router
        rendered)."""
        engine_id = _engine_response_id(stored.body_id(raw)) if req.route == "responses" else request_id
        if engine_id is not None and self.notable(req, prompt):
            assert prompt is not None
            self.record(ep, engine_id, prompt, owner, lora_adapter(req.body), prompt_tokens=len(prompt))

    @staticmethod
    def notable(req: Request, prompt: Sequence[int] | None) -> bool:
        """Whether an answer to ``req`` is noted for the next turn: the router rendered its prompt's ids, and it
        does not continue a stored response (``previous_response_id``: it runs on the engine that holds the
        conversation)."""
        return bool(prompt) and req.previous_response_id is None

    def noted(self, stream: AsyncIterator[bytes], req: Request, tape: Tape | None, ep: Endpoint, request_id: str,
              prompt: Sequence[int] | None, owner: str) -> AsyncIterator[bytes]:
        """``stream``, the answer to ``req`` from ``ep``, noted once it has ended whole: by its tape's prompt and
        answer ids when it has one (:meth:`noting`), else by ``prompt`` (:meth:`noting_events`); only when
        :meth:`notable` and ``ep`` is a decode engine (a prefill engine keeps no blocks: its stream passes
        through unread)."""
        if not self.notable(req, prompt) or ep.role != "decode":
            return stream
        if tape is not None:
            return self.noting(stream, tape, ep, request_id, owner)
        assert prompt is not None
        return self.noting_events(stream, req.route, ep, request_id, prompt, owner, lora_adapter(req.body))

    async def noting(self, stream: AsyncIterator[bytes], tape: Tape, ep: Endpoint, request_id: str,
                     owner: str) -> AsyncIterator[bytes]:
        """``stream`` as it is; once it has ended whole on ``ep`` (it never broke, router/migrate.py), its
        prompt and answer ids (``tape``) are noted for the next turn."""
        async for chunk in stream:
            yield chunk
        if tape.done and not tape.broke and tape.prompt_ids:
            self.record(ep, request_id, [*tape.prompt_ids, *tape.ids], owner, lora_adapter(tape.req.body),
                        prompt_tokens=len(tape.prompt_ids))


def _engine_response_id(response_id: str | None) -> str | None:
    """The id to ask a decode engine for a Responses answer by (engine/kv_handback.py's :func:`take`): vLLM
    runs it as the answer's id and its first sub-request; chat (and Messages, run as chat) and completions
    are asked by the router's own request id, which vLLM's ids carry."""
    return f"{response_id}_0" if response_id else None


def prefill_params(kept: Any, prompt: Sequence[int], adapter: str | None) -> dict[str, Any] | None:
    """The prefill leg's ``kv_transfer_params`` from what a decode engine kept (its answer to ``PATH``):
    its blocks for the leading tokens of ``prompt`` that equal the tokens they hold, in whole blocks, or
    ``None`` when fewer than :data:`MIN_TOKENS` match or the answer is not whole."""
    if not isinstance(kept, dict):
        return None
    params, held, size = kept.get("kv_transfer_params"), kept.get("token_ids"), kept.get("block_size")
    if not isinstance(params, dict) or not isinstance(held, list) or not isinstance(size, int) or size <= 0:
        return None
    if kept.get("lora") != adapter:
        return None
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(isinstance(g, list) for g in blocks):
        return None
    # At most all but the prompt's last token: prefill computes at least one (its first output's logits).
    n = min(len(held), len(prompt) - 1)
    same = n if held[:n] == list(prompt[:n]) else 0
    if not same:
        while same < n and held[same] == prompt[same]:
            same += 1
    if same < MIN_TOKENS:
        return None
    # Whole blocks: vLLM pairs the blocks it reads with the puller's from the end of both lists.
    return {**params, "remote_num_tokens": same, "remote_block_ids": [g[:math.ceil(same / size)] for g in blocks]}


async def kept_params(client: Any, noted: Noted, request_id: str, timeout_s: float) -> Any:
    """Ask ``noted``'s decode engine for what it kept; ``None`` when it has nothing (or no answer)."""
    path = PATH.format(request_id=quote(noted.request_id, safe=""))
    try:
        status, raw, _ = await client.call(noted.ep, "GET", path, None, request_id, timeout_s)
    except (UpstreamError, UpstreamTimeout) as e:
        log.info("request %s: no KV handback from %s (%s)", request_id, noted.ep.url, e)
        return None
    if status != 200:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
