"""Shared fixtures. Integration tests (marker ``integration``) run a real vLLM CPU engine and
real CRIU; they need root, CRIU >= 4.2, and the venv + tiny model from scripts/setup.sh. They
are skipped with a reason when those are missing -- except under CI (``CI=true``), where a
missing prerequisite is an error, never a silent skip.

One skip rule for every test under CI: a skip (a skip mark, ``pytest.skip``, an
``importorskip``, a whole module) fails the run unless its reason starts with one of
:data:`ALLOWED_CI_SKIPS` (docs/testing.md, "Skips", lists them). Outside CI a skip stays a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot"))
TINY = CACHE / "models" / "tiny-llama"
#: Random "secrets" set in the environment of the session snapshot's create: none may reach an
#: image (test_no_planted_secret_in_images searches every image for them), VLLM_API_KEY included
#: (vllm serve would read it; the key belongs to restore).
PLANTED_SECRETS = {"HF_TOKEN": "hf_" + os.urandom(12).hex(), "OPENAI_API_KEY": "sk-" + os.urandom(12).hex(),
                   "VLLM_API_KEY": "vk-" + os.urandom(12).hex()}
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--served-model-name", "tiny-llama"]
#: The tiny model without compilation, for the cold starts whose point is not what compilation
#: leaves (interrupted or killed creates, mounts, serve's build/refuse/rebuild, the fleet's
#: builds): measured here, a create's engine start takes 37.6 s eager vs 58.8 s compiled on a
#: loaded box (30.5 vs 37.7 s quiet, docs/benchmarks.md). The compiled path stays proven by the
#: session snapshot (ENGINE_ARGS: every restore test restores a compiled engine), the carried
#: compile-cache kernels (test_carry_integration.py) and inductor with the weights file
#: (test_weights_integration.py).
EAGER_ARGS = [*ENGINE_ARGS, "--enforce-eager"]


#: The only skips CI accepts: reason prefix -> why such a test cannot run on CI's machine.
#: Use :func:`skip_on_gpu_host` for these; any other skip under ``CI=true`` is a failure.
ALLOWED_CI_SKIPS = {
    "on a GPU host:": "the test checks what a host without NVIDIA GPUs does (CI has none; a GPU "
                      "host answers differently, and scripts/gpu_check.sh is the check there)",
}


def in_ci() -> bool:
    """True under CI (``CI=true``, as .ci/run is started)."""
    return os.environ.get("CI", "").lower() == "true"


def skip_on_gpu_host(why: str) -> None:
    """Skip the calling test (an allowed CI skip): it asserts a GPU-less host's behaviour."""
    pytest.skip(f"on a GPU host: {why}")


def _disallowed_skip(reason: str) -> str | None:
    """The failure message for a skip with ``reason`` under CI, or None if it is allowed."""
    if any(reason.startswith(prefix) for prefix in ALLOWED_CI_SKIPS):
        return None
    return (f"skipped under CI=true: {reason!r}. Only the skips listed in tests/conftest.py "
            f"ALLOWED_CI_SKIPS may skip in CI: install what the test needs in scripts/setup.sh "
            f"(or pyproject's dev extras), or fix the test.")


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if in_ci() and rep.skipped and not hasattr(rep, "wasxfail"):
        msg = _disallowed_skip(_skip_reason(rep.longrepr))
        if msg:
            rep.outcome, rep.longrepr = "failed", msg


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if in_ci() and rep.skipped:  # a module-level skip or importorskip
        msg = _disallowed_skip(_skip_reason(rep.longrepr))
        if msg:
            rep.outcome, rep.longrepr = "failed", msg


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CRIU)"
    try:
        from vllm_snapshot.checkpoint import criu

        b = criu.find_criu()
        if not criu.version_ok(criu.criu_version(b)):
            return f"CRIU at {b} is older than 4.2"
    except Exception as e:  # noqa: BLE001
        return f"CRIU unavailable: {e}"
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed in this interpreter"
        if importlib.util.find_spec("pycriu") is None:
            return "pycriu is not importable"
    except Exception as e:  # noqa: BLE001
        return str(e)
    if not (TINY / "config.json").is_file():
        return f"tiny model missing at {TINY} (run scripts/setup.sh)"
    if not (CACHE / "models" / "smollm2-135m-instruct" / "config.json").is_file():
        return f"the demo's model missing at {CACHE / 'models' / 'smollm2-135m-instruct'} (run scripts/setup.sh)"
    return None




def pytest_collection_modifyitems(config, items):
    reason = _missing()
    if reason is None:
        return
    if in_ci():
        raise pytest.UsageError(f"integration prerequisites missing in CI: {reason}")
    mark = pytest.mark.skip(reason=f"integration: {reason}")
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(mark)


@pytest.fixture(autouse=True)
def _environ_restored():
    """Put os.environ back after every test: importing vLLM in this process (the parser tests)
    sets TORCHINDUCTOR_CACHE_DIR, PYTORCH_NVML_BASED_CUDA_CHECK, ... in it, which would reach
    every later CLI run through engine_env() -- e.g. a serve whose key's env part then differs
    from the session snapshot's, created before the import (order-dependent failure)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _signals_released():
    """Forget signal holds after every test, as every command starts clean
    (:func:`vllm_snapshot.host.interrupts.reset`): a detached restore run in this process
    (tests/test_gpu_sequencing.py and others, through the real runtime) holds SIGINT/SIGTERM/SIGHUP
    for good -- its command would exit right after -- and a later test in the same xdist worker
    then saw its own signal deferred, or its check that nothing is held fail (CI: depth 6, after
    six such restores on one worker)."""
    yield
    from vllm_snapshot.host import interrupts

    if interrupts._state["depth"] or interrupts._state["pending"] is not None:
        interrupts.reset()


# ----------------------------------------------------------------------------- this run's own state
#
# Each test run has its own VLLM_SNAPSHOT_RUN_DIR (engine registry, locks), STATE_DIR, LOG_DIR and
# STAGING_DIR, under its pytest base temp dir, set in os.environ so every command a test starts
# inherits them (the runc integration helpers' shape: ``ROOT=$(mktemp -d)``, ``--root
# "$ROOT/state"``, teardown of its own containers only). The "nothing left" checks look only at
# what this run owns (:func:`owned_by_this_run`, :func:`criu_pids`, :func:`staging_left`), so a
# vllm-snapshot service or another test run on the host cannot fail them.

#: The env variables of :mod:`vllm_snapshot.paths` a run owns, and their directory under the run's state dir.
RUN_STATE_DIRS = {"VLLM_SNAPSHOT_RUN_DIR": "run", "VLLM_SNAPSHOT_STATE_DIR": "state",
                  "VLLM_SNAPSHOT_LOG_DIR": "log", "VLLM_SNAPSHOT_STAGING_DIR": "staging"}
#: This run's pytest base temp dir (set by :func:`_run_state`): every run dir of this run (its
#: own, and those tests make for "another run dir" or a "node") is below it.
RUN_BASE: Path | None = None
#: PIDs of the vllm-snapshot commands this run started (:func:`cli`, :func:`started`): the
#: owners of staging dirs this run may have left.
STARTED: dict[int, float | None] = {}
"""PID -> start time (psutil ``create_time``, None if it had gone) of the commands this run
started. PIDs wrap (pid_max is 32768 on the CI machine), so a live process with a recorded PID
but another start time is somebody else's."""


@pytest.fixture(scope="session", autouse=True)
def _run_state(tmp_path_factory):
    """Point this run's commands at its own state dirs (0700, root's, as the defaults are: the
    engine user never opens them by path -- a detached engine's log is opened by its restore
    and handed over). The CRIU lock stays host-wide: it also guards the engine cgroups, which
    every run on this host shares (a reclaim that ran outside it removed another restore's new
    leaf), so this run's ``criu.lock`` is a symlink to the host's (lock files are opened
    following links). At the end, engines still registered in this run's registry are stopped,
    and only those."""
    global RUN_BASE
    RUN_BASE = tmp_path_factory.getbasetemp().resolve()
    state = RUN_BASE / "vllm-snapshot-state"
    host_run = Path(os.environ.get("VLLM_SNAPSHOT_RUN_DIR") or "/run/vllm-snapshot")
    for var, name in RUN_STATE_DIRS.items():
        d = state / name
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        os.environ[var] = str(d)
    os.chmod(state, 0o700)
    if os.geteuid() == 0:
        host_run.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.close(os.open(host_run / "criu.lock", os.O_WRONLY | os.O_CREAT, 0o600))
        (state / "run" / "criu.lock").symlink_to(host_run / "criu.lock")
    yield state
    if os.geteuid() == 0:
        from vllm_snapshot.store import registry

        for e in registry.entries():
            registry.stop(e, drain_s=0)
    # pytest removes the base temp dirs of passed tests (and, at the next run, the rest): it
    # cannot while the stores in them hold immutable weights files
    unprotect_weights(RUN_BASE)


def unprotect_weights(top: Path) -> int:
    """Clear the immutable attribute (``chattr -i``) of every weights file below ``top`` (the
    store sets it on each ``.weights/*.weights`` it publishes), so that the tree can be removed.
    Returns how many files had it. Does not follow symlinks or cross into other mounts."""
    from vllm_snapshot.store import weights as sw

    n = 0
    top_dev = top.lstat().st_dev if top.exists() else None
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == top_dev]
        for name in filenames:
            f = Path(dirpath, name)
            if name.endswith(".weights") and f.is_file() and not f.is_symlink():
                try:
                    if sw.immutable(f):
                        sw.unprotect(f)
                        n += 1
                except OSError:
                    continue
    return n


def remove_tree(path: Path) -> None:
    """Remove ``path`` (a store or scratch dir a test made), immutable weights files included.
    Raises AssertionError naming what is left (a test must leave nothing behind: before this,
    every test store's immutable weights file stayed, and 57 GB of them filled the CI disk)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    unprotect_weights(path)
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        left = sorted(str(p) for p in path.rglob("*"))[:10]
        raise AssertionError(f"could not remove {path}; left: {left}")


def started(p: subprocess.Popen) -> subprocess.Popen:
    """Record ``p`` (a vllm-snapshot command a test started itself) as this run's; returns it."""
    import psutil

    try:
        STARTED[p.pid] = psutil.Process(p.pid).create_time()
    except psutil.Error:
        STARTED[p.pid] = None
    return p


def owned_by_this_run(p) -> bool:
    """Whether the process ``p`` (psutil) is this run's: its environment names a
    VLLM_SNAPSHOT_RUN_DIR below this run's base temp dir. That holds for the commands this run
    starts, the CRIU they run, the engines their creates launch, and the engines restored from
    this run's snapshots (a restored tree keeps the environment of the create that dumped it)."""
    import psutil

    if RUN_BASE is None:
        return False
    try:
        run_dir = p.environ().get("VLLM_SNAPSHOT_RUN_DIR", "")
    except (psutil.Error, OSError):
        return False
    return bool(run_dir) and Path(run_dir).is_relative_to(RUN_BASE)


def criu_pids() -> list[int]:
    """CRIU processes of this run still running (:func:`owned_by_this_run`; zombies are not)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if (p.info["name"] == "criu" or (p.info["cmdline"] or [""])[0].endswith("/criu")) \
                    and p.info["status"] != psutil.STATUS_ZOMBIE and owned_by_this_run(p):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def staging_left(*near: Path) -> list[Path]:
    """Staging dirs of this run under /dev/shm, this run's staging dir and ``near``: those whose
    owner PID (``vllm-snapshot-stage-<PID>-...``) is a command this run started (:data:`STARTED`),
    or a live process of this run. Another run's or a service's staging dirs are not listed."""
    import psutil

    from vllm_snapshot import paths
    from vllm_snapshot.store import archive

    out = []
    for d in (Path("/dev/shm"), paths.staging_dir(), *near):
        for s in (d.glob(f"{archive.STAGE_PREFIX}*") if d.is_dir() else []):
            head = s.name[len(archive.STAGE_PREFIX):].split("-", 1)[0]
            pid = int(head) if head.isdigit() else 0
            if not pid:
                continue
            try:
                proc = psutil.Process(pid)
                if (pid in STARTED and STARTED[pid] == proc.create_time()) or owned_by_this_run(proc):
                    out.append(s)
            except psutil.NoSuchProcess:
                if pid in STARTED:  # one of this run's commands, gone since
                    out.append(s)
            except psutil.Error:
                continue
    return sorted(out)


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV cache size is an engine arg
    for var in ("COLUMNS", "LINES"):  # pytest-xdist's workers set COLUMNS=80; a plain run does not
        env.pop(var, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cli(*args: str, timeout: float = 900, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m vllm_snapshot ARGS`` and capture its output (text)."""
    with started(subprocess.Popen([sys.executable, "-m", "vllm_snapshot", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env or engine_env(), cwd=ROOT)) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(f"vllm-snapshot {' '.join(args)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="session")
def snap_root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("snapshots")
    os.chmod(d, 0o700)
    return d


@pytest.fixture(scope="session")
def snapshot(snap_root) -> Path:
    """One real snapshot of the tiny model, created once per test session (~1 min)."""
    target = snap_root / "tiny"
    cli("create", str(TINY), "--snapshot-dir", str(target), "--", *ENGINE_ARGS, check=True,
        env={**engine_env(), **PLANTED_SECRETS})
    return target


@pytest.fixture()
def clone_snapshot(snapshot, tmp_path):
    """A hard-linked copy of the session snapshot (images shared, manifest private)."""
    def make(name: str = "clone") -> Path:
        d = tmp_path / name
        subprocess.run(["cp", "-al", str(snapshot), str(d)], check=True)
        os.chmod(tmp_path, 0o700)
        return d
    return make


@pytest.fixture()
def engine_tmp():
    """A temp dir the unprivileged engine user can search (0711, under /var/tmp), for models and
    TLS files a test makes: pytest's own tmp dirs are root-only, and every pytest session that
    starts resets /tmp/pytest-of-root to 0700, so a search bit added there does not stay."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="vsnap-engine-", dir="/var/tmp"))
    os.chmod(d, 0o711)
    yield d
    remove_tree(d)
