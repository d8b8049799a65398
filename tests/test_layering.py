"""The package's import graph (read from the source with ast, every import statement, function
-level ones included): no import cycle, and no module below the operations (``ops``) imports
them -- only the command line (``cli``, ``demo``, ``__main__``) and ``ops`` itself do.
docs/architecture.md draws the layers."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "vllm_snapshot"
ABOVE_OPS = ("vllm_snapshot.cli", "vllm_snapshot.demo", "vllm_snapshot.__main__", "vllm_snapshot.ops")


def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}: ``from . import x`` names module ``x`` when
    ``x`` is one, else the package it comes from."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for a in node.names:
                    full = f"{base_name}.{a.name}"
                    targets.append(full if full in mods else base_name)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_imports():
    g = import_graph()
    assert "vllm_snapshot.ops.restore" in g["vllm_snapshot.cli"] or "vllm_snapshot.ops" in g["vllm_snapshot.cli"]
    assert "vllm_snapshot.errors" in g["vllm_snapshot.ops.create"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_nothing_below_the_operations_imports_them():
    g = import_graph()
    bad = {m: sorted(t for t in deps if t.startswith("vllm_snapshot.ops"))
           for m, deps in g.items() if not m.startswith(ABOVE_OPS)}
    assert {m: d for m, d in bad.items() if d} == {}
