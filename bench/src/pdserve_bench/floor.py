"""``--scenario floor``: what the whole stack costs a single request on a small host.

Two systems take turns on the host, each started alone and stopped before the other starts, in rounds
whose order alternates (round 1: the engine alone, then pdserve; round 2: pdserve, then the engine; ...),
so that a host that speeds up or slows down over the run weighs on both alike:

* ``alone``: one plain vLLM OpenAI server, nothing else running: no Ray, no router, no second engine. Its
  command line and environment are the ones pdserve gives its prefill engine
  (:func:`~pdserve.engine.launcher.build_engine_command`: dtype, ``max_model_len``, ``enforce_eager``, the
  KV cache size, one core bound through ``VLLM_CPU_OMP_THREADS_BIND`` and pdserve's engine guard, its
  niceness, tcmalloc), without the KV connector (``connector=1`` keeps it). It runs on the core pdserve
  gives its prefill engine (the first usable one); ``alone_core=rotate`` moves it to the next core each
  round instead, for hosts whose two cores differ.
* ``pdserve``: ``pdserve serve`` with the same config (:class:`~pdserve_bench.systems.ServedApp`), through its
  endpoint: Ray Serve, the router, a prefill and a decode engine.

The CPU dtype is decided once, as ``pdserve serve`` decides it, and given to both. In each system's turn,
per prompt size: a warm-up of its own, then single streaming requests one at a time (greedy, ``ignore_eos``,
32 new tokens); every request of the run has a prompt of its own, so no prefix cache is ever hit. Per size
the report gives TTFT p50 and e2e p50 of each system per round and over all rounds (every round's requests
pooled), and the ratios pdserve ÷ alone beside the target (≤ 1.10x).

The ``ttft`` and ``vs-ray-serve-llm`` scenarios measure their floor on pdserve's own engines inside the
running app, which cannot see what the app's other processes cost the host; this one can.

``--requests 12 --opt prompts=300,1500 --opt rounds=2 --output-len 32 --opt connector=0
--opt alone_core=prefill``
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.allocator import claim_free_port
from pdserve.engine.launcher import EngineCommand, EnginePlacement, build_engine_command
from pdserve.errors import ConfigError
from pdserve_bench.client import Result
from pdserve_bench.plan import Plan
from pdserve_bench.runner import run_load
from pdserve_bench.scenario_load import ONE, WARMUP, prompt_factory
from pdserve_bench.stats import summarize
from pdserve_bench.systems import EnginePair, ServedApp, _say
from pdserve_bench.workload import Lengths, build_requests

SCENARIO = "floor"
#: pdserve ÷ one plain engine alone on the host, single requests, TTFT and e2e p50: the target.
TARGET = 1.10
#: The two systems, in the order of odd rounds (even rounds run them the other way round).
SYSTEMS = ("alone", "pdserve")


@dataclass(frozen=True)
class Settings:
    requests: int
    sizes: list[int]
    output_len: int
    rounds: int
    connector: bool
    alone_core: str


def read_settings(opts: dict[str, Any]) -> Settings:
    """The scenario's options (``--opt`` strings, ``--requests`` / ``--output-len`` as the CLI gives them)."""
    try:
        s = Settings(requests=int(opts.get("requests", 12)),
                     sizes=[int(x) for x in str(opts.get("prompts", "300,1500")).replace(";", ",").split(",")
                            if x.strip()],
                     output_len=int(opts.get("output_len", 32)), rounds=int(opts.get("rounds", 2)),
                     connector=str(opts.get("connector", "0")).strip().lower() in ("1", "true", "yes", "on"),
                     alone_core=str(opts.get("alone_core", "prefill")).strip())
    except ValueError as e:
        raise ConfigError(f"--scenario {SCENARIO}: {e}") from None
    if s.requests < 1 or s.rounds < 1 or s.output_len < 1 or not s.sizes or min(s.sizes) < 1:
        raise ConfigError(f"--scenario {SCENARIO}: requests, rounds, output_len and every prompt size must be ≥ 1")
    if s.alone_core not in ("prefill", "rotate"):
        raise ConfigError(f"--scenario {SCENARIO}: alone_core={s.alone_core!r}; valid: prefill, rotate")
    return s


def round_order(r: int) -> tuple[str, ...]:
    """Which system goes first in round ``r`` (from 0): the engine alone in even rounds, pdserve in odd."""
    return SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]


class AloneEngine(EnginePair):
    """One plain vLLM server on one core with the command line and environment pdserve gives its prefill
    engine; without the KV connector unless ``connector``."""

    def __init__(self, args: PDServeArgs, *, core: int, connector: bool = False) -> None:
        super().__init__(args, disaggregated=False, engines=1)
        self.core = core
        self.connector = connector

    def _commands(self, model: str) -> list[tuple[str, int, EngineCommand]]:
        pl = EnginePlacement(http_port=claim_free_port(self.claim, "127.0.0.1"), side_channel_port=5700,
                             side_channel_host="127.0.0.1", engine_id=f"bench-alone-{self.core}",
                             cores=[self.core], on_cpu=True)
        cmd = build_engine_command("prefill", self.args, model, pl)
        if not self.connector:
            i = cmd.argv.index("--kv-transfer-config")
            del cmd.argv[i:i + 2]
        return [("alone", self.core, cmd)]

    def _colocated(self) -> str:
        return "one plain engine alone on the host" + (" (with pdserve's KV connector)" if self.connector else "")


# --- the report: pure, from the requests each system answered ----------------------------------------------


def _summary(rows: list[Result]) -> dict[str, Any]:
    s = summarize(rows, sum(r.e2e_s for r in rows))
    s["results"] = [r.as_dict() for r in rows]
    return s


def _ratio(ours: float, floor: float) -> float:
    return ours / floor if floor > 0 and not math.isnan(floor) and not math.isnan(ours) else float("nan")


def _ratios(alone: dict[str, Any], ours: dict[str, Any]) -> dict[str, float]:
    return {f"{m}_p50": _ratio(ours[f"{m}_ms"]["p50"], alone[f"{m}_ms"]["p50"]) for m in ("ttft", "e2e")}


def floor_report(rows: dict[int, list[dict[str, list[Result]]]], target: float = TARGET) -> dict[str, Any]:
    """``rows[size][round][system]``: the measured requests. Per size: each round's summaries and ratios,
    every round's requests pooled per system, and the pooled ratios pdserve ÷ alone against ``target``
    (a ratio that cannot be computed, nan, is not within it)."""
    out: dict[str, Any] = {}
    for size, rounds in rows.items():
        pooled: dict[str, list[Result]] = {s: [] for s in SYSTEMS}
        per_round = []
        for got in rounds:
            entry: dict[str, Any] = {s: _summary(got.get(s, [])) for s in SYSTEMS}
            entry["ratio"] = _ratios(entry["alone"], entry["pdserve"])
            per_round.append(entry)
            for s in SYSTEMS:
                pooled[s] += got.get(s, [])
        overall = {s: _summary(pooled[s]) for s in SYSTEMS}
        ratio = _ratios(overall["alone"], overall["pdserve"])
        out[str(size)] = {"rounds": per_round, **overall, "ratio": ratio, "target": target,
                          "within_target": {k: (not math.isnan(v)) and v <= target for k, v in ratio.items()}}
    return out


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.0f} ms"


def _x(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def point_line(size: int | str, label: str, alone: dict[str, Any], ours: dict[str, Any]) -> str:
    """One line: TTFT and e2e p50 of both systems and their ratios."""
    r = _ratios(alone, ours)
    return (f"{size} tokens, {label}: TTFT p50 alone {_ms(alone['ttft_ms']['p50'])}, pdserve "
            f"{_ms(ours['ttft_ms']['p50'])} ({_x(r['ttft_p50'])}); e2e p50 alone {_ms(alone['e2e_ms']['p50'])}, "
            f"pdserve {_ms(ours['e2e_ms']['p50'])} ({_x(r['e2e_p50'])})")


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as lines: per size, each round, then all rounds with the target beside the ratios."""
    lines = []
    for size, r in report.items():
        for i, rd in enumerate(r["rounds"]):
            lines.append(point_line(size, f"round {i + 1}", rd["alone"], rd["pdserve"]))
        lines.append(point_line(size, "all rounds", r["alone"], r["pdserve"]))
        verdict = ", ".join(f"{k.replace('_p50', '')} {'within' if ok else 'OVER'}"
                            for k, ok in r["within_target"].items())
        failed = r["alone"]["failed"] + r["pdserve"]["failed"]
        lines.append(f"{size} tokens: pdserve ÷ alone, p50: TTFT {_x(r['ratio']['ttft_p50'])}, e2e "
                     f"{_x(r['ratio']['e2e_p50'])} (target ≤ {r['target']:.2f}x: {verdict})"
                     + (f"; {failed} requests failed" if failed else ""))
    return lines


# --- the plan and the run ----------------------------------------------------------------------------------


def _cores(s: Settings) -> list[int]:
    """The alone engine's core per round: pdserve's prefill core (the first usable one), or each in turn."""
    from pdserve.engine.allocator import usable_cores

    cores = usable_cores()
    return [cores[r % len(cores)] if s.alone_core == "rotate" else cores[0] for r in range(s.rounds)]


def floor(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The scenario (the module's docstring); with ``plan.dry_run``, returns the plan and starts nothing."""
    from pdserve_bench.engine_dtype import with_dtype

    s = read_settings(opts)
    args, dtype_reason = with_dtype(args, dry_run=plan.dry_run)
    cores = _cores(s)
    plan.set(requests=s.requests, prompts=s.sizes, output_len=s.output_len, rounds=s.rounds,
             order=[list(round_order(r)) for r in range(s.rounds)], connector=s.connector,
             alone_cores=cores, dtype=args.prefill_config.engine_kwargs.get("dtype", "auto"),
             dtype_reason=dtype_reason, target=TARGET)
    factory = prompt_factory(args, opts, plan)
    per_turn = WARMUP + s.requests
    # Every request its own prompt (built in the order the run sends them): no prefix cache is ever hit.
    work: dict[int, list[dict[str, list[Any]]]] = {
        size: [{name: build_requests(factory, per_turn, Lengths("fixed", size), Lengths("fixed", s.output_len))
                for name in round_order(r)} for r in range(s.rounds)]
        for size in s.sizes}
    for size in s.sizes:
        plan.workload(f"{size}-token prompts", [q for rd in work[size] for reqs in rd.values() for q in reqs],
                      warmup=WARMUP * 2 * s.rounds, stream=True, greedy=True,
                      note="each system, round and request its own prompt")
    plan.system("alone", AloneEngine(args, core=cores[0], connector=s.connector),
                cores_by_round=cores, started="in each of its turns, alone on the host")
    plan.system("pdserve", ServedApp(args), started="in each of its turns, alone on the host")
    for r in range(s.rounds):
        for name in round_order(r):
            for size in s.sizes:
                plan.phase(f"round {r + 1}: {name}, {size} tokens", system=name, load=ONE,
                           workload=f"{size}-token prompts", warmup=WARMUP, requests=s.requests,
                           through="its endpoint" if name == "pdserve" else f"the engine on core {cores[r]}")
    if plan.dry_run:
        return plan.as_dict()
    return _run(args, s, cores, work, dict(plan.settings))


def _one(url: str, model: str, req: Any) -> Result:
    res, _ = asyncio.run(run_load(url, model, [req], ONE, progress=False))
    return res[0]


def _run(args: PDServeArgs, s: Settings, cores: list[int], work: dict[int, list[dict[str, list[Any]]]],
         settings: dict[str, Any]) -> dict[str, Any]:
    import time

    from tqdm import tqdm

    from pdserve_bench.overload_long import host_cpu

    model = args.model_id
    rows: dict[int, list[dict[str, list[Result]]]] = {size: [{} for _ in range(s.rounds)] for size in s.sizes}
    turns: list[dict[str, Any]] = []
    for r in range(s.rounds):
        for name in round_order(r):
            system: Any = (ServedApp(args) if name == "pdserve"
                           else AloneEngine(args, core=cores[r], connector=s.connector))
            _say(f"round {r + 1}/{s.rounds}: starting {name}")
            t0 = time.monotonic()
            with system as live:
                url = live.url if name == "pdserve" else live.urls[0]
                turns.append({"round": r + 1, "system": name, "ready_s": time.monotonic() - t0,
                              **({"core": cores[r]} if name == "alone" else {})})
                for size in s.sizes:
                    reqs = work[size][r][name]
                    for req in reqs[:WARMUP]:
                        _one(url, model, req)
                    got = [_one(url, model, req) for req in tqdm(reqs[WARMUP:], unit="req",
                                                                 desc=f"round {r + 1} {name} {size} tokens")]
                    rows[size][r][name] = got
                    done = _summary(got)
                    _say(f"round {r + 1}/{s.rounds}, {name}, {size} tokens: TTFT p50 "
                         f"{_ms(done['ttft_ms']['p50'])}, e2e p50 {_ms(done['e2e_ms']['p50'])} "
                         f"({done['succeeded']}/{len(got)} ok)")
    report = floor_report(rows)
    for line in report_lines(report):
        _say(line)
    return {"host_cpu": host_cpu(), "settings": settings, "target": TARGET, "turns": turns, "sizes": report}
