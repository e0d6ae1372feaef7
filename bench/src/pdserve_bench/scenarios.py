"""Self-contained comparisons. Each starts what it compares on the same cores, one after the other.

Figures are ratios measured side by side in one run: absolute times on a shared machine drift.

Every scenario first builds its workload, the systems it compares and its phases, recording them in a
:class:`~pdserve_bench.plan.Plan`, and starts nothing before that: ``run_scenario(..., dry_run=True)``
(``pdserve bench --scenario NAME --dry-run``) returns that plan instead of running it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.stats import percentile, summarize
from pdserve_bench.systems import EnginePair, ServedApp, _say
from pdserve_bench.workload import Lengths, PromptFactory, build_requests

#: ``(args, opts, plan)``: records its workload, systems and phases in ``plan`` before it starts anything,
#: and returns ``plan.as_dict()`` at that point when ``plan.dry_run``.
Scenario = Callable[[PDServeArgs, dict[str, Any], Plan], dict[str, Any]]

ONE = Load("concurrency", 1)
#: Requests sent before a system's measured phase: the first ones pay one-time costs.
WARMUP = 3


def _factory(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> PromptFactory:
    return PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0)))


def _requests(args: PDServeArgs, opts: dict[str, Any], plan: Plan, n: int, prompt: int, out: int) -> list[Any]:
    return build_requests(_factory(args, opts, plan), n, Lengths.parse(str(opts.get("prompt_len", prompt))),
                          Lengths.parse(str(opts.get("output_len", out))))


def _run(url: str, model: str, reqs: list[Any], load: Load, prefill_url: str | None = None) -> dict[str, Any]:
    results, wall = asyncio.run(run_load(url, model, reqs, load, prefill_url=prefill_url))
    s = summarize(results, wall)
    s["results"] = [r.as_dict() for r in results]
    return s


def _warm(url: str, model: str, reqs: list[Any], prefill_url: str | None = None) -> None:
    # First requests pay one-time costs (NIXL handshake, allocator warm-up); not part of the figure.
    _run(url, model, reqs[:WARMUP], ONE, prefill_url)


def overhead(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """(a) the bare two-call handoff client straight to the engines vs (b) the pdserve endpoint.

    Both drive the *same* two vLLM servers (the ones pdserve started, plain vLLM OpenAI servers), one
    request at a time, alternating a/b and b/a so that drift on a shared machine hits both equally.
    The figure is the ratio b/a of p50 and p99, plus the paired per-request difference.
    """
    from tqdm import tqdm

    n = int(opts.get("requests", 40))
    model = args.model_id
    plan.set(requests=n)
    reqs = plan.workload("prompts", _requests(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
    served = plan.system("pdserve", ServedApp(args))
    plan.phase("warm-up", system="pdserve", load=ONE, workload="prompts", requests=WARMUP,
               through=["the pdserve endpoint", "the bare handoff to its engines"])
    plan.phase("paired", system="pdserve", load=ONE, workload="prompts", requests=n,
               through="each request via the endpoint and as the bare two calls, alternating which goes first")
    if plan.dry_run:
        return plan.as_dict()
    bare_rows: list[Any] = []
    served_rows: list[Any] = []
    with served as app:
        engines = app.engines()
        _warm(app.url, model, reqs)
        # The app's engines answer only with their keys; the bare handoff reads them as a local tool can.
        asyncio.run(run_load(engines["decode"], model, reqs[:WARMUP], ONE, progress=False,
                             prefill_url=engines["prefill"], auth=app.auth))
        for i, req in enumerate(tqdm(reqs[WARMUP:], desc="overhead (paired)", unit="pair")):
            runs = [("bare", engines["decode"], engines["prefill"]), ("pdserve", app.url, None)]
            for name, url, purl in (runs if i % 2 == 0 else runs[::-1]):
                res, _ = asyncio.run(run_load(url, model, [req], ONE, progress=False, prefill_url=purl,
                                              auth=app.auth if purl else None))
                (bare_rows if name == "bare" else served_rows).extend(res)
    bare = summarize(bare_rows, sum(r.e2e_s for r in bare_rows))
    ours = summarize(served_rows, sum(r.e2e_s for r in served_rows))
    bare["results"] = [r.as_dict() for r in bare_rows]
    ours["results"] = [r.as_dict() for r in served_rows]
    out: dict[str, Any] = {"bare_handoff": bare, "pdserve": ours, "requests": n}
    out["ratio"] = {f"{m}_{p}": ours[m][p] / bare[m][p] for m in ("e2e_ms", "ttft_ms") for p in ("p50", "p99")}
    diffs = [1000 * (b.e2e_s - a.e2e_s) for a, b in zip(bare_rows, served_rows) if a.ok and b.ok]
    ttft_diffs = [1000 * (b.ttft_s - a.ttft_s) for a, b in zip(bare_rows, served_rows) if a.ok and b.ok]
    out["router_added_ms"] = {"e2e_p50": percentile(diffs, 50), "e2e_p90": percentile(diffs, 90),
                              "ttft_p50": percentile(ttft_diffs, 50)}
    return out


def ttft(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Time to first token at low load: the pdserve endpoint (P/D) against one colocated engine with the same
    engine arguments, and the bare two-call handoff, paired request by request.

    The colocated engine is pdserve's own prefill engine asked for the whole answer (no KV handoff): the same
    process, arguments and core. The three ways take turns, the order rotating, one request at a time, each
    with its own prompts of the same length (the prefill engine caches prefixes: a prompt sent twice would
    be computed once); per prompt size the figure is the ratio of the p50s and the paired differences.
    """
    from tqdm import tqdm

    n = int(opts.get("requests", 20))
    sizes = [int(x) for x in str(opts.get("prompts", "300,1500")).replace(";", ",").split(",") if x.strip()]
    out_len = int(opts.get("output_len", 16))
    model = args.model_id
    plan.set(requests=n, prompts=sizes, output_len=out_len)
    work = {size: plan.workload(f"{size}-token prompts", _requests(args, {**opts, "prompt_len": size}, plan,
                                                                    3 * (n + WARMUP), size, out_len),
                                warmup=3 * WARMUP, note="three ways, each its own prompts")
            for size in sizes}
    served = plan.system("pdserve", ServedApp(args))
    for size in sizes:
        plan.phase(f"{size} tokens", system="pdserve", load=ONE, workload=f"{size}-token prompts", requests=n,
                   through=["the pdserve endpoint (P/D)", "its prefill engine alone (colocated)",
                            "the bare two-call handoff to its engines"])
    if plan.dry_run:
        return plan.as_dict()
    result: dict[str, Any] = {"requests": n, "output_len": out_len, "sizes": {}}
    with served as app:
        engines = app.engines()
        ways = {"pdserve": (app.url, None, None), "colocated": (engines["prefill"], None, app.auth),
                "bare_handoff": (engines["decode"], engines["prefill"], app.auth)}

        def one(way: str, req: Any) -> Any:
            url, purl, auth = ways[way]
            res, _ = asyncio.run(run_load(url, model, [req], ONE, progress=False, prefill_url=purl, auth=auth))
            return res[0]

        for size in sizes:
            order = list(ways)
            own = {way: work[size][k::3] for k, way in enumerate(order)}  # no prompt is sent twice
            for way in order:
                for req in own[way][:WARMUP]:
                    one(way, req)
            rows: dict[str, list[Any]] = {w: [] for w in ways}
            for i in tqdm(range(WARMUP, WARMUP + n), desc=f"ttft {size} tokens", unit="prompt"):
                for way in order[i % 3:] + order[:i % 3]:
                    rows[way].append(one(way, own[way][i]))
            summary = {w: summarize(r, sum(x.e2e_s for x in r)) for w, r in rows.items()}
            for w, r in rows.items():
                summary[w]["results"] = [x.as_dict() for x in r]
            colo = summary["colocated"]["ttft_ms"]["p50"]
            paired = [1000 * (a.ttft_s - b.ttft_s) for a, b in zip(rows["pdserve"], rows["colocated"])
                      if a.ok and b.ok]
            summary["ratio"] = {"pdserve_ttft_p50": summary["pdserve"]["ttft_ms"]["p50"] / colo,
                                "bare_handoff_ttft_p50": summary["bare_handoff"]["ttft_ms"]["p50"] / colo,
                                "pdserve_e2e_p50": summary["pdserve"]["e2e_ms"]["p50"]
                                / summary["colocated"]["e2e_ms"]["p50"]}
            summary["pdserve_minus_colocated_ttft_ms"] = {"p50": percentile(paired, 50),
                                                          "p90": percentile(paired, 90)}
            result["sizes"][str(size)] = summary
            _say(f"{size} tokens: TTFT p50 colocated {colo:.0f} ms, pdserve "
                 f"{summary['pdserve']['ttft_ms']['p50']:.0f} ms ({summary['ratio']['pdserve_ttft_p50']:.2f}x), "
                 f"bare handoff {summary['bare_handoff']['ttft_ms']['p50']:.0f} ms "
                 f"({summary['ratio']['bare_handoff_ttft_p50']:.2f}x)")
        result["early_first_token"] = _early_counts(app.url)
    return result


def _early_counts(url: str) -> dict[str, float]:
    from pdserve_bench.scrape import scrape, values

    return values(scrape(url), "pdserve_early_first_token_total", "outcome")


def handoff(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The handoff-stall check: single requests (~300-token prompt, 32 new tokens), P/D vs colocated.

    Colocated is one plain engine per core without KV transfer; P/D is the bare prefill→decode handoff on
    the same two cores, with pdserve's engine settings.
    """
    n = int(opts.get("requests", 20))
    model = args.model_id
    plan.set(requests=n)
    reqs = plan.workload("prompts", _requests(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
    colocated_pair = plan.system("colocated", EnginePair(args, disaggregated=False))
    pd_pair = plan.system("pd", EnginePair(args))
    plan.phase("colocated", system="colocated", load=ONE, workload="prompts", to="engine0")
    plan.phase("pd", system="pd", load=ONE, workload="prompts", to="prefill, then decode (bare handoff)")
    if plan.dry_run:
        return plan.as_dict()
    with colocated_pair as colo:
        _warm(colo.urls[0], model, reqs)
        colocated = _run(colo.urls[0], model, reqs[WARMUP:], ONE)
    with pd_pair as pair:
        _warm(pair.urls[1], model, reqs, pair.urls[0])
        pd = _run(pair.urls[1], model, reqs[WARMUP:], ONE, prefill_url=pair.urls[0])
    return {"colocated": colocated, "pd": pd,
            "ratio": {f"e2e_{p}": pd["e2e_ms"][p] / colocated["e2e_ms"][p] for p in ("p50", "p90", "p99")}}


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
    factory = _factory(args, opts, plan)
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
        _warm(colo.urls[0], model, streams)
        _warm(colo.urls[1], model, streams)
        colocated = _mixed(colo.urls, model, streams, bursts, n_streams, rate)
    with pd_pair as pair:
        _warm(pair.urls[1], model, streams, pair.urls[0])
        pd = _mixed(pair.urls[1], model, streams, bursts, n_streams, rate, prefill_url=pair.urls[0])
    return {
        "colocated": colocated, "pd": pd,
        "ratio": {
            "stream_itl_p99": pd["streams"]["itl_ms"]["p99"] / colocated["streams"]["itl_ms"]["p99"],
            "stream_itl_p50": pd["streams"]["itl_ms"]["p50"] / colocated["streams"]["itl_ms"]["p50"],
            "burst_ttft_p50": pd["bursts"]["ttft_ms"]["p50"] / colocated["bursts"]["ttft_ms"]["p50"],
        },
    }


def goodput(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Goodput (rate within SLO at 90 %) of two colocated engines, P/D and conditional P/D, per workload mix
    (pdserve_bench/goodput.py)."""
    from pdserve_bench.goodput import goodput as run

    return run(args, opts, plan)


def _vllm_bench_argv(url: str, model: str, tokenizer: str, n: int, result_dir: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "pdserve_bench.vllm_bench", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", "300", "--random-output-len", "32", "--num-prompts", str(n),
            "--max-concurrency", "1", "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--save-result", "--result-dir", result_dir, "--result-filename", "vllm.json",
            "--percentile-metrics", "ttft,tpot,itl,e2el"]


def outside_client(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """``vllm bench serve`` and ``pdserve bench`` against the same pdserve endpoint, same workload shape
    (random prompts of 300 tokens, 32 new tokens, ignore EOS, one request at a time)."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from pdserve_bench.systems import model_path

    n = int(opts.get("requests", 20))
    model = args.model_id
    plan.set(requests=n)
    plan.require("vllm")
    reqs = plan.workload("prompts", _requests(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
    tok = plan.tokenizer(args) or model_path(args)
    served = plan.system("pdserve", ServedApp(args))
    plan.phase("vllm bench serve", system="pdserve", load=ONE, requests=n,
               argv=_vllm_bench_argv("<pdserve endpoint>", model, tok, n, "<temporary directory>"))
    plan.phase("pdserve bench", system="pdserve", load=ONE, workload="prompts")
    if plan.dry_run:
        return plan.as_dict()
    out: dict[str, Any] = {"requests": n}
    with served as app, tempfile.TemporaryDirectory() as tmp:
        _warm(app.url, model, reqs)
        cmd = _vllm_bench_argv(app.url, model, tok, n, tmp)
        _say("running vllm bench serve")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        v = json.loads((Path(tmp) / "vllm.json").read_text())
        ours = _run(app.url, model, reqs[WARMUP:], ONE)
    out["vllm_bench"] = {k: v.get(k) for k in ("completed", "failed", "mean_ttft_ms", "median_ttft_ms",
                                                "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_e2el_ms")}
    out["pdserve_bench"] = ours
    out["agreement"] = {
        "median_ttft": ours["ttft_ms"]["p50"] / v["median_ttft_ms"],
        "median_tpot": ours["tpot_ms"]["p50"] / v["median_tpot_ms"],
        "mean_ttft": ours["ttft_ms"]["mean"] / v["mean_ttft_ms"],
        "mean_tpot": ours["tpot_ms"]["mean"] / v["mean_tpot_ms"],
    }
    return out


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
        _warm(colo.urls[0], model, streams)
        out["colocated"] = _mixed(colo.urls, model, streams, bursts, 2, rate)
    for name, system in served.items():
        with system as app:
            _warm(app.url, model, streams)
            out[name] = _mixed(app.url, model, streams, bursts, 2, rate)
    out["summary"] = {k: {"short_ttft_p50_ms": out[k]["streams"]["ttft_ms"]["p50"],
                          "short_itl_p99_ms": out[k]["streams"]["itl_ms"]["p99"],
                          "long_ttft_p50_ms": out[k]["bursts"]["ttft_ms"]["p50"]}
                      for k in ("colocated", "pd_all", "pd_conditional")}
    return out


def _prefill_cache_counters(app: ServedApp) -> tuple[float, float]:
    import urllib.request

    with urllib.request.urlopen(app.url + "/metrics", timeout=30) as r:
        return prefill_cache_counters(r.read().decode())


def prefill_cache_counters(text: str) -> tuple[float, float]:
    """(hits, queries) of the prefill engines' prefix caches, from the router's merged exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.labels.get("pdserve_role") != "prefill":
                continue
            if sample.name == "vllm:prefix_cache_hits_total":
                hits += sample.value
            elif sample.name == "vllm:prefix_cache_queries_total":
                queries += sample.value
    return hits, queries


def oracle_hit_rate(prompts: list[list[int]], block: int) -> float:
    """The prefix-cache hit rate of perfect routing with room for everything: each prompt hits its longest
    prefix shared with an earlier prompt, in whole blocks (vLLM caches full blocks only)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for p in prompts:
        n_blocks = len(p) // block
        hit = 0
        while hit < n_blocks and tuple(p[:(hit + 1) * block]) in seen:
            hit += 1
        for i in range(1, n_blocks + 1):
            seen.add(tuple(p[:i * block]))
        hits += hit * block
        total += len(p)
    return hits / total if total else 0.0


def prefix(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Two prefill replicas, a shared-prefix workload (4 system prompts of 512 tokens, 32 unique tokens
    each after them): round_robin vs prefix_affinity vs kv_cache (the engines' KV cache events) for prefill.
    Reports the prefill engines' prefix cache hit rate, its share of the oracle's (every prompt's longest
    prefix already sent, in whole blocks, counted as a hit), and TTFT."""
    import random

    from pdserve_bench.workload import BenchRequest

    model = args.model_id
    factory = _factory(args, opts, plan)
    prefixes = [factory.ids(512) for _ in range(4)]
    n = int(opts.get("requests", 24))
    rng = random.Random(1)
    reqs = plan.workload("shared prefixes",
                         [BenchRequest(rng.choice(prefixes) + factory.ids(32), 8) for _ in range(n)],
                         prefixes=len(prefixes), prefix_tokens=512, unique_tokens=32)
    served: dict[str, ServedApp] = {}
    policies = ("round_robin", "prefix_affinity", "kv_cache")
    for policy in policies:
        a = args.model_copy(deep=True)
        a.prefill_config.deployment_config.num_replicas = 2
        a.router.prefill_policy = policy
        served[policy] = plan.system(policy, ServedApp(a))
        plan.phase(policy, system=policy, load=ONE, workload="shared prefixes",
                   measures="the prefill engines' prefix cache hits over the phase")
    if plan.dry_run:
        return plan.as_dict()
    out: dict[str, Any] = {}
    for policy, system in served.items():
        with system as app:
            h0, q0 = _prefill_cache_counters(app)
            run = _run(app.url, model, reqs, ONE)
            h1, q1 = _prefill_cache_counters(app)
        run["prefill_prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        out[policy] = run
    oracle = oracle_hit_rate([r.prompt_ids for r in reqs], block=int(opts.get("block_size", 16)))
    out["oracle_hit_rate"] = oracle
    out["summary"] = {p: {"hit_rate": out[p]["prefill_prefix_cache_hit_rate"],
                          "of_oracle": out[p]["prefill_prefix_cache_hit_rate"] / oracle if oracle else None,
                          "ttft_p50_ms": out[p]["ttft_ms"]["p50"]} for p in policies}
    return out


def router(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The router alone against fake engines on one core: requests/s and CPU ms per request."""
    from pdserve_bench.router_bench import measure_router

    return measure_router(seconds=float(opts.get("seconds", 10)), concurrency=int(opts.get("concurrency", 32)),
                          latency_requests=int(opts.get("latency_requests", 300)), plan=plan)


def kv_transfer(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """NIXL DRAM→DRAM bandwidth vs single-thread memcpy on this host, with pdserve's UCX settings."""
    from pdserve_bench.nixl_bench import measure_kv_transfer

    return measure_kv_transfer(iters=int(opts.get("iters", 10)), plan=plan)


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
    probe = plan.workload("capacity probe", _requests(args, opts, plan, 6 * bound + WARMUP, 300, 32),
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
        _warm(app.url, model, probe)
        cap = _run(app.url, model, probe[WARMUP:], Load("concurrency", bound))
        capacity = cap["request_throughput"]
        out["capacity_req_per_s"] = capacity
        _say(f"capacity at {bound} in flight: {capacity:.2f} req/s")
        for label, mult in (("bounded_1x", 1.0), ("bounded_2x", 2.0)):
            rate = capacity * mult
            reqs = _requests(args, {**opts, "seed": seed + int(mult)}, plan, max(8, int(rate * seconds)), 300, 32)
            _say(f"{label}: Poisson {rate:.2f} req/s for {seconds:.0f}s")
            out[label] = _overload_phase(app.url, model, reqs, rate, seed)
    with unbounded as app:
        _warm(app.url, model, probe)
        rate = capacity * 2
        reqs = _requests(args, {**opts, "seed": seed + 2}, plan, max(8, int(rate * seconds)), 300, 32)
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
}


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
    out = fn(args, opts, plan)
    if dry_run and out.get("dry_run") is not True:
        raise RuntimeError(f"scenario {name!r} ran instead of returning its plan")
    out["scenario"] = name
    out["took_s"] = time.monotonic() - t0
    return out
