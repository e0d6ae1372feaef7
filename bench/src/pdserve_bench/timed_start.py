"""One measured start for ``--scenario startup``: an engine (the prefill command pdserve would run, its log
lines timed on arrival, ``/health`` polled every 0.1 s), or the whole app (``pdserve serve``'s progress
lines); each returns its marks, phases and what surrounded it (page cache, model preparation, caches)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.process import EngineProcess
from pdserve.errors import EngineStartError
from pdserve_bench.page_cache import drop_page_cache, resident_fraction, weight_files
from pdserve_bench.startup_log import (
    APP_MARKS,
    APP_PHASES,
    compile_cache_state,
    find_marks,
    parse_reported,
    phase_durations,
)
from pdserve_bench.systems import _say

# --- one engine -----------------------------------------------------------------------------------------


def _count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if path.exists() else 0


class TimedEngine(EngineProcess):
    """An engine process whose output lines are kept with their arrival time."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.lines: list[tuple[float, str]] = []
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        super().start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "ab") as f:
            for line in self.proc.stdout:
                now = time.monotonic()
                f.write(line)
                f.flush()
                text = line.decode(errors="replace").rstrip()
                self.lines.append((now, text))
                self.tail.append(text)


def _wait_ready(proc: TimedEngine, timeout_s: float, label: str) -> dict[str, float]:
    said: set[str] = set()
    while True:
        marks = find_marks(list(proc.lines), proc.t0)
        for name, t in sorted(marks.items(), key=lambda kv: kv[1]):
            if name not in said:
                said.add(name)
                _say(f"  {label}: {name} at {t:.1f}s")
        if proc.healthy(timeout=1.0):
            marks["health"] = time.monotonic() - proc.t0
            _say(f"  {label}: /health 200 at {marks['health']:.1f}s")
            return marks
        if not proc.alive():
            raise EngineStartError(f"{label}: engine exited during startup; log: {proc.log_path}\n"
                                   + "\n".join(list(proc.tail)[-20:]))
        if time.monotonic() - proc.t0 > timeout_s:
            raise EngineStartError(f"{label}: not ready after {timeout_s:.0f}s; log: {proc.log_path}")
        time.sleep(0.1)


def engine_command(args: PDServeArgs, label: str, model: str, side_port: int) -> tuple[Any, Any, int]:
    """(command, placement, core) of one measured engine start: the prefill command pdserve would run."""
    from pdserve.engine.allocator import free_ephemeral_port, usable_cores
    from pdserve.engine.launcher import EnginePlacement, build_engine_command

    core = usable_cores()[0]
    # The same NIXL side-channel port and core every time: vLLM's torch.compile cache key includes
    # VLLM_NIXL_SIDE_CHANNEL_PORT and VLLM_CPU_OMP_THREADS_BIND (vllm.envs.compile_factors).
    placement = EnginePlacement(http_port=free_ephemeral_port(), side_channel_port=side_port,
                                side_channel_host="127.0.0.1", engine_id=f"startup-{label}", cores=[core],
                                on_cpu=True)
    return build_engine_command("prefill", args, model, placement), placement, core


def engine_start(args: PDServeArgs, label: str, log_dir: Path, *, drop: bool, timeout_s: float,
                 side_port: int) -> dict[str, Any]:
    """One engine start in ``args.cache_dir``: the page cache dropped first when ``drop``, the model prepared
    (timed apart), then the engine from its first line to ``/health``; stopped once ready."""
    from pdserve.model.embedded import embedded_model_dir, is_prepared
    from pdserve.model.resolve import resolve_model

    out: dict[str, Any] = {"cache_dir": args.cache_dir}
    model_dir = embedded_model_dir(args.cache_dir)
    if drop:
        out["page_cache"] = drop_page_cache(weight_files(model_dir))
        _say(f"{label}: page cache {out['page_cache']['method']}"
             f"{'' if out['page_cache']['ok'] else ' (drop_caches refused: ' + out['page_cache']['error'] + ')'}")
    source = args.prefill_config.model_loading_config.model_source
    prepared = is_prepared(model_dir)
    _say(f"{label}: model {'found in the cache' if prepared else 'not in the cache: preparing'}")
    t = time.monotonic()
    model = resolve_model(source, lambda m: _say(f"  {label}: {m}"), cache_dir=args.cache_dir)
    out["prepare_s"] = time.monotonic() - t
    out["prepare"] = "found" if prepared else "converted"
    weights = weight_files(Path(model))
    out["weights_bytes"] = sum(w.stat().st_size for w in weights)
    res = [resident_fraction(w) for w in weights]
    out["weights_resident_before"] = None if not res or None in res else sum(res) / len(res)  # type: ignore[arg-type]
    cmd, placement, core = engine_command(args, label, model, side_port)
    out["cache_env"] = {k: v for k, v in cmd.env.items() if k in ("PDSERVE_CACHE_DIR", "HF_HOME", "VLLM_CACHE_ROOT")}
    vllm_cache = out["cache_env"].get("VLLM_CACHE_ROOT")
    if vllm_cache:
        # vLLM's own compile cache, and Inductor's and Triton's under it (pdserve/model/cache.py).
        out["compile_cache_files_before"] = sum(_count_files(Path(vllm_cache) / d)
                                                for d in ("torch_compile_cache", "inductor", "triton"))
    log_path = log_dir / f"startup-{label}.log"
    log_path.unlink(missing_ok=True)
    proc = TimedEngine(cmd, f"http://127.0.0.1:{placement.http_port}", log_path, f"startup {label}")
    _say(f"{label}: starting the engine on core {core} (weights {100 * (out['weights_resident_before'] or 0):.0f}% "
         "in the page cache)")
    proc.start()
    try:
        marks = _wait_ready(proc, timeout_s, label)
    finally:
        proc.stop()
    out["marks"] = marks
    out["phases"] = phase_durations(marks)
    out["ready_s"] = marks["health"]
    out["total_s"] = out["prepare_s"] + marks["health"]
    out["reported"] = parse_reported([text for _, text in proc.lines])
    out["compile_cache"] = compile_cache_state([text for _, text in proc.lines])
    out["log"] = str(log_path)
    _say(f"{label}: ready in {out['ready_s']:.1f}s after {out['prepare_s']:.1f}s of model preparation; "
         f"compile cache {out['compile_cache']}; vLLM: {out['reported']}")
    return out


# --- the whole app ---------------------------------------------------------------------------------------


def app_start(args: PDServeArgs, label: str, *, drop: bool, timeout_s: float) -> dict[str, Any]:
    """``pdserve serve`` in ``args.cache_dir`` from its start to ready, phased by its progress lines; stopped
    once ready (Ctrl-C's signal), and the stop timed to the exit (``stop_s``)."""
    out: dict[str, Any] = {"cache_dir": args.cache_dir}
    if drop:
        out["page_cache"] = drop_page_cache()
    from pdserve.testing.served import ServedProcess

    app = ServedProcess(args).start()
    t0 = app.started_at
    _say(f"app {label}: pdserve serve on port {app.port}, cache {args.cache_dir}")
    marks: dict[str, float] = {}
    said = 0

    def progress() -> None:
        nonlocal said, marks
        lines = list(app.timed_lines)
        for _, text in lines[said:]:
            if text.startswith("[pdserve] ["):
                _say(f"  app {label}: {text[len('[pdserve] '):]}")
        said = len(lines)
        marks = find_marks(lines, t0, APP_MARKS)

    try:
        app.wait_ready(timeout_s, poll=progress)
        progress()
    finally:
        t_stop = time.monotonic()
        app.stop()
        out["stop_s"] = time.monotonic() - t_stop
    out["marks"] = marks
    out["phases"] = phase_durations(marks, APP_PHASES)
    out["ready_s"] = marks["ready"]
    out["exit_code"] = app.proc.returncode if app.proc is not None else None
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in out["phases"].items())
    _say(f"app {label}: ready in {out['ready_s']:.1f}s ({phases}); stopped in {out['stop_s']:.1f}s")
    return out
