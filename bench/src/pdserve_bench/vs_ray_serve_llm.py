"""``--scenario vs-ray-serve-llm``: pdserve against Ray Serve LLM's own P/D app, and one colocated engine.

Three systems on the same model, the same vLLM engine arguments and the same cores, started one after the
other (each stopped before the next starts):

* ``ray-serve-llm``: ``ray.serve.llm.build_pd_openai_app`` with one prefill and one decode replica, run by
  a child process (``python -m pdserve_bench.vs_ray_serve_llm --serve-ray-llm CONFIG.json``) that starts a
  Ray instance of its own (``address="local"``, its own temporary directory, ports the kernel picks), runs
  the app on a free port, prints a ready line and blocks. Stopping it: SIGTERM (``serve.shutdown()``,
  ``ray.shutdown()``), then SIGKILL to its process group and to every process of that Ray instance (its
  descendants, and anything whose command line names its temporary directory). No other Ray is touched.
* ``pdserve``: ``pdserve serve`` with the same config (:class:`~pdserve_bench.systems.ServedApp`).
* ``colocated``: one plain vLLM server with pdserve's prefill command line minus the KV connector, on the
  first core: the compute floor of a single request.

The engine arguments are the ones pdserve gives its engines
(:func:`~pdserve.engine.launcher.engine_kwargs_for`: dtype, ``max_model_len``, ``enforce_eager``,
``kv_transfer_config`` with NixlConnector and a CPU buffer, and the config's own ``engine_kwargs``), with
the CPU dtype decided once for all three. Ray Serve LLM runs
without a GPU through its CPU accelerator backend: ``accelerator_config: {kind: cpu}``, no
``accelerator_type``, and ``placement_group_config: {bundle_per_worker: {CPU: 1}}`` (a bundle without GPU),
which makes it run vLLM with the ``mp`` executor. Each engine gets one core through the environment
pdserve's launcher gives its engines (:func:`~pdserve.engine.launcher.engine_env`:
``VLLM_CPU_OMP_THREADS_BIND``, ``OMP_NUM_THREADS``, UCX transports, NIXL side
channel on loopback, tcmalloc),
passed as the replicas' ``runtime_env.env_vars``; with ``ray_env=pdserve`` (the default) the replicas also
get what pdserve's engine guard does for its engines (every thread on the engine's core, its niceness; a
Ray worker setup hook, :func:`replica_setup`) and pdserve's NIXL poll-delay fix, so that the serving layers
differ and nothing else. ``ray_env=vllm`` keeps only vLLM's, UCX's and the allocator's variables.

Loads, the same prompts on every system (streamed, greedy, ``ignore_eos``): after a warm-up, single
requests (concurrency 1) at each size, then a closed-loop concurrency sweep on the first size (a refused
request, 429, is sent again after its retry-after-ms and its wait counts). Per system and point: TTFT
p50/p90, TPOT p50, end-to-end p50/p90, and the ratios pdserve ÷ colocated, ray-serve-llm ÷ colocated,
ray-serve-llm ÷ pdserve. Ray Serve LLM runs with its own defaults, among them the 50 ms batching of
streamed chunks (``experimental_configs.stream_batching_interval_ms``; ``ray_stream_batching_ms=0`` turns
it off): it adds up to one interval to TTFT and bunches the inter-token gaps; TPOT, counted in tokens
between the first and the last, moves little.

Systems started one after the other meet the host in different moods: on a shared 2-core machine one
engine's speed drifts by tens of percent within minutes, more than the differences measured. So by default
(``paired=1``) the colocated floor is measured inside pdserve's run, on pdserve's own engines asked for
the whole answer (the same processes, arguments and cores; what the ``ttft`` scenario does with the prefill
engine): each point's requests go in rounds, a round to pdserve and a round of other prompts of the same
sizes to one engine alone, the order alternating, so both see the same moments of the host; the engine
alone is the prefill engine and the decode engine in turn, as the two cores of a shared host differ. ``paired=0`` starts the plain engine of
its own after pdserve instead.

``--opt requests=10 --opt sizes=long:600x32,short:16x8 --opt concurrencies=1,2,4 --opt sweep_requests=12
--opt systems=ray-serve-llm,pdserve,colocated --opt ray_env=pdserve --opt ray_stream_batching_ms=50
--opt start_timeout_s=900 --opt paired=1 --opt rounds=4``

The scenario's parts: :mod:`pdserve_bench.ray_serve_llm` (Ray Serve LLM's app: config and child process),
:mod:`pdserve_bench.ray_serve_llm_child` (what runs in that child and in its Ray workers),
:mod:`pdserve_bench.vs_ray_options` (the options above), :mod:`pdserve_bench.vs_ray_measure` (a point,
alone or paired) and :mod:`pdserve_bench.vs_ray_report` (figures, ratios, plot). This module decides the
dtype, builds the workload and the plan, runs each system in turn, and is the child process's entry point
(``python -m pdserve_bench.vs_ray_serve_llm``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError, EngineStartError
from pdserve_bench.engine_dtype import with_dtype
from pdserve_bench.ray_serve_llm import (
    RAY_LLM_MODULES,
    RayServeLLMApp,
    check_ray_llm_modules,
    engine_cores,
    missing_message,
    missing_ray_llm_modules,
)
from pdserve_bench.ray_serve_llm_child import replica_setup, serve_ray_llm
from pdserve_bench.runner import Load
from pdserve_bench.systems import EnginePair, ServedApp, _say
from pdserve_bench.vs_ray_measure import PhaseTimes, measure, measure_paired
from pdserve_bench.vs_ray_options import Settings, Size, point, read_settings
from pdserve_bench.vs_ray_report import compare, plot, point_lines, ratio_lines
from pdserve_bench.workload import Lengths, PromptFactory, build_requests

#: The scenario, and the names callers found here before the module's split (each lives in the module it
#: is imported from). ``replica_setup`` is named by this path: the replicas' setup hook (``SETUP_HOOK``).
__all__ = ["RAY_LLM_MODULES", "PhaseTimes", "RayServeLLMApp", "check_ray_llm_modules", "compare", "engine_cores",
           "main", "missing_ray_llm_modules", "plot", "replica_setup", "vs_ray_serve_llm"]
_paired = measure_paired

SCENARIO = "vs-ray-serve-llm"
#: Requests each system gets per size before it is measured (the first ones pay one-time costs).
WARMUP = 3
ONE = Load("concurrency", 1)


# --- the workload ---------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests of every system: the warm-up, then per point its requests and load; with ``paired``,
    the colocated floor's own prompts per point."""

    warm: list[Any]
    work: dict[str, tuple[list[Any], Load]]
    own: dict[str, list[Any]]
    labels: dict[str, str]


def build_workload(s: Settings, factory: PromptFactory, plan: Any) -> Workload:
    """Every request the run sends, recorded in ``plan``: the same prompts for every system (in the order
    they are built, so the same seed gives the same prompts)."""
    def build(count: int, size: Size) -> list[Any]:
        return build_requests(factory, count, Lengths.parse(str(size.prompt)), Lengths.parse(str(size.out)))

    warm = plan.workload("warm-up", [r for size in s.sizes for r in build(WARMUP, size)],
                         note=f"{WARMUP} of each size, concurrency 1, not measured")
    work: dict[str, tuple[list[Any], Load]] = {}
    # In paired mode the colocated floor runs on pdserve's prefill engine, which caches prefixes: it gets
    # prompts of its own (built right after pdserve's, the same sizes).
    own: dict[str, list[Any]] = {}
    for size in s.sizes:
        work[point(size.name, 1)] = (plan.workload(size.label(), build(s.requests, size), stream=True, greedy=True),
                                     ONE)
        if s.paired:
            own[point(size.name, 1)] = build(s.requests, size)
    sweep = s.sweep
    for c in s.concurrencies:
        if c == 1:
            continue  # the single-request point of the first size
        count = int(math.ceil(max(s.sweep_requests, c) / c)) * c
        work[point(sweep.name, c)] = (plan.workload(f"{sweep.label()}, concurrency {c}", build(count, sweep),
                                                    stream=True, greedy=True), Load("concurrency", c))
        if s.paired:
            own[point(sweep.name, c)] = build(count, sweep)
    labels = {point(size.name, 1): size.label() for size in s.sizes}
    labels.update({point(sweep.name, c): f"{sweep.label()}, concurrency {c}" for c in s.concurrencies if c != 1})
    return Workload(warm, work, own, labels)


# --- the plan -------------------------------------------------------------------------------------------


def plan_systems(plan: Any, args: PDServeArgs, s: Settings, w: Workload, dtype_reason: str,
                 missing: list[str]) -> dict[str, Any]:
    """Records the settings, each system and its phases in ``plan``; returns the systems to start, in order
    (in paired mode the colocated floor is phases of pdserve's run, not a system of its own)."""
    cores = engine_cores()
    plan.set(requests=s.requests, sizes={x.name: {"prompt_tokens": x.prompt, "max_tokens": x.out} for x in s.sizes},
             concurrencies=s.concurrencies, sweep_size=s.sweep.name, sweep_requests=s.sweep_requests,
             systems=s.systems, ray_env=s.ray_env, dtype=args.prefill_config.engine_kwargs.get("dtype", "auto"),
             dtype_reason=dtype_reason,
             ray_stream_batching_ms=(s.stream_batching_ms if s.stream_batching_ms is not None
                                     else "Ray Serve LLM's default"),
             cores={"ray-serve-llm": {"prefill": cores[0], "decode": cores[1]},
                    "pdserve": "one per engine, claimed from the same cores",
                    "colocated": "pdserve's two engines', in turn" if s.paired else cores[0]},
             paired=s.paired, rounds=s.rounds if s.paired else None,
             missing_modules=missing)
    systems: dict[str, Any] = {}
    for name in s.systems:
        if name == "ray-serve-llm":
            systems[name] = plan.system(name, RayServeLLMApp(args, mode=s.ray_env,
                                                             stream_batching_ms=s.stream_batching_ms,
                                                             start_timeout_s=s.start_timeout_s))
        elif name == "pdserve":
            systems[name] = plan.system(name, ServedApp(args))
        elif s.paired:
            for key, (_, load) in w.work.items():
                plan.phase(f"colocated: {w.labels[key]}", system="pdserve", load=load, workload=w.labels[key],
                           point=key, to="pdserve's prefill and decode engines in turn, in rounds alternating "
                                         "with pdserve's, prompts of its own of the same sizes")
            continue
        else:
            systems[name] = plan.system(name, EnginePair(args, disaggregated=False, engines=1))
        plan.phase(f"{name}: warm-up", system=name, load=ONE, workload="warm-up")
        for key, (_, load) in w.work.items():
            plan.phase(f"{name}: {w.labels[key]}", system=name, load=load, workload=w.labels[key], point=key)
    return systems


# --- the run --------------------------------------------------------------------------------------------


def run_system(name: str, system: Any, model: str, s: Settings, w: Workload
               ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Starts one system, warms it up and measures every point; returns its points, the colocated floor's
    (measured on pdserve's engines in paired mode, else empty) and its seconds to ready."""
    t0 = time.monotonic()
    with system as live:
        url = live.urls[0] if isinstance(live, EnginePair) else live.url
        ready_s = time.monotonic() - t0
        _say(f"{name}: warm-up")
        measure(url, model, w.warm, ONE)
        got: dict[str, dict[str, Any]] = {}
        floor: dict[str, dict[str, Any]] = {}
        paired = s.paired and name == "pdserve"
        if paired:
            # Both of pdserve's engines serve as the floor in turn: the two cores of a shared host
            # differ (one engine's TPOT by 10-20 % against the other's, back to back), and pdserve
            # decodes on one and computes prompts on the other.
            roles = live.engines()
            engines = [roles["prefill"], roles["decode"]]
            for engine in engines:
                measure(engine, model, w.warm, ONE, auth=live.auth)
        for key, (reqs, load) in w.work.items():
            _say(f"{name}: {w.labels[key]} ({len(reqs)} requests)")
            if paired:
                got[key], floor[key] = measure_paired(url, engines, live.auth, model, reqs, w.own[key], load,
                                                      s.rounds)
            else:
                got[key] = measure(url, model, reqs, load)
            for who, res in ((name, got), ("colocated", floor)):
                if key in res:
                    for line in point_lines(who, res[key]):
                        _say(line)
    return got, floor, ready_s


def run_systems(systems: dict[str, Any], model: str, s: Settings, w: Workload,
                result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each system in turn (one that does not start is recorded with its error, and the next one runs);
    returns the measured points per system, the colocated floor among them in paired mode."""
    measured: dict[str, dict[str, dict[str, Any]]] = {}
    for name, system in systems.items():
        try:
            got, floor, ready_s = run_system(name, system, model, s, w)
        except EngineStartError as e:
            _say(f"{name} did not start: {str(e).splitlines()[0]}")
            result["systems"][name] = {"error": str(e)[-4000:]}
            continue
        measured[name] = got
        result["systems"][name] = {"ready_s": ready_s, "points": got}
        if floor:
            measured["colocated"] = floor
            result["systems"]["colocated"] = {"ready_s": None, "points": floor,
                                              "note": "pdserve's engines in turn, rounds alternating with pdserve"}
    return measured


def vs_ray_serve_llm(args: PDServeArgs, opts: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """The scenario; with a dry-run ``plan`` (:class:`pdserve_bench.plan.Plan`), returns the plan without
    starting anything."""
    from pdserve_bench.plan import Plan

    plan = plan or Plan(SCENARIO)
    found = plan.require(*RAY_LLM_MODULES)
    missing = [m for m, ok in found.items() if not ok]
    if missing and not plan.dry_run:
        raise ConfigError(missing_message(missing))
    s = read_settings(opts)
    if args.prefill_config.lora_config is not None or args.decode_config.lora_config is not None:
        raise ConfigError(f"--scenario {SCENARIO} compares the base model: remove lora_config from the config")
    args, dtype_reason = with_dtype(args, dry_run=plan.dry_run)
    w = build_workload(s, PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0))), plan)
    systems = plan_systems(plan, args, s, w, dtype_reason, missing)
    if plan.dry_run:
        return plan.as_dict()

    from pdserve_bench.overload_long import host_cpu

    result: dict[str, Any] = {"host_cpu": host_cpu(), "settings": dict(plan.settings), "systems": {},
                              "points": {k: w.labels[k] for k in w.work}}
    measured = run_systems(systems, args.model_id, s, w, result)
    if not measured:
        raise EngineStartError("no system started; see the errors above")
    result["compare"] = compare(measured)
    for line in ratio_lines(result["compare"]):
        _say(line)
    return result


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pdserve_bench.vs_ray_serve_llm")
    p.add_argument("--serve-ray-llm", metavar="CONFIG.json", required=True,
                   help="run Ray Serve LLM's P/D app as the scenario's child process")
    ns = p.parse_args(argv)
    return serve_ray_llm(ns.serve_ray_llm)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
