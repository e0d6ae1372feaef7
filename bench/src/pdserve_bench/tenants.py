"""A flooding tenant beside a steady one, on one app: does the steady tenant keep its service?

The app (the config given, default: the embedded one) gets two tenants, their keys in the environment:
``steady`` (priority 1, no limits) and ``flood`` (priority 0, ``max_concurrent`` and ``requests_per_s``
limits). Two phases on the same running app:

1. **alone**: the steady tenant sends ``requests`` streamed requests at ``rate`` per second (~300-token
   prompts, 32 new tokens), a client that honours 429s as OpenAI's clients do;
2. **flooded**: the same, while the flooding tenant's ``flooders`` clients send ``flood_tokens``-token prompts
   (1,000) back to back, never waiting (a 429 is sent again at once).

``engine_priority=1``: every engine schedules by priority (``scheduling_policy: priority``), so the tenants'
priorities order the engines' queues too, not only the router's admission.

Figures: the steady tenant's TTFT p50/p90 and SLO attainment (TTFT within 3x and TPOT within 1.5x its
alone p50) in each phase, their ratio (target: within 10 %), the flooder's answers by status (429s
expected), and timeouts and 5xx of both (target 0).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.stats import percentile, summarize
from pdserve_bench.systems import ServedApp, _say
from pdserve_bench.workload import Lengths, PromptFactory, build_requests

STEADY_ENV, FLOOD_ENV = "BENCH_TENANT_STEADY_KEYS", "BENCH_TENANT_FLOOD_KEYS"


def with_tenants(args: PDServeArgs, flood_concurrent: int, flood_rps: float,
                 flood_prompt_tpm: int | None = None, engine_priority: bool = False) -> PDServeArgs:
    """``args`` with the two tenants; ``engine_priority``: every engine schedules by priority
    (``scheduling_policy: priority``), so each request also carries its tenant's there."""
    plain = args.model_dump(mode="json")
    if engine_priority:
        for side in ("prefill_config", "decode_config"):
            plain[side]["engine_kwargs"]["scheduling_policy"] = "priority"
    plain["router"]["tenants"] = {
        "steady": {"keys_env": STEADY_ENV, "priority": 1},
        "flood": {"keys_env": FLOOD_ENV, "priority": 0, "max_concurrent": flood_concurrent,
                  "requests_per_s": flood_rps, "prompt_tokens_per_min": flood_prompt_tpm},
    }
    return PDServeArgs.model_validate(plain)


async def _flood(url: str, model: str, key: str, prompts: list[list[int]], clients: int, stop: asyncio.Event
                 ) -> dict[str, int]:
    import aiohttp

    counts: dict[str, int] = {}
    headers = {"Authorization": f"Bearer {key}"}

    async def one(i: int) -> None:
        n = i
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                body = {"model": model, "prompt": prompts[n % len(prompts)], "max_tokens": 64, "ignore_eos": True}
                n += clients
                try:
                    async with s.post(url + "/v1/completions", json=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=120)) as r:
                        await r.read()
                        counts[str(r.status)] = counts.get(str(r.status), 0) + 1
                except asyncio.TimeoutError:
                    counts["timeout"] = counts.get("timeout", 0) + 1
                except aiohttp.ClientError:
                    counts["error"] = counts.get("error", 0) + 1
                if counts.get("429"):
                    await asyncio.sleep(0.05)  # a flooder, not a busy loop on this host's cores

    await asyncio.gather(*(one(i) for i in range(clients)))
    return counts


def _attainment(results: list[Any], ttft_s: float, tpot_s: float) -> float:
    met = [r for r in results if r.ok and r.ttft_s <= ttft_s and (r.output_tokens <= 1 or r.tpot_s <= tpot_s)]
    return len(met) / len(results) if results else 0.0


def tenants(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    n = int(opts.get("requests", 40))
    rate = float(opts.get("rate", 0.5))
    flooders = int(opts.get("flooders", 6))
    flood_concurrent = int(opts.get("flood_concurrent", 2))
    flood_rps = float(opts.get("flood_rps", 1.0))
    flood_tpm = int(opts["flood_prompt_tpm"]) if opts.get("flood_prompt_tpm") else None
    flood_tokens = int(opts.get("flood_tokens", 1000))
    engine_priority = str(opts.get("engine_priority", "0")).lower() in ("1", "true", "yes")
    model = args.model_id
    served_args = with_tenants(args, flood_concurrent, flood_rps, flood_tpm, engine_priority)
    factory = PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0)))
    # Fresh prompts in each phase (and for the warm-up): a repeated prompt is found in the prefix cache.
    steady = plan.workload("steady", build_requests(factory, n, Lengths.parse("300"), Lengths.parse("32")))
    steady_flooded = plan.workload("steady_flooded",
                                   build_requests(factory, n, Lengths.parse("300"), Lengths.parse("32")))
    warm = build_requests(factory, 3, Lengths.parse("300"), Lengths.parse("32"))
    flood_prompts = [factory.ids(flood_tokens) for _ in range(16)]
    limits = {"max_concurrent": flood_concurrent, "requests_per_s": flood_rps, "prompt_tokens_per_min": flood_tpm}
    plan.set(requests=n, rate=rate, flooders=flooders, flood_tokens=flood_tokens, engine_priority=engine_priority,
             flood_limits=limits)
    app = plan.system("pdserve", ServedApp(served_args))
    plan.phase("alone", system="pdserve", load=Load("rate", rate), workload="steady", requests=n,
               through="the steady tenant alone")
    plan.phase("flooded", system="pdserve", load=Load("rate", rate), workload="steady_flooded", requests=n,
               through=f"the steady tenant while {flooders} clients of the flooding tenant send {flood_tokens:,}-token "
               "prompts")
    if plan.dry_run:
        return plan.as_dict()
    keys = {"steady": secrets.token_urlsafe(16), "flood": secrets.token_urlsafe(16)}
    os.environ[STEADY_ENV], os.environ[FLOOD_ENV] = keys["steady"], keys["flood"]
    steady_auth = {"Authorization": f"Bearer {keys['steady']}"}
    with app as served:
        url = served.url
        _say("warm-up")
        asyncio.run(run_load(url, model, warm, Load("concurrency", 1), auth=lambda u: steady_auth,
                             retry_refused=True, progress=False))
        _say(f"alone: {n} steady requests at {rate:g}/s")
        alone, wall_a = asyncio.run(run_load(url, model, steady, Load("rate", rate), auth=lambda u: steady_auth,
                                             retry_refused=True))

        async def flooded() -> tuple[list[Any], float, dict[str, int]]:
            stop = asyncio.Event()
            flood = asyncio.create_task(_flood(url, model, keys["flood"], flood_prompts, flooders, stop))
            await asyncio.sleep(2)  # the flood is on before the steady tenant starts
            res, wall = await run_load(url, model, steady_flooded, Load("rate", rate), auth=lambda u: steady_auth,
                                       retry_refused=True)
            stop.set()
            return res, wall, await flood

        _say(f"flooded: the same, beside {flooders} flooding clients")
        under, wall_f, flood_counts = asyncio.run(flooded())
    a, f = summarize(alone, wall_a), summarize(under, wall_f)
    ttft_slo = 3 * percentile([r.ttft_s for r in alone if r.ok], 50)
    tpot_slo = 1.5 * percentile([r.tpot_s for r in alone if r.ok and r.output_tokens > 1], 50)
    att_a, att_f = _attainment(alone, ttft_slo, tpot_slo), _attainment(under, ttft_slo, tpot_slo)
    out = {
        "steady_alone": {"ttft_ms": a["ttft_ms"], "tpot_ms": a["tpot_ms"], "attainment": att_a, "failed": a["failed"]},
        "steady_flooded": {"ttft_ms": f["ttft_ms"], "tpot_ms": f["tpot_ms"], "attainment": att_f,
                           "failed": f["failed"], "retries": sum(r.retries for r in under)},
        "ttft_p90_ratio": f["ttft_ms"]["p90"] / a["ttft_ms"]["p90"] if a["ttft_ms"]["p90"] else None,
        "attainment_ratio": att_f / att_a if att_a else None,
        "slo": {"ttft_ms": ttft_slo * 1000, "tpot_ms": tpot_slo * 1000},
        "flood_answers": flood_counts,
        "statuses_5xx": sum(v for k, v in flood_counts.items() if k.isdigit() and int(k) >= 500)
        + sum(1 for r in alone + under if r.status >= 500),
        "timeouts": flood_counts.get("timeout", 0) + sum(1 for r in alone + under if "imeout" in r.error),
    }
    _say(f"steady TTFT p90 alone {a['ttft_ms']['p90']:.0f} ms, flooded {f['ttft_ms']['p90']:.0f} ms "
         f"({out['ttft_p90_ratio']:.2f}x); attainment {att_a:.0%} -> {att_f:.0%}; flood answers {flood_counts}")
    return out
