"""How ``--scenario vs-ray-serve-llm`` measures a point: a closed loop (a refused request, 429, is sent again
after its retry-after-ms and its wait counts) summarised with its requests; and the paired form, pdserve and
one of its engines alone in alternating rounds, with pdserve's phase histograms read around each round
(:class:`PhaseTimes`)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve_bench.runner import Load, run_load
from pdserve_bench.scrape import add, delta, mean_ms, scrape
from pdserve_bench.stats import summarize


def _run(url: str, model: str, reqs: list[Any], load: Load, auth: Any = None) -> tuple[list[Any], float]:
    return asyncio.run(run_load(url, model, reqs, load, progress=False, retry_refused=True, auth=auth))


def _summary(results: list[Any], wall: float) -> dict[str, Any]:
    s = summarize(results, wall)
    s["results"] = [r.as_dict() for r in results]
    return s


def measure(url: str, model: str, reqs: list[Any], load: Load, auth: Any = None) -> dict[str, Any]:
    """One point on one system: ``reqs`` at ``load``, summarized with every request's row."""
    return _summary(*_run(url, model, reqs, load, auth))


def measure_paired(url: str, engines: list[str], auth: Any, model: str, reqs: list[Any], own: list[Any],
                   load: Load, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One point measured on pdserve (``url``) and on one of its engines alone (``own`` prompts) in
    alternating rounds: round k sends the k-th share of each list, pdserve first on even rounds, the
    engine alone being ``engines[k % len(engines)]``. Each summary counts the wall time of its own rounds
    only."""
    per = max(int(load.value) if load.kind == "concurrency" else 1, 1)
    k = max(1, min(rounds, len(reqs) // per))
    cut = [round(i * len(reqs) / k) for i in range(k + 1)]
    out: dict[str, tuple[list[Any], float]] = {"pd": ([], 0.0), "colo": ([], 0.0)}
    seen = {"pd": PhaseTimes(), "colo": PhaseTimes()}
    for i in range(k):
        ways = [("pd", url, reqs, None), ("colo", engines[i % len(engines)], own, auth)]
        for way, target, items, a in (ways if i % 2 == 0 else ways[::-1]):
            before = seen[way].scrape(url)
            res, wall = _run(target, model, items[cut[i]:cut[i + 1]], load, a)
            seen[way].add(before, seen[way].scrape(url))
            got, total = out[way]
            out[way] = (got + res, total + wall)
    pd, colo = _summary(*out["pd"]), _summary(*out["colo"])
    pd["phases"], colo["phases"] = seen["pd"].as_dict(), seen["colo"].as_dict()
    return pd, colo


#: Histograms read from pdserve's ``/metrics`` around each round: the router's P/D phases, and where the
#: engines' own time went (``vllm:*``, by pdserve role): whether a phase slows when P/D runs it.
PHASE_SERIES = (("pdserve_phase_duration_seconds", "phase", "router"),
                ("vllm:request_queue_time_seconds", "pdserve_role", "engine_queue"),
                ("vllm:request_prefill_time_seconds", "pdserve_role", "engine_prefill"),
                ("vllm:request_decode_time_seconds", "pdserve_role", "engine_decode"))


class PhaseTimes:
    """Histogram growth summed over the rounds of one way of a paired point. A failed scrape (the metrics
    are a side figure) leaves the round out and is counted."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, float]] = {key: {} for _, _, key in PHASE_SERIES}
        self.counts: dict[str, dict[str, float]] = {key: {} for _, _, key in PHASE_SERIES}
        self.missed = 0

    def scrape(self, url: str) -> Any:
        try:
            return scrape(url, engines=True)
        except (OSError, ValueError):
            self.missed += 1
            return None

    def add(self, before: Any, after: Any) -> None:
        if before is None or after is None:
            return
        for name, label, key in PHASE_SERIES:
            add(self.sums[key], delta(before, after, name + "_sum", label))
            add(self.counts[key], delta(before, after, name + "_count", label))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: mean_ms(self.sums[key], self.counts[key]) for _, _, key in PHASE_SERIES}
        out["rounds_unread"] = self.missed
        return out
