"""The dtype a benchmark's own engines compute in: the one ``pdserve serve`` would pick on this host
(``cpu.dtype: auto``), decided once per scenario so every system it compares computes alike."""

from __future__ import annotations

import json
from typing import Any

from pdserve.config.schema import PDServeArgs


def _cached_probe(cache_dir: str | None) -> Any:
    """This host's matmul probe when it is cached already (a dry run measures nothing), else None."""
    from pdserve.engine.cpu_host import MatmulProbe, probe_file, probe_key

    path = probe_file(cache_dir)
    try:
        entry = json.loads(path.read_text()).get("probes", {}).get(probe_key())
        return MatmulProbe.from_dict(entry) if isinstance(entry, dict) else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def with_dtype(args: PDServeArgs, *, dry_run: bool) -> tuple[PDServeArgs, str]:
    """``args`` with both roles' ``engine_kwargs.dtype`` decided as ``pdserve serve`` decides it, so the
    systems a scenario compares compute in one dtype; a dry run uses a cached probe only (otherwise the
    dtype stays open)."""
    from pdserve.engine.cpu_dtype import resolve_cpu_dtype

    pinned = args.cpu.dtype != "auto" or "dtype" in args.prefill_config.engine_kwargs
    if pinned:
        return resolve_cpu_dtype(args)
    if not dry_run:
        # As ``pdserve serve``: the model first, so that ``auto`` measures bf16's fidelity to it. On a fresh
        # host (the packaged model not converted yet) speed alone chose bf16 where it is not faithful.
        from pdserve.model.resolve import resolve_model

        resolve_model(args.prefill_config.model_loading_config.model_source, cache_dir=args.cache_dir,
                      download=True)
        return resolve_cpu_dtype(args)
    probe = _cached_probe(args.cache_dir)
    if probe is None:
        return args, "decided at start by cpu.dtype auto (a matmul probe on this host), the same for every system"
    return resolve_cpu_dtype(args, probe=lambda: probe)
