"""Read a pdserve YAML file: a bare ``args`` mapping or a full Ray Serve config (``applications: [...]``).

Errors name the file and the dotted path of the field, e.g.::

    config.yaml: prefill_config.deployment_config.num_replicas: Input should be a valid integer
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError

#: import paths whose ``args`` pdserve understands (ours, and Ray Serve LLM's own builder).
BUILDER_PATHS = ("pdserve:build_pd_openai_app", "ray.serve.llm:build_pd_openai_app")


@dataclass
class LoadedConfig:
    """A parsed file: the app's args plus the Serve-level settings that came with it."""

    args: PDServeArgs
    source: str
    app_name: str = "pdserve"
    route_prefix: str = "/"
    http_options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold (through Optional, unions, Annotated, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(m for m in _models_in(arg) if m not in found)
    return found


def known_fields(loc: tuple[Any, ...], root: type[BaseModel] = PDServeArgs) -> list[str]:
    """The field names the schema accepts in the mapping at ``loc`` (a path of keys and list indexes from
    ``root``); empty where that place is free-form (a dict of engine arguments) or unknown."""
    models = [root]
    for step in loc:
        if isinstance(step, int):
            continue  # a list's item: the same models
        nxt: list[type[BaseModel]] = []
        for m in models:
            f = m.model_fields.get(str(step))
            if f is None:
                f = next((v for v in m.model_fields.values() if v.alias == step), None)
            if f is not None:
                nxt.extend(x for x in _models_in(f.annotation) if x not in nxt)
        models = nxt
    names: list[str] = []
    for m in models:
        for name, f in m.model_fields.items():
            names.append(f.alias or name)
    return sorted(set(names))


def _unknown_field_message(loc: tuple[Any, ...]) -> str:
    msg = "unknown field (not part of the schema; check the spelling)"
    if not loc or not isinstance(loc[-1], str):
        return msg
    allowed = known_fields(loc[:-1])
    close = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean `{close[0]}`?"
    if allowed:
        return f"unknown field; this mapping takes: {', '.join(allowed)}"
    return msg


def _format_errors(err: ValidationError, source: str, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (*([prefix] if prefix else []), *e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = _unknown_field_message(tuple(e["loc"]))
        lines.append(f"{source}: {loc or '<top>'}: {msg}")
    return "\n".join(lines)


def parse_args(data: dict[str, Any], *, source: str = "<args>", prefix: str = "") -> PDServeArgs:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix or '<top>'}: expected a mapping, got {type(data).__name__}")
    try:
        return PDServeArgs.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, prefix)) from None


def load_config(path: str | Path | None) -> LoadedConfig:
    """Load ``path`` (``None``: the embedded default)."""
    if path is None:
        return LoadedConfig(args=PDServeArgs(), source="<embedded default>")
    import yaml

    p = Path(path)
    src = str(p)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{src}: cannot read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{src}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: <top>: expected a mapping, got {type(data).__name__}")
    if "applications" in data:
        return _from_serve_config(data, src)
    return LoadedConfig(args=parse_args(data, source=src), source=src)


def _from_serve_config(data: dict[str, Any], src: str) -> LoadedConfig:
    apps = data.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{src}: applications: expected a non-empty list")
    ours = [(i, a) for i, a in enumerate(apps) if isinstance(a, dict) and a.get("import_path") in BUILDER_PATHS]
    if not ours:
        found = ", ".join(str(a.get("import_path")) for a in apps if isinstance(a, dict))
        raise ConfigError(
            f"{src}: applications: no application with import_path {BUILDER_PATHS[0]} (found: {found or 'none'})"
        )
    if len(ours) > 1:
        raise ConfigError(f"{src}: applications: more than one pdserve application; `pdserve serve` runs one")
    i, app = ours[0]
    notes = []
    if app["import_path"] != BUILDER_PATHS[0]:
        notes.append(f"applications[{i}].import_path {app['import_path']} is served by pdserve's own builder")
    args = parse_args(app.get("args") or {}, source=src, prefix=f"applications[{i}].args")
    http = data.get("http_options") or {}
    if not isinstance(http, dict):
        raise ConfigError(f"{src}: http_options: expected a mapping")
    if "host" in http:
        args.http.host = str(http["host"])
    if "port" in http:
        args.http.port = int(http["port"])
    return LoadedConfig(
        args=args, source=src, app_name=str(app.get("name") or "pdserve"),
        route_prefix=str(app.get("route_prefix") or "/"), http_options=http, notes=notes,
    )
