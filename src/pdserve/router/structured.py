"""Structured outputs a request may ask for, bounded: no request makes an engine compile for minutes.

An engine compiles a request's JSON schema, grammar or structural tag into a token mask (xgrammar, vLLM
0.32's default) before its first step, on the engine's own cores, with no time limit but for regexes. The
cost is not the spec's size: a string with a length bound is unrolled into one rule per length, and each
distinct bound is compiled anew (measured on the packaged model's 49k-token vocabulary, AMD EPYC, one
core: a schema of one string with ``maxLength`` 16 took 0.11 s, 64 0.77 s, 256 and more ~2 s; four
distinct bounds 2.4 s, eight equal ones 0.7 s; unbounded strings, arrays and patterns ~0.01-0.07 s). A
~9 KB body of ~150 distinct bounds was minutes of a shared engine's time, on each leg it reached.

A regex's or grammar's repetition counts (``{m,n}``) are unrolled alike: ``a.{0,200}b`` took 1.8 s, two
distinct bounds 3.7 s, four equal ones 1.9 s (a schema's ``pattern`` with the same bound, 0.02 s).

So a request's specs (``structured_outputs``, ``response_format``, the Responses ``text.format``, the
legacy ``guided_*`` fields, and the tools' parameter schemas when ``tool_choice`` makes the engine hold the
answer to them) may hold at most :data:`MAX_DISTINCT_BOUNDS` distinct bounds above :data:`FREE_BOUND`,
string lengths and a regex's or grammar's repetitions together, and :data:`MAX_SPEC_BYTES` of spec in all;
past either, 400 naming the field. The
prefill leg keeps the specs: its token may be the stream's first (router/early.py), and some models' chat
formats render the response format into the prompt, which both legs must compute alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from pdserve.errors import BadRequest

#: Fields whose values the engine compiles into a grammar (vLLM 0.32's names, and the legacy ones).
SPEC_FIELDS = ("structured_outputs", "response_format", "text", "output_format", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")
#: JSON Schema keywords that bound a string's length: each distinct value is compiled as rules of its own.
BOUND_KEYS = ("maxLength", "minLength")
#: Fields (and ``structured_outputs`` keys) holding a regex or a grammar, whose ``{m,n}`` are bounds too.
PATTERN_KEYS = ("regex", "grammar", "guided_regex", "guided_grammar")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
#: A repetition count of more digits than this counts as this large (leading zeros are dropped first).
_HUGE = 10**9
#: Bounds up to this cost about a tenth of a second each, and are not counted.
FREE_BOUND = 16
#: Distinct string-length bounds above FREE_BOUND one request may ask for (~2 s of compile each at most).
MAX_DISTINCT_BOUNDS = 4
#: Bytes of specs (as JSON) one request may send.
MAX_SPEC_BYTES = 32_768
#: Nesting the walk follows (bodies are bounded deeper than this already: router/body.py).
_MAX_DEPTH = 64


def forced_tools(body: dict[str, Any]) -> bool:
    """Whether ``tool_choice`` makes the engine hold the answer to the tools' schemas (``required``, a named
    function, Anthropic's ``any`` or ``tool``)."""
    choice = body.get("tool_choice")
    if choice == "required":
        return True
    return isinstance(choice, dict) and choice.get("type") in ("function", "tool", "any")


def _repeats(pattern: str) -> Iterator[int]:
    """The counted bounds of a regex's or grammar's repetitions: ``{m}``, ``{m,}``, ``{m,n}`` (the larger)."""
    for m in _REPEAT.finditer(pattern):
        bound = max(_count(m.group(1)), _count(m.group(2) or "0"))
        if bound > FREE_BOUND:
            yield bound


def _count(digits: str) -> int:
    """A repetition count as the compiler reads it (``0000200`` is 200)."""
    digits = digits.lstrip("0") or "0"
    return _HUGE if len(digits) > 9 else int(digits)


def _bounds(node: Any, depth: int = 0) -> Iterator[int]:
    if depth > _MAX_DEPTH:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            if k in BOUND_KEYS and isinstance(v, int) and not isinstance(v, bool) and v > FREE_BOUND:
                yield v
            elif isinstance(v, str) and (k in PATTERN_KEYS or (k == "pattern" and node.get("type") == "regex")):
                yield from _repeats(v)  # (a structural tag's regex is its ``pattern``)
            elif isinstance(v, (dict, list)):
                yield from _bounds(v, depth + 1)
            elif isinstance(v, str) and (k == "structural_tag" or (k in ("json", "schema") and "Length" in v)):
                try:  # a schema or structural tag given as a JSON string (vLLM parses it)
                    yield from _bounds(json.loads(v), depth + 1)
                except ValueError:
                    pass
    elif isinstance(node, list):
        for v in node:
            yield from _bounds(v, depth + 1)


def check(body: dict[str, Any]) -> None:
    """400 for a request whose structured-output specs would cost an engine too much to compile."""
    specs = {k: body[k] for k in SPEC_FIELDS if body.get(k) is not None}
    if not specs and not (body.get("tools") and forced_tools(body)):
        return
    size = len(json.dumps(specs, separators=(",", ":"), default=str)) if specs else 0
    if size > MAX_SPEC_BYTES:
        field = max(specs, key=lambda k: len(json.dumps(specs[k], default=str)))
        raise BadRequest(f"structured-output specs of {size} bytes, more than {MAX_SPEC_BYTES}: an engine compiles "
                         "them before the first token", param=field)
    sources = dict(specs)
    if body.get("tools") and forced_tools(body):
        sources["tools"] = body["tools"]
    seen: set[int] = set()
    for field, spec in sources.items():
        bounds = _repeats(spec) if field in PATTERN_KEYS and isinstance(spec, str) else _bounds(spec)
        for bound in bounds:
            seen.add(bound)
            if len(seen) > MAX_DISTINCT_BOUNDS:
                raise BadRequest(
                    f"'{field}' bounds string lengths or repetitions (minLength/maxLength, {{m,n}} in a regex or "
                    f"grammar) in more than {MAX_DISTINCT_BOUNDS} ways above {FREE_BOUND}: each distinct bound is "
                    "compiled anew (up to ~2 s each on a CPU engine); use fewer distinct bounds", param=field)
