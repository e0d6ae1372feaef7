"""``--scenario outside-client``: ``vllm bench serve`` and ``pdserve bench`` against the same pdserve endpoint,
the same workload shape: whether an outside client reads the same figures."""

from __future__ import annotations

from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.scenario_load import ONE, WARMUP, build_prompts, measure, warm_up
from pdserve_bench.systems import ServedApp, _say


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
    reqs = plan.workload("prompts", build_prompts(args, opts, plan, n + WARMUP, 300, 32), warmup=WARMUP)
    tok = plan.tokenizer(args) or model_path(args)
    served = plan.system("pdserve", ServedApp(args))
    plan.phase("vllm bench serve", system="pdserve", load=ONE, requests=n,
               argv=_vllm_bench_argv("<pdserve endpoint>", model, tok, n, "<temporary directory>"))
    plan.phase("pdserve bench", system="pdserve", load=ONE, workload="prompts")
    if plan.dry_run:
        return plan.as_dict()
    out: dict[str, Any] = {"requests": n}
    with served as app, tempfile.TemporaryDirectory() as tmp:
        warm_up(app.url, model, reqs)
        cmd = _vllm_bench_argv(app.url, model, tok, n, tmp)
        _say("running vllm bench serve")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        v = json.loads((Path(tmp) / "vllm.json").read_text())
        ours = measure(app.url, model, reqs[WARMUP:], ONE)
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
