"""``--scenario overload``: admission control under twice the load the endpoint carries, with and without the
per-engine in-flight bounds."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.scenario_load import WARMUP, build_prompts, measure, warm_up
from pdserve_bench.stats import summarize
from pdserve_bench.systems import ServedApp, _say


def _health_watch(url: str, stop: Any, seen: dict[str, int]) -> None:
    import urllib.request

    while not stop.is_set():
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                key = "up" if r.status == 200 else "down"
        except OSError:
            key = "down"
        seen[key] = seen.get(key, 0) + 1
        stop.wait(1.0)


def _overload_phase(url: str, model: str, reqs: list[Any], rate: float, seed: int) -> dict[str, Any]:
    import threading

    stop, seen = threading.Event(), {"up": 0, "down": 0}
    watch = threading.Thread(target=_health_watch, args=(url, stop, seen), daemon=True)
    watch.start()
    try:
        results, wall = asyncio.run(run_load(url, model, reqs, Load("poisson", rate), seed=seed))
    finally:
        stop.set()
        watch.join()
    admitted = [r for r in results if r.status != 429]
    s = summarize(admitted, wall)
    refused = [r for r in results if r.status == 429]
    return {
        "rate": rate, "sent": len(results), "admitted": len(admitted), "refused_429": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.retry_after),
        "admitted_failed": s["failed"], "admitted_errors": s["errors"],
        "e2e_ms": s["e2e_ms"], "ttft_ms": s["ttft_ms"], "completed_per_s": s["request_throughput"],
        "health_checks": seen, "wall_s": wall, "results": [r.as_dict() for r in admitted],
    }


def overload(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Admission control under 2x saturating load.

    The endpoint's capacity is measured first (closed loop at ``bound`` requests in flight per engine);
    then Poisson arrivals at 1x and 2x that rate for ``seconds`` each, with the per-engine in-flight bound
    (refusals are 429 + Retry-After), and 2x again with the bounds lifted (every request queues in the
    engines). Admitted requests must all finish; their p99 with bounds should stay near the 1x figure,
    while without bounds the queue, and the p99, grow with the length of the overload.
    """
    model = args.model_id
    bound = int(opts.get("bound", 4))
    seconds = float(opts.get("seconds", 60))
    seed = int(opts.get("seed", 0))
    out: dict[str, Any] = {"bound_per_engine": bound, "seconds_per_phase": seconds}

    def configured(per_engine: int) -> PDServeArgs:
        a = args.model_copy(deep=True)
        a.router.max_inflight_per_decode_engine = per_engine
        a.router.max_inflight_per_prefill_engine = per_engine
        a.router.max_inflight = max(a.router.max_inflight, per_engine)
        return a

    plan.set(bound_per_engine=bound, seconds_per_phase=seconds)
    probe = plan.workload("capacity probe", build_prompts(args, opts, plan, 6 * bound + WARMUP, 300, 32),
                          warmup=WARMUP)
    bounded = plan.system("bounded", ServedApp(configured(bound)))
    unbounded = plan.system("unbounded", ServedApp(configured(100_000)))
    plan.phase("capacity", system="bounded", load=Load("concurrency", bound), workload="capacity probe")
    for label, system, mult in (("bounded_1x", "bounded", 1), ("bounded_2x", "bounded", 2),
                                ("unbounded_2x", "unbounded", 2)):
        plan.phase(label, system=system, load=f"poisson:{mult}x the measured capacity", seconds=seconds,
                   requests="max(8, rate x seconds), 300-token prompts, 32 new tokens, built once the rate is known")
    if plan.dry_run:
        return plan.as_dict()
    with bounded as app:
        warm_up(app.url, model, probe)
        cap = measure(app.url, model, probe[WARMUP:], Load("concurrency", bound))
        capacity = cap["request_throughput"]
        out["capacity_req_per_s"] = capacity
        _say(f"capacity at {bound} in flight: {capacity:.2f} req/s")
        for label, mult in (("bounded_1x", 1.0), ("bounded_2x", 2.0)):
            rate = capacity * mult
            reqs = build_prompts(args, {**opts, "seed": seed + int(mult)}, plan, max(8, int(rate * seconds)), 300, 32)
            _say(f"{label}: Poisson {rate:.2f} req/s for {seconds:.0f}s")
            out[label] = _overload_phase(app.url, model, reqs, rate, seed)
    with unbounded as app:
        warm_up(app.url, model, probe)
        rate = capacity * 2
        reqs = build_prompts(args, {**opts, "seed": seed + 2}, plan, max(8, int(rate * seconds)), 300, 32)
        _say(f"unbounded_2x: Poisson {rate:.2f} req/s for {seconds:.0f}s")
        out["unbounded_2x"] = _overload_phase(app.url, model, reqs, rate, seed)
    p99 = {k: out[k]["e2e_ms"]["p99"] for k in ("bounded_1x", "bounded_2x", "unbounded_2x")}
    out["summary"] = {
        "admitted_e2e_p99_ms": p99,
        "bounded_2x_over_1x_p99": p99["bounded_2x"] / p99["bounded_1x"],
        "unbounded_2x_over_1x_p99": p99["unbounded_2x"] / p99["bounded_1x"],
        "refused_share_at_2x": out["bounded_2x"]["refused_429"] / max(1, out["bounded_2x"]["sent"]),
        "admitted_failed": sum(out[k]["admitted_failed"] for k in p99),
        "health_down": sum(out[k]["health_checks"]["down"] for k in p99),
    }
    return out
