"""Render the YAML reference (docs/config-reference.md) from the schema's field descriptions.

    python -m pdserve.config.reference > docs/config-reference.md
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel

from pdserve.config.schema import PDServeArgs


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:  # a constrained type (``Annotated[int, Field(ge=0)]``): its base type
        return _type_name(get_args(tp)[0])
    if origin is None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return "mapping"
        return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")
    args = [a for a in get_args(tp)]
    if str(origin).endswith("Literal"):
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return " \\| ".join(_type_name(a) for a in args)


def _default(field: Any) -> str:
    factory = field.default_factory
    if factory is not None:
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "(section)"
        return f"`{json.dumps(factory())}`"
    if field.is_required():
        return "required"
    return f"`{json.dumps(field.default)}`"


def _walk(model: type[BaseModel], prefix: str, rows: list[tuple[str, str, str, str]]) -> None:
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append((path, _type_name(field.annotation), _default(field), field.description or ""))
        for cand, where in _sections(field.annotation):
            _walk(cand, f"{path}{where}.", rows)


def _sections(tp: Any, where: str = "") -> list[tuple[type[BaseModel], str]]:
    """The sections a field's type holds, each with what its keys' path adds past the field's own:
    nothing for a section, ``.<name>`` for a mapping of names to sections, ``[]`` for a list of them."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [(tp, where)]
    origin, args = get_origin(tp), get_args(tp)
    if origin is dict and len(args) == 2:
        return _sections(args[1], where + ".<name>")
    if origin in (list, tuple) and args:
        return _sections(args[0], where + "[]")
    return [s for a in args for s in _sections(a, where)]


def render_markdown() -> str:
    rows: list[tuple[str, str, str, str]] = []
    _walk(PDServeArgs, "", rows)
    out = [
        "# pdserve YAML reference",
        "",
        "Generated from the schema (`python -m pdserve.config.reference`); do not edit by hand.",
        "",
        "A file is either these keys at the top level, or a Ray Serve config whose application has",
        "`import_path: pdserve:build_pd_openai_app` and these keys under `args:`. Unknown keys are errors.",
        "`prefill_config` and `decode_config` share one shape (Ray Serve LLM's `LLMConfig`); the table",
        "lists `prefill_config.*` once for both.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for path, tp, default, desc in rows:
        if path.startswith("decode_config."):
            continue
        cell = desc.replace("|", "\\|")
        out.append(f"| `{path}` | {tp} | {default} | {cell} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
