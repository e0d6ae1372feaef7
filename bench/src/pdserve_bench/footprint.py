"""What the app costs a small host when nothing is asked of it, and whether its first requests are slow.

One app (the config given, default: the embedded one) is started with ``pdserve serve``. Right after it is
ready, ``requests`` (10) single streamed chat requests of ~``prompt_tokens`` (300) tokens, one after the
other: the TTFT of each (the first should be no slower than the tenth). Then the app is left alone for
``settle_s`` (5 s) and its processes' CPU time is read over two windows: ``used_s`` (25 s) just used (the
router still probes and reads the engine list every round, as it does for 30 s after a request), then
``seconds`` (60 s) idle (the router backed off: router/pool.py ``ProbeSchedule``; long enough to hold six
of the app's 10-second cycles), the share of one core each part uses (target for idle: under 5 % in all),
with the memory (PSS) by part (pdserve.footprint). Last, ``fill_prompts`` different prompts of
``fill_tokens`` (1,500) tokens, more than the engines' KV caches hold: the memory again once the caches have
filled (``cpu.kv_cache_lazy``: a KV page takes memory when first written, so an app just started is lighter
than one that has worked). ``auto`` (the default) counts them from the engines' own cache sizes (vLLM's
``cache_config_info``: blocks × block size, summed over each role's replicas, as the router balances the
prompts across them): the larger role's tokens over ``fill_tokens``, plus one; the embedded default's 16k
tokens per engine in float32 take 12. 0 prompts: not measured.

An idle app's cost is mostly timers (Ray's actors wake 100 times a second each), and what a wake-up costs
differs between hosts and between moments on one host (a virtual machine's neighbours): the same app read
4.1 and 6.5 % on one host within minutes. Beside the idle window a reference process wakes 100 times a second
(a Python loop of 10-ms sleeps) and its own share of a core is read over the same window: the app's idle in
those units (``idle_in_reference_timers``) compares across hosts and moments where the raw share does not.

Last (``floor``, on unless ``--opt floor=0``), once the app has stopped: the floor under that figure, a bare
Ray Serve instance started as ``pdserve serve`` starts its own with as many no-op replicas as the app had,
idle over the same ``seconds`` with the reference timer beside it (pdserve_bench/ray_floor.py): what any Ray
Serve app of that shape costs this host, and so what of the app's idle is pdserve's own
(``idle_above_ray_floor_core_share``).
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.footprint import measure
from pdserve_bench.plan import Plan
from pdserve_bench.reference_timer import reference_timer_share
from pdserve_bench.stats import percentile
from pdserve_bench.systems import ServedApp, _say

WORDS = ("river", "mountain", "lantern", "harvest", "copper", "meadow", "signal", "orchard", "canyon", "ember")


def _prompt(tokens: int, i: int) -> str:
    """A different prompt each time (no prefix cache answers it), about ``tokens`` tokens long."""
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] + ("," if k % 9 == 8 else "") for k in range(tokens - 20)]
    return f"Request {i}: write one sentence about these words: " + " ".join(words)


def _ttft(url: str, model: str, prompt: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line.replace(b" ", b""):
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


#: ``fill_prompts=auto`` where the engines do not say their cache size.
FILL_PROMPTS = 12
CACHE_INFO = "vllm:cache_config_info"


def fill_count(samples: dict[Any, float], fill_tokens: int) -> int | None:
    """Prompts of ``fill_tokens`` that fill every engine's KV cache (``samples``: the router's metrics with
    the engines', pdserve_bench.scrape): per role, the tokens its replicas' caches hold together; the larger
    role's over ``fill_tokens``, plus one. None where no engine says its cache size."""
    per_role: dict[str, int] = {}
    for (name, labels), _ in samples.items():
        if name != CACHE_INFO:
            continue
        d = dict(labels)
        try:
            tokens = int(d["num_gpu_blocks"]) * int(d["block_size"])
        except (KeyError, ValueError):
            continue
        role = d.get("pdserve_role", "")
        per_role[role] = per_role.get(role, 0) + tokens
    if not per_role or fill_tokens <= 0:
        return None
    return math.ceil(max(per_role.values()) / fill_tokens) + 1


def footprint(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    n = int(opts.get("requests", 10))
    tokens = int(opts.get("prompt_tokens", 300))
    settle_s = float(opts.get("settle_s", 5))
    used_s = float(opts.get("used_s", 25))
    seconds = float(opts.get("seconds", 60))
    fill_opt, fill_tokens = str(opts.get("fill_prompts", "auto")), int(opts.get("fill_tokens", 1500))
    fill_n: int | str = fill_opt if fill_opt == "auto" else int(fill_opt)
    floor = str(opts.get("floor", "1")).lower() not in ("0", "false", "no", "off")
    plan.set(requests=n, prompt_tokens=tokens, settle_s=settle_s, used_s=used_s, seconds=seconds,
             fill_prompts=fill_n, fill_tokens=fill_tokens, floor=floor)
    app = plan.system("pdserve", ServedApp(args))
    plan.phase("first requests", system="pdserve", through=f"{n} single streamed chat requests right after ready")
    plan.phase("idle", system="pdserve",
               through=f"nothing for {settle_s:g} s, then CPU time read over {used_s:g} s just used, {seconds:g} s idle")
    if fill_n:
        plan.phase("caches filled", system="pdserve",
                   through=f"{fill_n} different prompts of {fill_tokens} tokens, then the memory again")
    if floor:
        from pdserve_bench import ray_floor as rf

        planned = (args.prefill_config.num_replicas() + args.decode_config.num_replicas()
                   + args.router.num_replicas)
        plan.system("ray serve", {"argv": rf.argv(planned, seconds, args.http.host),
                                  "what": "a bare Ray Serve instance started as pdserve serve starts its own, with "
                                          "as many no-op replicas as the app has (pdserve_bench/ray_floor.py)"})
        plan.phase("ray floor", system="ray serve", through=f"after the app stopped: CPU time read over {seconds:g} s")
    if plan.dry_run:
        return plan.as_dict()
    t0 = time.monotonic()
    with app as served:
        ready_s = time.monotonic() - t0
        ttfts = []
        for i in range(n):
            ttfts.append(_ttft(served.url, args.model_id, _prompt(tokens, i)))
            _say(f"request {i + 1}: TTFT {ttfts[-1] * 1000:.0f} ms")
        time.sleep(settle_s)
        root = served.served.proc.pid  # (its own Ray instance: the whole app is under it)
        used = measure(cpu_seconds=used_s, root=root)
        fp, ref = reference_timer_share(lambda: measure(cpu_seconds=seconds, root=root))
        filled = None
        if fill_n == "auto":
            from pdserve_bench.scrape import scrape

            try:
                fill_n = fill_count(scrape(served.url, engines=True, timeout_s=30), fill_tokens) or FILL_PROMPTS
            except OSError:
                fill_n = FILL_PROMPTS
        for i in range(int(fill_n)):
            _say(f"filling the KV caches: prompt {i + 1}/{fill_n}, TTFT "
                 f"{_ttft(served.url, args.model_id, _prompt(fill_tokens, 1000 + i)) * 1000:.0f} ms")
        if fill_n:
            filled = measure(root=root)
    later = ttfts[len(ttfts) // 2:]
    steady = percentile(later, 50) if later else None
    _say("idle footprint:\n" + fp.table())
    _say(f"idle: {100 * fp.total_cpu:.1f} % of one core (just used: {100 * used.total_cpu:.1f} %), "
         f"{fp.total_pss / 2**30:.2f} GiB PSS; first TTFT "
         f"{ttfts[0] * 1000:.0f} ms, steady {steady * 1000 if steady else float('nan'):.0f} ms")
    _say(f"a reference 100-Hz timer took {100 * ref:.2f} % of a core over the idle window: the app's idle is "
         f"{fp.total_cpu / ref:.1f} such timers" if ref > 0 else "the reference timer took no measurable time")
    busiest = fp.as_dict().get("cpu_by_thread", {})
    _say("idle, busiest threads (% of a core): " + ", ".join(f"{k} {100 * v:.2f}" for k, v in busiest.items()))
    if filled is not None:
        _say("once the KV caches filled:\n" + filled.table())
    ray_floor = None
    if floor:
        k = rf.replicas_of(fp.processes)
        _say(f"the Ray Serve floor: a bare instance with {k} no-op replicas, {seconds:g} s idle")
        ray_floor = rf.measure_floor(k, seconds, args.http.host)
        _say(f"Ray Serve alone with {k} no-op replicas: {100 * ray_floor['core_share']:.1f} % of a core idle "
             f"({ray_floor['in_reference_timers'] or float('nan'):.1f} reference timers); the app "
             f"{100 * fp.total_cpu:.1f} % ({fp.total_cpu / ref if ref > 0 else float('nan'):.1f})")
    return {"ready_s": ready_s, "ttft_s": ttfts,
            "first_over_steady": (ttfts[0] / steady) if steady else None,
            "idle": fp.as_dict(), "idle_core_share": fp.total_cpu, "pss_gib": fp.total_pss / 2**30,
            "reference_timer_core_share": ref, "idle_in_reference_timers": fp.total_cpu / ref if ref > 0 else None,
            "just_used": used.as_dict(), "just_used_core_share": used.total_cpu,
            "filled": filled.as_dict() if filled is not None else None,
            "pss_filled_gib": filled.total_pss / 2**30 if filled is not None else None,
            "ray_floor": ray_floor,
            "idle_above_ray_floor_core_share": fp.total_cpu - ray_floor["core_share"] if ray_floor else None}
