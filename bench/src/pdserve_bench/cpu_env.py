"""``--scenario cpu-env``: does an engine setting make a CPU engine faster? Paired, side by side.

Two plain engines run at once, one per core, with identical workloads sent to both at the same time: one
with the setting (the variant), one without (the baseline). Then they swap cores and run again, so a
difference between the two cores cancels out. Noise from the rest of the machine hits both alike.

Each engine gets ``prompts`` prompts of ``prompt_len`` tokens one after the other (1 new token: its
prompt speed), then ``streams`` requests with a 16-token prompt and ``out`` new tokens (its time per
output token). The figure is variant / baseline for each.

Variants (``--opt variant=NAME``):

* ``tcmalloc``: ``LD_PRELOAD`` of gperftools' tcmalloc (Debian's libtcmalloc-minimal4), which vLLM's CPU
  worker asks for at start ("libtcmalloc is not found in LD_PRELOAD").
* ``float32`` / ``bfloat16``: that dtype against the other (what ``cpu.dtype: auto`` decides from a
  single matmul; this checks the decision on the whole engine).
* ``shared-weights``: ``cpu.share_weights: mapped`` (the weights mapped from the weight cache and computed with
  ``F.linear``) against vLLM's own oneDNN-packed copy.

``--opt concurrency=N`` runs the output-speed streams N at a time (decode batches of N).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench.overload_long import host_cpu
from pdserve_bench.systems import EnginePair, _say

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _variant(name: str, args: PDServeArgs) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """(engine env of the variant, engine_kwargs of the variant, engine_kwargs of the baseline)."""
    dtype = args.prefill_config.engine_kwargs.get("dtype")
    if name == "tcmalloc":
        import os

        if not os.path.exists(TCMALLOC):
            raise ConfigError(f"{TCMALLOC} is missing: apt-get install libtcmalloc-minimal4")
        return {"LD_PRELOAD": TCMALLOC}, {}, {}
    if name == "shared-weights":
        return {}, {}, {}  # (cpu_env turns the setting on and empties the baseline's variable)
    if name in ("float32", "bfloat16"):
        other = "bfloat16" if name == "float32" else "float32"
        return {}, {"dtype": name}, {"dtype": other}
    raise ConfigError(f"unknown cpu-env variant {name!r}: tcmalloc, float32, bfloat16 or shared-weights "
                      f"(dtype now {dtype})")


async def _drive(url: str, prompt_len: int, prompts: int, streams: int, out: int, seed: int,
                 concurrency: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def post(body: dict[str, Any]) -> float:
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.perf_counter() - t

        # Warm-up (first requests pay one-time costs).
        await post({"prompt": [rng.randrange(200, 20000) for _ in range(64)], "max_tokens": 2})
        t_prompt = 0.0
        for _ in range(prompts):
            t_prompt += await post({"prompt": [rng.randrange(200, 20000) for _ in range(prompt_len)],
                                    "max_tokens": 1})
        t_out = 0.0
        for _ in range(streams):  # each stream's time per token, ``concurrency`` streams in one batch
            bodies = [{"prompt": [rng.randrange(200, 20000) for _ in range(16)], "max_tokens": out,
                       "ignore_eos": True} for _ in range(concurrency)]
            t_out += sum(await asyncio.gather(*(post(b) for b in bodies))) / concurrency
    return {"prompt_tokens_per_s": prompts * prompt_len / t_prompt, "tpot_ms": 1000 * t_out / (streams * out)}


def cpu_env(args: PDServeArgs, opts: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """The scenario; with a dry-run ``plan`` (:class:`pdserve_bench.plan.Plan`), returns the plan without
    starting anything."""
    from pdserve_bench.plan import Plan

    plan = plan or Plan("cpu-env")
    name = str(opts.get("variant", "tcmalloc"))
    prompt_len, prompts = int(opts.get("prompt_len", 1500)), int(opts.get("prompts", 6))
    streams, out = int(opts.get("streams", 4)), int(opts.get("out", 64))
    concurrency = int(opts.get("concurrency", 1))
    env, kw_variant, kw_base = _variant(name, args)
    env_base: dict[str, str] = {}
    if name == "shared-weights":
        from pdserve.settings import SHARED_WEIGHTS_ENV

        env_base = {SHARED_WEIGHTS_ENV: ""}  # empty: the engine keeps vLLM's own weights
    plan.set(variant=name, variant_env=env, variant_engine_kwargs=kw_variant, baseline_engine_kwargs=kw_base)
    plan.workload("prompt speed", requests=prompts, prompt_tokens=prompt_len, max_tokens=1,
                  ids="random, the same seed on both engines")
    plan.workload("output speed", requests=streams * concurrency, prompt_tokens=16, max_tokens=out, ignore_eos=True,
                  concurrency=concurrency)
    pairs = []
    for swap in (False, True):
        a = args.model_copy(deep=True)
        if name == "shared-weights":
            a.cpu.share_weights = "mapped"
        variants = [(env, kw_variant), (env_base, kw_base)]
        if swap:
            variants.reverse()
        label = f"variant on core {1 if swap else 0}"
        pairs.append(plan.system(label, EnginePair(a, disaggregated=False, variants=variants)))
        for w in ("prompt speed", "output speed"):
            plan.phase(f"{label}: {w}", system=label, load="concurrency:1 on each engine, both at once",
                       workload=w)
    if plan.dry_run:
        return plan.as_dict()
    rounds = []
    for swap, system in zip((False, True), pairs):
        with system as pair:
            got = asyncio.run(_gather(pair.urls, prompt_len, prompts, streams, out, concurrency))
        v, b = (got[1], got[0]) if swap else (got[0], got[1])
        rounds.append({"variant_core": 1 if swap else 0, "variant": v, "baseline": b})
        _say(f"{name} on core {1 if swap else 0}: prompt {v['prompt_tokens_per_s']:.0f} vs "
             f"{b['prompt_tokens_per_s']:.0f} tokens/s, TPOT {v['tpot_ms']:.1f} vs {b['tpot_ms']:.1f} ms")
    prompt_ratio = sum(r["variant"]["prompt_tokens_per_s"] / r["baseline"]["prompt_tokens_per_s"]
                       for r in rounds) / len(rounds)
    tpot_ratio = sum(r["variant"]["tpot_ms"] / r["baseline"]["tpot_ms"] for r in rounds) / len(rounds)
    return {"variant": name, "host_cpu": host_cpu(), "prompt_len": prompt_len, "prompts": prompts,
            "streams": streams, "out": out, "concurrency": concurrency, "rounds": rounds,
            "summary": {"prompt_speed_variant_over_baseline": prompt_ratio,
                        "tpot_variant_over_baseline": tpot_ratio}}


async def _gather(urls: list[str], prompt_len: int, prompts: int, streams: int, out: int,
                  concurrency: int = 1) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(_drive(u, prompt_len, prompts, streams, out, seed=7, concurrency=concurrency)
                                       for u in urls)))
