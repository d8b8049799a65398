"""Least privilege (issue 19), without an engine: /proc status parsing, the credential and
identity checks, where create and restore call them (FakeWorld), CRIU's real ids, the manifest
field (old manifests without it still parse), and the drop itself in a child process (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_snapshot.checkpoint import criu
from vllm_snapshot.engine.spec import RunAs
from vllm_snapshot.store import manifest as mf
from vllm_snapshot import ops
from vllm_snapshot.host import privilege
from vllm_snapshot.errors import CriuError, EnvironmentProblem, IncompatibleHostError, UnsnapshottableError, UsageError
from vllm_snapshot.host.privilege import Creds, User
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.host.envpolicy import scrubbed_env

from fakes import FakeWorld
from helpers import ENGINE_USER, make_manifest, stand_in

SNAP = Path("/snaps/tiny")

STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
Uid:\t999\t999\t999\t999
Gid:\t995\t995\t995\t995
Groups:\t995 44
CapInh:\t0000000000000000
CapPrm:\t0000000000000000
CapEff:\t0000000000000000
CapBnd:\t0000000000000000
CapAmb:\t0000000000000000
NoNewPrivs:\t1
Seccomp:\t0
"""
ROOT_STATUS = STATUS.replace("999", "0").replace("995", "0").replace("CapEff:\t0000000000000000",
                                                                    "CapEff:\t000001fffeffffff").replace("NoNewPrivs:\t1",
                                                                                                         "NoNewPrivs:\t0")


def test_parse_status():
    c = privilege.parse_status(STATUS)
    assert c.uids == (999,) * 4 and c.gids == (995,) * 4 and c.groups == (44, 995)
    assert (c.cap_eff, c.cap_bnd, c.no_new_privs, c.seccomp) == (0, 0, 1, 0)
    assert privilege.parse_status(ROOT_STATUS).cap_eff == 0x1fffeffffff
    with pytest.raises(ValueError, match="NoNewPrivs"):
        privilege.parse_status(STATUS.replace("NoNewPrivs:\t1\n", ""))


def test_creds_problems_name_every_difference():
    ok = privilege.parse_status(STATUS)
    assert privilege.creds_problems(7, ok, 999, 995, (995, 44)) == []
    bad = privilege.parse_status(ROOT_STATUS)
    probs = privilege.creds_problems(7, bad, 999, 995, (995,))
    text = "\n".join(probs)
    assert "PID 7: uids 0/0/0/0, expected 999" in text and "gids 0/0/0/0" in text
    assert "CapEff 000001fffeffffff, expected 0" in text and "NoNewPrivs 0, expected 1" in text
    # one saved uid left behind is enough to refuse
    half = Creds(uids=(999, 999, 0, 999), gids=(995,) * 4, groups=(995,), cap_inh=0, cap_prm=0, cap_eff=0,
                 cap_bnd=0, cap_amb=0, no_new_privs=1)
    assert privilege.creds_problems(8, half, 999, 995, (995,)) == ["PID 8: uids 999/999/0/999, expected 999"]


def test_tree_problems_needs_every_recorded_process():
    ok = privilege.parse_status(STATUS)
    assert privilege.tree_problems({1: ok, 2: ok}, 999, 995, (995, 44), pids=(1, 2)) == []
    assert privilege.tree_problems({1: ok}, 999, 995, (995, 44), pids=(1, 2)) == ["PID 2: no credentials read (gone?)"]
    assert privilege.tree_problems({}, 999, 995, ()) == ["no process of the tree found"]


def _pw(name, uid, gid):
    return SimpleNamespace(pw_name=name, pw_uid=uid, pw_gid=gid, pw_dir="/home/" + name)


def _db(*users):
    by_name = {u.pw_name: u for u in users}
    by_uid = {u.pw_uid: u for u in users}

    def getpwnam(n):
        return by_name[n]

    def getpwuid(u):
        return by_uid[u]

    return dict(getpwnam=getpwnam, getpwuid=getpwuid, grouplist=lambda n, g: [g])


def test_identity_problems():
    same = _db(_pw("vllm-snapshot", 999, 995))
    assert privilege.identity_problems("vllm-snapshot", 999, 995, (995,), **same) == []
    gone = privilege.identity_problems("vllm-snapshot", 999, 995, (995,), **_db())
    assert gone == ["user 'vllm-snapshot' (uid 999) does not exist on this host"]
    renumbered = privilege.identity_problems("vllm-snapshot", 999, 995, (995,), **_db(_pw("vllm-snapshot", 998, 995)))
    assert renumbered == ["user 'vllm-snapshot' has uid 998 here, the snapshot's engine runs as uid 999"]
    taken = privilege.identity_problems("vllm-snapshot", 999, 995, (995,),
                                        **_db(_pw("vllm-snapshot", 998, 995), _pw("mallory", 999, 995)))
    assert "uid 999 belongs to 'mallory' here, not to 'vllm-snapshot'" in taken
    regrouped = privilege.identity_problems("vllm-snapshot", 999, 995, (995,), **_db(_pw("vllm-snapshot", 999, 100)))
    assert regrouped == ["user 'vllm-snapshot' has primary gid 100 here, the snapshot's engine runs as gid 995"]
    more_groups = {**same, "grouplist": lambda n, g: [g, 27]}
    assert "is in groups [27, 995] here" in privilege.identity_problems("vllm-snapshot", 999, 995, (995,), **more_groups)[0]


def test_lookup_reads_the_password_database():
    u = privilege.lookup("root")
    assert (u.name, u.uid, u.gid) == ("root", 0, 0) and 0 in u.groups
    assert privilege.lookup("0").name == "root"
    with pytest.raises(KeyError):
        privilege.lookup("no-such-user-vllm-snapshot-test")


def test_scrubbed_env_gives_the_engine_the_users_home():
    u = User("vllm-snapshot", 999, 995, (995,), "/var/lib/vllm-snapshot-engine")
    env = scrubbed_env({"HOME": "/root", "USER": "root", "PATH": "/bin"}, user=u)
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == (u.home, u.name, u.name)
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(u.home + "/")
    assert scrubbed_env({"HOME": "/root"})["HOME"] == "/root"


def test_manifest_without_a_user_still_parses_as_legacy():
    m = make_manifest(engine=mf.EngineInfo(kind="cpu", sleep_level=0, engine_args=(), env_hashes={},
                                           full_state_captured=True))
    raw = json.loads(mf.to_json(m))
    raw["engine"].pop("user")  # written before the field existed
    raw["digest"] = ""
    import blake3

    raw["digest"] = blake3.blake3(mf._canonical(raw)).hexdigest()
    old = mf.parse(json.dumps(raw))
    assert old.engine.user is None
    with pytest.raises(Exception):
        mf.EngineUser(name="root", uid=0, gid=0, groups=(0,), home="/root")  # never recorded: root is refused


# ------------------------------------------------------------------ create (FakeWorld)

def _create(t: FakeWorld, **kw):
    req = ops.CreateRequest(model="/models/tiny", target=SNAP, engine_args=["--kv-cache-memory-bytes", "64M"], **kw)
    return ops.create(req, Reporter(), tools=t.tools)


def test_create_runs_the_engine_as_the_user_and_records_it():
    t = FakeWorld()
    res = _create(t, user="svc")
    assert t.launch_spec.user == RunAs(name="svc", uid=990, gid=990, groups=(990,), home="/var/lib/vllm-snapshot-engine")
    assert t.launch_env["HOME"] == "/var/lib/vllm-snapshot-engine" and t.launch_env["USER"] == "svc"
    assert res.manifest.engine.user == mf.EngineUser(name="svc", uid=990, gid=990, groups=(990,),
                                                     home="/var/lib/vllm-snapshot-engine")
    c = t.calls
    assert c.index("engine_user") < c.index("engine_access") < c.index("launch_engine")
    assert c.index("inspect_tree") < c.index("tree_creds") < c.index("dump")
    assert ops.CreateRequest(model="m", target=SNAP).user == privilege.DEFAULT_USER


@pytest.mark.parametrize("what,err,words", [
    ("model", UsageError, ["cannot read the model at /models/tiny", "setfacl -R -m u:vllm-snapshot:rX"]),
    ("code", EnvironmentProblem, ["Python environment", "not under /root"]),
    ("home", EnvironmentProblem, ["writable HOME", "install -d -o vllm-snapshot"]),
])
def test_create_refuses_what_the_user_cannot_use_before_the_engine_starts(what, err, words):
    t = FakeWorld()
    t.access = {what: ["cannot read /models/tiny/config.json: Permission denied"]}
    with pytest.raises(err) as e:
        _create(t)
    text = e.value.message + " " + (e.value.hint or "")
    assert all(w in text for w in words), text
    assert "launch_engine" not in t.calls and "snapshot_lock" not in t.calls


def test_create_refuses_a_tree_that_kept_privileges():
    t = FakeWorld()
    bad = privilege.parse_status(ROOT_STATUS)
    t.creds = {4242: bad, 4243: bad}
    with pytest.raises(UnsnapshottableError, match="does not run as vllm-snapshot without privileges"):
        _create(t)
    assert "dump" not in t.calls and t.engine.killed and "publish" not in t.calls


# ------------------------------------------------------------------ restore (FakeWorld)

def _restore(t: FakeWorld):
    return ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123), Reporter(), tools=t.tools)


def test_restore_refuses_a_user_that_is_not_the_same_before_criu():
    t = FakeWorld()
    t.user_identity = ["user 'vllm-snapshot' (uid 990) does not exist on this host"]
    with pytest.raises(IncompatibleHostError) as e:
        _restore(t)
    assert "does not exist" in e.value.message and "useradd --system --uid 990 --gid 990" in e.value.hint
    assert "restore_tree" not in t.calls and "port_free" not in t.calls


def test_restore_checks_the_restored_trees_credentials_before_it_talks_to_it():
    t = FakeWorld()
    r, engine = _restore(t)
    c = t.calls
    assert c.index("restore_tree") < c.index("tree_creds") < c.index("engine.oracle")
    assert not any("ran as root" in w or "unprivileged" in w for w in r.warnings)


def test_restore_kills_a_tree_with_other_credentials_and_never_serves():
    t = FakeWorld()
    bad = privilege.parse_status(ROOT_STATUS)
    t.creds = {5151: bad}
    with pytest.raises(CriuError, match="does not run with the recorded credentials"):
        _restore(t)
    assert t.engine.killed and "engine.oracle" not in t.calls and "serve_engine" not in t.calls


def test_restore_of_a_legacy_snapshot_warns_that_it_runs_as_root():
    m = make_manifest(engine=mf.EngineInfo(kind="cpu", sleep_level=0, engine_args=(), env_hashes={},
                                           full_state_captured=True))
    t = FakeWorld(manifest=m)
    r, engine = _restore(t)
    assert any("runs as root with every capability" in w for w in r.warnings)
    assert "user_problems" not in t.calls and "tree_creds" not in t.calls


# ------------------------------------------------------------------ CRIU's ids

def test_dump_real_ids_only_without_cap_sys_resource():
    full = ROOT_STATUS.replace("000001fffeffffff", "000001ffffffffff")
    assert criu.dump_real_ids(STATUS, full) is None  # root has CAP_SYS_RESOURCE: plain CRIU
    assert criu.dump_real_ids(STATUS, ROOT_STATUS) == (999, 995)  # a container's root without it
    assert criu.dump_real_ids(ROOT_STATUS, ROOT_STATUS) is None  # a tree running as root


def test_criu_runs_through_the_wrapper_with_real_ids():
    r = criu.Criu("/usr/sbin/criu", {"X": "1"}, real_ids=(999, 995))
    env = r._call_env()
    assert env["VLLM_SNAPSHOT_CRIU_BINARY"] == "/usr/sbin/criu" and env["X"] == "1"
    assert (env["VLLM_SNAPSHOT_CRIU_RUID"], env["VLLM_SNAPSHOT_CRIU_RGID"]) == ("999", "995")
    assert os.access(criu.RUID_WRAPPER, os.X_OK)
    assert criu.Criu("/usr/sbin/criu", {"X": "1"})._call_env() == {"X": "1"}


# ------------------------------------------------------------------ the drop itself

@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_drop_to_leaves_no_capability_and_sets_no_new_privs():
    code = ("import os, sys, json; from vllm_snapshot.host.privilege import drop_to, parse_status;"
            "drop_to(65534, 65534, [65534]); c = parse_status(open('/proc/self/status').read());"
            "print(json.dumps([c.uids, c.gids, c.groups, c.cap_eff, c.cap_prm, c.cap_inh, c.cap_bnd, c.cap_amb,"
            " c.no_new_privs]));"
            "import ctypes; os.setuid(0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    got = json.loads(p.stdout)
    assert got == [[65534] * 4, [65534] * 4, [65534], 0, 0, 0, 0, 0, 1]
    assert "PermissionError" in p.stderr  # and there is no way back
    with pytest.raises(PermissionError):
        privilege.drop_to(0, 0, [])


def test_engine_user_record_roundtrips():
    from vllm_snapshot.ops.create import engine_user_record

    u = User(ENGINE_USER.name, ENGINE_USER.uid, ENGINE_USER.gid, ENGINE_USER.groups, ENGINE_USER.home)
    assert engine_user_record(u) == ENGINE_USER


def test_restore_refuses_tls_files_the_engine_user_cannot_read_before_criu(monkeypatch):
    from vllm_snapshot.supervise import frontend
    t = FakeWorld()
    t.user_unreadable = ["/etc/ssl/private/k.pem"]
    # the key pair itself is fine (frontend.check loads it as root); only the engine user cannot read it
    def fake_check(args, environ=None):
        return frontend.Frontend(args=list(args), tls=True, files=["/etc/ssl/private/k.pem", "/etc/ssl/c.pem"])

    monkeypatch.setattr(frontend, "check", stand_in(frontend.check, fake_check))
    with pytest.raises(UsageError) as e:
        ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, frontend=(
            "--ssl-keyfile", "/etc/ssl/private/k.pem", "--ssl-certfile", "/etc/ssl/c.pem")), Reporter(), tools=t.tools)
    assert "cannot read the TLS files" in e.value.message and "/etc/ssl/private/k.pem" in e.value.message
    assert "chgrp vllm-snapshot" in e.value.hint and "restore_tree" not in t.calls


def test_caps_beyond_names_what_a_legacy_root_tree_held_that_the_restorer_lacks():
    from vllm_snapshot.host.privilege import caps_beyond

    full = "Uid:\t0 0 0 0\nGid:\t0 0 0 0\nCapInh:\t0\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\n" \
           "CapBnd:\t000001ffffffffff\nCapAmb:\t0\nNoNewPrivs:\t0\n"
    narrow = full.replace("CapPrm:\t000001ffffffffff", "CapPrm:\t0000000000000001")  # only CAP_CHOWN
    legacy = {"cap_prm": [0xffffffff, 0x1ff], "cap_eff": [0xffffffff, 0x1ff], "cap_inh": [0, 0]}
    assert caps_beyond(legacy, full) == []
    assert caps_beyond(legacy, narrow)[:3] == [1, 2, 3] and 0 not in caps_beyond(legacy, narrow)
    assert caps_beyond({"cap_prm": [0, 0], "cap_eff": [0, 0], "cap_inh": [0, 0]}, narrow) == []  # today's engines
    assert privilege.cap_name(25) == "CAP_SYS_TIME" and privilege.cap_name(40) == "CAP_CHECKPOINT_RESTORE"


def test_legacy_snapshot_refused_before_criu_when_the_restorer_lacks_its_capabilities():
    from pathlib import Path

    from vllm_snapshot import ops
    from vllm_snapshot.errors import EnvironmentProblem
    from vllm_snapshot.report.progress import Reporter

    from fakes import FakeWorld, isolated_manifest

    m = isolated_manifest()
    m = m.model_copy(update={"engine": m.engine.model_copy(update={"user": None})})
    t = FakeWorld(manifest=m)
    t.missing_caps = [21, 25]
    with pytest.raises(EnvironmentProblem, match="capabilities this restore does not have") as ei:
        ops.restore(ops.RestoreRequest(snapshot=Path("/snaps/tiny"), port=8123), Reporter(), tools=t.tools)
    assert "re-create" in ei.value.hint and "restore_tree" not in t.calls and "stage_checking" not in t.calls


@pytest.mark.parametrize("extra,want", [([], privilege.DEFAULT_USER), (["--user", "svc"], "svc")])
def test_serve_builds_as_the_user_it_is_given(monkeypatch, tmp_path, extra, want):
    # `serve` builds a snapshot when none matches: its engine runs as --user, like create's
    from vllm_snapshot.cli import app as cli

    got = []

    def fake_serve(req, rep, tools=None):
        got.append(req)
        raise UsageError("stop here")

    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(tmp_path))
    monkeypatch.setattr(ops, "serve", stand_in(ops.serve, fake_serve))
    assert cli.main(["serve", "/models/tiny", *extra, "--", "--dtype", "float32"]) == 2
    assert [r.user for r in got] == [want] and got[0].engine_args == ["--dtype", "float32"]


@pytest.mark.parametrize("command", ["restore", "verify"])
def test_restore_refuses_a_model_the_engine_user_can_no_longer_read_before_criu(command):
    # a trial: create refuses a model dir the engine user cannot read (exit 2); a restore after
    # a chmod went on to CRIU (a level-2 wake then fails to reload the weights as that user)
    t = FakeWorld()
    t.user_unreadable = ["/models/tiny"]
    with pytest.raises(UsageError) as e:
        if command == "restore":
            ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123), Reporter(), tools=t.tools)
        else:
            ops.verify(SNAP, tools=t.tools)
    assert e.value.exit_code == 2 and "cannot read the model at /models/tiny" in e.value.message
    assert "setfacl -R -m u:vllm-snapshot:rX /models/tiny" in e.value.hint
    assert "restore_tree" not in t.calls and "stage_checking" not in t.calls
    t.user_unreadable = []
    ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123), Reporter(), tools=t.tools)


def test_a_model_directory_that_does_not_exist_is_no_permission_problem(tmp_path):
    # a trial: after `mv MODELDIR elsewhere`, restore said "does not exist" (right) and also
    # "cannot read MODELDIR: Permission denied" with setfacl advice (wrong)
    user = privilege.lookup(privilege.DEFAULT_USER)
    tmp_path.chmod(0o755)
    gone = tmp_path / "moved-away"
    assert privilege.access_problems(user, read=[gone]) == []
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)  # root's, not readable to the engine user: still a problem
    problems = privilege.access_problems(user, read=[hidden])
    assert problems and "Permission denied" in problems[0]
