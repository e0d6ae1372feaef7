"""``--scenario prefix``: the prefill policies on two prefill replicas and shared prefixes; the prefill engines'
prefix cache hit rate against the oracle's, and TTFT."""

from __future__ import annotations

from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.scenario_load import ONE, measure, prompt_factory
from pdserve_bench.systems import ServedApp


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
    factory = prompt_factory(args, opts, plan)
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
            run = measure(app.url, model, reqs, ONE)
            h1, q1 = _prefill_cache_counters(app)
        run["prefill_prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        out[policy] = run
    oracle = oracle_hit_rate([r.prompt_ids for r in reqs], block=int(opts.get("block_size", 16)))
    out["oracle_hit_rate"] = oracle
    out["summary"] = {p: {"hit_rate": out[p]["prefill_prefix_cache_hit_rate"],
                          "of_oracle": out[p]["prefill_prefix_cache_hit_rate"] / oracle if oracle else None,
                          "ttft_p50_ms": out[p]["ttft_ms"]["p50"]} for p in policies}
    return out
