"""Loaded by every Python process of a pdserve CPU engine (the engine's PYTHONPATH starts here).

Two fixes for small CPU hosts, both driven by environment variables the launcher sets:

1. ``PDSERVE_ENGINE_CORES``: vLLM's NIXL connector on CPU moves the worker's main thread to "the last
   core of each NUMA node" with ``os.sched_setaffinity``, ignoring the cores the process may use. With
   two engines on one host both workers land on the same core, where each one's idle busy-loop steals
   the other's compute. Every affinity request is clamped into the engine's own cores.

2. ``PDSERVE_NIXL_PTHR_DELAY_US``: NIXL's Python agent starts its progress thread with a poll delay of
   0, i.e. the thread spins and takes a whole core for itself. On a host where an engine has one core,
   that halves the engine's speed (decode TPOT 2x, measured). A positive delay makes the thread sleep
   in ``poll()`` between wake-ups. ``PDSERVE_NIXL_PROG_THREAD=0`` turns the thread off instead.
"""

from __future__ import annotations

import os
import sys


def _clamp_affinity() -> None:
    cores = os.environ.get("PDSERVE_ENGINE_CORES")
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    allowed = frozenset(int(c) for c in cores.split(",") if c.strip().isdigit())
    if not allowed:
        return
    original = os.sched_setaffinity

    def clamped(pid: int, mask: object) -> None:
        want = {int(c) for c in mask}  # type: ignore[attr-defined]
        original(pid, (want & allowed) or allowed)

    os.sched_setaffinity = clamped  # type: ignore[assignment]


def _patch_nixl_api(api: object) -> None:
    delay = os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US")
    prog = os.environ.get("PDSERVE_NIXL_PROG_THREAD")
    if prog is not None:
        cfg_cls = api.nixl_agent_config  # type: ignore[attr-defined]
        orig_cfg_init = cfg_cls.__init__

        def cfg_init(self: object, *a: object, **kw: object) -> None:
            orig_cfg_init(self, *a, **kw)
            self.enable_pthread = prog == "1"  # type: ignore[attr-defined]

        cfg_cls.__init__ = cfg_init
    if delay is not None:
        bind = api.nixlBind  # type: ignore[attr-defined]
        make_agent = bind.nixlAgent

        def agent(name: str, config: object) -> object:
            config.pthrDelay = int(delay)  # type: ignore[attr-defined]
            return make_agent(name, config)

        # nixl_agent.__init__ looks the constructor up on the module at call time.
        bind.nixlAgent = agent


class _AfterImport:
    """Patch ``nixl_cuXX._api`` right after it is first imported (without importing it ourselves)."""

    targets = frozenset({"nixl_cu12._api", "nixl_cu13._api"})

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name not in self.targets:
            return None
        import importlib.machinery

        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_and_patch(module: object, _exec=exec_module) -> None:
                    _exec(module)
                    try:
                        _patch_nixl_api(module)
                    except Exception as e:  # noqa: BLE001 - never break the engine over a tuning patch
                        print(f"[pdserve] NIXL tuning not applied: {e}", file=sys.stderr)

                loader.exec_module = exec_and_patch  # type: ignore[method-assign]
                return spec
        return importlib.machinery.PathFinder.find_spec(name, path, target)  # type: ignore[arg-type]


_clamp_affinity()
if os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US") is not None or os.environ.get("PDSERVE_NIXL_PROG_THREAD"):
    sys.meta_path.insert(0, _AfterImport())  # type: ignore[arg-type]
