"""Least privilege on a real engine + CRIU (issue 19): the restored tree runs as the engine user
with no capability and NoNewPrivs; create refuses a model the engine user cannot read before the
engine starts; restore refuses, before CRIU, a snapshot whose user was deleted or renumbered.
The session snapshot (tests/conftest.py) was made with the default user."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time

import psutil
import pytest

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.host.privilege import DEFAULT_USER, parse_status

from conftest import EAGER_ARGS, TINY, cli
from test_integration import engine_pids, free_port, port_accepts, stop
from test_integration_more import refused_before_criu, reseal

pytestmark = pytest.mark.integration


def test_restored_tree_runs_as_the_engine_user_without_capabilities(snapshot):
    u = pwd.getpwnam(DEFAULT_USER)
    m = mf.read(snapshot)
    assert m.engine.user is not None
    assert (m.engine.user.name, m.engine.user.uid, m.engine.user.gid) == (DEFAULT_USER, u.pw_uid, u.pw_gid)
    before = engine_pids()
    port = free_port()
    p = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", timeout=300, check=True)
    pid = json.loads(p.stdout)["pid"]
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        assert len(procs) == len(m.criu.tree_pids) >= 2  # API server, EngineCore, ...
        for proc in procs:
            with open(f"/proc/{proc.pid}/status") as f:
                c = parse_status(f.read())
            who = f"PID {proc.pid} ({proc.name()})"
            assert set(c.uids) == {u.pw_uid}, who
            assert set(c.gids) == {u.pw_gid}, who
            assert set(c.groups) == set(m.engine.user.groups), who
            assert (c.cap_eff, c.cap_prm, c.cap_inh, c.cap_amb, c.cap_bnd) == (0, 0, 0, 0, 0), who
            assert c.no_new_privs == 1, who
        # vLLM's compile cache is the engine user's own, outside the snapshot
        cache = os.path.join(m.engine.user.home, ".cache", "vllm")
        assert os.stat(cache).st_uid == u.pw_uid
    finally:
        stop(pid)
    assert engine_pids(10, before) - before == set()
    assert not port_accepts(port)
    assert os.stat(snapshot).st_mode & 0o777 == 0o700 and os.stat(snapshot).st_uid == 0


def test_create_refuses_a_model_the_engine_user_cannot_read(tmp_path):
    """pytest's tmp dirs are root-only (0700): the engine user cannot reach a model there."""
    model = tmp_path / "private-model"
    shutil.copytree(TINY, model)
    os.chmod(tmp_path, 0o700)
    target = tmp_path / "snap"
    before = engine_pids()
    t0 = time.monotonic()
    p = cli("create", str(model), "--snapshot-dir", str(target), "--", *EAGER_ARGS, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"runs as {DEFAULT_USER}" in p.stderr and "cannot read" in p.stderr and str(model) in p.stderr
    assert "setfacl" in p.stderr  # the remedy
    assert "starting engine" not in p.stderr and "Traceback" not in p.stderr
    assert took < 60  # an engine start alone takes longer
    assert not target.exists()
    assert engine_pids(10, before) - before == set()


def _useradd(name: str) -> pwd.struct_passwd:
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True)
    return pwd.getpwnam(name)


def _userdel(name: str) -> None:
    subprocess.run(["userdel", name], check=False, capture_output=True)


def test_snapshot_of_a_deleted_or_renumbered_user_is_refused_before_criu(clone_snapshot):
    snap = clone_snapshot("deleted-user")
    m = mf.read(snap)
    name = f"vsnap-t{os.getpid() % 100000}"
    _userdel(name)
    try:
        pw = _useradd(name)
        reseal(snap, engine=m.engine.model_copy(update={"user": m.engine.user.model_copy(update={
            "name": name, "uid": pw.pw_uid, "gid": pw.pw_gid, "groups": (pw.pw_gid,)})}))
    finally:
        _userdel(name)
    before = engine_pids()
    port = free_port()
    p = cli("restore", str(snap), "--port", str(port), timeout=120)
    refused_before_criu(p, 3, before)
    assert f"user '{name}'" in p.stderr and "does not exist" in p.stderr
    assert not port_accepts(port)

    # the default user, but the snapshot recorded other ids for it (user re-created since)
    u = m.engine.user
    reseal(snap, engine=m.engine.model_copy(update={"user": u.model_copy(update={"uid": u.uid + 1000})}))
    p = cli("restore", str(snap), "--port", str(port), timeout=120)
    refused_before_criu(p, 3, before)
    assert f"has uid {u.uid} here" in p.stderr and "re-create the snapshot" in p.stderr
