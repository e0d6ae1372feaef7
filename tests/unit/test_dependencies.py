"""Declared = imported: every third-party module the runtime imports comes from a distribution
pyproject.toml declares, and every declared runtime dependency is imported (or says why not). The same for
the benchmarks' distribution (bench/pyproject.toml), which also requires pdserve at its own version."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "pdserve"
BENCH = ROOT / "bench"
#: Declared but not imported by pdserve's code, and why.
NOT_IMPORTED = {"gguf": "transformers reads the packaged model's GGUF file with it",
                "accelerate": "transformers loads a GGUF file only with it installed (tests/component/test_embedded_model.py)"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist(requirement: str) -> str:
    return _norm(re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0])


def _declared(root: Path = ROOT) -> dict[str, set[str]]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    out = {"core": {_dist(r) for r in project["dependencies"]}}
    out.update({extra: {_dist(r) for r in reqs} for extra, reqs in project.get("optional-dependencies", {}).items()})
    return out


def _imports(src: Path = SRC, own: tuple[str, ...] = ("pdserve",)) -> dict[str, set[str]]:
    """Top-level third-party module -> the parts of the package in ``src`` (``engine``, ``router``, ...)
    importing it; ``own``: the first-party top-level names."""
    found: dict[str, set[str]] = {}
    for f in src.rglob("*.py"):
        part = f.relative_to(src).parts[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in (*own, "__future__"):
                    found.setdefault(top, set()).add(part)
    return found


def test_every_import_is_declared_and_every_declared_dependency_imported():
    declared = _declared()
    dists = packages_distributions()
    runtime = declared["core"] | declared["cpu"] | declared["gpu"]
    missing, imported = [], set()
    # pdserve_bench: `pdserve bench` imports the benchmarks' distribution when installed (test_layers.py)
    for module, parts in sorted(_imports(SRC, ("pdserve", "pdserve_bench")).items()):
        names = {_norm(d) for d in dists.get(module, [module])}
        # vllm and torch come with the cpu or gpu extra (one of them is always installed to serve)
        allowed = declared["core"] | declared["cpu"] | declared["gpu"]
        if not names & allowed:
            missing.append(f"{module} ({', '.join(sorted(parts))}) from {sorted(names)}")
        imported |= names
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
    unused = sorted(d for d in declared["core"] if d not in imported and d not in NOT_IMPORTED
                    and not (d == "ray" and "ray" in imported))
    assert not unused, f"declared but never imported: {unused}"
    assert runtime  # the extras exist


def test_the_benchmarks_declare_what_they_import_and_import_what_they_declare():
    """pdserve-bench (bench/): each module it imports comes from its own dependencies or from pdserve's (it
    requires pdserve; vllm and nixl come with pdserve's cpu or gpu extra); each of its own dependencies is
    imported, or is one Ray Serve LLM imports (the bench only checks that it is found)."""
    from pdserve_bench.vs_ray_serve_llm import RAY_LLM_MODULES

    dists = packages_distributions()
    pdserve, bench = _declared(), _declared(BENCH)["core"]
    assert "pdserve" in bench
    allowed = bench | pdserve["core"] | pdserve["cpu"] | pdserve["gpu"]
    missing, imported = [], set()
    for module, parts in sorted(_imports(BENCH / "src" / "pdserve_bench", ("pdserve", "pdserve_bench")).items()):
        names = {_norm(d) for d in dists.get(module, [module])}
        if not names & allowed:
            missing.append(f"{module} ({', '.join(sorted(parts))}) from {sorted(names)}")
        imported |= names
    assert not missing, "imported but not declared in bench/pyproject.toml: " + "; ".join(missing)
    found = {_norm(d) for m in RAY_LLM_MODULES for d in dists.get(m, [m])}
    unused = sorted(bench - imported - found - {"pdserve"})
    assert not unused, f"bench/pyproject.toml declares, but the bench never imports: {unused}"


def test_the_benchmarks_are_released_with_pdserves_number():
    from pdserve import __version__
    from pdserve_bench import __version__ as bench_version

    project = tomllib.loads((BENCH / "pyproject.toml").read_text())["project"]
    assert bench_version == __version__
    assert f"pdserve=={__version__}" in project["dependencies"]
    # and the root distribution no longer carries the benchmarks' dependencies as an extra
    assert "bench" not in _declared()
