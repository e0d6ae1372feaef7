"""Request bodies the engines would refuse are refused by the router before the prefill leg, naming the field
(through a router over fake engines: tests/component/test_validate.py).

vLLM's own models run on an engine (engine/request_check.py); here the validator asks them in-process.
They are imported once per test process, by the first fixture or fake engine that needs them (tens of
seconds on a busy host); tests of other modules never import them.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from pdserve.engine import request_check
from pdserve.errors import BadRequest
from pdserve.router import body as body_mod
from pdserve.router import handoff, prompt_length, validate
from pdserve.router.prompt_length import PromptLength
from pdserve.router.validate import EngineLimits, RequestValidator

VOCAB = 49152  # SmolLM2's
LIMITS = EngineLimits(max_model_len=2048, max_logprobs=20)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def chat(**kw):
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], **kw}


def comp(**kw):
    return {"prompt": "Once upon a time", "max_tokens": 8, **kw}


def nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def deep_schema(levels: int) -> dict:
    """A JSON schema nested ``levels`` objects deep (vLLM takes up to 64)."""
    schema: dict = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (route, body, the field the 400 names)
HOSTILE = [
    # Fields only the router sets, at the top and inside vllm_xargs.
    ("completions", comp(kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "x",
                                             "remote_block_ids": [[1]], "remote_host": "10.0.0.1",
                                             "remote_port": 1}), "kv_transfer_params"),
    ("completions", comp(kv_transfer_params=None), "kv_transfer_params"),
    # An engine scheduling by priority would run a client's own ahead of every tenant's (router.tenants).
    ("completions", comp(priority=-9223372036854775808), "priority"),
    ("chat", chat(priority=-1), "priority"),
    ("completions", comp(priority=True), "priority"),
    # vLLM answers a background request at once and goes on alone: past every in-flight cap and tenant limit.
    ("responses", {"input": "hello", "background": True}, "background"),
    ("chat", chat(kv_transfer_params={"do_remote_decode": True}), "kv_transfer_params"),
    ("completions", comp(ec_transfer_params={"x": 1}), "ec_transfer_params"),
    ("chat", chat(vllm_xargs={"kv_transfer_params": 0}), "vllm_xargs.kv_transfer_params"),
    ("completions", comp(vllm_xargs={"ec_transfer_params": "x"}), "vllm_xargs.ec_transfer_params"),
    ("completions", comp(vllm_xargs={"kv_cache_report_mode": "all"}), "vllm_xargs.kv_cache_report_mode"),
    # Wrong types on forwarded fields.
    ("completions", comp(max_tokens="8"), "max_tokens"),
    ("completions", comp(max_tokens=1.5), "max_tokens"),
    ("chat", chat(n="2"), "n"),
    ("chat", chat(stream="yes"), "stream"),
    ("completions", comp(temperature="hot"), "temperature"),
    ("completions", comp(echo=[1]), "echo"),
    ("completions", comp(user=5), "user"),
    ("completions", comp(suffix={"a": 1}), "suffix"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    ("chat", chat(messages="hello"), "messages"),
    ("completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("completions", comp(prompt=[-1, 5]), "prompt.0"),
    ("chat", chat(tools=[{"type": "function"}]), "tools.0.function"),
    ("chat", chat(tools=[1]), "tools.0"),
    ("completions", comp(vllm_xargs={"a": {"b": 1}}), "vllm_xargs.a"),
    ("completions", comp(truncation_side="middle"), "truncation_side"),
    # Extreme values.
    ("completions", comp(max_tokens=2**63), "max_tokens"),
    ("chat", chat(max_completion_tokens=100_000), "max_completion_tokens"),
    ("completions", comp(temperature=-1), "temperature"),
    ("completions", comp(temperature=float("inf")), "temperature"),
    ("completions", comp(top_p=2), "top_p"),
    ("completions", comp(top_k=-5), "top_k"),
    ("completions", comp(min_p=3), "min_p"),
    ("completions", comp(presence_penalty=5), "presence_penalty"),
    ("completions", comp(repetition_penalty=0), "repetition_penalty"),
    ("completions", comp(n=0), "n"),
    ("completions", comp(n=2**40), "n"),
    ("completions", comp(seed=2**64), "seed"),
    ("completions", comp(priority=2**70), "priority"),
    ("completions", comp(vllm_xargs={"a": 2**70}), "vllm_xargs"),
    ("completions", comp(logprobs=1000), "logprobs"),
    ("completions", comp(logprobs=-5), "logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("chat", chat(top_logprobs=5), "top_logprobs"),
    ("completions", comp(prompt_logprobs=1000), "prompt_logprobs"),
    ("completions", comp(stop=["x"] * 5), "stop"),
    ("completions", comp(stop=[str(i) for i in range(5000)]), "stop"),
    ("completions", comp(stop=[""]), "stop"),
    ("completions", comp(bad_words=[""]), "bad_words"),
    ("completions", comp(cache_salt=""), "cache_salt"),
    ("completions", comp(allowed_token_ids=[]), "allowed_token_ids"),
    # Token ids outside the vocabulary.
    ("completions", comp(logit_bias={str(VOCAB): 5}), "logit_bias"),
    ("chat", chat(logit_bias={"-1": 5}), "logit_bias"),
    ("completions", comp(logit_bias={"token": 5}), "logit_bias"),
    ("completions", comp(logit_bias="x"), "logit_bias"),
    ("completions", comp(stop_token_ids=[10**9]), "stop_token_ids"),
    ("chat", chat(allowed_token_ids=[1, VOCAB + 7]), "allowed_token_ids"),
    # Id lists past what vLLM's GPU model runner takes (its engine core fails), or a CPU engine scans each step.
    ("completions", comp(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    ("chat", chat(allowed_token_ids=list(range(1025))), "allowed_token_ids"),
    ("completions", comp(stop_token_ids=list(range(1025))), "stop_token_ids"),
    ("completions", comp(stop_token_ids=list(range(121)), min_tokens=1, max_tokens=8), "stop_token_ids"),
    # Errors only the decode engine would raise: the prefill leg does not carry these values.
    ("completions", comp(min_tokens=20), "min_tokens"),
    ("chat", chat(max_tokens=5, min_tokens=6), "min_tokens"),
    ("completions", {"prompt": [7] * 2000, "max_tokens": 100, "min_tokens": 60}, "min_tokens"),
    ("completions", comp(stream_options={"include_usage": True}), "stream_options"),
    ("chat", chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
    ("completions", comp(stream=True, stream_options={"include_usage": "maybe"}), "stream_options.include_usage"),
    ("completions", comp(stream=True, use_beam_search=True), "use_beam_search"),
    ("completions", comp(stream=True, prompt_logprobs=1), "prompt_logprobs"),
    ("completions", comp(n=2, temperature=0), "n"),
    # Prompts the context cannot hold.
    ("completions", {"prompt": [7] * 2048, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [[1, 2], [7] * 3000], "max_tokens": 1}, "prompt"),
    # Structured output and tools.
    ("chat", chat(response_format={"type": "xml"}), "response_format.type"),
    ("chat", chat(response_format={"type": "json_schema"}), "response_format"),
    ("completions", comp(structured_outputs={"json": {"type": "object"}, "regex": "a+"}), "structured_outputs"),
    ("chat", chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ("chat", chat(tool_choice="auto"), "tool_choice"),
    ("chat", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice"),
    ("chat", chat(tools=[]), "tools"),
    # Shape.
    ("chat", chat(tools=[{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": nested(100)}}]), "tools"),
    ("completions", comp(prompt=nested(100)), "prompt"),
    ("completions", comp(prompt="a\ud800b"), "prompt"),
]

VALID = [
    ("completions", comp()),
    ("completions", {"prompt": [1000, 2000, 3000], "max_tokens": 4}),
    ("completions", {"prompt": "no max_tokens"}),
    ("completions", comp(logprobs=5, echo=False, seed=7, stop=["\n", "The end", ".", "!"], n=2, temperature=0.7)),
    ("completions", comp(stream=True, stream_options={"include_usage": True})),
    ("completions", comp(vllm_xargs={"my_logits_processor_arg": 3, "names": ["a", 1, 2.5]})),
    ("completions", comp(logit_bias={"100": 5, str(VOCAB - 1): -100}, min_tokens=8, stop_token_ids=[2])),
    ("completions", comp(logit_bias={str(i): 1 for i in range(1024)}, allowed_token_ids=list(range(1024)),
                         stop_token_ids=list(range(1024)))),
    ("completions", comp(stop_token_ids=list(range(120)), min_tokens=1, max_tokens=8)),
    ("completions", comp(structured_outputs={"regex": "[a-z]+"})),
    ("completions", comp(response_format={"type": "json_object"})),
    ("completions", comp(user="alice", priority=0, cache_salt="s3cr3t-salt", top_k=40, min_p=0.05)),
    # vLLM 0.32 shortens max_tokens to what the context leaves after the prompt: not an error.
    ("completions", {"prompt": [7] * 2000, "max_tokens": 100}),
    ("completions", {"prompt": [7] * 2000, "max_tokens": 100, "min_tokens": 40}),
    ("chat", chat()),
    ("chat", chat(max_completion_tokens=100, min_tokens=5)),
    ("chat", chat(min_tokens=5)),
    ("chat", chat(tools=TOOLS)),
    ("chat", chat(tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)),
    ("chat", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ("chat", chat(tools=TOOLS, tool_choice="none")),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})),
    ("chat", chat(logprobs=True, top_logprobs=5, n=2, seed=1, temperature=0.8, stop="\n\n", max_tokens=12)),
    ("chat", chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False})),
    ("chat", chat(messages=[{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                         {"type": "text", "text": "there"}]},
                            {"role": "assistant", "content": "Hi!"},
                            {"role": "user", "content": "Again"}])),
    ("chat", chat(vllm_xargs={"my_arg": "x"}, chat_template_kwargs={"enable_thinking": False})),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(61)}})),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep_schema(61)}}])),
    ("chat", chat(reasoning_content="x", messages=[{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "a", "reasoning_content": "r"},
                                                   {"role": "user", "content": "q2"}])),
]


@pytest.fixture(scope="module")
def engine_models():
    # make setup installs vLLM: without its request models the router's main check is missing.
    models = request_check.engine_models()
    assert models is not None, "vLLM's request models are not importable"
    return models


async def in_process(route, body):
    """The engine's check (its ``POST /pdserve/check``), without the HTTP around it."""
    return request_check.check(route, body)


def check(v: RequestValidator, route, body):
    return asyncio.run(v.check(route, body))


@pytest.fixture
def validator(engine_models):
    lengths = PromptLength()
    lengths.vocab_size = VOCAB
    return RequestValidator(lengths, LIMITS, in_process)


def _id(case) -> str:
    route, body, *rest = case
    keys = ",".join(k for k in body if k not in ("messages", "prompt")) or "prompt"
    return f"{route}-{rest[0] if rest else keys}"


@pytest.mark.parametrize("route, body, param", HOSTILE, ids=[_id(c) for c in HOSTILE])
def test_hostile_body_is_refused_naming_the_field(validator, route, body, param):
    with pytest.raises(BadRequest) as e:
        check(validator, route, body)
    assert e.value.param == param, e.value.message
    assert e.value.status_code == 400 and e.value.message


@pytest.mark.parametrize("route, body", VALID, ids=[_id(c) for c in VALID])
def test_valid_body_passes_unchanged(validator, route, body):
    sent = copy.deepcopy(body)
    req = check(validator, route, body)
    assert req.route == route and req.body is body and req.prompt_tokens > 0
    assert body == sent  # vLLM's validators rewrite what they get: they get a copy


def test_decisions_read_the_values_the_engine_reads(validator):
    """A field vLLM's model accepts in another spelling ("false" for false) reaches the router's decisions as
    the engine reads it: a truthy string "false" made a stream look unmovable and early-token ineligible."""
    from pdserve.router import early, migrate

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4,
            "logprobs": "false", "return_token_ids": "0", "seed": "7", "temperature": "0"}
    req = check(validator, "chat", body)
    assert (body["logprobs"], body["return_token_ids"], body["seed"], body["temperature"]) == (False, False, 7, 0.0)
    assert (req.token_logprobs, req.return_token_ids, req.seed, req.greedy) == (False, False, 7, True)
    assert migrate.eligible(req) and early.eligible(req)
    comp = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 4, "echo": "false"}
    req = check(validator, "completions", comp)
    assert comp["echo"] is False and not req.prompt_logits and migrate.eligible(req)


def test_limits_unknown_means_not_checked(engine_models):
    v = RequestValidator(PromptLength(), EngineLimits(), in_process)
    for route, body in [("completions", comp(max_tokens=100_000)), ("completions", comp(logprobs=1000)),
                        ("completions", {"prompt": [7] * 5000, "max_tokens": 4}),
                        ("completions", comp(logit_bias={"999999": 1}))]:
        check(v, route, body)
    with pytest.raises(BadRequest) as e:  # an explicit max_tokens is known without any limit
        check(v, "completions", comp(min_tokens=9))
    assert e.value.param == "min_tokens"


def test_completions_default_max_tokens_is_vllms(validator):
    with pytest.raises(BadRequest) as e:
        check(validator, "completions", {"prompt": "x", "min_tokens": 17})
    assert e.value.param == "min_tokens" and "16 when not given" in e.value.message
    check(validator, "completions", {"prompt": "x", "min_tokens": 16})


def test_without_an_engine_to_ask_the_routers_own_rules_still_hold():
    """No engine up to run vLLM's models (or none answers): the checks that need no vLLM."""
    lengths = PromptLength()
    lengths.vocab_size = VOCAB

    async def nobody(route, body):
        return None

    v = RequestValidator(lengths, LIMITS, nobody)
    assert v.summary()["engine_checks"] is True
    for route, body, param in [
        ("completions", comp(kv_transfer_params={}), "kv_transfer_params"),
        ("completions", comp(min_tokens=20), "min_tokens"),
        ("completions", comp(logit_bias="x"), "logit_bias"),
        ("completions", comp(logit_bias={"5": "high"}), "logit_bias"),
        ("completions", comp(logit_bias={str(VOCAB): 1}), "logit_bias"),
        ("completions", comp(stream_options={"include_usage": True}), "stream_options"),
        ("completions", comp(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
        ("completions", comp(max_tokens=2**63), "max_tokens"),
        ("completions", comp(logprobs=1000), "logprobs"),
        ("completions", comp(prompt=nested(100)), "prompt"),
    ]:
        with pytest.raises(BadRequest) as e:
            check(v, route, body)
        assert e.value.param == param, (body, e.value.message)
    for route, body in VALID:
        check(v, route, body)


def test_engine_limits_from_engine_kwargs():
    assert EngineLimits.from_engine_kwargs() == EngineLimits(None, None)
    assert EngineLimits.from_engine_kwargs({}, {}) == EngineLimits(None, 20)
    assert EngineLimits.from_engine_kwargs({"max_model_len": 4096}, {"max_model_len": "2048"}) == EngineLimits(2048, 20)
    assert EngineLimits.from_engine_kwargs({"max_model_len": "2k", "max_logprobs": 50}) == EngineLimits(None, 50)
    assert EngineLimits.from_engine_kwargs({"max_logprobs": -1}) == EngineLimits(None, None)
    assert EngineLimits.from_engine_kwargs({"max_logprobs": 0}, {"max_logprobs": 5}) == EngineLimits(None, 0)


def test_orchestrator_takes_the_limits():
    from pdserve.config.schema import RouterConfig
    from pdserve.router.orchestrator import Orchestrator
    from pdserve.router.pool import EnginePool

    orch = Orchestrator(EnginePool([]), RouterConfig(), limits=LIMITS)
    assert orch.gate.validator.limits == LIMITS and orch.gate.validator.lengths is orch.gate.lengths


@pytest.mark.parametrize("rid", ["abc", "req-1", "a.b_c:d-e", "x" * 128, "0f8fad5b-d9cb-469f-a165-70867728950e"])
def test_request_ids_that_are_kept(rid):
    assert validate.request_id(rid) == rid


def test_absent_request_id_is_none():
    assert validate.request_id(None) is None and validate.request_id("") is None


@pytest.mark.parametrize("rid", ["x" * 129, "a b", "a/b", "../x", "a%2Fb", "x\ny", "é", "a\x00", "a?b", "a#b",
                                 "\u202e", "ÿþ"])
def test_odd_request_ids_are_refused(rid):
    with pytest.raises(BadRequest) as e:
        validate.request_id(rid)
    assert e.value.param == "X-Request-Id"


def test_prompt_floor_counts_only_user_words():
    from pdserve.model.resolve import resolve_model

    # The packaged model ships with make setup and is prepared offline on first use.
    pl = PromptLength(resolve_model(None))
    assert pl.vocab_size == VOCAB
    est, floor = pl.measure("chat", {"messages": [{"role": "system", "content": "one two three four"},
                                                  {"role": "user", "content": "Hello world"}]})
    assert floor == 2 and est > floor
    assert pl.measure("completions", {"prompt": ["Hello world", "a"]})[1] == 2
    assert pl.measure("completions", {"prompt": "a\ud800"})[1] is None  # the tokenizer refuses it
    assert PromptLength().measure("completions", {"prompt": "Hello world"}) == (2, None)


BIG = "lorem ipsum dolor sit amet " * 200  # ~1,000 tokens as text


@pytest.mark.parametrize("route, body", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f", "description": BIG}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "t", "text": BIG}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": BIG}}]}]}),
    ("responses", {"input": [{"role": "user", "content": "hi"},
                             {"type": "function_call_output", "call_id": "c1", "output": BIG}]}),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": BIG}]}]}]}),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": BIG}}]}]}),
])
def test_what_the_template_renders_besides_text_counts(route, body):
    """Tools, documents, tool calls and tool results are prompt tokens too: counting only message text let a
    request whose prompt is ~1,000 tokens on the engine count as a few, past admission and tenant limits."""
    from pdserve.model.resolve import resolve_model

    pl = PromptLength(resolve_model(None))
    est, floor = pl.measure(route, body)
    assert est > 900, est
    assert floor in (None, 1)  # the floor stays the user's words only
    # ...and a big one is measured off the event loop like big text (PromptLength.is_big reads the same).
    assert sum(map(len, prompt_length._texts(route, body))) > len(BIG)


def test_no_apply_chat_template_parameter_passes_as_a_template_kwarg():
    """vLLM passes every named parameter of transformers' apply_chat_template on as given (padding,
    max_length, truncation: "hi" padded to 6,000 tokens): none may come from a request."""
    import inspect

    from transformers import PythonBackend

    from pdserve.router.handoff import TEMPLATE_RESERVED_KWARGS

    named = {p.name for p in inspect.signature(PythonBackend.apply_chat_template).parameters.values()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert named - {"self"} <= TEMPLATE_RESERVED_KWARGS, named - TEMPLATE_RESERVED_KWARGS
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"padding": "max_length", "max_length": 6000}}
    with pytest.raises(BadRequest) as e:
        handoff.check_request("chat", body)
    assert e.value.param in ("chat_template_kwargs.padding", "chat_template_kwargs.max_length")


def test_an_engine_answers_the_routers_check(engine_models):
    """What an engine's ``POST /pdserve/check`` answers (engine/vllm_plugin.py serves request_check.answer)."""
    from pdserve.engine import vllm_plugin
    from pdserve.router.engine_client import CHECK_VERDICT

    # The router and the engines spell the route and the verdict's mark each in their own layer.
    assert validate.CHECK_PATH == vllm_plugin.CHECK_PATH and CHECK_VERDICT == request_check.VERDICT
    verdict = request_check.VERDICT
    status, out = request_check.answer({"route": "chat", "body": chat(n="2", stream="false", max_tokens=5)})
    assert status == 200 and out == {"decided": {"n": 2, "stream": False, "max_tokens": 5}, verdict: True}
    status, out = request_check.answer({"route": "completions", "body": comp(temperature=-1)})
    assert status == 400 and out["error"]["param"] == "temperature" and out["error"]["code"] == 400
    assert out[verdict] is True
    # Not a check at all: no verdict on anything (the router then decides with its own rules).
    for envelope in ("x", None, {"route": "evil", "body": {}}, {"route": "chat", "body": []}, {"route": "chat"}):
        status, out = request_check.answer(envelope)
        assert status == 422 and "route" in out["error"]["message"] and out[verdict] is False


def test_an_engines_verdict_sets_only_scalar_fields_the_client_gave():
    """The body's fields the engine parsed replace the client's spelling of them; nothing else changes."""
    async def odd(route, body):
        return {"seed": 7, "logprobs": False, "model": {"x": 1}, "messages": None, "kv_transfer_params": "x",
                "temperature": [1]}

    lengths = PromptLength()
    lengths.vocab_size = VOCAB
    body = chat(seed="7", logprobs="false", model="m", temperature=0.5)
    req = check(RequestValidator(lengths, LIMITS, odd), "chat", body)
    assert body["seed"] == 7 and body["logprobs"] is False and req.seed == 7 and not req.token_logprobs
    assert body["model"] == "m" and body["temperature"] == 0.5 and "kv_transfer_params" not in body
    assert body["messages"] == chat()["messages"]


def test_the_engines_endpoint_plugin_serves_the_check(engine_models, monkeypatch):
    """The route vLLM's API server gets from pdserve's endpoint plugin, called as the router calls it."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pdserve.engine import vllm_plugin

    monkeypatch.delenv(vllm_plugin.ENV_KEY, raising=False)
    app = FastAPI()
    vllm_plugin.KvLeaseEndpoint().attach_router(app)
    with TestClient(app) as client:
        r = client.post(validate.CHECK_PATH, json={"route": "chat", "body": chat(seed="7")})
        assert r.status_code == 200 and r.json() == {"decided": {"seed": 7}, request_check.VERDICT: True}
        r = client.post(validate.CHECK_PATH, json={"route": "chat", "body": chat(top_p=5)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        r = client.post(validate.CHECK_PATH, content=b"{not json")
        assert r.status_code == 422


class _SlowTokenizer:
    """A tokenizer that takes its time on a batch call (as the real one does on a long text, without the GIL)
    and one token per word; remembers what it encoded."""

    def __init__(self, release: Any) -> None:
        self.encoded: list[int] = []
        self.release = release

    def encode(self, text, add_special_tokens=False):
        self.encoded.append(len(text))
        return type("Enc", (), {"ids": [0] * len(text.split())})()

    def encode_batch(self, texts, add_special_tokens=False):
        self.release.wait(10)
        return [self.encode(t) for t in texts]


def test_much_text_is_measured_off_the_loop_and_text_past_the_context_not_at_all():
    """A client picks how much text there is to count (up to the body limit: seconds of tokenizing). A text
    longer than the context holds even at the longest token is refused by its length, never encoded; a
    request with much text is measured in a worker thread while the loop serves others; small ones inline."""
    import threading

    from pdserve.router.prompt_length import BIG_TEXT_CHARS

    release = threading.Event()
    tok = _SlowTokenizer(release)
    lengths = PromptLength()
    lengths._tok, lengths.vocab_size, lengths.max_token_chars = tok, VOCAB, 8
    v = RequestValidator(lengths, EngineLimits(max_model_len=4096), None)

    huge = {"model": "m", "prompt": "word " * (4096 * 8 // 5 + 1), "max_tokens": 4}
    with pytest.raises(BadRequest) as e:
        check(v, "completions", huge)
    assert e.value.param in ("prompt", "max_tokens") and tok.encoded == []  # by its length alone
    with pytest.raises(BadRequest):  # chat alike: a user's message past the context
        check(v, "chat", {"model": "m", "messages": [{"role": "user", "content": "word " * 7000}], "max_tokens": 4})
    assert tok.encoded == []

    big = {"model": "m", "prompt": "word " * (BIG_TEXT_CHARS // 5 + 10), "max_tokens": 4}
    seen: list[str] = []

    async def main() -> None:
        task = asyncio.create_task(v.check("completions", copy.deepcopy(big)))
        await asyncio.sleep(0.05)
        seen.append("loop ran while the big prompt was measured" if not task.done() else "done first")
        release.set()
        req = await task
        seen.append(f"{req.prompt_tokens} tokens")

    asyncio.run(main())
    assert seen == ["loop ran while the big prompt was measured", f"{BIG_TEXT_CHARS // 5 + 10} tokens"]
    release.clear()
    check(v, "completions", {"model": "m", "prompt": "a few words", "max_tokens": 4})  # inline, no wait
    assert tok.encoded[-1] == len("a few words")


def test_the_router_knows_engines_schedule_by_priority_only_when_every_role_does():
    from pdserve.router.validate import EngineLimits

    assert EngineLimits.from_engine_kwargs({"scheduling_policy": "priority"}, {"scheduling_policy": "priority"}
                                           ).priority_scheduling
    assert not EngineLimits.from_engine_kwargs({"scheduling_policy": "priority"}, {}).priority_scheduling
    assert not EngineLimits.from_engine_kwargs({"scheduling_policy": "fcfs"}, {"scheduling_policy": "fcfs"}
                                               ).priority_scheduling
    assert not EngineLimits.from_engine_kwargs().priority_scheduling


def test_a_big_bodys_checks_run_off_the_event_loop(validator, monkeypatch):
    """A body that came in past BIG_BODY_BYTES is walked (nesting, fields, Unicode, length) in a worker
    thread: millions of items are seconds of Python the loop would otherwise spend."""
    import threading

    where: list[bool] = []
    real = validate._shape

    def spy(route: Any, body: Any) -> None:
        where.append(threading.current_thread() is threading.main_thread())
        real(route, body)

    monkeypatch.setattr(validate, "_shape", spy)
    body = {"model": "m", "prompt": "hello there", "max_tokens": 4}

    async def check(size: int) -> None:
        body_mod.BODY_BYTES.set(size)
        await validator.check("completions", copy.deepcopy(body))

    asyncio.run(check(10))
    asyncio.run(check(body_mod.BIG_BODY_BYTES + 1))
    assert where == [True, False]
