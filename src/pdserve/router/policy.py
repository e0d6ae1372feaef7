"""Replica-choice policies, registered by name, chosen per role in the YAML (``router.policy``,
``router.prefill_policy``, ``router.decode_policy``).

A policy gets the healthy candidates of one role and the request's routing key (a hash of the prompt's
first tokens, or the session header; ``None`` when there is none) and returns one candidate. Unknown
names are an error that lists the valid ones.

- ``round_robin``: the baseline.
- ``least_loaded``: power of two choices on in-flight requests.
- ``prefix_affinity``: requests whose prompts start alike go to the same replica, so its prefix cache
  hits (rendezvous hashing on the prompt's first ``router.prefix_affinity_tokens`` tokens; a replica
  with far more in-flight requests than the least loaded one is skipped).
- ``session_affinity``: requests with the same ``X-Session-Id`` header go to the same replica.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.pool import Endpoint

Policy = Callable[[Sequence["Endpoint"], "str | None"], "Endpoint"]

#: prefix_affinity gives up its choice when that replica holds this many more requests than the least loaded.
AFFINITY_SLACK = 8


def _round_robin() -> Policy:
    counter = itertools.count()

    def pick(cands: Sequence[Endpoint], key: str | None) -> Endpoint:
        return cands[next(counter) % len(cands)]

    return pick


def _least_loaded() -> Policy:
    def pick(cands: Sequence[Endpoint], key: str | None) -> Endpoint:
        if len(cands) == 1:
            return cands[0]
        a, b = random.sample(list(cands), 2)
        return a if a.inflight <= b.inflight else b

    return pick


def _rendezvous(cands: Sequence[Endpoint], key: str) -> list[Endpoint]:
    """Candidates ordered by highest random weight for ``key``: stable when replicas come and go."""
    def weight(ep: Endpoint) -> bytes:
        return hashlib.blake2b(f"{key}|{ep.url}".encode(), digest_size=8).digest()

    return sorted(cands, key=weight, reverse=True)


def _affinity(fallback: Policy) -> Policy:
    def pick(cands: Sequence[Endpoint], key: str | None) -> Endpoint:
        if key is None or len(cands) == 1:
            return fallback(cands, key)
        least = min(e.inflight for e in cands)
        for ep in _rendezvous(cands, key):
            if ep.inflight - least <= AFFINITY_SLACK:
                return ep
        return fallback(cands, key)

    return pick


POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": _round_robin,
    "least_loaded": _least_loaded,
    "prefix_affinity": lambda: _affinity(_least_loaded()),
    "session_affinity": lambda: _affinity(_least_loaded()),
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
