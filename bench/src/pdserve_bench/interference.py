"""Decode streams under bursts of long prompts: colocated engines against P/D (``interference``), and against
pdserve disaggregating everything or only the long prompts (``conditional``)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.scenario_load import prompt_factory, warm_up
from pdserve_bench.stats import summarize
from pdserve_bench.systems import EnginePair, ServedApp
from pdserve_bench.workload import Lengths, build_requests


def _mixed(url: str | list[str], model: str, streams: list[Any], bursts: list[Any], n_streams: int,
           burst_rate: float, prefill_url: str | None = None) -> dict[str, Any]:
    """Steady decode streams (closed loop) and, at the same time, long prompts arriving at a fixed rate."""

    async def both() -> tuple[Any, Any]:
        return await asyncio.gather(
            run_load(url, model, streams, Load("concurrency", n_streams), progress=False, prefill_url=prefill_url),
            run_load(url, model, bursts, Load("rate", burst_rate), progress=False, prefill_url=prefill_url),
        )

    (s_res, s_wall), (b_res, b_wall) = asyncio.run(both())
    out = {"streams": summarize(s_res, s_wall), "bursts": summarize(b_res, b_wall)}
    out["streams"]["results"] = [r.as_dict() for r in s_res]
    out["bursts"]["results"] = [r.as_dict() for r in b_res]
    return out


def _streams_and_bursts(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> tuple[list[Any], list[Any], float]:
    """The interference workload: short-prompt decode streams and bursts of 1,000-token prompts."""
    factory = prompt_factory(args, opts, plan)
    streams = plan.workload("streams", build_requests(factory, int(opts.get("requests", 8)), Lengths.parse("32"),
                                                      Lengths.parse("96")))
    bursts = plan.workload("bursts", build_requests(factory, int(opts.get("bursts", 6)), Lengths.parse("1000"),
                                                    Lengths.parse("4")))
    rate = float(opts.get("burst_rate", 0.25))
    plan.set(burst_rate=rate)
    return streams, bursts, rate


def _plan_mixed(plan: Plan, system: str, n_streams: int, rate: float) -> None:
    plan.phase(f"{system}: streams", system=system, load=Load("concurrency", n_streams), workload="streams",
               alongside=f"{system}: bursts")
    plan.phase(f"{system}: bursts", system=system, load=Load("rate", rate), workload="bursts",
               alongside=f"{system}: streams")


def interference(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Decode streams disturbed by bursts of long prompts: colocated (two independent engines, one core
    each, requests spread over both) vs 1 prefill + 1 decode on the same two cores."""
    model = args.model_id
    n_streams = int(opts.get("streams", 2))
    plan.set(streams=n_streams)
    streams, bursts, rate = _streams_and_bursts(args, opts, plan)
    colocated_pair = plan.system("colocated", EnginePair(args, disaggregated=False))
    pd_pair = plan.system("pd", EnginePair(args))
    for name in ("colocated", "pd"):
        _plan_mixed(plan, name, n_streams, rate)
    if plan.dry_run:
        return plan.as_dict()
    with colocated_pair as colo:
        warm_up(colo.urls[0], model, streams)
        warm_up(colo.urls[1], model, streams)
        colocated = _mixed(colo.urls, model, streams, bursts, n_streams, rate)
    with pd_pair as pair:
        warm_up(pair.urls[1], model, streams, pair.urls[0])
        pd = _mixed(pair.urls[1], model, streams, bursts, n_streams, rate, prefill_url=pair.urls[0])
    return {
        "colocated": colocated, "pd": pd,
        "ratio": {
            "stream_itl_p99": pd["streams"]["itl_ms"]["p99"] / colocated["streams"]["itl_ms"]["p99"],
            "stream_itl_p50": pd["streams"]["itl_ms"]["p50"] / colocated["streams"]["itl_ms"]["p50"],
            "burst_ttft_p50": pd["bursts"]["ttft_ms"]["p50"] / colocated["bursts"]["ttft_ms"]["p50"],
        },
    }


def conditional(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Conditional disaggregation: the interference workload (short-prompt decode streams + bursts of
    1,000-token prompts) on colocated engines, on pdserve disaggregating everything, and on pdserve with
    ``router.local_prefill_below_tokens`` (short prompts prefilled on the decode replica)."""
    model = args.model_id
    threshold = int(opts.get("threshold", 256))
    plan.set(threshold=threshold)
    streams, bursts, rate = _streams_and_bursts(args, opts, plan)
    colocated_pair = plan.system("colocated", EnginePair(args, disaggregated=False))
    served: dict[str, ServedApp] = {}
    for name, below in (("pd_all", 0), ("pd_conditional", threshold)):
        a = args.model_copy(deep=True)
        a.router.local_prefill_below_tokens = below
        served[name] = plan.system(name, ServedApp(a), local_prefill_below_tokens=below)
    for name in ("colocated", *served):
        _plan_mixed(plan, name, 2, rate)
    if plan.dry_run:
        return plan.as_dict()
    out: dict[str, Any] = {"threshold": threshold}
    with colocated_pair as colo:
        warm_up(colo.urls[0], model, streams)
        out["colocated"] = _mixed(colo.urls, model, streams, bursts, 2, rate)
    for name, system in served.items():
        with system as app:
            warm_up(app.url, model, streams)
            out[name] = _mixed(app.url, model, streams, bursts, 2, rate)
    out["summary"] = {k: {"short_ttft_p50_ms": out[k]["streams"]["ttft_ms"]["p50"],
                          "short_itl_p99_ms": out[k]["streams"]["itl_ms"]["p99"],
                          "long_ttft_p50_ms": out[k]["bursts"]["ttft_ms"]["p50"]}
                      for k in ("colocated", "pd_all", "pd_conditional")}
    return out
