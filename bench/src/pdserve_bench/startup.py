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

Then (``--opt app=0`` skips it) the whole app, ``pdserve serve`` with a fresh ``cache_dir``, cold and warm.

Phases come from the engine's own log lines, timed on arrival (the engine writes them unbuffered), and
from ``/health`` polled every 0.1 s; vLLM's own figures ("Loading weights took ...") are kept next to them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.process import EngineProcess
from pdserve.errors import EngineStartError
from pdserve_bench.systems import _say

#: Engine log marks, in the order vLLM reaches them. A mark with several patterns takes the latest match
#: (on GPU "Model loading took" follows "Loading weights took" and covers more of the loading).
ENGINE_MARKS: list[tuple[str, tuple[str, ...]]] = [
    ("api_server", (r"\(APIServer pid=\d+\)",)),
    # vLLM inspects the model class in a subprocess unless VLLM_CACHE_ROOT/modelinfos has it.
    ("arch_resolved", (r"Resolved architecture:",)),
    ("engine_core", (r"Initializing a V1 LLM engine",)),
    ("load_start", (r"Starting to load model",)),
    ("weights_loaded", (r"Loading weights took [\d.]+ seconds", r"Model loading took [\d.]+ GiB")),
    ("engine_ready", (r"init engine \(profile, create kv cache, warmup model\) took",)),
    ("server_up", (r"Starting vLLM server on",)),
]

#: Phases of one engine start: (name, the mark that ends it); each starts where the previous one ended.
ENGINE_PHASES: list[tuple[str, str]] = [
    ("python + vLLM import", "api_server"),
    ("model inspection", "arch_resolved"),
    ("engine process start", "engine_core"),
    ("worker start", "load_start"),
    ("weights", "weights_loaded"),
    ("profile + KV cache + compile/warmup", "engine_ready"),
    ("API server start", "server_up"),
    ("/health answers", "health"),
]

#: ``pdserve serve`` progress lines (stdout and stderr together).
APP_MARKS: list[tuple[str, tuple[str, ...]]] = [
    ("config", (r"\[1/4\] config",)),
    ("model_ready", (r"model ready:", r"\[2/4\] model: prepared on each")),
    ("ray_started", (r"\[4/4\] deploying",)),
    ("ready", (r"^pdserve ready:",)),
]

APP_PHASES: list[tuple[str, str]] = [
    ("start + config", "config"),
    ("model preparation", "model_ready"),
    ("Ray start", "ray_started"),
    ("engines + router", "ready"),
]

#: vLLM's own startup figures, as it logs them.
REPORTED: dict[str, str] = {
    "initializing_model_s": r"Initializing model took ([\d.]+) seconds",
    "loading_weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "model_loading_gib": r"Model loading took ([\d.]+) GiB",
    "memory_profiling_s": r"Memory profiling takes ([\d.]+) seconds",
    "dynamo_transform_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_cache_load_s": r"Directly load the compiled graph\(s\) for compile range .* took ([\d.]+) s",
    "graph_compile_s": r"Compiling a graph for compile range .* takes ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "profiling_warmup_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "compilation_s": r"init engine .* took [\d.]+ s \(compilation: ([\d.]+) s",
}


# --- parsing and phase arithmetic (pure) ----------------------------------------------------------------


def find_marks(lines: list[tuple[float, str]], t0: float,
               spec: list[tuple[str, tuple[str, ...]]] = ENGINE_MARKS) -> dict[str, float]:
    """Seconds after ``t0`` at which each mark's line arrived (first line per pattern; the latest pattern
    of a mark wins). Marks never seen are absent."""
    compiled = [(name, [re.compile(p) for p in pats]) for name, pats in spec]
    first: dict[tuple[str, int], float] = {}
    for t, text in lines:
        for name, pats in compiled:
            for i, pat in enumerate(pats):
                if (name, i) not in first and pat.search(text):
                    first[(name, i)] = t - t0
    out: dict[str, float] = {}
    for (name, _), t in first.items():
        out[name] = max(out.get(name, t), t)
    return out


def phase_durations(marks: dict[str, float], spec: list[tuple[str, str]] = ENGINE_PHASES) -> dict[str, float]:
    """Consecutive phases from 0 to the last mark found. A phase whose mark is missing is left out and its
    time goes to the next phase found; a mark earlier than the one before it counts as 0 s. The phases
    add up to the last mark of ``spec`` that was found."""
    out: dict[str, float] = {}
    prev = 0.0
    for name, mark in spec:
        if mark not in marks:
            continue
        t = marks[mark]
        out[name] = max(0.0, t - prev)
        prev = max(prev, t)
    return out


def parse_reported(lines: list[str] | str) -> dict[str, float]:
    """vLLM's own startup figures (``REPORTED``) from its log; the first occurrence of each, summed for
    per-graph figures (compile, cache load)."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    out: dict[str, float] = {}
    for key, pat in REPORTED.items():
        found = [float(m.group(1)) for m in re.finditer(pat, text)]
        if not found:
            continue
        out[key] = sum(found) if key in ("graph_compile_s", "compile_cache_load_s") else found[0]
    return out


def compile_cache_state(lines: list[str] | str) -> str:
    """What vLLM's log says of its compile cache: ``hit`` (loaded from VLLM_CACHE_ROOT), ``miss`` (compiled,
    saved), ``failed load`` (found, could not load, compiled again), ``eager`` (no torch.compile), or
    ``not logged`` (the CPU path without AOT compilation logs neither)."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    if "Compiling model again due to a load failure" in text:
        return "failed load"
    if "Directly load AOT compilation from path" in text or "Directly load the compiled graph" in text:
        return "hit"
    if "saved AOT compiled function" in text or "Compiling a graph for compile range" in text:
        return "miss"
    if "Enforce eager set" in text:
        return "eager"
    return "not logged"


def _count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if path.exists() else 0


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


# --- page cache ------------------------------------------------------------------------------------------


def _cached_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def drop_page_cache(fallback_files: list[Path] | None = None) -> dict[str, Any]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root and a writable /proc/sys); when refused,
    evicts ``fallback_files`` with posix_fadvise(DONTNEED) instead."""
    before = _cached_mb()
    os.sync()
    out: dict[str, Any] = {"cached_mb_before": before}
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        out.update(method="drop_caches", ok=True)
    except OSError as e:
        out.update(method="fadvise", ok=False, error=f"drop_caches: {e.strerror or e}")
        evicted = 0
        for f in fallback_files or []:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                evicted += 1
            finally:
                os.close(fd)
        out["fadvise_files"] = evicted
    out["cached_mb_after"] = _cached_mb()
    return out


def resident_fraction(path: Path) -> float | None:
    """Share of a file's pages in the page cache (mincore), or None where that cannot be asked."""
    import ctypes
    import mmap

    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(b & 1 for b in vec.raw[:pages]) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


# --- one engine start ------------------------------------------------------------------------------------


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


def _engine_command(args: PDServeArgs, label: str, model: str, side_port: int) -> tuple[Any, Any, int]:
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


def _engine_start(args: PDServeArgs, label: str, log_dir: Path, *, drop: bool, timeout_s: float,
                  side_port: int) -> dict[str, Any]:
    from pdserve.model.embedded import embedded_model_dir, is_prepared
    from pdserve.model.resolve import resolve_model

    out: dict[str, Any] = {"cache_dir": args.cache_dir}
    model_dir = embedded_model_dir(args.cache_dir)
    if drop:
        out["page_cache"] = drop_page_cache(_weight_files(model_dir))
        _say(f"{label}: page cache {out['page_cache']['method']}"
             f"{'' if out['page_cache']['ok'] else ' (drop_caches refused: ' + out['page_cache']['error'] + ')'}")
    source = args.prefill_config.model_loading_config.model_source
    prepared = is_prepared(model_dir)
    _say(f"{label}: model {'found in the cache' if prepared else 'not in the cache: preparing'}")
    t = time.monotonic()
    model = resolve_model(source, lambda m: _say(f"  {label}: {m}"), cache_dir=args.cache_dir)
    out["prepare_s"] = time.monotonic() - t
    out["prepare"] = "found" if prepared else "converted"
    weights = _weight_files(Path(model))
    out["weights_bytes"] = sum(w.stat().st_size for w in weights)
    res = [resident_fraction(w) for w in weights]
    out["weights_resident_before"] = None if not res or None in res else sum(res) / len(res)  # type: ignore[arg-type]
    cmd, placement, core = _engine_command(args, label, model, side_port)
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


def _raw_read(model_dir: Path) -> dict[str, Any]:
    """Sequential read of the weights right after dropping the page cache: what the disk alone costs."""
    files = _weight_files(model_dir)
    drop = drop_page_cache(files)
    t = time.monotonic()
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                n += len(chunk)
    s = time.monotonic() - t
    t = time.monotonic()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass
    hot = time.monotonic() - t
    return {"bytes": n, "cold_s": s, "cold_mb_per_s": n / 1e6 / s if s else None, "hot_s": hot,
            "hot_mb_per_s": n / 1e6 / hot if hot else None, "page_cache": drop}


# --- the whole app -----------------------------------------------------------------------------------------


def _app_start(args: PDServeArgs, label: str, *, drop: bool, timeout_s: float) -> dict[str, Any]:


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
        app.stop()
    out["marks"] = marks
    out["phases"] = phase_durations(marks, APP_PHASES)
    out["ready_s"] = marks["ready"]
    out["exit_code"] = app.proc.returncode if app.proc is not None else None
    _say(f"app {label}: ready in {out['ready_s']:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in out['phases'].items())})")
    return out


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
        cmd, _, core = _engine_command(b, label, model_path(b), side_port)
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
            out["engine"][label] = _engine_start(a, label, log_dir, drop=drop_now, timeout_s=timeout_s,
                                                 side_port=side_port)
        if _flag(opts, "compile"):
            c = _compiled(a)
            for label in ("compile-cold", "compile-warm"):
                out["engine"][label] = _engine_start(c, label, log_dir, drop=False, timeout_s=timeout_s,
                                                     side_port=side_port)
        from pdserve.model.embedded import embedded_model_dir

        if drop and (not source or source.startswith("pdserve:")):
            out["raw_read"] = _raw_read(embedded_model_dir(a.cache_dir))
        if _flag(opts, "app"):
            out["app"] = {}
            app_cache = Path(tempfile.mkdtemp(prefix="pdserve-startup-app-", dir=tmp_root))
            app_caches.append(app_cache)
            b = args.model_copy(deep=True)
            b.cache_dir = str(app_cache)
            for label, drop_now in (("cold", drop), ("warm", False)):
                out["app"][label] = _app_start(b, label, drop=drop_now, timeout_s=timeout_s)
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
        s[f"app_{label}"] = {"ready_s": round(r["ready_s"], 2),
                             **{k: round(v, 2) for k, v in r["phases"].items()}}
    if "cold" in eng and "warm" in eng:
        s["engine_cold_over_warm"] = eng["cold"]["total_s"] / eng["warm"]["total_s"]
    drops = [r["page_cache"] for grp in ("engine", "app") for r in (result.get(grp) or {}).values()
             if isinstance(r, dict) and "page_cache" in r]
    if drops:
        s["page_cache_dropped"] = all(d["ok"] for d in drops)
    return s


# --- plot ------------------------------------------------------------------------------------------------


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
