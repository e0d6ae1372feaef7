"""The dtype CPU engines compute in: bf16 only where it is faster (:mod:`.cpu_host`) **and** faithful to
the model in float32 (:mod:`.dtype_fidelity`); decided once per app."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine import cpu_host, dtype_fidelity
from pdserve.engine.cpu_host import CpuProbeError, MatmulProbe, speed_sentence
from pdserve.engine.dtype_fidelity import FidelityProbe

if TYPE_CHECKING:
    from pdserve.config.schema import PDServeArgs


def model_fidelity(args: PDServeArgs) -> FidelityProbe:
    """The fidelity probe of the app's model on this host (cached); :class:`CpuProbeError` when the model
    is not on this host yet or cannot be probed."""
    source = args.prefill_config.model_loading_config.model_source
    where: Path | None = dtype_fidelity.local_model_dir(source, args.cache_dir)
    if where is None:
        raise CpuProbeError("the model is not on this host yet")
    return dtype_fidelity.probe_fidelity(where, args.cache_dir)


def resolve_cpu_dtype(args: PDServeArgs, *, probe: Callable[[], MatmulProbe] | None = None,
                      fidelity: Callable[[], FidelityProbe] | None = None) -> tuple[PDServeArgs, str]:
    """The config with the CPU engines' dtype decided, and why, in one sentence.

    Both roles always get the same dtype: the KV cache layout must match across NIXL, so this runs once
    per app (the builder, ``validate --show-engines`` and ``serve`` all call it), never per replica. An
    ``engine_kwargs.dtype`` in the config always wins (the schema already makes both roles agree); else
    ``cpu.dtype``. ``auto`` takes bf16 only where :func:`~.cpu_host.probe_matmul` finds its matmuls no
    slower than fp32 (when that probe cannot run: where the CPU has native bf16 instructions) **and**
    :func:`model_fidelity` finds it faithful to the model; where fidelity cannot be measured (a model not
    on this host, or too big to load twice) speed decides and the reason says so. ``probe`` and
    ``fidelity`` replace the two probes (tests, callers that hold them). ``args`` is never changed (a copy
    gets the dtype).

    On a multi-node CPU cluster the probes run where this is called (the Serve driver), which is assumed
    to be the same kind of CPU as the engine nodes.
    """
    pk, dk = args.prefill_config.engine_kwargs, args.decode_config.engine_kwargs
    given = pk.get("dtype", dk.get("dtype"))
    if given is not None:
        return args, f"engine_kwargs.dtype {given} (set in the config)"
    if args.cpu.dtype != "auto":
        dtype, reason = args.cpu.dtype, f"cpu.dtype {args.cpu.dtype} (set in the config)"
    else:
        try:
            p = probe() if probe is not None else cpu_host.probe_matmul(args.cache_dir)
            dtype, speed = p.dtype, speed_sentence(p)
        except CpuProbeError as e:
            isa = cpu_host.cpu_isa()
            dtype = "bfloat16" if {"amx_bf16", "avx512_bf16"} & set(isa["flags"]) else "float32"
            speed = f"{e}; chose from the CPU flags ({isa['label']})"
        if dtype == "float32":
            reason = f"{speed} -> float32"
        else:
            try:
                f = fidelity() if fidelity is not None else model_fidelity(args)
            except CpuProbeError as e:
                reason = f"{speed}; bf16 fidelity not measured ({e}) -> bfloat16"
            else:
                dtype = "bfloat16" if f.faithful else "float32"
                reason = f"{speed}, {'and' if f.faithful else 'but'} {dtype_fidelity.sentence(f)} -> {dtype}"
    out = args.model_copy(deep=True)
    out.prefill_config.engine_kwargs["dtype"] = dtype
    out.decode_config.engine_kwargs["dtype"] = dtype
    return out, reason

