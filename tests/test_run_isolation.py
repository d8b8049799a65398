"""The test run's own state (issue 38): its VLLM_SNAPSHOT_* dirs are its own, and the "nothing
left" checks of the integration tests (engine_pids, criu_pids, staging_left) see this run's
engines, CRIU and staging dirs and not those of another run or of a service on the host. The
"other run" here is a process whose environment names another VLLM_SNAPSHOT_RUN_DIR, as
another run's commands, CRIU and engines do."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import conftest
from conftest import RUN_STATE_DIRS, criu_pids, staging_left, started
from test_integration import engine_pids

from vllm_snapshot import paths
from vllm_snapshot.store import archive


def test_each_run_has_its_own_private_state_dirs():
    assert conftest.RUN_BASE is not None
    for var in RUN_STATE_DIRS:
        d = Path(os.environ[var])
        assert d.is_relative_to(conftest.RUN_BASE), (var, d)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, (var, oct(d.stat().st_mode))
    assert paths.run_dir() == Path(os.environ["VLLM_SNAPSHOT_RUN_DIR"])
    assert paths.log_dir() != paths.DEFAULT_LOG and paths.staging_dir() != Path("/var/tmp/vllm-snapshot-staging")
    if os.geteuid() == 0:  # the CRIU lock is the host's: it guards the engine cgroups every run shares
        lock = paths.run_dir() / "criu.lock"
        assert lock.is_symlink() and not lock.resolve().is_relative_to(conftest.RUN_BASE)


@pytest.fixture()
def spawn():
    """Start ``argv`` with VLLM_SNAPSHOT_RUN_DIR ``run_dir`` (None: unset, as a service's);
    return once it runs as ``argv0`` with that environment (before its exec a child still shows
    this process's environment)."""
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], run_dir: str | None, argv0: str | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_SNAPSHOT_RUN_DIR"}
        if run_dir is not None:
            env["VLLM_SNAPSHOT_RUN_DIR"] = run_dir
        p = subprocess.Popen(argv, env=env)
        procs.append(p)
        deadline = time.monotonic() + 10
        while True:
            try:
                q = psutil.Process(p.pid)
                if q.environ().get("VLLM_SNAPSHOT_RUN_DIR") == run_dir and q.cmdline()[:1] == [argv0 or argv[0]]:
                    return p
            except (psutil.Error, IndexError):
                pass
            assert time.monotonic() < deadline, f"{argv} did not start"
            time.sleep(0.01)

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


SLEEP = "import time; time.sleep(60)"


def test_engine_pids_counts_this_runs_engines_only(spawn):
    ours = spawn([sys.executable, "-c", SLEEP, "fake_engine.py"], os.environ["VLLM_SNAPSHOT_RUN_DIR"])
    theirs = spawn([sys.executable, "-c", SLEEP, "fake_engine.py"], "/run/vllm-snapshot-another-run")
    services = spawn([sys.executable, "-c", SLEEP, "fake_engine.py"], None)
    found = engine_pids()
    assert ours.pid in found
    assert theirs.pid not in found and services.pid not in found


def test_criu_pids_counts_this_runs_criu_only(spawn):
    argv = ["bash", "-c", "exec -a /opt/x/criu sleep 60"]
    ours = spawn(argv, os.environ["VLLM_SNAPSHOT_RUN_DIR"], "/opt/x/criu")
    theirs = spawn(argv, "/run/vllm-snapshot-another-run", "/opt/x/criu")
    found = criu_pids()
    assert ours.pid in found and theirs.pid not in found


def test_staging_left_lists_this_runs_staging_dirs_only(spawn, tmp_path):
    dead = started(subprocess.Popen(["true"]))  # a command of this run, killed or gone since
    dead.wait()
    theirs = spawn([sys.executable, "-c", SLEEP], "/run/vllm-snapshot-another-run")
    live = spawn([sys.executable, "-c", SLEEP], os.environ["VLLM_SNAPSHOT_RUN_DIR"])
    # PIDs wrap (pid_max 32768 on the CI machine): theirs has the PID one of this run's commands
    # had long ago -- as in a CI run that listed another run's dir as this run's
    conftest.STARTED.setdefault(theirs.pid, 1.0)
    made = [Path(d) / f"{archive.STAGE_PREFIX}{pid}-{tmp_path.name}"
            for d, pid in (("/dev/shm", dead.pid), ("/dev/shm", theirs.pid), (tmp_path, live.pid),
                           (paths.staging_dir(), theirs.pid))]
    try:
        for d in made:
            d.mkdir()
        assert staging_left(tmp_path) == sorted([made[0], made[2]])
    finally:
        for d in made:
            d.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs CAP_LINUX_IMMUTABLE (root; CI runs as root)")
def test_remove_tree_removes_a_store_with_an_immutable_weights_file(tmp_path):
    from vllm_snapshot.store import weights as sw

    store = tmp_path / "snaps"
    (store / ".weights").mkdir(parents=True)
    f = store / ".weights" / ("ab" * 32 + ".weights")
    f.write_bytes(b"w" * 4096)
    if not sw.protect(f):
        pytest.fail(f"{tmp_path} has no immutable attribute: the test needs a file system that has")
    shutil.rmtree(store, ignore_errors=True)
    assert f.exists()  # what every test store left behind before remove_tree
    conftest.remove_tree(store)
    assert not store.exists()
