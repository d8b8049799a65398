"""Commands the tool tells an operator to paste quote their paths (a new-user trial pasted
`rm -r /var/tmp/trial8/my snaps/tiny copy` from an inspect hint: that removes /var/tmp/trial8/my,
./snaps/tiny and ./copy). Each hint below is made for a path with a space and parentheses, and
its commands must split (as a shell splits them) back into the intended words; and no
interpolation inside a backticked command of the package's source goes unquoted."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from vllm_snapshot.errors import CorruptSnapshotError, EnvironmentProblem, UsageError, q
from vllm_snapshot.store import layout

from helpers import write_snapshot_dir

ODD = "my snaps (v2)"


def commands(text: str) -> list[list[str]]:
    """The backticked commands of ``text``, each split as a shell splits it."""
    return [shlex.split(c) for c in re.findall(r"`([^`]*)`", text)]


def test_q_leaves_an_ordinary_path_as_it_is_and_makes_any_other_one_word():
    assert q(Path("/var/lib/vllm-snapshot/tiny-1.a_b@c")) == "/var/lib/vllm-snapshot/tiny-1.a_b@c"
    for odd in ("/a/my snaps/tiny copy", "/m/My Model (v2)", "it's", "a;rm -rf /", "$(x)", ""):
        assert shlex.split(f"rm -r {q(odd)}") == ["rm", "-r", odd]


def test_inspect_of_a_snapshot_without_manifest_hints_an_rm_that_removes_it_only(tmp_path, monkeypatch, capsys):
    from vllm_snapshot.cli import app as cli

    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    snap = tmp_path / ODD / "tiny copy"
    (snap / "images").mkdir(mode=0o700, parents=True)
    assert cli.main(["inspect", str(snap), "--json"]) == 5
    hint = json.loads(capsys.readouterr().out)["error"]["hint"]
    assert ["rm", "-r", str(snap)] in commands(hint), hint


def test_the_hint_of_a_model_the_engine_user_cannot_read_is_a_setfacl_that_parses():
    from vllm_snapshot.host.privilege import User
    from vllm_snapshot.ops.create import check_access

    model = Path("/var/tmp/trial8/models/My Model (v2)")
    user = User(name="vllm-snapshot", uid=990, gid=990, groups=(990,), home="/var/lib/vllm-snapshot-engine")
    with pytest.raises(UsageError) as ei:
        check_access(user, model, {"model": [f"{model}: permission denied"]})
    assert commands(ei.value.hint)[0] == ["setfacl", "-R", "-m", "u:vllm-snapshot:rX", str(model)]


def test_delete_of_a_mounted_snapshot_hints_an_umount_of_the_mount_points(tmp_path, monkeypatch):
    from vllm_snapshot.store import store

    snap = tmp_path / ODD / "tiny copy"
    write_snapshot_dir(snap)
    (snap / "images").mkdir(mode=0o700)
    inner = snap / "images" / "a b"
    # /proc/self/mountinfo writes a space as \040
    esc = lambda p: str(p).replace(" ", "\\040")  # noqa: E731
    monkeypatch.setattr(store, "_mountinfo", lambda: (
        f"36 35 98:0 / {esc(snap)} rw - tmpfs tmpfs rw\n37 36 98:1 / {esc(inner)} rw - tmpfs tmpfs rw\n"))
    with pytest.raises(EnvironmentProblem) as ei:
        store.delete(snap)
    assert commands(ei.value.hint) == [["umount", str(inner), str(snap)]], ei.value.hint
    assert snap.is_dir()


def test_the_trust_checks_hint_chmod_and_chown_commands_that_parse(tmp_path):
    top = tmp_path / ODD
    top.mkdir(mode=0o700)
    snap = top / "tiny copy"
    write_snapshot_dir(snap)
    os.chmod(snap, 0o755)  # the snapshot itself readable by others
    with pytest.raises(CorruptSnapshotError) as ei:
        layout.check_dir_safety(snap)
    assert shlex.split(ei.value.hint) == ["chmod", "-R", "go-rwx", str(snap)]
    os.chmod(snap, 0o700)
    (snap / "manifest.json").chmod(0o644)  # a file in it readable by others
    with pytest.raises(CorruptSnapshotError) as ei:
        layout.check_file_modes(snap)
    assert shlex.split(ei.value.hint) == ["chmod", "-R", "go-rwx", str(snap)]
    (snap / "manifest.json").chmod(0o600)
    os.chmod(top, 0o777)  # the directory above it writable by others
    with pytest.raises(EnvironmentProblem) as ei:
        layout.check_parents(snap)
    assert shlex.split(ei.value.hint)[:3] == ["chmod", "0700", str(top)], ei.value.hint
    os.chmod(top, 0o700)
    os.chown(top, 65534, 65534)  # ... owned by another user
    try:
        with pytest.raises(EnvironmentProblem) as ei:
            layout.check_parents(snap)
        assert shlex.split(ei.value.hint)[:3] == ["chown", "root", str(top)], ei.value.hint
    finally:
        os.chown(top, 0, 0)


#: Interpolations a backticked command of the package may hold unquoted: (module, expression)
#: -> why it is one shell word as it is (a number, a fixed name, a command line already joined).
UNQUOTED_OK = {
    ("cli/app.py", "cmd_name"): "click's command path: fixed subcommand names",
    ("cli/common.py", "ctx.command.name"): "a subcommand's name",
    ("cli/common.py", "lister"): "a command built with q() of its root",
    ("cli/doctor.py", "name"): "a program name from doctor's fixed table",
    ("cli/doctor.py", "feat"): "a CRIU feature name from a fixed table",
    ("engine/args.py", "command"): "a subcommand's name",
    ("engine/args.py", "usage or command + ' MODEL [engine args]'"): "a usage line (words to read, not paste)",
    ("engine/args.py", "where"): "a subcommand's name",
    ("engine/args.py", "flag"): "an option name from a fixed table",
    ("store/argnames.py", "where"): "`vllm-snapshot COMMAND`: fixed words",
    ("host/ports.py", "port"): "a number",
    ("ops/switch.py", "port"): "a number",
    ("ops/fleet.py", "hx[:2]"): "hex digits of a digest",
    ("ops/fleet.py", "hx"): "hex digits of a digest",
    ("ops/fleet.py", "flags"): "fixed options",
    ("ops/fleet.py", "again"): "shlex.join-ed already",
    ("ops/fleet.py", "resume_command(req, name)"): "shlex.join-ed already",
}


PKG = Path(__file__).resolve().parent.parent / "vllm_snapshot"


def unquoted_in_backticks(pkg: Path = PKG) -> list[str]:
    """``"FILE:LINE: {EXPR}"`` for each interpolation of an f-string under ``pkg`` that sits
    inside a backticked span and is neither ``q(...)``/``shlex.quote(...)``/``shlex.join(...)``
    nor in :data:`UNQUOTED_OK`."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = str(path.relative_to(pkg))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.JoinedStr):
                continue
            ticks = 0
            for v in node.values:
                if isinstance(v, ast.Constant):
                    ticks += str(v.value).count("`")
                    continue
                if ticks % 2 == 0:
                    continue
                e = v.value
                quoted = isinstance(e, ast.Call) and ast.unparse(e.func) in ("q", "shlex.quote", "shlex.join")
                if not quoted and (rel, ast.unparse(e)) not in UNQUOTED_OK:
                    out.append(f"{rel}:{node.lineno}: {{{ast.unparse(e)}}}")
    return out


def test_every_path_in_a_backticked_command_of_the_package_is_quoted():
    assert unquoted_in_backticks() == [], "quote them with vllm_snapshot.errors.q (or list why not in UNQUOTED_OK)"


def test_the_source_scan_finds_an_unquoted_path(tmp_path):
    # the scan itself sees what it is meant to: a backticked rm of an unquoted path (on a line
    # of its own too), not a quoted one nor one outside backticks
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "x.py").write_text(
        'def f(p, n):\n    return (f"run `rm -r {p}` or `rm {q(p)}`; {p} is {n} (`umount "\n            f"{n}`)")\n')
    assert unquoted_in_backticks(tmp_path) == ["store/x.py:2: {p}", "store/x.py:2: {n}"]
