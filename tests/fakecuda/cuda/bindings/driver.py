"""A fake ``cuda.bindings.driver``: the calls our cuda-checkpoint helper makes, over a state
machine kept in files, so CRIU's CUDA plugin -> PATH -> helper -> "driver" chain runs through
real CRIU on a host without a GPU (tests/test_gpu_sequencing.py).

* A process "has CUDA" when one of its threads is named :data:`RESTORE_THREAD` (its
  ``/proc/PID/task/TID/comm``); that thread is its restore thread, as the real driver's.
* ``$FAKE_CUDA_DIR/state`` holds the one CUDA process's state (0 running .. 2 checkpointed);
  ``$FAKE_CUDA_DIR/calls.log`` gets one line per call (``lock <pid> timeoutMs=<ms>``, ...).
* ``$FAKE_CUDA_INIT=fail``: cuInit fails (CUDA_ERROR_NO_DEVICE, as without a GPU).
* ``$FAKE_CUDA_DRIVER_API``: what cuDriverGetVersion reports (default 13000).
* ``$FAKE_CUDA_FAIL=restore``: cuCheckpointProcessRestore fails (CUDA_ERROR_OUT_OF_MEMORY);
  ``=stay-locked``: unlock answers success but the process stays locked (a silent failure).
Transitions follow the driver's documented state machine: lock RUNNING->LOCKED, checkpoint
LOCKED->CHECKPOINTED, restore CHECKPOINTED->LOCKED, unlock LOCKED->RUNNING; anything else is
CUDA_ERROR_ILLEGAL_STATE.
"""

import enum
import os

RESTORE_THREAD = "fakecuda-rst"


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_ILLEGAL_STATE = 401


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class CUcheckpointLockArgs:
    def __init__(self):
        self.timeoutMs = 0


_OK = CUresult.CUDA_SUCCESS
_inited = False


def _path(name):
    return os.path.join(os.environ["FAKE_CUDA_DIR"], name)


def _log(line):
    with open(_path("calls.log"), "a") as f:
        f.write(line + "\n")


def _state():
    try:
        with open(_path("state")) as f:
            return CUprocessState(int(f.read().strip() or 0))
    except FileNotFoundError:
        return CUprocessState.CU_PROCESS_STATE_RUNNING


def _put(state):
    with open(_path("state"), "w") as f:
        f.write(str(int(state)))


def _restore_tid(pid):
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == RESTORE_THREAD:
                    return int(tid)
        except OSError:
            continue
    return None


def cuInit(flags):
    global _inited
    if os.environ.get("FAKE_CUDA_INIT") == "fail":
        return (CUresult.CUDA_ERROR_NO_DEVICE,)
    _inited = True
    return (_OK,)


def cuDriverGetVersion():
    return (_OK, int(os.environ.get("FAKE_CUDA_DRIVER_API", "13000")))


def cuGetErrorName(err):
    return (_OK, CUresult(err).name.encode())


def cuGetErrorString(err):
    return (_OK, b"fake driver")


def _check(pid):
    if not _inited:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED
    if _restore_tid(pid) is None:
        return CUresult.CUDA_ERROR_INVALID_VALUE
    return _OK


def cuCheckpointProcessGetRestoreThreadId(pid):
    err = _check(pid)
    _log(f"get-restore-tid {pid} {err.name}")
    return (err, _restore_tid(pid) or 0)


def cuCheckpointProcessGetState(pid):
    err = _check(pid)
    return (err, _state())


def _step(call, pid, frm, to, extra=""):
    err = _check(pid)
    if err == _OK and _state() != frm:
        err = CUresult.CUDA_ERROR_ILLEGAL_STATE
    fail = os.environ.get("FAKE_CUDA_FAIL")
    if err == _OK and call == "restore" and fail == "restore":
        err = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    _log(f"{call} {pid}{extra} {err.name}")
    if err == _OK and not (call == "unlock" and fail == "stay-locked"):
        _put(to)
    return (err,)


S = CUprocessState


def cuCheckpointProcessLock(pid, args):
    ms = args.timeoutMs if args is not None else 0
    return _step("lock", pid, S.CU_PROCESS_STATE_RUNNING, S.CU_PROCESS_STATE_LOCKED, f" timeoutMs={ms}")


def cuCheckpointProcessCheckpoint(pid, args):
    return _step("checkpoint", pid, S.CU_PROCESS_STATE_LOCKED, S.CU_PROCESS_STATE_CHECKPOINTED)


def cuCheckpointProcessRestore(pid, args):
    return _step("restore", pid, S.CU_PROCESS_STATE_CHECKPOINTED, S.CU_PROCESS_STATE_LOCKED)


def cuCheckpointProcessUnlock(pid, args):
    return _step("unlock", pid, S.CU_PROCESS_STATE_LOCKED, S.CU_PROCESS_STATE_RUNNING)
