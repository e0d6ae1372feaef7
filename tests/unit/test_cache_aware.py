"""Cache-aware disaggregation (``router.cache_aware_steps``): a request whose prompt a decode replica already
holds runs there alone (router/cache_aware.py, the gate, admission). With real sockets and fake engines:
tests/component/test_cache_aware.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.config.schema import PDServeArgs, RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.engine.launcher import EnginePlacement, build_engine_command, routes_by_kv_events
from pdserve.router import cache_aware, handoff
from pdserve.router.admission import admit
from pdserve.router.endpoint import Endpoint
from pdserve.router.flight import Flight
from pdserve.router.kv_index import KvIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool
from pdserve.router.prompt_length import PromptLength, as_chat_messages
from pdserve.router.request import Request
from tests.unit.test_kv_index import BS, batch, stored

#: A 40-token prompt: 10 blocks of 4.
PROMPT = list(range(200, 240))
#: Decode computes 100 prompt tokens/s and takes 50 ms a step: 5 tokens a step, 20 in 4 steps.
RATE, STEP = 100.0, 0.05


def decode(url: str, *, inflight: int = 0, measured: bool = True) -> Endpoint:
    ep = Endpoint(role="decode", url=url)
    ep.inflight = inflight
    if measured:
        ep.load.calibrated(RATE, tpot_single=STEP)
    return ep


def hold(index: KvIndex, ep: Endpoint, tokens: list[int], tag: str) -> None:
    """``ep``'s engine says it stored ``tokens`` (whole blocks) as the first blocks of a prompt."""
    n = len(tokens) // BS
    seq = index._engines[ep.key].last_seq + 1 if ep.key in index._engines else 0  # type: ignore[operator]
    index.apply(ep.key, seq, batch(stored([f"{tag}{i}".encode() for i in range(n)], None, tokens[:n * BS])))


def holder(decodes: list[Endpoint], index: KvIndex, *, steps: float = 4.0, slack: int = 2):
    return cache_aware.holder(decodes, index, index.chain(PROMPT), len(PROMPT), steps=steps, slack=slack)


def test_the_replica_holding_the_prompt_within_its_steps_takes_it():
    index = KvIndex()
    a, b = decode("http://a"), decode("http://b")
    hold(index, a, PROMPT[:8], "a")  # 32 tokens to compute: more than 4 steps' 20
    hold(index, b, PROMPT[:24], "b")  # 16 to compute: within
    got = holder([a, b], index)
    assert got is not None and got.endpoint is b
    assert (got.cached_tokens, got.uncached_tokens, got.budget_tokens) == (24, 16, 20)
    # fewer steps: 16 tokens are more than 3 steps' 15
    assert holder([a, b], index, steps=3.0) is None


def test_not_cached_enough_or_not_measured_or_off_means_p_d():
    index = KvIndex()
    a = decode("http://a")
    assert holder([a], index) is None  # nothing known yet (no block size)
    hold(index, a, PROMPT[:16], "a")  # 24 left: more than 20
    assert holder([a], index) is None
    hold(index, a, PROMPT[:20], "a")
    assert holder([a], index) is not None
    assert holder([a], index, steps=0) is None  # off
    cold = decode("http://cold", measured=False)
    hold(index, cold, PROMPT[:36], "c")
    assert holder([cold], index) is None  # no measured speed: not applied
    assert cache_aware.budget(cold, 4.0) is None and cache_aware.budget(a, 4.0) == 20


def test_an_overloaded_holder_gives_way_to_another_holder_or_to_p_d():
    index = KvIndex()
    a, b, idle = decode("http://a", inflight=5), decode("http://b", inflight=1), decode("http://idle")
    hold(index, a, PROMPT[:36], "a")  # holds the most
    hold(index, b, PROMPT[:24], "b")
    got = holder([a, b, idle], index, slack=2)  # a is 5 above the least loaded: passed over
    assert got is not None and got.endpoint is b
    b.inflight = 3
    assert holder([a, b, idle], index, slack=2) is None  # neither: disaggregated
    assert holder([a, b, idle], index, slack=5).endpoint is a  # type: ignore[union-attr]


def test_a_holder_whose_streams_the_uncached_part_would_stall_too_long_gives_way():
    """Its uncached part may stall the streams running there by at most BY_LOAD_STALL_SHARE of the shortest
    one's decode time; the stall is judged against each stream's own length."""
    from pdserve.router.admission import BY_LOAD_STALL_SHARE

    index = KvIndex()
    b = decode("http://b")
    hold(index, b, PROMPT[:24], "b")  # 16 tokens to compute
    assert holder([b], index) is not None  # nothing streams there
    # A stream of n new tokens at 0.05 s a step tolerates a stall of BY_LOAD_STALL_SHARE * n * 0.05 s.
    need = b.load.service_s(16) / (BY_LOAD_STALL_SHARE * STEP)  # the shortest answer that tolerates them
    b.load.add_stream()
    b.load.add_answer(int(need) - 1)
    assert holder([b], index) is None  # a shorter answer would be stalled too long: P/D
    b.load.end_answer(int(need) - 1)
    b.load.add_answer(int(need) + 1)
    got = holder([b], index)
    assert got is not None and got.endpoint is b


def prefill(url: str = "http://p") -> Endpoint:
    ep = Endpoint(role="prefill", url=url)
    ep.load.calibrated(RATE)
    return ep


def test_past_its_budget_a_holder_answers_when_p_d_would_answer_much_later():
    """24 uncached tokens are past 4 steps' 20; decode computes them in 0.48 s (the calibrated 100 tokens/s,
    derated by half), P/D in 0.9 s: the whole 40-token prompt on prefill (0.8 s) and two decode steps."""
    index = KvIndex()
    b, p = decode("http://b"), prefill()
    hold(index, b, PROMPT[:16], "b")
    assert holder([b], index) is None  # no prefill to weigh against: the budget alone
    got = cache_aware.holder([b], index, index.chain(PROMPT), len(PROMPT), steps=4.0, slack=2, prefills=[p])
    assert got is not None and got.endpoint is b and got.uncached_tokens == 24 > got.budget_tokens
    assert cache_aware.pd_first_token_s([p], index, index.chain(PROMPT), len(PROMPT), b) == pytest.approx(0.9)


def test_a_holder_past_its_budget_gives_way_when_its_streams_would_lose_more_than_the_request_gains():
    index = KvIndex()
    b, p = decode("http://b"), prefill()
    hold(index, b, PROMPT[:16], "b")

    def got():
        return cache_aware.holder([b], index, index.chain(PROMPT), len(PROMPT), steps=4.0, slack=2, prefills=[p])

    b.load.add_stream()  # one stream stalls 0.48 s; the request gains 0.42 s: P/D
    b.load.add_answer(1000)  # long enough that the budget's own stall bound would let it pass
    assert got() is None
    p.load.add_prompt(100)  # prefill's queue: 2 s more for P/D; now the request gains 2.42 s
    assert got() is not None
    for _ in range(5):  # six streams lose 2.88 s together: P/D again
        b.load.add_stream()
    assert got() is None


def test_a_prompt_prefill_holds_too_goes_p_d_when_that_is_as_quick():
    """Prefill's own cache counts: holding 36 of the 40 tokens, it computes 4 (0.08 s), and P/D's first
    token (0.18 s) comes sooner than the holder's 24 tokens (0.48 s)."""
    index = KvIndex()
    b, p = decode("http://b"), prefill()
    hold(index, b, PROMPT[:16], "b")
    hold(index, p, PROMPT[:36], "p")
    assert cache_aware.pd_first_token_s([p], index, index.chain(PROMPT), len(PROMPT), b) == pytest.approx(0.18)
    assert cache_aware.holder([b], index, index.chain(PROMPT), len(PROMPT), steps=4.0, slack=2, prefills=[p]) is None


def test_a_prompt_prefill_would_read_from_decode_goes_p_d_when_that_is_as_quick():
    """nixl.bidirectional: prefill would read the first 36 tokens from a decode engine's kept blocks and
    compute 4 (0.08 s): P/D's first token (0.18 s) comes sooner than the holder's 24 tokens (0.48 s), as when
    prefill holds them itself; reading fewer than it holds changes nothing."""
    index = KvIndex()
    b, p = decode("http://b"), prefill()
    hold(index, b, PROMPT[:16], "b")
    chain = index.chain(PROMPT)
    assert cache_aware.holder([b], index, chain, len(PROMPT), steps=4.0, slack=2, prefills=[p]) is not None
    assert cache_aware.holder([b], index, chain, len(PROMPT), steps=4.0, slack=2, prefills=[p],
                              prefill_reads=36) is None
    assert cache_aware.prefill_done_s([p], index, chain, len(PROMPT), 36) == pytest.approx(0.08)
    hold(index, p, PROMPT[:36], "p")
    assert cache_aware.prefill_done_s([p], index, chain, len(PROMPT), 8) == pytest.approx(0.08)


def test_a_request_on_the_holder_is_checked_by_admission_like_any_local_one():
    index = KvIndex()
    a, b = decode("http://a"), decode("http://b")
    p = Endpoint(role="prefill", url="http://p")
    p.load.calibrated(1000.0)
    pool = EnginePool([p, a, b], policy="least_loaded")
    cfg = RouterConfig(max_queue_wait_s=8.0)
    got = admit(pool, cfg, disaggregate=False, reason=handoff.CACHED_ON_DECODE, prompt_tokens=40, lease_s=None,
                local_on=b)
    assert (got.prefill, got.decode, got.reason) == (None, b, handoff.CACHED_ON_DECODE)
    # the holder's queue is past the budget: P/D (another decode replica takes the stream)
    b.load.add_prompt(10_000)
    got = admit(pool, cfg, disaggregate=False, reason=handoff.CACHED_ON_DECODE, prompt_tokens=40, lease_s=None,
                local_on=b)
    assert (got.prefill, got.decode, got.reason) == (p, a, "pd")
    assert index.engines() == []


def test_the_plan_says_cached_on_decode_only_for_a_splittable_request():
    def plan(body: dict, **kw) -> handoff.Plan:
        return handoff.plan(Request.parse("completions", {"prompt": PROMPT, "max_tokens": 8, **body}, 40), **kw)

    assert plan({}, cached_on_decode=True) == handoff.Plan(False, handoff.CACHED_ON_DECODE)
    assert plan({"n": 2}, cached_on_decode=True).reason == "n>1"
    assert plan({}, cached_on_decode=True, local_below=100).reason == handoff.CACHED_ON_DECODE
    assert plan({}) == handoff.Plan(True, "pd")


def _gate_admit(orch: Orchestrator, body: dict):
    async def go():
        req, adm, flight, _ = await orch.gate.admit("completions", body, None, "", DEFAULT_TENANT)
        flight.release()
        return req, adm

    return asyncio.run(go())


def _system(steps: float, **cfg) -> tuple[Orchestrator, Endpoint, Endpoint, Endpoint]:
    p, a, b = Endpoint(role="prefill", url="http://p"), decode("http://a"), decode("http://b")
    p.load.calibrated(1000.0)
    conf = RouterConfig(policy="least_loaded", cache_aware_steps=steps, local_prefill_below_tokens=0, **cfg)
    pool = EnginePool([p, a, b], policy="least_loaded", follow_all=steps > 0)
    orch = Orchestrator(pool, conf, RouterMetrics())
    hold(pool.kv_index, b, PROMPT[:32], "b")
    return orch, p, a, b


def test_the_gate_runs_a_request_cached_on_decode_there_alone_and_only_its_rest_is_queued():
    orch, p, a, b = _system(4.0)
    assert orch.pool.follows("decode") and orch.pool.follows("prefill")
    _, adm = _gate_admit(orch, {"model": "m", "prompt": PROMPT, "max_tokens": 8})
    assert (adm.prefill, adm.decode, adm.reason) == (None, b, handoff.CACHED_ON_DECODE)
    # an adapter's or another tenant's (salted) copy of the prompt is other blocks: P/D
    _, adm = _gate_admit(orch, {"model": "m", "prompt": PROMPT, "max_tokens": 8, "cache_salt": "x"})
    assert adm.prefill is p and adm.reason == "pd"
    # off: P/D whatever decode holds
    orch, p, a, b = _system(0.0)
    assert not orch.pool.follows("decode") and not orch.pool.follows("prefill")
    _, adm = _gate_admit(orch, {"model": "m", "prompt": PROMPT, "max_tokens": 8})
    assert adm.prefill is p and adm.reason == "pd"


def test_the_gate_passes_over_an_overloaded_holder():
    orch, p, a, b = _system(4.0, plugins={"kv_cache": {"slack": 1}})
    b.inflight = 2
    _, adm = _gate_admit(orch, {"model": "m", "prompt": PROMPT, "max_tokens": 8})
    assert adm.prefill is p and adm.decode is a and adm.reason == "pd"


def test_a_flight_cached_on_decode_queues_and_teaches_only_the_uncached_part():
    b, other = decode("http://b"), decode("http://c")
    flight = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), prompt_tokens=40)
    flight.held_on(b, 32, 8)
    flight.queue_prompt(b)
    assert b.load.queued_tokens == 8
    flight.queue_prompt(other)  # a retry elsewhere computes the whole prompt
    assert b.load.queued_tokens == 0 and other.load.queued_tokens == 40
    flight.end_prompt(None)
    flight.queue_prompt(b)
    flight.end_prompt(40)  # the engine reports the whole prompt; it computed 8
    assert b.load._done[-1][0] == 8
    flight.release()


def test_prefill_is_charged_only_the_part_of_a_prompt_it_does_not_hold():
    """A conversation's next turn on a prefill engine that holds its history queues only the new part there
    (admission's wait estimate) and teaches prefill's speed from that part only."""
    orch, p, a, b = _system(4.0)
    hold(orch.pool.kv_index, p, PROMPT[:32], "p")

    async def go():
        _, adm, flight, _ = await orch.gate.admit("completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8,
                                                                 "cache_salt": "t"}, None, "", DEFAULT_TENANT)
        return adm, flight

    # the salted prompt is not what decode or prefill hold: P/D, and prefill computes all 40 tokens
    adm, flight = asyncio.run(go())
    assert adm.prefill is p and adm.reason == "pd"
    flight.queue_prompt(p)
    assert p.load.queued_tokens == len(PROMPT)
    flight.release()
    # b (decode) no longer holds it, p (prefill) holds the first 32 tokens: P/D, 8 tokens queued on p
    orch.pool.kv_index.forget(b.key)
    req, adm, flight, _ = asyncio.run(orch.gate.admit("completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8},
                                                       None, "", DEFAULT_TENANT))
    assert adm.prefill is p and adm.reason == "pd"
    flight.queue_prompt(p)
    assert p.load.queued_tokens == len(PROMPT) - 32
    flight.end_prompt(len(PROMPT))
    assert p.load._done[-1][0] == len(PROMPT) - 32
    flight.release()
    assert p.load.queued_tokens == 0


def test_a_prompt_the_engine_holds_whole_still_costs_its_last_token():
    index = KvIndex()
    ep = decode("http://a")
    hold(index, ep, PROMPT[:32], "a")
    chain = index.chain(PROMPT[:32])
    assert cache_aware.cached_part(ep, index, chain, 32) == (31, 1)
    assert cache_aware.cached_part(ep, index, chain, 40) == (32, 8)
    assert cache_aware.cached_part(ep, index, [], 40) is None


def test_a_kv_cache_decode_policy_shares_the_one_index():
    pool = EnginePool([decode("http://a")], policy="least_loaded", decode_policy="kv_cache", follow_all=True)
    assert pool._plugins["decode"].index is pool.kv_index  # type: ignore[attr-defined]


def test_every_engine_publishes_kv_events_while_cache_aware_is_on():
    on = PDServeArgs()
    assert on.router.cache_aware_steps == 4.0
    assert routes_by_kv_events("decode", on) and routes_by_kv_events("prefill", on)
    off = PDServeArgs.model_validate({"router": {"cache_aware_steps": 0}})
    assert not routes_by_kv_events("decode", off) and not routes_by_kv_events("prefill", off)
    both = PDServeArgs.model_validate({"router": {"cache_aware_steps": 0, "policy": "kv_cache"}})
    assert routes_by_kv_events("decode", both) and routes_by_kv_events("prefill", both)
    with pytest.raises(ValueError):
        PDServeArgs.model_validate({"router": {"cache_aware_steps": -1}})
    pl = EnginePlacement(http_port=9000, side_channel_port=9100, side_channel_host="127.0.0.1", engine_id="d0",
                         cores=[], on_cpu=True, kv_events_bind="ipc:///tmp/pdserve-kv-events/d0.sock")
    argv = build_engine_command("decode", on, "/m", pl).argv
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["endpoint"] == "ipc:///tmp/pdserve-kv-events/d0.sock"


def test_responses_and_messages_conversations_render_as_chat():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "a\nb"}]
    responses = {"instructions": "be brief", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}
    messages = {"system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert as_chat_messages("responses", responses) == chat
    assert as_chat_messages("messages", messages) == chat
    assert as_chat_messages("responses", {"input": "hi"}) == [{"role": "user", "content": "hi"}]
    # more than text: the engine's own rendering, unknown here
    assert as_chat_messages("responses", {"input": [{"type": "function_call_output", "output": "x"}]}) is None
    assert as_chat_messages("messages", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}) is None
    assert as_chat_messages("messages", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}) is None


def test_a_responses_or_messages_prompt_has_the_ids_of_the_same_chat(packaged_model_dir):
    pl = PromptLength(str(packaged_model_dir))
    chat = pl.token_ids("chat", {"messages": [{"role": "user", "content": "hello there"}]})
    assert chat
    assert pl.token_ids("responses", {"input": "hello there"}) == chat
    assert pl.token_ids("messages", {"messages": [{"role": "user", "content": "hello there"}]}) == chat
    assert PromptLength().token_ids("responses", {"input": "hello there"}) is None  # no tokenizer


@pytest.fixture(scope="module")
def packaged_model_dir():
    from pdserve.model.resolve import resolve_model

    return resolve_model(None)
