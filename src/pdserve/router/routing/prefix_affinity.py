"""``prefix_affinity``: requests whose prompts start alike go to the same replica, so its prefix cache hits.

The key is the prompt's first ``tokens`` token ids, or for a text prompt or chat messages the first
``4 * tokens`` characters of their JSON; replicas are chosen by :mod:`~pdserve.router.routing.affinity`.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.config.routing import PrefixAffinitySettings
from pdserve.router.routing.affinity import Affinity
from pdserve.router.routing.base import RoutingKey, RoutingRequest


class PrefixAffinity(Affinity[PrefixAffinitySettings]):
    name = "prefix_affinity"
    settings_model = PrefixAffinitySettings

    def key(self, request: RoutingRequest) -> RoutingKey:
        n = self.settings.tokens
        body = request.body
        prompt: Any = body.get("messages") if request.route == "chat" else body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return ",".join(map(str, prompt[:n]))
        return json.dumps(prompt, sort_keys=True, default=str)[: 4 * n]
