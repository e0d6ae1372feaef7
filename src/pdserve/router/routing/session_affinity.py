"""``session_affinity``: requests with the same ``X-Session-Id`` header go to the same replica.

The key is the header's value; replicas are chosen by :mod:`~pdserve.router.routing.affinity`. A request
without the header is routed by ``least_loaded``.
"""

from __future__ import annotations

from pdserve.config.routing import SessionAffinitySettings
from pdserve.router.routing.affinity import Affinity
from pdserve.router.routing.base import RoutingKey, RoutingRequest


class SessionAffinity(Affinity[SessionAffinitySettings]):
    name = "session_affinity"
    settings_model = SessionAffinitySettings

    def key(self, request: RoutingRequest) -> RoutingKey:
        return request.session
