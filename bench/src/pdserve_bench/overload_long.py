"""``--scenario overload-long``: closed-loop clients sending long prompts at the default endpoint.

Each of N clients sends a streaming request (a 1,500-1,900-token prompt, ``out`` new tokens), waits for
the answer, and sends the next; a refused request (429) makes that client wait its ``Retry-After`` first,
as a well-behaved client does. Every phase runs for ``seconds``; then the clients stop sending and the
requests in flight finish (or time out at ``timeout_s``, which the figures count).

What it reports per phase (clients x output tokens), against the targets of admission by work:

* client timeouts and 5xx answers (target 0);
* how fast refusals come (target: every one within 100 ms) and whether each has Retry-After;
* the admitted requests' end-to-end p99 against ``router.max_queue_wait_s`` + the service time of one
  such request on the idle system (measured first);
* admitted prompt tokens per second against the capacity the router measured on its prefill engines
  during the phase (the mean of its measured rate, sampled once a second; target >= 90 %), and how much
  of the time an admitted prompt was waiting for prefill (1.0: admission never let it run dry);
* where prompts ran (P/D, or locally on decode and why), refusals by cause, and KV leases lost.

``--opt clients=6,12 --opt outs=2,64 --opt seconds=180 --opt timeout_s=300 --opt prompt_len=uniform:1500-1900``
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.config.schema import PDServeArgs
from pdserve_bench.client import Result, stream_completion
from pdserve_bench.runner import Load
from pdserve_bench.scrape import delta, scrape
from pdserve_bench.stats import percentile
from pdserve_bench.systems import ServedApp, _say
from pdserve_bench.workload import BenchRequest, Lengths, PromptFactory, request_body


@dataclass
class Sent:
    result: Result
    end_s: float


def _ints(text: Any) -> list[int]:
    return [int(x) for x in str(text).replace(";", ",").split(",") if x.strip()]


def _gc_pauses(before: dict[Any, float], after: dict[Any, float]) -> dict[str, float]:
    """The router's garbage-collector pauses in a phase: how many, their total, and how many over 50 ms."""
    name = "pdserve_router_gc_pause_seconds"
    count = sum(delta(before, after, name + "_count", "generation").values())
    return {"count": count, "total_s": sum(delta(before, after, name + "_sum", "generation").values()),
            "over_50ms": count - delta(before, after, name + "_bucket", "le").get("0.05", 0.0)}


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/pdserve/status", timeout=10) as r:
        return dict(json.load(r))


def host_cpu() -> str:
    """The CPU model and its widest matrix ISA, for every figure's label."""
    from pdserve.engine.cpu_host import cpu_isa

    isa = cpu_isa()
    return f"{isa['model'] or 'unknown CPU'}, {isa['label']}"


async def _one(url: str, model: str, factory: PromptFactory, prompt_len: Lengths, out: int,
               timeout_s: float) -> Result:
    req = BenchRequest(factory.ids(prompt_len.sample(factory.rng)), out)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        return await stream_completion(s, url + "/v1/completions", request_body(model, req), len(req.prompt_ids))


async def _phase(url: str, model: str, factory: PromptFactory, prompt_len: Lengths, out: int, clients: int,
                 seconds: float, timeout_s: float, samples: list[dict[str, Any]] | None = None
                 ) -> tuple[list[Sent], float]:
    sent: list[Sent] = []
    samples = [] if samples is None else samples
    t0 = time.perf_counter()
    deadline = t0 + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async def client() -> None:
            while time.perf_counter() < deadline:
                req = BenchRequest(factory.ids(prompt_len.sample(factory.rng)), out)
                r = await stream_completion(s, url + "/v1/completions", request_body(model, req),
                                            len(req.prompt_ids))
                sent.append(Sent(r, time.perf_counter() - t0))
                if r.status == 429:
                    wait = r.retry_wait_s
                    await asyncio.sleep(max(0.0, min(wait, deadline - time.perf_counter())))
                elif not r.ok:
                    await asyncio.sleep(1.0)

        await asyncio.gather(*(client() for _ in range(clients)), _sample(url, deadline, t0, samples))
    return sent, time.perf_counter() - t0


async def _sample(url: str, deadline: float, t0: float, out: list[dict[str, Any]]) -> None:
    """The router's view of each engine once a second: queue, estimated wait, admission's rate."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.perf_counter() < deadline:
            try:
                async with s.get(url + "/pdserve/status") as r:
                    engines = (await r.json()).get("engines", [])
                out.append({"t": time.perf_counter() - t0, "engines": [
                    {k: e.get(k) for k in ("role", "queued_prompts", "queued_prompt_tokens", "est_wait_s",
                                           "prompt_tokens_per_s", "measured_prompt_tokens_per_s", "streams",
                                           "pending_pd", "tpot_s")}
                    for e in engines]})
            except (aiohttp.ClientError, OSError, ValueError):
                pass
            await asyncio.sleep(1.0)


def phase_capacity(samples: list[dict[str, Any]], since_s: float, until_s: float) -> float | None:
    """The prefill engines' capacity over a phase's steady window: the mean of the router's measured prompt
    tokens per busy second, sampled once a second (the sum over prefill engines at each sample). One
    snapshot at the phase's end moved with the host by ±10 % against the phase's own mean."""
    per_sample = []
    for x in samples:
        if since_s < x.get("t", 0.0) <= until_s:
            rates = [e.get("measured_prompt_tokens_per_s") for e in x.get("engines", []) if e.get("role") == "prefill"]
            if rates and all(r for r in rates):
                per_sample.append(sum(rates))
    return sum(per_sample) / len(per_sample) if per_sample else None


def prefill_occupancy(sent: list[Sent], since_s: float, until_s: float) -> float:
    """Share of the window during which at least one admitted request was waiting for its first token
    (queued for or in its prefill): 1.0 means the prefill side never ran out of admitted work."""
    spans = sorted((max(since_s, s.end_s - s.result.e2e_s), min(until_s, s.end_s - s.result.e2e_s + s.result.ttft_s))
                   for s in sent if s.result.ok)
    covered, start, end = 0.0, None, None
    for a, b in spans:
        if b <= a:
            continue
        if end is None or a > end:
            if end is not None:
                covered += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        covered += end - start
    return covered / max(until_s - since_s, 1e-9)


def _summary(sent: list[Sent], wall: float, seconds: float, bound_s: float, capacity_tps: float | None
             ) -> dict[str, Any]:
    rs = [s.result for s in sent]
    refused = [r for r in rs if r.status == 429]
    ok = [r for r in rs if r.ok]
    refusal_ms = [r.e2e_s * 1000 for r in refused]
    timeouts = [r for r in rs if "Timeout" in r.error]
    e2e = [r.e2e_s for r in ok]
    # Throughput in the steady state: prompt tokens of admitted requests that finished after the first
    # sixth of the sending window (the queue filling up) and before its end (the requests still in flight
    # then are partly computed and would be missed by a count of finished requests).
    warm = seconds / 6
    done_in = [s.result for s in sent if s.result.ok and warm < s.end_s <= seconds]
    tps = sum(r.prompt_tokens for r in done_in) / (seconds - warm)
    p99 = percentile(e2e, 99) if e2e else 0.0
    return {
        "sent": len(rs), "ok": len(ok), "refused_429": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.retry_after),
        "refusal_ms": {"p50": percentile(refusal_ms, 50), "p99": percentile(refusal_ms, 99),
                       "max": max(refusal_ms, default=0.0)} if refused else None,
        "refused_over_100ms": sum(1 for x in refusal_ms if x > 100),
        "client_timeouts": len(timeouts),
        "http_5xx": sum(1 for r in rs if r.status >= 500),
        "other_errors": [r.error for r in rs if not r.ok and r.status not in (429,) and r.status < 500
                         and "Timeout" not in r.error][:5],
        "e2e_ms": {"p50": percentile(e2e, 50) * 1000, "p99": p99 * 1000} if e2e else None,
        "ttft_ms": {"p50": percentile([r.ttft_s for r in ok], 50) * 1000,
                    "p99": percentile([r.ttft_s for r in ok], 99) * 1000} if ok else None,
        "bound_ms": bound_s * 1000, "p99_within_bound": bool(ok) and p99 <= bound_s,
        "admitted_prompt_tokens_per_s": tps,
        "capacity_prompt_tokens_per_s": capacity_tps,
        "prefill_occupancy": prefill_occupancy(sent, warm, seconds),
        "throughput_over_capacity": tps / capacity_tps if capacity_tps else None,
        "wall_s": wall,
        "results": [{**s.result.as_dict(), "end_s": s.end_s} for s in sent],
    }


def overload_long(args: PDServeArgs, opts: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """Closed-loop clients with 1,500-1,900-token prompts against the default endpoint (admission by work).
    With a dry-run ``plan`` (:class:`pdserve_bench.plan.Plan`), returns the plan without starting anything."""
    from pdserve_bench.plan import Plan

    plan = plan or Plan("overload-long")
    model = args.model_id
    clients_list = _ints(opts.get("clients", "6,12"))
    outs = _ints(opts.get("outs", "2,64"))
    seconds = float(opts.get("seconds", 180))
    timeout_s = float(opts.get("timeout_s", 300))
    lengths = str(opts.get("prompt_len", "uniform:1500-1900"))
    prompt_len = Lengths.parse(lengths)
    factory = PromptFactory(plan.tokenizer(args), seed=int(opts.get("seed", 0)))
    plan.set(clients=clients_list, outs=outs, seconds=seconds, timeout_s=timeout_s,
             max_queue_wait_s=args.router.max_queue_wait_s)
    for n_out in outs:
        plan.workload(f"{n_out} new tokens", prompt_len=lengths, max_tokens=n_out, stream=True,
                      built="one request at a time, as each client sends")
    served = plan.system("pdserve", ServedApp(args))
    for n_out in outs:
        plan.phase(f"idle service time, {n_out} new tokens", system="pdserve", load=Load.parse("concurrency:1"),
                   workload=f"{n_out} new tokens", requests=2)
    for n in clients_list:
        for n_out in outs:
            plan.phase(f"{n}_clients_{n_out}_tokens", system="pdserve", load=f"closed loop, {n} clients",
                       workload=f"{n_out} new tokens", seconds=seconds,
                       on_429="the client waits its Retry-After", samples="/pdserve/status once a second")
    if plan.dry_run:
        return plan.as_dict()
    out: dict[str, Any] = {"host_cpu": host_cpu(), "clients": clients_list, "outs": outs, "seconds": seconds,
                           "timeout_s": timeout_s, "max_queue_wait_s": args.router.max_queue_wait_s,
                           "phases": {}}
    with served as app:
        st = _status(app.url)
        out["engines_at_start"] = [{k: e.get(k) for k in ("role", "prompt_tokens_per_s")} for e in st["engines"]]
        service, service_ttft = _idle_service(app.url, model, factory, prompt_len, outs, timeout_s)
        out["service_s"] = service
        out["service_ttft_s"] = service_ttft
        for n in clients_list:
            for n_out in outs:
                label = f"{n}_clients_{n_out}_tokens"
                _say(f"{label}: {seconds:.0f}s")
                out["phases"][label] = _measured_phase(app.url, model, factory, prompt_len, n_out, n, seconds,
                                                       timeout_s, args.router.max_queue_wait_s, service[n_out],
                                                       service_ttft[n_out])
    return out


def _idle_service(url: str, model: str, factory: PromptFactory, prompt_len: Lengths, outs: list[int],
                  timeout_s: float) -> tuple[dict[int, float], dict[int, float]]:
    """One request of each size on the idle system, twice: its own service time and TTFT (the best of two;
    a first request before them pays one-time costs)."""
    asyncio.run(_one(url, model, factory, prompt_len, 2, timeout_s))
    service: dict[int, float] = {}
    service_ttft: dict[int, float] = {}
    for n_out in outs:
        done = [r for r in (asyncio.run(_one(url, model, factory, prompt_len, n_out, timeout_s))
                            for _ in range(2)) if r.ok]
        service[n_out] = min((r.e2e_s for r in done), default=0.0)
        service_ttft[n_out] = min((r.ttft_s for r in done), default=0.0)
        _say(f"idle service time, {n_out} new tokens: {service[n_out]:.2f}s (TTFT {service_ttft[n_out]:.2f}s)")
    return service, service_ttft


def _measured_phase(url: str, model: str, factory: PromptFactory, prompt_len: Lengths, n_out: int, clients: int,
                    seconds: float, timeout_s: float, max_wait_s: float, service_s: float,
                    service_ttft_s: float) -> dict[str, Any]:
    """``clients`` closed-loop clients for ``seconds``: the phase's figures against its bounds (the router's
    ``max_queue_wait_s`` over the idle service time), with the router's counters read before and after."""
    before = scrape(url)
    samples: list[dict[str, Any]] = []
    sent, wall = asyncio.run(_phase(url, model, factory, prompt_len, n_out, clients, seconds, timeout_s, samples))
    after = scrape(url)
    engines = _status(url)["engines"]
    at_end = sum(e.get("measured_prompt_tokens_per_s") or e.get("prompt_tokens_per_s") or 0.0
                 for e in engines if e["role"] == "prefill") or None
    cap = phase_capacity(samples, seconds / 6, seconds) or at_end
    s = _summary(sent, wall, seconds, max_wait_s + service_s, cap)
    s["capacity_at_end_prompt_tokens_per_s"] = at_end
    ttft_bound = max_wait_s + service_ttft_s
    s["ttft_bound_ms"] = ttft_bound * 1000
    s["ttft_p99_within_bound"] = bool(s["ttft_ms"]) and s["ttft_ms"]["p99"] <= ttft_bound * 1000
    s["decisions"] = delta(before, after, "pdserve_pd_decisions_total", "decision,reason")
    s["refused_by_cause"] = delta(before, after, "pdserve_admission_refused_total", "cause")
    lease = delta(before, after, "pdserve_kv_lease_checks_total", "outcome")
    s["kv_lease_checks"] = lease
    s["kv_lease_lost"] = lease.get("expired", 0.0) + lease.get("unknown", 0.0)
    s["router_gc"] = _gc_pauses(before, after)
    s["engines"] = [{k: e.get(k) for k in ("role", "prompt_tokens_per_s", "measured_prompt_tokens_per_s", "tpot_s")}
                    for e in engines]
    s["router_samples"] = samples
    _say(f"  ok {s['ok']}, 429 {s['refused_429']} (over 100 ms: {s['refused_over_100ms']}), "
         f"router GC pauses over 50 ms {s['router_gc']['over_50ms']:.0f}, "
         f"timeouts {s['client_timeouts']}, 5xx {s['http_5xx']}, e2e p99 "
         f"{(s['e2e_ms'] or {}).get('p99', 0):.0f} ms (bound {s['bound_ms']:.0f}), "
         f"{s['admitted_prompt_tokens_per_s']:.0f} prompt tok/s of {cap or 0:.0f} measured "
         f"(phase mean; {at_end or 0:.0f} at its end), prefill occupied "
         f"{100 * s['prefill_occupancy']:.0f} % of the time")
    return s


def plot(result: dict[str, Any], path: Any) -> Any:
    """Per phase: each request's end-to-end time against when it was sent; refusals marked at the bottom."""
    from pdserve_bench.plots import _plt, _save

    plt = _plt()
    phases = result["phases"]
    fig, axes = plt.subplots(1, len(phases), figsize=(4.2 * len(phases), 3.6), sharey=True, squeeze=False)
    for ax, (label, ph) in zip(axes[0], phases.items()):
        ok = [r for r in ph["results"] if r["ok"]]
        ref = [r for r in ph["results"] if r["status"] == 429]
        ax.scatter([r["end_s"] - r["e2e_s"] for r in ok], [r["e2e_s"] for r in ok], s=8, label="admitted")
        ax.scatter([r["end_s"] for r in ref], [0.0] * len(ref), s=8, marker="x", color="tab:red",
                   label="refused (429)")
        ax.axhline(ph["bound_ms"] / 1000, ls="--", color="gray", label="max_queue_wait_s + service")
        ax.set_title(label.replace("_", " "), fontsize=9)
        ax.set_xlabel("sent at (s)")
    axes[0][0].set_ylabel("end-to-end (s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"overload-long on {result['host_cpu']}", fontsize=9)
    return _save(plt, fig, path)
