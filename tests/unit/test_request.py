"""The typed request every decision after the checks reads (router/request.py)."""

from __future__ import annotations

import pytest

from pdserve.errors import BadRequest
from pdserve.router import early, handoff, migrate
from pdserve.router.request import Request


def test_the_decided_values_are_typed_once():
    req = Request.parse("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "stream": True,
                                 "temperature": 0, "stop": ["."], "stream_options": {"include_usage": True},
                                 "tools": [{"type": "function"}], "tool_choice": "none"}, prompt_tokens=40)
    assert (req.route, req.prompt_tokens, req.budget_field, req.max_new_tokens) == ("chat", 40, "max_tokens", 9)
    assert req.stream and req.greedy and req.stop and req.usage_at_end and not req.usage_per_event
    assert not req.tool_calls and req.sampled_once and req.seed is None
    # chat: max_completion_tokens wins over max_tokens, as in vLLM
    both = Request.parse("chat", {"messages": [], "max_tokens": 9, "max_completion_tokens": 3})
    assert (both.budget_field, both.max_new_tokens) == ("max_completion_tokens", 3)
    assert Request.parse("responses", {"input": "x", "max_output_tokens": 5}).max_new_tokens == 5
    assert Request.parse("messages", {"messages": [], "max_tokens": 7, "stop_sequences": ["x"]}).stop


def test_completions_prompts_batches_and_ids():
    assert Request.parse("completions", {"prompt": [5, 6, 7]}).prompt_ids == (5, 6, 7)
    batch = Request.parse("completions", {"prompt": ["a", "b"]})
    assert batch.prompts == 2 and batch.prompt_ids is None
    assert Request.parse("completions", {"prompt": "a"}).prompts == 1


@pytest.mark.parametrize("field, value", [("best_of", "2"), ("n", 1.5), ("stream", "true"), ("max_tokens", "8"),
                                          ("temperature", "0"), ("seed", "7"), ("logprobs", "1"),
                                          ("return_token_ids", 1), ("echo", "false")])
def test_a_value_the_router_cannot_decide_on_is_a_400_naming_it(field, value):
    """Without vLLM's models (a router-only install) nothing converted these: the parse refuses them, where a
    comparison would have failed later with a 500."""
    with pytest.raises(BadRequest) as e:
        Request.parse("completions", {"prompt": "x", field: value})
    assert e.value.param == field and e.value.status_code == 400


def test_previous_response_id_must_be_a_string():
    with pytest.raises(BadRequest) as e:
        Request.parse("responses", {"input": "x", "previous_response_id": 3})
    assert e.value.param == "previous_response_id"
    assert Request.parse("chat", {"messages": [], "previous_response_id": 3}).previous_response_id is None


def test_a_new_body_is_parsed_again():
    req = Request.parse("completions", {"prompt": "x", "temperature": 0.5}, prompt_tokens=12)
    seeded = early.seeded(req)
    assert seeded.seed is not None and seeded.seed == seeded.body["seed"] and seeded.prompt_tokens == 12
    assert "seed" not in req.body  # the client's body is not changed
    tracked = migrate.tracked(req)
    assert tracked.return_token_ids and tracked.body["return_token_ids"] is True and not req.return_token_ids


def test_plan_reads_the_typed_values():
    assert handoff.plan(Request.parse("responses", {"input": "x", "previous_response_id": "resp_1"})).reason == \
        "previous_response"
    assert handoff.plan(Request.parse("completions", {"prompt": "x", "best_of": 2})).reason == "n>1"
    assert handoff.plan(Request.parse("completions", {"prompt": "x", "prompt_logprobs": 1})).reason == \
        "prompt logprobs"
    assert handoff.plan(Request.parse("completions", {"prompt": "x"}, prompt_tokens=10), local_below=11).reason == \
        handoff.SHORT_PROMPT


def test_a_logprobs_count_of_zero_asks_for_logprobs_as_vllm_reads_it():
    """vLLM returns the sampled token's logprob for ``logprobs: 0`` (and prompt logprobs for
    ``prompt_logprobs: 0``): the request carries logprobs, so no early first token without them and no move
    that would drop them (router/early.py, router/migrate.py)."""
    for body, asks in (({"logprobs": 0}, True), ({"logprobs": 3}, True), ({"logprobs": None}, False), ({}, False)):
        assert Request.parse("completions", {"model": "m", "prompt": "p", **body}).token_logprobs is asks, body
    assert Request.parse("completions", {"model": "m", "prompt": "p", "prompt_logprobs": 0}).prompt_logits
    assert Request.parse("chat", {"model": "m", "messages": [], "logprobs": False}).token_logprobs is False
    assert Request.parse("chat", {"model": "m", "messages": [], "logprobs": True}).token_logprobs is True
