"""The package's import graph (read from the source with ast, every import statement, function
-level ones included): no import cycle, and every import points down the layers of
:data:`LAYERS` (a module imports its own sub-package or a lower layer, never a higher one nor a
sibling sub-package of the same layer). docs/architecture.md draws the layers."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "vllm_snapshot"

#: Each module's layer: the longest matching prefix wins. Lower numbers are further down; a
#: module may import its own group (same prefix entry) or any lower layer.
LAYERS = {
    "vllm_snapshot": 0,  # the package face (__version__)
    "vllm_snapshot.errors": 0, "vllm_snapshot.paths": 0, "vllm_snapshot.units": 0,
    "vllm_snapshot.suggest": 0,
    "vllm_snapshot.engine": 1,  # leaves shared by both sides of the engine channel (protocol, args, mounts, net, prep)
    "vllm_snapshot.host": 2, "vllm_snapshot.dev": 2,
    "vllm_snapshot.store": 3,
    "vllm_snapshot.checkpoint": 4, "vllm_snapshot.fleet": 4,
    "vllm_snapshot.supervise": 5,
    "vllm_snapshot.report": 6,  # results and progress: what the operations hand the command line
    "vllm_snapshot.effects": 7,
    "vllm_snapshot.ops": 8,
    "vllm_snapshot.dev.bench": 8,  # the benchmarks' helpers: drive the product from above the seam; only cli/demo imports them
    "vllm_snapshot.dev.fakegpu": 8,  # the GPU checks of this host's tools, for the fake driver (tests, the device check's dry run)
    "vllm_snapshot.dev.gpu_engine": 10,  # a program run as a process of its own (the device check's engine root); nothing imports it
    "vllm_snapshot.cli": 9, "vllm_snapshot.__main__": 10,
    "vllm_snapshot.entrypoints": 10,  # programs run as processes of their own (the engine root); nothing imports them
}


def layer(module: str) -> tuple[str, int]:
    """(the LAYERS prefix that places ``module``, its layer). Raises KeyError for a module no
    prefix places (a new top-level module must be given its layer here)."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None or (best == "vllm_snapshot" and module != "vllm_snapshot"):
        raise KeyError(f"{module} has no layer in tests/test_layering.py LAYERS")
    return best, LAYERS[best]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not point down: ``"A -> B (layer a -> b)"``, sorted."""
    out = []
    for m, deps in graph.items():
        gm, lm = layer(m)
        for d in deps:
            gd, ld = layer(d)
            if gd == gm or ld < lm or ld == lm == 0:  # the base modules may use each other
                continue
            out.append(f"{m} -> {d} (layer {lm} -> {ld})")
    return sorted(out)


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
    served = g["vllm_snapshot.cli.commands.serving"]
    assert "vllm_snapshot.ops.restore" in served or "vllm_snapshot.ops" in served
    assert "vllm_snapshot.cli.commands.serving" in g["vllm_snapshot.cli.app"]
    assert "vllm_snapshot.errors" in g["vllm_snapshot.ops.create"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds
    # the layer rule finds an upward import and a sideways one (two sub-packages of one layer)
    assert upward({"vllm_snapshot.host.procs": {"vllm_snapshot.ops.create"}, "vllm_snapshot.ops.create": set()}) == [
        "vllm_snapshot.host.procs -> vllm_snapshot.ops.create (layer 2 -> 8)"]
    assert upward({"vllm_snapshot.checkpoint.criu": {"vllm_snapshot.fleet.oci"}, "vllm_snapshot.fleet.oci": set()}) == [
        "vllm_snapshot.checkpoint.criu -> vllm_snapshot.fleet.oci (layer 4 -> 4)"]


def test_every_module_has_a_layer():
    for m in import_graph():
        layer(m)  # KeyError names the module


def test_imports_point_down_the_layers():
    assert upward(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


#: The longest a module of the package may be (lines): past it a module holds more than one job
#: (archive.py grew to 675 lines with the pull's hashing, protocols.py to 622 with the handles;
#: both were split by job). A split, not a higher bound, is the fix.
MAX_MODULE_LINES = 600


def test_no_module_of_the_package_is_over_600_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by job: {long}"
