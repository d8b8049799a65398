"""cuda_checkpoint: the `cuda-checkpoint` contract of CRIU 4.2.1's CUDA plugin, against a fake
driver; the helper_dir wrapper as a real program; and CudaDriver over the real cuda-bindings
against a stub libcuda (compiled here when a C compiler and cuda-bindings are present)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import skip_on_gpu_host

from vllm_snapshot.checkpoint import cuda_checkpoint as cc
from vllm_snapshot.errors import EnvironmentProblem

GpuPair = cc.GpuPair
PID, TID, OTHER = 4242, 4250, 5000  # a CUDA process, its restore thread, a process without CUDA


class FakeDriver(cc.Driver):
    """The driver's state machine (cuda-bindings docstrings): lock needs RUNNING, checkpoint
    needs LOCKED, restore needs CHECKPOINTED (-> LOCKED), unlock needs LOCKED (-> RUNNING)."""

    def __init__(self, states: dict[int, str] | None = None):
        self.states = dict(states or {PID: "running"})
        self.calls: list[tuple] = []

    def _need(self, call: str, pid: int, state: str) -> None:
        if pid not in self.states:
            raise cc.DriverError(call, "CUDA_ERROR_INVALID_VALUE", "invalid argument")
        if self.states[pid] != state:
            raise cc.DriverError(call, "CUDA_ERROR_ILLEGAL_STATE", "operation not permitted")

    def get_state(self, pid: int) -> str:
        self.calls.append(("get_state", pid))
        if pid not in self.states:
            raise cc.DriverError("cuCheckpointProcessGetState", "CUDA_ERROR_INVALID_VALUE")
        return self.states[pid]

    def get_restore_tid(self, pid: int) -> int:
        self.calls.append(("get_restore_tid", pid))
        if pid not in self.states:
            raise cc.DriverError("cuCheckpointProcessGetRestoreThreadId", "CUDA_ERROR_INVALID_VALUE")
        return TID

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.calls.append(("lock", pid, timeout_ms))
        self._need("cuCheckpointProcessLock", pid, "running")
        self.states[pid] = "locked"

    def checkpoint(self, pid: int) -> None:
        self.calls.append(("checkpoint", pid))
        self._need("cuCheckpointProcessCheckpoint", pid, "locked")
        self.states[pid] = "checkpointed"

    def restore(self, pid: int, pairs: Sequence[GpuPair] = ()) -> None:
        self.calls.append(("restore", pid, tuple(pairs)) if pairs else ("restore", pid))
        self._need("cuCheckpointProcessRestore", pid, "checkpointed")
        self.states[pid] = "locked"

    def unlock(self, pid: int) -> None:
        self.calls.append(("unlock", pid))
        self._need("cuCheckpointProcessUnlock", pid, "locked")
        self.states[pid] = "running"

    def remap_unavailable(self) -> str | None:
        return self.no_remap

    no_remap: str | None = None


@pytest.fixture
def proc(tmp_path) -> Path:
    """A fake /proc: PID (with thread TID) and OTHER."""
    root = tmp_path / "proc"
    for n, tgid in ((PID, PID), (TID, PID), (OTHER, OTHER)):
        (root / str(n)).mkdir(parents=True)
        (root / str(n) / "status").write_text(f"Name:\tpython\nTgid:\t{tgid}\nPid:\t{n}\n")
    return root


def run(args, drv, proc, capsys):
    code = cc.main(args, driver=drv, proc_root=proc)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_names_action_within_criu_buffer_and_exits_zero(capsys):
    for flag in ("-h", "--help"):
        code = cc.main([flag], driver=FakeDriver())
        out, _ = capsys.readouterr()
        assert code == 0
        # cuda_checkpoint_supports_flag: strstr(buf, "--action") on a 2048-byte buffer.
        assert "--action" in out.encode()[:2047].decode()


def test_help_probes_the_driver_and_names_action_only_when_it_works(monkeypatch, capsys):
    # CRIU's plugin runs `-h` once to decide whether to run at all: it must reflect the driver.
    built = []
    monkeypatch.setattr(cc, "CudaDriver", lambda: built.append(1) or FakeDriver())
    assert cc.main(["-h"]) == 0
    assert "--action" in capsys.readouterr().out and built == [1]


def test_help_without_checkpoint_api_omits_action(monkeypatch, capsys):
    # A driver older than r570: help without --action, so the plugin says a newer driver is needed.
    def old():
        raise cc.DriverUnavailable("cuDriverGetVersion", "driver API 12040", "needs 12080", api_missing=True)

    monkeypatch.setattr(cc, "CudaDriver", old)
    assert cc.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--action" not in out and "NOT AVAILABLE" in out and "driver API 12040" in out and "r570" in out


@pytest.mark.parametrize("why", [
    cc.DriverUnavailable("import cuda.bindings", "ImportError", "No module named 'cuda'"),
    cc.DriverUnavailable("cuInit", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
])
def test_help_exits_unavailable_when_the_driver_cannot_be_used(monkeypatch, capsys, why):
    def broken():
        raise why

    monkeypatch.setattr(cc, "CudaDriver", broken)
    assert cc.main(["-h"]) == cc.EXIT_UNAVAILABLE == 3
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(cc.UNAVAILABLE) and why.call in err


def test_full_cycle_state_transitions(proc, capsys):
    drv = FakeDriver()

    def state() -> str:
        code, out, err = run(["--get-state", "--pid", str(PID)], drv, proc, capsys)
        assert (code, err) == (0, "")
        return out

    assert state() == "running\n"
    for action, after in (("lock", "locked\n"), ("checkpoint", "checkpointed\n"),
                          ("restore", "locked\n"), ("unlock", "running\n")):
        code, out, err = run(["--action", action, "--pid", str(PID)], drv, proc, capsys)
        assert (code, out, err) == (0, "", "")
        assert state() == after
    assert [c[0] for c in drv.calls if c[0] != "get_state"] == ["lock", "checkpoint", "restore", "unlock"]


def test_get_state_of_restore_thread_asks_about_its_process(proc, capsys):
    # cuda_plugin_pause_devices calls get_cuda_state(restore_tid), not the PID.
    drv = FakeDriver({PID: "locked"})
    code, out, _ = run(["--get-state", "--pid", str(TID)], drv, proc, capsys)
    assert (code, out) == (0, "locked\n")
    assert drv.calls == [("get_state", PID)]


def test_get_restore_tid_prints_only_the_number(proc, capsys):
    code, out, err = run(["--get-restore-tid", "--pid", str(PID)], FakeDriver(), proc, capsys)
    assert (code, out, err) == (0, f"{TID}\n", "")
    assert int(out) == TID  # the plugin uses atoi()


def test_failed_state_is_printed_transient_states_fail(proc, capsys):
    code, out, _ = run(["--get-state", "--pid", str(PID)], FakeDriver({PID: "failed"}), proc, capsys)
    assert (code, out) == (0, "failed\n")
    for transient in ("checkpointing", "restoring"):
        code, out, err = run(["--get-state", "--pid", str(PID)], FakeDriver({PID: transient}), proc, capsys)
        assert code == 1 and out == ""
        assert transient in err


def test_lock_timeout_is_passed_through_in_milliseconds(proc, capsys):
    drv = FakeDriver()
    assert run(["--action", "lock", "--pid", str(PID), "--timeout", "10000"], drv, proc, capsys)[0] == 0
    assert drv.calls == [("lock", PID, 10000)]
    drv = FakeDriver()
    assert run(["--action", "lock", "--pid", str(PID)], drv, proc, capsys)[0] == 0
    assert drv.calls == [("lock", PID, 0)]  # CRIU omits --timeout when it is 0: no timeout


def test_timeout_only_for_lock_and_in_range(proc, capsys):
    for args in (["--action", "unlock", "--pid", str(PID), "--timeout", "5"],
                 ["--action", "lock", "--pid", str(PID), "--timeout", "-1"],
                 ["--action", "lock", "--pid", str(PID), "--timeout", str(2**32)]):
        drv = FakeDriver()
        code, out, err = run(args, drv, proc, capsys)
        assert code == 2 and out == "" and "--timeout" in err
        assert drv.calls == []


def test_driver_error_exits_nonzero_with_message_on_stderr(proc, capsys):
    drv = FakeDriver()  # running: checkpoint needs locked
    code, out, err = run(["--action", "checkpoint", "--pid", str(PID)], drv, proc, capsys)
    assert code == 1 and out == ""
    assert err.startswith("cuda-checkpoint: --action checkpoint --pid 4242 failed: ")
    assert "CUDA_ERROR_ILLEGAL_STATE" in err
    assert len(err.splitlines()) == 1
    assert drv.states[PID] == "running"


def test_process_without_cuda_makes_get_restore_tid_fail(proc, capsys):
    # The plugin reads a non-zero exit here as "no need to checkpoint devices on pid".
    code, out, err = run(["--get-restore-tid", "--pid", str(OTHER)], FakeDriver(), proc, capsys)
    assert code == 1 and out == ""
    assert "CUDA_ERROR_INVALID_VALUE" in err


def test_unknown_pid_is_an_error_without_calling_the_driver(proc, capsys):
    for args in (["--get-state", "--pid", "99999"], ["--action", "lock", "--pid", "99999"]):
        drv = FakeDriver()
        code, out, err = run(args, drv, proc, capsys)
        assert code == 1 and out == ""
        assert "no such process: 99999" in err
        assert drv.calls == []


@pytest.mark.parametrize("args", [
    [],
    ["--pid", str(PID)],
    ["--get-state"],
    ["--action", "freeze", "--pid", str(PID)],
    ["--action", "lock", "--get-state", "--pid", str(PID)],
    ["--get-state", "--pid", "abc"],
    ["--get-state", "--pid", "0"],
    ["--get", "--pid", str(PID)],  # no abbreviations
])
def test_usage_errors_exit_2(args, proc, capsys):
    drv = FakeDriver()
    code, out, err = run(args, drv, proc, capsys)
    assert code == 2 and out == "" and err
    assert drv.calls == []


def test_driver_construction_failure_is_unavailable_not_no_cuda(proc, monkeypatch, capsys):
    # Exit 1 means "the driver refused" (e.g. not a CUDA process); a helper that cannot reach
    # the driver exits 3 with a message CRIU's log keeps and vllm-snapshot looks for.
    def no_cuda():
        raise cc.DriverUnavailable("cuInit", "DynamicLibNotFoundError", "libcuda not found")

    monkeypatch.setattr(cc, "CudaDriver", no_cuda)
    for args in (["--get-state", "--pid", str(PID)], ["--get-restore-tid", "--pid", str(OTHER)]):
        code = cc.main(args, proc_root=proc)
        out, err = capsys.readouterr()
        assert code == 3 and out == ""
        assert err.startswith("cuda-checkpoint: unavailable: ") and "cuInit: DynamicLibNotFoundError" in err
        assert len(err.encode()) > 0 and cc.UNAVAILABLE.encode() in err.encode()[:127]  # CRIU logs 127 bytes


def test_resolve_pid_uses_real_proc():
    assert cc.resolve_pid(os.getpid()) == os.getpid()
    with pytest.raises(LookupError):
        cc.resolve_pid(2**31 - 1)


def test_digest_is_sha256_of_the_module_file():
    assert cc.digest() == hashlib.sha256(Path(cc.__file__).read_bytes()).hexdigest()


# --- helper_dir: the wrapper CRIU finds on PATH ------------------------------------------------


def _env_with(path_dir: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{path_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def test_helper_dir_is_private_and_holds_an_executable_wrapper(tmp_path):
    d = cc.helper_dir(tmp_path / "cache")
    assert d == tmp_path / "cache" / cc.HELPER_DIRNAME
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    script = d / "cuda-checkpoint"
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert f"exec {sys.executable} -W ignore -m vllm_snapshot.checkpoint.cuda_checkpoint \"$@\" </dev/null" in text
    assert sorted(p.name for p in d.iterdir()) == ["cuda-checkpoint"]
    # Idempotent, and repairs a loosened mode.
    os.chmod(d, 0o755)
    assert cc.helper_dir(tmp_path / "cache") == d
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_helper_dir_refuses_a_symlink(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / cc.HELPER_DIRNAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EnvironmentProblem):
        cc.helper_dir(tmp_path / "cache")


def test_wrapper_starts_with_a_directory_as_stdin(tmp_path):
    # Under pycriu's `criu swrk`, fds 0-2 were closed and CRIU reuses fd 0 (e.g. for a directory);
    # the plugin's child inherits it. Python itself refuses such a stdin ("init_sys_streams:
    # <stdin> is a directory"): the wrapper must not hand it on.
    d = cc.helper_dir(tmp_path / "cache")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cp = subprocess.run(["cuda-checkpoint", "--get-state", "--pid", str(2**31 - 1)], stdin=fd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env_with(d),
                            cwd=tmp_path, timeout=60)
    finally:
        os.close(fd)
    assert "init_sys_streams" not in cp.stdout
    assert (cp.returncode, cp.stdout.split(":")[0]) == (1, "cuda-checkpoint"), cp.stdout


def test_wrapper_runs_from_path_like_criu_does(tmp_path):
    d = cc.helper_dir(tmp_path / "cache")
    # As launch_cuda_checkpoint does: execvp("cuda-checkpoint"), stdout+stderr in one pipe,
    # from an unrelated working directory, without our package on PYTHONPATH.
    # `-h` probes the driver; this host has none (or no cuda-bindings): exit 3, said plainly.
    cp = subprocess.run(["cuda-checkpoint", "-h"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, env=_env_with(d), cwd=tmp_path, timeout=60)
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        skip_on_gpu_host("-h may succeed here")
    assert cp.returncode == 3, cp.stdout
    assert cp.stdout.startswith("cuda-checkpoint: unavailable: ") and "--action" not in cp.stdout
    cp = subprocess.run(["cuda-checkpoint", "--get-state", "--pid", str(2**31 - 1)], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=_env_with(d), cwd=tmp_path, timeout=60)
    assert cp.returncode == 1
    assert cp.stdout.startswith("cuda-checkpoint: --get-state --pid 2147483647: no such process")


# --- CudaDriver over the real cuda-bindings, against a stub libcuda.so.1 ------------------------

# Our stub of the seven driver entry points (plus the ones cuda-bindings needs to load it),
# with the process state kept in $STUB_STATE across the helper's short-lived runs.
STUB_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int CUresult;
static int inited;
static void logmsg(const char *m, long a) { FILE *f = fopen(getenv("STUB_LOG"), "a"); if (f) { fprintf(f, "%s %ld\n", m, a); fclose(f); } }
static int get(void) { int s = 0; FILE *f = fopen(getenv("STUB_STATE"), "r"); if (f) { if (fscanf(f, "%d", &s) != 1) s = 0; fclose(f); } return s; }
static void put(int s) { FILE *f = fopen(getenv("STUB_STATE"), "w"); if (f) { fprintf(f, "%d", s); fclose(f); } }
static int ours(int pid) { return getenv("STUB_PID") && atoi(getenv("STUB_PID")) == pid; }
static CUresult step(int pid, int from, int to) { if (!inited) return 3; if (!ours(pid)) return 1; if (get() != from) return 401; put(to); return 0; }
CUresult cuInit(unsigned int flags) { inited = 1; logmsg("cuInit", flags); return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) { if (!inited) return 3; if (!ours(pid)) return 1; *tid = pid + 7; return 0; }
CUresult cuCheckpointProcessGetState(int pid, int *st) { if (!inited) return 3; if (!ours(pid)) return 1; *st = get(); return 0; }
CUresult cuCheckpointProcessLock(int pid, unsigned int *args) { logmsg("lock-timeoutMs", args ? (long)args[0] : -1); return step(pid, 0, 1); }
CUresult cuCheckpointProcessCheckpoint(int pid, void *args) { logmsg("checkpoint-args", args != 0); return step(pid, 1, 2); }
/* CUcheckpointRestoreArgs: CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount; ... (cuda.h 13);
   a pair is two 16-byte CUuuid: logged as "restore-pair OLDHEX=NEWHEX" */
typedef struct { unsigned char b[16]; } uuid16;
typedef struct { uuid16 oldUuid, newUuid; } gpupair;
typedef struct { gpupair *gpuPairs; unsigned int gpuPairsCount; } restoreargs;
static void hex(FILE *f, const uuid16 *u) { for (int i = 0; i < 16; i++) fprintf(f, "%02x", u->b[i]); }
CUresult cuCheckpointProcessRestore(int pid, restoreargs *args) {
  logmsg("restore-args", args != 0);
  if (args) { FILE *f = fopen(getenv("STUB_LOG"), "a"); if (f) { fprintf(f, "restore-pairs %u\n", args->gpuPairsCount);
    for (unsigned i = 0; i < args->gpuPairsCount; i++) { fprintf(f, "restore-pair "); hex(f, &args->gpuPairs[i].oldUuid);
      fprintf(f, "="); hex(f, &args->gpuPairs[i].newUuid); fprintf(f, "\n"); } fclose(f); } }
  return step(pid, 2, 1); }
CUresult cuCheckpointProcessUnlock(int pid, void *args) { logmsg("unlock-args", args != 0); return step(pid, 1, 0); }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = e == 401 ? "CUDA_ERROR_ILLEGAL_STATE" : e == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stub"; return 0; }
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
  *pfn = dlsym(RTLD_DEFAULT, sym); if (status) *status = *pfn ? 0 : 1; return *pfn ? 0 : 500; }
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
  return cuGetProcAddress_v2(sym, pfn, ver, flags, 0); }
"""


@pytest.fixture
def stub_cuda(tmp_path):
    cc_bin = shutil.which("cc") or shutil.which("gcc")
    if not cc_bin:
        pytest.skip("no C compiler for the stub libcuda")
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    lib = tmp_path / "stublib"
    lib.mkdir()
    (lib / "stub.c").write_text(textwrap.dedent(STUB_C))
    subprocess.run([cc_bin, "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(lib / "stub.c"), "-ldl"],
                   check=True, capture_output=True, timeout=120)
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    return lib


def test_cuda_driver_over_cuda_bindings_with_stub_libcuda(tmp_path, stub_cuda):
    target = subprocess.Popen(["sleep", "60"])  # a real PID for the /proc lookup
    try:
        d = cc.helper_dir(tmp_path / "cache")
        log, state = tmp_path / "stub.log", tmp_path / "stub.state"
        env = _env_with(d, LD_LIBRARY_PATH=str(stub_cuda), STUB_PID=str(target.pid),
                        STUB_LOG=str(log), STUB_STATE=str(state))

        def helper(*args: str) -> tuple[int, str]:
            cp = subprocess.run(["cuda-checkpoint", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp_path, timeout=60)
            return cp.returncode, cp.stdout

        pid = str(target.pid)
        assert helper("--get-restore-tid", "--pid", pid) == (0, f"{target.pid + 7}\n")
        assert helper("--get-state", "--pid", pid) == (0, "running\n")
        assert helper("--action", "lock", "--pid", pid, "--timeout", "10000") == (0, "")
        assert helper("--get-state", "--pid", pid) == (0, "locked\n")
        assert helper("--action", "checkpoint", "--pid", pid) == (0, "")
        assert helper("--get-state", "--pid", pid) == (0, "checkpointed\n")
        code, out = helper("--action", "unlock", "--pid", pid)
        assert code == 1 and "cuCheckpointProcessUnlock: CUDA_ERROR_ILLEGAL_STATE" in out
        assert helper("--action", "restore", "--pid", pid) == (0, "")
        assert helper("--action", "unlock", "--pid", pid) == (0, "")
        assert helper("--get-state", "--pid", pid) == (0, "running\n")
        code, out = helper("--get-restore-tid", "--pid", str(os.getpid()))  # no CUDA here
        assert code == 1 and "CUDA_ERROR_INVALID_VALUE" in out
        calls = log.read_text().splitlines()
        assert calls[0] == "cuInit 0"
        assert "lock-timeoutMs 10000" in calls
        assert "checkpoint-args 0" in calls and "restore-args 0" in calls
    finally:
        target.kill()
        target.wait()


# --- GPU remapping: --device-map / $VLLM_SNAPSHOT_CUDA_DEVICE_MAP -> gpuPairs --------------------

OLD_GPU = "GPU-0c4a1b2e-1111-2222-3333-444455556666"
NEW_GPU = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"


def test_parse_device_map_normalizes_and_keeps_order():
    assert cc.parse_device_map(f"{OLD_GPU}={NEW_GPU}") == ((OLD_GPU, NEW_GPU),)
    # without the GPU- prefix, upper case, spaces: the same pairs
    text = f" {OLD_GPU[4:].upper()} = {NEW_GPU} , {NEW_GPU}={OLD_GPU}"
    assert cc.parse_device_map(text, recorded=[OLD_GPU, NEW_GPU]) == ((OLD_GPU, NEW_GPU), (NEW_GPU, OLD_GPU))
    assert cc.format_device_map(cc.parse_device_map(text)) == f"{OLD_GPU}={NEW_GPU},{NEW_GPU}={OLD_GPU}"


@pytest.mark.parametrize("text,recorded,says", [
    ("", (), "empty"),
    (f"{OLD_GPU}={NEW_GPU},", (), "empty item"),
    (f"{OLD_GPU}:{NEW_GPU}", (), "has no '='"),
    (f"{OLD_GPU}=GPU-123", (), "'GPU-123' is not a GPU UUID"),
    (f"MIG-{OLD_GPU[4:]}={NEW_GPU}", (), "is not a GPU UUID"),
    (f"{OLD_GPU}={NEW_GPU},{OLD_GPU}={OLD_GPU}", (), "more than once"),
    (f"{OLD_GPU}={NEW_GPU},{NEW_GPU}={NEW_GPU}", (), "several GPUs onto " + NEW_GPU),
    (f"{OLD_GPU}={NEW_GPU}", (NEW_GPU,), f"does not map {NEW_GPU}"),
])
def test_parse_device_map_refuses_bad_maps(text, recorded, says):
    with pytest.raises(ValueError, match=re_escape(says)):
        cc.parse_device_map(text, recorded)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def _to_checkpointed(drv, proc, capsys):
    for action in ("lock", "checkpoint"):
        assert run(["--action", action, "--pid", str(PID)], drv, proc, capsys)[0] == 0


def test_restore_passes_the_device_map_to_the_driver(proc, capsys, monkeypatch):
    monkeypatch.delenv(cc.DEVICE_MAP_ENV, raising=False)
    drv = FakeDriver()
    _to_checkpointed(drv, proc, capsys)
    code, out, err = run(["--action", "restore", "--pid", str(PID), "--device-map", f"{OLD_GPU}={NEW_GPU}"],
                         drv, proc, capsys)
    assert (code, out, err) == (0, "", "")
    assert drv.calls[-1] == ("restore", PID, ((OLD_GPU, NEW_GPU),))


def test_restore_takes_the_map_from_the_environment_the_command_line_wins(proc, capsys, monkeypatch):
    # CRIU 4.2.1's plugin passes no map: vllm-snapshot puts it in CRIU's environment
    monkeypatch.setenv(cc.DEVICE_MAP_ENV, f"{OLD_GPU}={NEW_GPU}")
    drv = FakeDriver()
    _to_checkpointed(drv, proc, capsys)
    assert run(["--action", "restore", "--pid", str(PID)], drv, proc, capsys)[0] == 0
    assert drv.calls[-1] == ("restore", PID, ((OLD_GPU, NEW_GPU),))
    assert run(["--action", "unlock", "--pid", str(PID)], drv, proc, capsys)[0] == 0  # unlock ignores it
    assert drv.calls[-1] == ("unlock", PID)
    drv = FakeDriver()
    _to_checkpointed(drv, proc, capsys)
    assert run(["--action", "restore", "--pid", str(PID), "--device-map", f"{OLD_GPU}={OLD_GPU}"],
               drv, proc, capsys)[0] == 0
    assert drv.calls[-1] == ("restore", PID, ((OLD_GPU, OLD_GPU),))


def test_a_bad_or_misplaced_device_map_is_a_usage_error_before_the_driver(proc, capsys, monkeypatch):
    monkeypatch.setenv(cc.DEVICE_MAP_ENV, "nonsense")
    drv = FakeDriver({PID: "checkpointed"})
    code, out, err = run(["--action", "restore", "--pid", str(PID)], drv, proc, capsys)
    assert code == cc.EXIT_USAGE and f"${cc.DEVICE_MAP_ENV}" in err and "has no '='" in err
    code, out, err = run(["--action", "lock", "--pid", str(PID), "--device-map", f"{OLD_GPU}={NEW_GPU}"],
                         drv, proc, capsys)
    assert code == cc.EXIT_USAGE and "only to --action restore" in err
    assert drv.calls == [] and drv.states[PID] == "checkpointed"


def test_help_names_device_map_only_when_the_driver_can_remap(capsys):
    drv = FakeDriver()
    assert cc.main(["-h"], driver=drv) == 0
    out = capsys.readouterr().out
    assert cc.REMAP_HELP in out and cc.NO_REMAP_HELP not in out
    assert "--action" in out.encode()[:2047].decode() and len(out.encode()) < 2047
    drv.no_remap = "driver API 12080 restores only onto the GPU checkpointed on"
    assert cc.main(["-h"], driver=drv) == 0
    out = capsys.readouterr().out
    assert cc.REMAP_HELP not in out and f"{cc.NO_REMAP_HELP} driver API 12080" in out and "--action" in out


def _driver_over(module, version: int) -> cc.CudaDriver:
    d = cc.CudaDriver.__new__(cc.CudaDriver)  # no cuInit: only the remap decision is under test
    d._d, d._version = module, version
    return d


def test_cuda_driver_can_remap_only_with_gpu_pairs_and_a_r580_driver():
    drv = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    assert _driver_over(drv, cc.MIN_REMAP_DRIVER_API).remap_unavailable() is None
    assert "r580" in _driver_over(drv, cc.MIN_REMAP_DRIVER_API - 10).remap_unavailable()

    class OldBindings:  # cuda-bindings before the remap fields
        class CUcheckpointRestoreArgs:
            pass

    assert "gpuPairs" in _driver_over(OldBindings, 13000).remap_unavailable()
    with pytest.raises(cc.DriverError, match="CUDA_ERROR_NOT_SUPPORTED.*gpuPairs"):
        _driver_over(OldBindings, 13000).restore(PID, ((OLD_GPU, NEW_GPU),))


def test_restore_args_are_accepted_by_the_real_cuda_bindings_types():
    # the types only, no driver call: a misspelt field or a wrong value type fails here
    drv = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    args, keep = cc.restore_args(drv, ((OLD_GPU, NEW_GPU), (NEW_GPU, OLD_GPU)))
    assert isinstance(args, drv.CUcheckpointRestoreArgs) and args.gpuPairsCount == 2
    got = [(p.oldUuid.bytes.hex(), p.newUuid.bytes.hex()) for p in args.gpuPairs]
    hx = lambda u: u.removeprefix("GPU-").replace("-", "")  # noqa: E731
    assert got == [(hx(OLD_GPU), hx(NEW_GPU)), (hx(NEW_GPU), hx(OLD_GPU))]
    del keep  # the pairs hold copies: the buffers may go
    import gc

    gc.collect()
    assert args.gpuPairs[0].oldUuid.bytes.hex() == hx(OLD_GPU)
    with pytest.raises(AttributeError):
        args.gpuPair = []  # what a misspelling does with these types


def test_device_map_reaches_the_driver_through_the_real_bindings(tmp_path, stub_cuda):
    # wrapper -> helper -> cuda-bindings -> (stub) libcuda: the C struct the driver reads
    target = subprocess.Popen(["sleep", "60"])
    try:
        d = cc.helper_dir(tmp_path / "cache")
        log, state = tmp_path / "stub.log", tmp_path / "stub.state"
        env = _env_with(d, LD_LIBRARY_PATH=str(stub_cuda), STUB_PID=str(target.pid),
                        STUB_LOG=str(log), STUB_STATE=str(state))

        def helper(*args: str, **more: str) -> tuple[int, str]:
            cp = subprocess.run(["cuda-checkpoint", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**env, **more}, cwd=tmp_path, timeout=60)
            return cp.returncode, cp.stdout

        pid = str(target.pid)
        code, out = helper("-h")
        assert code == 0 and cc.REMAP_HELP in out  # the stub reports driver API 13000
        for action in ("lock", "checkpoint"):
            assert helper("--action", action, "--pid", pid) == (0, "")
        assert helper("--action", "restore", "--pid", pid, "--device-map", f"{OLD_GPU}={NEW_GPU}") == (0, "")
        for action in ("unlock", "lock", "checkpoint"):
            assert helper("--action", action, "--pid", pid) == (0, "")
        assert helper("--action", "restore", "--pid", pid, **{cc.DEVICE_MAP_ENV: f"{NEW_GPU}={NEW_GPU}"}) == (0, "")
        lines = log.read_text().splitlines()
        hx = lambda u: u.removeprefix("GPU-").replace("-", "")  # noqa: E731
        pairs = [ln for ln in lines if ln.startswith("restore-pair ")]
        assert pairs == [f"restore-pair {hx(OLD_GPU)}={hx(NEW_GPU)}", f"restore-pair {hx(NEW_GPU)}={hx(NEW_GPU)}"]
        assert lines.count("restore-pairs 1") == 2 and "restore-args 1" in lines
    finally:
        target.kill()
        target.wait()
