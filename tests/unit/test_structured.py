"""Structured-output specs are bounded before an engine compiles them (router/structured.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import BadRequest
from pdserve.router import handoff, structured


def schema(*bounds: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": b}
                                             for i, b in enumerate(bounds)}}


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body", [
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema(64, 128, 256, 512)}}),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema(*[100] * 50)}}),
    chat(structured_outputs={"json": schema(*range(1, 17))}),  # small bounds cost ~0.1 s: not counted
    chat(structured_outputs={"regex": "[a-z]{0,1000}"}),  # one bound
    chat(structured_outputs={"regex": "a.{0,200}b.{0,200}c.{0,200}d.{0,200}e{3}f{2,9}"}),  # one above 16
    chat(guided_regex="a{100}b{0,200}c{300,}d{1,400}"),  # four
    # A JSON schema's ``pattern`` compiles cheaply (0.02 s for a.{0,200}b): not counted.
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"a.{{0,{200 + i}}}"}
                                         for i in range(8)}}}}),
    chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema(*range(100, 160))}}]),
    chat(response_format={"type": "json_object"}),
])
def test_what_compiles_quickly_passes(body):
    handoff.check_request("chat", body)


@pytest.mark.parametrize("route, body, param", [
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema(*range(1000, 1005))}}),
     "response_format"),
    ("chat", chat(structured_outputs={"json": json.dumps(schema(*range(1000, 1005)))}), "structured_outputs"),
    ("responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                      "schema": schema(*range(20, 30))}}}, "text"),
    ("chat", chat(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": schema(*range(100, 160))}}]), "tools"),
    ("messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                  "tool_choice": {"type": "any"},
                  "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
                      "a": {"type": "string", "minLength": 20}, "b": {"type": "string", "minLength": 30},
                      "c": {"type": "string", "maxLength": 40}, "d": {"type": "string", "maxLength": 50},
                      "e": {"type": "string", "maxLength": 60}}}}]}, "tools"),
    ("chat", chat(structured_outputs={"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(8000))}),
     "structured_outputs"),
    # Each distinct repetition bound of a regex or grammar is unrolled anew: 1.8 s each (AMD EPYC, one core).
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a.{0,200}b.{0,201}c.{0,202}d.{0,203}e.{0,204}"}},
     "structured_outputs"),
    ("completions", {"prompt": "x", "guided_regex": "a.{200}b.{201,}c.{0,202}d.{0,203}e.{0, 204}"}, "guided_regex"),
    ("chat", chat(structured_outputs={"grammar": 'root ::= [a-z]{0,100} [a-z]{0,101} [a-z]{0,102} [a-z]{0,103} '
                                                 '[a-z]{0,104}'}), "structured_outputs"),
    # The compiler drops leading zeros; a structural tag's regex is its ``pattern``, in a dict or a JSON string.
    ("completions", {"prompt": "x", "guided_regex": "".join(f"a.{{0,000000000{200 + i}}}" for i in range(5))},
     "guided_regex"),
    ("completions", {"prompt": "x", "structured_outputs": {"structural_tag": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": f"a.{{0,{200 + i}}}"} for i in range(5)]}}}, "structured_outputs"),
    ("completions", {"prompt": "x", "structured_outputs": {"structural_tag": json.dumps({"type": "sequence",
        "elements": [{"type": "grammar", "grammar": f"root ::= [a-z]{{0,{200 + i}}}"} for i in range(5)]})}},
     "structured_outputs"),
])
def test_what_would_hold_an_engine_for_seconds_is_a_400(route, body, param):
    """A ~300-byte schema of five distinct length bounds took 9 s to compile on one core; a 9 KB body of such
    bounds, minutes, on each engine it reached."""
    with pytest.raises(BadRequest) as e:
        handoff.check_request(route, body)
    assert e.value.param == param, e.value.message


def test_the_bound_counts_distinct_values_across_the_request():
    body = chat(response_format={"type": "json_schema", "json_schema": {"schema": schema(100, 200)}},
                tool_choice={"type": "function", "function": {"name": "f"}},
                tools=[{"type": "function", "function": {"name": "f", "parameters": schema(300, 400, 100)}}])
    handoff.check_request("chat", body)  # 100, 200, 300, 400: four
    body["tools"][0]["function"]["parameters"] = schema(300, 400, 500)
    with pytest.raises(BadRequest):
        handoff.check_request("chat", body)
    assert structured.forced_tools({"tool_choice": "auto"}) is False
