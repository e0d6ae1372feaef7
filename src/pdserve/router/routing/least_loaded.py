"""``least_loaded``: power of d choices on in-flight requests (d = ``choices``, 2 by default).

Scores a replica by its in-flight requests (fewer is better) and picks the best of ``choices`` drawn at
random: near the best of all at a fraction of the herding a strict minimum causes between router replicas.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.config.routing import LeastLoadedSettings
from pdserve.router.routing.base import RoutingKey, RoutingPlugin, Scored

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint


class LeastLoaded(RoutingPlugin[LeastLoadedSettings]):
    name = "least_loaded"
    settings_model = LeastLoadedSettings

    def score(self, ep: Endpoint, key: RoutingKey) -> float:
        return -ep.inflight

    def pick(self, scored: Sequence[Scored], key: RoutingKey) -> Endpoint:
        if len(scored) == 1:
            return scored[0][0]
        drawn = random.sample(list(scored), min(self.settings.choices, len(scored)))
        return super().pick(drawn, key)
