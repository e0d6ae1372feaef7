"""What the router has sent to one engine, and how fast that engine has been going.

The router is the only sender to its engines, so it can keep their queues itself instead of asking them:
every prompt it hands an engine (a prefill leg, or a prompt a decode engine computes locally) is added to
that engine's ``queued_tokens`` until the engine has computed it, and every decode stream is counted in
``streams`` until it ends. Two speeds are learned from what comes back:

* prompt tokens per second: computed tokens over the time the engine had prompts to compute. Several
  prompts finishing together (vLLM batches them) add their tokens against the same stretch of busy time,
  so batching is measured, not assumed. Before the first measurement the rate comes from a calibration
  prompt the router sends a new engine (:meth:`pdserve.router.orchestrator.Orchestrator.calibrate`).
* time per output token of decode streams (an exponential average), with the number of streams it was
  measured at, and what one more stream adds to it: a least-squares line over the last finished streams,
  each one's time per token against the mean number of streams beside it.

:meth:`EngineLoad.wait_s` turns that into the estimate admission needs: how long a prompt sent now would
wait before the engine starts on it. Work drains at the measured rate from the last completion on, a
fluid model that needs no per-request timeline.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

#: Completed prompts the rate is averaged over, and the short window that catches a slowdown.
RATE_WINDOW = 16
SHORT_WINDOW = 4
#: Weight of the newest TPOT sample in the average.
TPOT_ALPHA = 0.3
#: The calibration prompt runs alone on an idle engine; under load the same engine computes prompts about
#: half as fast (its HTTP server, tokenizer and NIXL threads share its cores with the model: 1,587 tokens/s
#: calibrated vs 735 measured under 6 clients on one core).
#: Admission trusts this share of it until real prompts have been measured.
CALIBRATION_DERATE = 0.5
#: What a second decode stream adds to a step, as a share of the step, while the engine has been measured
#: with about one stream only. On CPU a step is mostly reading the weights: a second sequence adds little.
FIRST_STREAM_SHARE = 0.25
#: The per-stream cost is fitted (least squares) over this many finished streams: each one's time per
#: output token against the mean number of streams the engine ran during its life. The fit is used once it
#: has ``STREAM_FIT_MIN`` streams whose stream counts spread by at least ``STREAM_FIT_SPREAD`` (standard
#: deviation, in streams); with less spread a slope is noise.
STREAM_FIT_WINDOW = 32
STREAM_FIT_MIN = 6
STREAM_FIT_SPREAD = 0.3
#: The short window of an engine's share of time on prompts: a new stream's expected time per token takes
#: the higher of the last minute's share and this one's. With the minute alone, the first seconds of a burst
#: read as idle: by load put a whole request on a prefill engine that had just started a run of
#: 1,100-1,900-token prompts, and the next prompt stalled its stream for 2 s (TPOT 64 ms against a 38.7 ms
#: target).
BUSY_BURST_S = 10.0
#: The long window of that share, and its ceiling (a share of 1 would make a stream's stall infinite).
BUSY_WINDOW_S = 60.0
BUSY_SHARE_CAP = 0.9

#: When a stream started, and the engine's stream-seconds by then (:meth:`EngineLoad.add_stream`).
StreamMark = tuple[float, float]


class EngineLoad:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.queued_tokens = 0  # prompt tokens sent and not yet computed
        self.prompts = 0  # prompts in that queue
        self.streams = 0  # decode sequences this engine is generating for the router
        self.pending = 0  # P/D requests bound for this decode engine, still in their prefill leg
        self._due: list[float] = []  # when those expected to arrive were expected (clock times)
        self.answers: Counter[int] = Counter()  # new tokens asked for by those streams and pending requests
        self.calibrated_rate: float | None = None  # prompt tokens/s from the calibration prompt
        self.calibration_failures = 0
        self._done: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (tokens, busy seconds)
        self._busy: deque[tuple[float, float]] = deque(maxlen=RATE_WINDOW)  # (end time, busy seconds)
        self._mark = clock()  # the last completion, or the start of the current busy stretch
        # Streams ran beside the prompts since the mark: their time then includes decode steps they waited
        # behind (a prompt computed on a busy decode engine is timed to its first token), so it teaches no
        # prompt speed.
        self._shared = False
        self._untaught = 0  # prompts in the queue whose time teaches no speed (add_prompt)
        self.tpot_s: float | None = None
        self.tpot_streams = 1.0  # streams running when the TPOT average was last fed
        self.tpot_single: float | None = None  # time per output token with one stream (the idle figure)
        self._stream_s = 0.0  # streams integrated over time (stream-seconds) up to _stream_s_at
        self._stream_s_at = clock()
        self._fit: deque[tuple[float, float]] = deque(maxlen=STREAM_FIT_WINDOW)  # (mean streams, TPOT)
        self._fitted: tuple[float, float] | None = None  # the line through _fit, computed once per new stream

    # -- calibration --------------------------------------------------------------------------------

    def calibrated(self, rate: float, tpot_single: float | None = None) -> None:
        """The engine's measured prompt speed (tokens/s) and, for a decode engine, its idle time per token."""
        self.calibrated_rate = rate
        if tpot_single is not None:
            self.tpot_single = tpot_single

    def calibration_failed(self) -> None:
        self.calibration_failures += 1

    # -- P/D requests bound for this decode engine ----------------------------------------------------

    def add_pending(self, new_tokens: int, due_in_s: float | None = None) -> float | None:
        """A P/D request in its prefill leg will stream here, asking for ``new_tokens``, expected in
        ``due_in_s`` (its prefill engine's queue and its prompt there; None: unknown, counted as here now).
        Returns the mark :meth:`end_pending` takes back."""
        self.pending += 1
        self.add_answer(new_tokens)
        if due_in_s is None:
            return None
        due = self.clock() + max(0.0, due_in_s)
        self._due.append(due)
        return due

    def end_pending(self, new_tokens: int, due: float | None = None) -> None:
        self.pending = max(0, self.pending - 1)
        self.end_answer(new_tokens)
        if due is not None and due in self._due:
            self._due.remove(due)

    def pending_delay_s(self, busy_s: float) -> float:
        """What the P/D requests on their way here wait together if this engine is busy for the next
        ``busy_s`` seconds: each one due before that waits out the rest (one with no known due time, all of
        it)."""
        now = self.clock()
        unknown = max(0, self.pending - len(self._due))
        return unknown * busy_s + sum(max(0.0, now + busy_s - due) for due in self._due)

    # -- prompts ------------------------------------------------------------------------------------

    def add_prompt(self, tokens: int, teaches: bool = True) -> None:
        """A prompt of ``tokens`` joins the queue. ``teaches``: its time measures the engine's speed (not when
        the engine first loads its LoRA adapter: router/lora_slots.py); no stretch of busy time while it is
        queued teaches anything, as one shared with streams does not."""
        if self.prompts == 0:
            self._mark = self.clock()
            self._shared = False
        self._untaught += 0 if teaches else 1
        self._shared = self._shared or self.streams > 0 or not teaches
        self.prompts += 1
        self.queued_tokens += tokens

    def end_prompt(self, reserved: int, computed: int | None, teaches: bool = True) -> None:
        """A prompt added with ``reserved`` tokens (and ``teaches`` as given then) left the queue; ``computed``
        is how many tokens the engine reported computing (``None``: it failed or was abandoned, so it teaches
        nothing about speed)."""
        now = self.clock()
        self._untaught = max(0, self._untaught - (0 if teaches else 1))
        self.prompts = max(0, self.prompts - 1)
        self.queued_tokens = max(0, self.queued_tokens - reserved)
        if computed:
            busy = max(now - self._mark, 1e-6)
            if not self._shared:
                self._done.append((computed, busy))
            self._busy.append((now, busy))
            self._mark = now
            self._shared = self.streams > 0 or self._untaught > 0

    def rate(self) -> float | None:
        """Prompt tokens per second: measured once two prompts finished, else the calibration. The lower of
        the whole window's rate and its last few prompts' rate, so a slowdown (e.g. decode streams taking
        CPU from the router and the engines' servers) counts at once and a speed-up only once it holds."""
        if len(self._done) >= 2:
            recent = list(self._done)[-SHORT_WINDOW:]
            return min(_tokens_per_s(self._done), _tokens_per_s(recent))
        return self.calibrated_rate * CALIBRATION_DERATE if self.calibrated_rate else None

    def measured_rate(self) -> float | None:
        """The whole window's prompt tokens per busy second (the engine's capacity under this load)."""
        return _tokens_per_s(self._done) if len(self._done) >= 2 else None

    def wait_s(self, extra_tokens: int = 0) -> float:
        """Seconds before a prompt sent now would be started (``extra_tokens`` already queued ahead of it,
        e.g. the prompts of requests it will follow on another engine). ``inf`` while the engine's speed is
        unknown and it has work: an unmeasured engine takes one prompt at a time."""
        queued = self.queued_tokens + extra_tokens
        if queued == 0:
            return 0.0
        r = self.rate()
        if r is None:
            return math.inf
        drained = (self.clock() - self._mark) if self.prompts else 0.0
        return max(0.0, queued / r - drained)

    def busy_share(self, horizon_s: float = BUSY_WINDOW_S) -> float:
        """The share of the last ``horizon_s`` seconds this engine spent computing prompts (the prompts
        under way count from their start), at most 0.9."""
        now = self.clock()
        since = now - horizon_s
        busy = sum(max(0.0, end - max(since, end - b)) for end, b in self._busy if end > since)
        if self.prompts:
            busy += now - max(since, self._mark)
        return min(BUSY_SHARE_CAP, busy / horizon_s)

    def tpot_for_new_stream(self, fallback: float | None) -> float | None:
        """Expected time per output token of one more stream here: the measured figure with one more stream
        (``fallback``, e.g. another engine's single-stream figure, while this one has none), stretched by
        the time this engine spends on prompts, which stalls its streams: the higher of the last minute's
        share and the last ``BUSY_BURST_S`` seconds', so that a burst counts at once and not only once it
        has filled a minute."""
        base = self.tpot_with_one_more() or self.tpot_single or self.tpot_s or fallback
        if base is None:
            return None
        return base / (1.0 - max(self.busy_share(), self.busy_share(BUSY_BURST_S)))

    def service_s(self, tokens: int) -> float | None:
        r = self.rate()
        return tokens / r if r else None

    # -- decode streams -----------------------------------------------------------------------------

    def _integrate(self) -> float:
        now = self.clock()
        self._stream_s += self.streams * max(0.0, now - self._stream_s_at)
        self._stream_s_at = now
        return now

    def add_stream(self, sequences: int = 1) -> StreamMark:
        """One more stream (a request generating ``sequences`` at once, ``n`` or a batch of prompts, counts as
        that many: the engine runs each as a stream); what it returns, given back to :meth:`end_stream`, lets
        its time per token be set against the streams that ran beside it."""
        now = self._integrate()
        self.streams += max(1, sequences)
        self._shared = self._shared or self.prompts > 0
        return now, self._stream_s

    def end_stream(self, tpot_s: float | None, mark: StreamMark | None = None, sequences: int = 1) -> None:
        now = self._integrate()
        if tpot_s is not None and tpot_s > 0:
            self.tpot_s = _ewma(self.tpot_s, tpot_s)
            self.tpot_streams = _ewma(self.tpot_streams, float(max(1, self.streams)))
            if self.streams <= 1:
                self.tpot_single = _ewma(self.tpot_single, tpot_s)
            if mark is not None and now > mark[0]:
                self._fit.append(((self._stream_s - mark[1]) / (now - mark[0]), tpot_s))
                self._fitted = self._line()
        self.streams = max(0, self.streams - max(1, sequences))

    def stream_cost_fit(self) -> tuple[float, float] | None:
        """``(time per token with one stream, what each more stream adds)``, fitted over the last finished
        streams; ``None`` until their stream counts spread enough to tell (``STREAM_FIT_*``)."""
        return self._fitted

    def _line(self) -> tuple[float, float] | None:
        if len(self._fit) < STREAM_FIT_MIN:
            return None
        k = len(self._fit)
        mean_n = sum(n for n, _ in self._fit) / k
        mean_t = sum(t for _, t in self._fit) / k
        var = sum((n - mean_n) ** 2 for n, _ in self._fit) / k
        if var < STREAM_FIT_SPREAD ** 2:
            return None
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self._fit) / k / var
        return mean_t + slope * (1.0 - mean_n), slope

    def add_answer(self, new_tokens: int, sequences: int = 1) -> None:
        """A stream or a pending P/D request here will generate up to ``new_tokens`` (0: not known) in each of
        its ``sequences``."""
        if new_tokens > 0:
            self.answers[new_tokens] += max(1, sequences)

    def end_answer(self, new_tokens: int, sequences: int = 1) -> None:
        if self.answers.get(new_tokens, 0) > 0:
            self.answers[new_tokens] = max(0, self.answers[new_tokens] - max(1, sequences))
            if not self.answers[new_tokens]:
                del self.answers[new_tokens]

    def shortest_answer(self, unknown: int) -> int | None:
        """The fewest new tokens of the streams running here and of the requests on their way (``unknown``
        for one whose length was not asked); ``None`` when there are none."""
        lengths = list(self.answers)
        if sum(self.answers.values()) < self.streams + self.pending:
            lengths.append(unknown)
        return min(lengths) if lengths else None

    def stalls_little(self, tokens: int, share: float, unknown: int) -> bool:
        """Whether computing a prompt of ``tokens`` here stalls the streams running (or on their way) by at
        most ``share`` of the shortest one's decode time (its new tokens, ``unknown`` when not asked, × this
        engine's step): a stall of s seconds adds s / (n - 1) to the time per token of an n-token answer.
        True with no streams; False while this engine's speeds are unknown."""
        shortest = self.shortest_answer(unknown)
        if shortest is None:
            return True
        svc, step = self.service_s(tokens), self.tpot_s or self.tpot_single
        return svc is not None and step is not None and svc <= share * shortest * step

    def idle(self) -> bool:
        """Nothing queued, streaming or on its way here."""
        return not (self.queued_tokens or self.streams or self.pending)

    def _per_stream_s(self) -> float:
        """What one more stream adds to a decode step. A step costs a fixed part (reading the weights) plus
        a part per sequence: with the single-stream figure as the fixed part, the rest of the measured
        average is spread over the streams it was measured with. Never more than the average itself
        spread evenly (a pure per-sequence cost), so noise in either figure cannot inflate it."""
        assert self.tpot_s is not None
        seen = max(self.tpot_streams, 1.0)
        even = self.tpot_s / seen
        fit = self.stream_cost_fit()
        if fit is not None:
            # Measured over streams that ran beside different numbers of others: the slope itself.
            return min(even, max(0.0, fit[1]))
        if self.tpot_single is None or seen <= 1.5:
            # Measured with about one stream: nothing says yet what a second one adds. Assume a share of the
            # step, not all of it: with the whole step, a host slowed by something else (TPOT at one stream
            # 2.8x its idle figure, measured) made every 64-token request look 11 s slower and admission
            # refused 96 % of requests while the prefill queue stood empty.
            return min(even, FIRST_STREAM_SHARE * self.tpot_s)
        return min(even, max(0.0, (self.tpot_s - self.tpot_single) / (seen - 1)))

    def tpot_with_one_more(self, sequences: int = 1) -> float | None:
        """Time per output token the streams would see with one more request (of ``sequences``): the ones
        running, the P/D requests already admitted towards this engine (still in their prefill leg, they will
        stream here too), and this one; from the measured average at the stream count it was measured with."""
        if self.tpot_s is None:
            return None
        n = self.streams + self.pending + max(1, sequences)
        if n <= 1:
            return None
        return max(0.0, self.tpot_s + self._per_stream_s() * (n - max(self.tpot_streams, 1.0)))

    def decode_slowdown_s(self, new_tokens: int) -> float:
        """How much longer ``new_tokens`` take here because of the streams admitted here and still to come,
        over what the engine does now. (A host that is slow for other reasons is slow for every request
        alike; refusing requests would not make it faster.)"""
        if self.tpot_s is None or new_tokens <= 1:
            return 0.0
        more = self.streams + self.pending + 1 - max(self.tpot_streams, 1.0)
        return max(0.0, self._per_stream_s() * more) * (new_tokens - 1)

    def others_slowdown_s(self, sequences: int, unknown: int) -> float:
        """How much longer the streams here (and on their way) take because a request's ``sequences`` run
        beside them, beyond what any one more stream costs them (which each admitted request's own budget
        allowed for): each sequence past the first adds a stream's cost to every step of theirs, over the
        shortest one's answer (``unknown`` tokens for one that did not say). 0 for one sequence or no
        streams. Before any stream here has been timed (a request of several sequences teaches no time per
        token), a stream costs :data:`FIRST_STREAM_SHARE` of the idle step its calibration measured; with
        neither known, the cost is unbounded."""
        shortest = self.shortest_answer(unknown)
        if sequences <= 1 or shortest is None:
            return 0.0
        if self.tpot_s is not None:
            per = self._per_stream_s()
        elif self.tpot_single is not None:
            per = FIRST_STREAM_SHARE * self.tpot_single
        else:
            return math.inf
        return per * (sequences - 1) * max(0, shortest - 1)

    def as_dict(self) -> dict[str, float | int | None]:
        r = self.rate()
        wait = self.wait_s()
        return {
            "queued_prompt_tokens": self.queued_tokens,
            "queued_prompts": self.prompts,
            "streams": self.streams,
            "pending_pd": self.pending,
            "prompt_tokens_per_s": round(r, 1) if r else None,  # as admission uses it
            "calibrated_prompt_tokens_per_s": round(self.calibrated_rate, 1) if self.calibrated_rate else None,
            "measured_prompt_tokens_per_s": round(m, 1) if (m := self.measured_rate()) else None,
            "est_wait_s": round(wait, 3) if math.isfinite(wait) else None,
            "tpot_s": round(self.tpot_s, 4) if self.tpot_s else None,
            "tpot_per_extra_stream_s": round(fit[1], 5) if (fit := self.stream_cost_fit()) else None,
        }


def _tokens_per_s(done: Any) -> float:
    return sum(t for t, _ in done) / sum(s for _, s in done)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - TPOT_ALPHA) * old + TPOT_ALPHA * new
