"""Request bodies generated from vLLM's own request models (their JSON Schemas), for property-based tests:
every shape vLLM's OpenAI server documents, filled with values inside and at the edges of each field's
declared type, plus now and then a value of the wrong type. Used against the router with fake engines
(tests/component/test_fuzz.py) and against the real system (tests/integration/test_hostile_input.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

#: (path, vLLM request model's import path) for every route the router serves from a body.
ROUTES = (
    ("/v1/completions", "vllm.entrypoints.openai.completion.protocol:CompletionRequest"),
    ("/v1/chat/completions", "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest"),
    ("/v1/responses", "vllm.entrypoints.openai.responses.protocol:ResponsesRequest"),
    ("/v1/messages", "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest"),
    ("/tokenize", "vllm.entrypoints.serve.tokenize.protocol:TokenizeCompletionRequest"),
    ("/tokenize", "vllm.entrypoints.serve.tokenize.protocol:TokenizeChatRequest"),
    ("/detokenize", "vllm.entrypoints.serve.tokenize.protocol:DetokenizeRequest"),
)

_any_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_wrong = st.one_of(_any_scalar, st.lists(_any_scalar, max_size=2), st.dictionaries(st.text(max_size=6), _any_scalar,
                                                                                   max_size=2))


def schema_of(import_path: str) -> dict[str, Any]:
    import importlib

    module, name = import_path.split(":")
    return getattr(importlib.import_module(module), name).model_json_schema()


class FromSchema:
    """A hypothesis strategy for one JSON Schema (pydantic's dialect: ``$defs``, ``anyOf``, ``$ref``)."""

    def __init__(self, schema: dict[str, Any], *, max_depth: int = 4, wrong_type_share: int = 12) -> None:
        self.defs = schema.get("$defs", {})
        self.root = schema
        self.max_depth = max_depth
        self.wrong_every = wrong_type_share  # about one value in this many has the wrong type

    def strategy(self) -> st.SearchStrategy[Any]:
        return self._of(self.root, 0)

    def _of(self, s: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        strat = self._typed(s, depth)
        if depth == 0:
            return strat
        return st.one_of(strat, _wrong) if self.wrong_every else strat

    def _typed(self, s: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        if depth > self.max_depth:
            return _any_scalar
        if "$ref" in s:
            return st.deferred(lambda: self._typed(self.defs.get(s["$ref"].split("/")[-1], {}), depth + 1))
        if "const" in s:
            return st.just(s["const"])
        if "enum" in s:
            return st.sampled_from(s["enum"]) if s["enum"] else st.none()
        for key in ("anyOf", "oneOf"):
            if key in s:
                return st.one_of([self._typed(x, depth) for x in s[key]])
        if "allOf" in s and s["allOf"]:
            return self._typed(s["allOf"][0], depth)
        kind = s.get("type")
        if isinstance(kind, list):
            return st.one_of([self._typed({**s, "type": k}, depth) for k in kind])
        if kind == "string":
            return st.text(max_size=int(min(s.get("maxLength", 40), 40)))
        if kind == "integer":
            lo, hi = s.get("minimum"), s.get("maximum")
            return st.one_of(st.integers(lo if lo is not None else -(2**33), hi if hi is not None else 2**33),
                             st.sampled_from([0, 1, -1, 2**31, 2**63]))
        if kind == "number":
            return st.floats(allow_nan=False, allow_infinity=False, min_value=s.get("minimum"),
                             max_value=s.get("maximum"))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            item = self._of(s.get("items", {}), depth + 1)
            return st.lists(item, max_size=3)
        if kind == "object" or "properties" in s:
            props = s.get("properties", {})
            required = {k: self._of(v, depth + 1) for k, v in props.items() if k in s.get("required", [])}
            optional = {k: self._of(v, depth + 1) for k, v in props.items() if k not in required}
            fixed = st.fixed_dictionaries(required, optional=optional)
            extra = s.get("additionalProperties")
            if isinstance(extra, dict) and not props:
                return st.dictionaries(st.text(max_size=8), self._of(extra, depth + 1), max_size=3)
            return fixed
        return _any_scalar


def bodies(import_path: str, model: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies for one request model, most of them naming the served ``model``."""
    base = FromSchema(schema_of(import_path)).strategy()

    def named(b: Any, keep: bool) -> Any:
        if isinstance(b, dict) and not keep:
            b = {**b, "model": model}
        return b

    return st.builds(named, base, st.integers(0, 9).map(lambda n: n == 0))
