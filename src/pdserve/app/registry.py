"""Where engine replicas announce themselves to the routers.

A small named Ray actor per application. Engine replicas register their URL when ready and
unregister when they stop; routers poll the list. Ray Serve handles route to *some* replica, while the
router needs *every* replica's address to pick by load, hence this registry.
"""

from __future__ import annotations

from typing import Any


def registry_name(app_name: str) -> str:
    return f"pdserve-registry-{app_name}"


class EngineRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def register(self, replica_id: str, entry: dict[str, Any]) -> None:
        self._entries[replica_id] = entry

    def unregister(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)

    def list(self) -> list[dict[str, Any]]:
        return list(self._entries.values())


def get_registry(app_name: str) -> Any:
    """The registry actor of ``app_name``, created on first use (by an engine or a router)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(EngineRegistry)
    return actor_cls.options(  # type: ignore[attr-defined]
        name=registry_name(app_name), namespace="pdserve", lifetime="detached", get_if_exists=True
    ).remote()
