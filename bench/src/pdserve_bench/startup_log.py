"""What an engine's and ``pdserve serve``'s startup logs say: the marks each start passes, timed on arrival,
the phases between them, vLLM's own startup figures and the state of its compile cache. Pure: recorded lines
in, figures out."""

from __future__ import annotations

import re

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
