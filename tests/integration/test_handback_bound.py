"""``nixl.decode_pin_share`` with real engines: the blocks a decode engine keeps for next turns hold at most
that share of its KV cache together, and a conversation past it answers as one engine all the same.

Its own system (handback-bound.yaml: 1 prefill + 1 decode, float32, every turn P/D, a context of 512 tokens
so decode's KV cache is a couple of dozen blocks, pins of 60 s, half of the blocks for pins). Three conversations,
each a little over a third of what pins may hold, end at once: decode keeps two and frees the third's blocks
at once (its KV cache use says so); the next turns read what was kept (the router counts ``read``) or find
nothing (``gone``) and compute the last answer on prefill, and every answer is one engine's.

The system also runs ``cpu.share_weights: packed`` (the default) as a host runs it after its first start:
each engine core computes with the weights the engines' forkserver packed, pages it shares, not its own.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import ROOT, ServeProcess, SystemSlot, engine_auth
from tests.integration.test_handback import chat, one_engine, outcomes, words
from tests.integration.test_pd_real import MODEL, engine_metrics, metric
from tests.integration.test_shared_weights import engine_cores, shared_anonymous, weight_files

pytestmark = pytest.mark.integration

#: decode_pin_share and the engines' max_model_len in handback-bound.yaml; the test's answers' length.
PIN_SHARE = 0.5
CONTEXT = 512
ANSWER = 24
#: An engine core's anonymous memory shared with other processes, at least, with packed weights (the
#: packaged model in float32; measured 0.83 GiB, 0.33 with its own packed copy).
SHARED_BYTES = 0.6 * (1 << 30)


@pytest.fixture(scope="module")
def served(system_slot: SystemSlot):
    def start() -> ServeProcess:
        sp = system_slot.own(ROOT / "tests" / "integration" / "handback-bound.yaml", engines=2,
                             what="the bounded-pins system (1 prefill + 1 decode engine, nixl.decode_pin_share 0.5)")
        sp.wait_ready()
        return sp

    if not weight_files():  # the host's first float32 start: it writes the weight files the next one packs
        start().stop()
    sp = start()
    yield sp
    sp.stop()


def test_the_engines_compute_with_one_packed_copy_of_the_weights(served: ServeProcess):
    cores = engine_cores(served)
    assert len(cores) == 2, f"engine cores of this system: {cores}"
    shared = [shared_anonymous(pid) for pid in cores]
    # Each with its own packed copy (cpu.share_weights: off), an engine core shares 0.33 GiB of anonymous
    # memory (what its server and the forkserver built before the forks); packed, 0.83: the weights' 0.5 more.
    assert min(shared) >= SHARED_BYTES, f"anonymous memory the engine cores share: {shared}"


def kv_blocks(url: str) -> tuple[int, int]:
    """A decode engine's KV block size and its number of blocks (vLLM's ``cache_config_info``)."""
    info = re.search(r"vllm:cache_config_info\{([^}]*)\}", engine_metrics(url))
    assert info is not None, "decode publishes no cache_config_info"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    return int(labels["block_size"]), int(labels["num_gpu_blocks"])


def conversation(served: ServeProcess, seed: float, tokens: int, tolerance: int) -> list[dict]:
    """A first turn whose prompt is ``tokens`` ± ``tolerance`` long (counted by the prefill engine)."""
    prefill = served.engine_url("prefill")
    n = tokens
    for _ in range(20):
        messages = [{"role": "system", "content": words(random.Random(seed), n)},
                    {"role": "user", "content": "Sum it up."}]
        r = httpx.post(prefill + "/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
                       headers=engine_auth(prefill), timeout=60)
        assert r.status_code == 200, r.text
        got = int(r.json()["count"])
        if abs(got - tokens) <= tolerance:
            return messages
        n += (tokens - got) * 3 // 4 or (1 if got < tokens else -1)
    raise AssertionError(f"no prompt of {tokens} tokens")


def test_pins_hold_at_most_their_share_and_a_conversation_past_it_answers_as_one_engine(served: ServeProcess):
    decode = served.engine_url("decode")
    block, blocks = kv_blocks(decode)
    assert block >= 4 * ANSWER, block  # (a turn's answer ends in its prompt's last block)
    limit = int(blocks * PIN_SHARE)
    each = limit // 3 + 1  # blocks of one conversation's first turn (prompt and answer): two fit, three do not
    assert 2 * each <= limit < 3 * each
    prompt = (each - 1) * block + block // 2 - ANSWER  # its last block half full
    assert prompt + ANSWER + 64 < CONTEXT, "decode's KV cache is too large for this test's context"
    rng = random.Random(23)
    firsts = [conversation(served, rng.random(), prompt, block // 4) for _ in range(3)]
    usage = "vllm:kv_cache_usage_perc"
    deadline = time.monotonic() + 30
    while metric(engine_metrics(decode), usage) > 0:  # (nothing kept yet: a fresh system)
        assert time.monotonic() < deadline, "decode's KV cache is not empty at the start"
        time.sleep(1)
    before = outcomes(served)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda m: chat(served.url, m), firsts))
        kept = metric(engine_metrics(decode), usage) * (blocks - 1)  # (vLLM's usage leaves out its null block)
        nexts = [m + [{"role": "assistant", "content": a}, {"role": "user", "content": words(rng, 30) + " And?"}]
                 for m, a in zip(firsts, answers)]
        got = list(pool.map(lambda m: chat(served.url, m), nexts))
    after = outcomes(served)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert round(kept) == 2 * each, (kept, each, limit)  # two conversations kept, the third's blocks freed
    assert (grew.get("read"), grew.get("gone")) == (2, 1), grew
    with ThreadPoolExecutor(3) as pool:
        assert got == list(pool.map(lambda m: one_engine(served, m), nexts))
