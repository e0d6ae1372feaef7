"""Admission by work: which engines a request goes to, or a 429 before anything is sent.

Counting requests is not enough: a one-core CPU engine takes seconds for a long prompt, so 32 requests
"in flight" can be minutes of queue, far past the KV lease and the leg timeouts. Each engine's queue is
kept in prompt tokens and its speed is measured (:mod:`pdserve.router.load`), so the router can say how
long a request would wait and refuse it at once when that is too long.

The rules, for a request whose prompt has ``n`` tokens:

* **P/D** (the plan splits it): the prefill replica the routing policy picks among those whose queue wait
  fits ``router.max_queue_wait_s`` (together with the decode replica's wait, which is also the time its
  blocks sit on prefill before decode pulls them, so it must stay inside half the KV lease).
* **Prefill busy**: the prompt is computed on decode instead only when that decode replica is idle:
  nothing queued, nothing streaming, and no P/D request admitted towards it still in its prefill leg (its
  decode leg would queue behind the prompt, past the wait it was admitted with); with
  ``router.disaggregate_by_load``, also one that streams nothing and finishes the prompt before the P/D
  requests on their way there are due, or makes them wait less in all than the prompt gains
  (:func:`prompt_on_decode`). Otherwise 429.
* **No prefill replica healthy**: decode computes the prompt if its queue fits (or 503 with
  ``prefill_fallback: error``); else 429.
* **Local plans** (short prompt, ``n > 1``, ...): decode's queue must fit. A prompt cached on a decode
  replica (``cached_on_decode``) runs on that replica only, if its queue fits; else P/D.
* **Decode** streams: a decode replica is eligible only if one more stream keeps its measured time per
  output token within ``router.max_tpot_s``; and a busy decode replica's slowdown (time per output token
  with one more stream, over its single-stream figure, times the request's ``max_tokens``) counts
  against the same ``max_queue_wait_s`` budget as queue wait: the promise to an admitted request is its
  idle service time plus at most ``max_queue_wait_s``, wherever the delay comes from. A request of several
  sequences (``n``, a batch of prompts) counts as that many streams, here and in the engine's load, and
  what its sequences past the first slow the streams already there counts against its budget too: counted
  as one stream, an ``n: 64`` request was let onto a streaming engine and took the stream beside it from 53
  to 246 ms per token (2-core AMD EPYC, AVX-512, float32); now it is a 429 there.
* **LoRA adapters**: a request on an adapter streams only from an engine whose batch can start it now
  (router/lora_slots.py); 429 ``lora_slots`` when none can.

Refusals carry ``Retry-After`` from the estimate: the seconds until the wait would fit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.config.schema import RouterConfig
from pdserve.errors import NoEngineAvailable, Overloaded
from pdserve.router.endpoint import Endpoint
from pdserve.router.handoff import PROMPT_BOUND
from pdserve.router.lora_slots import LoraAsk
from pdserve.router.pool import EnginePool
from pdserve.router.routing import RoutingKey

#: Longest Retry-After the router gives, seconds.
MAX_RETRY_AFTER_S = 60
#: Share by which a refusal's wait moves at random either way, so that refused clients come back spread out.
RETRY_JITTER = 0.2
#: Share of ``max_queue_wait_s`` the estimate may fill. The estimate runs short under load (engines and
#: router share the host's cores, vLLM batches prompts unevenly): with the whole budget, admitted TTFT p99
#: overshot its promise by 0.9-2.4 s of 8, and with 75 % by up to 1.1 s (`pdserve bench --scenario
#: overload-long`): the speed of a one-core engine on a shared host moves faster than its measurement.
HEADROOM = 0.6


@dataclass(frozen=True)
class Admitted:
    prefill: Endpoint | None  # None: the decode engine computes the prompt
    decode: Endpoint
    reason: str  # why it runs where it does (the pd_decisions reason)


class Refused(Overloaded):
    """429 from admission; ``cause`` labels the refusal in metrics."""

    def __init__(self, message: str, *, cause: str, wait_s: float, cfg: RouterConfig,
                 jitter: Callable[[], float] = random.random) -> None:
        excess = wait_s - cfg.max_queue_wait_s * HEADROOM if math.isfinite(wait_s) else 1.0
        # Clients refused in one burst would all come back at the same moment, as a new burst, and queue
        # behind each other in the router: each gets a wait within RETRY_JITTER of the estimate, on average
        # the estimate itself (later on average would leave the engines idle before the clients return).
        spread = 1.0 + RETRY_JITTER * (2.0 * jitter() - 1.0)
        wait = min(float(MAX_RETRY_AFTER_S), max(1.0, excess) * spread)
        super().__init__(message, retry_after_ms=int(math.ceil(wait * 1000)))
        self.cause = cause


def _pick(pool: EnginePool, role: str, fits: Sequence[Endpoint], key: RoutingKey) -> Endpoint:
    """The routing policy's choice among the replicas that fit."""
    keep = {e.url for e in fits}
    others = {e.url for e in pool.healthy(role) if e.url not in keep}  # type: ignore[arg-type]
    return pool.pick(role, exclude=others, key=key)  # type: ignore[arg-type]


def admit(pool: EnginePool, cfg: RouterConfig, *, disaggregate: bool, reason: str, prompt_tokens: int,
          lease_s: float | None, new_tokens: int = 0, prefill_key: RoutingKey = None,
          decode_key: RoutingKey = None, local_if_idle: bool = False, local_on: Endpoint | None = None,
          lora: LoraAsk | None = None, sequences: int = 1) -> Admitted:
    """Where a request runs, or :class:`Refused` / :class:`NoEngineAvailable`. The budget is
    ``max_queue_wait_s`` beyond the request's own service time on idle engines: the wait for the prompt
    to start, plus how much longer its ``new_tokens`` take on a decode engine that is busier than idle.
    ``local_if_idle``: a request that would run on decode (``disaggregate`` false) does so only on an idle
    decode engine, else it is disaggregated like any other (``local_prefill_below_tokens: auto``).
    ``local_on``: a request that would run on decode does so on that decode replica only (the one that holds
    its prompt: router/cache_aware.py), when its queue and token rate fit; else it is disaggregated.
    ``lora``: the request's adapter; only an engine whose batch can start it now streams it
    (router/lora_slots.py). ``sequences``: what it generates at once (``n``, a batch of prompts); each runs as
    a stream, and what those past the first slow the streams already there counts against the same budget."""
    limit = cfg.max_queue_wait_s * HEADROOM
    decodes = pool.healthy("decode")
    if not decodes:
        return _whole_on_prefill(pool, cfg, limit, prefill_key, lora)
    # Mostly prompt: a prefill engine may answer it whole, so what decode engines refuse does not refuse it.
    prompt_bound = (not disaggregate and reason in PROMPT_BOUND and pool.has("prefill")
                    and 0 < new_tokens * max(1, sequences) <= PROMPT_BOUND_MAX_NEW)
    if lora is not None:
        try:
            decodes = lora_room(decodes, lora, cfg)
        except Refused:
            if not prompt_bound:
                raise
            decodes = []
    if cfg.max_tpot_s is not None and decodes:
        # An idle engine takes a request of many sequences whatever its own time per token would be: the bound
        # keeps the streams already there at their rate, and with none there a 429 would never end (its
        # estimate, a share of the idle step per sequence, put ``n: 64`` at 1.9 s per token where a CPU
        # engine ran it at 0.25 s); the streams that come while it runs are refused until it ends.
        room = [d for d in decodes if (d.load.tpot_with_one_more(sequences) or 0.0) <= cfg.max_tpot_s
                or d.load.idle()]
        if not room and not prompt_bound:
            best = min(d.load.tpot_with_one_more(sequences) or 0.0 for d in decodes)
            more = "one more stream" if sequences <= 1 else f"its {sequences} sequences at once"
            raise Refused(f"every decode engine is at its token-rate bound ({more}: {best:.3f}s per "
                          f"token > max_tpot_s {cfg.max_tpot_s:g}); retry shortly",
                          cause="decode_tpot", wait_s=limit + 1, cfg=cfg)
        decodes = room

    def slower(d: Endpoint) -> float:
        return d.load.decode_slowdown_s(new_tokens) + d.load.others_slowdown_s(sequences, BY_LOAD_UNKNOWN_TOKENS)

    def local(why: str, *, idle_only: bool, among: Sequence[Endpoint] | None = None) -> Admitted | None:
        fits = [d for d in (decodes if among is None else among)
                if d.load.wait_s() + slower(d) <= limit and not (idle_only and not d.load.idle())]
        return Admitted(None, _pick(pool, "decode", fits, decode_key), why) if fits else None

    if local_on is not None and not disaggregate:
        got = local(reason, idle_only=False, among=[d for d in decodes if d is local_on])
        if got is not None:
            return got
        disaggregate, reason = True, "pd"
    if local_if_idle and not disaggregate:
        got = local(reason, idle_only=True) if pool.has("prefill") else None
        if got is not None:
            return got
        disaggregate, reason = True, "pd"
    if disaggregate and pool.has("prefill"):
        # Decode must pull the blocks soon after prefill ends: its own queue of local prompts delays that.
        pull_limit = min(limit, 0.5 * lease_s) if lease_s else limit
        dfits = [d for d in decodes if d.load.wait_s() <= pull_limit and d.load.wait_s() + slower(d) <= limit]
        if dfits:
            d = _pick(pool, "decode", dfits, decode_key)
            d_cost = d.load.wait_s() + slower(d)
            pfits = [p for p in pool.healthy("prefill") if p.load.wait_s() + d_cost <= limit]
            if pfits:
                p = _pick(pool, "prefill", pfits, prefill_key)
                if cfg.disaggregate_by_load:
                    return by_load(p, d, prompt_tokens, slower(d), limit, reason, lora)
                return Admitted(p, d, reason)
        spill = local("prefill_busy", idle_only=True)
        if spill is not None:
            return spill
        if cfg.disaggregate_by_load:
            # Prefill's queue is past the budget: a decode engine that streams nothing may compute the prompt
            # meanwhile, when it finishes it clearly sooner than prefill would and what that costs the
            # requests on their way to it is less (a burst of long first turns, one engine each).
            soonest = min(pool.healthy("prefill"), key=lambda p: p.load.wait_s() + (p.load.service_s(prompt_tokens)
                                                                                   or math.inf))
            fits = [d for d in decodes if not d.load.streams and d.load.wait_s() + slower(d) <= limit
                    and prompt_on_decode(soonest, d, prompt_tokens)]
            if fits:
                return Admitted(None, _pick(pool, "decode", fits, decode_key), "by_load_prefill_on_decode")
        d_cost = min(d.load.wait_s() + slower(d) for d in decodes)
        wait = min(p.load.wait_s() for p in pool.healthy("prefill")) + d_cost
        raise Refused(f"prefill is busy: a prompt sent now would wait {_secs(wait)} "
                      f"(max_queue_wait_s {cfg.max_queue_wait_s:g}); retry later", cause="prefill_wait", wait_s=wait, cfg=cfg)
    if disaggregate:
        if cfg.prefill_fallback == "error":
            raise NoEngineAvailable("no healthy prefill engine is available")
        reason = "no_prefill_engine"
    elif prompt_bound:
        return _prompt_bound(pool, cfg, limit, decodes, prompt_tokens, reason, local, prefill_key, lora)
    got = local(reason, idle_only=False)
    if got is not None:
        return got
    wait = min(d.load.wait_s() + slower(d) for d in decodes)
    raise Refused(f"decode is busy: a prompt sent now would wait {_secs(wait)} (max_queue_wait_s {cfg.max_queue_wait_s:g}); "
                  "retry later", cause="decode_wait", wait_s=wait, cfg=cfg)


def lora_room(engines: Sequence[Endpoint], lora: LoraAsk, cfg: RouterConfig) -> list[Endpoint]:
    """The engines whose batch can start ``lora``'s adapter now (router/lora_slots.py), or 429 ``lora_slots``."""
    fit = [e for e in engines if lora.fits(e.loras)]
    if not fit:
        raise Refused(lora.refusal([e.loras for e in engines]), cause="lora_slots",
                      wait_s=cfg.max_queue_wait_s * HEADROOM + 1, cfg=cfg)
    return fit


#: A request that cannot be split goes whole to a prefill engine (:func:`_prompt_bound`) only when it asks for
#: at most this many tokens in all: decoding there delays that engine's prompts, which its queue does not show.
PROMPT_BOUND_MAX_NEW = 64


def _prompt_bound(pool: EnginePool, cfg: RouterConfig, limit: float, decodes: Sequence[Endpoint],
                  prompt_tokens: int, reason: str, local: Callable[..., Admitted | None], key: RoutingKey,
                  lora: LoraAsk | None) -> Admitted:
    """A request that cannot be split and is mostly its prompt (:data:`~pdserve.router.handoff.PROMPT_BOUND`,
    at most :data:`PROMPT_BOUND_MAX_NEW` tokens of answer):
    on a decode engine only where its prompt stalls the streams there little (``BY_LOAD_STALL_SHARE`` of the
    shortest one's decode time, as by load) or none run; else whole on a prefill engine, which holds no
    streams. A client's 8,000-token prompt with ``max_tokens: 1`` had been computed on the decode engine
    beside other clients' streams, each of them stalled for its seconds. The decision's reason is ``reason``
    on decode, ``reason`` and ``_on_prefill`` on prefill."""
    quiet = [d for d in decodes
             if d.load.stalls_little(prompt_tokens, BY_LOAD_STALL_SHARE, BY_LOAD_UNKNOWN_TOKENS)]
    got = local(reason, idle_only=False, among=quiet) if quiet else None
    if got is not None:
        return got
    return _on_prefill(pool, cfg, limit, key, lora, f"{reason}_on_prefill", "prefill is busy")


def _whole_on_prefill(pool: EnginePool, cfg: RouterConfig, limit: float, key: RoutingKey,
                      lora: LoraAsk | None = None) -> Admitted:
    """No decode engine is healthy (e.g. its replica is being replaced): a prefill engine, which runs the same
    model, answers whole requests meanwhile, as long as its queue lets one start in time; ``prefill_fallback:
    error`` keeps the roles apart (503)."""
    if not pool.healthy("prefill") or cfg.prefill_fallback == "error":
        raise NoEngineAvailable("no healthy decode engine is available")
    return _on_prefill(pool, cfg, limit, key, lora, "no_decode_engine",
                       "no decode engine is up and the prefill engines are busy")


def _on_prefill(pool: EnginePool, cfg: RouterConfig, limit: float, key: RoutingKey, lora: LoraAsk | None,
                reason: str, busy: str) -> Admitted:
    """A prefill engine answers the request whole, one whose batch can start its adapter and whose queue lets
    it start within ``limit``; else 429 ``prefill_wait`` (``busy`` opens its message)."""
    prefills = pool.healthy("prefill")
    if lora is not None:
        prefills = lora_room(prefills, lora, cfg)
    fits = [p for p in prefills if p.load.wait_s() <= limit]
    if not fits:
        wait = min(p.load.wait_s() for p in prefills)
        raise Refused(f"{busy}: a prompt sent now would wait {_secs(wait)} (max_queue_wait_s "
                      f"{cfg.max_queue_wait_s:g}); retry later", cause="prefill_wait", wait_s=wait, cfg=cfg)
    return Admitted(None, _pick(pool, "prefill", fits, key), reason)


#: By load, a request leaves P/D only for an engine that is clearly better placed: its estimate must be
#: below this share of P/D's (the estimates are coarse; P/D is the default for a reason).
BY_LOAD_MARGIN = 0.8
#: By load, a prompt is computed on a decode engine that is streaming only if the stall costs each stream
#: there at most this share of its own decode time (its new tokens × a step): a stall of s seconds adds
#: s / (n - 1) to the time per token of an n-token answer. For 100-token answers: 8 steps.
BY_LOAD_STALL_SHARE = 0.08
#: A stream that did not say how many tokens it wants (no ``max_tokens``) counts as this many.
BY_LOAD_UNKNOWN_TOKENS = 100


def by_load(p: Endpoint, d: Endpoint, prompt_tokens: int, d_slower: float, limit: float, reason: str,
            lora: LoraAsk | None = None) -> Admitted:
    """``router.disaggregate_by_load``: where a P/D-eligible request's two phases run, given that prefill
    replica ``p`` and decode replica ``d`` can both take it.

    * The prompt: on decode itself when decode would finish computing it clearly sooner than ``p`` (its own
      queue and speed against prefill's) and can start it within the budget (:func:`prompt_on_decode`). If
      streams run there, only when its time is at most ``BY_LOAD_STALL_SHARE`` of the shortest of those
      streams' decode time (its ``max_tokens`` × decode's step): a prompt stalls every stream of its engine
      for its whole length (1,500-token prompts, seconds each on one CPU core, put 4 of 16 long-mix
      requests over their TPOT target at the lowest rate), while a short one costs them a few steps and
      spares it a wait behind prefill's queue (two chat prompts arriving together: the second's TTFT 2.0 s
      in P/D). If none run, the P/D requests on their way there wait only past when they were due.
      Prefill's queue is P/D's bottleneck under load; when it is past the budget altogether, :func:`admit`
      asks the same of a decode engine that streams nothing before it refuses.
    * The tokens: on ``p``, as one whole request there, when ``p`` would give a new stream a clearly lower
      time per token than ``d`` (each engine's measured figure with one more stream, stretched by its
      share of time on prompts, which stalls its streams); one decode engine holding every stream is P/D's
      other bottleneck on small hosts. Not for an adapter ``p``'s batch cannot start now (``lora``).
    * Otherwise P/D.
    """
    if d.load.wait_s() + d_slower <= limit and prompt_on_decode(p, d, prompt_tokens):
        return Admitted(None, d, "by_load_prefill_on_decode")
    fallback = d.load.tpot_single or d.load.tpot_s
    t_d, t_p = d.load.tpot_for_new_stream(fallback), p.load.tpot_for_new_stream(fallback)
    if t_d is not None and t_p is not None and t_p < BY_LOAD_MARGIN * t_d and (lora is None or lora.fits(p.loras)):
        return Admitted(None, p, "by_load_whole_on_prefill")
    return Admitted(p, d, reason)


def prompt_on_decode(p: Endpoint, d: Endpoint, prompt_tokens: int) -> bool:
    """By load: whether decode replica ``d`` computing the prompt itself beats prefill replica ``p`` doing it.
    It must finish clearly sooner (``BY_LOAD_MARGIN`` of ``p``'s queue and service, at each engine's measured
    speed), and cost the others there little: with streams running, the stall is at most
    ``BY_LOAD_STALL_SHARE`` of the shortest one's decode time; with none, the requests on their way (P/D
    requests in their prefill legs) wait for it less in all than the request gains (each waits only past
    when it was due: a prompt done before they arrive costs them nothing)."""
    p_svc, d_svc = p.load.service_s(prompt_tokens), d.load.service_s(prompt_tokens)
    if d_svc is None:
        return False
    p_done = p.load.wait_s() + (p_svc or 0.0)
    d_done = d.load.wait_s() + d_svc
    if not d_done < BY_LOAD_MARGIN * p_done:
        return False
    if d.load.streams:
        return d.load.stalls_little(prompt_tokens, BY_LOAD_STALL_SHARE, BY_LOAD_UNKNOWN_TOKENS)
    return d.load.pending_delay_s(d_done) < p_done - d_done


def _secs(wait: float) -> str:
    return f"{wait:.1f}s" if math.isfinite(wait) else "until the engine's speed is measured"
