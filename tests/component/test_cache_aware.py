"""Cache-aware disaggregation end to end on loopback: fake engines, the router following a decode replica's
KV cache events from a real ZMQ publisher (vLLM's frames and event types), and a conversation's next turn
that skips the prefill engine and lands on the decode replica holding the conversation, for chat, Responses
and Messages alike (the decision alone: tests/unit/test_cache_aware.py)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from pdserve.config.schema import RouterConfig
from pdserve.router.build import build_router
from pdserve.router.endpoint import Endpoint
from pdserve.router.prompt_length import PromptLength
from pdserve.testing.fake_engine import FakeEngine, _prompt_text, build_fake_engine, expected_words
from pdserve.testing.thread_server import ThreadServer

MODEL = "fake-model"
BLOCK = 16
#: The new part of a follow-up turn, in tokens, that the holder computes itself: within 4 of its steps
#: (100 prompt tokens/s × 0.1 s a step × 4 = 40 tokens; the last partial block adds up to 15).
NEW_TAIL = 12

HISTORY = [{"role": "user", "content": "Tell me about the history of the harbour town and its old lighthouse."},
           {"role": "assistant", "content": "The lighthouse was built long ago and guided ships past the reef."}]
FOLLOW_UP = {"role": "user", "content": "And who kept it?"}
#: Another conversation: it shares only the template's default system prompt with the first, and its own
#: part is far more than 4 of the holder's steps.
OTHER = [{"role": "user", "content": "Something else entirely: how do tides work on a long coast, why are there two "
                                     "of them a day in most places but one in some, and what part do the moon, "
                                     "the sun and the shape of the sea floor play in how high they rise?"}]


def chat(msgs: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": msgs, "max_tokens": 8}


def responses(msgs: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "input": msgs, "max_output_tokens": 8, "store": False}


def messages(msgs: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": msgs, "max_tokens": 8}


PATHS = {"chat": ("/v1/chat/completions", chat), "responses": ("/v1/responses", responses),
         "messages": ("/v1/messages", messages)}


class Publisher:
    """A decode engine's KV events publisher, as vLLM frames it: (topic, 8-byte sequence, msgpack batch)."""

    def __init__(self, address: str) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(address)
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()

    def stored(self, tokens: list[int], tag: str) -> None:
        n = len(tokens) // BLOCK
        ev = BlockStored(block_hashes=[f"{tag}{i}".encode() for i in range(n)], parent_block_hash=None,
                         token_ids=tokens[:n * BLOCK], block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), self.enc.encode(KVEventBatch(ts=1.0, events=[ev]))))
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def lengths() -> PromptLength:
    from pdserve.model.resolve import resolve_model

    return PromptLength(str(resolve_model(None)))


@pytest.fixture
def system(tmp_path, lengths):
    prefill = FakeEngine("prefill", MODEL)
    decodes = [FakeEngine("decode", MODEL) for _ in range(2)]
    servers = [ThreadServer(build_fake_engine(e)).__enter__() for e in [prefill, *decodes]]
    address = f"ipc://{tmp_path}/decode1-kv.sock"
    eps = [Endpoint(role=e.role, url=s.url, engine_id=e.engine_id,  # type: ignore[arg-type]
                    kv_events=address if e is decodes[1] else "")
           for e, s in zip([prefill, *decodes], servers)]
    eps[0].load.calibrated(1e6)
    for ep in eps[1:]:
        ep.load.calibrated(100.0, tpot_single=0.1)  # as the router's calibration measures a decode engine
    cfg = RouterConfig(policy="least_loaded", cache_aware_steps=4.0, local_prefill_below_tokens=0,
                       prefill_timeout_s=5, decode_timeout_s=10)
    built = build_router(cfg, MODEL, endpoints=eps, lengths=lengths)

    @built.app.on_event("startup")
    async def _follow() -> None:  # what the deployment's engine refresh does (pool.probe_forever)
        built.pool.follow_kv_events()

    @built.app.on_event("shutdown")
    async def _stop() -> None:
        built.pool.stop_following()

    pub = Publisher(address)
    router = ThreadServer(built.app).__enter__()
    client = httpx.Client(base_url=router.url, timeout=20)
    try:
        yield client, built, prefill, decodes, pub, eps[2]
    finally:
        client.close()
        router.__exit__()
        pub.close()
        for s in servers:
            s.__exit__()


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_follow_up_turn_runs_alone_on_the_decode_replica_that_holds_the_conversation(system, lengths, api):
    client, built, prefill, decodes, pub, holder_ep = system
    path, body = PATHS[api]
    follow_up = body([*HISTORY, FOLLOW_UP])
    ids = lengths.token_ids(api, follow_up)
    assert ids and len(ids) > 4 * BLOCK
    # The holder's engine stored the conversation so far (turn one's prompt and its answer, in whole blocks):
    # all of the follow-up's prompt but its last NEW_TAIL tokens.
    index = built.pool.kv_index
    deadline = time.monotonic() + 10
    while not index.blocks(holder_ep.key):  # a SUB socket misses what was sent before it joined
        assert time.monotonic() < deadline, "the router never received the decode engine's KV events"
        pub.stored(ids[:len(ids) - NEW_TAIL], "turn1-")
        time.sleep(0.05)
    assert index.cached(holder_ep.key, index.request_chain(ids, follow_up)) == (len(ids) - NEW_TAIL) // BLOCK

    before = (prefill.counters["requests"], decodes[0].counters["requests"], decodes[1].counters["requests"])
    r = client.post(path, json=follow_up)
    assert r.status_code == 200, r.text
    after = (prefill.counters["requests"], decodes[0].counters["requests"], decodes[1].counters["requests"])
    assert after == (before[0], before[1], before[2] + 1)  # no prefill leg; on the holder
    assert not decodes[1].requests[-1].get("kv_transfer_params")  # nothing pulled: it computed the rest
    # Exactness: the answer is the one engine's answer to the whole conversation.
    words = expected_words(_prompt_text(follow_up), 8)
    assert " ".join(words) in r.text
    decided = built.orchestrator.metrics.decisions.labels("local", "cached_on_decode")._value.get()
    assert decided >= 1

    # A conversation no decode replica holds is disaggregated, its prefill on the prefill engine.
    r = client.post(path, json=body(OTHER))
    assert r.status_code == 200, r.text
    assert prefill.counters["requests"] == before[0] + 1

