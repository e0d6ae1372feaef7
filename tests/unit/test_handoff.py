import pytest

from pdserve.errors import BadRequest
from pdserve.router import handoff
from pdserve.router.request import Request


def test_prefill_body_shape():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0, "n": 1,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    p = handoff.prefill_body("chat", body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p and "n" not in p
    assert p["tools"] == body["tools"]  # tools change the prompt: they must reach prefill
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's request is not modified


def test_completions_prefill_has_no_max_completion_tokens():
    p = handoff.prefill_body("completions", {"prompt": "x", "max_tokens": 9})
    assert p["max_tokens"] == 1 and "max_completion_tokens" not in p


def test_decode_body_keeps_request_and_adds_params():
    kv = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "remote_block_ids": [[1]]}
    d = handoff.decode_body({"prompt": "x", "stream": True}, kv)
    assert d == {"prompt": "x", "stream": True, "kv_transfer_params": kv}


@pytest.mark.parametrize("kv, ok", [
    (None, False), ({}, False), ("x", False),
    ({"remote_engine_id": "e", "remote_host": "h", "remote_port": 1}, False),
    ({"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "remote_block_ids": [[1]]}, True),
    ({"remote_engine_id": None, "remote_host": "h", "remote_port": 1, "remote_block_ids": [[1]]}, False),
])
def test_usable_kv_params(kv, ok):
    assert (handoff.usable_kv_params(kv) is not None) is ok


def plan(route: str, body: dict, prompt_tokens: int = 0, local_below: int = 0) -> handoff.Plan:
    return handoff.plan(Request.parse(route, body, prompt_tokens), local_below=local_below)  # type: ignore[arg-type]


@pytest.mark.parametrize("body, reason", [
    ({"prompt": "x", "n": 2}, "n>1"),
    ({"prompt": "x", "max_tokens": 1}, "max_tokens=1"),
    ({"prompt": "x", "echo": True}, "prompt logprobs"),
    ({"prompt": ["a", "b"]}, "batched prompts"),
])
def test_plan_local(body, reason):
    p = plan("completions", body)
    assert not p.disaggregate and p.reason == reason


def test_a_short_prompt_that_cannot_be_split_says_why():
    """``auto`` disaggregates short prompts again when decode is busy: only requests that can be split may
    carry the reason ``short_prompt``."""
    assert plan("completions", {"prompt": "x", "n": 2}, prompt_tokens=1, local_below=100).reason == "n>1"
    short = plan("completions", {"prompt": "x", "max_tokens": 4}, prompt_tokens=1, local_below=100)
    assert not short.disaggregate and short.reason == "short_prompt"
    assert plan("completions", {"prompt": "x", "max_tokens": 4}, prompt_tokens=100,
                        local_below=100).disaggregate


def test_a_responses_request_with_a_tool_the_engine_runs_itself_is_not_split():
    """vLLM generates again after each built-in tool call with the first generation's sampling params, KV
    params included: a decode leg would pull prefill's blocks a second time, long after they were released."""
    ask = {"input": "What is new?", "max_output_tokens": 8}
    for tool in ({"type": "web_search_preview"}, {"type": "code_interpreter", "container": {"type": "auto"}},
                 {"type": "mcp", "server_label": "x"}):
        got = plan("responses", {**ask, "tools": [{"type": "function", "name": "f"}, tool]})
        assert not got.disaggregate and got.reason == "builtin_tools", tool
    assert plan("responses", {**ask, "tools": [{"type": "function", "name": "f", "parameters": {}}]}).disaggregate
    assert plan("chat", {"messages": [], "max_tokens": 8, "tools": [{"type": "web_search_preview"}]}).disaggregate


def test_plan_pd():
    assert plan("completions", {"prompt": [1, 2, 3], "max_tokens": 4}).disaggregate
    assert plan("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
                                 "max_tokens": 1}).disaggregate


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "x", "best_of": "2"}, "best_of"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs.chat_template"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 1000}, "n"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
])
def test_check_request_rejects(route, body, param):
    with pytest.raises(BadRequest) as e:
        handoff.check_request(route, body)
    assert e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "vllm_xargs": {"kv_transfer_params": 0}}, "vllm_xargs.kv_transfer_params"),
    ({"prompt": "x", "vllm_xargs": {"ec_transfer_params": {}}}, "vllm_xargs.ec_transfer_params"),
    ({"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "x"}}, "vllm_xargs.kv_cache_report_mode"),
    ({"prompt": "x", "vllm_xargs": [1]}, "vllm_xargs"),
    ({"prompt": "x", "ec_transfer_params": {}}, "ec_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
])
def test_fields_that_steer_the_kv_connector_are_refused(body, param):
    from pdserve.errors import BadRequest

    with pytest.raises(BadRequest) as e:
        handoff.check_request("completions", body)
    assert e.value.param == param


def test_harmless_vllm_xargs_pass():
    handoff.check_request("completions", {"prompt": "x", "vllm_xargs": {"my_logits_processor_arg": 3}})


def test_template_flags_pass():
    handoff.check_request("chat", {"messages": [{"role": "user", "content": "x"}],
                                   "chat_template_kwargs": {"enable_thinking": False}})


def test_a_whole_answer_reaches_its_client_without_the_kv_params_decode_wrote_into_it():
    """With nixl.bidirectional the decode engine writes the params of the blocks it keeps (its NIXL address,
    block ids) into a whole answer; the client gets ``null``, as from one engine."""
    import json

    kept = {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 5600, "remote_block_ids": [[1]]}
    raw = json.dumps({"id": "chatcmpl-1", "choices": [{"message": {"content": "hé"}}], "kv_transfer_params": kept},
                     separators=(",", ":"), ensure_ascii=False).encode()
    got = json.loads(handoff.client_answer(raw))  # type: ignore[arg-type]
    assert got["kv_transfer_params"] is None and got["choices"][0]["message"]["content"] == "hé"
    assert b"10.0.0.7" not in handoff.client_answer(raw)  # type: ignore[operator]
    plain = b'{"id":"x","kv_transfer_params":null}'
    assert handoff.client_answer(plain) is plain  # nothing to take out: the bytes as they came
    quoted = json.dumps({"choices": [{"text": '"kv_transfer_params": {"a": 1}'}], "kv_transfer_params": None}).encode()
    assert handoff.client_answer(quoted) is quoted  # (only the answer's own field, not text inside it)
    assert handoff.client_answer(b'{"kv_transfer_params": {') == b'{"kv_transfer_params": {'  # not JSON: as it is
    assert handoff.client_answer(None) is None and handoff.client_answer(b"") == b""


def test_a_responses_streams_last_event_reaches_its_client_without_decodes_kv_params():
    import asyncio
    import json

    kept = {"remote_host": "10.0.0.7", "remote_block_ids": [[1]]}
    done = {"type": "response.completed", "response": {"id": "resp_1", "kv_transfer_params": kept}}
    raw = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
           b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n")

    async def chunks():
        for i in range(0, len(raw), 7):  # (events cut anywhere)
            yield raw[i:i + 7]

    async def read() -> bytes:
        return b"".join([c async for c in handoff.client_events(chunks())])

    got = asyncio.run(read())
    assert b"10.0.0.7" not in got and got.startswith(raw[:raw.index(b"\n\n") + 2])
    last = got.split(b"\n\n")[1]
    assert last.startswith(b"event: response.completed\ndata: ")
    assert json.loads(last.split(b"data: ", 1)[1])["response"] == {"id": "resp_1", "kv_transfer_params": None}
