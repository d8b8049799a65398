"""model_digest.stat_pins / compare_pinned / recheck: the digest must describe the bytes the
engine read (issue 29, S1).

The flow modelled: digest (create) or check (restore) a model directory, the engine reads it
from ``since_ns`` on, then the re-check. A file changed in between is re-hashed; a content
difference refuses; an equal content refuses when its last change may have fallen while the
engine read (changed and put back), and is accepted when it came before.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from vllm_snapshot.store import model_digest
from vllm_snapshot.errors import ModelChangedError

WEIGHTS = "model.safetensors"
HINT = "run create again"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / WEIGHTS).write_bytes(os.urandom(64 << 10))
    (d / "config.json").write_text('{"hidden_size": 32}')
    (d / "sub").mkdir()
    (d / "sub" / "tokenizer.json").write_text('{"vocab": {}}')
    return d


def _later_ns() -> int:
    """A reading start well after anything the test changed before it."""
    return time.time_ns() + 10 * model_digest.CTIME_SLACK_NS


def _changed(p: Path) -> bytes:
    """Flip one byte in place (same size, same inode); returns the original bytes."""
    old = p.read_bytes()
    data = bytearray(old)
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return old


def _refusal(root: Path, pinned, since_ns: int) -> ModelChangedError:
    with pytest.raises(ModelChangedError) as ei:
        model_digest.recheck(root, pinned, since_ns, during="while the engine loaded them", hint=HINT)
    e = ei.value
    assert e.exit_code == 4 and e.hint == HINT
    assert str(root) in e.message and "while the engine loaded them" in e.message
    return e


def test_unchanged_files_pass_without_being_read(model_dir, monkeypatch):
    since = time.time_ns()
    files = model_digest.digest_dir(model_dir)

    def no_read(p):
        raise AssertionError(f"{p} was read although its stat is the pinned one")

    monkeypatch.setattr(model_digest, "hash_file", no_read)
    assert model_digest.recheck(model_dir, files, since, during="x", hint=HINT) == ()


def test_content_changed_after_the_hash_refuses_naming_the_file(model_dir):
    since = time.time_ns()
    files = model_digest.digest_dir(model_dir)
    _changed(model_dir / WEIGHTS)
    e = _refusal(model_dir, files, since)
    assert WEIGHTS in e.message and "content changed" in e.message
    assert e.details == {"changed": [WEIGHTS], "rewritten": [], "missing": []}


def test_content_changed_before_the_engine_started_still_refuses(model_dir):
    """When it changed does not matter when the bytes differ: the digest is wrong either way."""
    files = model_digest.digest_dir(model_dir)
    _changed(model_dir / "sub" / "tokenizer.json")
    e = _refusal(model_dir, files, _later_ns())
    assert e.details["changed"] == ["sub/tokenizer.json"]


def test_file_replaced_by_rename_with_other_bytes_refuses(model_dir):
    since = time.time_ns()
    files = model_digest.digest_dir(model_dir)
    w = model_dir / WEIGHTS
    new = model_dir / "new.tmp"
    new.write_bytes(b"\0" * w.stat().st_size)
    os.replace(new, w)
    assert _refusal(model_dir, files, since).details["changed"] == [WEIGHTS]


def test_changed_and_put_back_while_the_engine_read_refuses(model_dir):
    """S1 itself, rolled back before the re-check: the bytes equal the hashed ones again, but
    the engine may have loaded the changed ones in between."""
    files = model_digest.digest_dir(model_dir)
    since = time.time_ns()  # the engine starts reading
    w = model_dir / WEIGHTS
    old = _changed(w)
    w.write_bytes(old)  # put back
    assert model_digest.hash_file(w) == next(f.blake3 for f in files if f.path == WEIGHTS)
    e = _refusal(model_dir, files, since)
    assert e.details == {"changed": [], "rewritten": [WEIGHTS], "missing": []}
    assert "put back" in e.message and WEIGHTS in e.message


def test_same_content_new_stat_before_the_engine_read_passes_and_is_rehashed(model_dir):
    """A touch, or the same bytes written again (a re-download), after the hash but before
    the engine began reading: what it read is the hashed content; nothing to refuse."""
    files = model_digest.digest_dir(model_dir)
    w = model_dir / WEIGHTS
    w.write_bytes(w.read_bytes())  # same content, new mtime/ctime
    os.utime(model_dir / "config.json")  # touch
    shutil.copy(model_dir / "sub" / "tokenizer.json", model_dir / "t.tmp")
    os.replace(model_dir / "t.tmp", model_dir / "sub" / "tokenizer.json")  # same bytes, new inode
    got = model_digest.recheck(model_dir, files, _later_ns(), during="x", hint=HINT)
    assert sorted(got) == ["config.json", WEIGHTS, "sub/tokenizer.json"]


def test_touch_during_the_reading_refuses_as_put_back(model_dir):
    """A stat change at any moment the engine may have been reading cannot be told apart from
    a change rolled back: refused (a re-run with a quiet directory passes)."""
    files = model_digest.digest_dir(model_dir)
    since = time.time_ns()
    os.utime(model_dir / "config.json")
    assert _refusal(model_dir, files, since).details["rewritten"] == ["config.json"]


def test_ctime_within_the_slack_before_the_start_counts_as_during(model_dir):
    """Coarse file-system timestamps: a change stamped up to CTIME_SLACK_NS before the start
    may have been made after it."""
    files = model_digest.digest_dir(model_dir)
    os.utime(model_dir / "config.json")
    ctime = (model_dir / "config.json").stat().st_ctime_ns
    assert _refusal(model_dir, files, ctime + model_digest.CTIME_SLACK_NS // 2).details["rewritten"] == ["config.json"]
    assert model_digest.recheck(model_dir, files, ctime + model_digest.CTIME_SLACK_NS + 1, during="x",
                                hint=HINT) == ("config.json",)


def test_removed_file_refuses(model_dir):
    files = model_digest.digest_dir(model_dir)
    (model_dir / "config.json").unlink()
    assert _refusal(model_dir, files, time.time_ns()).details["missing"] == ["config.json"]


def test_stat_pins_take_the_current_stat_and_keep_the_digest(model_dir):
    """Restore's pins: the stat seen when it checked (here: after a touch since create), the
    digest recorded at create; a missing file keeps its record for the check to report."""
    recorded = model_digest.digest_dir(model_dir)
    os.utime(model_dir / "config.json", ns=(1, 2))
    (model_dir / "sub" / "tokenizer.json").unlink()
    pins = {f.path: f for f in model_digest.stat_pins(model_dir, recorded)}
    rec = {f.path: f for f in recorded}
    st = (model_dir / "config.json").stat()
    c = pins["config.json"]
    assert (c.size, c.mtime_ns, c.ctime_ns, c.inode, c.device) == (
        st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    assert c.mtime_ns == 2 and c.blake3 == rec["config.json"].blake3
    assert pins["sub/tokenizer.json"] == rec["sub/tokenizer.json"]
    assert pins[WEIGHTS] == rec[WEIGHTS]


def test_pinned_after_a_touch_then_unchanged_passes_without_reading(model_dir, monkeypatch):
    """At restore: a file touched since create was re-hashed by the check; pinned with its new
    stat, it is not read again after the wake."""
    recorded = model_digest.digest_dir(model_dir)
    os.utime(model_dir / WEIGHTS, ns=(5, 5))
    pins = model_digest.stat_pins(model_dir, recorded)
    since = time.time_ns()
    monkeypatch.setattr(model_digest, "hash_file", lambda p: pytest.fail(f"{p} read"))
    assert model_digest.recheck(model_dir, pins, since, during="x", hint=HINT) == ()
