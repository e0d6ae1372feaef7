"""``round_robin``: the baseline, each role's replicas in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.config.routing import RoundRobinSettings
from pdserve.router.routing.base import RoutingKey, RoutingPlugin, Scored

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint


class RoundRobin(RoutingPlugin[RoundRobinSettings]):
    name = "round_robin"
    settings_model = RoundRobinSettings

    def __init__(self, settings: RoundRobinSettings) -> None:
        super().__init__(settings)
        self._counter = itertools.count()

    def pick(self, scored: Sequence[Scored], key: RoutingKey) -> Endpoint:
        return scored[next(self._counter) % len(scored)][0]
