"""criu: pure option building (argv, pycriu flags), version gate, log excerpt. No CRIU is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_snapshot.checkpoint import criu
from vllm_snapshot.checkpoint.criu import DumpOptions, RestoreOptions, options


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_shared_flags_are_the_measured_set():
    assert criu.SHARED_FLAGS == ("shell-job", "ext-unix-sk", "tcp-established", "link-remap", "file-locks")


def test_dump_argv_content():
    argv = criu.dump_argv(DumpOptions(pid=4242), "/snap/images")
    assert argv[0] == "dump"
    assert _after(argv, "-t") == ["4242"]
    assert _after(argv, "-D") == ["/snap/images"]
    assert _after(argv, "-o") == [criu.DUMP_LOG]
    assert "-v4" in argv
    for f in criu.SHARED_FLAGS:
        assert argv.count(f"--{f}") == 1
    assert "--leave-running" not in argv
    assert "-L" not in argv and "--external" not in argv
    assert "--root" not in argv  # restore-only


def test_dump_argv_external():
    opts = DumpOptions(pid=7, external=("mnt[/a]:a", "dev[1/2]:d"))
    argv = criu.dump_argv(opts, "/x", log="d.log")
    assert _after(argv, "--external") == ["mnt[/a]:a", "dev[1/2]:d"]
    assert _after(argv, "-o") == ["d.log"]


def test_dump_argv_uses_given_flags_only():
    argv = criu.dump_argv(DumpOptions(pid=1, flags=("shell-job",)), "/x")
    assert [a for a in argv if a.startswith("--")] == ["--shell-job"]


class _Repeated(list):
    def add(self, **kw):
        self.append(kw)


class _Rpc:
    """Stands in for pycriu's criu_opts message: plain attributes + repeated fields."""

    def __init__(self):
        self.external = _Repeated()
        self.inherit_fd = _Repeated()


def test_restore_rpc_uses_the_given_flags_inherit_fds_and_root():
    rpc = _Rpc()
    criu.restore_rpc(RestoreOptions(flags=("shell-job", "link-remap"), inherit_fds=(("pipe:[123]", 5), ("pipe:[456]", 7)),
                                    external=("mnt[m0]:/data",)), rpc)
    assert rpc.shell_job is True and rpc.link_remap is True and not hasattr(rpc, "tcp_established")
    assert rpc.root == "/" and rpc.rst_sibling is True and rpc.log_file == criu.RESTORE_LOG
    assert rpc.inherit_fd == [{"key": "pipe:[123]", "fd": 5}, {"key": "pipe:[456]", "fd": 7}]
    assert rpc.external == ["mnt[m0]:/data"]


def test_dump_rpc_sets_pid_log_and_flags():
    rpc = _Rpc()
    criu.dump_rpc(DumpOptions(pid=42), rpc)
    assert rpc.pid == 42 and rpc.log_file == criu.DUMP_LOG and rpc.log_level == criu.LOG_LEVEL
    assert all(getattr(rpc, options._FLAG_TO_OPT[f]) is True for f in criu.SHARED_FLAGS)
    assert rpc.external == []


def test_check_flags_refuses_unknown():
    criu.check_flags(criu.SHARED_FLAGS)
    with pytest.raises(ValueError, match="tcp-close"):
        criu.check_flags(("shell-job", "tcp-close"))


def test_parse_version():
    assert criu.parse_version("Version: 4.2.1\nGitID: v4.2\n") == "4.2.1"
    assert criu.parse_version("hello") is None


def test_plugin_candidates_one_list_for_doctor_and_runs(tmp_path):
    c = criu.plugin_candidates("/opt/criu-src/criu/criu", tmp_path)
    assert c[0] == Path("/opt/criu-src/plugins/cuda/cuda_plugin.so")
    assert c[1] == tmp_path / "criu-4.2.1" / "plugins" / "cuda" / "cuda_plugin.so"
    assert Path("/usr/lib/criu/cuda_plugin.so") in c  # a distro CRIU's plugin dir


def test_find_cuda_plugin_refuses_naming_where_it_looked(tmp_path):
    from vllm_snapshot.errors import EnvironmentProblem

    with pytest.raises(EnvironmentProblem, match="looked in") as ei:
        criu.find_cuda_plugin(str(tmp_path / "criu" / "criu"), is_file=lambda p: False)
    assert "/usr/lib/criu/cuda_plugin.so" in ei.value.message
    so = tmp_path / "plugins" / "cuda" / "cuda_plugin.so"
    assert criu.find_cuda_plugin(str(tmp_path / "criu" / "criu"), is_file=lambda p: p == str(so)) == so


def test_failed_criu_run_keeps_its_log_and_names_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / criu.DUMP_LOG).write_text("(00.1) info\n(00.2) Error (criu/mount.c:1): FS mnt ./mnt/x unsupported\n")
    runner = criu.Criu("/nonexistent/criu", keep_log_dir=tmp_path / "logs")
    err = runner._failed("dump", work, criu.DUMP_LOG)
    kept = Path(err.details["log"])
    assert kept.parent == tmp_path / "logs" and kept.is_file() and "unsupported" in kept.read_text()
    assert str(kept) in err.hint and "FS mnt" in err.message
    (work / criu.DUMP_LOG).unlink()  # the work dir is removed after a failed create
    assert kept.is_file()


class _FakeOpts:
    """Stands in for pycriu's criu_opts: records attribute assignments."""

    def __init__(self):
        self.__dict__["set"] = {}

    def __setattr__(self, name, value):
        self.set[name] = value


def test_apply_flags_sets_pycriu_booleans():
    o = _FakeOpts()
    criu.apply_flags(o, criu.SHARED_FLAGS)
    assert o.set == {"shell_job": True, "ext_unix_sk": True, "tcp_established": True,
                     "link_remap": True, "file_locks": True}


def test_apply_flags_subset():
    o = _FakeOpts()
    criu.apply_flags(o, ("link-remap",))
    assert o.set == {"link_remap": True}


def test_apply_flags_refuses_unknown_flag():
    o = _FakeOpts()
    with pytest.raises(ValueError, match="tcp-close"):
        criu.apply_flags(o, ("shell-job", "tcp-close"))


def test_every_shared_flag_maps_to_an_rpc_option():
    # a flag added to SHARED_FLAGS without an RPC mapping, or mapped to a misspelt field, would
    # make every dump fail: pycriu's real message refuses a field it does not have
    import pycriu

    req = pycriu.rpc.criu_opts()
    criu.apply_flags(req, criu.SHARED_FLAGS)
    assert {f.name: v for f, v in req.ListFields()} == {options._FLAG_TO_OPT[f]: True for f in criu.SHARED_FLAGS}
    assert set(options._FLAG_TO_OPT.values()) <= set(req.DESCRIPTOR.fields_by_name)  # every mapping, shared or not


def test_dump_and_restore_rpc_fill_a_real_criu_opts_message():
    # the _Rpc stand-in above accepts any attribute; the real message checks names and types
    import pycriu

    req = pycriu.rpc.criu_opts()
    criu.restore_rpc(RestoreOptions(inherit_fds=(("pipe:[123]", 5), ("pipe:[456]", 7)), external=("mnt[m0]:/data",),
                                    network_lock="skip"), req)
    assert req.rst_sibling and req.root == "/" and req.log_file == criu.RESTORE_LOG
    assert [(i.key, i.fd) for i in req.inherit_fd] == [("pipe:[123]", 5), ("pipe:[456]", 7)]
    assert list(req.external) == ["mnt[m0]:/data"] and req.HasField("network_lock")
    assert all(getattr(req, options._FLAG_TO_OPT[f]) is True for f in criu.SHARED_FLAGS)
    req = pycriu.rpc.criu_opts()
    criu.dump_rpc(DumpOptions(pid=42, external=("mnt[/a]:a",)), req)
    assert req.pid == 42 and req.log_file == criu.DUMP_LOG and list(req.external) == ["mnt[/a]:a"]


@pytest.mark.parametrize("version,ok", [
    ("4.2", True), ("4.2.1", True), ("4.10", True), ("4.10.0", True), ("5.0", True),
    ("4.1.1", False), ("4.1", False), ("3.19", False), ("3.99.9", False),
])
def test_version_ok(version, ok):
    assert criu.version_ok(version) is ok


def test_log_excerpt_picks_error_lines_with_context(tmp_path):
    lines = [f"(00.{i:06d}) info line {i}" for i in range(20)]
    lines[3] = "(00.000003) Error (criu/cr-restore.c:1): RLIMIT_NOFILE noise we always see"
    lines[12] = "(00.000012) Error (criu/files.c:42): cannot open pipe:[99]"
    lines[15] = "(00.000015) info after"
    log = tmp_path / "criu-restore.log"
    log.write_text("\n".join(lines) + "\n")
    out = criu.log_excerpt(log, context=2).splitlines()
    assert out == lines[10:13]
    assert not any("RLIMIT_NOFILE" in x for x in out)


def test_log_excerpt_merges_overlapping_context_and_limits(tmp_path):
    lines = [f"l{i}" for i in range(100)]
    for i in (10, 11, 50, 90):
        lines[i] = f"Error at {i}"
    log = tmp_path / "l.log"
    log.write_text("\n".join(lines))
    out = criu.log_excerpt(log, context=3, limit=30).splitlines()
    want = lines[7:12] + lines[47:51] + lines[87:91]
    assert out == want  # sorted, no duplicates
    short = criu.log_excerpt(log, context=3, limit=5).splitlines()
    assert short == want[-5:]


def test_log_excerpt_without_errors_returns_the_tail(tmp_path):
    lines = [f"l{i}" for i in range(30)]
    log = tmp_path / "l.log"
    log.write_text("\n".join(lines))
    assert criu.log_excerpt(log, context=4).splitlines() == lines[-8:]


def test_log_excerpt_missing_log_is_empty(tmp_path):
    assert criu.log_excerpt(tmp_path / "nope.log") == ""


def test_find_criu_prefers_env_and_refuses_when_absent(tmp_path, monkeypatch):
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VLLM_SNAPSHOT_CRIU", str(fake))
    assert criu.find_criu() == str(fake.resolve())
    assert criu.criu_version(str(fake)) == "4.2.1"
    monkeypatch.setenv("VLLM_SNAPSHOT_CRIU", str(tmp_path / "missing"))
    monkeypatch.setenv("VLLM_SNAPSHOT_CACHE", str(tmp_path / "nocache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    from vllm_snapshot.errors import EnvironmentProblem

    with pytest.raises(EnvironmentProblem):
        criu.find_criu()


def test_criu_version_unparsable_output(tmp_path):
    from vllm_snapshot.errors import EnvironmentProblem

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho hello\n")
    fake.chmod(0o755)
    with pytest.raises(EnvironmentProblem, match="cannot parse"):
        criu.criu_version(str(fake))


@pytest.mark.parametrize("line,words", [
    ("(00.06) Error (criu/mount.c:724): mnt: FS mnt ./mnt/wtm-other dev 0x700002 root / unsupported id 72",
     "holds /mnt/wtm-other, a file system CRIU cannot re-create"),
    ("(00.1) Error (criu/mount.c:753): mnt: 99:./etc/resolv.conf doesn't have a proper root mount",
     "/etc/resolv.conf is a bind mount"),
    ("(00.1) Error (criu/mount.c:3141): mnt: No mapping for 87:(null) mountpoint", "not given back at restore"),
    ("Error (criu/files-reg.c:1): Can't lookup mount=24 for fd=10 path=/dev/null", "fd 10 (/dev/null)"),
])
def test_explain_says_what_failed_in_words(line, words):
    assert words in criu.explain("(00.0) info\n" + line + "\n")


def test_explain_unknown_is_none():
    assert criu.explain("(00.0) Error (criu/x.c:1): something new") is None


def test_failed_run_message_leads_with_the_explanation(tmp_path):
    (tmp_path / criu.DUMP_LOG).write_text("(00.2) Error (criu/mount.c:724): mnt: FS mnt ./mnt/x dev 0x7 root / unsupported id 7\n")
    err = criu.Criu("/x", keep_log_dir=tmp_path / "logs")._failed("dump", tmp_path, criu.DUMP_LOG)
    assert err.message.startswith("CRIU dump failed: the engine's mount namespace holds /mnt/x")


def test_network_lock_only_when_asked():
    assert "--network-lock" not in criu.dump_argv(DumpOptions(pid=1), "/x")
    argv = criu.dump_argv(DumpOptions(pid=1, network_lock=criu.NETWORK_LOCK_ISOLATED), "/x")
    assert _after(argv, "--network-lock") == ["skip"]
    rpc = _Rpc()
    criu.dump_rpc(DumpOptions(pid=1), rpc)
    assert not hasattr(rpc, "network_lock")  # CRIU's default stays


def test_network_lock_rpc_values_are_criu_4_2_1s():
    """The enum values are images/rpc.proto's criu_network_lock_method, as pycriu has them."""
    rpc_pb2 = pytest.importorskip("pycriu.rpc_pb2", reason="pycriu comes from scripts/setup.sh")
    for name, value in options._NETWORK_LOCK_RPC.items():
        assert getattr(rpc_pb2, name.upper()) == value
    d, r = _Rpc(), _Rpc()
    criu.dump_rpc(DumpOptions(pid=1, network_lock="skip"), d)
    criu.restore_rpc(RestoreOptions(network_lock="skip"), r)
    assert d.network_lock == r.network_lock == rpc_pb2.SKIP


def test_unknown_network_lock_refused():
    with pytest.raises(ValueError, match="network lock"):
        criu.restore_rpc(RestoreOptions(network_lock="ebtables"), _Rpc())


# --- issue 20: the CUDA path ----------------------------------------------------------------------

def test_freeze_timeout_covers_every_helper_run_of_the_tree():
    # a vLLM TP1 tree: API root, EngineCore (CUDA), resource tracker -> 3 + 2*1 helper runs
    assert criu.freeze_timeout("cuda", 3, 1, {}) == criu.FREEZE_MARGIN_S + criu.HELPER_RUN_S * 5 == 80
    assert criu.freeze_timeout("cuda", 0, 0, {}) == 30 + 10 * 3  # at least one CUDA process assumed
    assert criu.freeze_timeout("cuda", 3, 1, {}) > criu.CRIU_DEFAULT_TIMEOUT_S * 2  # 10 s was the bug
    assert criu.freeze_timeout("cpu", 4, 0, {}) is None  # CRIU's default stays for CPU engines
    env = {criu.FREEZE_TIMEOUT_ENV: "300"}
    assert criu.freeze_timeout("cuda", 3, 1, env) == 300 and criu.freeze_timeout("cpu", 3, 0, env) == 300
    from vllm_snapshot.errors import UsageError

    for bad in ("0", "-5", "1.5", "soon"):
        with pytest.raises(UsageError, match=criu.FREEZE_TIMEOUT_ENV):
            criu.freeze_timeout("cuda", 3, 1, {criu.FREEZE_TIMEOUT_ENV: bad})


def test_dump_timeout_goes_into_the_rpc_and_the_recorded_argv():
    pytest.importorskip("pycriu")
    import pycriu

    opts = DumpOptions(pid=7, timeout_s=80)
    req = pycriu.rpc.criu_opts()
    criu.dump_rpc(opts, req)
    assert req.HasField("timeout") and req.timeout == 80
    assert _after(criu.dump_argv(opts, "/i"), "--timeout") == ["80"]
    req = pycriu.rpc.criu_opts()
    criu.dump_rpc(DumpOptions(pid=7), req)
    assert not req.HasField("timeout") and "--timeout" not in criu.dump_argv(DumpOptions(pid=7), "/i")


def test_plugin_must_come_from_the_binarys_build(tmp_path):
    from vllm_snapshot.errors import EnvironmentProblem

    src = tmp_path / "criu-4.2.1"
    (src / "criu").mkdir(parents=True)
    (src / "plugins" / "cuda").mkdir(parents=True)
    (src / "criu" / "criu").write_bytes(b"criu 4.2.1 build")
    plugin = src / "plugins" / "cuda" / "cuda_plugin.so"
    plugin.write_bytes(b"plugin")
    assert criu.paired(plugin, str(src / "criu" / "criu"))
    copy = tmp_path / "bin" / "criu"  # a byte-identical copy of that build's binary
    copy.parent.mkdir()
    copy.write_bytes(b"criu 4.2.1 build")
    assert criu.paired(plugin, str(copy))
    other = tmp_path / "other-criu"  # e.g. a system CRIU of another version
    other.write_bytes(b"criu 4.1 distro")
    assert not criu.paired(plugin, str(other))
    with pytest.raises(EnvironmentProblem, match="built for another CRIU") as ei:
        criu.find_cuda_plugin(str(other), cache=tmp_path)
    assert str(plugin) in ei.value.message and "VLLM_SNAPSHOT_CRIU" in ei.value.hint
    assert criu.find_cuda_plugin(str(copy), cache=tmp_path) == plugin
    # distribution pairs: same prefix only
    assert criu.paired(Path("/usr/lib/criu/cuda_plugin.so"), "/usr/sbin/criu")
    assert criu.paired(Path("/usr/local/lib/criu/cuda_plugin.so"), "/usr/local/sbin/criu")
    assert not criu.paired(Path("/usr/lib/criu/cuda_plugin.so"), "/usr/local/sbin/criu")


def test_config_file_libdir_is_found_and_refused(tmp_path):
    from vllm_snapshot.errors import EnvironmentProblem

    texts = {"/etc/criu/default.conf": "# site config\ntcp-established\nlibdir /opt/plugins  # ours\n",
             "/home/u/.criu/default.conf": "--libdir=/x\n", "/cfg": "L /y\n"}
    found = criu.config_libdirs(texts.get, {"HOME": "/home/u", "CRIU_CONFIG_FILE": "/cfg"})
    assert found == [("/etc/criu/default.conf", "/opt/plugins"), ("/home/u/.criu/default.conf", "/x"), ("/cfg", "/y")]
    assert criu.config_libdirs(lambda p: None, {}) == []
    with pytest.raises(EnvironmentProblem, match="beats CRIU_LIBS_DIR"):
        criu.check_config_libdir(tmp_path, texts.get, {"HOME": "/nobody"})
    criu.check_config_libdir(Path("/opt/plugins"), {"/etc/criu/default.conf": "libdir /opt/plugins\n"}.get, {})


def test_cuda_env_refuses_a_helper_override_criu_would_not_run(tmp_path, monkeypatch):
    from vllm_snapshot.errors import EnvironmentProblem

    binary = tmp_path / "src" / "criu" / "criu"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"x")
    (tmp_path / "src" / "plugins" / "cuda").mkdir(parents=True)
    (tmp_path / "src" / "plugins" / "cuda" / "cuda_plugin.so").write_bytes(b"p")
    monkeypatch.setattr(criu.find, "_read_text", lambda p: None)  # no host config files in the way
    wrong = tmp_path / "nv-checkpoint"
    wrong.write_text("#!/bin/sh\n")
    wrong.chmod(0o755)
    monkeypatch.setenv("VLLM_SNAPSHOT_CUDA_CHECKPOINT", str(wrong))
    with pytest.raises(EnvironmentProblem, match="named cuda-checkpoint"):
        criu.cuda_env(str(binary))
    good = tmp_path / "nv" / "cuda-checkpoint"
    good.parent.mkdir()
    good.write_text("#!/bin/sh\n")
    good.chmod(0o755)
    monkeypatch.setenv("VLLM_SNAPSHOT_CUDA_CHECKPOINT", str(good))
    env = criu.cuda_env(str(binary))
    assert env["PATH"].startswith(f"{good.parent}:") and env["CRIU_LIBS_DIR"] == str(tmp_path / "src" / "plugins" / "cuda")


LOG_OK = ("(00.01) cuda_plugin: initialized: cuda_plugin stage 1\n"
          "(00.02) Error (cuda_plugin.c:221): cuda_plugin: Failed to launch cuda-checkpoint to retrieve restore tid: "
          "cuda-checkpoint: --get-restore-tid --pid 10 failed: cuCheckpointProcessGetRestoreThreadId: CUDA_ERROR_INVALID_VALUE\n"
          "(00.03) cuda_plugin: no need to pause devices on pid 10\n"
          "(00.04) cuda_plugin: pausing devices on pid 11\n"
          "(00.05) cuda_plugin: Checkpointing CUDA devices on pid 11 restore_tid 12\n")


@pytest.mark.parametrize("log, why", [
    ("(00.01) Loading plugins\n", "did not load its CUDA plugin"),
    ("cuda_plugin: No GPU device found; CUDA plugin is disabled\n", "found no GPU"),
    ("Warn (cuda_plugin.c:585): cuda_plugin: check that cuda-checkpoint is present in $PATH\n",
     "could not run `cuda-checkpoint -h`"),
    ("cuda_plugin: cuda-checkpoint --action flag not supported, an r555 or higher version driver is required.\n",
     "no checkpoint API"),
    (LOG_OK.replace("pid 11 restore_tid 12", "").replace("Checkpointing CUDA devices on", "x"), "checkpointed no process"),
    (LOG_OK + "Error: cuda_plugin: Failed to launch cuda-checkpoint to retrieve restore tid: "
     "cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE\n",
     "could not use the driver: cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE"),
])
def test_cuda_dump_log_must_show_the_plugin_checkpointing(log, why):
    from vllm_snapshot.errors import CriuError

    criu.check_cuda_log(LOG_OK, "dump")
    with pytest.raises(CriuError, match="CRIU dump of a CUDA engine") as ei:
        criu.check_cuda_log(log, "dump")
    assert why in ei.value.message


def test_cuda_restore_log_refuses_a_logged_restore_failure():
    from vllm_snapshot.errors import CriuError

    ok = "cuda_plugin: initialized: cuda_plugin stage 4\ncuda_plugin: resuming devices on pid 30\n"
    criu.check_cuda_log(ok, "restore")
    with pytest.raises(CriuError, match="restore of the GPU state failed: CUDA_ERROR_OUT_OF_MEMORY"):
        criu.check_cuda_log(ok + "Error: cuda_plugin: RESUME_DEVICES RESTORE failed with CUDA_ERROR_OUT_OF_MEMORY\n",
                            "restore")


# ----------------------------------------------------------------------------- restore notifications

def _fake_criu(script: list[str], fail_at: str | None = None):
    """A swrk stand-in on a socketpair: reads the restore request, sends one NOTIFY per name in
    ``script`` and records the answers, then answers the restore (failed when a notification
    was answered with failure, as CRIU aborts then)."""
    import socket
    import threading

    pycriu = pytest.importorskip("pycriu")
    rpc = pycriu.rpc
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seen: dict = {"acks": []}

    def serve() -> None:
        req = rpc.criu_req()
        req.ParseFromString(theirs.recv(1 << 20))
        seen["notify_scripts"] = req.opts.notify_scripts
        ok = True
        for name in script:
            msg = rpc.criu_resp()
            msg.type = rpc.NOTIFY
            msg.success = True
            msg.notify.script = name
            theirs.send(msg.SerializeToString())
            ack = rpc.criu_req()
            ack.ParseFromString(theirs.recv(1 << 20))
            seen["acks"].append((name, ack.type == rpc.NOTIFY and ack.notify_success))
            if not ack.notify_success:
                ok = False
                break
        resp = rpc.criu_resp()
        resp.type = rpc.RESTORE
        resp.success = ok
        if ok:
            resp.restore.pid = 4242
        theirs.send(resp.SerializeToString())

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    req = rpc.criu_req()
    req.type = rpc.RESTORE
    req.opts.images_dir_fd = 3
    req.opts.notify_scripts = True
    return criu.Swrk(ours), req, seen, th


NOTES = ["pre-restore", "setup-namespaces", "post-setup-namespaces", "post-restore", "pre-resume"]


def test_restore_waits_for_before_memory_at_post_setup_namespaces():
    swrk, req, seen, th = _fake_criu(NOTES)
    calls = []
    resp = criu.restore_notified(swrk, req, lambda: calls.append(len(seen["acks"])), [])
    th.join(5)
    assert resp.pid == 4242 and seen["notify_scripts"]
    assert calls == [2]  # called once, when post-setup-namespaces arrived (two answered before)
    assert seen["acks"] == [(n, True) for n in NOTES]


def test_a_failing_before_memory_aborts_criu_and_is_kept():
    from vllm_snapshot.errors import CorruptSnapshotError

    swrk, req, seen, th = _fake_criu(NOTES)
    failed: list = []

    def bad() -> None:
        raise CorruptSnapshotError("frame 3 fails its checksum")

    with pytest.raises(criu.RpcFailed):
        criu.restore_notified(swrk, req, bad, failed)
    th.join(5)
    assert seen["acks"][-1] == ("post-setup-namespaces", False)  # CRIU is told to abort
    assert [type(e) for e in failed] == [CorruptSnapshotError]


def test_without_the_notification_before_memory_runs_after_criu():
    swrk, req, seen, th = _fake_criu(["pre-restore", "post-restore"])
    calls = []
    resp = criu.restore_notified(swrk, req, lambda: calls.append("late"), [])
    th.join(5)
    assert resp.pid == 4242 and calls == ["late"]


def test_log_excerpt_leaves_out_the_cuda_plugins_benign_not_cuda_lines(tmp_path):
    """Review gpu-path-2 L2: every non-CUDA process of a CUDA dump/restore makes CRIU 4.2.1's
    plugin log an ``Error`` line; they must not push the real error out of the excerpt. A line
    where our helper says it cannot reach the driver (``unavailable:``) is kept."""
    benign = ("(00.1) Error (plugins/cuda/cuda_plugin.c:221): cuda_plugin: Failed to launch cuda-checkpoint "
              "to retrieve restore tid: cuda-checkpoint: no CUDA in process {}")
    real = "(00.2) Error (criu/files-reg.c:2136): Can't open file dev/nvidiactl on restore"
    lines = ["(00.0) info"] * 5 + [real] + [benign.format(i) for i in range(40)]
    unavailable = ("(00.3) Error (plugins/cuda/cuda_plugin.c:221): cuda_plugin: Failed to launch cuda-checkpoint "
                   "to retrieve restore tid: cuda-checkpoint: unavailable: cuInit: CUDA_ERROR_NO_DEVICE")
    log = tmp_path / "criu-restore.log"
    log.write_text("\n".join(lines + [unavailable]) + "\n")
    out = criu.log_excerpt(log, context=2)
    assert real in out and unavailable in out
    assert "no CUDA in process" not in out


def test_a_criu_run_killed_before_it_logged_says_its_log_is_empty(tmp_path):
    # a trial: Ctrl-C during the dump: "CRIU dump failed; log excerpt:" and nothing after it
    work = tmp_path / "work"
    work.mkdir()
    (work / criu.DUMP_LOG).write_text("")
    runner = criu.Criu("/nonexistent/criu", keep_log_dir=tmp_path / "logs")
    err = runner._failed("dump", work, criu.DUMP_LOG)
    assert "excerpt" not in err.message and err.message == f"CRIU dump failed; its log {err.details['log']} is empty"
    (work / criu.DUMP_LOG).unlink()
    err = runner._failed("dump", work, criu.DUMP_LOG)
    assert err.message == f"CRIU dump failed; it wrote no log ({work / criu.DUMP_LOG})"


# ----------------------------------------------------------------------------- the runner's own transport

FAKE_SWRK = r"""#!{python}
# a `criu swrk FD` stand-in: records what it was given, answers one request as CRIU would
import ctypes, json, os, socket, sys
from pycriu import rpc_pb2 as rpc
sk = socket.socket(fileno=int(sys.argv[2]))
req = rpc.criu_req()
req.ParseFromString(sk.recv(1 << 20))
inherit = [f.fd for f in req.opts.inherit_fd]
with open(os.environ["FAKE_SWRK_OUT"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "type": req.type,
               "open": [fd for fd in inherit if os.path.exists(f"/proc/self/fd/{{fd}}")],
               "stdin": os.readlink("/proc/self/fd/0"),
               "merge": ctypes.CDLL(None).prctl(68, 0, 0, 0, 0)}}, f)  # PR_GET_MEMORY_MERGE
resp = rpc.criu_resp()
resp.type = req.type
resp.success = {success}
resp.restore.pid = 4343
sk.send(resp.SerializeToString())
"""


def _fake_swrk(tmp_path, success=True):
    import sys

    pytest.importorskip("pycriu")
    fake = tmp_path / "criu"
    fake.write_text(FAKE_SWRK.format(python=sys.executable, success=success))
    fake.chmod(0o755)
    for d in ("images", "work"):
        (tmp_path / d).mkdir()
    return fake


def test_the_runner_spawns_swrk_with_its_env_and_leaves_this_processs_alone(tmp_path, monkeypatch):
    """CRIU gets this process's environment plus the runner's own (a CUDA run's CRIU_LIBS_DIR),
    given to the child: os.environ is never changed while the call runs (worker threads read it),
    and the fds a restore hands to the tree (inherit_fd) are open in CRIU."""
    import json
    import os

    fake = _fake_swrk(tmp_path)
    out = tmp_path / "out.json"
    monkeypatch.setenv("FAKE_SWRK_OUT", str(out))
    before = dict(os.environ)
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        runner = criu.Criu(str(fake), {"CRIU_LIBS_DIR": "/opt/plugins"}, keep_log_dir=tmp_path / "logs", timeout_s=30)
        pid = runner.restore(RestoreOptions(inherit_fds=(("pipe:[1]", r),)), tmp_path / "images", tmp_path / "work")
    finally:
        os.close(r)
        os.close(w)
    got = json.loads(out.read_text())
    assert pid == 4343
    assert got["argv"][0] == "swrk" and got["env"]["CRIU_LIBS_DIR"] == "/opt/plugins"
    assert got["env"]["FAKE_SWRK_OUT"] == str(out)  # this process's environment, plus the runner's
    assert got["open"] == [r] and got["stdin"] == "/dev/null"
    assert dict(os.environ) == before and "CRIU_LIBS_DIR" not in os.environ


def test_a_failed_answer_keeps_the_log_and_names_it(tmp_path, monkeypatch):
    fake = _fake_swrk(tmp_path, success=False)
    monkeypatch.setenv("FAKE_SWRK_OUT", str(tmp_path / "out.json"))
    (tmp_path / "work" / criu.DUMP_LOG).write_text("(00.2) Error (criu/mount.c:1): FS mnt ./mnt/x dev 0:52 root / "
                                                   "unsupported\n")
    from vllm_snapshot.errors import CriuError

    with pytest.raises(CriuError, match="CRIU dump failed: the engine's mount namespace holds /mnt/x") as ei:
        criu.Criu(str(fake), keep_log_dir=tmp_path / "logs", timeout_s=30).dump(
            DumpOptions(pid=1), tmp_path / "images", tmp_path / "work")
    assert Path(ei.value.details["log"]).parent == tmp_path / "logs"


def test_a_criu_that_cannot_start_is_a_criu_error(tmp_path):
    from vllm_snapshot.errors import CriuError

    pytest.importorskip("pycriu")
    for d in ("images", "work"):
        (tmp_path / d).mkdir()
    with pytest.raises(CriuError, match="it wrote no log"):
        criu.Criu(str(tmp_path / "no-criu"), keep_log_dir=tmp_path / "logs").dump(
            DumpOptions(pid=1), tmp_path / "images", tmp_path / "work")
