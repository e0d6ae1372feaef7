"""A bound on the Responses API answers a vLLM engine keeps (``VLLM_ENABLE_RESPONSES_API_STORE=1``).

vLLM keeps every stored answer, the conversation that led to it and, for a background stream, its events, in
three dicts of its Responses server, and never removes any. Here those dicts forget their oldest entries past
two bounds: :data:`PER_OWNER_ENV` entries of one owner (the API key or tenant that made them) and
:data:`TOTAL_ENV` in all, where the oldest of the owner keeping the most goes first. One client creating
answers without end so costs the engine a bounded memory and pushes out only its own oldest answers; owners
that fill the whole engine together share it, none pushed below another's count.

The owner is read from the response id, which the router makes (router/stored.py; the layout is in
pdserve/settings.py): ``resp_``, 16 hex digits that stand for the owner (a keyed digest of it, the same in
every router replica), 16 at random, then a seal of 32. An id of another form (one a client chose, in an
app without keys, which has one owner) counts as the anonymous owner's. A later request naming a forgotten
answer gets vLLM's own 404.

Loaded in the engine's API server by the endpoint plugin (engine/vllm_plugin.py); no vLLM import here.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.owned import OwnedOrder
from pdserve.settings import STORED_PER_ENGINE_ENV as TOTAL_ENV
from pdserve.settings import STORED_PER_OWNER_ENV as PER_OWNER_ENV
from pdserve.settings import response_owner_tag

#: vLLM's Responses server's stores, all keyed by the response id.
STORES = ("msg_store", "response_store", "event_store")


class Ledger:
    """The order the ids of every bounded store arrived in, by owner; forgets the oldest past the bounds, from
    every store at once (an answer, its conversation and its events go together)."""

    def __init__(self, per_owner: int, total: int) -> None:
        if per_owner < 1 or total < 1:
            raise ValueError("the bounds of stored responses must be at least 1")
        self.per_owner = per_owner
        self.total = total
        self.stores: list[BoundedStore] = []
        self._order: OwnedOrder[str] = OwnedOrder()  # the ids by their owners' tags, the oldest first
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._order)

    def owned(self, tag: str) -> int:
        return self._order.count(tag)

    def note(self, response_id: str) -> None:
        """A store took ``response_id``: count it (once, whichever store took it first) and keep the bounds:
        an owner past its own loses its oldest, and past the engine's the owner keeping the most does."""
        if response_id in self._order:
            return
        tag = response_owner_tag(response_id)
        self._order.add(response_id, tag)
        for gone in self._order.trim_owner(tag, self.per_owner) + self._order.trim(self.total):
            self._drop(gone)

    def forget(self, response_id: str) -> None:
        if self._order.discard(response_id):
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        for store in self.stores:
            dict.pop(store, response_id, None)
        self.forgotten += 1


class BoundedStore(dict):  # type: ignore[type-arg]
    """One of vLLM's stores: a dict whose every new key is noted in the shared :class:`Ledger` (vLLM only sets,
    reads and tests keys of these)."""

    def __init__(self, ledger: Ledger, entries: dict[Any, Any] | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        ledger.stores.append(self)
        for key, value in (entries or {}).items():
            self[key] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.ledger.note(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *a: Any, **kw: Any) -> None:
        for key, value in dict(*a, **kw).items():
            self[key] = value


def bounds_from_env(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(per owner, per engine) from the environment the launcher set; None when it set neither."""
    env = os.environ if environ is None else environ
    if PER_OWNER_ENV not in env and TOTAL_ENV not in env:
        return None
    total = int(env.get(TOTAL_ENV, "0") or 0) or int(env[PER_OWNER_ENV])
    per_owner = int(env.get(PER_OWNER_ENV, "0") or 0) or total
    return per_owner, total


def bound(serving: Any, per_owner: int, total: int) -> Ledger | None:
    """Put vLLM's Responses server ``serving`` (``app.state.openai_serving_responses``) under the bounds;
    None where there is no such server (an engine without the generate task)."""
    if serving is None or not all(hasattr(serving, name) for name in STORES):
        return None
    ledger = Ledger(per_owner, total)
    for name in STORES:
        setattr(serving, name, BoundedStore(ledger, getattr(serving, name)))
    return ledger
