"""Names a person can guess (issue "Operator experience"): a mistyped snapshot name gets "did
you mean"; a model path or name selects its snapshot when there is one; a user other than root
is told where root's snapshots are instead of "no snapshots" / "does not exist"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from helpers import make_manifest, manifest_fields, write_snapshot_dir
from vllm_snapshot.cli import app as cli
from vllm_snapshot.cli import suggest
from vllm_snapshot.store import manifest


def _snap(root: Path, name: str, model: str) -> Path:
    fields = manifest_fields()
    m = make_manifest(model=fields["model"].model_copy(update={"requested": model, "path": model,
                                                                 "served_name": Path(model).name}))
    write_snapshot_dir(root / name, m)
    return root / name


def test_close_matches_prefer_the_names_that_start_with_the_word():
    names = ["trial-model-a711061d712f", "tiny", "demo-smollm2", "demo-tiny-llama"]
    assert suggest.close_matches("trial-model", names) == ["trial-model-a711061d712f"]
    assert suggest.close_matches("demo-smolm2", names) == ["demo-smollm2"]
    assert suggest.close_matches("zzz", names) == []
    assert suggest.did_you_mean("demo", names) == "did you mean demo-smollm2 or demo-tiny-llama?"


def test_a_mistyped_snapshot_name_gets_did_you_mean(tmp_path, capsys):
    root = tmp_path / "root"
    _snap(root, "trial-model-a711061d712f", "/models/other")
    code = cli.main(["--root", str(root), "inspect", "trial-modle-a711061d712f"])
    err = capsys.readouterr().err
    assert code == 2 and "snapshot 'trial-modle-a711061d712f' does not exist under" in err, err
    assert "did you mean trial-model-a711061d712f?" in err, err


def test_a_name_that_names_nothing_hints_the_list_of_the_root_in_use(tmp_path, capsys, monkeypatch):
    # a root set in the environment is the one plain `list` shows; one given as --root is not
    root = tmp_path / "my root"
    root.mkdir()
    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(root))
    assert cli.main(["inspect", "nosuch"]) == 2
    assert "hint: `vllm-snapshot list` shows the snapshots there" in capsys.readouterr().err
    monkeypatch.delenv("VLLM_SNAPSHOT_ROOT")
    assert cli.main(["--root", str(root), "inspect", "nosuch"]) == 2
    assert f"hint: `vllm-snapshot --root '{root}' list` shows the snapshots there" in capsys.readouterr().err


def test_a_model_path_or_name_selects_its_only_snapshot(tmp_path, capsys):
    root = tmp_path / "root"
    model = tmp_path / "models" / "trial-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    _snap(root, "trial-model-a711061d712f", str(model))
    _snap(root, "other-0123456789ab", "/models/other")
    for ref in (str(model), "trial-model"):
        code = cli.main(["--root", str(root), "inspect", ref, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert json.loads(out)["snapshot"].endswith("/trial-model-a711061d712f")
        assert f"{ref} is a model, not a snapshot: using its snapshot trial-model-a711061d712f" in err


def test_a_model_of_several_snapshots_lists_them(tmp_path, capsys):
    root = tmp_path / "root"
    _snap(root, "m-1", "/models/m")
    _snap(root, "m-2", "/models/m")
    code = cli.main(["--root", str(root), "inspect", "m"])
    err = capsys.readouterr().err
    assert code == 2 and "m is the model of 2 snapshots" in err and "m-1, m-2" in err, err


@pytest.fixture()
def other_user():
    """A throw-away user (removed afterwards) with a HOME of its own."""
    from helpers import throwaway_user

    with throwaway_user("vsnap-ux") as u:
        yield u


def test_another_user_is_told_where_roots_snapshots_are(other_user, monkeypatch):
    """As a user other than root (the default per-user root is empty): `list` does not say "no
    snapshots" and `inspect NAME` not "does not exist" while root's snapshot root exists."""
    if os.geteuid() != 0:
        pytest.fail("this test runs as root (it makes a user)")
    if not os.path.isdir("/var/lib/vllm-snapshot"):
        os.makedirs("/var/lib/vllm-snapshot", mode=0o700)  # what setup/the first create makes
    name, home = other_user
    # a copy of the package the user can read (a checkout under /root is root's only)
    shutil.copytree(ROOT / "vllm_snapshot", home / "src" / "vllm_snapshot", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(home / "src")], check=True)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(home / "src")}

    def run(*argv):
        return subprocess.run(["runuser", "-u", name, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                               sys.executable, "-m", "vllm_snapshot", *argv], capture_output=True, text=True,
                              cwd="/", timeout=60)

    p = run("list")
    assert p.returncode == 0, p.stderr
    assert "no snapshots" not in p.stdout and "root's snapshots are in /var/lib/vllm-snapshot" in p.stdout, p.stdout
    assert "sudo vllm-snapshot list" in p.stdout
    p = run("list", "--json")
    assert "/var/lib/vllm-snapshot" in json.loads(p.stdout)["elsewhere"]
    p = run("inspect", "demo-smollm2")
    assert p.returncode == 11, p.stderr
    assert "root's snapshots are in /var/lib/vllm-snapshot" in p.stderr and "sudo" in p.stderr, p.stderr
