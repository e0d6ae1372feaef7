"""The package's layers: config -> model -> engine -> router -> app, with deploy and doctor beside and the
CLI on top; testing (the harnesses for tests and benchmarks) over the runtime, which never imports it. Every
import of one pdserve package by another (lazy imports inside functions included) must be one this table
allows, so nothing imports upward. The benchmarks are another distribution (bench/, pdserve_bench): the
runtime imports them in one place, ``pdserve bench``."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pdserve"

#: Modules every layer may use: the typed config, the error types, the settings, the version.
BASE = {"config", "errors", "settings", "_version", "footprint"}

#: What each part may import besides itself and BASE.
ALLOWED: dict[str, set[str]] = {
    "config": {"errors", "_version"},
    "errors": set(),
    "settings": {"errors"},
    "_version": set(),
    "footprint": set(),
    "model": BASE,
    "engine": BASE | {"model"},
    "router": BASE | {"package"},  # the package's __version__
    "app": BASE | {"model", "engine", "router"},
    "deploy": BASE,
    "doctor": BASE | {"model", "engine", "package"},
    "cli": BASE | {"model", "engine", "router", "app", "deploy", "doctor", "package"},
    # Harnesses over the runtime (fake engines, a router over them, `pdserve serve` as a child process);
    # nothing in the runtime imports them.
    "testing": BASE | {"model", "engine", "router"},
    "package": BASE | {"app"},  # pdserve/__init__.py: build_pd_openai_app for Serve import paths
}


def part(module: str) -> str:
    """The layer of a dotted module name: the first name under pdserve, or "package" for pdserve itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "package"


def imports(top: str = "pdserve", src: Path = SRC) -> list[tuple[str, str]]:
    """(importing module, imported module) for every import of ``top`` or below it in ``src``."""
    found = []
    for f in src.rglob("*.py"):
        if "_site" in f.parts:  # the engine processes' sitecustomize imports nothing of pdserve
            continue
        rel = f.relative_to(src.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == top or name.startswith(top + "."):
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
    assert not [p for p, allowed in ALLOWED.items() if "testing" in allowed]
    assert part("pdserve.router.orchestrator") == "router" and part("pdserve") == "package"


def test_the_runtime_imports_the_benchmarks_only_to_run_pdserve_bench():
    """The one import of pdserve_bench under src/pdserve: ``pdserve bench``'s, inside the command's function
    (so every other command, and serving, works without the benchmarks installed)."""
    found = imports("pdserve_bench")
    assert sorted(set(found)) == [("pdserve.cli.main", "pdserve_bench.cli")], found
    tree = ast.parse((SRC / "cli" / "main.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in top if "pdserve_bench" in ast.dump(n)], "pdserve_bench imported at module level"
    (bench,) = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_cmd_bench"]
    assert any(isinstance(n, ast.ImportFrom) and n.module == "pdserve_bench.cli" for n in ast.walk(bench))


def test_the_benchmarks_check_sees_another_import(tmp_path):
    (tmp_path / "pdserve" / "doctor").mkdir(parents=True)
    (tmp_path / "pdserve" / "doctor" / "x.py").write_text("def f():\n    from pdserve_bench import stats\n")
    assert imports("pdserve_bench", tmp_path / "pdserve") == [("pdserve.doctor.x", "pdserve_bench")]
