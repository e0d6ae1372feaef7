"""Self-contained comparisons. Each starts what it compares on the same cores, one after the other.

Figures are ratios measured side by side in one run: absolute times on a shared machine drift.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.runner import Load, run_load
from pdserve.bench.stats import percentile, summarize
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
    """(a) the bare two-call handoff client straight to the engines vs (b) the pdserve endpoint.

    Both drive the *same* two vLLM servers (the ones pdserve started, plain vLLM OpenAI servers), one
    request at a time, alternating a/b and b/a so that drift on a shared machine hits both equally.
    The figure is the ratio b/a of p50 and p99, plus the paired per-request difference.
    """
    n = int(opts.get("requests", 40))
    model = args.model_id
    reqs = _requests(args, opts, n + 3, 300, 32)
    one = Load("concurrency", 1)
    bare_rows: list[Any] = []
    served_rows: list[Any] = []
    with ServedApp(args) as app:
        engines = app.engines()
        _warm(app.url, model, reqs)
        _warm(engines["decode"], model, reqs, engines["prefill"])
        from tqdm import tqdm

        for i, req in enumerate(tqdm(reqs[3:], desc="overhead (paired)", unit="pair")):
            runs = [("bare", engines["decode"], engines["prefill"]), ("pdserve", app.url, None)]
            for name, url, purl in (runs if i % 2 == 0 else runs[::-1]):
                res, _ = asyncio.run(run_load(url, model, [req], one, progress=False, prefill_url=purl))
                (bare_rows if name == "bare" else served_rows).extend(res)
    bare = summarize(bare_rows, sum(r.e2e_s for r in bare_rows))
    served = summarize(served_rows, sum(r.e2e_s for r in served_rows))
    bare["results"] = [r.as_dict() for r in bare_rows]
    served["results"] = [r.as_dict() for r in served_rows]
    out: dict[str, Any] = {"bare_handoff": bare, "pdserve": served, "requests": n}
    out["ratio"] = {f"{m}_{p}": served[m][p] / bare[m][p] for m in ("e2e_ms", "ttft_ms") for p in ("p50", "p99")}
    diffs = [1000 * (b.e2e_s - a.e2e_s) for a, b in zip(bare_rows, served_rows) if a.ok and b.ok]
    ttft_diffs = [1000 * (b.ttft_s - a.ttft_s) for a, b in zip(bare_rows, served_rows) if a.ok and b.ok]
    out["router_added_ms"] = {"e2e_p50": percentile(diffs, 50), "e2e_p90": percentile(diffs, 90),
                              "ttft_p50": percentile(ttft_diffs, 50)}
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


def interference(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """Decode streams disturbed by bursts of long prompts: colocated (two independent engines, one core
    each, requests spread over both) vs 1 prefill + 1 decode on the same two cores."""
    from pdserve.bench.workload import Lengths, PromptFactory, build_requests
    from pdserve.model.resolve import resolve_model

    model = args.model_id
    factory = PromptFactory(resolve_model(args.prefill_config.model_loading_config.model_source),
                            seed=int(opts.get("seed", 0)))
    n_streams = int(opts.get("streams", 2))
    streams = build_requests(factory, int(opts.get("requests", 8)), Lengths.parse("32"), Lengths.parse("96"))
    bursts = build_requests(factory, int(opts.get("bursts", 6)), Lengths.parse("1000"), Lengths.parse("4"))
    rate = float(opts.get("burst_rate", 0.25))
    with EnginePair(args, disaggregated=False) as colo:
        _warm(colo.urls[0], model, streams)
        _warm(colo.urls[1], model, streams)
        colocated = _mixed(colo.urls, model, streams, bursts, n_streams, rate)
    with EnginePair(args) as pair:
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


def goodput(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """A Poisson rate sweep on colocated (two engines) and P/D; goodput at the SLOs for each rate."""
    from pdserve.bench.stats import SLO

    model = args.model_id
    slo = SLO.parse(opts.get("slo") or "ttft=3000ms,tpot=150ms")
    rates = [float(x) for x in str(opts.get("rates", "0.1,0.2,0.3,0.4")).split(",")]
    n = int(opts.get("requests", 12))
    reqs = _requests(args, opts, n, 300, 32)
    out: dict[str, Any] = {"slo": slo.__dict__, "rates": rates}

    def sweep(urls: str | list[str], prefill: str | None) -> list[dict[str, Any]]:
        points = []
        for rate in rates:
            res, wall = asyncio.run(run_load(urls, model, reqs, Load("poisson", rate), prefill_url=prefill))
            sm = summarize(res, wall, slo)
            points.append({"rate": rate, "slo_attainment": sm["slo_attainment"], "goodput": sm["goodput"],
                           "ttft_p90_ms": sm["ttft_ms"]["p90"], "tpot_p90_ms": sm["tpot_ms"]["p90"]})
        return points

    with EnginePair(args, disaggregated=False) as colo:
        _warm(colo.urls[0], model, reqs)
        out["colocated"] = sweep(colo.urls, None)
    with EnginePair(args) as pair:
        _warm(pair.urls[1], model, reqs, pair.urls[0])
        out["pd"] = sweep(pair.urls[1], pair.urls[0])
    for k in ("colocated", "pd"):
        good = [p["rate"] for p in out[k] if p["slo_attainment"] >= 0.9]
        out[f"{k}_max_rate_at_90pct"] = max(good, default=0.0)
    return out


def outside_client(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """``vllm bench serve`` and ``pdserve bench`` against the same pdserve endpoint, same workload shape
    (random prompts of 300 tokens, 32 new tokens, ignore EOS, one request at a time)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from pdserve.model.resolve import resolve_model

    n = int(opts.get("requests", 20))
    model = args.model_id
    tok = resolve_model(args.prefill_config.model_loading_config.model_source)
    reqs = _requests(args, opts, n + 3, 300, 32)
    out: dict[str, Any] = {"requests": n}
    with ServedApp(args) as app, tempfile.TemporaryDirectory() as tmp:
        _warm(app.url, model, reqs)
        cmd = [sys.executable, "-m", "pdserve.bench.vllm_bench", "--backend", "openai", "--base-url", app.url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tok, "--dataset-name", "random",
               "--random-input-len", "300", "--random-output-len", "32", "--num-prompts", str(n),
               "--max-concurrency", "1", "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
               "--save-result", "--result-dir", tmp, "--result-filename", "vllm.json",
               "--percentile-metrics", "ttft,tpot,itl,e2el"]
        _say("running vllm bench serve")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        v = json.loads((Path(tmp) / "vllm.json").read_text())
        ours = _run(app.url, model, reqs[3:], Load("concurrency", 1))
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


def conditional(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """Conditional disaggregation: the interference workload (short-prompt decode streams + bursts of
    1,000-token prompts) on colocated engines, on pdserve disaggregating everything, and on pdserve with
    ``router.local_prefill_below_tokens`` (short prompts prefilled on the decode replica)."""
    from pdserve.bench.workload import Lengths, PromptFactory, build_requests
    from pdserve.model.resolve import resolve_model

    model = args.model_id
    threshold = int(opts.get("threshold", 256))
    factory = PromptFactory(resolve_model(args.prefill_config.model_loading_config.model_source),
                            seed=int(opts.get("seed", 0)))
    streams = build_requests(factory, int(opts.get("requests", 8)), Lengths.parse("32"), Lengths.parse("96"))
    bursts = build_requests(factory, int(opts.get("bursts", 6)), Lengths.parse("1000"), Lengths.parse("4"))
    rate = float(opts.get("burst_rate", 0.25))
    out: dict[str, Any] = {"threshold": threshold}
    with EnginePair(args, disaggregated=False) as colo:
        _warm(colo.urls[0], model, streams)
        out["colocated"] = _mixed(colo.urls, model, streams, bursts, 2, rate)
    for name, below in (("pd_all", 0), ("pd_conditional", threshold)):
        a = args.model_copy(deep=True)
        a.router.local_prefill_below_tokens = below
        with ServedApp(a) as app:
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


def prefix(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """Two prefill replicas, a shared-prefix workload (4 system prompts of 512 tokens, 32 unique tokens
    each after them): round_robin vs prefix_affinity for prefill. Reports the prefill engines' prefix
    cache hit rate and TTFT."""
    import random

    from pdserve.bench.workload import BenchRequest, PromptFactory
    from pdserve.model.resolve import resolve_model

    model = args.model_id
    factory = PromptFactory(resolve_model(args.prefill_config.model_loading_config.model_source),
                            seed=int(opts.get("seed", 0)))
    prefixes = [factory.ids(512) for _ in range(4)]
    n = int(opts.get("requests", 24))
    rng = random.Random(1)
    reqs = [BenchRequest(rng.choice(prefixes) + factory.ids(32), 8) for _ in range(n)]
    out: dict[str, Any] = {}
    for policy in ("round_robin", "prefix_affinity"):
        a = args.model_copy(deep=True)
        a.prefill_config.deployment_config.num_replicas = 2
        a.router.prefill_policy = policy
        with ServedApp(a) as app:
            h0, q0 = _prefill_cache_counters(app)
            run = _run(app.url, model, reqs, Load("concurrency", 1))
            h1, q1 = _prefill_cache_counters(app)
        run["prefill_prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        out[policy] = run
    out["summary"] = {p: {"hit_rate": out[p]["prefill_prefix_cache_hit_rate"], "ttft_p50_ms": out[p]["ttft_ms"]["p50"]}
                      for p in ("round_robin", "prefix_affinity")}
    return out


def router(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """The router alone against fake engines on one core: requests/s and CPU ms per request."""
    from pdserve.bench.router_bench import measure_router

    return measure_router(seconds=float(opts.get("seconds", 10)), concurrency=int(opts.get("concurrency", 32)))


def kv_transfer(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """NIXL DRAM→DRAM bandwidth vs single-thread memcpy on this host, with pdserve's UCX settings."""
    from pdserve.bench.nixl_bench import measure_kv_transfer

    return measure_kv_transfer()


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


def overload(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
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

    with ServedApp(configured(bound)) as app:
        probe = _requests(args, opts, 6 * bound + 3, 300, 32)
        _warm(app.url, model, probe)
        cap = _run(app.url, model, probe[3:], Load("concurrency", bound))
        capacity = cap["request_throughput"]
        out["capacity_req_per_s"] = capacity
        _say(f"capacity at {bound} in flight: {capacity:.2f} req/s")
        for label, mult in (("bounded_1x", 1.0), ("bounded_2x", 2.0)):
            rate = capacity * mult
            reqs = _requests(args, {**opts, "seed": seed + int(mult)}, max(8, int(rate * seconds)), 300, 32)
            _say(f"{label}: Poisson {rate:.2f} req/s for {seconds:.0f}s")
            out[label] = _overload_phase(app.url, model, reqs, rate, seed)
    with ServedApp(configured(100_000)) as app:
        _warm(app.url, model, probe)
        rate = capacity * 2
        reqs = _requests(args, {**opts, "seed": seed + 2}, max(8, int(rate * seconds)), 300, 32)
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


def startup(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """Time-to-ready by phase, cold vs warm, one engine and the whole app (see bench/startup.py)."""
    from pdserve.bench.startup import measure_startup

    return measure_startup(args, opts)


def overload_long(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """Closed-loop clients, 1,500-1,900-token prompts, the default config (see bench/overload_long.py)."""
    from pdserve.bench.overload_long import overload_long as run

    return run(args, opts)


def cpu_env(args: PDServeArgs, opts: dict[str, Any]) -> dict[str, Any]:
    """An engine setting (tcmalloc preload, dtype) against none, paired on both cores (bench/cpu_env.py)."""
    from pdserve.bench.cpu_env import cpu_env as run

    return run(args, opts)


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
    "cpu-env": cpu_env,
    "startup": startup,
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
