"""Which prompt blocks each engine holds in its prefix cache, learned from the engine's own KV cache events.

vLLM publishes, with ``--kv-events-config`` (publisher ``zmq``), a batch of events after each scheduler step:
``BlockStored`` (the hashes of blocks it has just filled, their parent's hash, their token ids, the block
size, the LoRA adapter's name) and ``BlockRemoved`` / ``AllBlocksCleared`` (evictions). The engine's hashes
are seeded per engine and cannot be recomputed outside it, so the index keys each block by a hash of its
own: the chain of (parent's key, the block's token ids, the adapter), the same chain the router computes
for a new prompt (:meth:`KvIndex.chain`). A prompt's cached prefix on an engine is then the number of its
leading blocks whose keys that engine holds.

The subscriber (:func:`follow`) keeps one engine's part of the index current: a ZMQ SUB socket on the
engine's publisher; a gap in the events' sequence numbers (the publisher dropped some) or a reconnect
forgets that engine's blocks, so the index errs towards "not cached", never towards blocks that are gone.
The batches are read with the router's own msgspec structs of vLLM's wire format (:func:`wire_decoder`), not
vLLM's: importing vLLM would bring torch into the router (half a GiB, seconds of start).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

log = logging.getLogger(__name__)

ROOT = 0  # the parent key of a prompt's first block


def block_key(parent: int, tokens: Sequence[int], adapter: str | None, salt: str | None = None) -> int:
    """A block's key: its parent's, its tokens, the adapter, and for a prompt's first block the request's
    ``cache_salt`` (vLLM hashes the salt into the first block, so salted prompts share nothing with
    others: nor may the router's index, or its hit counters would tell one tenant another's prompt)."""
    return hash((parent, tuple(tokens), adapter, salt))


def first_block_salt(extra: Any, adapter: str | None) -> str | None:
    """The ``cache_salt`` among a first block's event ``extra_keys`` (untagged, in vLLM's order: the adapter's
    name when there is one, multimodal ``(identifier, offset)`` pairs, the salt, prompt-embedding digests)."""
    if not isinstance(extra, (list, tuple)):
        return None
    values = list(extra)
    if adapter is not None and values and values[0] == adapter:
        values = values[1:]
    return next((v for v in values if isinstance(v, str)), None)


@dataclass
class _Engine:
    theirs: dict[Any, int] = field(default_factory=dict)  # the engine's block hash -> our key
    held: dict[int, int] = field(default_factory=dict)  # our key -> how many of the engine's blocks have it
    last_seq: int | None = None
    events: int = 0


class KvIndex:
    """The blocks of every followed engine (by endpoint key)."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        self._engines: dict[str, _Engine] = {}
        self.gaps = 0  # sequence gaps seen (the engine's part was forgotten each time)
        # Prompts routed by the index: their full blocks, and those the chosen engine held (its expected hits).
        self.routed_blocks = 0
        self.routed_hits = 0

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def engines(self) -> list[str]:
        return list(self._engines)

    def routed(self, blocks: int, hits: int) -> None:
        self.routed_blocks += blocks
        self.routed_hits += hits

    def summary(self) -> dict[str, Any]:
        """For ``/pdserve/status``: what the router knows and how its choices hit."""
        return {"block_size": self.block_size, "gaps": self.gaps,
                "engines": {k: {"blocks": len(e.held), "events": e.events} for k, e in self._engines.items()},
                "routed_blocks": self.routed_blocks, "routed_hit_blocks": self.routed_hits,
                "expected_hit_rate": self.routed_hits / self.routed_blocks if self.routed_blocks else None}

    def blocks(self, engine: str) -> int:
        e = self._engines.get(engine)
        return len(e.held) if e else 0

    # -- events ------------------------------------------------------------------------------------

    def apply(self, engine: str, seq: int | None, batch: Any) -> None:
        """One published batch from ``engine``: a ``vllm.distributed.kv_events.KVEventBatch``, as
        :func:`follow` decodes it (:func:`wire_decoder`)."""
        e = self._engines.setdefault(engine, _Engine())
        if seq is not None:
            if e.last_seq is not None and seq != e.last_seq + 1:
                self.gaps += 1
                log.warning("KV events of %s: %d batches missed; its cached blocks are forgotten", engine,
                            seq - e.last_seq - 1)
                e.theirs.clear()
                e.held.clear()
            e.last_seq = seq
        for ev in batch.events:
            e.events += 1
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(e, ev)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    self._drop(e, h)
            elif kind == "AllBlocksCleared":
                e.theirs.clear()
                e.held.clear()

    def _stored(self, e: _Engine, ev: Any) -> None:
        hashes, parent, tokens, size = ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size
        adapter, extra = ev.lora_name, ev.extra_keys or []
        if not hashes or size <= 0:
            return
        if self.block_size is None:
            self.block_size = size
        if parent is None:
            key = ROOT
        else:
            known = e.theirs.get(parent)
            if known is None:
                return  # its parent was never seen (stored before this router followed): cannot be chained
            key = known
        for i, h in enumerate(hashes):
            chunk = tokens[i * size:(i + 1) * size]
            if len(chunk) < size:
                return
            salt = first_block_salt(extra[0] if extra else None, adapter) if parent is None and i == 0 else None
            key = block_key(key, chunk, adapter, salt)
            if h in e.theirs:
                continue
            e.theirs[h] = key
            e.held[key] = e.held.get(key, 0) + 1

    @staticmethod
    def _drop(e: _Engine, h: Any) -> None:
        key = e.theirs.pop(h, None)
        if key is None:
            return
        left = e.held.get(key, 0) - 1
        if left > 0:
            e.held[key] = left
        else:
            e.held.pop(key, None)

    # -- queries -----------------------------------------------------------------------------------

    def chain(self, tokens: Sequence[int], adapter: str | None = None, salt: str | None = None) -> list[int]:
        """The keys of a prompt's full blocks, first to last (empty until the block size is known);
        ``salt``: the request's ``cache_salt``."""
        size = self.block_size
        if not size:
            return []
        out: list[int] = []
        key = ROOT
        for start in range(0, len(tokens) - size + 1, size):
            key = block_key(key, tokens[start:start + size], adapter, salt if start == 0 else None)
            out.append(key)
        return out

    def request_chain(self, ids: Sequence[int], body: dict[str, Any]) -> list[int]:
        """:meth:`chain` of a request's prompt ``ids``, under the adapter its ``model`` names
        (``base:adapter``) and its ``cache_salt``."""
        from pdserve.router.request import lora_adapter

        salt = body.get("cache_salt")
        return self.chain(ids, lora_adapter(body), salt if isinstance(salt, str) and salt else None)

    def cached(self, engine: str, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` ``engine`` holds."""
        e = self._engines.get(engine)
        if e is None:
            return 0
        n = 0
        for key in chain:
            if key not in e.held:
                break
            n += 1
        return n


# vLLM's ``KVEventBatch`` (``vllm/distributed/kv_events.py``) as the router reads it: a batch is an array
# (``ts``, ``events``, ...), each event a map tagged with its class name. These structs name only the fields
# the index reads; fields they do not name, and ones a later vLLM adds, are skipped. A unit test holds them
# against vLLM's own. (Block hashes are vLLM's ExternalBlockHash: bytes or int.)


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[bytes | int]


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]  # each read on its own: an event kind a later vLLM adds is skipped, not fatal


_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


@dataclass
class Batch:
    """One published batch as the index reads it: the events the router knows, and how many it skipped."""

    events: list[Any]
    skipped: int = 0


class WireDecoder:
    """Reads the batches an engine publishes (:meth:`decode`: bytes -> :class:`Batch`)."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(KVEventBatch)

    def decode(self, data: bytes) -> Batch:
        raw = self._batch.decode(data)
        out = Batch([])
        for ev in raw.events:
            try:
                out.events.append(_EVENT.decode(ev))
            except msgspec.ValidationError:
                out.skipped += 1  # a kind (or shape) this router does not know: the others still count
        return out


def wire_decoder() -> WireDecoder:
    """A decoder of the batches an engine publishes."""
    return WireDecoder()


#: Largest KV-event message the router accepts (a step's batch is a few KiB to a few hundred; ZeroMQ drops
#: the connection of a publisher that sends more).
MAX_EVENT_BYTES = 4 << 20


async def follow(index: KvIndex, engine: str, address: str, stop: asyncio.Event, engine_key: str = "") -> None:
    """Keep ``engine``'s part of ``index`` current from its publisher at ``address`` (``ipc://path`` on a
    local app, else ``tcp://host:port`` behind CURVE keys derived from ``engine_key``) until ``stop`` is set."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
    if address.startswith("tcp://"):
        if not engine_key:
            sock.close(linger=0)
            raise ValueError(f"KV events of {engine} over TCP need the engine's key (CURVE)")
        from pdserve.settings import kv_events_curve_keys

        keys = kv_events_curve_keys(engine_key)
        sock.curve_serverkey = keys["server_public"]
        sock.curve_publickey = keys["client_public"]
        sock.curve_secretkey = keys["client_secret"]
    sock.connect(address)
    decode = wire_decoder()
    log.info("following the KV cache events of %s at %s", engine, address)
    skipped_kinds = False
    try:
        while not stop.is_set():
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            if len(frames) < 3:
                continue
            try:
                seq = int.from_bytes(frames[1], "big")
                batch = decode.decode(frames[2])
                if batch.skipped and not skipped_kinds:
                    skipped_kinds = True
                    log.warning("KV events of %s: an event kind this router does not know was skipped (a newer "
                                "vLLM?); the others are followed", engine)
                index.apply(engine, seq, batch)
            except (msgspec.DecodeError, ValueError, TypeError, IndexError) as e:
                log.warning("KV events of %s: a batch could not be read: %s", engine, e)
    finally:
        sock.close(linger=0)
        index.forget(engine)
