"""The package's layers: config -> model -> engine -> router -> app, with deploy and doctor beside and the
CLI on top; testing (the harnesses for tests and benchmarks) over the runtime, which never imports it. Every
import of one pdserve package by another (lazy imports inside functions included) must be one this table
allows, so nothing imports upward. The benchmarks are another distribution (bench/, pdserve_bench): the
runtime imports them in one place, ``pdserve bench``.

Within each part (pdserve.router, pdserve.app, ...), and across the benchmarks' whole distribution, no
modules import each other in a circle, again counting imports inside functions (a lazy import hides a circle
from the interpreter, not from the design). Imports under ``if TYPE_CHECKING:`` never run and name types
only: they do not count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "pdserve"
BENCH = ROOT / "bench" / "src" / "pdserve_bench"

#: Modules every layer may use: the typed config, the error types, the settings, the version, how a running
#: app's cost is measured, how idle servers wait, records bounded per owner.
BASE = {"config", "errors", "settings", "_version", "footprint", "idle", "owned"}

#: What each part may import besides itself and BASE.
ALLOWED: dict[str, set[str]] = {
    "config": {"errors", "_version"},
    "errors": set(),
    "settings": {"errors"},
    "_version": set(),
    "footprint": set(),
    "idle": set(),
    "owned": set(),
    "model": BASE,
    "engine": BASE | {"model"},
    "router": BASE,
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


# -- no circles of imports within a part ------------------------------------------------------------------


def module_names(src: Path) -> dict[str, Path]:
    """Every module of the package at ``src`` (``src.name`` its top), by dotted name."""
    found = {}
    for f in sorted(src.rglob("*.py")):
        if "_site" in f.parts:
            continue
        rel = f.relative_to(src.parent).with_suffix("")
        found[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip |= {id(n) for n in ast.walk(child)}
    return skip


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its file (module body, functions,
    classes; relative imports resolved). ``from a.b import c`` is an import of ``a.b.c`` where that is a
    module, else of ``a.b``."""
    mods = module_names(src)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports per strongly connected group of modules, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # a shortest way back to the group's first module, through the group
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & group):
                if w == start:
                    queue = []
                    found.append(paths[v] + [start])
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(found)


def _within_parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if part(t) == part(m)} for m, targets in graph.items()}


def test_no_part_imports_itself_in_a_circle():
    found = cycles(_within_parts(import_graph(SRC)))
    assert not found, "modules that import each other in a circle (inside functions too):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_the_benchmarks_import_themselves_in_no_circle():
    found = cycles(import_graph(BENCH))
    assert not found, "pdserve_bench modules that import each other in a circle (inside functions too):\n" + \
        "\n".join(" -> ".join(c) for c in found)


def test_the_circle_check_sees_a_lazy_circle_and_leaves_type_only_imports_alone(tmp_path):
    pkg = tmp_path / "pdserve" / "router"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py"):
        (pkg / f).write_text("")
    (tmp_path / "pdserve" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pdserve.router.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # lazy and relative
    (pkg / "c.py").write_text("import pdserve.router.a\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pdserve.router.e import E\n")
    (pkg / "e.py").write_text("from pdserve.router import d\nclass E:\n    pass\n")
    graph = import_graph(tmp_path / "pdserve")
    assert graph["pdserve.router.sub.b"] == {"pdserve.router.c"}
    assert cycles(_within_parts(graph)) == [
        ["pdserve.router.a", "pdserve.router.sub.b", "pdserve.router.c", "pdserve.router.a"]]
