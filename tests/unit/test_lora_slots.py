"""LoRA batch slots: the adapters each engine's batch runs at once, as admission counts them
(router/lora_slots.py; through the router with tenants: tests/component/test_lora.py)."""

from __future__ import annotations

import pytest

from pdserve.router.admission import Refused, admit
from pdserve.router.flight import Flight
from pdserve.router.lora_slots import LoraAsk, LoraSlots
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import EnginePool
from pdserve.router.validate import EngineLimits
from tests.unit.test_admission import Clock, cfg, endpoint


def test_a_full_batch_takes_only_adapters_it_runs_and_a_slot_comes_back_once():
    slots = LoraSlots()
    gone = [slots.claim(name, "t") for name in ("a", "b", "c", "d")]
    assert slots.running() == 4
    assert not slots.fits("e", "t", 4, fair=False) and slots.fits("a", "other", 4, fair=False)
    extra = slots.claim("a", "other")  # a second request on a running adapter takes no new slot
    gone[0]()
    gone[0]()  # (once)
    assert slots.running() == 4 and not slots.fits("e", "t", 4, fair=False)
    extra()
    assert slots.running() == 3 and slots.fits("e", "t", 4, fair=False)


def test_with_tenants_the_last_free_slot_goes_to_a_tenant_under_its_share():
    slots = LoraSlots()
    for name in ("a1", "a2", "a3"):
        slots.claim(name, "big")
    assert slots.fits("a4", "big", 4, fair=False)  # without tenants, first come
    assert not slots.fits("a4", "big", 4, fair=True)  # alone it holds 3 of 4 at most
    assert slots.fits("a1", "big", 4, fair=True)  # an adapter it runs already takes no slot
    assert slots.fits("b1", "small", 4, fair=True)
    slots.claim("b1", "small")
    assert not slots.fits("c1", "third", 4, fair=True)  # none free: contention, not one tenant's doing
    assert slots.held_by("big") == 3 and slots.held_by("small") == 1
    shared = LoraSlots()  # two tenants with two slots each of eight: the last free one for either
    for name, who in (("x1", "x"), ("x2", "x"), ("y1", "y"), ("y2", "y"), ("z1", "z"), ("z2", "z"), ("x3", "x")):
        shared.claim(name, who)
    assert not shared.fits("x4", "x", 8, fair=True) and shared.fits("w1", "w", 8, fair=True)


def test_admission_sends_an_adapter_to_an_engine_whose_batch_can_start_it_else_429():
    c = Clock()
    p, d1, d2 = endpoint("prefill", "http://p", c), endpoint("decode", "http://d1", c), endpoint("decode", "http://d2", c)
    pool = EnginePool([p, d1, d2])
    for name in ("a", "b"):
        d1.loras.claim(name, "t")
    ask = LoraAsk("new", "t", slots=2, fair=False)
    for _ in range(4):  # whatever the routing policy picks, d1 cannot start it
        got = admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30, lora=ask)
        assert got.decode is d2 and got.prefill is p
    for name in ("c", "d"):
        d2.loras.claim(name, "t")
    with pytest.raises(Refused) as e:
        admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30, lora=ask)
    assert e.value.cause == "lora_slots" and "max_loras" in str(e.value) and e.value.retry_after_ms >= 800  # (1 s, moved by a fifth)
    running = LoraAsk("a", "t", slots=2, fair=False)
    assert admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30, lora=running).decode is d1
    # No decode engine up: a prefill engine answers whole requests, with the same check.
    for name in ("a", "b"):
        p.loras.claim(name, "t")
    with pytest.raises(Refused):
        admit(EnginePool([p]), cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30, lora=ask)


def test_a_requests_slot_follows_its_stream_and_is_given_back_with_the_rest():
    c = Clock()
    d1, d2 = endpoint("decode", "http://d1", c), endpoint("decode", "http://d2", c)
    flight = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=8)
    flight.lora = LoraAsk("a", "t", slots=4, fair=False)
    flight.claim_lora(d1)
    flight.start_stream(d1)
    assert d1.loras.running() == 1 and not flight.released
    flight.start_stream(d2)  # the stream moved (its engine died): so does the slot
    assert d1.loras.running() == 0 and d2.loras.running() == 1
    assert d2.as_dict()["lora_adapters_running"] == 1 and "lora_adapters_running" not in d1.as_dict()
    flight.release()
    flight.release()
    assert d2.loras.running() == 0 and flight.released


def test_the_engines_batch_size_in_adapters_is_the_fewest_of_the_roles_serving_them():
    assert EngineLimits.from_engine_kwargs({}, {}).max_loras is None
    assert EngineLimits.from_engine_kwargs({"enable_lora": True}, {}).max_loras == 1  # vLLM's default
    assert EngineLimits.from_engine_kwargs({"enable_lora": True, "max_loras": 4},
                                           {"enable_lora": True, "max_loras": "2"}).max_loras == 2


def test_an_engine_loads_an_adapter_it_was_not_sent_among_the_last_it_keeps():
    slots = LoraSlots()
    assert slots.loads("a", 2) and not slots.loads("a", 2)
    assert slots.loads("b", 2) and not slots.loads("a", 2)  # a is the most recent now
    assert slots.loads("c", 2)  # the engine keeps two: b went
    assert slots.loads("b", 2) and not slots.loads("c", 2)


def test_a_prompt_whose_engine_loads_its_adapter_teaches_admission_no_speed():
    """Four adapters' first prompts (each engine loads the adapter, seconds on CPU) had made a prefill engine's
    measured speed so low that a 40-token prompt was refused as a 29-s wait."""
    c = Clock()
    p = endpoint("prefill", "http://p", c)
    ask = LoraAsk("a", "t", slots=4, fair=False, cache=4)

    def prompt(seconds: float, tokens: int = 100) -> None:
        flight = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), tokens, new_tokens=8)
        flight.lora = ask
        flight.queue_prompt(p)
        c.t += seconds
        flight.end_prompt(tokens)

    for _ in range(2):  # base-model prompts: 100 tokens/s
        base = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 100, new_tokens=8)
        base.queue_prompt(p)
        c.t += 1.0
        base.end_prompt(100)
    assert p.load.rate() == pytest.approx(100.0)
    prompt(20.0)  # the engine loads adapter a: 100 tokens in 20 s
    assert p.load.rate() == pytest.approx(100.0)
    prompt(1.0)  # loaded: a sample like any other
    assert p.load.rate() == pytest.approx(100.0) and len(p.load._done) == 3
    # Queued together, a prompt that loads an adapter spoils the stretch of the one that ends before it too.
    first, second = (Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 100, new_tokens=8) for _ in range(2))
    second.lora = LoraAsk("b", "t", slots=4, fair=False, cache=4)
    first.queue_prompt(p)
    second.queue_prompt(p)
    c.t += 10.0
    first.end_prompt(100)
    c.t += 10.0
    second.end_prompt(100)
    assert len(p.load._done) == 3 and p.load.rate() == pytest.approx(100.0)


def test_the_adapters_an_engine_keeps_are_its_max_cpu_loras_or_else_max_loras():
    assert EngineLimits.from_engine_kwargs({"enable_lora": True, "max_loras": 2}).lora_cache == 2
    assert EngineLimits.from_engine_kwargs({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 8},
                                           {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 6}).lora_cache == 6


def test_a_stream_that_moves_goes_to_an_engine_whose_batch_can_run_its_adapter_where_one_can():
    """A decode engine failed mid-stream (or before its first byte): the stream goes on on another replica,
    one whose batch runs the adapter or has a slot free; only where none has does it go to a full one (it
    waits inside that engine: better than a cut stream)."""
    import asyncio

    from pdserve.router.engine_client import UpstreamReply
    from pdserve.router.moves import Moves

    c = Clock()
    d1, full, room = (endpoint("decode", f"http://{n}", c) for n in ("d1", "full", "room"))
    for name in ("x", "y"):
        full.loras.claim(name, "t")
    pool = EnginePool([d1, full, room])
    sent: list[str] = []

    class Client:
        async def stream(self, ep, route, body, request_id, headers):
            sent.append(ep.url)

            async def chunks():
                yield b""

            return UpstreamReply(status=200, stream=chunks())

    def flight() -> Flight:
        f = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=8)
        f.lora = LoraAsk("a", "t", slots=2, fair=False)
        f.claim_lora(d1)
        f.start_stream(d1)
        return f

    moves = Moves(Client(), pool, RouterMetrics())  # type: ignore[arg-type]
    for _ in range(6):  # whatever the routing policy would pick
        f = flight()
        asyncio.run(moves.resumer("r", {d1.url}, f)("completions", {}))
        assert sent[-1] == room.url and room.loras.running() == 1
        f.release()
    f = flight()
    asyncio.run(moves.resumer("r", {d1.url, room.url}, f)("completions", {}))  # only the full one is left
    assert sent[-1] == full.url and full.loras.running() == 3
    assert pool.pick("decode", prefer=lambda e: False) in (d1, full, room)  # none preferred: any
