"""Interrupting restore, create and switch at every phase leaves nothing behind (real engine +
CRIU; the creates' phases with the fake engine through the real command line and CRIU, and one
real vLLM create interrupted as it starts and in its dump). The phase is found from the progress lines, as a user's script would; a signal that
lands just after a short phase ends hits the next one, which is fine: the invariants are the
same. Afterwards: no engine process, no CRIU process, no staging dir of this run, no registry
entry, no lock held, the port free, and the snapshot restores normally the next time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from vllm_snapshot.store import archive, locks
from vllm_snapshot.store import manifest as mf

from conftest import EAGER_ARGS, ROOT, TINY, cli, criu_pids, engine_env, staging_left, started
from fake_cli import FAKE_CLI, fake_env
from test_integration import engine_pids, free_port, port_accepts

pytestmark = pytest.mark.integration

VLLM_SNAPSHOT = (sys.executable, "-m", "vllm_snapshot")
RESTORE_PHASES = ["validating snapshot, host and model", "staging images", "CRIU restore",
                  "replaying the oracle inside the engine", "image checksums", "binding", "waiting for the HTTP server",
                  "canary request over HTTP"]


@pytest.fixture(scope="module")
def snapshots(snapshot, tmp_path_factory):
    """The session snapshot (uncompressed) and a zstd copy of it (images re-packed, manifest
    resealed: the same tree, stored compressed)."""
    d = tmp_path_factory.mktemp("interrupt")
    os.chmod(d, 0o700)
    z = d / "tiny-zstd"
    subprocess.run(["cp", "-al", str(snapshot), str(z)], check=True)
    images = archive.pack(z / "images", archive.Compression("zstd", 1))
    m = mf.read(z)
    mf.write_atomic(mf.seal(m.model_copy(update={
        "images": images, "sizes": {**m.sizes, "stored": sum(i.stored_bytes for i in images)}})), z)
    return {"none": snapshot, "zstd": z}


def _lock_free(snap: Path) -> bool:
    try:
        with locks.snapshot_lock(snap):
            return True
    except Exception:  # noqa: BLE001 - BusyError: still held
        return False


def assert_nothing_left(snap: Path, port: int, before: set[int]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (criu_pids() or engine_pids() - before):
        time.sleep(0.2)
    assert engine_pids(5, before) - before == set(), "an engine process was left"
    assert criu_pids() == [], "a CRIU process was left"
    assert staging_left(snap.parent) == [], "a staging dir was left"
    st = json.loads(cli("status", "--json", check=True).stdout)["engines"]
    assert [e for e in st if e["port"] == port] == [], "a registry entry was left"
    assert _lock_free(snap), "the snapshot lock is still held"
    assert not port_accepts(port), "the port is still bound"


def _interrupt_at(argv: list[str], label: str, sig: int, env=None, prog: tuple[str, ...] = VLLM_SNAPSHOT,
                  ready=None) -> tuple[int, str]:
    """Run ``PROG ARGV`` (``vllm-snapshot ARGV``, or tests/fake_cli.py's command line with the
    fake engine); send ``sig`` when the phase ``label`` starts -- and, with ``ready`` (a
    callable), once it returns true (polled for up to 60 s). Returns (exit code, stderr)."""
    p = started(subprocess.Popen([*prog, *argv], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, env=env or engine_env(), cwd=ROOT))
    seen, lines = False, []
    # a phase line never seen must fail the test, not hang it while the engine serves
    watchdog = threading.Timer(300, p.kill)
    watchdog.start()
    # search, not startswith/endswith: in the foreground the engine's log shares stderr, and a
    # chunk of it without its newline can stand before or after our progress line on one line;
    # the start line is "LABEL... ...", the end line "LABEL...: done in" / "...: FAILED"
    start = re.compile(rf"\[vllm-snapshot\] {re.escape(label)}(?:(?!: done|: FAILED)[^\n])*? \.\.\.")
    try:
        for line in p.stderr:
            lines.append(line)
            if start.search(line):
                deadline = time.monotonic() + 60
                while ready is not None and not ready() and time.monotonic() < deadline:
                    time.sleep(0.1)
                p.send_signal(sig)
                seen = True
                break
        rest = p.communicate(timeout=180)[1]
    finally:
        watchdog.cancel()
    assert seen, f"never reached {label!r}:\n{''.join(lines)[-3000:]}"
    return p.returncode, "".join(lines) + rest


#: Where a compressed snapshot's restore differs: its images are decompressed into a staging
#: dir (in /dev/shm) alongside CRIU, and checksummed as they are, instead of hard-linked beside
#: the snapshot and checksummed alongside CRIU and the oracle. These phases run with both.
STAGING_PHASES = ("staging images", "CRIU restore", "image checksums")


def _restore_cases() -> list:
    """Each phase once (both compressions for :data:`STAGING_PHASES`, the others taking
    turns), and SIGTERM, SIGINT and SIGHUP taking turns: one handler serves the three
    (tests/test_interrupts.py proves it), so what each case proves is the phase's cleanup."""
    cases, comps = [], iter(["none", "zstd"] * len(RESTORE_PHASES))
    for phase in RESTORE_PHASES:
        cases += [(phase, c) for c in (("none", "zstd") if phase in STAGING_PHASES else (next(comps),))]
    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    return [pytest.param(phase, sigs[i % 3], comp, id=f"{phase}-{sigs[i % 3].name[3:]}-{comp}")
            for i, (phase, comp) in enumerate(cases)]


@pytest.mark.parametrize("phase,sig,comp", _restore_cases())
def test_interrupted_restore_leaves_nothing(snapshots, comp, sig, phase):
    snap = snapshots[comp]
    before = engine_pids()
    port = free_port()
    rc, err = _interrupt_at(["restore", str(snap), "--port", str(port)], phase, sig)
    # 130: interrupted and cleaned up; 0: the signal arrived once it served (clean stop)
    assert rc == 130 or (rc == 0 and f"received {sig.name}" in err), f"exit {rc}\n{err[-3000:]}"
    if rc == 130:
        assert "interrupted by SIG" in err
    assert_nothing_left(snap, port, before)


@pytest.mark.parametrize("comp", ["none", "zstd"])
@pytest.mark.parametrize("phase", ["staging images", "CRIU restore",
                                   "replaying the oracle inside the engine"])
def test_sigkilled_restore_is_reclaimed_by_the_next_command(snapshots, comp, phase):
    snap = snapshots[comp]
    before = engine_pids()
    port = free_port()
    _interrupt_at(["restore", str(snap), "--port", str(port)], phase, signal.SIGKILL)
    # CRIU may still finish a restore it had begun; then nobody owns that tree
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and criu_pids():
        time.sleep(0.2)
    r = cli("restore", str(snap), "--port", str(port), "--detach", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cli("stop", "--port", str(port), timeout=120, check=True)
    assert_nothing_left(snap, port, before)


def _assert_create_left_nothing(snap_root: Path, target: Path, rc: int, err: str, before: set[int]) -> None:
    assert rc == 130, err[-3000:]
    assert "interrupted by SIG" in err
    assert engine_pids(30, before) - before == set(), "engine processes outlived the interrupted create"
    assert not target.exists() and not list(snap_root.glob(f".{target.name}.tmp-*"))
    assert criu_pids() == []
    assert staging_left(snap_root) == [], "a staging dir was left"


#: The fake engine's start-up, for the phase "starting engine": it is interrupted in it, and would
#: still be starting when the test looks for what was left.
FAKE_START_S = "120"
#: The fake engine's written memory (MiB): its dump and checksums take a second, not a few ms.
FAKE_BALLAST_MB = "256"


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "starting engine"), (signal.SIGINT, "CRIU dump"),
                                       (signal.SIGTERM, "checksums + compression")],
                         ids=["TERM-engine-start", "INT-dump", "TERM-pack"])
def test_interrupted_create_leaves_nothing(snap_root, tmp_path, sig, phase):
    """The real command line, supervisor, cgroups, CRIU (with its CUDA plugin) and store, with the
    protocol-speaking fake engine (tests/fake_cli.py) and its child process: what is checked
    (no engine process, no CRIU, no temp or staging dir, nothing published, exit 130) is the
    create's cleanup, not the engine's. A real vLLM engine's case is the next test."""
    before = engine_pids()
    target = snap_root / f"int-fake-{sig}-{phase.split()[0]}"
    env = {**fake_env(engine_env(), tmp_path), "VLLM_FAKE_BALLAST_MB": FAKE_BALLAST_MB,
           "VLLM_FAKE_START_S": FAKE_START_S if phase == "starting engine" else "0"}
    # at "starting engine", once the fake engine and its child run (as vLLM's would, loading)
    ready = (lambda: len(engine_pids() - before) >= 2) if phase == "starting engine" else None
    rc, err = _interrupt_at(["create", str(TINY), "--snapshot-dir", str(target)], phase, sig, env=env,
                            prog=FAKE_CLI, ready=ready)
    if phase != "starting engine":  # the dump ran on the fake's tree: CRIU's CUDA plugin asked the fake driver
        assert (tmp_path / "fakecuda" / "calls.log").is_file()
    _assert_create_left_nothing(snap_root, target, rc, err, before)


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "starting engine"), (signal.SIGINT, "CRIU dump")],
                         ids=["TERM-engine-start", "INT-dump"])
def test_interrupted_create_of_a_real_engine_leaves_nothing(snap_root, sig, phase):
    """A real vLLM CPU engine interrupted as it starts (under a second) and in the dump (its
    root, API server and EngineCore processes, after a full cold start): the cleanup the fake
    engine's cases prove holds for vLLM's process tree too."""
    before = engine_pids()
    target = snap_root / f"int-real-{sig}-{phase.split()[0]}"
    rc, err = _interrupt_at(["create", str(TINY), "--snapshot-dir", str(target), "--", *EAGER_ARGS], phase, sig)
    _assert_create_left_nothing(snap_root, target, rc, err, before)


def test_switch_interrupted_between_stop_and_restore_leaves_the_port_free(snapshots):
    snap = snapshots["none"]
    before = engine_pids()
    port = free_port()
    r = json.loads(cli("restore", str(snap), "--port", str(port), "--detach", "--json", timeout=300,
                       check=True).stdout)
    rc, err = _interrupt_at(["switch", str(snapshots["zstd"]), "--port", str(port), "--no-handover"],
                            "staging images", signal.SIGTERM)
    assert rc == 130, err[-3000:]
    assert "stopped" in err and "nothing serves on port" in err  # no rollback on an interruption
    assert not psutil.pid_exists(r["pid"]) or psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE
    assert_nothing_left(snapshots["zstd"], port, before)


def test_a_hand_over_interrupted_before_the_new_engine_took_the_port_leaves_the_old_one_serving(snapshots):
    snap = snapshots["none"]
    before = engine_pids()
    port = free_port()
    r = json.loads(cli("restore", str(snap), "--port", str(port), "--detach", "--json", timeout=300,
                       check=True).stdout)
    try:
        rc, err = _interrupt_at(["switch", str(snapshots["zstd"]), "--port", str(port)],
                                "replaying the oracle inside the engine", signal.SIGTERM)
        assert rc == 130, err[-3000:]
        assert "was not touched: it still serves" in err, err[-3000:]
        st = json.loads(cli("status", "--json", check=True).stdout)["engines"]
        assert [e["pid"] for e in st if e["port"] == port] == [r["pid"]]
        assert port_accepts(port)
    finally:
        cli("stop", "--port", str(port), timeout=120)
    assert_nothing_left(snapshots["zstd"], port, before)
