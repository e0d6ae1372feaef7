"""A bound on the Responses API answers a vLLM engine keeps (``VLLM_ENABLE_RESPONSES_API_STORE=1``).

vLLM keeps every stored answer, the conversation that led to it and, for a background stream, its events, in
three dicts of its Responses server, and never removes any. Here those dicts forget their oldest entries past
bounds on their count and on their memory: :data:`PER_OWNER_ENV` entries and :data:`BYTES_PER_OWNER_ENV`
bytes of one owner (the API key or tenant that made them), :data:`TOTAL_ENV` entries and
:data:`BYTES_TOTAL_ENV` bytes in all, where the oldest of the owner keeping the most goes first. One client
creating answers without end so costs the engine a bounded memory and pushes out only its own oldest answers;
owners that fill the whole engine together share it, none pushed below another's count. An entry's memory is
measured when a store takes it (:func:`deep_size`): each turn's conversation holds the whole history, so a
long conversation's entries cost many times a short one's, up to the model's context each. A background
stream's events, added after, are not counted (the router refuses background requests). An answer forgotten
is forgotten whole: vLLM storing it again later (an answer that finishes after its conversation was pushed out)
keeps nothing, so no later turn reads an answer without its conversation.

Each entry's memory is measured as all it reaches: a turn's conversation shares its earlier messages with the
turns before (vLLM copies the list, not the messages), so a long conversation's entries are counted at more
than they hold together: the bound errs towards forgetting early, never towards holding more.

The owner is read from the response id, which the router makes (router/stored.py; the layout is in
pdserve/settings.py): ``resp_``, 16 hex digits that stand for the owner (a keyed digest of it, the same in
every router replica), 16 at random, then a seal of 32. An id of another form (one a client chose, in an
app without keys, which has one owner) counts as the anonymous owner's. A later request naming a forgotten
answer gets vLLM's own 404.

Loaded in the engine's API server by the endpoint plugin (engine/vllm_plugin.py); no vLLM import here.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any

from pdserve.owned import OwnedOrder
from pdserve.settings import STORED_BYTES_PER_ENGINE_ENV as BYTES_TOTAL_ENV
from pdserve.settings import STORED_BYTES_PER_OWNER_ENV as BYTES_PER_OWNER_ENV
from pdserve.settings import STORED_PER_ENGINE_ENV as TOTAL_ENV
from pdserve.settings import STORED_PER_OWNER_ENV as PER_OWNER_ENV
from pdserve.settings import response_owner_tag

#: vLLM's Responses server's stores, all keyed by the response id.
STORES = ("msg_store", "response_store", "event_store")
#: The store of the answer itself (vLLM sets it once the answer is done, its conversation before).
ANSWER = STORES.index("response_store")
#: Objects :func:`deep_size` visits in one value at most (past them the rest is not counted): a stored
#: conversation of the longest context is some thousands of objects.
MAX_SIZED_OBJECTS = 200_000


def deep_size(value: Any, limit: int = MAX_SIZED_OBJECTS) -> int:
    """About the bytes ``value`` holds: ``sys.getsizeof`` of it and of every object it reaches through
    containers and attributes (pydantic models and dataclasses keep their fields in ``__dict__``), each once."""
    seen: set[int] = set()
    todo = [value]
    total = 0
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj, 64)
        if isinstance(obj, (str, bytes, bytearray, int, float, bool)) or obj is None:
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            todo.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                todo.append(attrs)
            extra = getattr(obj, "__pydantic_extra__", None)
            if isinstance(extra, dict):
                todo.append(extra)
    return total


class Bounds:
    """The bounds of one engine's stored answers: entries and bytes, of one owner and in all."""

    def __init__(self, per_owner: int, total: int, bytes_per_owner: int = 0, bytes_total: int = 0) -> None:
        if per_owner < 1 or total < 1 or bytes_per_owner < 0 or bytes_total < 0:
            raise ValueError("the bounds of stored responses must be at least 1 (bytes: 0 for none)")
        self.per_owner = per_owner
        self.total = total
        self.bytes_per_owner = bytes_per_owner
        self.bytes_total = bytes_total

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Bounds) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Bounds({vars(self)})"


class Ledger:
    """The order the ids of every bounded store arrived in, by owner, with the bytes each id's entries hold;
    forgets the oldest past the bounds, from every store at once (an answer, its conversation and its events go
    together)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.stores: list[BoundedStore] = []
        self._order: OwnedOrder[str] = OwnedOrder()  # the ids by their owners' tags, the oldest first
        self._sizes: dict[str, dict[int, int]] = {}  # id -> its entries' bytes, by store
        #: Ids forgotten before their answer came (still running): when it comes it is not kept. At most as
        #: many as the bound on entries (a request that failed never brings its answer).
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._order)

    def owned(self, tag: str) -> int:
        return self._order.count(tag)

    def bytes(self, tag: str | None = None) -> int:
        """The bytes kept for the owner ``tag`` (None: for all)."""
        return self._order.weight(tag)

    def gone(self, response_id: str, store: int) -> bool:
        """Whether store number ``store`` must not keep ``response_id``: it was forgotten while its answer was
        still running (the answer must not come back without its conversation)."""
        if response_id not in self._gone:
            return False
        if store == ANSWER:  # (the answer came: nothing of it will come again)
            del self._gone[response_id]
        return True

    def note(self, response_id: str, store: int, size: int) -> None:
        """Store number ``store`` took ``response_id``'s entry, of ``size`` bytes: count the id (once, whichever
        store took it first, at the bytes of all its entries) and keep the bounds: an owner past its own loses
        its oldest, and past the engine's the owner keeping the most does."""
        sizes = self._sizes.setdefault(response_id, {})
        sizes[store] = size
        tag = response_owner_tag(response_id)
        if response_id in self._order:  # (an answer stored again, done: in its place)
            self._order.reweigh(response_id, sum(sizes.values()))
        else:
            self._order.add(response_id, tag, size)
        b = self.bounds
        gone = self._order.trim_owner(tag, b.per_owner) + self._order.trim(b.total)
        if b.bytes_per_owner:
            gone += self._order.trim_owner(tag, b.bytes_per_owner, weighted=True)
        if b.bytes_total:
            gone += self._order.trim(b.bytes_total, weighted=True)
        for rid in gone:
            self._drop(rid)

    def forget(self, response_id: str) -> None:
        if self._order.discard(response_id):
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        for store in self.stores:
            dict.pop(store, response_id, None)
        if ANSWER not in self._sizes.pop(response_id, {}):
            self._gone[response_id] = None
            while len(self._gone) > self.bounds.total:
                self._gone.popitem(last=False)
        self.forgotten += 1


class BoundedStore(dict):  # type: ignore[type-arg]
    """One of vLLM's stores: a dict whose every new entry is noted in the shared :class:`Ledger`, with its bytes
    (vLLM only sets, reads and tests keys of these)."""

    def __init__(self, ledger: Ledger, entries: dict[Any, Any] | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        self.index = len(ledger.stores)
        ledger.stores.append(self)
        for key, value in (entries or {}).items():
            self[key] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.ledger.gone(key, self.index):  # forgotten while running: its answer does not come back alone
            return
        super().__setitem__(key, value)
        self.ledger.note(key, self.index, deep_size(value))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self.get(key, default)

    def update(self, *a: Any, **kw: Any) -> None:
        for key, value in dict(*a, **kw).items():
            self[key] = value


def _int(env: Any, name: str) -> int:
    return int(env.get(name, "0") or 0)


def bounds_from_env(environ: dict[str, str] | None = None) -> Bounds | None:
    """The bounds the launcher set in the environment; None when it set neither on entries."""
    env = os.environ if environ is None else environ
    if PER_OWNER_ENV not in env and TOTAL_ENV not in env:
        return None
    total = _int(env, TOTAL_ENV) or int(env[PER_OWNER_ENV])
    per_owner = _int(env, PER_OWNER_ENV) or total
    return Bounds(per_owner, total, _int(env, BYTES_PER_OWNER_ENV), _int(env, BYTES_TOTAL_ENV))


def bound(serving: Any, bounds: Bounds) -> Ledger | None:
    """Put vLLM's Responses server ``serving`` (``app.state.openai_serving_responses``) under ``bounds``; None
    where there is no such server (an engine without the generate task)."""
    if serving is None or not all(hasattr(serving, name) for name in STORES):
        return None
    ledger = Ledger(bounds)
    for name in STORES:
        setattr(serving, name, BoundedStore(ledger, getattr(serving, name)))
    return ledger
