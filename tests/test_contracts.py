"""One owner per contract, read from the source with ast: the snapshot's member names are
spelled only in store/layout.py, and the other contracts' owners are the only modules that
state them (docs/architecture.md lists the contracts and their owners)."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_snapshot.store import layout

PKG = Path(__file__).resolve().parent.parent / "vllm_snapshot"


def _trees() -> dict[str, ast.AST]:
    """{path relative to the package: its parsed source} of every module of the package."""
    return {str(p.relative_to(PKG)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name a member)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


#: Every name layout gives to something in a snapshot directory (published or being made).
NAMES = layout.MEMBERS | {layout.RESTORE_LOG, layout.OWNER_PID, layout.MANIFEST_TMP}
#: The names no other string of the package can mean (file names: ``manifest.json``,
#: ``criu-dump.log``, ...): spelled anywhere else, they are a second owner. ``images`` and
#: ``files`` are also manifest field names, so for the plain words only a path join
#: (``x / "images"``) counts.
UNAMBIGUOUS = {n for n in NAMES if "." in n or "-" in n}


def member_spellings(trees: dict[str, ast.AST]) -> list[str]:
    """Every place outside store/layout.py that spells a member name: ``"FILE:LINE: 'name'"``."""
    out = []
    for rel, tree in trees.items():
        if rel == "store/layout.py":
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value in UNAMBIGUOUS:
                    out.append(f"{rel}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and node.right.value in NAMES:
                out.append(f"{rel}:{node.lineno}: / {node.right.value!r}")
    return sorted(out)


def test_the_finder_finds_a_second_spelling():
    trees = {"store/manifest.py": ast.parse('"""manifest.json is prose here"""\nNAME = "manifest.json"\n'),
             "effects/tools.py": ast.parse('p = snapshot / "images"\nrow = {"images": 1}\n'),
             "store/layout.py": ast.parse('MANIFEST = "manifest.json"\n')}
    assert member_spellings(trees) == ["effects/tools.py:1: / 'images'", "store/manifest.py:2: 'manifest.json'"]


def test_only_layout_spells_a_member_name():
    assert member_spellings(_trees()) == []


def test_one_judgement_of_is_this_a_snapshot(tmp_path):
    # open_trusted, manifest.read and the removal check (not_a_snapshot) give the same answer,
    # layout.judge's, for what is no snapshot at all or an incomplete one
    import os

    import pytest

    from vllm_snapshot.errors import CorruptSnapshotError, UsageError
    from vllm_snapshot.store import manifest

    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir(mode=0o700)
    (tmp_path / "half" / layout.IMAGES).mkdir(parents=True)
    os.chmod(tmp_path / "half", 0o700)
    cases = {"missing": UsageError, "afile": UsageError, "empty": UsageError, "half": CorruptSnapshotError}
    for name, kind in cases.items():
        d = tmp_path / name
        verdict = layout.judge(d)
        assert type(verdict) is kind, name
        for reader in (layout.open_trusted, manifest.read):
            with pytest.raises(kind) as ei:
                reader(d)
            assert ei.value.message == verdict.message, (name, reader)
        assert layout.not_a_snapshot(d) == verdict.message


def callers(trees: dict[str, ast.AST], name: str) -> list[str]:
    """Modules (relative paths) that call a function or method named ``name``."""
    out = set()
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                    out.add(rel)
    return sorted(out)


def test_only_staging_lists_the_staging_parents():
    # where restore stages (/dev/shm, paths.staging_dir(), beside the snapshot) is decided by
    # staging.staging_parent and listed by staging.staging_parents; cleanup, reclaim and doctor
    # ask for that list instead of writing it out again
    trees = _trees()
    assert callers(trees, "staging_dir") == ["store/staging.py"]
    assert set(callers(trees, "stale_staging") + callers(trees, "own_staging")) <= set(callers(trees, "staging_parents"))


#: The engine-argument rules and tables engine/args.py owns: no other module defines them.
ARG_RULES = {"arg_value", "has_flag", "last_value", "flag_name", "check_engine_args", "unrestorable",
             "argparse_reason", "RESTORE_OWNED_ARGS", "FRONTEND_OPTIONS", "FRONTEND_REFUSED", "EARLY_REFUSED",
             "PARALLEL_SIZES", "OPTIONS", "Option", "walk", "split", "values", "refuse_engine_options",
             "without_secrets", "secrets", "pop_option", "redact_args", "is_secret_name", "SECRET_FLAGS",
             "SECRET_DESTS", "REFUSED", "REFUSED_AT_RESTORE", "APP_DESTS", "normalize_args",
             "normalize_namespace", "memoizable", "ARGS_IGNORED", "config_refusal", "PARALLEL_FLAGS"}

#: What the finder flags that does not take engine arguments apart, and what it splits instead.
NOT_ENGINE_ARGS = {
    "checkpoint/criu/find.py:config_libdirs: splits at '='": "CRIU's configuration files (libdir=)",
    "checkpoint/cuda_checkpoint.py:parse_device_map: splits at '='": "a --device-map value OLD=NEW",
    "checkpoint/mountpolicy.py:_devname: splits at '='": "a block device's uevent file (DEVNAME=)",
    "cli/app.py:_global_options_first: splits at '='": "vllm-snapshot's own options before the command",
    "cli/app.py:_subcommand: startswith('--root=')": "vllm-snapshot's own --root",
}


def _by_function(tree: ast.AST):
    """``(name of the innermost enclosing function or "<module>", node)`` for every node."""
    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            yield name, child
            yield from visit(child, name)
    yield from visit(tree, "<module>")


def arg_rule_owners(trees: dict[str, ast.AST]) -> list[str]:
    """Every place outside engine/args.py that defines an :data:`ARG_RULES` name
    (``"FILE:LINE: def NAME"``, ``"FILE:LINE: NAME ="``), scans args for a flag by hand
    (``a.startswith("--flag=")``: ``"FILE:FUNCTION: startswith('--flag=')"``) or takes a token
    apart at ``=`` (``.split("=")``, ``.partition("=")``: the step every walker of
    ``--flag=value`` needs, whatever else it is written with, ``flag_name`` included:
    ``"FILE:FUNCTION: splits at '='"``)."""
    import re

    out = set()
    for rel, tree in trees.items():
        if rel == "engine/args.py":
            continue
        for fn, node in _by_function(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ARG_RULES:
                out.add(f"{rel}:{node.lineno}: def {node.name}")
            elif isinstance(node, ast.Assign):
                out |= {f"{rel}:{node.lineno}: {t.id} =" for t in node.targets
                        if isinstance(t, ast.Name) and t.id in ARG_RULES}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                    and isinstance(node.args[0], ast.Constant):
                arg = str(node.args[0].value)
                if node.func.attr == "startswith" and re.fullmatch(r"--[a-z][a-z0-9-]*=", arg):
                    out.add(f"{rel}:{fn}: startswith({arg!r})")
                elif node.func.attr in ("split", "rsplit", "partition", "rpartition") and arg == "=":
                    out.add(f"{rel}:{fn}: splits at '='")
    return sorted(out)


def test_the_finder_finds_a_second_arg_rule():
    trees = {"ops/create.py": ast.parse('def arg_value(a, f): pass\nsized = any(a.startswith("--kv-cache=") for a in x)\n'
                                        'def walk(args):\n    for a in args:\n        name, _, v = a.partition("=")\n'),
             "cli/app.py": ast.parse('def lift(args):\n    return [a.split("=", 1)[1] for a in args if a.startswith("--port=")]\n'),
             "engine/args.py": ast.parse("def arg_value(a, f): pass\n")}
    assert arg_rule_owners(trees) == ["cli/app.py:lift: splits at '='", "cli/app.py:lift: startswith('--port=')",
                                      "ops/create.py:1: def arg_value", "ops/create.py:3: def walk",
                                      "ops/create.py:<module>: startswith('--kv-cache=')",
                                      "ops/create.py:walk: splits at '='"]


def test_engine_argument_rules_live_in_engine_args_only():
    """Only engine/args.py holds the engine-argument rules and walks ``vllm serve`` argv (one
    table, one walker); what :data:`NOT_ENGINE_ARGS` lists splits something else. cli/app.py is
    searched like every other module."""
    found = arg_rule_owners(_trees())
    assert [f for f in found if f not in NOT_ENGINE_ARGS] == [], \
        "a new engine-argument rule or walker outside engine/args.py: use engine/args.py's (or list what it splits)"
    assert sorted(NOT_ENGINE_ARGS) == found, "a listed non-engine split is gone: remove it from the list"


def private_imports(trees: dict[str, ast.AST]) -> list[str]:
    """Every ``from M import _name`` of a package module (a private helper used across modules:
    it wants a public home): ``"FILE:LINE: M._name"``."""
    out = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__" and (node.level or (node.module or "")
                                                                                     .startswith("vllm_snapshot")):
                out += [f"{rel}:{node.lineno}: {node.module or '.'}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(out)


def test_the_finder_finds_a_private_import():
    trees = {"ops/serve.py": ast.parse("from .manage import _first_lines\nfrom vllm_snapshot import __version__\n")}
    assert private_imports(trees) == ["ops/serve.py:1: manage._first_lines"]


def test_no_module_imports_another_modules_private_name():
    # serve once took manage's _first_lines and demo tools' _http_json: shared helpers are public
    assert private_imports(_trees()) == []
