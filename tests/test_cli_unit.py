"""CLI without engines: fast --help (no torch/vLLM import), inspect, exit codes, error shape."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_canary, make_manifest, write_snapshot_dir

from vllm_snapshot.cli import app as cli
from vllm_snapshot import errors
from vllm_snapshot.store import layout, manifest

ROOT = Path(__file__).resolve().parent.parent


def _py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


HEAVY = "[m for m in ('torch', 'vllm', 'pycriu', 'transformers') if m in sys.modules]"


def test_help_imports_neither_torch_nor_vllm():
    p = _py("import sys, io, contextlib\n"
            "from vllm_snapshot.cli.app import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    rc = main(['--help'])\n"
            f"print(rc, {HEAVY}, 'inspect' in buf.getvalue() and 'restore' in buf.getvalue())")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "0 [] True"


def test_python_dash_m_help_works():
    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    for cmd in ("create", "inspect", "verify", "restore", "demo"):
        assert cmd in p.stdout


def test_subcommand_help_is_light():
    # one interpreter for all four: each help must exit 0 and none may pull in torch/vLLM
    p = _py("import sys, io, contextlib\nfrom vllm_snapshot.cli.app import main\n"
            "for cmd in ('create', 'restore', 'inspect', 'verify'):\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        rc = main([cmd, '--help'])\n"
            f"    print('RESULT', cmd, rc, 'Usage' in buf.getvalue(), {HEAVY})")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines() == [
        f"RESULT {c} 0 True []" for c in ("create", "restore", "inspect", "verify")]


def test_inspect_of_a_missing_dir_exits_2_with_one_error_line_and_a_hint(tmp_path):
    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "inspect", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint:") and f"--root {tmp_path} list" in lines[1], p.stderr
    assert lines[0].startswith("error [usage]:") and "nope" in lines[0] and "does not exist" in lines[0]
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_a_dir_that_is_not_a_snapshot_exits_2_and_an_incomplete_one_5(tmp_path, cmd):
    # the same rule for every command: a wrong argument (a file, an empty or foreign directory)
    # is a usage error; a snapshot directory (images/) without its manifest is damaged
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "half" / "images").mkdir(parents=True)
    os.chmod(tmp_path / "half", 0o700)

    def run(d):
        return subprocess.run([sys.executable, "-m", "vllm_snapshot", cmd, str(tmp_path / d)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    for d, code, words in (("empty", 2, "is not a snapshot"), ("afile", 2, "is not a directory"),
                           ("half", 5, "incomplete snapshot")):
        p = run(d)
        assert p.returncode == code, (d, p.stderr)
        assert words in p.stderr, (d, p.stderr)


def test_restore_of_a_missing_snapshot_leaves_no_lock_file(tmp_path):
    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "restore", str(tmp_path / "nope"), "--port", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode in (2, 11), p.stderr  # 11 when not root
    assert list(tmp_path.iterdir()) == []


def test_inspect_json_of_a_valid_snapshot(tmp_path, capsys):
    m = write_snapshot_dir(tmp_path / "snap")
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "snap"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema_version"] == 1
    assert doc["snapshot"] == str((tmp_path / "snap").absolute())
    assert doc["manifest"]["schema_version"] == manifest.SCHEMA_VERSION
    assert doc["manifest"]["digest"] == m.digest
    assert doc["manifest"]["oracle"]["text"] == m.oracle.text
    # what inspect prints is a manifest that parses and verifies again
    assert manifest.parse(json.dumps(doc["manifest"])) == m


def test_inspect_table_of_a_valid_snapshot(tmp_path, capsys):
    m = write_snapshot_dir(tmp_path / "snap")
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "snap"))
    assert code == 0, err
    assert m.criu.version in out and m.model.served_name in out and repr(m.oracle.prompt) in out
    # a snapshot made before canary records: its canary asks the oracle's prompt, and says so
    assert re.search(r"canary +│ 'Once upon a time' → token 11 ',' \(the oracle's\)", out), out
    write_snapshot_dir(tmp_path / "new", make_manifest(canary=make_canary()))
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "new"))
    assert code == 0 and re.search(r"canary +│ 'Hi' → token 17 ' there' +│", out), out


def test_inspect_of_a_hand_edited_manifest_exits_5(tmp_path, capsys):
    write_snapshot_dir(tmp_path / "snap")
    path = tmp_path / "snap" / layout.MANIFEST
    doc = json.loads(path.read_text())
    doc["oracle"]["token_id"] += 1
    path.write_text(json.dumps(doc))
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "snap"))
    assert code == 5
    assert "$.digest" in err and "hint:" in err


def _damaged(tmp_path: Path, text: str) -> Path:
    """A snapshot dir with one image whose manifest.json is ``text``."""
    snap = tmp_path / "snap"
    write_snapshot_dir(snap)
    (snap / layout.IMAGES).mkdir(mode=0o700)
    (snap / layout.IMAGES / "pages-1.img").write_bytes(b"p" * 4096)
    (snap / layout.MANIFEST).write_text(text)
    return snap


def test_inspect_of_a_truncated_manifest_says_so_shows_what_is_left_and_exits_5(tmp_path, capsys):
    # a trial: inspect of a damaged snapshot showed one JSON error and nothing of the directory
    whole = (write_snapshot_dir(tmp_path / "whole") and (tmp_path / "whole" / layout.MANIFEST).read_text())
    cut = whole.rindex(",\n", 0, 300) + 2  # ~300 bytes, between two members (not inside a string)
    snap = _damaged(tmp_path, whole[:cut])
    code, out, err = _run_main(capsys, "inspect", str(snap))
    assert code == 5, err
    assert f"{snap / layout.MANIFEST} is not valid JSON" in err and "line " in err and "column " in err, err
    assert f"the file ends there, after {cut} bytes: it was cut short (truncated)" in err, err
    assert "`vllm-snapshot verify` and `restore` refuse it the same way" in err and "rm -r" in err, err
    assert out.startswith(f"snapshot {snap}: its manifest is damaged; what can still be read:"), out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "4.0 KiB (1 file)" in lines["images/"] and f"{cut} B" in lines["manifest.json"], out


def test_inspect_json_of_a_manifest_of_the_wrong_schema_names_the_field_and_lists_the_members(tmp_path, capsys):
    doc = json.loads((write_snapshot_dir(tmp_path / "whole") and (tmp_path / "whole" / layout.MANIFEST)).read_text())
    del doc["oracle"]
    snap = _damaged(tmp_path, json.dumps(doc))
    (snap / "stray.txt").write_text("x")
    code, out, err = _run_main(capsys, "inspect", str(snap), "--json")
    assert code == 5
    e = json.loads(out)["error"]
    assert e["code"] == "corrupt-snapshot" and "$.oracle: Field required" in e["message"], e
    left = e["details"]["remains"]
    assert {m["name"]: (m["kind"], m["files"], m["bytes"]) for m in left["members"]} == {
        "images": ("dir", 1, 4096), "manifest.json": ("file", 1, len(json.dumps(doc))), "stray.txt": ("file", 1, 1)}
    assert left["unexpected"] == ["stray.txt"] and e["details"]["manifest"] == str(snap / layout.MANIFEST)


def test_delete_of_a_snapshot_whose_manifest_is_cut_short_points_to_inspect_and_rm(tmp_path, capsys):
    # before: "check the path; remove other directories with rm" -- as if it were not ours
    from vllm_snapshot.store import store

    snap = _damaged(tmp_path, '{"schema_version": 1, "criu": {')
    with pytest.raises(errors.CorruptSnapshotError) as e:
        store.delete(snap)
    assert f"`vllm-snapshot inspect {snap}` shows what is left" in e.value.hint and f"rm -r {snap}" in e.value.hint
    assert (snap / layout.IMAGES / "pages-1.img").exists()  # nothing deleted
    other = tmp_path / "webapp"
    other.mkdir()
    (other / layout.MANIFEST).write_text("{")
    with pytest.raises(errors.CorruptSnapshotError) as e:
        store.delete(other)
    assert e.value.hint == "check the path; remove other directories with rm, not vllm-snapshot"
    # a snapshot with a file put into it by hand: move it out (restore/verify and delete say so)
    whole = tmp_path / "whole"
    write_snapshot_dir(whole)
    (whole / layout.IMAGES).mkdir(mode=0o700)
    (whole / "notes.txt").write_text("x")
    os.chmod(whole / "notes.txt", 0o600)
    with pytest.raises(errors.CorruptSnapshotError) as e:
        store.delete(whole)
    assert e.value.hint.startswith("if it is a snapshot with files put into it by hand, move them out"), e.value.hint
    with pytest.raises(errors.CorruptSnapshotError) as e:
        layout.open_trusted(whole)
    assert e.value.hint.startswith("move notes.txt out of the snapshot directory"), e.value.hint


def test_inspect_json_error_is_json(tmp_path, capsys):
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "nope"), "--json")
    assert code == 2
    doc = json.loads(out)
    assert doc["schema_version"] == 1
    assert doc["error"]["code"] == "usage" and doc["error"]["exit_code"] == 2


def test_inspect_does_not_import_heavy_modules(tmp_path):
    write_snapshot_dir(tmp_path / "snap", make_manifest())
    p = _py("import sys, io, contextlib\nfrom vllm_snapshot.cli.app import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['inspect', sys.argv[1], '--json'])\n"
            f"print(rc, {HEAVY})", str(tmp_path / "snap"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "0 []"


def test_restore_with_a_bogus_verify_model_exits_2(tmp_path, capsys):
    code, out, err = _run_main(capsys, "restore", str(tmp_path / "snap"), "--verify-model", "bogus")
    assert code == 2
    assert "--verify-model must be quick or full" in err
    assert "Traceback" not in err


def test_create_with_a_bad_compression_exits_2(tmp_path, capsys, monkeypatch):
    # parsing --compress happens before anything touches the system
    code, out, err = _run_main(capsys, "create", str(tmp_path), "--snapshot-dir", str(tmp_path / "s"),
                               "--compress", "gzip")
    assert code == 2
    assert "--compress 'gzip'" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv", [
    ["frobnicate"],
    ["inspect"],  # missing argument
    ["restore", "/nonexistent", "--port", "99999"],  # out of range
    ["inspect", "/x", "--no-such-option"],
])
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = _run_main(capsys, *argv)
    assert code == 2, err
    assert "internal" not in err


def test_no_arguments_shows_help_without_an_internal_error(capsys):
    # a trial: "error [usage]: usage: vllm-snapshot ..." -- the help, framed as an error line
    code, out, err = _run_main(capsys)
    assert code == 2 and out == ""  # click's no_args_is_help: the help on stderr, exit 2
    assert err.startswith("Usage: vllm-snapshot [OPTIONS] COMMAND [ARGS]...") and "error [" not in err, err[:200]
    assert "inspect" in err and "restore" in err
    code, _, err = _run_main(capsys, "--debug")  # global options but no command: a usage error naming it
    assert code == 2 and "error [usage]: missing command" in err and "--help` lists the commands" in err


def test_internal_errors_are_one_line_without_debug(tmp_path, capsys, monkeypatch):
    from vllm_snapshot.store import manifest as mmod

    def boom(_):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(mmod, "read", boom)
    code, out, err = _run_main(capsys, "inspect", str(tmp_path))
    assert code == 1
    assert "error [internal]: RuntimeError: kaboom" in err and "Traceback" not in err
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "inspect", str(tmp_path)])


def test_error_classes_have_distinct_codes_and_exit_codes():
    codes = [e.code for e in errors.ALL_ERRORS]
    exits = [e.exit_code for e in errors.ALL_ERRORS]
    assert len(set(codes)) == len(codes) and len(set(exits)) == len(exits)
    declared = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.SnapshotError)}
    assert declared == set(errors.ALL_ERRORS)  # a new error class must be in the table
    assert errors.SnapshotError.exit_code == 1
    assert 0 not in exits and all(0 < x < 126 or (x == 130 and e is errors.Interrupted) for x, e in zip(exits, errors.ALL_ERRORS))
    e = errors.BusyError("port 80 is not free", hint="pick another", details={"port": 80})
    assert e.to_json() == {"code": "busy", "exit_code": 9, "message": "port 80 is not free",
                           "hint": "pick another", "details": {"port": 80}}


def test_error_table_in_errors_docstring_matches_the_classes():
    doc = errors.__doc__
    for e in errors.ALL_ERRORS[1:]:
        assert f"{e.exit_code:<4} ``{e.code}``" in doc, e.__name__


def test_console_script_entry_point_is_main():
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["vllm-snapshot"] == "vllm_snapshot.cli.app:main"
    p = subprocess.run([sys.executable, "-m", "vllm_snapshot", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "restore" in p.stdout


def test_inspect_says_who_the_engine_runs_as(tmp_path, capsys):
    write_snapshot_dir(tmp_path / "snap")
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "snap"))
    assert code == 0 and "vllm-snapshot (uid 990, gid 990), no capabilities" in out
    legacy = make_manifest(engine=manifest.EngineInfo(kind="cpu", sleep_level=0, engine_args=(), env_hashes={},
                                                      full_state_captured=True))
    write_snapshot_dir(tmp_path / "old", legacy)
    code, out, err = _run_main(capsys, "inspect", str(tmp_path / "old"))
    assert code == 0 and "root with every capability" in " ".join(out.split())


def test_demo_report_compares_with_the_faster_cold_start(capsys):
    """The demo's ratio is against the faster cold start a user could choose (issue 32)."""
    from vllm_snapshot.cli import render
    from vllm_snapshot.report.results import DemoReport

    r = DemoReport("/s", "http://127.0.0.1:1", "hi", {}, {}, 1.0, 30.0, 10, 10,
                   {"compiled": 38.0, "eager": 30.0})
    j = r.to_json()
    assert j["cold_starts_s"] == {"compiled": 38.0, "eager": 30.0} and j["speedup"] == 30.0
    render.show(r)
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "compiled 38.00 s, eager 30.00 s" in out and "30.0× faster than the faster cold start" in out


@pytest.mark.parametrize("argv,said", [
    (["restore", "snap", "--verify-model", "fast", "--log-file", "x.log"],
     ["--verify-model must be quick or full, not 'fast'", "--log-file applies to --detach"]),
    (["serve", "/m", "--no-build", "--rebuild", "--weights", "mmap", "--compress", "gzip", "--plain-http"],
     ["--no-build and --rebuild contradict", "--weights 'mmap'", "--compress 'gzip'", "--plain-http, --sign-key"]),
    # judged by their words before the validation starts (it printed "validating ...: FAILED" first)
    (["restore", "snap", "--allow-mismatch", "kernel", "--", "--max-num-seqs", "4"],
     ["--allow-mismatch cannot override kernel: only cpu_model and machine_id may differ on purpose",
      "--max-num-seqs is not an option restore can apply"]),
])
def test_several_bad_options_are_all_said_in_one_run(tmp_path, capsys, argv, said):
    # a trial: each rerun met the next bad option
    code, out, err = _run_main(capsys, "--root", str(tmp_path / "root"), *argv)
    assert code == 2, err
    assert err.startswith(f"error [usage]: {said[0]}"), err
    assert f"and {len(said) - 1} more problem" in err and all(s in err for s in said), err
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
