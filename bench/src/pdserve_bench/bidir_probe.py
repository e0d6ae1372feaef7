"""vLLM's ``bidirectional_kv_xfer``: does a follow-up's prefill get cheaper when prefill reads the decode
engine's blocks instead of recomputing them?

    python -m pdserve_bench.bidir_probe --conversations 10 [--config FILE] [--out FILE]

Two engines with pdserve's command lines (prefill on the first core, decode on the second, float32 on CPU)
and ``kv_connector_extra_config: {bidirectional_kv_xfer: true}``, driven by hand, without the router. Each
conversation: turn 1 (a 1,500-1,627-token prompt) goes through prefill, then decode (32 greedy tokens);
turn 2 is turn 1, its answer and 100 new tokens. Prefill already holds turn 1's prompt in its prefix cache
(all but the last partial block); it lacks that block and the answer. Conversations alternate between

* ``plain``: turn 2's prefill leg carries pdserve's usual parameters, so prefill recomputes what it lacks;
* ``bidir``: it carries the parameters decode returned with turn 1's answer, so prefill reads those blocks
  from decode over NIXL and computes only the new tokens.

Printed and written: each conversation's prefill-leg time of turn 2 and its p50 per mode. Decode keeps a
finished request's blocks for ``decoder_kv_blocks_ttl`` seconds (set to 60 here) so prefill can read them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

OUTPUT_TOKENS = 32
NEW_TOKENS = 100
SYSTEM_TOKENS = 1500
BLOCKS_TTL_S = 60


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve_bench.bidir_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=10, help="conversations, alternating plain/bidir")
    ap.add_argument("--config", help="pdserve YAML (default: the embedded default)")
    ap.add_argument("--out", default="bench-results/bidir-probe.json")
    ns = ap.parse_args(argv)

    import urllib.request

    from pdserve.config.loader import load_config
    from pdserve.router.handoff import PREFILL_KV_PARAMS
    from pdserve_bench.overload_long import host_cpu
    from pdserve_bench.systems import EnginePair

    args = load_config(ns.config).args
    for cfg in (args.prefill_config, args.decode_config):
        cfg.engine_kwargs.setdefault("dtype", "float32")
        kv = cfg.engine_kwargs.setdefault("kv_transfer_config", {})
        kv.setdefault("kv_connector_extra_config", {}).update(bidirectional_kv_xfer=True,
                                                              decoder_kv_blocks_ttl=BLOCKS_TTL_S)
    print("[bidir] starting prefill and decode engines", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    with EnginePair(args) as pair:
        p_url, d_url = pair.urls
        rng = random.Random(3)

        def ids(n: int) -> list[int]:
            return [rng.randrange(1000, 40000) for _ in range(n)]

        def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
            data = json.dumps({"model": args.model_id, **body}).encode()
            req = urllib.request.Request(url + "/v1/completions", data, {
                "Content-Type": "application/json"})
            t = time.perf_counter()
            with urllib.request.urlopen(req, timeout=300) as r:  # an error status raises
                got = json.load(r)
            return got, time.perf_counter() - t

        def turn(prompt: list[int], kv: dict[str, Any]) -> tuple[dict[str, Any], float]:
            first, t_p = post(p_url, {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "kv_transfer_params": kv})
            answer, _ = post(d_url, {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                                     "temperature": 0, "return_token_ids": True,
                                     "kv_transfer_params": first["kv_transfer_params"]})
            return answer, t_p

        for _ in range(2):  # warm both engines and their NIXL connection
            turn(ids(600), dict(PREFILL_KV_PARAMS))
        for conv in range(ns.conversations):
            mode = "bidir" if conv % 2 else "plain"
            first = ids(SYSTEM_TOKENS + rng.randrange(0, 128))
            answer, _ = turn(first, dict(PREFILL_KV_PARAMS))
            back = answer.get("kv_transfer_params")
            second = first + (answer["choices"][0].get("token_ids") or []) + ids(NEW_TOKENS)
            kv = dict(back) if mode == "bidir" and back else dict(PREFILL_KV_PARAMS)
            _, t_p = turn(second, kv)
            rows.append({"conversation": conv, "mode": mode, "decode_returned_params": bool(back),
                         "turn2_prompt_tokens": len(second), "turn2_prefill_ms": round(t_p * 1000, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {}
    for mode in ("plain", "bidir"):
        xs = sorted(r["turn2_prefill_ms"] for r in rows if r["mode"] == mode)
        summary[mode] = {"turn2_prefill_p50_ms": xs[len(xs) // 2] if xs else None, "n": len(xs)}
    if summary["plain"]["turn2_prefill_p50_ms"] and summary["bidir"]["turn2_prefill_p50_ms"]:
        summary["bidir_over_plain"] = round(summary["bidir"]["turn2_prefill_p50_ms"]
                                            / summary["plain"]["turn2_prefill_p50_ms"], 3)
    result = {"host_cpu": host_cpu(), "summary": summary, "conversations": rows}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
