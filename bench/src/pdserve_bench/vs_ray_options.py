"""``--scenario vs-ray-serve-llm``'s options (``--opt``), read and checked: the sizes, the concurrency sweep,
the systems and how Ray Serve LLM runs; and the name of each measured point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError
from pdserve_bench.vs_ray_report import SYSTEMS


@dataclass(frozen=True)
class Size:
    name: str
    prompt: int
    out: int

    def label(self) -> str:
        return f"{self.name} ({self.prompt} -> {self.out} tokens)"


def parse_sizes(text: str) -> list[Size]:
    """``long:600x32,short:16x8``: NAME:PROMPT_TOKENSxNEW_TOKENS, the sweep runs on the first."""
    sizes = []
    for part in str(text).replace(";", ",").split(","):
        if not part.strip():
            continue
        try:
            name, shape = part.split(":")
            prompt, out = shape.lower().split("x")
            size = Size(name.strip(), int(prompt), int(out))
        except ValueError:
            raise ConfigError(f"sizes: bad entry {part!r}; use NAME:PROMPTxOUT, e.g. long:600x32") from None
        if size.prompt < 1 or size.out < 1 or not size.name:
            raise ConfigError(f"sizes: bad entry {part!r}; use NAME:PROMPTxOUT, e.g. long:600x32")
        sizes.append(size)
    if not sizes or len({s.name for s in sizes}) != len(sizes):
        raise ConfigError(f"sizes {text!r}: give one or more distinct NAME:PROMPTxOUT")
    return sizes


def _ints(text: Any, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a list of integers") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"{what}: {text!r}: give positive integers")
    return list(dict.fromkeys(vals))


def _systems(text: Any) -> list[str]:
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ConfigError(f"systems: {text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def point(size: str, concurrency: int) -> str:
    return f"{size}_c{concurrency}"


@dataclass(frozen=True)
class Settings:
    """The scenario's options, read and checked (``--opt``)."""

    requests: int
    sizes: list[Size]
    concurrencies: list[int]
    sweep_requests: int
    systems: list[str]
    ray_env: str
    stream_batching_ms: float | None
    start_timeout_s: float
    paired: bool
    rounds: int

    @property
    def sweep(self) -> Size:
        """The size the concurrency sweep runs on: the first."""
        return self.sizes[0]


def read_settings(opts: dict[str, Any]) -> Settings:
    n = int(opts.get("requests", 10))
    sizes = parse_sizes(opts.get("sizes", "long:600x32,short:16x8"))
    concurrencies = _ints(opts.get("concurrencies", "1,2,4"), "concurrencies")
    per_point = int(opts.get("sweep_requests", 12))
    order = _systems(opts.get("systems", ",".join(SYSTEMS)))
    mode = str(opts.get("ray_env", "pdserve"))
    batching = opts.get("ray_stream_batching_ms")
    batching_ms = float(batching) if batching not in (None, "") else None
    start_timeout_s = float(opts.get("start_timeout_s", 900))
    paired = str(opts.get("paired", "1")).lower() not in ("0", "false", "no", "off") and {
        "pdserve", "colocated"} <= set(order)
    rounds = int(opts.get("rounds", 4))
    if rounds < 1:
        raise ConfigError("rounds must be >= 1")
    if n < 1 or per_point < 1:
        raise ConfigError("requests and sweep_requests must be >= 1")
    return Settings(n, sizes, concurrencies, per_point, order, mode, batching_ms, start_timeout_s, paired, rounds)
