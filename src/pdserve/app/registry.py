"""Where engine replicas announce themselves to the routers.

Ray Serve handles route to *some* replica, while the router needs *every* replica's address to pick by load,
hence this registry. It is a few keys in Ray's own key-value store, the one Ray Serve keeps its checkpoints
in (in the GCS, so it lives as long as the cluster and, with GCS fault tolerance, survives a head restart):
one key per engine replica under ``registry/<app>/`` in the ``pdserve`` namespace, its value the entry as
JSON. Engine replicas write theirs when their engine is ready (and again at each of Serve's health checks)
and delete it when they stop; routers read the whole prefix every ``router.engine_refresh_s``. No actor
of its own: that would be one more process on every host, awake for nothing between the reads (0.7 % of a
core and 70 MB on the 2-core host ``pdserve bench --scenario footprint`` measures).
"""

from __future__ import annotations

import json
from typing import Any

NAMESPACE = b"pdserve"
#: Seconds any one call to the store may take before it fails (the caller retries on its next round).
TIMEOUT_S = 10.0
#: What a router needs of an entry; one without them is left out.
REQUIRED = ("role", "url", "replica_id", "engine_id")


def prefix(app_name: str) -> bytes:
    return f"registry/{app_name}/".encode()


def key(app_name: str, replica_id: str) -> bytes:
    return prefix(app_name) + replica_id.encode()


def _store() -> Any:
    from ray.experimental import internal_kv

    client = internal_kv.internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("not connected to Ray")
    return client


def register(app_name: str, replica_id: str, entry: dict[str, Any]) -> None:
    _store().internal_kv_put(key(app_name, replica_id), json.dumps(entry).encode(), True, NAMESPACE,
                             timeout=TIMEOUT_S)


async def register_async(app_name: str, replica_id: str, entry: dict[str, Any]) -> None:
    await _store().async_internal_kv_put(key(app_name, replica_id), json.dumps(entry).encode(), True,
                                         NAMESPACE, timeout=TIMEOUT_S)


def unregister(app_name: str, replica_id: str) -> None:
    _store().internal_kv_del(key(app_name, replica_id), False, NAMESPACE, timeout=TIMEOUT_S)


async def unregister_async(app_name: str, replica_id: str) -> None:
    await _store().async_internal_kv_del(key(app_name, replica_id), False, NAMESPACE, timeout=TIMEOUT_S)


async def entries(app_name: str) -> list[dict[str, Any]]:
    """Every engine replica of ``app_name`` that announced itself, in key order. A value that is not such an
    entry (not written by this module) is left out."""
    store = _store()
    keys = await store.async_internal_kv_keys(prefix(app_name), NAMESPACE, timeout=TIMEOUT_S)
    if not keys:
        return []
    values = await store.async_internal_kv_multi_get(keys, NAMESPACE, timeout=TIMEOUT_S)
    return decode(values)


def decode(values: dict[bytes, bytes | None]) -> list[dict[str, Any]]:
    """The entries among ``values`` (key → JSON), in key order."""
    out = []
    for k in sorted(values):
        try:
            entry = json.loads(values[k] or b"")
        except ValueError:
            continue
        if isinstance(entry, dict) and all(isinstance(entry.get(f), str) for f in REQUIRED):
            out.append(entry)
    return out


def clear(app_name: str) -> None:
    """Forget every entry of ``app_name`` (its app is being deleted), and that it was stopping."""
    _store().internal_kv_del(prefix(app_name), True, NAMESPACE, timeout=TIMEOUT_S)
    unmark_stopping(app_name)


def _stopping_key(app_name: str) -> bytes:
    return f"stopping/{app_name}".encode()  # (outside the entries' prefix: no router reads it as one)


def mark_stopping(app_name: str) -> None:
    """The whole app is being stopped (``pdserve serve`` going down): its engine replicas need not wait for
    routers to stop picking them (Serve stops the routers first) before their engines stop."""
    _store().internal_kv_put(_stopping_key(app_name), b"1", True, NAMESPACE, timeout=TIMEOUT_S)


def unmark_stopping(app_name: str) -> None:
    """The app is (being) deployed: a mark left by a stop that never finished no longer holds."""
    _store().internal_kv_del(_stopping_key(app_name), False, NAMESPACE, timeout=TIMEOUT_S)


def stopping(app_name: str) -> bool:
    """Whether :func:`mark_stopping` was called for ``app_name`` (and :func:`clear` not since)."""
    return bool(_store().internal_kv_get(_stopping_key(app_name), NAMESPACE, timeout=TIMEOUT_S))
