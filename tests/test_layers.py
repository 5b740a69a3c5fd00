"""The package's layers stay layers: every import (at module level or inside a function) goes to
the same layer or one below it, no two modules import each other through any path, and the
modeling file copied into output folders imports nothing of headtool.

The order (lowest first) is the map in README's Development section.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import headtool

SRC = Path(headtool.__file__).parent

# lowest first; a module belongs to the first entry that is it or a package above it
LAYERS: list[tuple[str, ...]] = [
    ("headtool.version", "headtool.errors", "headtool.console", "headtool.distributed", "headtool.optionspec",
     "headtool.templates"),
    ("headtool.arch",),
    ("headtool.io",),
    ("headtool.model",),
    ("headtool.data",),
    ("headtool.measure",),
    ("headtool.surgery",),
    ("headtool.train",),
    ("headtool.workflows",),
    ("headtool.cli",),
    ("headtool", "headtool.__main__"),  # the package's public facade and `python -m headtool`
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matched prefix, layer)
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if name == "headtool" and module != "headtool":
                    continue  # the root facade holds only itself
                if best is None or len(name) > best[0]:
                    best = (len(name), i)
    return None if best is None else best[1]


def imports_of(path: Path, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(imported headtool module, line) for every import statement anywhere in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "headtool"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "headtool":
                continue
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{target}.{a.name}"
                found.append((sub if sub in known else target, node.lineno))
    return found


def import_graph(root: Path) -> tuple[dict[str, list[tuple[str, int]]], dict[str, Path]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph = {m: imports_of(p, m, p.name == "__init__.py", known) for m, p in files.items()}
    return graph, files


def layer_violations(root: Path) -> list[str]:
    graph, files = import_graph(root)
    problems = []
    for module, deps in graph.items():
        own = layer_of(module)
        if own is None:
            problems.append(f"{module}: belongs to no layer (add it to LAYERS)")
            continue
        for dep, line in deps:
            theirs = layer_of(dep)
            if theirs is not None and theirs > own:
                problems.append(f"{files[module].name}:{line}: {module} imports {dep}, a higher layer")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-imports."""
    graph, _ = import_graph(root)
    edges = {m: sorted({d for d, _ in deps if d in graph and d != m}) for m, deps in graph.items()}
    # a package's __init__ runs before its modules: `pkg.mod` importing `pkg` is no cycle unless
    # `pkg` itself imports `pkg.mod` back, which the graph shows as an edge both ways
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_every_import_goes_down_the_layers():
    assert layer_violations(SRC) == []


def test_no_import_cycles():
    assert cycles(SRC) == []


def test_the_modeling_file_imports_nothing_of_headtool():
    """It is copied into output folders and runs where headtool is not installed."""
    path = SRC / "templates" / "modeling_headtool.py"
    assert imports_of(path, "headtool.templates.modeling_headtool", False, set()) == []


def test_the_modeling_file_names_what_exists():
    """Its comments name headtool modules and adapter fields, and its keys are the ones headtool
    writes: a rename in the package must show up here (it once named `headtool.resize`)."""
    import importlib.util
    import re

    from headtool.arch import LAYOUT_KEY, RESIZE_QUANTITIES, RESIZE_SPEC_KEY, Adapter
    from headtool.templates import modeling_headtool as tpl

    text = (SRC / "templates" / "modeling_headtool.py").read_text()
    modules = set(re.findall(r"\bheadtool(?:\.[a-z_]+)+", text))
    assert modules, "the file names no headtool module (the check would be vacuous)"
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []
    fields = set(re.findall(r"\bAdapter\.(\w+)", text))
    assert fields and [f for f in sorted(fields) if f not in Adapter.__dataclass_fields__] == []
    assert (tpl.LAYOUT_KEY, tpl.RESIZE_SPEC_KEY) == (LAYOUT_KEY, RESIZE_SPEC_KEY)
    for q in RESIZE_QUANTITIES:
        tpl.quantity(q, 4, 2, 8)  # every quantity an adapter may name is one the file computes
    assert "http" not in text  # no placeholder links in a file copied into every output


def test_command_line_start_up_imports_no_torch():
    """`headtool --help` stays fast: the CLI modules import torch only when a command runs."""
    import subprocess
    import sys

    code = "import sys, headtool.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.fixture()
def fake_tree(tmp_path: Path) -> Path:
    root = tmp_path / "headtool"
    for pkg in ("arch", "model", "measure"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "arch" / "base.py").write_text("def f():\n    from ..model.loading import load\n")
    (root / "model" / "loading.py").write_text("from . import resize\n")
    (root / "model" / "resize.py").write_text("def g():\n    from .loading import load\n")
    (root / "measure" / "gates.py").write_text("from ..model import loading\nfrom ..arch.base import f\n")
    (root / "stray.py").write_text("")
    return root


def test_the_checker_finds_upward_imports_cycles_and_strays(fake_tree: Path):
    """The checks above would fail on a tree that breaks the rules (they are not vacuous)."""
    problems = layer_violations(fake_tree)
    assert any("headtool.arch.base imports headtool.model.loading" in p for p in problems), problems
    assert any("headtool.stray: belongs to no layer" in p for p in problems), problems
    assert not any("measure" in p for p in problems), problems  # downward imports are fine
    assert cycles(fake_tree) == [["headtool.model.loading", "headtool.model.resize"]]
