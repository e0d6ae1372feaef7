"""Where the engines run and how they compute: the app's placement facts, decided in one place.

- **CPU or GPU** for the whole app (:func:`cpu_only_cluster`), and for one replica on its node
  (:func:`replica_on_gpu`);
- **the CPU engines' dtype**, once for the whole app (:func:`decide`): every replica of both roles must
  compute in the same dtype (the KV layout crosses NIXL), so no replica probes its own host and chooses on its
  own (the speed and fidelity probes: engine/cpu_dtype.py);
- **ranks per engine** (GPUs, data-parallel ranks): :mod:`pdserve.config.resources`, from the engine arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.resources import asks_for_gpus
from pdserve.config.schema import PDServeArgs


@dataclass(frozen=True)
class Placement:
    #: The config, with the CPU engines' dtype filled in when they run on CPU.
    args: PDServeArgs
    on_cpu: bool
    #: Why the CPU engines compute in their dtype (probe figures or the config's choice); None on GPU.
    dtype_reason: str | None = None

    @property
    def dtype(self) -> str | None:
        return self.args.prefill_config.engine_kwargs.get("dtype") if self.on_cpu else None


def decide(args: PDServeArgs, *, on_cpu: bool | None = None) -> Placement:
    """The app's placement: CPU or GPU (``on_cpu``, else :func:`cpu_only_cluster`), and on CPU the dtype.
    Idempotent: a config whose dtype is set keeps it."""
    if on_cpu is None:
        on_cpu = cpu_only_cluster(args)
    if not on_cpu:
        return Placement(args, False)
    from pdserve.engine.cpu_dtype import resolve_cpu_dtype

    resolved, reason = resolve_cpu_dtype(args)
    return Placement(resolved, True, reason)


def cpu_only_cluster(args: PDServeArgs | None = None) -> bool:
    """True when the engines are to run on CPU, i.e. get nominal Ray reservations and no GPU.

    With Ray initialised (``serve run FILE``, ``serve deploy``, KubeRay, ``pdserve serve``: the builder runs
    in or against the cluster), the cluster decides: CPU only when it has no GPU at all. Without Ray
    (``serve run pdserve:build_pd_openai_app key=value`` builds before it connects, or a plain Python
    call), the config decides: GPUs only when it asks for them (``accelerator_type``, ``num_gpus``, GPU
    placement bundles, ``kv_buffer_device: cuda``). The host that builds the app is not asked: it is not
    necessarily where the engines run.
    """
    ray_gpus = _ray_cluster_gpus()
    if ray_gpus is not None:
        return ray_gpus == 0
    return not asks_for_gpus(args if args is not None else PDServeArgs())


def _ray_cluster_gpus() -> float | None:
    """GPUs in the Ray cluster this process is connected to; ``None`` when Ray is not initialised."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return float(ray.cluster_resources().get("GPU", 0))


def replica_on_gpu() -> bool:
    """Whether the Ray replica calling this was given a GPU."""
    import ray

    try:
        return bool(ray.get_runtime_context().get_accelerator_ids().get("GPU"))
    except Exception:  # noqa: BLE001
        return False
