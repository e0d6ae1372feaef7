"""A decode engine's pins for next turns are bounded (engine/kv_handback.py's ``bound_pins``): with a stand-in
for vLLM's NIXL scheduler-side connector (the real one: tests/integration/test_handback.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.config.host import NixlConfig
from pdserve.engine import kv_handback
from pdserve.engine.kv_handback import PinBudget, bound_pins, pin_share

TTL = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _connector_class(clock: Clock) -> type:
    """What bound_pins relies on of vLLM's ``NixlPullConnectorScheduler``: ``request_finished`` pins a
    finished request's blocks on a decode engine (``_reqs_need_send``: its pin's end, for the worker) and
    returns the params that name them; ``update_connector_output`` hears of pins that ended."""

    class Connector:
        def __init__(self, num_blocks: int) -> None:
            self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
            self._reqs_need_send: dict[str, float] = {}
            self.updates = 0

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
            if request.pin:
                self._reqs_need_send[request.request_id] = clock() + TTL
                return True, {"do_remote_decode": True, "remote_block_ids": block_ids, "remote_engine_id": "d"}
            return False, None

        def update_connector_output(self, connector_output: Any) -> None:
            self.updates += 1

    return Connector


_next_block = [0]


def _finish(conn: Any, rid: str, blocks: int | list[int], pin: bool = True) -> tuple[bool, Any]:
    """Finish request ``rid`` holding ``blocks``: that many blocks no other request holds, or these ids."""
    if isinstance(blocks, int):
        ids = list(range(_next_block[0], _next_block[0] + blocks))
        _next_block[0] += blocks
    else:
        ids = blocks
    return conn.request_finished(SimpleNamespace(request_id=rid, pin=pin), (ids,))


def test_pins_past_the_share_are_not_kept_and_room_comes_back_as_pins_end():
    clock = Clock()
    cls = _connector_class(clock)
    assert bound_pins(cls, 0.5, clock=clock)
    conn = cls(num_blocks=40)  # at most 20 blocks pinned
    assert _finish(conn, "a", 12)[0] and _finish(conn, "b", 8)[0]  # 20: at the bound
    delay, params = _finish(conn, "c", 1)
    assert (delay, params) == (False, None)  # not kept: vLLM frees its blocks now, nothing is noted
    assert "c" not in conn._reqs_need_send and set(conn._reqs_need_send) == {"a", "b"}
    assert not _finish(conn, "x", 5, pin=False)[0]  # (what vLLM does not pin is left alone)

    conn.update_connector_output(SimpleNamespace(finished_sending={"a"}))  # prefill read a's blocks
    assert conn.updates == 1  # vLLM's own bookkeeping still runs
    assert _finish(conn, "d", 12)[0]  # a's room is free again
    assert not _finish(conn, "e", 1)[0]
    clock.now += TTL + 1  # b's and d's pins ran out: the worker freed them
    assert _finish(conn, "f", 20)[0]


def test_a_request_larger_than_the_share_is_never_kept():
    clock = Clock()
    cls = _connector_class(clock)
    bound_pins(cls, 0.25, clock=clock)
    conn = cls(num_blocks=40)
    assert not _finish(conn, "big", 11)[0] and _finish(conn, "small", 10)[0]


def test_binding_again_keeps_one_wrapper_and_takes_the_new_share():
    clock = Clock()
    cls = _connector_class(clock)
    original = cls.request_finished
    bound_pins(cls, 0.5, clock=clock)
    bound_pins(cls, 0.5, clock=clock)
    assert cls.request_finished._pdserve_original is original
    bound_pins(cls, 0.1, clock=clock)
    assert cls.request_finished._pdserve_original is original
    conn = cls(num_blocks=100)
    assert not _finish(conn, "a", 11)[0] and _finish(conn, "b", 10)[0]


def _blocks(*ids: int, group: int = 0) -> frozenset[tuple[int, int]]:
    return frozenset((group, i) for i in ids)


def test_the_budget_counts_live_pins_only():
    budget = PinBudget(limit=10)
    assert budget.admit("a", _blocks(*range(6)), end=5.0, now=0.0)
    assert not budget.admit("b", _blocks(*range(10, 15)), end=9.0, now=1.0)
    assert budget.in_use(now=5.0) == 0 and budget.admit("b", _blocks(*range(10, 15)), end=9.0, now=5.0)
    budget.release(["b", "unknown"])
    budget.release(None)
    assert budget.in_use(now=6.0) == 0


def test_a_block_two_pins_hold_counts_once():
    # A conversation's next turn reuses its last turn's cached blocks: its pin holds them again while the
    # last turn's pin (unread: the turn ran on decode alone) still does.
    budget = PinBudget(limit=10)
    assert budget.admit("turn1", _blocks(0, 1, 2, 3, 4, 5), end=30.0, now=0.0)
    assert budget.admit("turn2", _blocks(0, 1, 2, 3, 4, 5, 6, 7), end=35.0, now=5.0)
    assert budget.in_use(now=5.0) == 8  # not 14
    assert not budget.admit("other", _blocks(20, 21, 22), end=36.0, now=6.0)  # 11 distinct blocks
    assert budget.in_use(now=31.0) == 8  # turn1 ran out; its blocks are still turn2's
    budget.release(["turn2"])
    assert budget.in_use(now=31.0) == 0
    # Block ids of different KV cache groups are different blocks.
    assert kv_handback.block_keys([[1, 2], [1]]) == {(0, 1), (0, 2), (1, 1)}
    assert kv_handback.block_keys(None) == frozenset()


def test_the_bound_counts_blocks_shared_by_pins_once():
    clock = Clock()
    cls = _connector_class(clock)
    bound_pins(cls, 0.5, clock=clock)
    conn = cls(num_blocks=20)  # at most 10 blocks pinned
    assert _finish(conn, "turn1", [0, 1, 2, 3, 4, 5])[0]
    assert _finish(conn, "turn2", [0, 1, 2, 3, 4, 5, 6, 7])[0]  # 8 distinct: kept
    assert not _finish(conn, "other", [10, 11, 12])[0]  # 11 distinct: not kept


def test_the_share_reaches_the_engine_and_a_bad_value_bounds_nothing(monkeypatch: pytest.MonkeyPatch):
    assert NixlConfig().decode_pin_share == 0.5
    with pytest.raises(ValueError):
        NixlConfig(decode_pin_share=0)
    for raw, want in (("0.5", 0.5), ("0.05", 0.05), ("1", None), ("", None), ("half", None), ("-1", None)):
        monkeypatch.setenv(kv_handback.ENV_SHARE, raw)
        assert pin_share() == want, raw
    monkeypatch.delenv(kv_handback.ENV_SHARE)
    assert pin_share() is None


def test_the_launcher_gives_decode_engines_the_share_only_with_the_handback():
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine import launcher

    pl = launcher.EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e",
                                  cores=[0], on_cpu=True)
    on = PDServeArgs.model_validate({"nixl": {"bidirectional": True, "decode_pin_share": 0.3}})
    env = launcher.engine_env(on, pl)
    assert env[kv_handback.ENV_SHARE] == "0.3" and env[kv_handback.ENV_TTL] == "30.0"
    assert kv_handback.ENV_SHARE not in launcher.engine_env(PDServeArgs(), pl)


def test_with_tenants_the_last_quarter_of_the_bound_is_kept_for_owners_under_their_share():
    """A pin cannot be given back early: without the reserve one tenant's turns filled the bound for a whole
    pin's time and no other tenant's turn was kept. Owners are the tenant part of the salt."""
    assert kv_handback.pin_owner("tenantA:clienthash", tenants=True) == "tenantA"
    assert kv_handback.pin_owner(None, tenants=True) == ""
    fair = PinBudget(limit=100, fair=True)
    n = 0
    kept = 0
    for i in range(20):  # tenant A: turns of 10 blocks each
        kept += fair.admit(f"A-{i}", _blocks(*range(n, n + 10)), end=30.0, now=0.0, owner="A")
        n += 10
    assert kept == 7  # three quarters of the bound; the rest only while under its share (100 / 2 owners)
    assert fair.admit("B-0", _blocks(*range(1000, 1020)), end=30.0, now=0.0, owner="B")
    assert not fair.admit("A-x", _blocks(*range(2000, 2010)), end=30.0, now=0.0, owner="A")
    # Without tenants (one owner, or not fair) the whole bound is anyone's, as before.
    plain = PinBudget(limit=100)
    assert sum(plain.admit(f"A-{i}", _blocks(*range(10 * i, 10 * i + 10)), end=30.0, now=0.0, owner="A")
               for i in range(20)) == 10


def test_a_pins_owner_comes_from_the_finished_requests_salt():
    clock = Clock()
    cls = _connector_class(clock)
    bound_pins(cls, 0.5, clock=clock, fair=True)
    conn = cls(num_blocks=200)  # 100 blocks for pins

    def finish(rid: str, salt: str, blocks: int) -> bool:
        ids = list(range(_next_block[0], _next_block[0] + blocks))
        _next_block[0] += blocks
        return conn.request_finished(SimpleNamespace(request_id=rid, pin=True, cache_salt=salt), (ids,))[0]

    assert sum(finish(f"a{i}", "A:c", 10) for i in range(20)) == 7
    assert finish("b0", "B", 20)


def test_without_tenants_a_clients_salt_names_no_owner(monkeypatch):
    """Without tenants the salt is the client's own: one client sending a new salt with each request would be as
    many owners keeping one note each, and every other client's notes would give way first."""
    monkeypatch.delenv(kv_handback.ENV_FAIR, raising=False)
    assert kv_handback.pin_owner("mine:1") == kv_handback.pin_owner("mine:2") == kv_handback.pin_owner(None) == ""
    monkeypatch.setenv(kv_handback.ENV_FAIR, "1")
    assert kv_handback.pin_owner("tenantA:clienthash") == "tenantA"
