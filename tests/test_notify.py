"""sd_notify client against a real AF_UNIX datagram socket; the NotifyingReporter; the restore
command's notifications (ops faked: no engine, no CRIU); the systemd unit files."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_snapshot.cli import app as cli
from vllm_snapshot.host import notify
from vllm_snapshot import ops
from vllm_snapshot.report.progress import NotifyingReporter, Reporter
from helpers import stand_in

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "scripts" / "systemd"


class Listener:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, addr):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.sock.settimeout(2)

    def recv(self) -> bytes:
        return self.sock.recv(4096)

    def pending(self) -> list[bytes]:
        out = []
        self.sock.settimeout(0.05)
        try:
            while True:
                out.append(self.sock.recv(4096))
        except (socket.timeout, BlockingIOError):
            return out
        finally:
            self.sock.settimeout(2)

    def close(self):
        self.sock.close()


@pytest.fixture
def path_socket(monkeypatch):
    # A short directory: AF_UNIX paths are limited to 107 bytes.
    d = tempfile.mkdtemp(prefix="ntf-")
    path = os.path.join(d, "notify")
    lis = Listener(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield lis
    lis.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def abstract_socket(monkeypatch):
    name = f"vllm-snapshot-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lis = Listener(b"\0" + name.encode())
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield lis
    lis.close()


def test_notify_sends_the_exact_bytes(path_socket):
    assert notify.notify("READY=1\nSTATUS=hello") is True
    assert path_socket.recv() == b"READY=1\nSTATUS=hello"


def test_helpers(path_socket):
    assert notify.ready("serving tiny on http://127.0.0.1:8000", mainpid=4242)
    assert path_socket.recv() == b"READY=1\nSTATUS=serving tiny on http://127.0.0.1:8000\nMAINPID=4242"
    assert notify.ready()
    assert path_socket.recv() == b"READY=1"
    assert notify.status("CRIU restore")
    assert path_socket.recv() == b"STATUS=CRIU restore"
    assert notify.stopping()
    assert path_socket.recv() == b"STOPPING=1"


def test_status_is_one_line(path_socket):
    notify.status("two\nlines")
    assert path_socket.recv() == b"STATUS=two lines"


def test_abstract_socket(abstract_socket):
    assert notify.status("abstract works") is True
    assert abstract_socket.recv() == b"STATUS=abstract works"


def test_unset_or_unusable_socket_returns_false(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False
    assert notify.ready("x") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify.stopping() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")  # neither a path nor '@'
    assert notify.status("x") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert notify.status("x") is False  # ENOENT is swallowed, never raised


# --- NotifyingReporter ------------------------------------------------------------------------

class Recording(Reporter):
    def __init__(self):
        super().__init__()
        self.calls = []

    def start(self, name, label):
        self.calls.append(("start", name, label))

    def end(self, name, label, seconds, ok):
        self.calls.append(("end", name, label, ok))

    def info(self, text):
        self.calls.append(("info", text))


def test_notifying_reporter_sends_status_per_phase(path_socket):
    inner = Recording()
    rep = NotifyingReporter(inner)
    with rep.phase("validate", "validating snapshot, host and model"):
        pass
    with rep.phase("criu_restore", "CRIU restore"):
        pass
    rep.info("hello")
    assert path_socket.pending() == [b"STATUS=validating snapshot, host and model", b"STATUS=CRIU restore"]
    assert inner.calls[0] == ("start", "validate", "validating snapshot, host and model")
    assert inner.calls[1][:4] == ("end", "validate", "validating snapshot, host and model", True)
    assert inner.calls[-1] == ("info", "hello")
    # one timings dict: what ops reads from the wrapper is the inner reporter's
    assert set(rep.timings) == {"validate", "criu_restore"} and rep.timings is inner.timings


def test_notifying_reporter_reports_a_failed_phase(path_socket):
    rep = NotifyingReporter(Recording())
    with pytest.raises(RuntimeError):
        with rep.phase("oracle", "replaying the oracle"):
            raise RuntimeError("boom")
    assert path_socket.pending() == [b"STATUS=replaying the oracle", b"STATUS=replaying the oracle: failed"]


def test_notifying_reporter_without_socket_is_silent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    inner = Recording()
    with NotifyingReporter(inner).phase("stage"):
        pass
    assert [c[0] for c in inner.calls] == ["start", "end"]


# --- the restore command's notifications (ops faked) ------------------------------------------

def _fake_restored():
    from vllm_snapshot.report.results import Restored

    return (Restored("/snap", 999, "http://127.0.0.1:8123", "tiny", {"validate": 0.1}, []),
            SimpleNamespace(close=lambda: None))


def test_restore_command_notifies_phases_ready_and_stopping(path_socket, monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_restore(req, rep, tools=None):
        seen["wrapped"] = isinstance(rep, NotifyingReporter)
        with rep.phase("validate", "validating snapshot, host and model"):
            pass
        # READY must not have been sent before restore returns
        seen["before_return"] = path_socket.pending()
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        seen["at_serve"] = path_socket.pending()
        on_signal_msg("received signal 15; stopping the engine")
        on_signal_msg("received signal 15; stopping the engine")
        return 0

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    code = cli.main(["restore", str(tmp_path), "--port", "8123", "-q"])
    assert code == 0
    assert seen["wrapped"] is True
    assert seen["before_return"] == [b"STATUS=validating snapshot, host and model"]
    assert seen["at_serve"] == [f"READY=1\nSTATUS=serving tiny on http://127.0.0.1:8123\nMAINPID={os.getpid()}".encode()]
    assert path_socket.pending() == [b"STOPPING=1"]  # once, on the first signal


def test_restore_command_stopping_when_engine_exits_on_its_own(path_socket, monkeypatch, tmp_path):
    def fake_restore(req, rep, tools=None):
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        return 3

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    assert cli.main(["restore", str(tmp_path), "--port", "8123", "-q"]) == 3
    assert path_socket.pending() == [f"READY=1\nSTATUS=serving tiny on http://127.0.0.1:8123\nMAINPID={os.getpid()}".encode(),
                                     b"STOPPING=1"]


def test_restore_command_engine_killed_while_serving_exits_8_with_its_reason(path_socket, monkeypatch, tmp_path, capsys):
    # a trial: `kill -9 <engine PID>` under a foreground restore: exit 137, nothing said
    from vllm_snapshot.ops.restore import died_while_serving

    def fake_restore(req, rep, tools=None):
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        raise died_while_serving(r, 137)

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    assert cli.main(["restore", str(tmp_path), "--port", "8123", "-q"]) == 8
    err = capsys.readouterr().err
    assert "error [engine-failed]" in err and "PID 999" in err and "killed by SIGKILL" in err, err
    assert "journalctl" in err, err  # where its log is: the journal under systemd
    assert path_socket.pending()[-1] == b"STOPPING=1"


@pytest.mark.parametrize("flags", [["-q"], ["--json"], []])
def test_the_signal_the_command_received_is_said_on_stderr_even_when_quiet(monkeypatch, tmp_path, capsys, flags):
    # a trial: SIGHUP to `restore -q` logged only the engine's "SIGTERM: draining"
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)

    def fake_restore(req, rep, tools=None):
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        on_signal_msg("received SIGHUP; stopping the engine (draining: ...)")
        return 0

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    assert cli.main(["restore", str(tmp_path), "--port", "8123", *flags]) == 0
    assert "received SIGHUP; stopping the engine" in capsys.readouterr().err


def test_ctrl_c_in_the_foreground_is_said_in_one_line_naming_the_signal_received(monkeypatch, tmp_path, capsys):
    # a trial: Ctrl-C printed "received SIGINT; stopping the engine ..." and the engine's own
    # "SIGTERM: draining ..." (the signal the command forwarded): two signals named for one key
    from vllm_snapshot.engine.protocol import cut_line, drain_line

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    seen = {}

    def fake_restore(req, rep, tools=None):
        seen["log"] = req.engine_log
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        log = seen["log"]
        log(b"INFO engine serving\n" + drain_line("SIGTERM", 0, 30).encode() + b"\n")  # sent by someone else: kept
        on_signal_msg("received SIGINT; stopping the engine (draining: ...)")
        log(drain_line("SIGTERM", 2, 30).encode() + b"\nINFO shutting down\n")
        on_signal_msg("received SIGINT; stopping the engine now (requests still in flight are cut)")
        log(cut_line("SIGTERM", 2).encode() + b"\n")
        log(drain_line("SIGTERM", 0, 30).encode() + b"\n")  # no third signal was forwarded: kept
        return 0

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    assert cli.main(["restore", str(tmp_path), "--port", "8123", "-q"]) == 0
    err = capsys.readouterr().err
    assert err.count("received SIGINT; stopping the engine") == 2, err
    assert err.count("SIGTERM: draining") == 2 and "cancelling" not in err, err
    assert "2 request(s) in flight" not in err and "INFO engine serving" in err and "INFO shutting down" in err, err


def test_serve_command_notifies_ready_only_after_serve_returned(path_socket, monkeypatch, tmp_path):
    from vllm_snapshot.report.results import Served

    seen = {}

    def fake_serve(req, rep, tools=None):
        seen["req"] = req
        with rep.phase("engine_start", "starting engine (load, compile, warm-up)"):
            pass
        seen["before_return"] = path_socket.pending()
        r, engine = _fake_restored()
        return Served("built", r, "k" * 64, [], [], {"engine_start": 1.0}, 1.0), engine

    def fake_foreground(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        seen["at_serve"] = path_socket.pending()
        return 0

    monkeypatch.setenv("VLLM_SNAPSHOT_ROOT", str(tmp_path))
    monkeypatch.setattr(ops, "serve", stand_in(ops.serve, fake_serve))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_foreground))
    # `vllm serve` form: --port among the engine args is serve's own
    assert cli.main(["serve", "/models/tiny", "--dtype", "float32", "--port", "8123", "-q"]) == 0
    assert seen["req"].port == 8123 and seen["req"].engine_args == ["--dtype", "float32"]
    assert seen["before_return"] == [b"STATUS=starting engine (load, compile, warm-up)"]
    assert seen["at_serve"] == [f"READY=1\nSTATUS=serving tiny on http://127.0.0.1:8123\nMAINPID={os.getpid()}".encode()]
    assert path_socket.pending() == [b"STOPPING=1"]


def test_restore_command_without_notify_socket_is_unchanged(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    seen = {}

    def fake_restore(req, rep, tools=None):
        seen["wrapped"] = isinstance(rep, NotifyingReporter)
        return _fake_restored()

    def fake_serve(r, engine, on_signal_msg=None, stop_grace_s=None, tools=None):
        seen["on_msg"] = on_signal_msg
        return 0

    monkeypatch.setattr(ops, "restore", stand_in(ops.restore, fake_restore))
    monkeypatch.setattr(ops, "serve_foreground", stand_in(ops.serve_foreground, fake_serve))
    assert cli.main(["restore", str(tmp_path), "--port", "8123", "-q"]) == 0
    assert seen["wrapped"] is False
    assert callable(seen["on_msg"])


# --- systemd units ----------------------------------------------------------------------------

def _unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # keys are case-sensitive in systemd
    cp.read(UNITS / name)
    return cp


def test_restore_unit_keys():
    u = _unit("vllm-snapshot@.service")
    s = u["Service"]
    assert s["Type"] == "notify"
    assert s["NotifyAccess"] == "main"
    argv = s["ExecStart"].split()
    assert argv[0] == "/var/cache/vllm-snapshot/venv/bin/vllm-snapshot"
    assert argv[1:3] == ["restore", "/var/lib/vllm-snapshot/%i"]
    assert "--detach" not in argv  # READY is sent in the foreground only
    assert argv[argv.index("--host") + 1] == "${VLLM_SNAPSHOT_HOST}"
    assert argv[argv.index("--port") + 1] == "${VLLM_SNAPSHOT_PORT}"
    assert s["EnvironmentFile"] == "-/etc/vllm-snapshot/%i.env"
    prevent = set(s["RestartPreventExitStatus"].split())
    assert {"3", "4", "5", "6"} <= prevent
    assert s["Restart"] == "on-failure"
    assert s["KillMode"] == "mixed" and s["KillSignal"] == "SIGTERM"
    # the engine drains (30 s by default), then gets 10 s to exit before the supervisor SIGKILLs
    # it; systemd must wait longer, with room for the cleanup
    from vllm_snapshot.store import registry

    assert int(s["TimeoutStopSec"]) >= registry.DRAIN_S + registry.TEARDOWN_S + 10
    assert s["SuccessExitStatus"] == "130"  # an interrupted restore cleaned up: a clean stop
    assert int(s["TimeoutStartSec"]) >= 300
    assert s["StandardOutput"] == "journal"


def test_cold_unit_keys():
    u = _unit("vllm-snapshot-cold@.service")
    assert "vllm-snapshot@%i.service" in u["Unit"]["Conflicts"]
    s = u["Service"]
    assert "-m vllm.entrypoints.openai.api_server" in s["ExecStart"]
    assert s["EnvironmentFile"] == "/etc/vllm-snapshot/%i.env"


def test_serve_unit_keys():
    u = _unit("vllm-snapshot-serve@.service")
    s = u["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    argv = s["ExecStart"].split()
    assert argv[:3] == ["/var/cache/vllm-snapshot/venv/bin/vllm-snapshot", "serve", "${VLLM_SNAPSHOT_MODEL}"]
    assert "--detach" not in argv
    assert argv[argv.index("--port") + 1] == "${VLLM_SNAPSHOT_PORT}"
    # the engine args come last, after --, so serve's own options can never be read as theirs
    assert argv[-2:] == ["--", "$VLLM_SNAPSHOT_ENGINE_ARGS"]
    assert s["EnvironmentFile"] == "/etc/vllm-snapshot/%i.env"  # required: it names the model
    assert int(s["TimeoutStartSec"]) >= 1800  # a start may build (a whole cold start + dump)
    assert {"2", "3", "4", "5", "6", "11"} == set(s["RestartPreventExitStatus"].split())
    assert s["SuccessExitStatus"] == "130"
    assert "vllm-snapshot@%i.service" in u["Unit"]["Conflicts"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    paths = []
    for tmpl, inst in (("vllm-snapshot@.service", "vllm-snapshot@demo.service"),
                       ("vllm-snapshot-cold@.service", "vllm-snapshot-cold@demo.service"),
                       ("vllm-snapshot-serve@.service", "vllm-snapshot-serve@demo.service")):
        shutil.copy(UNITS / tmpl, tmp_path / tmpl)
        (tmp_path / inst).symlink_to(tmpl)
        paths.append(str(tmp_path / inst))
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths], capture_output=True, text=True, timeout=60)
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if "vllm-snapshot" in ln]
    bad = [ln for ln in ours if any(w in ln for w in ("Unknown", "Failed", "Invalid", "nvalid", "not valid",
                                                        "Ignoring", "ignoring"))]
    assert not bad, "\n".join(ours)
    if p.returncode != 0:
        # Only acceptable failure: the venv is not installed at its documented path here.
        assert ours and all("is not executable" in ln for ln in ours), p.stdout + p.stderr


#: What CRIU's restore was seen to need under a narrowed bounding set (docs/security.md,
#: "systemd hardening"): namespaces and mounts, ptrace, checkpoint/restore, the tree's credentials,
#: time-namespace offsets (without CAP_SYS_TIME: "Unable to set a monotonic clock offset").
CRIU_NEEDS = {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_CHECKPOINT_RESTORE", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP",
              "CAP_NET_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_TIME", "CAP_DAC_OVERRIDE", "CAP_KILL",
              "CAP_NET_BIND_SERVICE"}
#: Directives that would change the unit's namespaces or add a seccomp filter: the engine tree
#: (and so the snapshot) would inherit them, and CRIU restores relative to the host's mounts.
NOT_FOR_CRIU = ("PrivateTmp", "PrivateDevices", "PrivateNetwork", "ProtectSystem", "ProtectHome", "ProtectClock",
                "ProtectKernelTunables", "ProtectHostname", "RestrictNamespaces", "SystemCallFilter",
                "MemoryDenyWriteExecute", "LockPersonality", "PrivateIPC", "PrivateUsers")


@pytest.mark.parametrize("name", ["vllm-snapshot@.service", "vllm-snapshot-serve@.service"])
def test_root_units_are_hardened_without_breaking_criu(name):
    s = _unit(name)["Service"]
    assert s["NoNewPrivileges"] == "yes" and s["UMask"] == "0077" and s["LimitCORE"] == "0"
    bounding = set(s["CapabilityBoundingSet"].split())
    assert CRIU_NEEDS <= bounding
    assert not bounding & {"CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_BOOT", "CAP_MAC_ADMIN", "CAP_BPF", "CAP_SETFCAP"}
    assert not [k for k in NOT_FOR_CRIU if k in s]
    assert "User" not in s  # CRIU and the namespaces need root; the engine drops itself


def test_cold_unit_runs_unprivileged():
    s = _unit("vllm-snapshot-cold@.service")["Service"]
    assert s["User"] == "vllm-snapshot" and s["NoNewPrivileges"] == "yes"
    assert s["CapabilityBoundingSet"] == "" and s["AmbientCapabilities"] == ""
