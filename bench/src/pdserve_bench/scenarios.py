"""Self-contained comparisons. Each starts what it compares on the same cores, one after the other.

Figures are ratios measured side by side in one run: absolute times on a shared machine drift.

Every scenario first builds its workload, the systems it compares and its phases, recording them in a
:class:`~pdserve_bench.plan.Plan`, and starts nothing before that: ``run_scenario(..., dry_run=True)``
(``pdserve bench --scenario NAME --dry-run``) returns that plan instead of running it.

This module is the registry (``--scenario NAME`` → the function that runs it) and :func:`run_scenario`. The
scenarios live in their own modules: :mod:`~pdserve_bench.single_requests` (overhead, ttft, handoff),
:mod:`~pdserve_bench.interference` (interference, conditional), :mod:`~pdserve_bench.prefix`,
:mod:`~pdserve_bench.outside_client`, :mod:`~pdserve_bench.overload`, and those imported when they run (router,
kv-transfer, goodput, overload-long, cpu-env, startup, vs-ray-serve-llm, edge, tenants, footprint, multiturn,
floor).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench.interference import conditional, interference
from pdserve_bench.outside_client import outside_client
from pdserve_bench.overload import overload
from pdserve_bench.plan import Plan
from pdserve_bench.prefix import prefill_cache_counters, prefix
from pdserve_bench.scenario_load import WARMUP
from pdserve_bench.single_requests import handoff, overhead, ttft
from pdserve_bench.systems import _say

#: The registry, and the names callers found here before the scenarios moved to their own modules.
__all__ = ["SCENARIOS", "WARMUP", "Scenario", "prefill_cache_counters", "run_scenario"]

#: ``(args, opts, plan)``: records its workload, systems and phases in ``plan`` before it starts anything,
#: and returns ``plan.as_dict()`` at that point when ``plan.dry_run``.
Scenario = Callable[[PDServeArgs, dict[str, Any], Plan], dict[str, Any]]


# --- the scenarios imported when they run ------------------------------------------------------------------


def goodput(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Goodput (rate within SLO at 90 %) of two colocated engines, P/D and conditional P/D, per workload mix
    (pdserve_bench/goodput.py)."""
    from pdserve_bench.goodput import goodput as run

    return run(args, opts, plan)


def router(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The router alone against fake engines on one core: requests/s and CPU ms per request."""
    from pdserve_bench.router_bench import measure_router

    return measure_router(seconds=float(opts.get("seconds", 10)), concurrency=int(opts.get("concurrency", 32)),
                          latency_requests=int(opts.get("latency_requests", 300)), plan=plan)


def kv_transfer(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """NIXL DRAM→DRAM bandwidth vs single-thread memcpy on this host, with pdserve's UCX settings
    (``--opt memory=VRAM``: GPU 0's memory to GPU 0's memory, vs its device-to-device copy)."""
    from pdserve_bench.nixl_bench import measure_kv_transfer

    return measure_kv_transfer(iters=int(opts.get("iters", 10)), plan=plan,
                               memory=str(opts.get("memory", "DRAM")).upper())


def startup(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Time-to-ready by phase, cold vs warm, one engine and the whole app (see pdserve_bench/startup.py)."""
    from pdserve_bench.startup import measure_startup

    return measure_startup(args, opts, plan)


def overload_long(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Closed-loop clients, 1,500-1,900-token prompts, the default config (see pdserve_bench/overload_long.py)."""
    from pdserve_bench.overload_long import overload_long as run

    return run(args, opts, plan)


def cpu_env(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """An engine setting (tcmalloc preload, dtype) against none, paired on both cores (pdserve_bench/cpu_env.py)."""
    from pdserve_bench.cpu_env import cpu_env as run

    return run(args, opts, plan)


def vs_ray_serve_llm(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """pdserve against Ray Serve LLM's own P/D app and one colocated engine: same model, engine arguments and
    cores (pdserve_bench/vs_ray_serve_llm.py)."""
    from pdserve_bench.vs_ray_serve_llm import vs_ray_serve_llm as run

    return run(args, opts, plan)


def edge(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """``/health`` latency idle and under 200 hostile connections (slow heads, stalled bodies, oversized
    heads, silent ones) against the app's public port (pdserve_bench/edge.py)."""
    from pdserve_bench.edge import edge as run

    return run(args, opts, plan)


def tenants(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """A flooding tenant beside a steady one on one app: the steady tenant's TTFT and attainment alone and
    flooded, the flooder's 429s (pdserve_bench/tenants.py)."""
    from pdserve_bench.tenants import tenants as run

    return run(args, opts, plan)


def footprint(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The app idle: CPU share and memory (PSS) by part, and the TTFT of the first requests after ready
    (pdserve_bench/footprint.py)."""
    from pdserve_bench.footprint import footprint as run

    return run(args, opts, plan)


def multiturn(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Agent-like conversations of 8-12 turns, several at once: plain P/D, cache-aware P/D and two colocated
    engines; TTFT by turn index, goodput, turns without prefill, KV moved (pdserve_bench/multiturn.py)."""
    from pdserve_bench.multiturn import multiturn as run

    return run(args, opts, plan)


def floor(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Single requests: pdserve against one plain engine alone on the host (no Ray, no router), in rounds
    that alternate, TTFT and e2e p50 ratios against 1.10x (pdserve_bench/floor.py)."""
    from pdserve_bench.floor import floor as run

    return run(args, opts, plan)


SCENARIOS: dict[str, Scenario] = {
    "overhead": overhead,
    "handoff": handoff,
    "router": router,
    "interference": interference,
    "goodput": goodput,
    "conditional": conditional,
    "prefix": prefix,
    "outside-client": outside_client,
    "kv-transfer": kv_transfer,
    "overload": overload,
    "overload-long": overload_long,
    "ttft": ttft,
    "cpu-env": cpu_env,
    "startup": startup,
    "vs-ray-serve-llm": vs_ray_serve_llm,
    "edge": edge,
    "tenants": tenants,
    "footprint": footprint,
    "multiturn": multiturn,
    "floor": floor,
}


#: Scenarios that decide their engines' dtype themselves, and report why (``with_dtype``).
DECIDE_DTYPE_THEMSELVES = frozenset({"multiturn", "floor", "vs-ray-serve-llm"})


def run_scenario(name: str, args: PDServeArgs, opts: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    """Run a scenario; ``dry_run``: build its workload, systems and phases and return them (the plan),
    starting nothing."""
    try:
        fn = SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; valid: {', '.join(sorted(SCENARIOS))}") from None
    t0 = time.monotonic()
    _say(f"scenario {name}{' (dry run: plan only)' if dry_run else ''}")
    plan = Plan(name, dry_run=dry_run)
    # The engines a scenario starts itself compute in the dtype ``pdserve serve`` would pick on this host
    # (``cpu.dtype: auto``), not the model's own (bfloat16 for the packaged model: 7.8x slower on AVX2).
    dtype_reason = None
    if name not in DECIDE_DTYPE_THEMSELVES:
        from pdserve_bench.engine_dtype import with_dtype

        args, dtype_reason = with_dtype(args, dry_run=dry_run)
        plan.set(engine_dtype=dtype_reason)
    out = fn(args, opts, plan)
    if dry_run and out.get("dry_run") is not True:
        raise RuntimeError(f"scenario {name!r} ran instead of returning its plan")
    out["scenario"] = name
    if dtype_reason is not None:
        out.setdefault("engine_dtype", dtype_reason)
    out["took_s"] = time.monotonic() - t0
    return out
