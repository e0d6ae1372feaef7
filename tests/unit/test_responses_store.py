"""The engines' bound on stored Responses answers (engine/responses_store.py): by owner, then in all, the
oldest forgotten first, an answer's conversation and events with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.responses_store import (
    PER_OWNER_ENV,
    TOTAL_ENV,
    BoundedStore,
    Bounds,
    Ledger,
    bound,
    bounds_from_env,
    deep_size,
)
from pdserve.router.stored import StoredResponses
from pdserve.settings import ANONYMOUS_TAG
from pdserve.settings import response_owner_tag as owner_tag

ROUTER = StoredResponses(secret=b"k" * 32)


def _serving() -> SimpleNamespace:
    """vLLM's Responses server as far as the bound sees it: its three stores."""
    return SimpleNamespace(msg_store={}, response_store={}, event_store={})


def _answer(serving: SimpleNamespace, rid: str) -> None:
    """What vLLM does for a stored answer: its conversation first, the answer when it is done."""
    serving.msg_store[rid] = ["messages of " + rid]
    serving.response_store[rid] = "answer " + rid


def test_one_owner_pushes_out_only_its_own_oldest_answers():
    serving = _serving()
    ledger = bound(serving, Bounds(3, 100))
    assert ledger is not None
    acme = [ROUTER.new_id("tenant:acme") for _ in range(2)]
    evil = [ROUTER.new_id("tenant:evil") for _ in range(50)]
    for rid in acme:
        _answer(serving, rid)
    for rid in evil:
        _answer(serving, rid)
    assert all(rid in serving.response_store and rid in serving.msg_store for rid in acme)
    assert [rid in serving.response_store for rid in evil[-4:]] == [False, True, True, True]
    assert not any(rid in serving.msg_store for rid in evil[:-3])  # its conversation went with the answer
    assert ledger.owned(owner_tag(evil[0])) == 3 and len(ledger) == 5 and ledger.forgotten == 47


def test_a_full_engine_forgets_from_the_owner_keeping_the_most():
    """Past the engine's whole bound the oldest answer of the owner keeping the most goes (the one adding,
    where it is among them): many owners share the engine, none pushed below another's count."""
    serving = _serving()
    ledger = bound(serving, Bounds(10, 6))
    assert ledger is not None
    acme = [ROUTER.new_id("acme") for _ in range(3)]
    for rid in acme:
        _answer(serving, rid)
    evil = [ROUTER.new_id("evil") for _ in range(20)]
    for rid in evil:
        _answer(serving, rid)
    assert all(rid in serving.response_store for rid in acme)  # evil pushed out only its own
    assert [rid in serving.response_store for rid in evil] == [False] * 17 + [True] * 3
    ids = [ROUTER.new_id(f"key{i}") for i in range(3)]  # three owners more, one answer each
    for rid in ids:
        _answer(serving, rid)
    assert all(rid in serving.response_store for rid in ids) and len(ledger) == 6
    # (3 each, then one from the first of the two largest each time: 2 and 3, 2 and 2, 1 and 2)
    assert (ledger.owned(owner_tag(acme[0])), ledger.owned(owner_tag(evil[0]))) == (1, 2)
    assert len(serving.msg_store) == 6


def test_an_answer_updated_in_place_counts_once_and_keeps_its_place():
    """A background answer is stored queued, then again when done; its events live in the third store."""
    serving = _serving()
    bound(serving, Bounds(2, 10))
    first, second, third = (ROUTER.new_id("acme") for _ in range(3))
    serving.msg_store[first] = []
    serving.response_store[first] = "queued"
    serving.event_store[first] = ("events", None)
    serving.response_store[first] = "completed"
    _answer(serving, second)
    assert serving.response_store[first] == "completed" and first in serving.event_store
    _answer(serving, third)  # the owner's third: its oldest, ``first``, goes from every store
    assert first not in serving.response_store and first not in serving.event_store and first not in serving.msg_store
    assert second in serving.response_store and third in serving.response_store


def test_ids_not_made_by_the_router_are_the_anonymous_owners():
    """Without keys a client may name its response (``request_id``): all such ids are one owner's, as every
    router-made id of an app without keys is."""
    assert owner_tag(ROUTER.new_id()) == ANONYMOUS_TAG
    for other in ("mine", "resp_" + "g" * 64, "resp_" + "0" * 63, 42, None, "resp_" + "é" * 64):
        assert owner_tag(other) == ANONYMOUS_TAG
    serving = _serving()
    bound(serving, Bounds(2, 10))
    made = ROUTER.new_id()
    for rid in ("a", "b", made, "c"):
        serving.response_store[rid] = rid
    assert list(serving.response_store) == [made, "c"]  # one owner: its two newest


def test_a_store_behaves_as_the_dict_vllm_wrote_for():
    ledger = Ledger(Bounds(5, 5))
    store = BoundedStore(ledger, {"x": 1})
    store.setdefault("y", 2)
    store.update({"z": 3})
    assert store == {"x": 1, "y": 2, "z": 3} and len(ledger) == 3
    assert store.get("x") == 1 and "y" in store and store.pop("z") == 3


def test_bounds_come_from_the_launchers_environment_and_must_be_positive():
    assert bounds_from_env({}) is None
    assert bounds_from_env({PER_OWNER_ENV: "10", TOTAL_ENV: "100"}) == Bounds(10, 100)
    assert bounds_from_env({TOTAL_ENV: "100"}) == Bounds(100, 100)
    assert bound(None, Bounds(1, 1)) is None and bound(SimpleNamespace(response_store={}), Bounds(1, 1)) is None
    with pytest.raises(ValueError):
        Ledger(Bounds(0, 5))


def _turns(serving: SimpleNamespace, owner: str, n: int, words: int) -> list[str]:
    """``n`` answers of ``owner``, each with a conversation of ``words`` words of history (as vLLM stores it:
    the whole message list of each turn)."""
    ids = [ROUTER.new_id(owner) for _ in range(n)]
    for rid in ids:
        serving.msg_store[rid] = [{"role": "user", "content": "word " * words}]
        serving.response_store[rid] = SimpleNamespace(id=rid, output=[{"text": "an answer"}])
    return ids


def test_an_owners_long_conversations_push_out_its_own_oldest_by_bytes():
    """Each stored turn keeps its whole history: a bound on entries alone let one owner keep 1,000 turns of the
    model's whole context. Past its bytes the owner's oldest go, never another owner's."""
    serving = _serving()
    ledger = bound(serving, Bounds(1000, 10000, bytes_per_owner=60_000, bytes_total=10**9))
    assert ledger is not None
    short = _turns(serving, "acme", 5, 10)
    small = ledger.bytes(owner_tag(short[0]))
    assert 0 < small < 10_000
    long = _turns(serving, "evil", 8, 5_000)  # each about 25 kB of text
    evil = owner_tag(long[0])
    assert [rid in serving.response_store for rid in long] == [False] * 6 + [True] * 2
    assert not any(rid in serving.msg_store for rid in long[:6])
    assert 50_000 < ledger.bytes(evil) <= 60_000 and ledger.owned(evil) == 2
    assert all(rid in serving.response_store and rid in serving.msg_store for rid in short)
    assert ledger.bytes() == ledger.bytes(evil) + ledger.bytes(owner_tag(short[0]))


def test_past_the_engines_bytes_the_heaviest_owner_gives_way_even_its_newest():
    serving = _serving()
    ledger = bound(serving, Bounds(1000, 10000, bytes_per_owner=10**9, bytes_total=100_000))
    assert ledger is not None
    quiet = _turns(serving, "quiet", 3, 1_000)
    huge = _turns(serving, "huge", 1, 40_000)  # one answer past the whole bound: its owner loses it
    assert huge[0] not in serving.response_store and huge[0] not in serving.msg_store
    assert all(rid in serving.response_store for rid in quiet) and ledger.bytes() < 100_000


def test_an_answer_forgotten_while_running_is_not_kept_without_its_conversation():
    """vLLM stores a turn's conversation when it starts and its answer when it ends: a conversation pushed out
    in between must not leave an answer that a next turn would read without its history."""
    serving = _serving()
    bound(serving, Bounds(2, 10))
    running = ROUTER.new_id("acme")
    serving.msg_store[running] = [{"role": "user", "content": "hello"}]
    _turns(serving, "acme", 2, 3)  # the owner's two newer turns end first: ``running`` is its oldest
    assert running not in serving.msg_store
    serving.response_store[running] = SimpleNamespace(id=running, output=[])
    assert running not in serving.response_store and serving.response_store.get(running) is None


def test_deep_size_counts_what_a_value_holds_once_and_stops_at_its_bound():
    text = "x" * 10_000
    assert deep_size([text, text]) < deep_size([text, "y" * 10_000])  # the same string counted once
    loop: list = []
    loop.append(loop)  # a cycle ends
    assert deep_size(loop) > 0
    model = SimpleNamespace(content=text, parts=[{"k": text + "z"}])
    assert deep_size(model) > 20_000
    assert deep_size(list(range(1000)), limit=10) < deep_size(list(range(1000)))


def test_only_answers_still_running_are_remembered_as_forgotten():
    """A running turn's conversation pushed out must keep its answer out however many finished answers are
    forgotten meanwhile (remembering every forgotten id, bounded, let the running one's mark go first)."""
    serving = _serving()
    ledger = bound(serving, Bounds(2, 2))
    assert ledger is not None
    running = ROUTER.new_id("acme")
    serving.msg_store[running] = [{"role": "user", "content": "hello"}]
    _turns(serving, "acme", 50, 3)  # 49 finished answers forgotten after it
    serving.response_store[running] = SimpleNamespace(id=running, output=[])
    assert running not in serving.response_store and len(ledger._gone) == 0  # (its mark went with its answer)
