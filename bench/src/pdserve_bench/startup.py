"""``--scenario startup``: time-to-ready by phase, cold vs warm, with the weight cache in a fresh directory.

One engine (the prefill command pdserve would run, NIXL included, on one core), started with its cache
(``cache_dir``: prepared model, ``HF_HOME``, ``VLLM_CACHE_ROOT``) in a new temporary directory:

* ``cold``: empty cache, page cache dropped; the model is prepared (the packaged GGUF converted to
  safetensors), then the engine starts. This is a first start on a fresh node.
* ``restart``: cache prepared, page cache dropped again; the weights and every library come from disk
  (a new pod on the node, a reboot).
* ``warm``: the next start with everything cached (the process restarted on the same node).
* ``compile-cold`` / ``compile-warm`` (``--opt compile=0`` skips them): the same engine without
  ``enforce_eager``, so vLLM compiles the model with torch.compile, first into an empty
  ``VLLM_CACHE_ROOT``, then from it. On CPU pdserve runs engines eagerly; on GPU compiling is vLLM's default.
  Every start uses the same core and NIXL side-channel port: both are part of vLLM's compile cache key.

Then (``--opt app=0`` skips it) the whole app, ``pdserve serve`` with a fresh ``cache_dir``, cold and warm,
each stopped once ready as Ctrl-C stops it, the stop timed to its exit.

Phases come from the engine's own log lines, timed on arrival (the engine writes them unbuffered), and
from ``/health`` polled every 0.1 s; vLLM's own figures ("Loading weights took ...") are kept next to them.

The scenario's parts: :mod:`pdserve_bench.startup_log` (marks, phases and vLLM's figures from the logs),
:mod:`pdserve_bench.page_cache` (dropping it, what it holds, a raw read of the weights) and
:mod:`pdserve_bench.timed_start` (one engine start, one app start). This module plans and runs the starts
in order, summarizes them and draws the plot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve_bench.page_cache import raw_read, resident_fraction
from pdserve_bench.startup_log import (
    APP_MARKS,
    APP_PHASES,
    ENGINE_PHASES,
    compile_cache_state,
    find_marks,
    parse_reported,
    phase_durations,
)
from pdserve_bench.timed_start import app_start, engine_command, engine_start

#: The scenario, and the names callers found here before the module's split (each lives in the module it is
#: imported from).
__all__ = ["APP_MARKS", "APP_PHASES", "ENGINE_PHASES", "compile_cache_state", "find_marks", "measure_startup",
           "parse_reported", "phase_durations", "plot_startup", "resident_fraction", "stacked_rows",
           "summarize_startup"]


# --- the scenario ----------------------------------------------------------------------------------------


def _flag(opts: dict[str, Any], key: str, default: bool = True) -> bool:
    v = opts.get(key)
    return default if v is None else str(v).strip().lower() not in ("0", "false", "no", "off", "")


def _compiled(args: PDServeArgs) -> PDServeArgs:
    """The same engines without ``enforce_eager``: vLLM compiles the model with torch.compile."""
    c = args.model_copy(deep=True)
    for cfg in (c.prefill_config, c.decode_config):
        cfg.engine_kwargs["enforce_eager"] = False
    return c


def _plan_startup(plan: Any, args: PDServeArgs, opts: dict[str, Any], steps: list[tuple[str, bool]],
                  tmp_root: Path, side_port: int) -> None:
    """The starts :func:`measure_startup` makes, each with the command it would run (in a cache directory
    still to be made)."""
    from pdserve_bench.systems import ServedApp, model_path

    drop, source = _flag(opts, "drop"), args.prefill_config.model_loading_config.model_source
    plan.set(timeout_s=float(opts.get("timeout_s", 900)), drop_page_cache=drop, keep_caches=_flag(opts, "keep", False),
             drop_caches_writable=os.access("/proc/sys/vm/drop_caches", os.W_OK), tmp_dir=str(tmp_root),
             cpus=len(os.sched_getaffinity(0)), model_source=source or "embedded")
    a = args.model_copy(deep=True)
    a.cache_dir = str(tmp_root / "pdserve-startup-cache-NEW")
    runs = [(label, a, drop_now) for label, drop_now in steps]
    if _flag(opts, "compile"):
        runs += [(label, _compiled(a), False) for label in ("compile-cold", "compile-warm")]
    for label, b, drop_now in runs:
        cmd, _, core = engine_command(b, label, model_path(b), side_port)
        plan.system(f"engine {label}", {"kind": "one engine (the prefill command)", "core": core, "argv": cmd.argv,
                                        "cache_dir": "a new directory, shared by the engine starts"})
        plan.phase(f"engine {label}", system=f"engine {label}", drop_page_cache=drop_now,
                   measures="log marks and /health every 0.1 s")
    if drop and (not source or source.startswith("pdserve:")):
        plan.phase("raw read", system=None, measures="a sequential read of the weights, page cache dropped")
    if _flag(opts, "app"):
        b = args.model_copy(deep=True)
        b.cache_dir = str(tmp_root / "pdserve-startup-app-NEW")
        plan.system("app", ServedApp(b), cache_dir="a new directory")
        for label, drop_now in (("cold", drop), ("warm", False)):
            plan.phase(f"app {label}", system="app", drop_page_cache=drop_now, measures="pdserve serve's progress lines")


def measure_startup(args: PDServeArgs, opts: dict[str, Any], plan: Any = None) -> dict[str, Any]:
    """The scenario; with a dry-run ``plan`` (:class:`pdserve_bench.plan.Plan`), returns the plan without
    starting anything or making the cache directories."""
    from pdserve.engine.allocator import free_ephemeral_port

    timeout_s = float(opts.get("timeout_s", 900))
    drop = _flag(opts, "drop")
    keep = _flag(opts, "keep", False)
    tmp_root = Path(opts.get("tmp_dir") or tempfile.gettempdir())
    source = args.prefill_config.model_loading_config.model_source
    steps = [("cold", drop), ("restart", drop), ("warm", False)] if drop else [("cold", False), ("warm", False)]
    side_port = free_ephemeral_port()
    if plan is not None:
        _plan_startup(plan, args, opts, steps, tmp_root, side_port)
        if plan.dry_run:
            return dict(plan.as_dict())
    log_dir = Path(tempfile.gettempdir()) / "pdserve-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "model_source": source or "embedded",
                           "engine": {}}
    cache = Path(tempfile.mkdtemp(prefix="pdserve-startup-cache-", dir=tmp_root))
    app_caches: list[Path] = []
    try:
        a = args.model_copy(deep=True)
        a.cache_dir = str(cache)
        for label, drop_now in steps:
            out["engine"][label] = engine_start(a, label, log_dir, drop=drop_now, timeout_s=timeout_s,
                                                 side_port=side_port)
        if _flag(opts, "compile"):
            c = _compiled(a)
            for label in ("compile-cold", "compile-warm"):
                out["engine"][label] = engine_start(c, label, log_dir, drop=False, timeout_s=timeout_s,
                                                     side_port=side_port)
        from pdserve.model.embedded import embedded_model_dir

        if drop and (not source or source.startswith("pdserve:")):
            out["raw_read"] = raw_read(embedded_model_dir(a.cache_dir))
        if _flag(opts, "app"):
            out["app"] = {}
            app_cache = Path(tempfile.mkdtemp(prefix="pdserve-startup-app-", dir=tmp_root))
            app_caches.append(app_cache)
            b = args.model_copy(deep=True)
            b.cache_dir = str(app_cache)
            for label, drop_now in (("cold", drop), ("warm", False)):
                out["app"][label] = app_start(b, label, drop=drop_now, timeout_s=timeout_s)
    finally:
        if not keep:
            shutil.rmtree(cache, ignore_errors=True)
            for c in app_caches:
                shutil.rmtree(c, ignore_errors=True)
    out["summary"] = summarize_startup(out)
    return out


def summarize_startup(result: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    eng = result.get("engine") or {}
    for label, r in eng.items():
        s[f"engine_{label}"] = {"total_s": round(r["total_s"], 2), "prepare_s": round(r["prepare_s"], 2),
                                "ready_s": round(r["ready_s"], 2),
                                "weights_phase_s": round(r["phases"].get("weights", 0.0), 2),
                                "vllm_loading_weights_s": r["reported"].get("loading_weights_s"),
                                "compile_cache": r.get("compile_cache"),
                                "compile_cache_files_before": r.get("compile_cache_files_before"),
                                "weights_resident_before": r.get("weights_resident_before")}
    for label, r in (result.get("app") or {}).items():
        s[f"app_{label}"] = {"ready_s": round(r["ready_s"], 2), "stop_s": round(r.get("stop_s", 0.0), 2),
                             **{k: round(v, 2) for k, v in r["phases"].items()}}
    if "cold" in eng and "warm" in eng:
        s["engine_cold_over_warm"] = eng["cold"]["total_s"] / eng["warm"]["total_s"]
    drops = [r["page_cache"] for grp in ("engine", "app") for r in (result.get(grp) or {}).values()
             if isinstance(r, dict) and "page_cache" in r]
    if drops:
        s["page_cache_dropped"] = all(d["ok"] for d in drops)
    return s


# --- plot ------------------------------------------------------------------------------------------------


def stacked_rows(result: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """(label, {phase: seconds}) per measured start, model preparation first; what the plot and the
    summary show."""
    rows: list[tuple[str, dict[str, float]]] = []
    for group in ("engine", "app"):
        for cond, r in (result.get(group) or {}).items():
            if not isinstance(r, dict) or "phases" not in r:
                continue
            phases = dict(r["phases"])
            if group == "engine":
                phases = {"model preparation": r.get("prepare_s", 0.0), **phases}
            rows.append((f"{group}: {cond}", phases))
    return rows


def plot_startup(result: dict[str, Any], out: Path) -> Path:
    """Horizontal stacked bars: one per start, one segment per phase (seconds)."""
    from pdserve_bench.plots import _plt, _save

    rows = stacked_rows(result)
    plt = _plt()
    names: list[str] = []
    for _, phases in rows:
        for k in phases:
            if k not in names:
                names.append(k)
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Set2").colors
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 2.4))
    drawn: set[str] = set()
    # Top to bottom in the order measured; each bar stacks its own phases in the order they happen.
    for y, (_, phases) in enumerate(reversed(rows)):
        left = 0.0
        for name, width in phases.items():
            ax.barh(y, width, left=left, color=colors[names.index(name) % len(colors)], edgecolor="white",
                    label=None if name in drawn else name)
            drawn.add(name)
            left += width
        ax.text(left, y, f" {left:.1f}s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)])
    ax.set_xlabel("seconds from start to ready")
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: names.index(labels[i]))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    ax.set_title(f"time to ready by phase, {result.get('cpus', '?')} CPU cores "
                 "(cold: empty cache + page cache dropped)")
    return _save(plt, fig, out)
