"""Driving the conversations of ``--scenario multiturn``: streamed chat turns, the history grown by each real
answer, think time between turns; and the app's counters read around a run.

One row per turn: its conversation and turn index, TTFT and end-to-end time, the engines' prompt and
completion tokens (``usage``), its estimated new tokens, whether it succeeded. A turn that fails ends its
conversation (the history it would have extended is gone); the rows say so.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdserve_bench.multiturn_workload import Conversation

#: The router's counter of where each request ran (``decision:reason``): goodput.py reads it too.
DECISIONS = "pdserve_pd_decisions_total"
#: The router's reads of what decode kept of a conversation's last turn, by outcome (router/handback.py).
HANDBACKS = "pdserve_kv_handback_total"
#: NIXL's own count of the bytes each KV transfer moved (a histogram on the engine that pulls: decode).
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_TRANSFERS = "vllm:nixl_bytes_transferred_count"
#: Decode engines' prompt tokens by where they came from (``external_kv_transfer``: pulled over NIXL).
TOKEN_SOURCES = "vllm:prompt_tokens_by_source_total"
#: Where a turn's time goes: the router's P/D phases (the prefill leg; the handoff: prefill's answer to
#: decode's first byte) and each engine's own queue and prompt time, by role (vLLM's histograms).
PHASES = "pdserve_phase_duration_seconds"
ENGINE_TIMES = {"queue": "vllm:request_queue_time_seconds", "prompt": "vllm:request_prefill_time_seconds"}
#: Prompt tokens each engine looked up in its prefix cache, and found there (vLLM's counters).
CACHE_QUERIES, CACHE_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


#: How many 429s one turn waits out before it counts as failed.
MAX_RETRIES = 20


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


async def chat_turn(session: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: TTFT (first content), end-to-end, the answer's text and usage. A 429 is
    retried after its Retry-After (at most :data:`MAX_RETRIES` times), as an agent behind an
    admission-controlled endpoint does; the waits count in the turn's TTFT."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"ok": False, "ttft_s": 0.0, "e2e_s": 0.0, "prompt_tokens": 0, "output_tokens": 0,
                           "text": "", "error": "", "retries": 0}
    pieces: list[str] = []
    try:
        while True:
            async with session.post(base.rstrip("/") + "/v1/chat/completions", json=body) as r:
                if r.status == 429 and row["retries"] < MAX_RETRIES:
                    wait = float(r.headers.get("Retry-After") or 1)
                elif r.status != 200:
                    row["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return row
                else:
                    await _read_stream(r, row, pieces, t0)
                    break
            row["retries"] += 1
            await asyncio.sleep(wait)
    except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    if row["error"]:
        return row
    row["e2e_s"] = time.perf_counter() - t0
    row["text"] = "".join(pieces)
    row["ok"] = bool(pieces)
    if not row["ok"]:
        row["error"] = "no content streamed"
    return row


async def _read_stream(r: aiohttp.ClientResponse, row: dict[str, Any], pieces: list[str], t0: float) -> None:
    """The SSE events of one answer into ``row`` (usage, the first content's time, an error event)."""
    buf = b""
    async for chunk in r.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event[6:] == b"[DONE]":
                continue
            msg = json.loads(event[6:])
            if "error" in msg:
                row["error"] = str(msg["error"])[:200]
                return
            if msg.get("usage"):
                row["prompt_tokens"] = int(msg["usage"].get("prompt_tokens") or 0)
                row["output_tokens"] = int(msg["usage"].get("completion_tokens") or 0)
            for c in msg.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if not pieces:
                        row["ttft_s"] = time.perf_counter() - t0
                    pieces.append(piece)


async def run_conversations(bases: list[str], model: str, convs: list[Conversation], max_tokens: int, *,
                            label: str = "", say: Callable[[str], None] = _say,
                            timeout_s: float = 600) -> tuple[list[dict[str, Any]], float]:
    """Every conversation at once, each on its own timeline; conversation ``i`` goes to ``bases[i % n]``
    (sticky: a client that spreads conversations over colocated engines keeps each on the engine that holds
    its history). Returns the rows and the wall time."""
    rows: list[dict[str, Any]] = []
    total = sum(len(c.turns) for c in convs)
    t0 = time.perf_counter()

    async def one(session: aiohttp.ClientSession, conv: Conversation) -> None:
        base = bases[conv.index % len(bases)]
        await asyncio.sleep(conv.start_s)
        messages = [{"role": "system", "content": conv.system}]
        for k, turn in enumerate(conv.turns, start=1):
            messages.append({"role": "user", "content": turn.user})
            start = time.perf_counter() - t0
            got = await chat_turn(session, base, chat_body(model, messages, max_tokens))
            text = got.pop("text")
            row = {"conversation": conv.index, "turn": k, "turns": len(conv.turns), "new_tokens": turn.new_tokens,
                   "start_s": round(start, 3), "target": base, **got}
            rows.append(row)
            say(f"{label} conversation {conv.index} turn {k}/{len(conv.turns)}: "
                + (f"TTFT {row['ttft_s'] * 1000:.0f} ms, {row['prompt_tokens']} prompt tokens"
                   if row["ok"] else f"failed ({row['error'][:80]})")
                + f" [{len(rows)}/{total}]")
            if not row["ok"]:
                return  # the history cannot go on without this answer
            messages.append({"role": "assistant", "content": text})
            if k < len(conv.turns):
                await asyncio.sleep(turn.think_s)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        await asyncio.gather(*(one(s, c) for c in convs))
    return rows, time.perf_counter() - t0


async def run_singles(base: str, model: str, prompts: list[list[dict[str, str]]],
                      max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt alone, one after the other (the SLO probe and the warm-up)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for messages in prompts:
            row = await chat_turn(s, base, chat_body(model, messages, max_tokens))
            row.pop("text")
            out.append(row)
    return out


# --- the app's counters around a run -------------------------------------------------------------------


def counters(url: str | None) -> dict[str, Any] | None:
    """The router's and its engines' counters this scenario reads (None: plain engines, or no answer)."""
    if url is None:
        return None
    from pdserve_bench.scrape import scrape

    try:
        return {"samples": scrape(url, engines=True, timeout_s=30)}
    except OSError:
        return None


def _sum(samples: dict[Any, float], name: str, **labels: str) -> float:
    total = 0.0
    for (n, ls), v in samples.items():
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items()):
            total += v
    return total


def counters_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the run added: decisions by ``decision:reason``; NIXL's bytes and transfers (None when the
    engines do not export them); prompt tokens decode pulled over NIXL and computed itself; the handback's
    reads by outcome (``read``, ``gone``: decode kept nothing, e.g. past ``nixl.decode_pin_share``, ``differs``)."""
    if before is None or after is None:
        return None
    from pdserve_bench.scrape import delta

    b, a = before["samples"], after["samples"]

    def grew(name: str, **labels: str) -> float:
        return _sum(a, name, **labels) - _sum(b, name, **labels)

    has_nixl = any(n == NIXL_BYTES for n, _ in a)
    return {"decisions": {k: int(v) for k, v in delta(b, a, DECISIONS, "decision,reason").items()},
            "handback": {k: int(v) for k, v in delta(b, a, HANDBACKS, "outcome").items()},
            "nixl_bytes": grew(NIXL_BYTES, pdserve_role="decode") if has_nixl else None,
            "nixl_transfers": grew(NIXL_TRANSFERS, pdserve_role="decode") if has_nixl else None,
            "decode_pulled_tokens": grew(TOKEN_SOURCES, pdserve_role="decode", source="external_kv_transfer"),
            "decode_computed_tokens": grew(TOKEN_SOURCES, pdserve_role="decode", source="local_compute"),
            "time_split": time_split(b, a), "prefix_cache_hits": cache_hits(b, a)}


def cache_hits(b: dict[Any, float], a: dict[Any, float]) -> dict[str, float]:
    """Per role, the share of the prompt tokens its engines looked up that their prefix cache held."""
    from pdserve_bench.scrape import delta

    asked, found = delta(b, a, CACHE_QUERIES, "pdserve_role"), delta(b, a, CACHE_HITS, "pdserve_role")
    return {role: round(found.get(role, 0.0) / n, 3) for role, n in sorted(asked.items()) if n > 0}


def time_split(b: dict[Any, float], a: dict[Any, float]) -> dict[str, dict[str, float]]:
    """Mean milliseconds (and counts) of the router's P/D phases and of each engine role's queue and prompt
    time over the run: where P/D's time to first token goes."""
    from pdserve_bench.scrape import delta, mean_ms

    out = {f"router {k}": v for k, v in mean_ms(delta(b, a, PHASES + "_sum", "phase"),
                                                 delta(b, a, PHASES + "_count", "phase")).items()}
    for what, name in ENGINE_TIMES.items():
        for role, v in mean_ms(delta(b, a, name + "_sum", "pdserve_role"),
                               delta(b, a, name + "_count", "pdserve_role")).items():
            out[f"{role} {what}"] = v
    return out
