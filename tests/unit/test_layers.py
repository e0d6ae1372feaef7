"""The package's layers: config -> model -> engine -> router -> app, with deploy, doctor and bench beside and
the CLI on top. Every import of one pdserve package by another (lazy imports inside functions included) must
be one this table allows, so nothing imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pdserve"

#: Modules every layer may use: the typed config, the error types, the settings, the version.
BASE = {"config", "errors", "settings", "_version"}

#: What each part may import besides itself and BASE.
ALLOWED: dict[str, set[str]] = {
    "config": {"errors", "_version"},
    "errors": set(),
    "settings": {"errors"},
    "_version": set(),
    "served": {"errors"},
    "model": BASE,
    "engine": BASE | {"model"},
    "router": BASE | {"package"},  # the package's __version__
    "app": BASE | {"model", "engine", "router"},
    "deploy": BASE,
    "doctor": BASE | {"model", "engine", "package"},
    "bench": BASE | {"model", "engine", "router", "served"},
    "cli": BASE | {"model", "engine", "router", "app", "deploy", "doctor", "bench", "served", "package"},
    "package": BASE | {"app"},  # pdserve/__init__.py: build_pd_openai_app for Serve import paths
}


def part(module: str) -> str:
    """The layer of a dotted module name: the first name under pdserve, or "package" for pdserve itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "package"


def imports() -> list[tuple[str, str]]:
    found = []
    for f in SRC.rglob("*.py"):
        if "_site" in f.parts:  # the engine processes' sitecustomize imports nothing of pdserve
            continue
        rel = f.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "pdserve" or name.startswith("pdserve."):
                    found.append((module, name))
    return found


def test_no_part_imports_upward():
    bad = sorted({f"{src} imports {dst}" for src, dst in imports()
                  if part(src) != part(dst) and part(dst) not in ALLOWED[part(src)]})
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_part_is_in_the_table():
    parts = {part(src) for src, _ in imports()} | {part(dst) for _, dst in imports()}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


def test_the_check_sees_an_upward_import():
    assert "app" not in ALLOWED["router"] and "router" not in ALLOWED["engine"] and "engine" not in ALLOWED["model"]
    assert part("pdserve.router.orchestrator") == "router" and part("pdserve") == "package"
