"""Where pdserve changes Ray's own behaviour: every patch of Ray and every Ray variable pdserve sets, in one
place, each with the Ray version it was written against and why. Moving Ray's pin means reading this file.
Written against Ray 2.60.0.
"""

from __future__ import annotations

import os
from typing import Any

#: Ray's switch for a single-machine instance: its node address becomes loopback (instead of the host's
#: address, which ``_node_ip_address="127.0.0.1"`` still resolves to), and Ray's servers bind to it.
RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Ray starts its workers at niceness 15 unless told; pdserve's router and proxy are Ray workers.
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"


def local_only_ray(ray: Any) -> None:
    """Laptop mode (a loopback ``http.host`` and no cluster to join): the endpoint is local, so is everything
    behind it. Set before Ray starts; its processes and the replicas inherit it. The engines and their NIXL
    side channels bind to the node address (app/deployments.py), and UCX to the loopback device."""
    os.environ[RAY_LOCAL_ONLY_ENV] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def keep_serve_grpc_local() -> None:
    """In a local-only Ray instance (``pdserve serve`` on a loopback address, see cli/serve.py), Serve's
    per-replica gRPC server for calls between deployments still binds every interface ("[::]:0", fixed in
    Ray Serve 2.60). Bind it to loopback instead; the node address it is reached by is loopback too.
    Call in a replica's constructor: the server starts after it."""
    if os.environ.get(RAY_LOCAL_ONLY_ENV) != "0":
        return
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "_pdserve_local", False):
        return

    def local_bind(server: Any, address: str) -> Any:
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    local_bind._pdserve_local = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = local_bind
