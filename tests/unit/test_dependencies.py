"""Declared = imported: every third-party module the runtime imports comes from a distribution
pyproject.toml declares, and every declared runtime dependency is imported (or says why not)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "pdserve"
#: Declared but not imported by pdserve's code, and why.
NOT_IMPORTED = {"gguf": "transformers reads the packaged model's GGUF file with it"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist(requirement: str) -> str:
    return _norm(re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0])


def _declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {"core": {_dist(r) for r in project["dependencies"]}}
    out.update({extra: {_dist(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()})
    return out


def _imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the pdserve parts (``bench``, ``engine``, ...) importing it."""
    found: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        part = f.relative_to(SRC).parts[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("pdserve", "__future__"):
                    found.setdefault(top, set()).add(part)
    return found


def test_every_import_is_declared_and_every_declared_dependency_imported():
    declared = _declared()
    dists = packages_distributions()
    runtime = declared["core"] | declared["cpu"] | declared["gpu"]
    missing, imported = [], set()
    for module, parts in sorted(_imports().items()):
        names = {_norm(d) for d in dists.get(module, [module])}
        # vllm and torch come with the cpu or gpu extra (one of them is always installed to serve)
        allowed = declared["core"] | (declared["cpu"] | declared["gpu"]) | (declared["bench"] if parts == {"bench"} else set())
        if not names & allowed:
            missing.append(f"{module} ({', '.join(sorted(parts))}) from {sorted(names)}")
        imported |= names
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
    unused = sorted(d for d in declared["core"] if d not in imported and d not in NOT_IMPORTED
                    and not (d == "ray" and "ray" in imported))
    assert not unused, f"declared but never imported: {unused}"
    assert runtime  # the extras exist
