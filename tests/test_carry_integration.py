"""Self-contained snapshots end to end (issue 29's compile cache, issue 31 item 7): a snapshot of
an engine that compiled (no --enforce-eager) maps kernels from its engine user's compile cache;
the snapshot carries them (vllm_snapshot/checkpoint/carry.py). Real vLLM + real CRIU.

The engine runs as a throw-away user whose HOME the tests empty, so the shared engine user's
cache (and the engines of other tests) are never touched. Its cache is seeded from the shared
engine user's (when there is one) only to skip a cold compile; the snapshot is created once
per module. Unit level: test_carry.py."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vllm_snapshot.host.privilege import DEFAULT_USER

from conftest import ENGINE_ARGS, ROOT, TINY, cli, remove_tree
from test_integration import free_port

pytestmark = pytest.mark.integration


def _not_searchable_ancestors(path: Path) -> list[Path]:
    return [d for d in [path, *path.parents] if d.is_dir() and not os.stat(d).st_mode & 0o001]


@pytest.fixture(scope="module")
def engine_user():
    """(name, HOME) of a throw-away engine user: a HOME of its own (0700) under /var/tmp, the
    search bit (an ACL entry) on the directories above the interpreter, the venv and this
    checkout that others cannot search (e.g. a pyenv Python under /root), all taken back after."""
    name = f"vsnap-sc{os.getpid() % 100000}"
    top = Path(tempfile.mkdtemp(prefix="vsnap-sc-", dir="/var/tmp"))
    os.chmod(top, 0o711)
    home = top / "home"
    subprocess.run(["useradd", "--system", "--user-group", "--home-dir", str(home), "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True)
    acl: list[Path] = []
    try:
        u = pwd.getpwnam(name)
        home.mkdir(mode=0o700)
        os.chown(home, u.pw_uid, u.pw_gid)
        for base in (Path(os.path.realpath(sys.base_prefix)), Path(os.path.realpath(sys.prefix)), ROOT, TINY):
            for d in _not_searchable_ancestors(base):
                if d not in acl:
                    subprocess.run(["setfacl", "-m", f"u:{name}:x", str(d)], check=True)
                    acl.append(d)
        try:  # seed the compile cache (a cold compile takes minutes on 2 cores); the tests empty it
            shared = Path(pwd.getpwnam(DEFAULT_USER).pw_dir) / ".cache"
            if shared.is_dir():
                shutil.copytree(shared, home / ".cache", symlinks=True)
                subprocess.run(["chown", "-R", f"{u.pw_uid}:{u.pw_gid}", str(home)], check=True)
        except KeyError:
            pass
        yield name, home
    finally:
        for d in acl:
            subprocess.run(["setfacl", "-x", f"u:{name}", str(d)], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)
        remove_tree(top)


@pytest.fixture(scope="module")
def compiled(engine_user, tmp_path_factory):
    """(store root, snapshot dir, manifest) of one snapshot made with compilation on, as the
    throw-away user."""
    name, _home = engine_user
    root = tmp_path_factory.mktemp("carry-store")
    os.chmod(root, 0o700)
    snap = root / "compiled"
    cli("create", str(TINY), "--snapshot-dir", str(snap), "--user", name, "--", *ENGINE_ARGS, check=True)
    m = json.loads((snap / "manifest.json").read_text())
    return root, snap, m


def _empty(home: Path) -> None:
    for p in home.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _stop(port: int) -> None:
    cli("stop", "--port", str(port), "--drain-timeout", "0")


def test_a_compiled_snapshot_carries_the_kernels_it_maps_from_the_engine_users_home(compiled, engine_user):
    _root, snap, m = compiled
    _name, home = engine_user
    files = m["carried"]["files"]
    assert files, "a compiled engine maps kernels from its compile cache: the snapshot must carry them"
    assert all(f["path"].startswith(str(home) + "/") for f in files), [f["path"] for f in files]
    assert any("/torch_compile_cache/" in f["path"] and f["path"].endswith(".so") for f in files)
    blobs = {b["name"] for b in m["carried"]["blobs"]}
    assert {f["blake3"] for f in files} == blobs
    assert {p.name.removesuffix(".zst") for p in (snap / "carried").iterdir()} == blobs
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in [snap / "carried", *(snap / "carried").iterdir()])
    # nothing of the model, the Python environment or the system is carried
    assert not [f for f in files if f["path"].startswith((str(TINY), sys.prefix, "/usr/", "/lib"))]


def test_restore_after_emptying_the_engine_users_home(compiled, engine_user):
    """Issue 31's test. Before: exit 3, "... inductor_cache/....so vanished"."""
    _root, snap, m = compiled
    _name, home = engine_user
    _empty(home)
    port = free_port()
    try:
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        out = json.loads(p.stdout)
        assert "carried" in out["timings"]
        for f in m["carried"]["files"]:
            st = os.stat(f["path"])
            assert (st.st_size, st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns) == \
                (f["size"], f["mode"], f["uid"], f["gid"], f["mtime_ns"]), f["path"]
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["choices"][0]["text"] is not None
    finally:
        _stop(port)


def test_serve_after_emptying_the_home_restores_the_snapshot_it_has_and_builds_no_duplicate(compiled, engine_user):
    """Issue 29: the refusal ("... vanished") made serve build a second snapshot of the same key."""
    root, snap, _m = compiled
    name, home = engine_user
    _empty(home)
    before = sorted(p.name for p in root.iterdir())
    port = free_port()
    try:
        t0 = time.monotonic()
        p = cli("--root", str(root), "serve", str(TINY), "--user", name, "--port", str(port), "--detach", "--json",
                "--", *ENGINE_ARGS)
        assert p.returncode == 0, p.stdout + p.stderr
        out = json.loads(p.stdout)
        assert (out["path"], out["snapshot"], out["refused"]) == ("restored", str(snap), []), out
        assert sorted(p.name for p in root.iterdir()) == before, f"a second snapshot was built ({time.monotonic() - t0:.0f} s)"
    finally:
        _stop(port)


def test_a_flipped_byte_in_a_carried_copy_refuses_before_criu_naming_the_file(compiled, engine_user, tmp_path):
    root, snap, m = compiled
    _name, home = engine_user
    copy = tmp_path / "flipped"
    subprocess.run(["cp", "-al", str(snap), str(copy)], check=True)  # images shared ...
    shutil.rmtree(copy / "carried")
    shutil.copytree(snap / "carried", copy / "carried")  # ... the carried copies our own
    os.chmod(tmp_path, 0o700)
    blob = m["carried"]["blobs"][0]
    stored = copy / "carried" / (blob["name"] + ("" if blob["compression"] == "none" else ".zst"))
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x40
    stored.write_bytes(bytes(data))
    named = [f["path"] for f in m["carried"]["files"] if f["blake3"] == blob["name"]]
    _empty(home)
    port = free_port()
    try:
        p = cli("restore", str(copy), "--port", str(port), "--json")
        assert p.returncode != 0, p.stdout
        err = json.loads(p.stdout)["error"]
        assert err["code"] == "corrupt-snapshot", err
        assert named[0] in err["message"] and "checksum" in err["message"], err
        assert list(home.iterdir()) == []  # refused before anything was put back, before CRIU
        assert "criu_restore" not in json.dumps(err.get("details") or {})
    finally:
        _stop(port)


def test_a_rotated_cache_restores_same_bytes_kept_other_bytes_of_the_engines_own_file_replaced(compiled, engine_user):
    """A create of another model rewrote cache files the snapshot maps: one with the same bytes
    (a new inode and mtime), one with other bytes of the same size (owned by the engine user,
    held by nothing). Before: exit 3 ("... changed: content differs")."""
    _root, snap, m = compiled
    name, home = engine_user
    mapped = [f for f in m["criu"]["tree_files"] if f["path"].startswith(str(home) + "/") and f["blake3"]]
    same, other = mapped[0], mapped[1]
    port = free_port()
    if not all(os.path.exists(f["path"]) for f in (same, other)):  # an earlier test emptied the HOME
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json")  # puts them back
        _stop(port)
        assert p.returncode == 0, p.stdout + p.stderr
    u = pwd.getpwnam(name)
    for f, data in ((same, Path(same["path"]).read_bytes()), (other, os.urandom(other["size"]))):
        mode = os.stat(f["path"]).st_mode & 0o7777
        tmp = Path(f["path"] + ".rotating")
        tmp.write_bytes(data)
        os.chown(tmp, u.pw_uid, u.pw_gid)
        os.chmod(tmp, mode)
        os.rename(tmp, f["path"])  # as inductor writes its cache: a temp file renamed over
    same_ino = os.stat(same["path"]).st_ino
    try:
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        assert os.stat(same["path"]).st_ino == same_ino  # same content: used as it is
        import blake3

        assert blake3.blake3(Path(other["path"]).read_bytes()).hexdigest() == other["blake3"]  # ours again
    finally:
        _stop(port)


def test_a_differing_carried_file_a_live_process_holds_stops_serve_as_busy_and_builds_nothing(compiled, engine_user):
    """The transient refusal: another engine (a create in progress, say) maps a cache file with
    other bytes. Replacing it would turn that engine's mapping into a deleted file at its dump,
    so serve says so (busy, the file and the holder named) and builds no second snapshot of the
    key; once the holder is gone the snapshot restores."""
    root, snap, m = compiled
    name, home = engine_user
    f = [x for x in m["criu"]["tree_files"] if x["path"].startswith(str(home) + "/") and x["blake3"]][0]
    port = free_port()
    if not os.path.exists(f["path"]):  # an earlier test emptied the HOME
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json")
        _stop(port)
        assert p.returncode == 0, p.stdout + p.stderr
    u = pwd.getpwnam(name)
    tmp = Path(f["path"] + ".rotating")
    mode = os.stat(f["path"]).st_mode & 0o7777
    tmp.write_bytes(os.urandom(f["size"]))
    os.chown(tmp, u.pw_uid, u.pw_gid)
    os.chmod(tmp, mode)
    os.rename(tmp, f["path"])
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); time.sleep(600)",
                               f["path"]])
    before = sorted(p.name for p in root.iterdir())
    try:
        time.sleep(1)
        p = cli("--root", str(root), "serve", str(TINY), "--user", name, "--port", str(port), "--detach", "--json",
                "--", *ENGINE_ARGS)
        assert p.returncode == 9, p.stdout + p.stderr
        err = json.loads(p.stdout)["error"]
        assert f["path"] in err["message"] and f"PID {holder.pid}" in err["message"], err
        assert sorted(p.name for p in root.iterdir()) == before  # no second snapshot of the key
    finally:
        holder.kill()
        holder.wait()
        _stop(port)
    try:
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json")
        assert p.returncode == 0, p.stdout + p.stderr
    finally:
        _stop(port)


def test_a_compiled_snapshot_pulled_on_another_node_restores_with_the_engine_users_home_empty(
        compiled, engine_user, tmp_path):
    """Issue 31 item 7 after a pull: push -> pull into an empty store on a second "node" (its
    own mount and UTS namespaces, machine id and hostname) whose engine user's HOME (compile
    cache) is empty -> restore there: the carried kernels travel as layers of their own, are put
    back before CRIU, and the oracle matches with no --allow-mismatch."""
    from vllm_snapshot.dev.registry_server import RegistryServer
    from test_fleet_integration import _private, on_node

    _root, snap, m = compiled
    _name, home = engine_user
    reg = RegistryServer(tmp_path / "registry")
    try:
        image = f"{reg.host}/fleet/compiled:v1"
        cli("push", str(snap), image, "--plain-http", check=True)
        _empty(home)
        root_b = _private(tmp_path / "node-b-store")
        port = free_port()
        p = on_node([["--root", str(root_b), "pull", image, "--plain-http", "--name", "compiled", "--json"],
                     ["--root", str(root_b), "restore", "compiled", "--port", str(port), "--detach", "--json"]],
                    hostname="node-b-compiled")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        import re

        docs = [json.loads(x) for x in re.findall(r"^\{.*?^\}$|^\{.*\}$", p.stdout, re.M | re.S)]
        pulled, restored = docs[0], docs[1]
        try:
            assert pulled["snapshot"] == str(root_b / "compiled")
            # nothing of the snapshot was on node B; only its weights file, at its recorded path on
            # this one machine (the fleet's weights tests hide it: tests/test_fleet_weights_integration.py)
            assert pulled["weights_reused"] == "present" and pulled["reused_bytes"] == pulled["weights_bytes"] > 0
            assert restored["oracle"] == "match" and not restored["warnings"], restored
            assert "carried" in restored["timings"]
            for f in m["carried"]["files"]:  # put back, as they were
                st = os.stat(f["path"])
                assert (st.st_size, st.st_uid, st.st_mtime_ns) == (f["size"], f["uid"], f["mtime_ns"]), f["path"]
        finally:
            _stop(port)
    finally:
        reg.stop()
