"""What ``nixl.bidirectional`` costs traffic that is not a conversation: one-shot prompts on 1P1D.

    python -m pdserve_bench.pin_cost [--requests 24] [--prompt-tokens 1500] [--concurrency 4] [--rounds 2]
                                     [--config FILE] [--out FILE]

With ``nixl.bidirectional`` a decode engine keeps every finished P/D request's blocks for
``nixl.decode_blocks_ttl_s`` in case a next turn reads them; a one-shot prompt never has one, so its blocks
only take decode KV memory until the pin ends. The app (the embedded default, or ``--config``) runs without
and with it, alternating, ``--rounds`` times each: ``--requests`` fresh prompts of ``--prompt-tokens`` random
token ids, 32 tokens each, streamed, ``--concurrency`` clients (a 429 is retried after its Retry-After).

Printed and written: per run the wall time, TTFT and e2e p50/p90, the peak of decode's
``vllm:kv_cache_usage_perc`` (read every second), and each mode's medians with bidirectional's over plain's,
with the host's CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

OUTPUT_TOKENS = 32
MODES = ("plain", "bidirectional")


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's medians over its runs, and bidirectional's over plain's."""
    out: dict[str, Any] = {}
    keys = ("wall_s", "ttft_p50_ms", "e2e_p50_ms", "decode_kv_peak")
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[mode] = {k: round(statistics.median(r[k] for r in mine), 3) for k in keys}
    if all(m in out for m in MODES):
        out["bidirectional_over_plain"] = {
            k: round(out["bidirectional"][k] / out["plain"][k], 3) if out["plain"][k] else None for k in keys}
    return out


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return r.read()


def one_run(url: str, decode_url: str, model: str, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    from pdserve.engine.process import local_engine_auth

    rows: list[tuple[float, float]] = []
    lock, todo, peak, stop = threading.Lock(), iter(prompts), [0.0], threading.Event()
    failed: list[str] = []

    def client() -> None:
        while True:
            with lock:
                prompt = next(todo, None)
            if prompt is None:
                return
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                               "stream": True}).encode()
            t0, first = time.perf_counter(), None
            while True:
                req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        for line in r:
                            if first is None and line.startswith(b"data: "):
                                first = time.perf_counter()
                except urllib.error.HTTPError as e:
                    if e.code == 429:
                        time.sleep(float(e.headers.get("retry-after") or 1))
                        continue
                    failed.append(f"{e.code}: {e.read()[:200]!r}")
                    break
                with lock:
                    rows.append(((first or t0) - t0, time.perf_counter() - t0))
                break

    def watch() -> None:
        auth = local_engine_auth(decode_url)
        while not stop.is_set():
            try:
                text = _get(decode_url + "/metrics", auth).decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("vllm:kv_cache_usage_perc"):
                    peak[0] = max(peak[0], float(line.split()[-1]))
            stop.wait(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    stop.set()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    ttft, e2e = [r[0] * 1000 for r in rows], [r[1] * 1000 for r in rows]
    return {"wall_s": round(wall, 1), "ttft_p50_ms": round(percentile(ttft, 0.5)),
            "ttft_p90_ms": round(percentile(ttft, 0.9)), "e2e_p50_ms": round(percentile(e2e, 0.5)),
            "e2e_p90_ms": round(percentile(e2e, 0.9)), "decode_kv_peak": round(peak[0], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve_bench.pin_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", help="pdserve YAML (default: the embedded default)")
    ap.add_argument("--out", default="bench-results/pin-cost.json")
    ns = ap.parse_args(argv)

    from pdserve.config.loader import load_config
    from pdserve_bench.overload_long import host_cpu
    from pdserve_bench.systems import ServedApp

    runs: list[dict[str, Any]] = []
    for rnd in range(ns.rounds):
        for mode in MODES:
            args = load_config(ns.config).args
            args.nixl.bidirectional = mode == "bidirectional"
            rng = random.Random(rnd)
            prompts = [[rng.randrange(1000, 40000) for _ in range(ns.prompt_tokens)] for _ in range(ns.requests)]
            print(f"[pin-cost] round {rnd + 1}/{ns.rounds}: {mode}", file=sys.stderr, flush=True)
            with ServedApp(args) as app:
                engines = json.loads(_get(app.url + "/pdserve/status"))["engines"]
                decode = next(e["url"] for e in engines if e["role"] == "decode")
                got = {"round": rnd, "mode": mode, **one_run(app.url, decode, args.model_id, prompts, ns.concurrency)}
            runs.append(got)
            print(json.dumps(got), file=sys.stderr, flush=True)
    result = {"host_cpu": host_cpu(), "requests": ns.requests, "prompt_tokens": ns.prompt_tokens,
              "concurrency": ns.concurrency, "summary": summary(runs), "runs": runs}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
