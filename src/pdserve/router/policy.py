"""Replica-choice policies, registered by name.

A policy gets the healthy candidates of one role and returns one. Unknown names are an error that
lists the valid ones.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.pool import Endpoint

Policy = Callable[[Sequence["Endpoint"]], "Endpoint"]


def _round_robin() -> Policy:
    counter = itertools.count()

    def pick(cands: Sequence[Endpoint]) -> Endpoint:
        return cands[next(counter) % len(cands)]

    return pick


def _least_loaded() -> Policy:
    """Power of two choices on in-flight requests: near-optimal balance at O(1) cost."""

    def pick(cands: Sequence[Endpoint]) -> Endpoint:
        if len(cands) == 1:
            return cands[0]
        a, b = random.sample(list(cands), 2)
        return a if a.inflight <= b.inflight else b

    return pick


POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": _round_robin,
    "least_loaded": _least_loaded,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
