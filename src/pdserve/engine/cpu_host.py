"""What this CPU is good at: which dtype a CPU engine should compute in, measured, not assumed.

The machines pdserve runs on differ: some have AVX-512 BF16 / AMX, where bf16 matrix products are
fast; others only AVX2, where vLLM logs "Failed to create oneDNN linear, fallback to torch linear" and
torch's bf16 GEMM fallback is several times slower than fp32 (one 1500x576 @ 576x1536 linear on one
thread: fp32 75 ms, bf16 480 ms on a 2-core AMD EPYC). Running the model's own dtype (bf16 for the
packaged SmolLM2) regardless of host therefore costs a 6x slower prefill on the second kind. CPU flags
alone do not tell the answer (torch's kernels and the oneDNN build matter too), so :func:`probe_matmul`
times the very operation once per host and torch version, in a subprocess, and caches the result:

::

    <cache root>/host/cpu-probe.json     the matmul probe, one entry per (CPU model, ISA flags, torch)
    <cache root>/host/engine-speed.json  the last prefill speed the router measured on an engine

Speed is half of the choice: :mod:`pdserve.engine.dtype_fidelity` measures whether bf16 gives the model's
answers, and :mod:`pdserve.engine.cpu_dtype` decides from both.

This module imports no torch (nor anything heavy): ``pdserve validate`` and ``pdserve doctor`` read the
answer without loading torch into their own process. ``python -m pdserve.engine.cpu_host`` runs the probe
itself and prints its JSON (what :func:`probe_matmul` runs in the subprocess).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pdserve.errors import PDServeError
from pdserve.model.cache import cache_root

log = logging.getLogger("pdserve")
T = TypeVar("T")

#: The CPU flags that decide how fast a CPU engine's matrix products are (x86 and Arm names).
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",
)
#: Where the host's files live under the pdserve cache root.
HOST_SUBDIR = "host"
PROBE_FILE = "cpu-probe.json"
SPEED_FILE = "engine-speed.json"
#: The probe's linear layer: the shape quoted in DESIGN.md (a SmolLM2 MLP projection over ~1500 tokens).
PROBE_SHAPE = (1500, 576, 1536)
#: Longest the probe subprocess may take (torch's import alone takes a few seconds on a busy small host).
PROBE_TIMEOUT_S = 120.0
_FORMAT = 1


class CpuProbeError(PDServeError):
    """A probe could not run (torch missing or broken, the subprocess failed or timed out)."""


# -- the ISA -----------------------------------------------------------------------------------------


def cpu_isa(cpuinfo: str | None = None) -> dict[str, Any]:
    """This CPU's model name, vendor and the :data:`ISA_FLAGS` it has (from ``/proc/cpuinfo``).

    ``{"model": "AMD EPYC 7B13", "vendor": "AuthenticAMD", "flags": ["avx", "avx2", "fma", ...],
    "label": "AVX2"}``; empty strings / list where ``/proc/cpuinfo`` is missing (not Linux).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model = vendor = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key in ("model name", "Model name") and not model:
            model = value.strip()
        elif key in ("vendor_id", "CPU implementer") and not vendor:
            vendor = value.strip()
    present = [f for f in ISA_FLAGS if f in flags]
    return {"model": model, "vendor": vendor, "flags": present, "label": isa_label(present)}


def isa_label(flags: list[str] | set[str]) -> str:
    """The one name that matters for bf16 speed: AMX, AVX-512 BF16, AVX-512, AVX2, ... or ``?``."""
    f = set(flags)
    for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                        ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON"), ("avx", "AVX")):
        if flag in f:
            return label
    return "?"


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def probe_key(isa: dict[str, Any] | None = None, torch_version: str | None = None) -> str:
    """What a cached probe is valid for: the CPU model, its ISA flags and the torch build that ran it.

    A different host (or a VM moved to another CPU) or another torch measures again."""
    isa = isa if isa is not None else cpu_isa()
    tv = torch_version if torch_version is not None else _torch_version()
    return f"{isa['model'] or '?'}|{','.join(isa['flags'])}|torch {tv or '?'}"


# -- the probe ---------------------------------------------------------------------------------------


@dataclass
class MatmulProbe:
    """One timing of the probe's linear layer on one core, in fp32 and in bf16 (best of a few runs)."""

    cpu_model: str
    isa: list[str]
    torch_version: str
    fp32_ms: float
    bf16_ms: float
    ratio: float = 0.0  # bf16_ms / fp32_ms: > 1 means bf16 is slower
    dtype: str = ""  # choose_dtype()'s answer
    measured_at: str = ""  # ISO 8601, UTC
    shape: list[int] = field(default_factory=lambda: list(PROBE_SHAPE))

    def __post_init__(self) -> None:
        self.ratio = round(self.bf16_ms / self.fp32_ms, 3) if self.fp32_ms > 0 else float("inf")
        self.dtype = choose_dtype(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MatmulProbe:
        names = {"cpu_model", "isa", "torch_version", "fp32_ms", "bf16_ms", "measured_at", "shape"}
        p = cls(**{k: v for k, v in d.items() if k in names})
        if not (p.fp32_ms > 0 and p.bf16_ms > 0):
            raise ValueError(f"non-positive timings: {d}")
        return p


def choose_dtype(probe: MatmulProbe) -> str:
    """``bfloat16`` only where bf16 matmuls are really fast (no slower than fp32), else ``float32``.

    bf16 halves the weights' and the KV cache's memory, but where the CPU has no fast bf16 kernels it
    multiplies the prefill time; memory is rarely what a small CPU engine runs out of first."""
    return "bfloat16" if probe.bf16_ms <= probe.fp32_ms else "float32"


def dtype_reason(probe: MatmulProbe) -> str:
    """One sentence: what was measured and what follows, e.g. ``bf16 matmul 6.4x slower than fp32 on this
    CPU (AMD EPYC 7B13, AVX2; 480 vs 75 ms) -> float32``."""
    return f"{speed_sentence(probe)} -> {probe.dtype}"


def speed_sentence(probe: MatmulProbe) -> str:
    """What was measured, without the conclusion: ``bf16 matmul 6.4x slower than fp32 on this CPU (...)``."""
    r = probe.ratio
    if 0.95 <= r <= 1.05:
        speed = "about as fast as"
    elif r > 1:
        speed = f"{r:.1f}x slower than"
    else:
        speed = f"{1 / r:.1f}x faster than"
    where = ", ".join(x for x in (probe.cpu_model, isa_label(probe.isa)) if x)
    return f"bf16 matmul {speed} fp32 on this CPU ({where}; {_ms(probe.bf16_ms)} vs {_ms(probe.fp32_ms)} ms)"


def _ms(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def host_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where this host's measurements are cached (``<cache root>/host``)."""
    return cache_root(cache_dir) / HOST_SUBDIR


def probe_file(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return host_dir(cache_dir) / PROBE_FILE


def probe_matmul(cache_dir: str | os.PathLike[str] | None = None, *, refresh: bool = False) -> MatmulProbe:
    """This host's matmul probe: from the cache when one matches :func:`probe_key`, else measured now.

    The measurement runs in a subprocess (``python -m pdserve.engine.cpu_host``), so the caller never
    imports torch and the probe's thread and core settings stay out of the caller's process. A cache that
    cannot be read or written is reported and otherwise ignored. Raises :class:`CpuProbeError` when the
    probe itself cannot run.
    """
    isa = cpu_isa()
    key = probe_key(isa)
    path = probe_file(cache_dir)
    entries = read_json(path).get("probes", {}) if path.exists() else {}
    if not refresh and isinstance(entries, dict) and key in entries:
        try:
            return MatmulProbe.from_dict(entries[key])
        except (TypeError, ValueError) as e:
            log.warning("pdserve: ignoring a bad CPU probe entry in %s (%s); probing again", path, e)
    probe = _run_probe()
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = asdict(probe)
    write_json(path, {"format": _FORMAT, "probes": entries})
    return probe


def run_probe_process(args: list[str], what: str, parse: Callable[[dict[str, Any]], T], *,
                      env: dict[str, str], timeout_s: float) -> T:
    """Run ``python -m <args>`` (a probe that prints its result as JSON on its last line) and ``parse`` that
    line; :class:`CpuProbeError` naming ``what`` when it cannot run, fails, times out or prints nonsense."""
    argv = [sys.executable, "-m", *args]
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise CpuProbeError(f"the {what} took longer than {timeout_s:.0f} s") from e
    except OSError as e:
        raise CpuProbeError(f"cannot run the {what}: {e}") from e
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise CpuProbeError(f"the {what} failed (exit {r.returncode}): {tail[:300]}")
    try:
        return parse(json.loads(lines[-1]))
    except (TypeError, ValueError) as e:
        raise CpuProbeError(f"the {what} printed something unexpected: {lines[-1][:200]}") from e


def _run_probe() -> MatmulProbe:
    env = dict(os.environ)
    # One thread everywhere: the probe compares kernels, not how well a library spreads over cores.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return run_probe_process(["pdserve.engine.cpu_host"], "CPU matmul probe", MatmulProbe.from_dict, env=env,
                             timeout_s=PROBE_TIMEOUT_S)


def measure(*, reps: int = 5, budget_s: float = 0.5) -> MatmulProbe:
    """Time the probe's linear layer in this process (imports torch: the subprocess's side).

    One thread on one core; one warm-up per dtype (oneDNN builds its kernel on the first call), then the
    best of up to ``reps`` runs, stopping after two once a dtype has used ``budget_s``: under 2 s in all
    on an AVX2 host where one bf16 run takes ~0.5 s.
    """
    import time

    try:
        allowed = sorted(os.sched_getaffinity(0))
        # The last allowed core: engines claim cores from the first one up (pdserve/engine/allocator.py).
        os.sched_setaffinity(0, {allowed[-1]})
    except (AttributeError, OSError, IndexError):
        pass
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    m, k, n = PROBE_SHAPE
    x32, w32 = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    best: dict[str, float] = {}
    with torch.inference_mode():
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w = x32.to(dt), w32.to(dt)
            F.linear(x, w)
            times: list[float] = []
            while len(times) < reps and (len(times) < 2 or sum(times) < budget_s):
                t0 = time.perf_counter()
                F.linear(x, w)
                times.append(time.perf_counter() - t0)
            best[name] = min(times) * 1000.0
    isa = cpu_isa()
    return MatmulProbe(cpu_model=isa["model"], isa=isa["flags"], torch_version=str(torch.__version__),
                       fp32_ms=round(best["fp32"], 3), bf16_ms=round(best["bf16"], 3),
                       measured_at=_now())


# -- the engines' measured speed ---------------------------------------------------------------------


def record_engine_speed(cache_dir: str | os.PathLike[str] | None, *, dtype: str, prompt_tokens_per_s: float,
                        role: str, model: str) -> None:
    """Remember the prefill speed just measured on an engine (read back by ``pdserve doctor``).

    Only the latest measurement is kept, with this host's CPU beside it. Never raises: a speed that
    cannot be stored is merely not shown later."""
    isa = cpu_isa()
    write_json(cache_root(cache_dir) / HOST_SUBDIR / SPEED_FILE, {
        "format": _FORMAT, "dtype": dtype, "prompt_tokens_per_s": round(float(prompt_tokens_per_s), 1),
        "role": role, "model": model, "cpu_model": isa["model"], "isa": isa["label"], "measured_at": _now()})


def last_engine_speed(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The last :func:`record_engine_speed` record, ``None`` when there is none (or it is unreadable)."""
    path = cache_root(cache_dir) / HOST_SUBDIR / SPEED_FILE
    if not path.exists():
        return None
    rec = read_json(path)
    return rec if isinstance(rec.get("prompt_tokens_per_s"), (int, float)) else None


# -- files -------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("pdserve: ignoring unreadable %s (%s)", path, e)
        return {}
    if not isinstance(data, dict):
        log.warning("pdserve: ignoring %s: not a JSON object", path)
        return {}
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically (a reader never sees half a file); warn and go on when it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("pdserve: cannot write %s (%s); it will be measured again next time", path, e)


if __name__ == "__main__":
    print(json.dumps(asdict(measure())), flush=True)
