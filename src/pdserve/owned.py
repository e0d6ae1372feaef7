"""Entries of many owners under one bound, where the owner keeping the most gives way.

Four records keep entries for every client under one bound on the whole: on the router, the stored responses
(router/stored.py) and the KV handback notes (router/handback.py); on each engine, its stored Responses
answers (engine/responses_store.py) and its handback notes (engine/kv_handback.py). Under one LRU, one busy
client pushes every other client's entries out. Here, past the bound, the oldest entry of the owner keeping
the most goes first (of owners keeping as many, the one whose oldest entry is the oldest): no owner loses an
entry to one keeping fewer, a lone owner still has the whole bound, and owners keeping one each take turns
as one LRU would (preferring the owner that just added one dropped each new owner's entry at once). Each
record says who an owner is (an API key, a tenant, a keyed digest of one) and keeps its own data under the
keys; this keeps only their order and owners. :func:`fair_share` is the share the bounds that keep their
last part for owners under it use.

Standard library only: the engines' API servers load it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class OwnedOrder(Generic[K]):
    """Keys in the order they were added (a key added again moves to the end), each under one owner, with a
    weight (1 unless given: what the key's entry costs, e.g. its bytes). The bounds are on the keys' count
    (:meth:`trim`) or on their weight (``weighted``)."""

    def __init__(self) -> None:
        self._owner_of: OrderedDict[K, str] = OrderedDict()
        self._of: dict[str, OrderedDict[K, int]] = {}  # owner -> its keys, the oldest first, with when added
        self._added = 0
        self._weight_of: dict[K, int] = {}
        self._owner_weight: dict[str, int] = {}
        self._weight = 0

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

    def weight(self, owner: str | None = None) -> int:
        """The weight of ``owner``'s keys (None: of all keys)."""
        return self._weight if owner is None else self._owner_weight.get(owner, 0)

    def owners(self) -> list[str]:
        """The owners with keys, in the order each first added one still kept."""
        return list(self._of)

    def add(self, key: K, owner: str, weight: int = 1) -> None:
        """Note ``key`` as ``owner``'s newest, of ``weight`` (one already noted moves to the end, under
        ``owner``, of the weight given now)."""
        self.discard(key)
        self._owner_of[key] = owner
        self._added += 1
        self._of.setdefault(owner, OrderedDict())[key] = self._added
        self._weight_of[key] = weight
        self._owner_weight[owner] = self._owner_weight.get(owner, 0) + weight
        self._weight += weight

    def reweigh(self, key: K, weight: int) -> None:
        """Give the noted ``key`` a new weight, in its place."""
        owner = self._owner_of[key]
        delta = weight - self._weight_of[key]
        self._weight_of[key] = weight
        self._owner_weight[owner] += delta
        self._weight += delta

    def discard(self, key: K) -> bool:
        """Forget ``key``; whether it was noted."""
        if key not in self._owner_of:
            return False
        owner = self._owner_of.pop(key)
        mine = self._of[owner]
        del mine[key]
        weight = self._weight_of.pop(key)
        self._weight -= weight
        self._owner_weight[owner] -= weight
        if not mine:
            del self._of[owner]
            del self._owner_weight[owner]
        return True

    def _size(self, owner: str | None, weighted: bool) -> int:
        if owner is None:
            return self._weight if weighted else len(self._owner_of)
        return self._owner_weight.get(owner, 0) if weighted else self.count(owner)

    def trim(self, bound: int, *, weighted: bool = False) -> list[K]:
        """Forget keys until at most ``bound`` are left (``weighted``: until their weight is at most ``bound``),
        each time the oldest of the owner keeping the most (by count or weight; of owners keeping as much, the
        oldest key of theirs). The keys forgotten, the first forgotten first, for the caller to drop what it
        keeps under them."""
        gone: list[K] = []
        while self._size(None, weighted) > max(bound, 0):
            most = max(self._size(owner, weighted) for owner in self._of)
            key = min((next(iter(keys.items())) for owner, keys in self._of.items()
                       if self._size(owner, weighted) == most), key=lambda item: item[1])[0]
            self.discard(key)
            gone.append(key)
        return gone

    def trim_owner(self, owner: str, bound: int, *, weighted: bool = False) -> list[K]:
        """Forget ``owner``'s oldest keys until it has at most ``bound`` (``weighted``: of at most that weight);
        the keys forgotten."""
        gone: list[K] = []
        while owner in self._of and self._size(owner, weighted) > max(bound, 0):
            key = next(iter(self._of[owner]))
            self.discard(key)
            gone.append(key)
        return gone


def fair_share(bound: float, owners: int) -> float:
    """One owner's share of a bound that ``owners`` (itself included) hold: the bound over them, two at least,
    so that a lone owner still leaves room for a second. Where a bound keeps its last part for owners under
    their share (the in-flight caps, LoRA batch slots, the decode engine's pins), this is the share."""
    return bound / max(2, owners)
