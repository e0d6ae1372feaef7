"""What one engine replica reserves: its GPUs and, when it spans several, its placement-group bundles.

One definition for everything that sizes engines: the app builder (the Ray Serve reservation),
``pdserve render`` (worker pods per GPU node, the bundles written into ``serveConfigV2``) and the doctor
(GPUs this host must have, NIXL side-channel ports).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.schema import LLMConfig, PDServeArgs

#: How the bundles of a multi-GPU engine are placed: all on one node (the ranks talk over NVLink/PCIe).
MULTI_GPU_STRATEGY = "STRICT_PACK"


def gpus_per_engine(cfg: LLMConfig) -> int:
    """GPUs one engine replica uses: ``tensor_parallel_size`` x ``pipeline_parallel_size``."""
    kw = cfg.engine_kwargs
    return int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))


def engine_ranks(cfg: LLMConfig) -> int:
    """Worker ranks of one engine replica (each opens its own NIXL side channel): GPUs x data parallel."""
    return max(1, gpus_per_engine(cfg) * int(cfg.engine_kwargs.get("data_parallel_size", 1)))


def multi_gpu_placement(cfg: LLMConfig) -> dict[str, Any] | None:
    """The placement group pdserve reserves for a GPU engine that spans several GPUs; ``None`` for one GPU.

    In the shape of ``placement_group_config``: one ``{GPU: 1, CPU: 1}`` bundle per GPU, all on one node.
    A config's own ``placement_group_config`` takes precedence over this (callers check it first).
    """
    n = gpus_per_engine(cfg)
    if n <= 1:
        return None
    return {"bundles": [{"GPU": 1, "CPU": 1} for _ in range(n)], "strategy": MULTI_GPU_STRATEGY}


def gpu_demand(cfg: LLMConfig) -> int:
    """GPUs one replica of this role explicitly asks for (0: nothing in the config needs a GPU).

    A GPU is asked for by ``accelerator_type``, ``ray_actor_options.num_gpus``, GPU placement bundles or
    ``kv_transfer_config.kv_buffer_device: cuda``; ``tensor_parallel_size`` alone is not a GPU request.
    """
    ranks = gpus_per_engine(cfg)
    want = 0
    if cfg.accelerator_type:
        want = ranks
    opts = cfg.deployment_config.ray_actor_options or {}
    if float(opts.get("num_gpus", 0) or 0) > 0:
        want = max(want, math.ceil(float(opts["num_gpus"])), ranks)
    if cfg.placement_group_config is not None:
        bundles = sum(float(b.get("GPU", 0)) for b in cfg.placement_group_config.bundles)
        if bundles > 0:
            want = max(want, math.ceil(bundles))
    kvt = cfg.engine_kwargs.get("kv_transfer_config") or {}
    if isinstance(kvt, dict) and kvt.get("kv_buffer_device") == "cuda":
        want = max(want, ranks)
    return want


def asks_for_gpus(args: PDServeArgs) -> bool:
    """True when the prefill or the decode engines explicitly ask for GPUs (see :func:`gpu_demand`)."""
    return any(gpu_demand(c) > 0 for c in (args.prefill_config, args.decode_config))
