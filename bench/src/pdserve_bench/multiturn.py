"""``--scenario multiturn``: agent-like conversations, several at once, on plain P/D, on cache-aware P/D and on
two colocated engines, one system after the other on the same cores.

Each conversation (:mod:`pdserve_bench.multiturn_workload`) has a long system prompt of its own and 8-12
tool-output-like turns of 20-200 tokens; every turn is a streamed, greedy chat request (``max_tokens`` 32)
whose real answer joins the history before the next turn, after a think time. The systems:

* ``pd``: ``pdserve serve`` with ``router.cache_aware_steps: 0``: every turn's whole history is prefilled
  on a prefill replica and its KV moved to a decode replica (today's behaviour);
* ``cache_aware``: the same app with cache-aware placement on (the config's ``cache_aware_steps``, or the
  schema's default): a turn whose history a decode replica holds runs there alone;
* ``adaptive``: cache-aware placement and ``router.disaggregate_by_load`` together: besides, a turn's prompt
  or its whole answer may go to whichever engine is less loaded (loaded, the engines share both phases);
* ``pd_bidir``, ``cache_aware_bidir``, ``adaptive_bidir``: those apps with ``nixl.bidirectional``: decode keeps each finished
  turn's blocks and the next turn's prefill leg reads them instead of computing the last answer and the
  history's last partial block (router/handback.py); asked by name only;
* ``colocated``: two plain vLLM engines, one per core, no KV connector; conversation ``i`` stays on engine
  ``i % 2`` (a client keeps a conversation where its history is cached).

``topology=2p2d`` gives the apps two prefill and two decode replicas on the same two cores; colocated stays
two engines. Before the measured run each system answers a warm-up of fresh first turns; the first system
started (colocated when asked) also answers ``probe`` fresh first turns alone, and the SLO is ``ttft_x``
(1.0) times their TTFT p50 and ``tpot_x`` (1.5) times their TPOT p50 (``slo=ttft=…ms,tpot=…ms`` instead):
a turn should start no later than an idle engine starts a conversation it has never seen.

Per system: TTFT p50/p90 and e2e by turn index; short agent turns (not a conversation's first, ≤ 200 new
tokens on ≥ 1,000 tokens of history); goodput (turns within the SLO per second) and attainment; from the
router's ``pdserve_pd_decisions_total`` read before and after, the share of turns run without a prefill leg;
KV bytes moved per turn, from NIXL's ``vllm:nixl_bytes_transferred`` on the decode engines when they export
it, and estimated beside it from the prompt tokens decode pulled (``vllm:prompt_tokens_by_source``) times
the KV bytes of a token (model config, dtype); ``time_split``, where the time goes (the router's P/D
phases, each role's engine queue and prompt time: vLLM's histograms); each role's prefix-cache hit share.
The targets checked: ``cache_aware``'s short-turn TTFT p50 at most half of ``pd``'s, its goodput at least
``pd``'s and ``colocated``'s; the same for ``adaptive`` and ``cache_aware_bidir``. Beside them, each
system's mean time to the whole answer (what an agent waits for) and short turns' TTFT p50 over ``pd``'s.
Per turn, TPOT p50: what decides goodput where every system sits near the TPOT SLO. ``rounds=N`` runs the
systems N times, the order reversed every other round, each a freshly started system: the figures then pool
every round's turns (goodput over all rounds' time), ``rounds`` keeps each round's, and ``spread`` lists
each system's short-turn TTFT, TPOT, e2e, attainment and goodput round by round with its goodput over plain
P/D's and colocated's within the round (side by side), so one run's luck shows as a spread, not a verdict.
Goodput is counted at the SLO and at ``slo_scales`` multiples of both its targets (DistServe's SLO scale),
the ratios to plain P/D's and colocated's at each, and plotted (``multiturn-goodput.png``): where every
system's TPOT p50 sits at the SLO, whether a lead holds over a range of SLOs or at one point only.

``--opt conversations=4 --opt turns=8-12 --opt topology=1p1d --opt systems=pd,cache_aware,adaptive,colocated
--opt think_s=1 --opt seed=0 --opt system_tokens=1500 --opt tool_tokens=20-200 --opt max_tokens=32
--opt probe=3 --opt ttft_x=1 --opt tpot_x=1.5 --opt slo=ttft=2000ms,tpot=100ms --opt slo_scales=1,1.25,1.5,2
--opt steps=4 --opt rounds=1``. A
conversation that would not fit the engines' ``max_model_len`` (4,096 by default on CPU) gets a shorter
system prompt (not below 256 tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench import multiturn_report as report
from pdserve_bench.multiturn_run import counters, counters_delta, run_conversations, run_singles
from pdserve_bench.multiturn_workload import (
    Shape,
    build_conversations,
    describe,
    probe_prompts,
    span,
    tokenizer_words,
)
from pdserve_bench.plan import Plan
from pdserve_bench.stats import SLO
from pdserve_bench.systems import EnginePair, ServedApp, _say

#: The order they run in: colocated first (it measures the SLO).
SYSTEMS = ("colocated", "pd", "pd_bidir", "cache_aware", "cache_aware_bidir", "adaptive", "adaptive_bidir")
DEFAULT_SYSTEMS = "pd,cache_aware,adaptive,colocated"
TOPOLOGIES = {"1p1d": 1, "2p2d": 2}
STEPS_KEY = "cache_aware_steps"
#: Fresh first turns each system answers before it is measured (one-time costs, NIXL handshakes).
WARMUP = 2


def max_model_len(args: PDServeArgs) -> int:
    """The engines' context: their ``engine_kwargs.max_model_len``, else what pdserve gives CPU engines."""
    got = [int(c.engine_kwargs["max_model_len"]) for c in (args.prefill_config, args.decode_config)
           if c.engine_kwargs.get("max_model_len")]
    return min(got) if got else 4096


def has_steps(args: PDServeArgs) -> bool:
    return STEPS_KEY in type(args.router).model_fields


def app_args(args: PDServeArgs, replicas: int, steps: float | None, by_load: bool = False,
             bidir: bool = False) -> PDServeArgs:
    """The app's config: ``replicas`` of each role, ``router.cache_aware_steps`` set when given (a pdserve
    without the key has only plain P/D: nothing to set), ``router.disaggregate_by_load`` and
    ``nixl.bidirectional`` as asked."""
    a = args.model_copy(deep=True)
    if bidir:
        a.nixl.bidirectional = True
    a.prefill_config.deployment_config.num_replicas = replicas
    a.decode_config.deployment_config.num_replicas = replicas
    if steps is not None and has_steps(a):
        setattr(a.router, STEPS_KEY, steps)
    a.router.disaggregate_by_load = by_load
    return a


def cache_aware_steps(args: PDServeArgs, opts: dict[str, Any]) -> float:
    """``steps``, else the config's value, else (the config turns it off) the schema's default."""
    if opts.get("steps") is not None:
        return float(opts["steps"])
    configured = float(getattr(args.router, STEPS_KEY))
    return configured if configured > 0 else float(type(args.router).model_fields[STEPS_KEY].default)


def build_system(name: str, args: PDServeArgs, replicas: int, steps: float) -> Any:
    """The system ``name`` (not started): what the component test replaces with fakes."""
    if name == "colocated":
        return EnginePair(args, disaggregated=False)
    base = name.removesuffix("_bidir")
    return ServedApp(app_args(args, replicas, 0.0 if base == "pd" else steps, by_load=base == "adaptive",
                              bidir=name != base))


def _endpoints(name: str, system: Any) -> tuple[list[str], str | None]:
    """(the base URLs conversations go to, the app URL whose counters are read or None)."""
    if name == "colocated":
        return list(system.urls), None
    return [system.url], system.url


def _order(systems: list[str], round_index: int) -> list[str]:
    """The systems in the order round ``round_index`` runs them: reversed every other round, so no system
    always runs first (on a fresher host) or last."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def _dtype(args: PDServeArgs) -> str | None:
    got = args.prefill_config.engine_kwargs.get("dtype") or (args.cpu.dtype if args.cpu.dtype != "auto" else None)
    return str(got) if got else None


def multiturn(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    from pdserve_bench.engine_dtype import with_dtype

    topology = str(opts.get("topology", "1p1d")).lower()
    if topology not in TOPOLOGIES:
        raise ConfigError(f"multiturn: topology {topology!r}; valid: {', '.join(TOPOLOGIES)}")
    asked = [s.strip() for s in str(opts.get("systems", DEFAULT_SYSTEMS)).split(",") if s.strip()]
    if not asked or not set(asked) <= set(SYSTEMS):
        raise ConfigError(f"multiturn: systems {asked}; valid: {', '.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in asked]
    if not has_steps(args) and {"cache_aware", "adaptive", "cache_aware_bidir", "adaptive_bidir"} & set(systems):
        raise ConfigError(f"multiturn: this pdserve has no router.{STEPS_KEY}; ask systems=pd,colocated")
    steps = cache_aware_steps(args, opts) if has_steps(args) else 0.0
    shape = Shape(conversations=int(opts.get("conversations", 4)), turns=span(str(opts.get("turns", "8-12")), (8, 12)),
                  system_tokens=int(opts.get("system_tokens", 1500)),
                  tool_tokens=span(str(opts.get("tool_tokens", "20-200")), (20, 200)),
                  max_tokens=int(opts.get("max_tokens", 32)), think_s=float(opts.get("think_s", 1.0)),
                  max_model_len=max_model_len(args))
    seed, n_probe = int(opts.get("seed", 0)), int(opts.get("probe", 3))
    rounds = int(opts.get("rounds", 1))
    if rounds < 1:
        raise ConfigError(f"multiturn: rounds {rounds}; at least 1")
    ttft_x, tpot_x = float(opts.get("ttft_x", 1.0)), float(opts.get("tpot_x", 1.5))
    fixed_slo = SLO.parse(str(opts["slo"])) if opts.get("slo") else None
    scales = report.slo_scales(str(opts.get("slo_scales", ",".join(f"{x:g}" for x in report.SLO_SCALES))))
    args, dtype_note = with_dtype(args, dry_run=plan.dry_run)
    plan.set(topology=topology, systems=systems, rounds=rounds, seed=seed, cache_aware_steps=steps, warmup=WARMUP,
             slo=fixed_slo.__dict__ if fixed_slo else f"ttft {ttft_x:g}x, tpot {tpot_x:g}x the p50 of {n_probe} "
                                                     f"fresh first turns on the first system, alone",
             slo_scales=list(scales),
             dtype=dtype_note)

    model_dir = plan.tokenizer(args)
    words = tokenizer_words(model_dir)
    convs = build_conversations(shape, words, seed)
    shape_info = describe(convs, shape)
    plan.workload("conversations", None, **shape_info, stream=True, greedy=True, api="chat/completions")
    probe = probe_prompts(shape, words, n_probe, seed)
    warm = probe_prompts(shape, words, WARMUP, seed + 1)
    replicas = TOPOLOGIES[topology]
    built = {}
    for s in systems:
        detail = {} if s == "colocated" else {STEPS_KEY: 0.0 if s.startswith("pd") else steps,
                                              "topology": topology, "disaggregate_by_load": s.startswith("adaptive"),
                                              "bidirectional": s.endswith("_bidir")}
        built[s] = plan.system(s, build_system(s, args, replicas, steps), **detail)
    for r in range(rounds):
        for i, s in enumerate(_order(systems, r)):
            if r == 0 and i == 0 and fixed_slo is None:
                plan.phase(f"SLO probe on {s}", system=s, load="concurrency:1", requests=n_probe)
            plan.phase(f"conversations on {s}" + (f" (round {r + 1})" if rounds > 1 else ""), system=s,
                       workload="conversations",
                       load=f"{shape.conversations} conversations at once, think time between turns")
    if plan.dry_run:
        return plan.as_dict()

    from pdserve_bench.overload_long import host_cpu

    per_token = report.kv_bytes_per_token(model_dir, _dtype(args))
    out: dict[str, Any] = {"host_cpu": host_cpu(), "topology": topology, "workload": shape_info, "seed": seed,
                           "dtype": _dtype(args), "kv_bytes_per_token": per_token, "cache_aware_steps": steps,
                           "systems": {}}
    slo = fixed_slo
    model = args.model_id
    runs: dict[str, list[tuple[list[dict[str, Any]], float, dict[str, Any] | None]]] = {s: [] for s in systems}
    per_round: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        per_round.append({})
        for s in _order(systems, r):
            # (a system is started once: a later round starts a fresh one, built alike)
            with (built[s] if r == 0 else build_system(s, args, replicas, steps)) as system:
                bases, app_url = _endpoints(s, system)
                for base in bases:
                    asyncio.run(run_singles(base, model, warm, shape.max_tokens))
                if slo is None:
                    rows = asyncio.run(run_singles(bases[0], model, probe, shape.max_tokens))
                    slo = report.slo_from_probe(rows, ttft_x, tpot_x)
                    out["slo_probe"] = {"system": s, "turns": rows}
                    _say(f"SLO from {len(rows)} fresh first turns on {s}: {slo.__dict__}")
                before = counters(app_url)
                rows, wall = asyncio.run(run_conversations(bases, model, convs, shape.max_tokens, label=s))
                delta = counters_delta(before, counters(app_url))
            rows = [{**row, "round": r} for row in rows]
            runs[s].append((rows, wall, delta))
            per_round[r][s] = report.summarize_system(rows, wall, slo, delta, per_token, scales)
            _say((f"round {r + 1}: " if rounds > 1 else "") + report.lines({"systems": {s: per_round[r][s]}})[0])
    assert slo is not None
    if rounds == 1:
        out["systems"] = per_round[0]
    else:
        # Every round's turns together (goodput: all turns within SLO over all rounds' time), each round's
        # figures beside them, and the ratios within each round (the systems side by side).
        out["systems"] = {s: report.summarize_system([row for rows, _, _ in got for row in rows],
                                                     sum(wall for _, wall, _ in got), slo,
                                                     report.merge_deltas([d for _, _, d in got]), per_token,
                                                     scales)
                          for s, got in runs.items()}
        out["rounds"] = [{s: {k: v for k, v in fig.items() if k != "results"} for s, fig in r.items()}
                         for r in per_round]
        out["spread"] = report.spread(per_round)
    out["slo"] = slo.__dict__
    out["targets"] = report.targets(out["systems"], slo)
    out["compared"] = report.compared(out["systems"])
    for line in report.lines(out):
        _say(line)
    return out
