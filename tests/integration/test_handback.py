"""``nixl.bidirectional`` with real engines: a conversation's next turn reads what decode kept of the last.

Its own system (handback.yaml: 1 prefill + 1 decode, float32, every turn P/D, decode keeps a finished
request's blocks for 16 s; kept running for test_shared_weights.py). A follow-up turn's prefill leg reads
decode's blocks of the last turn (the last answer and the history's last partial block) over NIXL instead of
computing them; the answer is one engine's, token for token: for chat streams, and for answers without a tape
(an agent's chat with tools, the Messages and Responses APIs, whole answers). Hostile clients: one that
rewrites the assistant's last answer, one that reuses another conversation's request id (so the decode
engine's note under that id is its own): the prefill engine reads only the leading tokens equal to the new
prompt, and every answer is still one engine's. Pins end: decode's KV cache use is back to idle once the pin's
time has passed (how much pins may hold together: test_handback_bound.py). A read that reaches the prefill
engine too late is declined by vLLM and computed at once, its blocks freed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest

from pdserve.config.host import HANDBACK_SLACK_S, VLLM_READ_MARGIN_S
from tests.integration.conftest import ROOT, ServeProcess, SystemSlot, engine_auth
from tests.integration.test_pd_real import MODEL, _engine_workers, by_source, engine_metrics, metric

pytestmark = pytest.mark.integration

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be or had not "
         "but what all when we there can more if no out so said up its about into than them could").split()
#: decode_blocks_ttl_s in handback.yaml.
PIN_S = 16


def handback_system(slot: SystemSlot) -> ServeProcess:
    """handback.yaml, kept for test_shared_weights.py too (its engines map one copy of the weights)."""
    return slot.kept(ROOT / "tests" / "integration" / "handback.yaml", engines=2,
                     what="the handback system (1 prefill + 1 decode engine, nixl.bidirectional, mapped weights)")


@pytest.fixture(scope="module")
def served(system_slot: SystemSlot) -> ServeProcess:
    return handback_system(system_slot)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(url: str, messages: list[dict], request_id: str | None = None, salt: str | None = None,
         **extra) -> str:
    """A streamed greedy chat turn through the router: its text."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
            **({"cache_salt": salt} if salt else {}), **extra}
    headers = {"X-Request-Id": request_id} if request_id else {}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += "".join((c.get("delta") or {}).get("content") or "" for c in event["choices"])
    return text


def one_engine(served: ServeProcess, messages: list[dict], **extra) -> str:
    """The same turn computed whole by one engine (the prefill engine, asked directly)."""
    url = served.engine_url("prefill")
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=engine_auth(url), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def outcomes(served: ServeProcess) -> dict[str, float]:
    """Every outcome the router counted of its reads (read, gone, differs, none: nothing noted)."""
    text = httpx.get(served.url + "/metrics?engines=0").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pdserve_kv_handback_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def handbacks(served: ServeProcess, outcome: str) -> float:
    return metric(httpx.get(served.url + "/metrics?engines=0").text, f'pdserve_kv_handback_total{{outcome="{outcome}"}}')


def read_from_decode(served: ServeProcess) -> float:
    """Prompt tokens the prefill engine read from elsewhere (vLLM's by-source count)."""
    return by_source(engine_metrics(served.engine_url("prefill")), "external_kv_transfer")


def test_decode_gives_its_kept_blocks_back_when_the_pin_ends(served: ServeProcess):
    """First on the fresh system: decode holds nothing yet (or only what it kept of the router's first
    requests, for one pin's time), so its idle KV use is read without waiting out other tests' pins."""
    url = served.engine_url("decode")
    usage = "vllm:kv_cache_usage_perc"
    deadline = time.monotonic() + PIN_S + 10
    while (idle := metric(engine_metrics(url), usage)) > 0:
        assert time.monotonic() < deadline, "decode held blocks past their pin at the start"
        time.sleep(0.5)
    rng = random.Random(13)
    chat(served.url, [{"role": "system", "content": words(rng, 900)}, {"role": "user", "content": "Sum it up."}])
    kept = metric(engine_metrics(url), usage)
    assert kept > idle, "decode kept nothing of the finished turn"
    deadline = time.monotonic() + PIN_S + 30
    while metric(engine_metrics(url), usage) > idle + 1e-9:
        assert time.monotonic() < deadline, "decode held the finished turn's blocks past its pin"
        time.sleep(1)


def test_follow_up_turns_read_decodes_blocks_and_answer_as_one_engine(served: ServeProcess):
    rng = random.Random(7)
    messages = [{"role": "system", "content": words(rng, 900)}, {"role": "user", "content": "Sum it up."}]
    asked = []
    for turn in range(3):  # one turn right after the other: the reads come well within the pins' window
        reads, tokens = handbacks(served, "read"), read_from_decode(served)
        got = chat(served.url, messages)
        if turn:
            # Every follow-up: the router found the last turn's blocks and the prefill engine read some.
            assert handbacks(served, "read") == reads + 1, served.status().get("decisions")
            assert read_from_decode(served) > tokens
        asked.append((list(messages), got))
        messages += [{"role": "assistant", "content": got}, {"role": "user", "content": words(rng, 40) + " And?"}]
    for turn, (history, got) in enumerate(asked):
        assert got == one_engine(served, history), (turn, got)


def test_a_turn_salted_otherwise_reads_nothing_of_another_salts_turn(served: ServeProcess):
    """Decode's kept blocks of a turn salted ``alice`` are not read by the same conversation's next turn
    salted ``bob`` (a NIXL read checks no block hash: the router must not offer them), and are by the next
    ``alice`` turn. The ``bob`` turn between the two is kept short (a shorter history, one answer token): the
    next ``alice`` turn must start within the pin's read window of the first."""
    rng = random.Random(23)
    messages = [{"role": "system", "content": words(rng, 500)}, {"role": "user", "content": "Sum it up."}]
    reads, tokens = handbacks(served, "read"), read_from_decode(served)  # (taken first: the turns go on at once)
    got = chat(served.url, messages, salt="alice")
    follow = messages + [{"role": "assistant", "content": got}, {"role": "user", "content": words(rng, 40) + " And?"}]
    chat(served.url, follow, salt="bob", max_tokens=1)
    assert handbacks(served, "read") == reads and read_from_decode(served) == tokens
    assert chat(served.url, follow, salt="alice") == one_engine(served, follow)
    assert handbacks(served, "read") == reads + 1 and read_from_decode(served) > tokens


def test_a_turn_the_engine_cuts_reads_nothing_and_answers_as_one_engine(served: ServeProcess):
    """A follow-up turn with ``truncate_prompt_tokens``: the engines compute its last 600 tokens, not the
    history decode kept, so no read is offered (vLLM's pull loads the blocks it is given over the prompt's
    positions without comparing tokens: the answer would be over a context the client never sent)."""
    rng = random.Random(29)
    messages = [{"role": "system", "content": words(rng, 900)}, {"role": "user", "content": "Sum it up."}]
    got = chat(served.url, messages)
    follow = messages + [{"role": "assistant", "content": got}, {"role": "user", "content": words(rng, 40) + " And?"}]
    reads, tokens = handbacks(served, "read"), read_from_decode(served)
    cut = chat(served.url, follow, truncate_prompt_tokens=600)
    assert handbacks(served, "read") == reads and read_from_decode(served) == tokens
    assert cut == one_engine(served, follow, truncate_prompt_tokens=600)


def test_a_rewritten_answer_and_a_reused_request_id_read_only_equal_tokens(served: ServeProcess):
    rng = random.Random(11)
    system = words(rng, 900)
    a = [{"role": "system", "content": system}, {"role": "user", "content": "Sum it up."}]
    answer = chat(served.url, a, request_id="hb-conv-a-1")
    # Another client sends its own conversation under the same request id: the decode engine's note under that
    # id is now of its tokens (the same system prompt, then another question).
    chat(served.url, [{"role": "system", "content": system}, {"role": "user", "content": "Name one word."}],
         request_id="hb-conv-a-1")
    follow = a + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    assert chat(served.url, follow) == one_engine(served, follow)
    # A client that rewrites the assistant's answer before its next turn.
    b = [{"role": "system", "content": words(rng, 900)}, {"role": "user", "content": "Sum it up."}]
    real = chat(served.url, b)
    edited = b + [{"role": "assistant", "content": "No. " + real[::-1]}, {"role": "user", "content": "Why?"}]
    assert chat(served.url, edited) == one_engine(served, edited)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.read()
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event and event.get("type") != "error", event
            # (a Responses stream's last event is the whole answer: without decode's KV params, as whole answers)
            assert not (event.get("response") or {}).get("kv_transfer_params"), event
            out.append(event)
    return out


def ask(url: str, api: str, system: str, turns: list[str], stream: bool, headers: dict | None = None) -> str:
    """One greedy turn of a conversation (``turns``: user, assistant, user, ...) through ``api``'s shape: its
    text. Chat carries tools and a stop string, as a ReAct agent's do (no tape: the stream cannot move)."""
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(turns))]
    msgs = [{"role": r, "content": t} for r, t in zip(roles, turns)]
    if api == "chat":
        body = {"messages": [{"role": "system", "content": system}, *msgs], "max_tokens": 24, "tools": TOOLS,
                "tool_choice": "none", "stop": ["Observation:"]}
    elif api == "messages":
        body = {"system": system, "messages": msgs, "max_tokens": 24}
    else:
        body = {"input": [{"role": "system", "content": system}, *msgs], "max_output_tokens": 24, "store": False}
    body.update(model=MODEL, temperature=0, stream=stream)
    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}[api]
    if not stream:
        r = httpx.post(url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()
        # The blocks decode keeps are the router's to read: their params (decode's NIXL address, block ids)
        # are not the client's to see.
        assert got.get("kv_transfer_params") is None, got["kv_transfer_params"]
        if api == "chat":
            return got["choices"][0]["message"]["content"]
        if api == "messages":
            return "".join(c["text"] for c in got["content"] if c["type"] == "text")
        return "".join(c["text"] for item in got["output"] if item["type"] == "message" for c in item["content"])
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=300) as r:
        events = _events(r)
    if api == "chat":
        return "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])
    if api == "messages":
        return "".join((e.get("delta") or {}).get("text") or "" for e in events if e.get("type") == "content_block_delta")
    return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")


@pytest.mark.parametrize("api, stream", [("chat", True), ("chat", False), ("messages", True), ("responses", True),
                                         ("responses", False)])
def test_agents_tools_messages_responses_and_whole_answers_read_decodes_blocks(served: ServeProcess, api: str,
                                                                               stream: bool):
    """Answers without a tape (tools, the Messages and Responses APIs, whole answers) are noted by the prompt
    the router rendered; the next turn reads decode's blocks and answers as one engine."""
    rng = random.Random(f"{api}-{stream}")
    system, turns = words(rng, 900), ["Sum it up."]
    first = ask(served.url, api, system, turns, stream)
    turns += [first, words(rng, 40) + " And?"]
    reads, tokens = handbacks(served, "read"), read_from_decode(served)
    got = ask(served.url, api, system, turns, stream)
    assert handbacks(served, "read") == reads + 1, (api, stream, served.status().get("decisions"))
    assert read_from_decode(served) > tokens
    prefill = served.engine_url("prefill")
    assert got == ask(prefill, api, system, turns, False, engine_auth(prefill)), (api, stream)


def test_an_answer_cut_at_a_stop_string_is_computed_again_and_answers_as_one_engine(served: ServeProcess):
    """vLLM finds stop strings in its API server and aborts the request in the engine core, which then keeps
    none of its blocks: the next turn finds the engine's hands empty (``gone``), computes the last answer on
    prefill as plain P/D does, and answers as one engine."""
    rng = random.Random(17)
    stops = [":", ".", ",", "\n"]  # (one of them ends any answer of a few words; at most 4)
    messages = [{"role": "system", "content": words(rng, 900)}, {"role": "user", "content": "Sum it up."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stop": stops}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice.get("stop_reason") in stops, choice  # cut at one
    messages += [{"role": "assistant", "content": choice["message"]["content"]},
                 {"role": "user", "content": words(rng, 40) + " And?"}]
    reads, gone = handbacks(served, "read"), handbacks(served, "gone")
    got = httpx.post(served.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=300)
    assert got.status_code == 200, got.text
    assert (handbacks(served, "read"), handbacks(served, "gone")) == (reads, gone + 1)
    prefill = served.engine_url("prefill")
    ref = httpx.post(prefill + "/v1/chat/completions", json={**body, "messages": messages}, headers=engine_auth(prefill),
                     timeout=300)
    assert got.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]


def test_a_read_that_comes_too_late_is_computed_at_once_and_holds_no_blocks(served: ServeProcess):
    """A follow-up whose prefill leg reaches its engine's scheduler after vLLM's read margin (the engine
    frozen for a few seconds, so the router, which sees it idle, still gives the leg decode's blocks to read):
    vLLM declines the read, and the prefill engine computes those tokens at once. Without pdserve's fix
    (engine/kv_handback.py ``read_back_once``) vLLM 0.32 parks the request waiting for a read nobody starts:
    the router's read guard has to send it again, and the engine holds its blocks until it stops."""
    rng = random.Random(23)
    prefill = served.engine_url("prefill")
    usage = "vllm:kv_cache_usage_perc"
    expired = "vllm:nixl_num_kv_expired_reqs_total"
    messages = [{"role": "system", "content": words(rng, 300)}, {"role": "user", "content": "Sum it up."}]
    got = chat(served.url, messages)
    ended = time.monotonic()  # decode pinned the turn's blocks no later than this
    follow = messages + [{"role": "assistant", "content": got}, {"role": "user", "content": words(rng, 40) + " And?"}]
    idle = metric(engine_metrics(prefill), usage)
    before = {k: handbacks(served, k) for k in ("read", "stalled")}
    expired_before = metric(engine_metrics(prefill), expired)
    frozen = _engine_workers(prefill)
    # The router gives a read while the pin has its read window left (the pin less vLLM's margin and the
    # router's slack): the follow-up is sent 3.5 s before it closes (the router's own work on a loaded host
    # fits); vLLM declines a read that starts in the pin's last VLLM_READ_MARGIN_S: the engine thaws 2 s
    # into them.
    window = PIN_S - VLLM_READ_MARGIN_S - HANDBACK_SLACK_S
    time.sleep(max(0.0, ended + window - 3.5 - time.monotonic()))
    result: dict = {}
    for p in frozen:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=lambda: result.update(text=chat(served.url, follow)), daemon=True)
        asking.start()
        time.sleep(max(0.0, ended + PIN_S - VLLM_READ_MARGIN_S + 2.0 - time.monotonic()))
    finally:
        for p in frozen:
            os.kill(p.pid, signal.SIGCONT)
    asking.join(timeout=120)
    assert result.get("text") is not None, "the follow-up got no answer"
    assert handbacks(served, "read") == before["read"] + 1  # the router gave the leg decode's blocks to read
    assert metric(engine_metrics(prefill), expired) > expired_before  # ... and the engine declined them
    assert handbacks(served, "stalled") == before["stalled"]  # computed at once: the router's guard never fired
    assert result["text"] == one_engine(served, follow)
    deadline = time.monotonic() + 30
    while metric(engine_metrics(prefill), usage) > idle + 1e-9:
        assert time.monotonic() < deadline, "the prefill engine still holds the declined request's blocks"
        time.sleep(1)
