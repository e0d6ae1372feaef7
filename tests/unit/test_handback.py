"""``nixl.bidirectional``: what decode keeps of a finished turn, and how the next turn's prefill reads it.

The router's notes (router/handback.py), its check of the next prompt against the engine's own tokens, the
engine's notes (engine/kv_handback.py, with a stand-in for vLLM's output processor), the settings it turns on
(config/kv_transfer.py), and the orchestrator's two ends: a finished stream noted, the next prefill leg given
the blocks to read.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from pdserve.config.host import MIN_PIN_S, NixlConfig
from pdserve.config.kv_transfer import CPU_RECOMPUTE_BELOW_TOKENS, build_kv_transfer_config, handback_ttl_s
from pdserve.config.schema import PDServeArgs, RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.engine import kv_handback
from pdserve.owned import OwnedOrder
from pdserve.router import handback, handoff, migrate
from pdserve.router.endpoint import Endpoint
from pdserve.router.handback import (
    GRAIN,
    MIN_TOKENS,
    VLLM_READ_MARGIN_S,
    Handbacks,
    prefill_params,
    read_window_s,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool
from pdserve.router.request import Request

#: A finished turn: 300 prompt ids and 40 answer ids; the next turn adds 50 more.
PROMPT = list(range(1000, 1300))
ANSWER = list(range(5000, 5040))
NEXT = PROMPT + ANSWER + list(range(7000, 7050))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _noted(ttl: float = 30.0) -> tuple[Handbacks, Endpoint, Clock]:
    clock = Clock()
    hb = Handbacks(ttl, clock=clock)
    ep = Endpoint(role="decode", url="http://d")
    hb.record(ep, "r1", PROMPT + ANSWER, "alice", None, prompt_tokens=len(PROMPT))
    return hb, ep, clock


# -- the router's notes -----------------------------------------------------------------------------


def test_an_answer_a_prefill_engine_gave_whole_is_not_noted():
    """Prefill engines keep no blocks (by load answers some requests whole there): a note would cost the
    next turn a question and find nothing."""
    hb = Handbacks(30.0, clock=Clock())
    hb.record(Endpoint(role="prefill", url="http://p"), "r1", PROMPT + ANSWER, "alice", None,
              prompt_tokens=len(PROMPT))
    assert hb.find(NEXT, "alice", None) is None


def test_the_next_turn_finds_the_last_one_once_by_its_whole_tokens_or_its_prompt_alone():
    hb, ep, _ = _noted()
    got = hb.find(NEXT, "alice", None)
    assert got is not None and (got.ep, got.request_id, got.tokens) == (ep, "r1", len(PROMPT + ANSWER))
    assert hb.find(NEXT, "alice", None) is None  # read once: the engine gives its blocks up with the first read
    # A next prompt that renders the answer with other ids still finds it by the prompt's own grains.
    hb, ep, _ = _noted()
    other = PROMPT + [9] * 40 + list(range(7000, 7050))
    got = hb.find(other, "alice", None)
    assert got is not None and got.request_id == "r1" and len(hb) == 0
    # Nothing in common with a noted request: nothing found.
    hb, _, _ = _noted()
    assert hb.find(list(range(20000, 20400)), "alice", None) is None


def test_another_tenant_another_adapter_a_lapsed_pin_or_an_unwell_engine_find_nothing():
    hb, ep, clock = _noted()
    assert hb.find(NEXT, "bob", None) is None
    assert hb.find(NEXT, "alice", "sql-adapter") is None
    assert hb.find(NEXT, "alice", None) is not None  # (still there for its own tenant)
    hb, ep, clock = _noted(ttl=30.0)
    clock.t += 23.9  # within the read window: 30 s less vLLM's 5 s read margin, less the router's 1 s
    assert hb.find(NEXT, "alice", None, take=False) is not None
    # A prefill engine that would start the leg only after the window (its queue) gets nothing to read.
    assert hb.find(NEXT, "alice", None, wait_s=0.2) is None and len(hb) > 0
    clock.t += 0.2  # past it: vLLM would decline the read (the router would count a read that computed)
    assert hb.find(NEXT, "alice", None) is None and len(hb) == 0
    hb, ep, _ = _noted()
    ep.healthy = False
    assert hb.find(NEXT, "alice", None) is None


def test_conversations_that_share_a_system_prompt_keep_their_own_notes():
    """Two conversations' first turns share 256 tokens of system prompt and a question shorter than a grain:
    their prompts alone end at the same grain. Reading one's note leaves the other's findable; a tenant with
    the very same tokens takes no other tenant's key."""
    clock = Clock()
    hb = Handbacks(30.0, clock=clock)
    ep = Endpoint(role="decode", url="http://d")
    system = list(range(3000, 3256))
    a, b = system + [1] * 20, system + [2] * 20
    hb.record(ep, "a1", a + ANSWER, "alice", None, prompt_tokens=len(a))
    hb.record(ep, "b1", b + ANSWER, "alice", None, prompt_tokens=len(b))
    hb.record(ep, "c1", a + ANSWER, "carol", None, prompt_tokens=len(a))
    assert hb.find(a + ANSWER + [5] * 10, "alice", None).request_id == "a1"
    assert hb.find(b + ANSWER + [5] * 10, "alice", None).request_id == "b1"
    assert hb.find(a + ANSWER + [5] * 10, "carol", None).request_id == "c1"


def test_a_peek_says_how_much_prefill_would_read_and_leaves_the_note():
    hb, _, _ = _noted()
    assert hb.peek(NEXT, "alice", None) == len(PROMPT + ANSWER) - 1  # decode computed all but the last
    assert hb.peek(PROMPT + ANSWER[:3], "alice", None) == len(PROMPT) + 2  # at most all but the prompt's last
    assert hb.peek(NEXT, "bob", None) == 0
    assert hb.find(NEXT, "alice", None) is not None  # still there


def test_a_prompt_shorter_than_a_grain_is_not_noted_and_notes_are_bounded():
    hb = Handbacks(30.0, max_noted=4)
    ep = Endpoint(role="decode", url="http://d")
    hb.record(ep, "short", list(range(GRAIN - 1)), "", None)
    assert len(hb) == 0
    for i in range(10):
        hb.record(ep, f"r{i}", [i] * (3 * GRAIN), "", None, prompt_tokens=2 * GRAIN)
    assert len(hb) == 4  # the oldest went first
    assert hb.find([9] * (3 * GRAIN + 5), "", None).request_id == "r9"
    assert hb.find([0] * (3 * GRAIN + 5), "", None) is None


def test_one_keys_flood_of_notes_pushes_out_its_own_not_anothers():
    """Past the bound the API key holding most notes gives way, oldest first: a tenant finishing hundreds of
    requests in a pin's window no longer empties every other tenant's notes (its next turn then read
    nothing); one key alone still uses the whole bound. A key's salts are the key's."""
    hb = Handbacks(30.0, max_noted=8)
    ep = Endpoint(role="decode", url="http://d")
    hb.record(ep, "gold", [7] * (2 * GRAIN), "gold", None)
    for i in range(50):
        hb.record(ep, f"f{i}", [i + 100] * (2 * GRAIN), f"flood\0salt\0s{i % 3}", None)
    assert len(hb) == 8
    assert hb.find([7] * (2 * GRAIN + 3), "gold", None).request_id == "gold"
    assert hb.find([149] * (2 * GRAIN + 3), "flood\0salt\0s1", None).request_id == "f49"
    alone = Handbacks(30.0, max_noted=8)
    for i in range(8):
        alone.record(ep, f"a{i}", [i] * (2 * GRAIN), "", None)
    assert len(alone) == 8 and alone.find([0] * (2 * GRAIN + 3), "", None).request_id == "a0"


# -- the check of the next prompt against the engine's own tokens -------------------------------------


def _kept(tokens: list[int], *, blocks: int = 3, size: int = 128, lora: str | None = None) -> dict[str, Any]:
    return {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_block_ids": [list(range(40, 40 + blocks))], "remote_engine_id": "d1",
                                   "remote_request_id": "chatcmpl-r1-x", "remote_host": "h", "remote_port": 1,
                                   "remote_num_tokens": len(tokens)},
            "token_ids": tokens, "lora": lora, "block_size": size}


def test_prefill_reads_the_leading_tokens_equal_to_the_engines_in_whole_blocks():
    held = PROMPT + ANSWER[:-1]  # what decode computed: all but the last answer token
    got = prefill_params(_kept(held), NEXT, None)
    assert got is not None and got["remote_num_tokens"] == len(held) == 339
    assert got["remote_block_ids"] == [[40, 41, 42]]  # ceil(339 / 128)
    assert got["do_remote_decode"] and got["remote_engine_id"] == "d1"
    # The client rewrote the answer from its 11th token: only the first 310 tokens are read.
    edited = PROMPT + ANSWER[:10] + [1] * 30 + list(range(7000, 7050))
    got = prefill_params(_kept(held), edited, None)
    assert got is not None and got["remote_num_tokens"] == 310 and got["remote_block_ids"] == [[40, 41, 42]]
    got = prefill_params(_kept(held), PROMPT[:200] + [1] * 200, None)
    assert got["remote_num_tokens"] == 200 and got["remote_block_ids"] == [[40, 41]]  # whole blocks of 200
    # The engine's tokens are another conversation's: fewer than MIN_TOKENS equal, nothing read.
    assert prefill_params(_kept(held), [1] * MIN_TOKENS + NEXT, None) is None
    # At most all but the prompt's last token (prefill computes at least one).
    got = prefill_params(_kept(held), held, None)
    assert got["remote_num_tokens"] == len(held) - 1


def test_another_adapter_or_an_answer_that_is_not_whole_reads_nothing():
    held = PROMPT + ANSWER[:-1]
    assert prefill_params(_kept(held, lora="a"), NEXT, None) is None
    assert prefill_params(_kept(held), NEXT, "a") is None
    assert prefill_params(_kept(held, lora="a"), NEXT, "a") is not None
    for broken in ({}, {"kv_transfer_params": {}}, {**_kept(held), "block_size": None},
                   {**_kept(held), "token_ids": "no"}, "nothing", None,
                   {**_kept(held), "kv_transfer_params": {"remote_block_ids": "x"}}):
        assert prefill_params(broken, NEXT, None) is None, broken


# -- the engine's notes --------------------------------------------------------------------------------


@pytest.fixture
def notes(monkeypatch):
    monkeypatch.setattr(kv_handback, "_notes", {})
    monkeypatch.setattr(kv_handback, "_order", OwnedOrder())
    yield kv_handback
    kv_handback.set_block_size(None)


def test_the_engine_gives_what_it_kept_once_under_the_routers_request_id(notes):
    notes.set_block_size(128)
    params = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "d"}
    notes.note("chatcmpl-abc", params, [1, 2, 3], None, ttl=30, now=0.0)
    notes.note("cmpl-xyz-0", params, [4, 5], "lora1", ttl=30, now=0.0)
    got = notes.take("abc", now=1.0)
    assert got == {"kv_transfer_params": params, "token_ids": [1, 2, 3], "lora": None, "block_size": 128}
    assert notes.take("abc", now=1.0) is None  # once
    assert notes.take("xyz", now=31.0) is None  # its pin ended
    notes.note("chatcmpl-old", params, [1], None, ttl=5, now=0.0)
    notes.note("chatcmpl-new", params, [1], None, ttl=5, now=10.0)  # a later note sweeps the lapsed one
    assert list(notes._notes) == ["chatcmpl-new"]


def test_the_engine_keeps_a_bounded_number_of_notes(notes, monkeypatch):
    monkeypatch.setattr(notes, "MAX_NOTES", 3)
    for i in range(5):
        notes.note(f"chatcmpl-{i}", {}, [i], None, ttl=30, now=0.0)
    assert list(notes._notes) == ["chatcmpl-2", "chatcmpl-3", "chatcmpl-4"]


def test_past_the_bound_the_owner_keeping_the_most_notes_gives_way(notes, monkeypatch):
    """One tenant finishing many requests within a pin's time no longer pushes out another's note (the
    router would ask, find nothing, and that tenant's next turn recompute its history)."""
    monkeypatch.setattr(notes, "MAX_NOTES", 4)
    notes.note("chatcmpl-gold", {}, [1], None, ttl=30, now=0.0, owner="gold")
    for i in range(10):
        notes.note(f"chatcmpl-flood-{i}", {}, [i], None, ttl=30, now=0.1 * i, owner="flood")
    assert notes.take("gold", now=2.0) is not None
    assert list(notes._notes) == ["chatcmpl-flood-7", "chatcmpl-flood-8", "chatcmpl-flood-9"]


def test_only_blocks_a_decode_engine_pinned_are_noted():
    assert kv_handback.pinned({"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "d"})
    assert not kv_handback.pinned({"do_remote_decode": False, "remote_block_ids": [[1]], "remote_engine_id": "d"})
    assert not kv_handback.pinned({"do_remote_decode": True, "remote_block_ids": [], "remote_engine_id": "d"})
    assert not kv_handback.pinned(None)


class _Out:
    def __init__(self, rid: str, new: list[int], finish: str | None, params: dict | None) -> None:
        self.request_id, self.new_token_ids, self.finish_reason, self.kv_transfer_params = rid, new, finish, params


class _State:
    def __init__(self, external: str, prompt: list[int], out: list[int]) -> None:
        self.external_req_id, self.prompt_token_ids, self.lora_name = external, prompt, None
        self.detokenizer = types.SimpleNamespace(output_token_ids=out)


def test_install_notes_finished_pinned_requests_with_their_prompt_and_answer_ids(notes, monkeypatch):
    class OutputProcessor:  # vLLM's, as far as the note reads it: the last ids arrive in the original
        def __init__(self) -> None:
            self.request_states: dict[str, _State] = {}

        def add_request(self, request: Any, prompt: Any = None) -> None:
            self.request_states.setdefault(request.request_id, _State("chatcmpl-e", [1], []))

        def process_outputs(self, outputs: list[_Out]) -> str:
            for o in outputs:
                self.request_states[o.request_id].detokenizer.output_token_ids.extend(o.new_token_ids)
            return "processed"

    module = types.ModuleType("vllm.v1.engine.output_processor")
    module.OutputProcessor = OutputProcessor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.output_processor", module)
    monkeypatch.delenv(kv_handback.ENV_TTL, raising=False)
    assert not notes.install()  # off without the pin's length
    monkeypatch.setenv(kv_handback.ENV_TTL, "30")
    assert notes.install() and notes.install()  # idempotent
    proc = OutputProcessor()
    pinned = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "d", "remote_num_tokens": 5}
    proc.request_states = {"a-1": _State("chatcmpl-a", [1, 2, 3], [7]), "b-1": _State("chatcmpl-b", [1, 2], []),
                           "c-1": _State("chatcmpl-c", [1], []), "d-1": _State("chatcmpl-d", [1], [])}
    assert proc.process_outputs([
        _Out("a-1", [8, 9], "stop", pinned),  # prompt 3 + answer 3, the engine computed 5 of them
        _Out("b-1", [5], None, None),  # still running
        _Out("c-1", [5], "stop", {"do_remote_decode": False}),  # nothing pinned
        _Out("d-1", [5], "stop", {**pinned, "remote_num_tokens": 9}),  # cut back at a stop string
    ]) == "processed"
    assert set(notes._notes) == {"chatcmpl-a"}
    assert notes.take("a")["token_ids"] == [1, 2, 3, 7, 8]
    # With tenants, a request's owner is the tenant part of its salt, taken as the engine adds it; without, the
    # salt is the client's own and names no owner.
    proc.add_request(types.SimpleNamespace(request_id="e-1", cache_salt="tenantA:client"))
    assert proc.process_outputs([_Out("e-1", [4], "length", {**pinned, "remote_num_tokens": 2})]) == "processed"
    assert notes._order.owner("chatcmpl-e") == ""
    monkeypatch.setenv(kv_handback.ENV_FAIR, "1")
    proc.request_states["f-1"] = _State("chatcmpl-f", [1], [])
    proc.add_request(types.SimpleNamespace(request_id="f-1", cache_salt="tenantA:client"))
    assert proc.process_outputs([_Out("f-1", [4], "length", {**pinned, "remote_num_tokens": 2})]) == "processed"
    assert notes._order.owner("chatcmpl-f") == "tenantA" and notes._order.owners() == ["", "tenantA"]


def test_a_prefill_request_reads_kept_blocks_once_and_computes_them_after_a_declined_read():
    class PullScheduler:  # vLLM 0.32's, as far as the scheduler asks it: it offers kept blocks every time
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            params = request.kv_transfer_params or {}
            if params.get("do_remote_prefill"):
                return 300 - num_computed_tokens, True
            if params.get("do_remote_decode") and params.get("remote_block_ids"):
                return params["remote_num_tokens"] - num_computed_tokens, True
            return 0, False

    assert kv_handback.read_back_once(PullScheduler) and kv_handback.read_back_once(PullScheduler)  # idempotent
    sched = PullScheduler()
    readback = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "d",
                "remote_num_tokens": 101}
    req = types.SimpleNamespace(kv_transfer_params=dict(readback))
    assert sched.get_num_new_matched_tokens(req, 16) == (85, True)  # the first look: the read is set up
    # vLLM marks the read as set up (update_state_after_alloc); declined, the request is looked at again.
    req.kv_transfer_params.update(do_remote_prefill=False, _remote_blocks_processed=True)
    assert sched.get_num_new_matched_tokens(req, 16) == (0, False)  # computed, not parked for a read again
    # A decode engine's pull, and a request with nothing to read, as before.
    pull = types.SimpleNamespace(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [[1]]})
    assert sched.get_num_new_matched_tokens(pull, 100) == (200, True)
    assert sched.get_num_new_matched_tokens(types.SimpleNamespace(kv_transfer_params=None), 0) == (0, False)


def test_the_patched_method_is_vllms_own():
    """What :func:`read_back_once` replaces exists in the pinned vLLM, and marks its reads as it expects."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler

    cls = pull_scheduler.NixlPullConnectorScheduler
    src = inspect.getsource(cls.update_state_after_alloc)
    assert '"_remote_blocks_processed"' in src and 'params["do_remote_prefill"] = False' in src
    assert list(inspect.signature(cls.get_num_new_matched_tokens).parameters) == [
        "self", "request", "num_computed_tokens"]


# -- the settings -------------------------------------------------------------------------------------


def test_bidirectional_turns_on_vllms_transfer_both_ways_with_the_pins_length():
    on = NixlConfig(bidirectional=True, decode_blocks_ttl_s=12)
    for role in ("prefill", "decode"):
        extra = build_kv_transfer_config(role, None, on, on_cpu=True)["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is True and extra["decoder_kv_blocks_ttl"] == 12
        assert extra["kv_recompute_threshold"] == CPU_RECOMPUTE_BELOW_TOKENS
    gpu = build_kv_transfer_config("prefill", None, on, on_cpu=False)["kv_connector_extra_config"]
    assert "kv_recompute_threshold" not in gpu  # vLLM's own on a GPU
    off = build_kv_transfer_config("decode", None, NixlConfig(), on_cpu=True)["kv_connector_extra_config"]
    assert "bidirectional_kv_xfer" not in off and "decoder_kv_blocks_ttl" not in off
    assert handback_ttl_s(None, on) == 12.0 and handback_ttl_s(None, NixlConfig()) is None
    # Turned on in the engine's own settings: the router follows them.
    own = {"kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60}}
    assert handback_ttl_s(own, NixlConfig()) == 60.0
    with pytest.raises(ValueError, match="at least 10"):
        NixlConfig(bidirectional=True, decode_blocks_ttl_s=9)  # a read window under 4 s
    assert NixlConfig(decode_blocks_ttl_s=5).decode_blocks_ttl_s == 5  # (not used without bidirectional)
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl"):
        PDServeArgs.model_validate({"nixl": {"bidirectional": True}, "decode_config": {"engine_kwargs": {
            "kv_transfer_config": {"kv_connector_extra_config": {"decoder_kv_blocks_ttl": 5}}}}})


def test_the_read_window_is_the_pin_less_vllms_read_margin_as_vllm_has_it():
    """vLLM declines a read of kept blocks in their pin's last seconds; the router's window ends before.
    The margin is vLLM's own constant, read from its source (importing its NIXL worker needs torch)."""
    assert read_window_s(30.0) == 24.0 and read_window_s(6.0) == 0.0 and read_window_s(MIN_PIN_S) == 4.0
    hb = Handbacks(6.0)
    hb.record(Endpoint(role="decode", url="http://d"), "r1", PROMPT + ANSWER, "alice", None)
    assert hb.find(NEXT, "alice", None) is None  # a pin too short to read is not noted
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    src = (Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_transfer" / "kv_connector" / "v1"
           / "nixl" / "pull_worker.py").read_text()
    found = re.search(r"^_KV_BLOCKS_EXPIRY_SAFETY_MARGIN\s*=\s*([0-9.]+)", src, re.M)
    assert found is not None and float(found.group(1)) == VLLM_READ_MARGIN_S


# -- the orchestrator's two ends ------------------------------------------------------------------------


def _orch() -> tuple[Orchestrator, Endpoint, Endpoint]:
    p, d = Endpoint(role="prefill", url="http://p"), Endpoint(role="decode", url="http://d")
    conf = RouterConfig(policy="least_loaded", local_prefill_below_tokens=0, cache_aware_steps=0)
    orch = Orchestrator(EnginePool([p, d], policy="least_loaded"), conf, RouterMetrics(), handback_ttl_s=30.0)
    return orch, p, d


def test_a_stream_that_ended_whole_is_noted_and_the_next_prefill_leg_reads_its_blocks():
    orch, p, d = _orch()
    assert orch.handbacks is not None and orch.gate.handbacks is orch.handbacks
    req = Request.parse("completions", {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 40})
    tape = migrate.Tape(req)

    async def engine():
        first = {"id": "c", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": "x", "token_ids": ANSWER[:20], "prompt_token_ids": PROMPT}]}
        rest = {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "text": "y", "token_ids": ANSWER[20:],
                                                                   "finish_reason": "length"}]}
        for event in (first, rest):
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def read() -> None:
        wrapped = migrate.resilient(req, engine(), None, None, tape)  # type: ignore[arg-type]
        async for _ in orch.handbacks.noting(wrapped, tape, d, "r1", "alice"):
            pass

    tape.broke = True  # a stream that moved (or broke) ended elsewhere: not noted
    asyncio.run(read())
    assert len(orch.handbacks) == 0
    tape = migrate.Tape(req)
    asyncio.run(read())
    assert len(orch.handbacks) > 0

    asked: list[str] = []
    held = PROMPT + ANSWER[:-1]

    async def call(ep, method, path, body, request_id, timeout_s, headers=None):
        asked.append(f"{method} {ep.url}{path}")
        return 200, json.dumps(_kept(held)).encode(), "application/json"

    orch.client.call = call  # type: ignore[method-assign]
    nxt = Request.parse("completions", {"model": "m", "prompt": NEXT, "max_tokens": 8})

    async def kept(owner: str, queued: bool = False):
        _, _, flight, _ = await orch.gate.admit("completions", {"model": "m", "prompt": NEXT, "max_tokens": 8},
                                                None, owner, DEFAULT_TENANT)
        assert flight.prompt_ids == NEXT  # rendered for the handback although nothing routes by prefix
        # Prefill is charged only what it would neither hold nor read (admission's queue estimate).
        charged = flight._held.get(p.url)
        assert queued or charged == ((len(PROMPT + ANSWER) - 1, len(NEXT) - len(PROMPT + ANSWER) + 1) if owner == "alice"
                           else None)
        try:
            return await orch.legs.kept(nxt, flight, owner, "r2", p)
        finally:
            flight.release()

    assert asyncio.run(kept("bob")) is None  # another tenant's conversation: not even asked
    assert asked == []
    # A prefill engine whose queue would start the leg past the read window: not asked either.
    p.load.add_prompt(100_000)
    assert p.load.wait_s() > handback.read_window_s(30.0)
    assert asyncio.run(kept("alice", queued=True)) is None and asked == []
    p.load.end_prompt(100_000, None)
    params = asyncio.run(kept("alice"))
    assert asked == ["GET http://d/pdserve/kv-handback/r1"]
    assert params is not None and params["remote_num_tokens"] == len(held)
    body = handoff.prefill_body("completions", nxt.body, params)
    assert body["kv_transfer_params"] == params and body["max_tokens"] == 1
    assert handoff.prefill_body("completions", nxt.body)["kv_transfer_params"] == handoff.PREFILL_KV_PARAMS
    assert orch.handbacks.counts == {"none": 2, "read": 1}  # (bob, then the queue too long)


def test_the_engine_keeping_nothing_or_not_answering_leaves_prefill_to_compute():
    orch, p, d = _orch()
    orch.handbacks.record(d, "r1", PROMPT + ANSWER, "", None, prompt_tokens=len(PROMPT))

    async def gone(ep, method, path, body, request_id, timeout_s, headers=None):
        return 404, b'{"error": {}}', "application/json"

    orch.client.call = gone  # type: ignore[method-assign]
    got = asyncio.run(handback.kept_params(orch.client, orch.handbacks.find(NEXT, "", None), "r2", 1.0))
    assert got is None


def test_a_prefill_leg_whose_read_stalls_is_sent_again_without_it_to_the_same_engine():
    """vLLM 0.32 declines a read whose pin ran out in prefill's queue and then never answers the leg: the
    router gives a reading leg up after ``read_guard_s`` (twice its queue and whole prompt at the engine's
    speed, plus a slack), not after ``prefill_timeout_s``, and sends it again to the same engine without
    the read; the engine is not marked failed. A leg that reads nothing keeps ``prefill_timeout_s``."""
    from pdserve.errors import UpstreamTimeout
    from pdserve.router.flight import Flight

    orch, p, d = _orch()
    cap = orch.cfg.prefill_timeout_s
    assert handback.read_guard_s(p, 2000, cap) == cap  # speed unknown: the leg's own timeout
    p.load.calibrated(1000.0)
    svc = p.load.service_s(2000)
    assert svc is not None and svc > 0
    want = handback.READ_STALL_FACTOR * svc + handback.READ_STALL_SLACK_S
    assert handback.read_guard_s(p, 2000, cap) == pytest.approx(want) and want < cap
    assert handback.read_guard_s(p, 10_000_000, cap) == cap  # never past the leg's own timeout
    p.load.add_prompt(4000)  # a queue ahead: counted
    assert handback.read_guard_s(p, 2000, cap) > want
    p.load.end_prompt(4000, None)

    kept = _kept(PROMPT + ANSWER[:-1])["kv_transfer_params"]
    calls: list[tuple[str, float, dict[str, Any]]] = []

    async def post(ep, route, body, request_id, timeout_s, headers=None):
        calls.append((ep.url, timeout_s, body["kv_transfer_params"]))
        if body["kv_transfer_params"] == kept:
            raise UpstreamTimeout(f"prefill engine did not answer within {timeout_s:.0f}s")
        answer = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(NEXT)},
                  "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1, 2]],
                                         "remote_engine_id": "p1", "remote_request_id": "r2-x",
                                         "remote_host": "h", "remote_port": 1}}
        return 200, json.dumps(answer).encode(), "application/json"

    orch.client.post = post  # type: ignore[method-assign]
    nxt = Request.parse("completions", {"model": "m", "prompt": NEXT, "max_tokens": 8})

    def leg(with_kept: dict[str, Any] | None):
        flight = Flight({"prefill": 0, "decode": 0}, orch.metrics, len(NEXT), 8)
        try:
            return asyncio.run(orch.legs.prefill("completions", nxt.body, "r2", p, flight, with_kept))
        finally:
            flight.release()

    kv, lease, _ = leg(kept)
    assert kv is not None and lease is not None and lease.ep is p
    assert [(u, k == kept) for u, _, k in calls] == [("http://p", True), ("http://p", False)]
    assert calls[0][1] == pytest.approx(handback.read_guard_s(p, len(NEXT), cap), rel=0.05) and calls[0][1] < cap
    assert calls[1][1] == cap and calls[1][2] == handoff.PREFILL_KV_PARAMS
    assert p.healthy and p.failures == 0
    assert orch.metrics.handback.labels("stalled")._value.get() == 1
    calls.clear()
    leg(None)  # reads nothing: the leg's own timeout, one call
    assert [(u, t) for u, t, _ in calls] == [("http://p", cap)]


# -- answers without a tape: tools, stop strings, the Responses and Messages APIs, whole answers -----------


def _stream(*chunks: bytes):
    async def gen():
        for c in chunks:
            yield c
    return gen()


def _drain(stream) -> list[bytes]:
    async def run():
        return [c async for c in stream]
    return asyncio.run(run())


def test_a_stream_without_a_tape_is_noted_by_its_prompt_once_its_api_says_it_ended():
    hb = Handbacks(30.0)
    d = Endpoint(role="decode", url="http://d")
    tools = Request.parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    assert not migrate.eligible(tools)  # no tape: the stream cannot move
    chunks = (b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n', b"data: [DO", b"NE]\n\n")
    assert _drain(hb.noted(_stream(*chunks), tools, None, d, "r1", PROMPT, "alice")) == list(chunks)
    got = hb.find(NEXT, "alice", None, take=False)
    assert got is not None and (got.request_id, got.tokens) == ("r1", len(PROMPT))
    assert hb.peek(NEXT, "alice", None) == len(PROMPT) - 1

    cut = Handbacks(30.0)  # a stream that ended before its last event (an engine that failed) is not noted
    _drain(cut.noted(_stream(chunks[0]), tools, None, d, "r1", PROMPT, "alice"))
    assert len(cut) == 0
    broke = Handbacks(30.0)

    async def failing():
        yield chunks[0]
        raise ConnectionError("engine gone")

    with pytest.raises(ConnectionError):
        _drain(broke.noted(failing(), tools, None, d, "r1", PROMPT, "alice"))
    assert len(broke) == 0


def test_messages_and_responses_streams_are_noted_under_the_ids_their_engine_knows():
    d = Endpoint(role="decode", url="http://d")
    msgs = Request.parse("messages", {"model": "m", "max_tokens": 8, "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]})
    hb = Handbacks(30.0)
    _drain(hb.noted(_stream(b"event: content_block_delta\ndata: {}\n\n",
                            b'event: message_stop\ndata: {"type": "message_stop"}\n\n'),
                    msgs, None, d, "r-msg", PROMPT, "alice"))
    got = hb.find(NEXT, "alice", None)
    assert got is not None and got.request_id == "r-msg"  # Messages run as chat: chatcmpl-<X-Request-Id>

    resp = Request.parse("responses", {"model": "m", "input": "hi", "stream": True})
    head = b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_abc12", ' \
           b'"output": []}}\n\n'
    done = b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "resp_abc12"}}\n\n'
    hb = Handbacks(30.0)
    _drain(hb.noted(_stream(head, done), resp, None, d, "r-resp", PROMPT, "alice"))
    got = hb.find(NEXT, "alice", None)
    assert got is not None and got.request_id == "resp_abc12_0"  # vLLM's engine request: <response id>_0
    hb = Handbacks(30.0)  # an incomplete or failed response is not noted
    _drain(hb.noted(_stream(head, b'event: response.incomplete\ndata: {}\n\n'), resp, None, d, "r", PROMPT, "a"))
    assert len(hb) == 0


def test_a_whole_answer_is_noted_and_the_engine_is_asked_under_its_id():
    d = Endpoint(role="decode", url="http://d")
    hb = Handbacks(30.0)
    chat = Request.parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    hb.note_answer(chat, b'{"id": "chatcmpl-r1", "choices": []}', d, "r1", PROMPT, "alice")
    resp = Request.parse("responses", {"model": "m", "input": "hi"})
    hb.note_answer(resp, b'{"id": "resp_q9", "object": "response", "output": [{"id": "msg_1"}]}', d, "r2",
                   list(range(1, 200)), "alice")
    hb.note_answer(resp, b'{"error": {"message": "no id"}}', d, "r3", list(range(500, 700)), "alice")
    assert hb.find(NEXT, "alice", None).request_id == "r1"  # type: ignore[union-attr]
    assert hb.find(list(range(1, 300)), "alice", None).request_id == "resp_q9_0"  # type: ignore[union-attr]
    assert hb.find(list(range(500, 800)), "alice", None) is None

    asked: list[str] = []

    class Client:
        async def call(self, ep, method, path, body, request_id, timeout_s, headers=None):
            asked.append(path)
            return 404, b"{}", "application/json"

    hb.note_answer(resp, b'{"id": "resp_q9"}', d, "r2", list(range(1, 200)), "alice")
    outcome, _ = asyncio.run(hb.read_for(Client(), list(range(1, 300)), "alice", None, "r9", 1.0))
    assert (outcome, asked) == ("gone", ["/pdserve/kv-handback/resp_q9_0"])
