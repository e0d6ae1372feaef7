"""Entries of many owners under one bound, where the owner keeping the most gives way.

Four records keep entries for every client under one bound on the whole: on the router, the stored responses
(router/stored.py) and the KV handback notes (router/handback.py); on each engine, its stored Responses
answers (engine/responses_store.py) and its handback notes (engine/kv_handback.py). Under one LRU, one busy
client pushes every other client's entries out. Here, past the bound, the oldest entry of the owner keeping
the most goes first (of equals, the owner that just added one): no owner loses an entry to one keeping
fewer, and a lone owner still has the whole bound. Each record says who an owner is (an API key, a tenant,
a keyed digest of one) and keeps its own data under the keys; this keeps only their order and owners.

Standard library only: the engines' API servers load it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class OwnedOrder(Generic[K]):
    """Keys in the order they were added (a key added again moves to the end), each under one owner."""

    def __init__(self) -> None:
        self._owner_of: OrderedDict[K, str] = OrderedDict()
        self._of: dict[str, OrderedDict[K, None]] = {}

    def __len__(self) -> int:
        return len(self._owner_of)

    def __contains__(self, key: object) -> bool:
        return key in self._owner_of

    def __iter__(self) -> Iterator[K]:
        """The keys, the oldest first."""
        return iter(self._owner_of)

    def owner(self, key: K) -> str | None:
        return self._owner_of.get(key)

    def count(self, owner: str) -> int:
        """How many keys ``owner`` has."""
        return len(self._of.get(owner, ()))

    def owners(self) -> list[str]:
        """The owners with keys, in the order each first added one still kept."""
        return list(self._of)

    def add(self, key: K, owner: str) -> None:
        """Note ``key`` as ``owner``'s newest (one already noted moves to the end, under ``owner``)."""
        self.discard(key)
        self._owner_of[key] = owner
        self._of.setdefault(owner, OrderedDict())[key] = None

    def discard(self, key: K) -> bool:
        """Forget ``key``; whether it was noted."""
        if key not in self._owner_of:
            return False
        owner = self._owner_of.pop(key)
        mine = self._of[owner]
        del mine[key]
        if not mine:
            del self._of[owner]
        return True

    def trim(self, bound: int, newcomer: str | None = None) -> list[K]:
        """Forget keys until at most ``bound`` are left, each time the oldest of the owner keeping the most
        (``newcomer``, the owner that just added one, first among equals). The keys forgotten, the first
        forgotten first, for the caller to drop what it keeps under them."""
        gone: list[K] = []
        while len(self._owner_of) > max(bound, 0):
            most = max(len(keys) for keys in self._of.values())
            if newcomer is not None and self.count(newcomer) == most:
                who = newcomer
            else:
                who = next(o for o, keys in self._of.items() if len(keys) == most)
            key = next(iter(self._of[who]))
            self.discard(key)
            gone.append(key)
        return gone

    def trim_owner(self, owner: str, bound: int) -> list[K]:
        """Forget ``owner``'s oldest keys until it has at most ``bound``; the keys forgotten."""
        gone: list[K] = []
        while self.count(owner) > max(bound, 0):
            key = next(iter(self._of[owner]))
            self.discard(key)
            gone.append(key)
        return gone
