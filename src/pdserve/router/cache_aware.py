"""Cache-aware disaggregation (``router.cache_aware_steps``): a request runs on a decode replica alone when
that replica already holds nearly all of its prompt.

Decode engines publish their KV cache events (as engines routed by ``kv_cache`` do) and the router follows
them into the pool's one :class:`~pdserve.router.kv_index.KvIndex`, so it knows which blocks of a prompt each
decode replica holds: a conversation's earlier turns, their prompts and generated tokens alike. The part of
a prompt a replica does not hold is what it would compute itself. When that takes it at most
``cache_aware_steps`` of its own decode steps (its measured prompt speed × its single-stream time per
token, the figures ``local_prefill_below_tokens: auto`` reads), a prefill leg and a KV handoff cost more than
they spare: the request runs there, with no prefill leg. Load comes before locality: a replica with more
than ``plugins.kv_cache.slack`` requests in flight above the least loaded decode replica is passed over, and
so is one whose running streams that part would stall by more than ``disaggregate_by_load``'s share of the
shortest one's decode time (router/admission.py ``BY_LOAD_STALL_SHARE``): on one CPU core a decode engine
that computed every cached turn itself raised its streams' time per token past the SLO, and agent turns
lost more goodput than the skipped handoffs won (``pdserve bench --scenario multiturn``).

A holder also takes a request whose uncached part is past that budget when P/D would give it its first
token much later (:func:`sooner_there`): prefill's queue, the part of the prompt prefill's own cache lacks
at its measured speed (a conversation's last answer is never in it: decode generated it) and the handoff,
against the holder's queue and its uncached part (with ``nixl.bidirectional``, prefill reads the last turn
from decode: only what it neither holds nor reads counts). It does so only when what the request gains is more
than what the streams running there lose together (each stalls for the whole uncached part): the least
total waiting. In plain P/D on a 1P1D host of one core per engine, an agent's short turn took 2.3 s of
prefill's prompt time, for the ~230 tokens prefill's cache lacked, and prefill computed 90 % of the time
(``pdserve bench --scenario multiturn``, ``time_split``).

Admission then checks the chosen one's queue as for any request computed on decode; otherwise the request
is disaggregated as usual, its prefill routed by prefill's own policy.

The router follows the prefill engines' events too, for admission: a turn of a long conversation sent to
prefill costs that engine only the part its prefix cache lacks, so only that part is queued on it
(:func:`cached_part`, :meth:`pdserve.router.flight.Flight.held_on`) and only that part counts as computed
when its speed is measured. Counting whole prompts, a few agents' turns made prefill's queue look seconds
long and were refused (429) though it computed a few hundred tokens each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config.schema import RouterConfig
from pdserve.router.admission import BY_LOAD_MARGIN, BY_LOAD_STALL_SHARE, BY_LOAD_UNKNOWN_TOKENS
from pdserve.router.endpoint import Endpoint
from pdserve.router.kv_index import KvIndex

#: The handoff, in decode steps: decode pulls the blocks and computes the first token (measured on a 1P1D
#: CPU host: 228 ms against ~90 ms steps, ``pdserve bench --scenario multiturn``'s ``time_split``).
HANDOFF_STEPS = 2.0


@dataclass(frozen=True)
class Holder:
    """A decode replica that may run a request alone, and why."""

    endpoint: Endpoint
    cached_tokens: int  # the prompt's leading tokens it holds (whole blocks)
    uncached_tokens: int  # the rest, which it would compute
    budget_tokens: int  # the most it may compute: cache_aware_steps of its decode steps


def budget(ep: Endpoint, steps: float) -> int | None:
    """The prompt tokens ``ep`` computes in ``steps`` of its idle decode steps; None until both its prompt
    speed and its single-stream time per token are measured."""
    rate, step = ep.load.calibrated_rate, ep.load.tpot_single
    if not rate or not step:
        return None
    return int(steps * rate * step)


def prefill_done_s(prefills: Sequence[Endpoint], index: KvIndex, chain: Sequence[int], prompt_tokens: int,
                   reads: int = 0) -> float | None:
    """When the soonest of ``prefills`` would finish a request's prompt, from now: its queue, then the part
    of the prompt its prefix cache lacks, at its measured speed; less the leading ``reads`` tokens it would
    read from a decode engine's kept blocks (``nixl.bidirectional``, router/handback.py). None while no
    speed is known."""
    best = None
    for p in prefills:
        part = cached_part(p, index, chain, prompt_tokens)
        svc = p.load.service_s(min(part[1] if part else prompt_tokens, prompt_tokens - reads))
        if svc is not None:
            t = p.load.wait_s() + svc
            best = t if best is None else min(best, t)
    return best


def pd_first_token_s(prefills: Sequence[Endpoint], index: KvIndex, chain: Sequence[int], prompt_tokens: int,
                     d: Endpoint, prefill_s: float | None = None) -> float | None:
    """When P/D would give a request its first token, from now: :func:`prefill_done_s` (``prefill_s`` when
    already known), then :data:`HANDOFF_STEPS` of decode replica ``d``'s steps (the pull and the first
    token). None while no speed is known."""
    step = d.load.tpot_s or d.load.tpot_single
    if prefill_s is None:
        prefill_s = prefill_done_s(prefills, index, chain, prompt_tokens)
    if step is None or prefill_s is None:
        return None
    return prefill_s + HANDOFF_STEPS * step


def sooner_there(d: Endpoint, uncached: int, pd_s: float | None) -> bool:
    """Whether decode replica ``d`` computing ``uncached`` tokens itself gives the first token clearly sooner
    than P/D (``pd_s``: :func:`pd_first_token_s`; ``BY_LOAD_MARGIN`` of it at most) and the time that gains
    is more than the streams there (running, or admitted on their way) lose together: each waits out the
    whole part."""
    svc = d.load.service_s(uncached)
    if pd_s is None or svc is None:
        return False
    here = d.load.wait_s() + svc
    streams = d.load.streams + d.load.pending
    return here <= BY_LOAD_MARGIN * pd_s and pd_s - here > streams * svc


def holder(decodes: Sequence[Endpoint], index: KvIndex, chain: Sequence[int], prompt_tokens: int, *,
           steps: float, slack: int, prefills: Sequence[Endpoint] = (), prefill_reads: int = 0) -> Holder | None:
    """Among ``decodes`` (the healthy decode replicas), the one holding the longest cached prefix of the
    prompt (``chain``: its blocks' keys, :meth:`KvIndex.request_chain`; ``prompt_tokens``: its length)
    whose uncached rest fits its budget, or, past it, that answers much sooner than P/D on ``prefills``
    would (:func:`sooner_there`; ``prefill_reads``: the prompt's leading tokens prefill would read from a
    decode engine rather than compute); the less loaded among equals; None when there is none, when
    ``steps`` is 0 (off) or when what decode holds is not known."""
    size = index.block_size
    if steps <= 0 or not chain or not size or not decodes:
        return None
    least = min(d.inflight for d in decodes)
    best: Holder | None = None
    prefill_s: list[float | None] = []  # prefill_done_s, looked up once, when a holder is past its budget
    for d in decodes:
        if d.inflight - least > slack:
            continue
        blocks = index.cached(d.key, chain)
        room = budget(d, steps)
        if not blocks or room is None:
            continue
        cached = blocks * size
        uncached = max(0, prompt_tokens - cached)
        within = uncached <= room and d.load.stalls_little(uncached, BY_LOAD_STALL_SHARE, BY_LOAD_UNKNOWN_TOKENS)
        if not within:
            if not prefill_s:
                prefill_s.append(prefill_done_s(prefills, index, chain, prompt_tokens, prefill_reads))
            pd_s = None if prefill_s[0] is None else pd_first_token_s(prefills, index, chain, prompt_tokens, d,
                                                                        prefill_s[0])
            if not sooner_there(d, uncached, pd_s):
                continue
        if best is None or (cached, -d.inflight) > (best.cached_tokens, -best.endpoint.inflight):
            best = Holder(d, cached, uncached, room)
    return best


def find(decodes: Sequence[Endpoint], index: KvIndex, cfg: RouterConfig, chain: Sequence[int],
         prompt_tokens: int, prefills: Sequence[Endpoint] = (), prefill_reads: int = 0) -> Holder | None:
    """:func:`holder` for a request (``chain``: its prompt's blocks' keys, :meth:`KvIndex.request_chain`) by
    the router's config: ``cache_aware_steps``, and the ``kv_cache`` plugin's ``slack`` as the load bound
    (one setting for "load before locality")."""
    if not chain or cfg.cache_aware_steps <= 0:
        return None
    return holder(decodes, index, chain, prompt_tokens, steps=cfg.cache_aware_steps,
                  slack=cfg.plugins.kv_cache.slack, prefills=prefills, prefill_reads=prefill_reads)


def cached_part(ep: Endpoint, index: KvIndex, chain: Sequence[int], prompt_tokens: int) -> tuple[int, int] | None:
    """(tokens of the prompt ``ep`` holds, tokens it would compute) for a prompt of ``prompt_tokens`` whose
    blocks' keys are ``chain``; None when it holds none of them. The engine computes at least the last
    token (its first answer token needs it)."""
    blocks = index.cached(ep.key, chain)
    if not blocks or not index.block_size or prompt_tokens <= 1:
        return None
    cached = min(blocks * index.block_size, prompt_tokens - 1)
    return cached, prompt_tokens - cached


def holds_any(engines: Sequence[Endpoint], index: KvIndex) -> bool:
    """Whether the index knows of any block on these replicas (else no prompt need be rendered)."""
    return any(index.blocks(e.key) for e in engines)
