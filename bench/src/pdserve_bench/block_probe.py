"""A CPU engine's KV block size (``engine_kwargs.block_size``; vLLM's CPU default 128): what it costs a fresh
prompt and what it saves a conversation's next turn.

    python -m pdserve_bench.block_probe [--sizes 128,32] [--rounds 3] [--out FILE]

vLLM caches a prompt's prefix in whole blocks, so a follow-up turn recomputes the last partial block of the
history besides its new tokens: half a block on average, 64 tokens at 128. Each size runs in its own
process (one engine, float32, on one core, prefix caching on), the sizes alternating twice; per round:

* ``fresh_s``: a fresh 1,500-token prompt (its first token);
* ``follow_up_s``: a 2,500-token history already computed, then it and 200 new tokens (its first token);
* ``tpot_ms``: 32 greedy tokens after that context, per token.

Printed and written: each size's medians and their ratios to the first size's, with the host's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FRESH_TOKENS = 1500
HISTORY_TOKENS = 2500
NEW_TOKENS = 200
OUTPUT_TOKENS = 32
METRICS = ("fresh_s", "follow_up_s", "tpot_ms")


def measure(block_size: int, rounds: int, model: str) -> dict[str, list[float]]:
    """One engine with ``block_size``, in this process: ``rounds`` of the three figures."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", block_size=block_size, max_model_len=4096, enforce_eager=True,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=True)
    rng = random.Random(block_size)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(n)]

    def first_token_s(ids: list[int]) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0),
                     use_tqdm=False)
        return time.perf_counter() - t

    first_token_s(tokens(300))  # warm-up
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for _ in range(rounds):
        out["fresh_s"].append(first_token_s(tokens(FRESH_TOKENS)))
        history = tokens(HISTORY_TOKENS)
        first_token_s(history)
        turn = history + tokens(NEW_TOKENS)
        out["follow_up_s"].append(first_token_s(turn))
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=turn)],
                     SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
        out["tpot_ms"].append(1000 * (time.perf_counter() - t) / OUTPUT_TOKENS)
    return out


def summarize(runs: list[tuple[int, dict[str, list[float]]]]) -> dict[str, Any]:
    """Per size, each figure's median over all its runs and its ratio to the first size's median."""
    sizes: dict[int, dict[str, list[float]]] = {}
    for size, got in runs:
        into = sizes.setdefault(size, {m: [] for m in METRICS})
        for m in METRICS:
            into[m].extend(got[m])
    medians = {size: {m: statistics.median(v[m]) for m in METRICS} for size, v in sizes.items()}
    base = next(iter(medians.values()))
    return {str(size): {**{m: round(v, 3) for m, v in med.items()},
                        **{f"{m}_ratio": round(med[m] / base[m], 3) for m in METRICS}}
            for size, med in medians.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve_bench.block_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128,32", help="block sizes, comma-separated; the first is the base")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per engine start")
    ap.add_argument("--out", default="bench-results/block-probe.json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)

    from pdserve.model.resolve import resolve_model

    model = str(resolve_model(None))
    if ns.child:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # one core, as an engine has
        print(json.dumps(measure(ns.child, ns.rounds, model)), flush=True)
        return 0
    sizes = [int(s) for s in ns.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        ap.error("--sizes: positive integers, e.g. 128,32")
    from pdserve_bench.overload_long import host_cpu

    runs: list[tuple[int, dict[str, list[float]]]] = []
    for i, size in enumerate(sizes * 2):
        print(f"[block] engine {i + 1}/{2 * len(sizes)}: block_size {size}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pdserve_bench.block_probe", "--child", str(size),
                               "--rounds", str(ns.rounds)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append((size, json.loads(done.stdout.strip().splitlines()[-1])))
    result = {"host_cpu": host_cpu(), "model": model, "sizes": summarize(runs), "runs": runs}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for size, s in result["sizes"].items():
        print(f"block_size {size}: fresh {FRESH_TOKENS} tokens {s['fresh_s']} s ({s['fresh_s_ratio']}x), "
              f"follow-up {s['follow_up_s']} s ({s['follow_up_s_ratio']}x), TPOT {s['tpot_ms']} ms "
              f"({s['tpot_ms_ratio']}x)  [{result['host_cpu']}]")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
