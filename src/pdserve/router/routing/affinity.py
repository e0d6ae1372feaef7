"""What the affinity plugins share: rendezvous hashing of the routing key, yielding to overload.

A request with a key goes to the candidate with the highest hash weight for that key among those not
overloaded (at most ``slack`` in-flight requests above the least loaded candidate): the same key keeps its
replica, and when replicas come and go only the keys of the departed one move. Without a key (or with one
candidate) the request is routed by ``least_loaded``. Subclasses say how the key is read from the request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from pdserve.config.routing import LeastLoadedSettings, PrefixAffinitySettings, SessionAffinitySettings
from pdserve.router.routing.base import RoutingKey, RoutingPlugin
from pdserve.router.routing.least_loaded import LeastLoaded

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint

_A = TypeVar("_A", PrefixAffinitySettings, SessionAffinitySettings)


def rendezvous_weight(key: str, ep: Endpoint) -> int:
    """``ep``'s highest-random-weight for ``key``: stable for a key and replica, whatever the others."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{ep.url}".encode(), digest_size=8).digest(), "big")


class Affinity(RoutingPlugin[_A]):
    def __init__(self, settings: _A) -> None:
        super().__init__(settings)
        self.fallback = LeastLoaded(LeastLoadedSettings())

    def choose(self, cands: Sequence[Endpoint], key: RoutingKey) -> Endpoint:
        if key is None or len(cands) == 1:
            return self.fallback.choose(cands, key)
        return super().choose(cands, key)

    def filter(self, cands: Sequence[Endpoint], key: RoutingKey) -> list[Endpoint]:
        least = min(e.inflight for e in cands)
        return [e for e in cands if e.inflight - least <= self.settings.slack]

    def score(self, ep: Endpoint, key: RoutingKey) -> float:
        return rendezvous_weight(key or "", ep)
