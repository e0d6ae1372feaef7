"""Routing by the engines' KV cache events: the index and the kv_cache plugin (following a real ZMQ
publisher: tests/component/test_kv_index.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from pdserve.config.routing import KvCacheSettings
from pdserve.config.schema import RouterConfig
from pdserve.router.endpoint import Endpoint
from pdserve.router.kv_index import KvIndex, wire_decoder
from pdserve.router.pool import EnginePool
from pdserve.router.routing.base import RoutingRequest
from pdserve.router.routing.kv_cache import KvCache

BS = 4


def stored(hashes, parent, tokens, lora=None, extra_keys=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=lora, extra_keys=extra_keys)


def batch(*events):
    """A batch as the engine publishes it, decoded as the router decodes it."""
    # as the router receives it: encoded by the engine with vLLM's structs, decoded with the router's
    return wire_decoder().decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events))))


PROMPT = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens


def test_cached_prefix_follows_stores_and_removals():
    idx = KvIndex()
    assert idx.chain(PROMPT) == []  # block size not known yet
    idx.apply("p0", 0, batch(stored([b"h1", b"h2"], None, PROMPT[:8])))
    idx.apply("p0", 1, batch(stored([b"h3"], b"h2", PROMPT[8:12])))
    chain = idx.chain(PROMPT)
    assert len(chain) == 3 and idx.cached("p0", chain) == 3 and idx.blocks("p0") == 3
    assert idx.cached("p1", chain) == 0
    # another prompt sharing the first block only
    other = idx.chain(PROMPT[:4] + [1, 2, 3, 4])
    assert idx.cached("p0", other) == 1
    idx.apply("p0", 2, batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")))
    assert idx.cached("p0", chain) == 1  # the prefix stops at the evicted block
    idx.apply("p0", 3, batch(AllBlocksCleared()))
    assert idx.cached("p0", chain) == 0 and idx.blocks("p0") == 0


def test_a_salted_prompt_is_found_only_under_its_salt():
    """vLLM hashes ``cache_salt`` into a prompt's first block (published in its event's extra_keys): another
    tenant's unsalted or differently salted copy of the prompt shares no block, in the engine nor here."""
    idx = KvIndex()
    idx.apply("p0", 0, batch(stored([b"s1", b"s2"], None, PROMPT[:8], extra_keys=[("tenant-a",), None])))
    assert idx.cached("p0", idx.chain(PROMPT, salt="tenant-a")) == 2
    assert idx.cached("p0", idx.chain(PROMPT)) == 0
    assert idx.cached("p0", idx.chain(PROMPT, salt="tenant-b")) == 0
    # with an adapter the adapter's name comes first in extra_keys, then the salt
    idx.apply("p0", 1, batch(stored([b"l1"], None, PROMPT[:4], lora="sql", extra_keys=[("sql", "tenant-a")])))
    assert idx.cached("p0", idx.chain(PROMPT, "sql", salt="tenant-a")) == 1
    assert idx.cached("p0", idx.chain(PROMPT, "sql")) == 0


def test_the_router_routes_a_salted_request_by_its_salt():
    from pdserve.router.routing.base import RoutingRequest

    plugin = KvCache(KvCacheSettings())
    plugin.index.apply("p0", 0, batch(stored([b"s1", b"s2"], None, PROMPT[:8], extra_keys=[("tenant-a",), None])))
    salted = plugin.key(RoutingRequest("completions", {"prompt": PROMPT, "cache_salt": "tenant-a"}, None, PROMPT))
    plain = plugin.key(RoutingRequest("completions", {"prompt": PROMPT}, None, PROMPT))
    assert plugin.index.cached("p0", salted) == 2 and plugin.index.cached("p0", plain) == 0


def test_adapters_and_unknown_parents_and_gaps():
    idx = KvIndex()
    idx.apply("p0", 0, batch(stored([b"a1"], None, PROMPT[:4], lora="sql")))
    assert idx.cached("p0", idx.chain(PROMPT, "sql")) == 1
    assert idx.cached("p0", idx.chain(PROMPT)) == 0  # the base model's blocks are other blocks
    # a block whose parent this router never saw cannot be placed in a chain: it is not counted
    idx.apply("p0", 1, batch(stored([b"x2"], b"never-seen", PROMPT[4:8])))
    assert idx.blocks("p0") == 1
    # a missed batch: what the engine holds is no longer known, so nothing is claimed
    idx.apply("p0", 5, batch(stored([b"h1"], None, PROMPT[:4])))
    assert idx.gaps == 1 and idx.blocks("p0") == 1 and idx.cached("p0", idx.chain(PROMPT, "sql")) == 0


def _ep(url: str, inflight: int = 0) -> Endpoint:
    ep = Endpoint(role="prefill", url=url)
    ep.inflight = inflight
    return ep


def test_plugin_picks_the_longest_cached_prefix_and_yields_to_load():
    plugin = KvCache(KvCacheSettings(slack=2))
    a, b = _ep("http://a"), _ep("http://b")
    plugin.index.apply(a.key, 0, batch(stored([b"h1"], None, PROMPT[:4])))
    plugin.index.apply(b.key, 0, batch(stored([b"g1", b"g2", b"g3"], None, PROMPT[:12])))
    key = plugin.key(RoutingRequest("completions", {"model": "m"}, None, PROMPT))
    assert plugin.choose([a, b], key) is b
    b.inflight = 3  # more than slack above a: load first
    assert plugin.choose([a, b], key) is a
    b.inflight = 0
    # nothing cached (or ids unknown): least loaded
    cold = plugin.key(RoutingRequest("completions", {"model": "m"}, None, [9] * 12))
    a.inflight = 1
    assert plugin.choose([a, b], cold) is b
    assert plugin.key(RoutingRequest("chat", {}, None, None)) is None
    # the adapter named in the model id is part of the key
    lora = plugin.key(RoutingRequest("completions", {"model": "m:sql"}, None, PROMPT))
    assert plugin.score(b, lora) == 0 and plugin.score(b, key) == 3


def test_pool_gives_kv_cache_prompt_ids_and_one_index():
    pool = EnginePool([_ep("http://a")], policy="least_loaded", prefill_policy="kv_cache")
    assert pool.wants_prompt_ids("prefill") and not pool.wants_prompt_ids("decode")
    assert pool._plugins["prefill"].index is pool.kv_index


@pytest.fixture(scope="module")
def packaged_model_dir():
    from pdserve.model.resolve import resolve_model

    return resolve_model(None)


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": [5, 6, 7]}),
    ("completions", {"prompt": "hello there"}),
    ("chat", {"messages": [{"role": "user", "content": "hello there"}]}),
])
def test_router_tells_the_prompt_ids_the_engine_computes(route, body, packaged_model_dir):
    from transformers import AutoTokenizer

    from pdserve.router.prompt_length import PromptLength

    ids = PromptLength(str(packaged_model_dir)).token_ids(route, body)
    tok = AutoTokenizer.from_pretrained(str(packaged_model_dir))
    if route == "chat":
        want = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        want = want if isinstance(want, list) else want["input_ids"]
    elif isinstance(body["prompt"], str):
        want = tok(body["prompt"])["input_ids"]
    else:
        want = body["prompt"]
    assert ids == list(want)
    assert PromptLength(str(packaged_model_dir)).token_ids("completions", {"prompt": ["a", "b"]}) is None
    assert PromptLength().token_ids("chat", body) is None


def test_a_clients_template_is_never_rendered_and_only_plain_flags_reach_the_models(packaged_model_dir):
    from pdserve.router.prompt_length import PromptLength

    pl = PromptLength(str(packaged_model_dir))
    msgs = [{"role": "user", "content": "hello there"}]
    plain = pl.token_ids("chat", {"messages": msgs})
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert pl.token_ids("chat", {"messages": msgs, "chat_template": loops}) is None
    assert pl.token_ids("chat", {"messages": msgs, "chat_template_kwargs": "x"}) is None
    # Plain flags reach the model's template; a template in the kwargs, or a huge value, is never rendered
    # here, and without it the router cannot tell the engine's prompt: no ids (the engine renders it alone).
    assert pl.token_ids("chat", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}) == plain
    for kwargs in ({"chat_template": loops, "enable_thinking": False}, {"blob": "x" * 100_000}):
        assert pl.token_ids("chat", {"messages": msgs, "chat_template_kwargs": kwargs}) is None


@pytest.mark.parametrize("route, extra", [
    ("completions", {"truncate_prompt_tokens": 4}),
    ("completions", {"truncation_side": "left"}),
    ("completions", {"add_special_tokens": False}),
    ("chat", {"add_special_tokens": True}),
    ("chat", {"documents": [{"text": "d"}]}),
    ("chat", {"truncate_prompt_tokens": 4}),
])
def test_no_ids_where_the_engine_computes_another_prompt(packaged_model_dir, route, extra):
    """A prompt the engine cuts, or renders with other special tokens or documents, is not the one the router
    renders: its ids would have a prefill leg read kept KV blocks of tokens it is not computing."""
    from pdserve.router.prompt_length import PromptLength

    pl = PromptLength(str(packaged_model_dir))
    body = ({"prompt": list(range(1000, 1100))} if route == "completions"
            else {"messages": [{"role": "user", "content": "hello there"}]})
    assert pl.token_ids(route, body) is not None
    assert pl.token_ids(route, {**body, **extra}) is None
    same = {"add_special_tokens": route == "completions", "truncate_prompt_tokens": None}
    assert pl.token_ids(route, {**body, **same}) == pl.token_ids(route, body)


def test_a_slow_chat_render_runs_off_the_event_loop_and_is_given_up(monkeypatch):
    """The router's loop goes on while a chat prompt renders in a worker thread; past the bound the request
    is routed without ids."""
    import threading

    from pdserve.router import gate
    from pdserve.router.orchestrator import Orchestrator
    from pdserve.router.pool import EnginePool

    release = threading.Event()
    loop_threads: list[bool] = []

    class Slow:
        def token_ids(self, route, body):
            loop_threads.append(threading.current_thread() is threading.main_thread())
            release.wait(10)
            return [1, 2, 3]

    monkeypatch.setattr(gate, "RENDER_TIMEOUT_S", 0.2)
    orch = Orchestrator(EnginePool(policy="round_robin"), RouterConfig())
    orch.gate.lengths = Slow()  # type: ignore[assignment]

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        got = await orch.gate.prompt_ids("chat", {"messages": []})
        t.cancel()
        release.set()
        return got, ticks

    got, ticks = asyncio.run(scenario())
    assert got is None and loop_threads == [False] and ticks > 1


def test_a_long_completions_text_is_encoded_off_the_event_loop_a_short_one_on_it():
    """Two long prompts at once: the count's encoding of the first is gone when its ids are asked for, and
    encoding 640,000 characters again on the loop held it 0.35 s."""
    import threading

    from pdserve.router.orchestrator import Orchestrator
    from pdserve.router.pool import EnginePool

    on_loop: list[bool] = []

    class Lengths:
        def is_big(self, route, body):
            return len(body["prompt"]) > 100

        def token_ids(self, route, body):
            on_loop.append(threading.current_thread() is threading.main_thread())
            return [1]

    orch = Orchestrator(EnginePool(policy="round_robin"), RouterConfig())
    orch.gate.lengths = Lengths()  # type: ignore[assignment]
    for prompt in ("short", "x" * 1000):
        assert asyncio.run(orch.gate.prompt_ids("completions", {"prompt": prompt})) == [1]
    assert on_loop == [True, False]


def test_a_prompt_is_encoded_once_for_its_length_and_its_ids(packaged_model_dir):
    """Admission measures a completion's prompt, routing by cached prefix needs its ids: one encoding."""
    from pdserve.router.prompt_length import PromptLength

    pl = PromptLength(str(packaged_model_dir))
    calls = []
    real = pl._tok

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, *a, **k):
            calls.append(a[0])
            return real.encode(*a, **k)

    pl._tok = Counting()
    body = {"prompt": "one prompt, measured and routed"}
    n, at_least = pl.measure("completions", body)
    ids = pl.token_ids("completions", body)
    assert calls == [body["prompt"]] and n == at_least == len(ids)
    assert ids == list(real.encode(body["prompt"], add_special_tokens=True).ids)
    pl.token_ids("completions", {"prompt": "another"})  # a different text is encoded anew
    assert calls == [body["prompt"], "another"]


def test_a_chat_template_that_cannot_load_is_not_tried_per_request(packaged_model_dir, monkeypatch):
    from pdserve.router.chat_template import ChatTemplate
    from pdserve.router.prompt_length import PromptLength

    tries = []

    def broken(*a, **k):
        tries.append(a)
        raise OSError("no tokenizer_config.json")

    monkeypatch.setattr(ChatTemplate, "load", broken)
    pl = PromptLength(str(packaged_model_dir))
    with pytest.raises(OSError):
        pl.load_chat_template()  # at the router's start: logged there
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert [pl.token_ids("chat", body) for _ in range(5)] == [None] * 5  # routed by load
    with pytest.raises(RuntimeError, match="no tokenizer_config"):
        pl.load_chat_template()
    assert len(tries) == 1
    assert pl.token_ids("completions", {"prompt": "text still works"})


def test_the_routers_structs_read_every_event_vllm_publishes():
    """The router decodes vLLM's batches with structs of its own (no vLLM import): every field it reads comes
    out as vLLM's own decoder gives it, whatever else vLLM's events carry."""
    events = [
        BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    lora_id=3, medium="CPU", lora_name="ad-1", extra_keys=[("ad-1", "salt-x"), None],
                    group_idx=0, kv_cache_spec_kind="full", locality="LOCAL", session_id="s1"),
        BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                    medium=None, lora_name=None),
        BlockRemoved(block_hashes=[b"\x01" * 32, 9], medium="GPU", group_idx=1, ownership="x"),
        AllBlocksCleared(),
    ]
    wire = msgspec.msgpack.encode(KVEventBatch(ts=5.0, events=events, data_parallel_rank=0))
    theirs = msgspec.msgpack.Decoder(KVEventBatch).decode(wire)
    ours = wire_decoder().decode(wire)
    assert [type(e).__name__ for e in ours.events] == [type(e).__name__ for e in theirs.events]
    for mine, vllm_ev in zip(ours.events, theirs.events):
        for name in mine.__struct_fields__:
            got, want = getattr(mine, name), getattr(vllm_ev, name)
            if name == "extra_keys" and want is not None:
                want = [list(k) if isinstance(k, tuple) else k for k in want]  # msgpack has no tuples
            assert got == want, name
    # and the index reads both alike
    a, b = KvIndex(), KvIndex()
    a.apply("e", 1, theirs)
    b.apply("e", 1, ours)
    assert a.blocks("e") == b.blocks("e")


def test_an_event_kind_the_router_does_not_know_is_skipped_and_the_rest_of_its_batch_counts():
    """A later vLLM may publish a new kind of event: that one is skipped, its batch's other events still count
    (a batch that failed whole would leave the engine's blocks unfollowed from then on)."""
    known = KVEventBatch(ts=1.0, events=[stored([b"h1", b"h2"], None, PROMPT[:8])])
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(known))
    batch[1].insert(0, {"type": "BlockMovedToMars", "block_hashes": [b"h1"], "planet": 4})
    batch[1].append({"type": "BlockRemoved", "block_hashes": "not a list"})  # a known kind, wrong shape
    got = wire_decoder().decode(msgspec.msgpack.encode(batch))
    assert got.skipped == 2 and [type(e).__name__ for e in got.events] == ["BlockStored"]
    idx = KvIndex()
    idx.apply("e", 1, got)
    assert idx.blocks("e") == 2
