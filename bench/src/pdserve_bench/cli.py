"""``pdserve bench``: drive an endpoint, or run a named scenario; JSON results and PNG plots."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def _strip(d: Any) -> Any:
    """The summary without per-request rows (kept in the JSON file, not printed)."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k != "results"}
    return d


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every system a scenario started is stopped on the way out (its
    ``with`` block), not left running without its parent."""
    import signal
    import threading

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def run_bench(ns: Any) -> int:
    from pdserve.config.loader import load_config
    from pdserve_bench.stats import SLO, summarize

    _stop_on_sigterm()
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = load_config(ns.config).args
    opts = {"requests": ns.requests, "seed": ns.seed, "load": ns.load, "prompt_len": ns.prompt_len,
            "output_len": ns.output_len, "slo": ns.slo, "rates": ns.rates, "threshold": ns.threshold}
    opts = {k: v for k, v in opts.items() if v is not None}
    for item in getattr(ns, "opt", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"pdserve bench: --opt {item!r}: use KEY=VALUE", file=sys.stderr)
            return 2
        opts[key.strip().replace("-", "_")] = value.strip()
    if getattr(ns, "dry_run", False):
        if not ns.scenario:
            print("pdserve bench: --dry-run needs --scenario NAME", file=sys.stderr)
            return 2
        from pdserve_bench.scenarios import run_scenario

        plan = run_scenario(ns.scenario, args, opts, dry_run=True)
        path = out_dir / f"{ns.scenario}-plan.json"
        path.write_text(json.dumps(plan, indent=2, default=str))
        print(json.dumps(plan, indent=2, default=str))
        print(f"plan: {path} (nothing was started)", file=sys.stderr)
        return 0
    if ns.scenario:
        from pdserve_bench.scenarios import run_scenario

        result = run_scenario(ns.scenario, args, opts)
        name = ns.scenario
    else:
        from pdserve.model.resolve import resolve_model
        from pdserve_bench.runner import Load, run_load
        from pdserve_bench.workload import Lengths, PromptFactory, build_requests

        if not ns.url:
            print("pdserve bench: give --url ENDPOINT or --scenario NAME", file=sys.stderr)
            return 2
        model = ns.model or args.model_id
        tok_dir = ns.tokenizer or resolve_model(args.prefill_config.model_loading_config.model_source)
        factory = PromptFactory(tok_dir, seed=ns.seed or 0)
        reqs = build_requests(factory, ns.requests or 100, Lengths.parse(ns.prompt_len or "256"),
                              Lengths.parse(ns.output_len or "32"), shared_prefix=ns.shared_prefix)
        slo = SLO.parse(ns.slo)
        loads = [Load.parse(x) for x in (ns.load or "concurrency:4").split(";")]
        runs = {}
        from pdserve.settings import settings

        key = getattr(ns, "api_key", None) or settings().client_api_key
        auth = (lambda url: {"Authorization": f"Bearer {key}"}) if key else None
        for load in loads:
            results, wall = asyncio.run(run_load(ns.url, model, reqs, load, seed=ns.seed or 0, auth=auth))
            s = summarize(results, wall, slo)
            s["results"] = [r.as_dict() for r in results]
            runs[load.label()] = s
        result = {"url": ns.url, "model": model, "runs": runs}
        if slo.any():
            good = [(k, v["request_throughput"]) for k, v in runs.items() if v["slo_attainment"] >= 0.9]
            result["max_rate_at_90pct_slo"] = max((r for _, r in good), default=0.0)
        name = "endpoint"
        from pdserve_bench.plots import latency_cdfs
        from pdserve_bench.stats import table

        print(table(runs), file=sys.stderr)

        latency_cdfs(runs, out_dir / f"{name}-cdf.png", f"latency CDFs: {ns.url}")
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    _plot_scenario(name, result, out_dir)
    print(json.dumps(_strip(result), indent=2, default=float))
    print(f"results: {path}", file=sys.stderr)
    return 0


def _plot_scenario(name: str, result: dict[str, Any], out_dir: Path) -> None:
    from pdserve_bench.plots import latency_cdfs

    if name == "overhead":
        latency_cdfs({"bare handoff": result["bare_handoff"], "pdserve": result["pdserve"]},
                     out_dir / "overhead-cdf.png", "pdserve endpoint vs bare two-call handoff")
    elif name == "interference":
        from pdserve_bench.plots import itl_cdf

        itl_cdf({k: [x * 1000 for r in result[k]["streams"]["results"] for x in r["itl_s"]]
                 for k in ("colocated", "pd")}, out_dir / "interference-itl.png",
                "decode streams under bursts of 1,000-token prompts")
    elif name == "goodput":
        from pdserve_bench.goodput import plot

        plot(result, out_dir)
    elif name == "conditional":
        from pdserve_bench.plots import itl_cdf

        itl_cdf({k: [x * 1000 for r in result[k]["streams"]["results"] for x in r["itl_s"]]
                 for k in ("colocated", "pd_all", "pd_conditional")}, out_dir / "conditional-itl.png",
                f"short-prompt streams under long-prompt bursts (threshold {result['threshold']})")
    elif name == "overload":
        latency_cdfs({k: result[k] for k in ("bounded_1x", "bounded_2x", "unbounded_2x")},
                     out_dir / "overload-cdf.png",
                     f"admitted requests at 1x and 2x capacity, bound {result['bound_per_engine']} per engine")
    elif name == "overload-long":
        from pdserve_bench.overload_long import plot

        plot(result, out_dir / "overload-long.png")
    elif name == "handoff":
        latency_cdfs({"colocated": result["colocated"], "P/D": result["pd"]},
                     out_dir / "handoff-cdf.png", "single requests: P/D handoff vs colocated")
    elif name == "startup":
        from pdserve_bench.startup import plot_startup

        plot_startup(result, out_dir / "startup.png")
    elif name == "multiturn":
        from pdserve_bench.multiturn_report import plot as plot_multiturn

        plot_multiturn(result, out_dir)
    elif name == "vs-ray-serve-llm":
        from pdserve_bench.vs_ray_report import plot

        plot(result, out_dir / "vs-ray-serve-llm.png")
