"""Following a real ZMQ publisher (an IPC socket) that sends vLLM's own event types (the index and the
kv_cache plugin: tests/unit/test_kv_index.py)."""

from __future__ import annotations

import asyncio

import msgspec
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

from pdserve.router.kv_index import KvIndex, follow
from tests.unit.test_kv_index import PROMPT, stored


def test_following_a_publisher_that_sends_vllm_events(tmp_path):
    """A ZMQ PUB socket framed as vLLM's publisher frames it (topic, 8-byte sequence, msgpack batch)."""
    import zmq

    address = f"ipc://{tmp_path}/kv.sock"

    async def scenario() -> tuple[int, int]:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.bind(address)
        idx = KvIndex()
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(follow(idx, "p0", address, stop))
        enc = msgspec.msgpack.Encoder()
        seq = 0
        for _ in range(100):  # a SUB socket misses what is sent before it has joined: send until it has
            pub.send_multipart((b"", seq.to_bytes(8, "big"),
                                enc.encode(KVEventBatch(ts=1.0, events=[stored([b"h1", b"h2"], None, PROMPT[:8])]))))
            seq += 1
            await asyncio.sleep(0.02)
            if idx.blocks("p0"):
                break
        held = idx.cached("p0", idx.chain(PROMPT))

        async def sent(seq: int, payload: bytes, done) -> None:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if done():
                    return

        await sent(seq, enc.encode(KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[b"h2"], medium=None)])),
                   lambda: idx.cached("p0", idx.chain(PROMPT)) == 1)
        after = idx.cached("p0", idx.chain(PROMPT))
        # a batch that cannot be read counts as missed: the next one finds the gap and forgets the engine's blocks
        await sent(seq + 1, b"\xc1not msgpack", lambda: False)
        await sent(seq + 2, enc.encode(KVEventBatch(ts=3.0, events=[])), lambda: idx.gaps == 1)
        assert idx.gaps == 1 and idx.blocks("p0") == 0
        stop.set()
        await asyncio.wait_for(task, 5)
        pub.close(linger=0)
        assert "p0" not in idx.engines()  # an engine no longer followed is forgotten
        return held, after

    held, after = asyncio.run(scenario())
    assert (held, after) == (2, 1)
