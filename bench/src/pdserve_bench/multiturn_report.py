"""The figures of ``--scenario multiturn`` from its rows and counters: TTFT by turn index, goodput at the SLO
and at looser multiples of it, the share of turns run without a prefill leg, KV bytes moved per turn, the
targets; and its plots.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError
from pdserve_bench.client import Result
from pdserve_bench.stats import SLO, percentile

#: A short agent turn: at most this many new tokens, on a history of at least HISTORY tokens.
SHORT_NEW = 200 + 8  # the tool output and its header (multiturn_workload.HEADER_TOKENS)
HISTORY = 1000
#: The targets: short turns' TTFT p50 at most this share of plain P/D's.
TTFT_SHARE = 0.5
#: SLO scales (DistServe's): goodput is also counted with both SLO targets times each of these. Where every
#: system's TPOT p50 sits at the SLO, attainment at scale 1 is a coin flip per run; the curve shows whether a
#: system's lead holds once the SLO is a little looser, or only at one point of it.
SLO_SCALES = (1.0, 1.25, 1.5, 2.0)
#: The goodput ratios' interval: a paired bootstrap over conversations (each resample draws a round's
#: conversations with replacement, the same draw for both systems: they ran the same conversations), this many
#: resamples, this two-sided level. Few turns within the SLO make a ratio of small counts; its interval says
#: whether the run can tell the systems apart at all.
BOOTSTRAP_RESAMPLES = 2000
CI_LEVEL = 0.9
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}


def as_result(row: dict[str, Any]) -> Result:
    """A turn as the framework's :class:`~pdserve_bench.client.Result` (for :meth:`SLO.met`)."""
    return Result(ok=row["ok"], prompt_tokens=row["prompt_tokens"], output_tokens=row["output_tokens"],
                  ttft_s=row["ttft_s"], e2e_s=row["e2e_s"])


def _ms(values: list[float], p: float) -> float | None:
    return round(percentile(values, p) * 1000, 1) if values else None


def by_turn(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per turn index: how many turns, how many failed, TTFT p50/p90 and e2e p50/p90 (ms) of those that ran."""
    out: dict[int, dict[str, Any]] = {}
    for k in sorted({r["turn"] for r in rows}):
        ok = [r for r in rows if r["turn"] == k and r["ok"]]
        ttft, e2e = [r["ttft_s"] for r in ok], [r["e2e_s"] for r in ok]
        out[k] = {"turns": sum(r["turn"] == k for r in rows), "failed": sum(r["turn"] == k and not r["ok"] for r in rows),
                  "ttft_p50_ms": _ms(ttft, 50), "ttft_p90_ms": _ms(ttft, 90),
                  "e2e_p50_ms": _ms(e2e, 50), "e2e_p90_ms": _ms(e2e, 90),
                  "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in ok) / len(ok)) if ok else None}
    return out


def short_turns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Short agent turns: not a conversation's first, few new tokens, a long history before them."""
    return [r for r in rows if r["ok"] and r["turn"] > 1 and r["new_tokens"] <= SHORT_NEW
            and r["prompt_tokens"] - r["new_tokens"] >= HISTORY]


def slo_from_probe(probe: list[dict[str, Any]], ttft_x: float, tpot_x: float) -> SLO:
    """Multiples of an idle engine's TTFT p50 and TPOT p50 on fresh first turns."""
    ok = [as_result(r) for r in probe if r["ok"]]
    if not ok:
        raise RuntimeError(f"every SLO probe failed: {sorted({r['error'] for r in probe})[:3]}")
    ttft = percentile([r.ttft_s for r in ok], 50) * 1000
    tpots = [r.tpot_s for r in ok if r.output_tokens > 1]
    tpot = percentile(tpots, 50) * 1000 if tpots else None
    return SLO(ttft_ms=round(ttft * ttft_x, 1), tpot_ms=round(tpot * tpot_x, 1) if tpot else None)


def goodput(rows: list[dict[str, Any]], wall_s: float, slo: SLO) -> dict[str, Any]:
    """Turns within every SLO target per second of the run, and their share (attainment) of the turns the
    workload holds: a turn never sent (its conversation failed earlier) counts as missed. Rows of several
    rounds (``round``) plan each round's conversations anew."""
    met = sum(1 for r in rows if slo.met(as_result(r)))
    planned = sum({(r.get("round", 0), r["conversation"]): r["turns"] for r in rows}.values())
    return {"turns_within_slo": met, "turns_planned": planned,
            "attainment": round(met / planned, 4) if planned else 0.0,
            "goodput_turns_per_s": round(met / wall_s, 4) if wall_s > 0 else 0.0}


def scaled(slo: SLO, scale: float) -> SLO:
    """``slo`` with each of its targets times ``scale``."""
    def x(v: float | None) -> float | None:
        return None if v is None else round(v * scale, 1)
    return SLO(ttft_ms=x(slo.ttft_ms), tpot_ms=x(slo.tpot_ms), e2e_ms=x(slo.e2e_ms))


def slo_scales(text: str) -> tuple[float, ...]:
    """``slo_scales``: comma-separated multiples, each at least 1 (1 is the SLO itself, always counted)."""
    try:
        got = {float(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ConfigError(f"multiturn: slo_scales {text!r}: numbers, e.g. 1,1.5,2") from None
    if any(not x >= 1 or x == float("inf") for x in got):
        raise ConfigError(f"multiturn: slo_scales {text!r}: each at least 1 (the SLO itself) and finite")
    return tuple(sorted(got | {1.0}))


def by_slo_scale(rows: list[dict[str, Any]], wall_s: float, slo: SLO,
                 scales: tuple[float, ...] = SLO_SCALES) -> dict[str, dict[str, float]]:
    """Attainment and goodput at each SLO scale, keyed by the scale as written (``"1.5"``)."""
    out = {}
    for sc in scales:
        g = goodput(rows, wall_s, scaled(slo, sc))
        out[f"{sc:g}"] = {"attainment": g["attainment"], "goodput_turns_per_s": g["goodput_turns_per_s"]}
    return out


def no_prefill_share(decisions: dict[str, int] | None) -> float | None:
    """Share of the router's decisions that ran a request on decode alone (``local:*``)."""
    if not decisions:
        return None
    total = sum(decisions.values())
    return round(sum(v for k, v in decisions.items() if k.startswith("local:")) / total, 4) if total else None


def kv_bytes_per_token(model_dir: str | None, dtype: str | None) -> int | None:
    """Bytes of K and V one token takes across the model's layers: 2 x layers x KV heads x head size x the
    dtype's bytes (from ``config.json``); None when the model or the dtype is not known here."""
    if model_dir is None or dtype not in DTYPE_BYTES:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads") or heads) * head_dim \
        * DTYPE_BYTES[str(dtype)]


def kv_moved(delta: dict[str, Any] | None, turns: int, per_token: int | None) -> dict[str, Any] | None:
    """KV bytes moved per turn: NIXL's own byte count when the engines export it; else (and beside it) the
    prompt tokens decode pulled times :func:`kv_bytes_per_token`, labelled an estimate."""
    if delta is None or turns <= 0:
        return None
    pulled = delta.get("decode_pulled_tokens") or 0.0
    measured = delta.get("nixl_bytes")
    est = pulled * per_token if per_token else None
    return {"measured_bytes_per_turn": round(measured / turns) if measured is not None else None,
            "source": "NIXL (vllm:nixl_bytes_transferred)" if measured is not None else "estimate",
            "pulled_tokens_per_turn": round(pulled / turns, 1),
            "estimated_bytes_per_turn": round(est / turns) if est is not None else None,
            "estimate": f"pulled prompt tokens x {per_token} bytes of KV per token (model config, dtype)"
                        if per_token else "unknown: model config or dtype not known"}


def summarize_system(rows: list[dict[str, Any]], wall_s: float, slo: SLO, delta: dict[str, Any] | None,
                     per_token: int | None, scales: tuple[float, ...] = SLO_SCALES) -> dict[str, Any]:
    ok = [r for r in rows if r["ok"]]
    short = short_turns(rows)
    return {"turns": len(rows), "failed": len(rows) - len(ok), "wall_s": round(wall_s, 2),
            "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
            "ttft_p50_ms": _ms([r["ttft_s"] for r in ok], 50), "ttft_p90_ms": _ms([r["ttft_s"] for r in ok], 90),
            "e2e_p50_ms": _ms([r["e2e_s"] for r in ok], 50), "e2e_p90_ms": _ms([r["e2e_s"] for r in ok], 90),
            "e2e_mean_ms": round(1000 * sum(r["e2e_s"] for r in ok) / len(ok), 1) if ok else None,
            "short_turns": len(short), "short_ttft_p50_ms": _ms([r["ttft_s"] for r in short], 50),
            "short_ttft_p90_ms": _ms([r["ttft_s"] for r in short], 90),
            "tpot_p50_ms": _ms([(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
                                if (r.get("output_tokens") or 0) > 1], 50),
            "by_turn": by_turn(rows), **goodput(rows, wall_s, slo),
            "by_slo_scale": by_slo_scale(rows, wall_s, slo, scales),
            "decisions": delta["decisions"] if delta else None,
            "no_prefill_share": no_prefill_share(delta["decisions"]) if delta else None,
            "handback": delta.get("handback") if delta else None,
            "kv_moved": kv_moved(delta, len(ok), per_token),
            "time_split": delta.get("time_split") if delta else None,
            "prefix_cache_hits": delta.get("prefix_cache_hits") if delta else None, "results": rows}


def merge_deltas(deltas: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One system's counters over several rounds (:func:`multiturn_run.counters_delta` each): decisions,
    bytes and tokens summed, phase means weighted by their counts, cache hit shares averaged."""
    if not deltas or any(d is None for d in deltas):
        return None
    ds = [d for d in deltas if d is not None]
    out: dict[str, Any] = {"decisions": {}, "handback": {}}
    for d in ds:
        for field in ("decisions", "handback"):
            for k, v in (d.get(field) or {}).items():
                out[field][k] = out[field].get(k, 0) + v
    for key in ("nixl_bytes", "nixl_transfers", "decode_pulled_tokens", "decode_computed_tokens"):
        got = [d.get(key) for d in ds]
        out[key] = None if any(v is None for v in got) else sum(got)
    split: dict[str, dict[str, float]] = {}
    for d in ds:
        for name, v in (d.get("time_split") or {}).items():
            acc = split.setdefault(name, {"total": 0.0, "n": 0})
            acc["total"] += v["mean_ms"] * v["n"]
            acc["n"] += v["n"]
    out["time_split"] = {k: {"mean_ms": round(v["total"] / v["n"], 1), "n": v["n"]} for k, v in split.items() if v["n"]}
    hits: dict[str, list[float]] = {}
    for d in ds:
        for role, share in (d.get("prefix_cache_hits") or {}).items():
            hits.setdefault(role, []).append(share)
    out["prefix_cache_hits"] = {k: round(sum(v) / len(v), 4) for k, v in hits.items()}
    return out


#: The per-round figures :func:`spread` lists side by side.
SPREAD = ("short_ttft_p50_ms", "tpot_p50_ms", "e2e_mean_ms", "attainment", "goodput_turns_per_s")


def spread(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[Any]]]:
    """Each system's :data:`SPREAD` figures, one per round (the rounds alternate the systems' order), and
    the ratios to plain P/D's and to colocated's goodput within each round (measured side by side), at the
    SLO and at each looser scale of it (``goodput_vs_pd@1.5x``)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for r in rounds:
        for name, s in r.items():
            mine = out.setdefault(name, {k: [] for k in SPREAD})
            for k in SPREAD:
                mine[k].append(s.get(k))
            for base in ("pd", "colocated"):
                if base in r and base != name:
                    b = r[base].get("goodput_turns_per_s")
                    mine.setdefault(f"goodput_vs_{base}", []).append(
                        round(s["goodput_turns_per_s"] / b, 3) if b else None)
                    for sc, g in (s.get("by_slo_scale") or {}).items():
                        if sc == "1":
                            continue
                        bs = (r[base].get("by_slo_scale") or {}).get(sc, {}).get("goodput_turns_per_s")
                        mine.setdefault(f"goodput_vs_{base}@{sc}x", []).append(
                            round(g["goodput_turns_per_s"] / bs, 3) if bs else None)
    return out


def _met_by_conversation(rows: list[dict[str, Any]], slo: SLO) -> dict[tuple[int, int], int]:
    """Turns within ``slo``, per conversation of each round (a conversation that met none counts 0)."""
    out: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (int(r.get("round", 0)), int(r["conversation"]))
        out[key] = out.get(key, 0) + (1 if slo.met(as_result(r)) else 0)
    return out


def goodput_ratio_interval(mine: dict[str, Any], other: dict[str, Any], slo: SLO, *,
                           resamples: int = BOOTSTRAP_RESAMPLES, level: float = CI_LEVEL,
                           seed: int = 0) -> list[float] | None:
    """The ``level`` interval of ``mine``'s goodput over ``other``'s at ``slo`` (each a system's figures:
    ``results``, ``wall_s``), by :data:`BOOTSTRAP_RESAMPLES` paired resamples of the conversations, round by
    round; the run's time is kept as measured. None with fewer than two conversations in common. A resample
    where neither system met the SLO is left out; one where only ``other`` met none counts as infinite."""
    a, b = _met_by_conversation(mine["results"], slo), _met_by_conversation(other["results"], slo)
    keys = sorted(set(a) & set(b))
    if len(keys) < 2 or not mine.get("wall_s") or not other.get("wall_s"):
        return None
    rounds: dict[int, list[tuple[int, int]]] = {}
    for k in keys:
        rounds.setdefault(k[0], []).append(k)
    time_ratio = other["wall_s"] / mine["wall_s"]
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(resamples):
        na = nb = 0
        for convs in rounds.values():
            for k in rng.choices(convs, k=len(convs)):
                na, nb = na + a[k], nb + b[k]
        if na or nb:
            ratios.append(na / nb * time_ratio if nb else math.inf)
    if not ratios:
        return None
    ratios.sort()
    tail = (1.0 - level) / 2.0
    lo, hi = ratios[int(tail * len(ratios))], ratios[min(len(ratios) - 1, int((1.0 - tail) * len(ratios)))]
    return [round(lo, 3) if math.isfinite(lo) else lo, round(hi, 3) if math.isfinite(hi) else hi]


def verdict(interval: list[float] | None) -> str | None:
    """``met`` when the whole interval is at least 1, ``missed`` when it is all below, else ``undecided``."""
    if interval is None:
        return None
    return "met" if interval[0] >= 1.0 else "missed" if interval[1] < 1.0 else "undecided"


def targets(systems: dict[str, dict[str, Any]], slo: SLO | None = None) -> dict[str, Any]:
    """The issue's targets for ``cache_aware`` (and ``adaptive``, ``cache_aware_bidir``, ``pd_bidir`` and
    ``adaptive_bidir``, keys prefixed ``adaptive_``, ``bidir_``, ``pd_bidir_``, ``adaptive_bidir_``): short
    turns' TTFT p50 at most half of plain P/D's; goodput at least plain P/D's and at least colocated's (at the
    SLO; ``by_scale`` gives the ratio at each looser scale beside it). Left out where a system is missing or
    has no figure. With ``slo``, each goodput ratio also has its interval (``ci90``, :func:`goodput_ratio_interval`)
    and what it says (``verdict``: met, missed or undecided)."""
    pd, col = systems.get("pd"), systems.get("colocated")
    out: dict[str, Any] = {}
    for mine, prefix in (("cache_aware", ""), ("adaptive", "adaptive_"), ("cache_aware_bidir", "bidir_"),
                         ("pd_bidir", "pd_bidir_"), ("adaptive_bidir", "adaptive_bidir_")):
        ca = systems.get(mine)
        if not ca:
            continue
        if pd and ca["short_ttft_p50_ms"] and pd["short_ttft_p50_ms"]:
            share = ca["short_ttft_p50_ms"] / pd["short_ttft_p50_ms"]
            out[f"{prefix}short_ttft_vs_pd"] = {"ratio": round(share, 3), "target": TTFT_SHARE,
                                                "met": share <= TTFT_SHARE}
        for name, other in (("pd", pd), ("colocated", col)):
            if other:
                a, b = ca["goodput_turns_per_s"], other["goodput_turns_per_s"]
                # (no turn of either within the SLO tells nothing: not met)
                out[f"{prefix}goodput_vs_{name}"] = {"ratio": round(a / b, 3) if b else None, "met": a >= b and a > 0}
                if slo is not None and ca.get("results") and other.get("results"):
                    ci = goodput_ratio_interval(ca, other, slo)
                    out[f"{prefix}goodput_vs_{name}"].update({"ci90": ci, "verdict": verdict(ci)})
                mine_by, other_by = ca.get("by_slo_scale") or {}, other.get("by_slo_scale") or {}
                ratios = {sc: round(g["goodput_turns_per_s"] / other_by[sc]["goodput_turns_per_s"], 3)
                          for sc, g in mine_by.items()
                          if sc != "1" and other_by.get(sc, {}).get("goodput_turns_per_s")}
                if ratios:
                    out[f"{prefix}goodput_vs_{name}"]["by_scale"] = ratios
    return out


def compared(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each system's mean time to the whole answer (what an agent waits for before its next step) and its
    short turns' TTFT p50 over plain P/D's; no target."""
    pd = systems.get("pd")
    if not pd:
        return {}
    out: dict[str, float] = {}
    for key, short in (("e2e_mean_ms", "e2e_mean"), ("short_ttft_p50_ms", "short_ttft")):
        if pd.get(key):
            out.update({f"{name}_{short}_vs_pd": round(s[key] / pd[key], 3)
                        for name, s in systems.items() if name != "pd" and s.get(key)})
    return out


def lines(result: dict[str, Any]) -> list[str]:
    """One line per system, then the targets, then (with rounds) each system's figures round by round: what the
    run says on stderr at its end."""
    out = []
    for name, s in result["systems"].items():
        kv = s.get("kv_moved") or {}
        kvb = kv.get("measured_bytes_per_turn") or kv.get("estimated_bytes_per_turn")
        out.append(f"{name}: TTFT p50 {s['ttft_p50_ms']} ms (short turns {s['short_ttft_p50_ms']} ms, "
                   f"{s['short_turns']}), goodput {s['goodput_turns_per_s']} turns/s ({s['attainment']:.0%} "
                   f"within SLO), failed {s['failed']}"
                   + (f", without prefill {s['no_prefill_share']:.0%}" if s.get("no_prefill_share") is not None else "")
                   + (f", KV {kvb / 2**20:.1f} MiB/turn ({kv['source']})" if kvb else "")
                   + (", handback " + ", ".join(f"{k} {v}" for k, v in sorted(s["handback"].items()))
                      if s.get("handback") else ""))
        if s.get("time_split"):
            out.append(f"{name}: mean ms " + ", ".join(f"{k} {v['mean_ms']:g} ({v['n']})"
                                                       for k, v in s["time_split"].items()))
        if s.get("prefix_cache_hits"):
            out.append(f"{name}: prefix cache hits " + ", ".join(f"{k} {v:.0%}" for k, v in s["prefix_cache_hits"].items()))
        if s.get("by_slo_scale"):
            out.append(f"{name}: goodput (attainment) at SLO x " + ", ".join(
                f"{sc}: {g['goodput_turns_per_s']:g} ({g['attainment']:.0%})" for sc, g in s["by_slo_scale"].items()))
    for k, t in result.get("targets", {}).items():
        ci = t.get("ci90")
        out.append(f"target {k}: ratio {t['ratio']} -> {'met' if t['met'] else 'MISSED'}"
                   + (f" (90 % interval {ci[0]:g}-{ci[1]:g}: {t['verdict']})" if ci else "")
                   + ("; looser SLO " + ", ".join(f"x{sc} {r:g}" for sc, r in t["by_scale"].items())
                      if t.get("by_scale") else ""))
    for k, ratio in result.get("compared", {}).items():
        out.append(f"{k}: {ratio}")
    for name, by in result.get("spread", {}).items():
        out.append(f"{name} by round: " + "; ".join(f"{k} {' / '.join('-' if v is None else f'{v:g}' for v in vals)}"
                                                   for k, vals in by.items()))
    return out


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    """TTFT p50 by turn index, one line per system; beside it (where the systems have it) goodput by SLO
    scale, one line per system."""
    from pdserve_bench.plots import sweep

    title = (f"multi-turn agents, {result['topology']}, {result['workload']['conversations']} conversations\n"
             f"{result.get('host_cpu', '')}")
    scales = {name: [(float(sc), g["goodput_turns_per_s"]) for sc, g in s["by_slo_scale"].items()]
              for name, s in result["systems"].items() if s.get("by_slo_scale")}
    if scales:
        sweep(scales, out_dir / "multiturn-goodput.png", "SLO scale (x the TTFT and TPOT targets)",
              "goodput (turns within the SLO / s)", title)
    points = {name: [(int(k), v["ttft_p50_ms"]) for k, v in sorted(s["by_turn"].items(), key=lambda kv: int(kv[0]))
                     if v["ttft_p50_ms"] is not None]
              for name, s in result["systems"].items()}
    return sweep(points, out_dir / "multiturn-ttft.png", "turn index", "TTFT p50 (ms)", title)
