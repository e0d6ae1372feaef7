"""What a routing plugin is: read the request, then filter → score → pick among replicas.

The pool hands a plugin the healthy candidates of one role (already non-empty, minus any replica the
request has tried) and the routing key the same plugin read from the request. :meth:`RoutingPlugin.choose`
runs the three steps; a plugin overrides the ones it needs:

- :meth:`~RoutingPlugin.key`: what the plugin needs from the request (a prompt prefix, a session id), as
  a string, or ``None``.
- :meth:`~RoutingPlugin.filter`: drop candidates that must not take the request (e.g. overloaded ones).
- :meth:`~RoutingPlugin.score`: higher is better.
- :meth:`~RoutingPlugin.pick`: one of the scored candidates; by default the highest score, the first on a
  tie.

A plugin is built from its own settings block (a model in :mod:`pdserve.config.routing`) and keeps its
state (e.g. a counter) between requests: each role gets its own instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.request import Route

S = TypeVar("S", bound=BaseModel)

#: A candidate and its score.
Scored = tuple["Endpoint", float]

#: What a plugin reads from a request and is handed back when it picks: a string for most, the prompt's
#: chain of block keys for ``kv_cache``; ``None`` when the plugin needs nothing from the request.
RoutingKey = Any


@dataclass(frozen=True)
class RoutingRequest:
    """What plugins may read from a client request."""

    route: Route
    body: dict[str, Any]
    session: str | None = None  # the X-Session-Id header
    #: The prompt's token ids as the engine will see them, when the role's plugin asks for them
    #: (:attr:`RoutingPlugin.wants_prompt_ids`) and the router can tell them; else ``None``.
    prompt_ids: Sequence[int] | None = None


class RoutingPlugin(Generic[S]):
    """Base of the routing plugins; registered by :attr:`name` in :mod:`pdserve.router.routing.registry`."""

    #: The policy name that selects this plugin in the YAML (``router.policy``) and names its settings block.
    name: ClassVar[str]
    #: Its settings model (the type of ``router.plugins.<name>``).
    settings_model: ClassVar[type[BaseModel]]
    #: Whether :meth:`key` reads :attr:`RoutingRequest.prompt_ids` (the router tokenizes only for those).
    wants_prompt_ids: ClassVar[bool] = False

    def __init__(self, settings: S) -> None:
        self.settings = settings

    def key(self, request: RoutingRequest) -> RoutingKey:
        """The routing key of ``request`` (``None``: this plugin needs nothing from it)."""
        return None

    def filter(self, cands: Sequence[Endpoint], key: RoutingKey) -> list[Endpoint]:
        return list(cands)

    def score(self, ep: Endpoint, key: RoutingKey) -> float:
        return 0.0

    def pick(self, scored: Sequence[Scored], key: RoutingKey) -> Endpoint:
        return max(scored, key=lambda s: s[1])[0]

    def choose(self, cands: Sequence[Endpoint], key: RoutingKey) -> Endpoint:
        """filter → score → pick over ``cands`` (non-empty); a filter that leaves none keeps them all."""
        kept = self.filter(cands, key) or list(cands)
        return self.pick([(ep, self.score(ep, key)) for ep in kept], key)

    def __call__(self, cands: Sequence[Endpoint], key: RoutingKey) -> Endpoint:
        return self.choose(cands, key)
