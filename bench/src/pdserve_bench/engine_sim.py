"""A step-level simulation of vLLM engines on one CPU core each, as the goodput scenario runs them: colocated
engines, P/D, and P/D with the router's by-load placement. It gives each request's first token and end, and
so the share that meets an SLO at a Poisson rate and the highest rate at which 90 % do (:func:`goodput`).

The engine model (vLLM's scheduler on one CPU core, as measured, not assumed):

* an engine runs in steps; a step advances every running stream by one token and computes the prompts that
  fit its batch budget (``max_num_batched_tokens``; at least one prompt per step, larger ones in chunks
  like vLLM's chunked prefill);
* a step's time is ``t1 · (1 + β (B − 1))`` for ``B`` streams (nothing without streams) plus each prompt's
  ``prompt_s0 + n / prompt_tok_s``, stretched by ``γ`` when streams share the step (what a prompt costs
  them, :mod:`pdserve_bench.crossover`'s γ);
* a prompt's first token comes at the end of the step that finishes it; the stream runs from the next step.

Systems:

* ``colocated``: two engines, the client alternating;
* ``pd``: one prefill engine (prompts only, in arrival order) and one decode engine; the first token
  reaches the client when prefill finishes (the router streams it at once) and the stream joins decode
  ``handoff_s`` later (KV pull and decode's first step);
* ``pd_by_load``: ``pd`` with :func:`pdserve.router.admission.by_load`'s placement, read from the simulated
  engines' queues: the prompt on decode when it finishes there clearly sooner and stalls decode's shortest
  stream by at most its share; the whole request on prefill when a new stream is clearly faster there.

Left out: admission (pdserve's 429s and retries), the router's own CPU, and the host's noise.
:mod:`pdserve_bench.attainment` checks the simulation against a run's own requests before any crossover is
read from it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.router.admission import BY_LOAD_MARGIN, BY_LOAD_STALL_SHARE
from pdserve.router.load import BUSY_BURST_S, BUSY_SHARE_CAP, BUSY_WINDOW_S
from pdserve_bench.stats import TARGET

#: vLLM's CPU default batch budget (tokens per step).
BATCH_TOKENS = 2048
SYSTEMS = ("colocated", "pd", "pd_by_load")


@dataclass(frozen=True)
class Speeds:
    """One engine's speeds on one core, and the handoff between two."""

    t1_s: float  # a decode step with one stream
    prompt_tok_s: float  # prompt tokens per second, idle
    prompt_s0: float = 0.0  # fixed cost of a prompt (s), besides its tokens
    beta: float = 0.0  # what each further stream adds to a step, as a share of t1
    gamma: float = 1.0  # a prompt's time in a step that streams share, as a multiple of its idle time
    handoff_s: float = 0.0  # P/D: first token (end of prefill) to the stream's place on decode

    def prompt_s(self, tokens: int) -> float:
        return self.prompt_s0 + tokens / self.prompt_tok_s

    def step_s(self, streams: int) -> float:
        return self.t1_s * (1.0 + self.beta * (streams - 1)) if streams else 0.0


@dataclass
class Req:
    arrival_s: float
    prompt_tokens: int
    new_tokens: int
    first_s: float = math.nan  # first token, as the client sees it
    end_s: float = math.nan
    placed: str = ""
    stay: bool = False  # streams where its prompt was computed, even on a prefill engine
    left: int = 0  # prompt tokens still to compute
    tokens: int = 0  # tokens produced so far

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.end_s - self.first_s) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0


@dataclass
class _Engine:
    name: str
    sp: Speeds
    waiting: deque = field(default_factory=deque)  # Req with prompt tokens left, in arrival order
    running: list = field(default_factory=list)  # Req streaming here
    joining: list = field(default_factory=list)  # Req to join ``running`` at the next step's start
    busy_until: float = 0.0
    prompt_spans: deque = field(default_factory=deque)  # (start, end) of the steps that computed prompts
    expected: list = field(default_factory=list)  # Req in their prefill leg or handoff towards this engine
    on_prompt_done: Callable[[Req, float], None] | None = None
    # the step under way: (streams, prompts computed with their tokens this step)
    step: tuple[list, list] | None = None

    def queued_s(self, now: float) -> float:
        """Time until this engine has computed every prompt it holds (its own estimate of a wait)."""
        rest = max(0.0, self.busy_until - now)
        return rest + sum(self.sp.prompt_s(r.left) for r in self.waiting)

    def streams(self) -> list[Req]:
        return self.running + self.joining

    def busy_share(self, now: float, horizon_s: float = BUSY_WINDOW_S) -> float:
        """Share of the last ``horizon_s`` (at most ``BUSY_WINDOW_S``) spent on prompts, capped as the
        router caps it (``EngineLoad.busy_share``)."""
        since = now - horizon_s
        while self.prompt_spans and self.prompt_spans[0][1] < now - BUSY_WINDOW_S:
            self.prompt_spans.popleft()  # older than any window asked for
        busy = sum(max(0.0, min(b, now) - max(a, since)) for a, b in self.prompt_spans)
        return min(BUSY_SHARE_CAP, busy / horizon_s)


class _Sim:
    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.n = 0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.n += 1
        heapq.heappush(self.events, (t, self.n, fn))

    def run(self) -> None:
        while self.events:
            t, _, fn = heapq.heappop(self.events)
            fn(t)

    def kick(self, e: _Engine, now: float) -> None:
        if e.step is None and (e.waiting or e.running or e.joining):
            self._start(e, now)

    def _start(self, e: _Engine, now: float) -> None:
        e.running += e.joining
        e.joining = []
        streams = list(e.running)
        budget = max(1, BATCH_TOKENS - len(streams))
        chunks, dur = [], 0.0
        for r in e.waiting:
            if budget <= 0:
                break
            take = min(r.left, budget)
            chunks.append((r, take))
            budget -= take
            dur += take / e.sp.prompt_tok_s + (e.sp.prompt_s0 if take == r.left else 0.0)
        if streams and chunks:
            dur *= e.sp.gamma
        dur += e.sp.step_s(len(streams))
        e.step = (streams, chunks)
        e.busy_until = now + dur
        if chunks:
            e.prompt_spans.append((now, now + dur))
        self.at(now + dur, lambda t, e=e: self._end(e, t))

    def _end(self, e: _Engine, now: float) -> None:
        streams, chunks = e.step or ([], [])
        e.step = None
        for r in streams:
            r.tokens += 1
            if r.tokens >= r.new_tokens:
                r.end_s = now
                e.running.remove(r)
        for r, take in chunks:
            r.left -= take
            if r.left == 0:
                e.waiting.remove(r)
                r.tokens = 1
                r.first_s = now
                if r.new_tokens <= 1:
                    r.end_s = now
                elif e.on_prompt_done is not None and not r.stay:
                    e.on_prompt_done(r, now)
                else:
                    e.joining.append(r)
        self.kick(e, now)


def simulate(system: str, sp: Speeds, arrivals: Sequence[tuple[float, int, int]]) -> list[Req]:
    """Each request's first token and end on ``system``: ``arrivals`` are (seconds, prompt tokens, new
    tokens), in order of arrival."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; valid: {', '.join(SYSTEMS)}")
    sim = _Sim()
    reqs = [Req(float(t), int(n), int(m)) for t, n, m in arrivals]
    if system == "colocated":
        engines = [_Engine("a", sp), _Engine("b", sp)]

        def place(i: int, r: Req, now: float) -> None:
            e = engines[i % 2]
            r.placed = e.name
            r.left = r.prompt_tokens
            e.waiting.append(r)
            sim.kick(e, now)
    else:
        p, d = _Engine("prefill", sp), _Engine("decode", sp)

        def handed(r: Req, now: float) -> None:
            def join(t: float) -> None:
                d.expected.remove(r)
                d.joining.append(r)
                sim.kick(d, t)
            sim.at(now + sp.handoff_s, join)

        p.on_prompt_done = handed

        def place(i: int, r: Req, now: float) -> None:
            r.placed = _by_load(p, d, r, now) if system == "pd_by_load" else "pd"
            r.left, r.stay = r.prompt_tokens, r.placed == "whole"
            if r.placed == "pd":
                d.expected.append(r)
            e = d if r.placed == "local" else p
            e.waiting.append(r)
            sim.kick(e, now)

    for i, r in enumerate(reqs):
        sim.at(r.arrival_s, lambda t, i=i, r=r: place(i, r, t))
    sim.run()
    return reqs


def _by_load(p: _Engine, d: _Engine, r: Req, now: float) -> str:
    """The router's by-load placement (admission.by_load) read from the simulated engines."""
    sp = d.sp
    svc = sp.prompt_s(r.prompt_tokens)
    p_done = p.queued_s(now) + svc
    d_done = d.queued_s(now) + svc
    bound = [q.new_tokens for q in d.streams() + d.expected]
    stalls_little = not bound or svc <= BY_LOAD_STALL_SHARE * min(bound) * sp.step_s(len(bound))
    if stalls_little and d_done < BY_LOAD_MARGIN * p_done:
        return "local"

    def new_stream(e: _Engine) -> float:
        busy = max(e.busy_share(now), e.busy_share(now, BUSY_BURST_S))
        return sp.step_s(len(e.streams()) + len(e.expected) + 1) / (1.0 - busy)
    if new_stream(p) < BY_LOAD_MARGIN * new_stream(d):
        return "whole"
    return "pd"


def attainment(reqs: Sequence[Req], ttft_slo_s: float, tpot_slo_s: float) -> float:
    ok = sum(1 for r in reqs if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
    return ok / len(reqs) if reqs else 0.0


def poisson(rate: float, count: int, lengths: Callable[[random.Random], tuple[int, int]], seed: int = 0
            ) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append((t, *lengths(rng)))
    return out


def goodput(system: str, sp: Speeds, lengths: Callable[[random.Random], tuple[int, int]], ttft_slo_s: float,
            tpot_slo_s: float, *, target: float = TARGET, requests: int = 400, seeds: int = 3) -> float:
    """The highest Poisson rate at which ``target`` of the requests meet both targets (bisection over the
    rate; each rate's attainment pooled over ``seeds`` runs of ``requests``)."""
    def met(rate: float) -> float:
        got = []
        for s in range(seeds):
            got += simulate(system, sp, poisson(rate, requests, lengths, seed=s))
        return attainment(got, ttft_slo_s, tpot_slo_s)

    lo, hi = 0.0, 0.05
    while met(hi) >= target and hi < 1e3:
        lo, hi = hi, hi * 2
    if hi >= 1e3:
        return math.inf
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if met(mid) >= target else (lo, mid)
    return lo


def uniform_mix(prompt: tuple[int, int], new: tuple[int, int]) -> Callable[[random.Random], tuple[int, int]]:
    return lambda rng: (rng.randint(*prompt), rng.randint(*new))
