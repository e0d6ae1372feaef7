"""One request at a time: what pdserve's endpoint adds to the bare two-call handoff (``overhead``), its time
to first token against one colocated engine (``ttft``), and the handoff stall of P/D against colocated
engines (``handoff``)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.runner import run_load
from pdserve_bench.scenario_load import ONE, WARMUP, build_prompts, measure, warm_up
from pdserve_bench.stats import percentile, summarize
from pdserve_bench.systems import EnginePair, ServedApp, _say


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
    reqs = plan.workload("prompts", build_prompts(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
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
        warm_up(app.url, model, reqs)
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
    work = {size: plan.workload(f"{size}-token prompts", build_prompts(args, {**opts, "prompt_len": size}, plan,
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
    reqs = plan.workload("prompts", build_prompts(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
    colocated_pair = plan.system("colocated", EnginePair(args, disaggregated=False))
    pd_pair = plan.system("pd", EnginePair(args))
    plan.phase("colocated", system="colocated", load=ONE, workload="prompts", to="engine0")
    plan.phase("pd", system="pd", load=ONE, workload="prompts", to="prefill, then decode (bare handoff)")
    if plan.dry_run:
        return plan.as_dict()
    with colocated_pair as colo:
        warm_up(colo.urls[0], model, reqs)
        colocated = measure(colo.urls[0], model, reqs[WARMUP:], ONE)
    with pd_pair as pair:
        warm_up(pair.urls[1], model, reqs, pair.urls[0])
        pd = measure(pair.urls[1], model, reqs[WARMUP:], ONE, prefill_url=pair.urls[0])
    return {"colocated": colocated, "pd": pd,
            "ratio": {f"e2e_{p}": pd["e2e_ms"][p] / colocated["e2e_ms"][p] for p in ("p50", "p90", "p99")}}
