"""Self-contained comparisons. Each starts what it compares on the same cores, one after the other.

Figures are ratios measured side by side in one run: absolute times on a shared machine drift.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.runner import Load, run_load
from pdserve.bench.stats import summarize
from pdserve.bench.systems import EnginePair, ServedApp, _say
from pdserve.bench.workload import Lengths, PromptFactory, build_requests
from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError

Scenario = Callable[[PDServeArgs, dict[str, Any]], dict[str, Any]]


def _requests(args: PDServeArgs, opts: dict[str, Any], n: int, prompt: int, out: int) -> list[Any]:
    from pdserve.model.resolve import resolve_model

    model_dir = resolve_model(args.prefill_config.model_loading_config.model_source)
    factory = PromptFactory(model_dir, seed=int(opts.get("seed", 0)))
    return build_requests(factory, n, Lengths.parse(str(opts.get("prompt_len", prompt))),
                          Lengths.parse(str(opts.get("output_len", out))))


def _run(url: str, model: str, reqs: list[Any], load: Load, prefill_url: str | None = None) -> dict[str, Any]:
    results, wall = asyncio.run(run_load(url, model, reqs, load, prefill_url=prefill_url))
    s = summarize(results, wall)
    s["results"] = [r.as_dict() for r in results]
    return s


def _warm(url: str, model: str, reqs: list[Any], prefill_url: str | None = None) -> None:
    # First requests pay one-time costs (NIXL handshake, allocator warm-up); not part of the figure.
    _run(url, model, reqs[:3], Load("concurrency", 1), prefill_url)


def overhead(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """(a) two plain vLLM servers + the bare two-call handoff client vs (b) the pdserve endpoint."""
    n = int(opts.get("requests", 40))
    model = args.model_id
    reqs = _requests(args, opts, n + 3, 300, 32)
    load = Load.parse(opts.get("load", "concurrency:1"))
    with EnginePair(args) as pair:
        _warm(pair.urls[1], model, reqs, pair.urls[0])
        bare = _run(pair.urls[1], model, reqs[3:], load, prefill_url=pair.urls[0])
    with ServedApp(args) as app:
        _warm(app.url, model, reqs)
        served = _run(app.url, model, reqs[3:], load)
    out = {"bare_handoff": bare, "pdserve": served}
    out["ratio"] = {f"{m}_{p}": served[m][p] / bare[m][p] for m in ("e2e_ms", "ttft_ms") for p in ("p50", "p99")}
    out["router_added_ms"] = {p: served["e2e_ms"][p] - bare["e2e_ms"][p] for p in ("p50", "p90")}
    return out


def handoff(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """The handoff-stall check: single requests (~300-token prompt, 32 new tokens), P/D vs colocated.

    Colocated is one plain engine per core without KV transfer; P/D is the bare prefill→decode handoff on
    the same two cores, with pdserve's engine settings.
    """
    n = int(opts.get("requests", 20))
    model = args.model_id
    reqs = _requests(args, opts, n + 3, 300, 32)
    one = Load("concurrency", 1)
    with EnginePair(args, disaggregated=False) as colo:
        _warm(colo.urls[0], model, reqs)
        colocated = _run(colo.urls[0], model, reqs[3:], one)
    with EnginePair(args) as pair:
        _warm(pair.urls[1], model, reqs, pair.urls[0])
        pd = _run(pair.urls[1], model, reqs[3:], one, prefill_url=pair.urls[0])
    return {"colocated": colocated, "pd": pd,
            "ratio": {f"e2e_{p}": pd["e2e_ms"][p] / colocated["e2e_ms"][p] for p in ("p50", "p90", "p99")}}


def router(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """The router alone against fake engines on one core: requests/s and CPU ms per request."""
    from pdserve.bench.router_bench import measure_router

    return measure_router(seconds=float(opts.get("seconds", 10)), concurrency=int(opts.get("concurrency", 32)))


def kv_transfer(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """NIXL DRAM→DRAM bandwidth vs single-thread memcpy on this host, with pdserve's UCX settings."""
    from pdserve.bench.nixl_bench import measure_kv_transfer

    return measure_kv_transfer()


SCENARIOS: dict[str, Scenario] = {
    "overhead": overhead,
    "handoff": handoff,
    "router": router,
    "kv-transfer": kv_transfer,
}


def run_scenario(name: str, args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    try:
        fn = SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; valid: {', '.join(sorted(SCENARIOS))}") from None
    t0 = time.monotonic()
    _say(f"scenario {name}")
    out = fn(args, opts)
    out["scenario"] = name
    out["took_s"] = time.monotonic() - t0
    return out
