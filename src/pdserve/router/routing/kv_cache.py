"""``kv_cache``: the replica that holds the longest cached prefix of the prompt, as its engine says.

Every engine publishes its KV cache events (pdserve starts the engines of a role routed by ``kv_cache`` with
``--kv-events-config``), the router follows them into a :class:`~pdserve.router.kv_index.KvIndex`, and this
plugin scores each candidate by how many leading blocks of the prompt its engine holds. Replicas holding more
than ``slack`` in-flight requests above the least loaded one are passed over first (load before locality),
and when no candidate holds ``min_blocks`` of the prompt, or the prompt's token ids are unknown, the least
loaded replica takes it. Unlike ``prefix_affinity``, which hashes the prompt's first tokens, this knows what
is cached: prompts that share a long prefix but differ early, evictions, and replicas that came and went.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.config.routing import KvCacheSettings, LeastLoadedSettings
from pdserve.router.kv_index import KvIndex
from pdserve.router.routing.base import RoutingKey, RoutingPlugin, RoutingRequest, Scored
from pdserve.router.routing.least_loaded import LeastLoaded

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint


class KvCache(RoutingPlugin[KvCacheSettings]):
    name = "kv_cache"
    settings_model = KvCacheSettings
    wants_prompt_ids = True

    def __init__(self, settings: KvCacheSettings) -> None:
        super().__init__(settings)
        self.index = KvIndex()
        self.fallback = LeastLoaded(LeastLoadedSettings())

    def key(self, request: RoutingRequest) -> RoutingKey:
        if not request.prompt_ids:
            return None
        return tuple(self.index.request_chain(request.prompt_ids, request.body)) or None

    def filter(self, cands: Sequence[Endpoint], key: RoutingKey) -> list[Endpoint]:
        least = min(e.inflight for e in cands)
        return [e for e in cands if e.inflight - least <= self.settings.slack]

    def score(self, ep: Endpoint, key: RoutingKey) -> float:
        return float(self.index.cached(ep.key, key or ()))

    def pick(self, scored: Sequence[Scored], key: RoutingKey) -> Endpoint:
        # the longest cached prefix; the less loaded among equals
        ep, hits = max(scored, key=lambda s: (s[1], -s[0].inflight))
        if hits < self.settings.min_blocks:
            ep = self.fallback.choose([e for e, _ in scored], None)
            hits = next(s for e, s in scored if e is ep)
        self.index.routed(len(key or ()), int(hits))
        return ep

    def choose(self, cands: Sequence[Endpoint], key: RoutingKey) -> Endpoint:
        if key is None:
            return self.fallback.choose(cands, None)
        return super().choose(cands, key)
