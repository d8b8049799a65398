"""Weights files (vllm_snapshot/store/weights.py, vllm_snapshot/engine/weights.py) without vLLM:
the table, writing and mapping tensors (copy-on-write keeps writes private), publishing once by
content, the stat-pinned check, references counted from manifests, the channel's table check."""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import pytest

from vllm_snapshot.engine import weights as ew
from vllm_snapshot.errors import ModelChangedError
from vllm_snapshot.store import weights as sw
from vllm_snapshot.store import weights_channel

from helpers import make_manifest, write_snapshot_dir

torch = pytest.importorskip("torch")


class Tiny(torch.nn.Module):
    """Two linear layers whose first weight is tied to an embedding, a buffer and a small norm."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(256, 128)
        self.emb.weight.data = torch.randn(256, 128, generator=g)
        self.up = torch.nn.Linear(128, 256, bias=False)
        self.up.weight.data = torch.randn(256, 128, generator=g)
        self.tied = torch.nn.Linear(128, 256, bias=False)
        self.tied.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(128)
        self.register_buffer("table", torch.arange(32768, dtype=torch.float32))

    def forward(self, x):
        return self.tied(self.norm(x)) + self.up(x)


def _map(model: torch.nn.Module, path: Path) -> tuple[list[dict], mmap.mmap]:
    """What map_model does without the channel: plan, write into ``path``, map it private, re-point."""
    entries, stays, storages = ew.plan(ew._named_tensors(model))
    size = entries[-1]["offset"] + entries[-1]["nbytes"]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        ew._write_all(fd, entries, storages)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    del storages, stays  # as map_model does: the old buffers' last references
    moved, held = ew._repoint(model, entries, mm)
    assert moved == sum(e["nbytes"] for e in entries) and held == []
    return entries, mm


def test_plan_writes_each_storage_once_aligned_and_keeps_small_tensors():
    m = Tiny()
    entries, stays, _ = ew.plan(ew._named_tensors(m))
    names = [e["names"] for e in entries]
    # the tied weight is one entry with both names; the buffer is there; the norm stays (small)
    assert ["param:emb.weight", "param:tied.weight"] in names
    assert ["buffer:table"] in names and ["param:up.weight"] in names
    assert all(e["offset"] % ew.ALIGN == 0 for e in entries)
    assert {s["name"] for s in stays} == {"param:norm.weight", "param:norm.bias"}
    assert all("KiB" in s["why"] for s in stays)


def test_mapped_tensors_compute_the_same_and_live_in_the_file(tmp_path):
    m = Tiny().requires_grad_(False)  # as vLLM's parameters (an autograd graph would hold the old memory)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    want = m(x)
    path = tmp_path / "w"
    _, mm = _map(m, path)
    assert torch.equal(m(x), want)
    # the parameters' memory is the file's mapping now (tied weights still one tensor)
    maps = Path("/proc/self/maps").read_text()
    assert str(path) in maps
    assert m.emb.weight.data_ptr() == m.tied.weight.data_ptr()
    lo = m.up.weight.data_ptr()
    assert any(int(a, 16) <= lo < int(b, 16) and str(path) in line
               for line in maps.splitlines() for a, b in [line.split()[0].split("-")])


def test_old_memory_is_zeroed_unless_something_else_still_uses_it(tmp_path):
    m = Tiny().requires_grad_(False)
    kept = m.up.weight.detach()[:2]  # a view elsewhere (a closure, a cache) of the loaded weight
    before = kept.clone()
    entries, stays, storages = ew.plan(ew._named_tensors(m))
    size = entries[-1]["offset"] + entries[-1]["nbytes"]
    fd = os.open(tmp_path / "w", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    ew._write_all(fd, entries, storages)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    old_emb = m.emb.weight.detach().untyped_storage()
    del storages
    moved, held = ew._repoint(m, entries, mm)
    assert held == ["param:up.weight"] and torch.equal(kept, before)  # still used: left as it was
    assert not any(bytes(old_emb))  # nothing else used it: zeroed (no stale copy for CRIU to dump)


def test_a_write_to_a_mapped_tensor_stays_in_the_process(tmp_path):
    m = Tiny().requires_grad_(False)
    path = tmp_path / "w"
    _map(m, path)
    before = path.read_bytes()
    orig = m.up.weight.detach().clone()
    with torch.no_grad():
        m.up.weight.add_(1.0)  # copy-on-write: private pages
    assert torch.equal(m.up.weight.detach(), orig + 1.0)  # the process sees its write
    assert path.read_bytes() == before  # the file never does


def test_repoint_refuses_a_file_whose_bytes_differ(tmp_path):
    m = Tiny()
    entries, stays, storages = ew.plan(ew._named_tensors(m))
    size = entries[-1]["offset"] + entries[-1]["nbytes"]
    path = tmp_path / "w"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    ew._write_all(fd, entries, storages)
    os.pwrite(fd, b"\x55", entries[0]["offset"] + 3)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    with pytest.raises(RuntimeError, match="differ"):
        ew._repoint(m, entries, mm)


def test_a_level_2_wake_fills_the_same_storages_from_the_file_with_the_post_processed_bytes(tmp_path, monkeypatch):
    # the GPU wake's source (fill_in_place): sleep level 2 gives the weight tensors back at the
    # same addresses with undefined contents; the file's bytes go into those very storages. On
    # CPU this proves the table, the tied names, the chunking and the refusals; only a GPU proves
    # the device copies and that the woken addresses are the ones graphs captured.
    monkeypatch.setattr(ew, "CHUNK", 1000)  # many steps per tensor, a short last one
    m = Tiny()
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    want = m(x).detach()
    entries, _, storages = ew.plan(ew._named_tensors(m))
    path = tmp_path / "w"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, entries[-1]["offset"] + entries[-1]["nbytes"])
        ew._write_all(fd, entries, storages)
        del storages
        ptrs = {n: t.data_ptr() for n, t in ew._named_tensors(m)}
        with torch.no_grad():  # what a level-2 sleep leaves: the storages, not their bytes
            for _, t in ew._named_tensors(m):
                if t.numel() * t.element_size() >= ew.MIN_BYTES:
                    t.fill_(float("nan"))
        assert torch.isnan(m(x)).all()
        assert ew.fill_in_place(m, entries, fd) == sum(e["nbytes"] for e in entries)
        assert torch.equal(m(x), want)
        assert {n: t.data_ptr() for n, t in ew._named_tensors(m)} == ptrs  # filled in place, nothing re-pointed
        # a model that is not the file's: refused, naming the tensor
        other = Tiny()
        other.up = torch.nn.Linear(128, 128, bias=False)
        with pytest.raises(RuntimeError, match="up.weight is torch.float32 x 16384 here"):
            ew.fill_in_place(other, entries, fd)
        del other.up
        with pytest.raises(RuntimeError, match="names param:up.weight, which this model does not have"):
            ew.fill_in_place(other, entries, fd)
        os.ftruncate(fd, entries[-1]["offset"] + 10)  # a short file
        with pytest.raises(OSError, match="ended at"):
            ew.fill_in_place(m, entries, fd)
    finally:
        os.close(fd)


def _published(root: Path, data: bytes) -> tuple[Path, str, bool]:
    d = sw.ensure_dir(root)
    tmp = d / f"{sw.TMP_PREFIX}{os.getpid()}-x"
    tmp.write_bytes(data)
    return sw.publish(tmp, root)


def test_publish_names_the_file_by_its_content_writes_it_once_and_private(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    p1, d1, reused1 = _published(root, b"a" * 9000)
    assert p1 == sw.path_of(root, d1) and not reused1
    assert oct(p1.stat().st_mode & 0o777) == "0o600" and oct(p1.parent.stat().st_mode & 0o777) == "0o700"
    ino = p1.stat().st_ino
    p2, d2, reused2 = _published(root, b"a" * 9000)
    assert (p2, d2, reused2) == (p1, d1, True) and p2.stat().st_ino == ino  # the same inode: shared pages
    assert [x.name for x in p1.parent.iterdir()] == [p1.name]  # no temp left
    # published files are immutable: a "backup" copied over it or a truncate fails (the running
    # engines map it); root can clear the attribute on purpose
    assert sw.immutable(p1)
    with pytest.raises(PermissionError):
        open(p1, "r+b")
    with pytest.raises(PermissionError):
        os.truncate(p1, 10)
    # a same-named file whose bytes do not match its name is replaced
    sw.unprotect(p1)
    with open(p1, "r+b") as f:
        f.write(b"b")
    p3, d3, reused3 = _published(root, b"a" * 9000)
    assert not reused3 and sw.hash_file(p3) == d3


def test_check_trusts_an_unchanged_stat_and_rehashes_a_changed_one(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    p, d, _ = _published(root, os.urandom(20000))
    rec = sw.record(p, d, 2, 20000)
    assert sw.check(rec) is None and sw.check(rec, full=True) is None
    time.sleep(0.05)  # out of the coarse timestamp tick the record was made in (see below)
    sw.unprotect(p)  # as an operator would have to: the file is immutable
    st = p.stat()
    with open(p, "r+b") as f:  # a flipped byte, mtime put back: ctime still changes
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "changed since create" in sw.check(rec)
    with pytest.raises(ModelChangedError) as e:
        sw.refuse(rec)
    assert str(p) in e.value.message and e.value.exit_code == 4 and "serve" in e.value.hint
    os.chmod(p, 0o644)  # what a plain `cp` of a backup makes: CRIU would refuse the mode at restore
    assert "mode 0644" in sw.check(rec) and "chmod 0600" in sw.check(rec)
    p.unlink()
    assert sw.check(rec) == f"the weights file {p} is missing"


def test_a_file_placed_with_another_nodes_stat_is_hashed_once_then_pinned_on_this_node(tmp_path, monkeypatch):
    # a pulled (or restored-from-backup) weights file has the bytes the manifest records but not
    # the creating node's stat: the first check hashes it whole, later ones trust this node's pin
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    p, d, _ = _published(root, os.urandom(30000))
    rec = sw.record(p, d, 2, 30000).model_copy(update={"inode": 1, "ctime_ns": 1})  # the creating node's stat
    hashed = []
    real = sw.hash_file
    monkeypatch.setattr(sw, "hash_file", lambda q: hashed.append(q) or real(q))
    assert sw.check(rec) is None and hashed == [p]
    pin = sw.pin_path(p)
    assert oct(pin.stat().st_mode & 0o777) == "0o600"
    assert sw.check(rec) is None and sw.check(rec) is None and hashed == [p]  # pinned: no second hash
    assert sw.check(rec, full=True) is None and len(hashed) == 2  # verify still hashes whole
    # a pin for other bytes, or one another user could have written, vouches for nothing
    os.chmod(pin, 0o666)
    assert sw.check(rec) is None and len(hashed) == 3
    assert oct(pin.stat().st_mode & 0o777) == "0o600"  # re-written by that good hash
    # changed bytes change the stat (ctime at least): the pin no longer matches and the check refuses
    sw.unprotect(p)
    # the kernel stamps ctime/mtime from a coarse clock (a tick of ~4 ms): a write in the tick
    # the pin was written in keeps the same stat (git's "racily clean" case), so wait one out
    time.sleep(0.05)
    with open(p, "r+b") as f:
        f.write(b"\0")
    assert "changed since create" in sw.check(rec) and len(hashed) == 4
    # the pin goes with its file
    (root / "s").mkdir()
    assert sw.remove_unreferenced(root) == [p] and not pin.exists()


def test_the_store_removes_an_unused_weights_files_pin_with_it(tmp_path):
    # a trial: deleting the last snapshot that used a weights file left ROOT/.weights/<digest>.weights.pin
    from vllm_snapshot.effects.store import LocalStoreTools

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    p, d, _ = _published(root, os.urandom(30000))
    sw.write_pin(p, d)
    pin = sw.pin_path(p)
    assert pin.exists()
    write_snapshot_dir(root / "s1", make_manifest(weights=sw.record(p, d)))
    assert LocalStoreTools().remove_unused_weights(root) == [] and pin.exists()  # s1 uses it
    import shutil

    shutil.rmtree(root / "s1")
    assert LocalStoreTools().remove_unused_weights(root, dry_run=True) == [p] and pin.exists()
    assert LocalStoreTools().remove_unused_weights(root) == [p]
    assert not p.exists() and not pin.exists() and not sw.directory(root).exists()  # .weights empty: gone too


def test_unreferenced_counts_from_the_manifests(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    a, da, _ = _published(root, b"a" * 5000)
    b, db, _ = _published(root, b"b" * 5000)
    write_snapshot_dir(root / "s1", make_manifest(weights=sw.record(a, da)))
    write_snapshot_dir(root / "s2", make_manifest(weights=sw.record(a, da)))
    assert sw.unreferenced(root) == [b]
    assert sw.remove_unreferenced(root) == [b] and not b.exists()
    import shutil

    shutil.rmtree(root / "s1")
    assert sw.unreferenced(root) == []  # s2 still names it
    # an unreadable manifest might name any file: nothing is removed then
    (root / "s2" / "manifest.json").write_text("{")
    (root / "s3").mkdir()
    write_snapshot_dir(root / "s3")
    assert sw.unreferenced(root) == [] and sw.blocked(root) == [str(root / "s2")]  # said, not silent
    shutil.rmtree(root / "s2")
    assert sw.unreferenced(root) == [a] and sw.blocked(root) == []


@pytest.mark.parametrize("msg,why", [
    ({"op": "table", "size": 8192, "entries": [{"offset": 0, "nbytes": 8192}]}, None),
    ({"op": "table", "size": 8192, "entries": [{"offset": 100, "nbytes": 10}]}, "out of place"),
    ({"op": "table", "size": 100, "entries": [{"offset": 0, "nbytes": 8192}]}, "out of place"),
    ({"op": "table", "size": 8192, "entries": [{"offset": 0, "nbytes": 10}]}, "ends at 10"),
    ({"op": "table", "size": sw.MAX_BYTES + 1, "entries": []}, "bytes"),
    ({"op": "table", "size": "1", "entries": []}, "bytes"),
    ({"op": "written"}, "expected the table"),
])
def test_the_table_a_worker_sends_is_checked(msg, why):
    if why is None:
        assert weights_channel.check_table(msg) == 8192
    else:
        with pytest.raises(ValueError, match=why):
            weights_channel.check_table(msg)


def test_stale_temps_are_those_of_gone_creates_or_old(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    d = sw.ensure_dir(root)
    mine = d / f"{sw.TMP_PREFIX}{os.getpid()}-a"
    gone = d / f"{sw.TMP_PREFIX}999999999-b"
    mine.touch()
    gone.touch()
    assert sw.stale_temps(root) == [gone]
    assert set(sw.stale_temps(root, now=os.path.getmtime(mine) + 2 * 86400)) == {gone, mine}


def test_prune_says_which_unreadable_manifest_keeps_unused_weights_files(tmp_path, monkeypatch, capsys):
    # a trial: prune said "nothing to prune" while a damaged manifest silently kept a GiB-sized file
    from vllm_snapshot.cli import app as cli

    monkeypatch.setenv("VLLM_SNAPSHOT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path / "run"))
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    a, da, _ = _published(root, b"a" * 5000)
    write_snapshot_dir(root / "s1", make_manifest(weights=sw.record(a, da)))
    (root / "s1" / "manifest.json").write_text("{")
    assert cli.main(["--root", str(root), "prune"]) == 0
    out = capsys.readouterr().out
    assert f"kept the unused weights files: the manifest of {root / 's1'} cannot be read" in out
    assert "nothing to prune" not in out and a.exists()
    # `delete` refuses a manifest that is not JSON: the way out it names is rm -r there
    assert "`rm -r DIR` where delete cannot tell it is a snapshot" in out, out
    assert cli.main(["--root", str(root), "prune", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_kept_for"] == [str(root / "s1")]
    sw.unprotect(a)


def test_a_weights_dir_that_is_not_root_owned_0700_is_refused_not_adopted(tmp_path):
    # a trial: `runuser -u nobody -- mkdir -m 0777 /tmp/.weights` before a create beside /tmp:
    # the create adopted it (chmod 0700, still nobody's), who could then replace its files
    import shlex

    from vllm_snapshot.effects.files import LocalSnapshotFiles
    from vllm_snapshot.errors import EnvironmentProblem

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    d = sw.directory(root)
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    os.chown(d, 65534, 65534)
    for refuse in (sw.ensure_dir, LocalSnapshotFiles().check_weights_dir):
        with pytest.raises(EnvironmentProblem, match=f"the weights directory {d} is owned by uid 65534") as ei:
            refuse(root)
        assert ei.value.exit_code == 11
        assert shlex.split(ei.value.hint.split("`")[1]) == ["chown", "root:root", str(d), "&&", "chmod", "0700", str(d)]
    st = d.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o777)  # nothing adopted
    os.chown(d, 0, 0)
    with pytest.raises(EnvironmentProblem, match="has mode 0777, not 0700"):
        sw.ensure_dir(root)
    os.chmod(d, 0o700)
    assert sw.ensure_dir(root) == d and sw.dir_problem(d) is None
    os.rmdir(d)
    assert sw.dir_problem(d) is None and sw.ensure_dir(root) == d  # missing: made root's 0700
    assert d.stat().st_mode & 0o777 == 0o700
    os.rmdir(d)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    d.symlink_to(tmp_path / "elsewhere")  # a link is not followed, even to a good directory
    with pytest.raises(EnvironmentProblem, match="is a symlink"):
        LocalSnapshotFiles().check_weights_dir(root)
    with pytest.raises(EnvironmentProblem, match="is a symlink"):
        sw.ensure_dir(root)


def test_prune_removes_nothing_through_an_untrusted_weights_dir(tmp_path):
    # a symlinked ROOT/.weights would point delete/prune at another directory's *.weights files
    from vllm_snapshot.effects.store import LocalStoreTools

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    theirs = other / ("a" * 64 + sw.SUFFIX)
    theirs.write_bytes(b"not ours")
    (other / f"{sw.TMP_PREFIX}999999999-x").write_bytes(b"")
    sw.directory(root).symlink_to(other)
    assert sw.unreferenced(root) == [] and sw.stale_temps(root) == [] and sw.blocked(root) == []
    assert LocalStoreTools().remove_unused_weights(root) == [] and theirs.exists()
    sw.directory(root).unlink()
    os.rename(other, sw.directory(root))
    d = sw.directory(root)
    os.chown(d, 65534, 65534)  # another user's: not removed from either
    assert sw.unreferenced(root) == [] and sw.remove_orphan_pins(root) == []
    os.chown(d, 0, 0)
    assert sw.unreferenced(root) == [d / theirs.name]  # root's 0700: it is the store's again


# -- a GPU engine's level-2 wake from the weights file -------------------------------------------

WAKE_WORKER = r'''
import json, os, sys, types
import torch
sys.path.insert(0, os.environ["TESTS_DIR"])
from test_weights import Tiny
from vllm_snapshot.engine import weights as ew

m = Tiny()
x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
want = m(x).detach()
ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
out = ew.hold_for_wake(m, device="cpu")
held = os.readlink(f"/proc/self/fd/{ew._HELD['fd']}")
with torch.no_grad():  # what a level-2 sleep leaves: every parameter's storage, not its bytes
    for p in m.parameters():
        p.fill_(float("nan"))
assert torch.isnan(m(x)).all()
# through the worker extension vLLM mixes into its worker class (self.model_runner.get_model())
worker = type("Worker", (ew.WakeFromWeightsFile,), {})()
worker.model_runner = types.SimpleNamespace(get_model=lambda: m)
filled = worker.vllm_snapshot_fill_weights()
print(json.dumps({"out": out, "held": held, "filled": filled, "same": bool(torch.equal(m(x), want)),
                  "ptrs_kept": {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs,
                  "buffer_in_file": any("buffer:" in n for e in ew._HELD["entries"] for n in e["names"])}))
'''


def test_a_gpu_engines_worker_writes_its_parameters_through_the_channel_keeps_the_file_and_wakes_from_it(
        tmp_path, monkeypatch):
    # the real channel (create's WeightsServer in the tree's own network namespace, the peer
    # checks, publish) and the worker's side of a GPU engine (MODE_WAKE) with CPU tensors: the
    # parameters go into the file, the fd stays open (CRIU re-opens it at restore), and the
    # wake -- called as vLLM's collective_rpc calls a worker extension's method -- fills the
    # very storages from it. Only a GPU proves the device copies (scripts/gpu_check_weights.py).
    import subprocess
    import sys

    from conftest import remove_tree

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    script = tmp_path / "worker.py"
    script.write_text(WAKE_WORKER)
    env = {**os.environ, "TESTS_DIR": str(Path(__file__).parent),
           "PYTHONPATH": f"{Path(__file__).parent.parent}:{os.environ.get('PYTHONPATH', '')}"}
    # the engine root: a shell in a network namespace of its own; the worker: its child
    tree = subprocess.Popen(["unshare", "--net", "sh", "-c", f'{sys.executable} {script}; exit $?'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    # create's end reads the worker's last message late (a loaded box): the engine may report
    # itself started before that; result() must still give what the worker mapped
    recv = weights_channel._recv

    def late_recv(sock):
        msg, fd = recv(sock)
        if msg.get("op") == "mapped":
            time.sleep(1.0)
        return msg, fd

    monkeypatch.setattr(weights_channel, "_recv", late_recv)
    try:
        server = weights_channel.WeightsServer(tree.pid, root, os.getuid())
        try:
            stdout, stderr = tree.communicate(timeout=120)
            assert tree.returncode == 0, stderr[-2000:]
            path, digest, reused, mapped = server.result()  # not waited for by the test
        finally:
            server.close()
        got = json.loads(stdout.strip().splitlines()[-1])
        params = Tiny().named_parameters()
        want_bytes = sum(p.numel() * 4 for n, p in params if n != "tied.weight")  # the tied weight once
        assert got["out"]["digest"] == digest and path == root / ".weights" / f"{digest}.weights" and not reused
        assert got["out"]["bytes"] == want_bytes == mapped["bytes"] and got["filled"] == want_bytes
        assert got["held"] == str(path)  # the worker keeps the published file open: CRIU dumps the fd
        assert got["same"] and got["ptrs_kept"] and not got["buffer_in_file"]  # vLLM saves the buffers itself
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        if tree.poll() is None:
            tree.kill()
        remove_tree(root)


def test_the_wake_refuses_a_model_whose_parameter_the_file_cannot_hold():
    m = Tiny()
    m.up.weight = torch.nn.Parameter(torch.randn(512, 128)[256:])  # a slice of a larger storage
    with pytest.raises(RuntimeError, match="1 parameters cannot be restored from a weights file.*up.weight"):
        ew.wake_plan(m, device="cpu")
    entries, stays, _ = ew.wake_plan(Tiny(), device="cpu")
    names = [n for e in entries for n in e["names"]]
    assert "param:norm.weight" in names and "param:norm.bias" in names  # no size floor: all of them are discarded
    assert not any(n.startswith("buffer:") for n in names) and stays == []


def test_fill_held_without_a_held_file_says_so(monkeypatch):
    monkeypatch.setattr(ew, "_HELD", {})
    with pytest.raises(RuntimeError, match="holds no weights file"):
        ew.fill_held(Tiny())


def test_a_wake_fills_from_the_file_only_for_a_gpu_engine_made_with_one():
    from vllm_snapshot.entrypoints.engine_root import wake_rpc

    assert wake_rpc(True, "cuda") == ew.FILL_RPC == "vllm_snapshot_fill_weights"
    assert wake_rpc(False, "cuda") == wake_rpc(True, "cpu") == "reload_weights"
    assert ew.EXTENSION == f"{ew.WakeFromWeightsFile.__module__}.{ew.WakeFromWeightsFile.__qualname__}"
    assert hasattr(ew.WakeFromWeightsFile, ew.FILL_RPC)


@pytest.mark.parametrize("requested,device,mode", [
    ("auto", "cpu", "file"), ("auto", "cuda", "in-image"), ("file", "cpu", "file"), ("file", "cuda", "file"),
    ("in-image", "cpu", "in-image"), ("in-image", "cuda", "in-image")])
def test_weights_mode(requested, device, mode):
    from vllm_snapshot.ops.create import weights_mode

    assert weights_mode(requested, device) == mode
