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
  ``=stay-locked``: unlock answers success but the process stays locked (a silent failure);
  ``=remap``: a restore with GPU pairs fails with CUDA_ERROR_NOT_SUPPORTED.
* GPU remapping as cuda-bindings 13.5.0 spells it: ``CUuuid(address)`` over 16 bytes (``bytes``
  read-only), ``CUcheckpointGpuPair`` (``oldUuid``/``newUuid``; assigning copies),
  ``CUcheckpointRestoreArgs`` (``gpuPairs`` a list of pairs, ``gpuPairsCount``; any other
  attribute is an AttributeError, as with the real types). A restore logs its pairs
  (``restore <pid> pairs=OLD>NEW,...``); a count that is not the list's length is
  CUDA_ERROR_INVALID_VALUE.
Transitions follow the driver's documented state machine: lock RUNNING->LOCKED, checkpoint
LOCKED->CHECKPOINTED, restore CHECKPOINTED->LOCKED, unlock LOCKED->RUNNING; anything else is
CUDA_ERROR_ILLEGAL_STATE.

The virtual memory management calls vLLM's CuMemAllocator makes (csrc/cumem_allocator.cpp:
reserve a VA range, create physical memory and map it there, set access; at sleep level 2
unmap and release it while the reservation stays; at wake create and map again at the same
address) are faked over host memory of the calling process, with the driver's rules checked:
``cuMemAddressReserve`` is an ``mmap(PROT_NONE)``; ``cuMemMap`` puts fresh zeroed pages at an
address inside a reservation that is not mapped yet (and is a ``PROT_NONE`` mapping in
/proc/self/maps), with a live handle of the same size (else CUDA_ERROR_INVALID_VALUE); they are inaccessible until ``cuMemSetAccess``; ``cuMemUnmap`` puts
the ``PROT_NONE`` reservation back (the pages are gone); copies touch only mapped, accessible
ranges. The state lives in the process, so CRIU dumps and restores it with the process, as the
real driver's checkpoint restores the real one. Signatures and return tuples are cuda-bindings'.
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
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_ILLEGAL_STATE = 401


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class CUcheckpointLockArgs:
    def __init__(self):
        self.timeoutMs = 0


class CUuuid:
    """16 bytes read from ``address`` at construction (cuda-bindings: a view; copied on assignment)."""

    __slots__ = ("_b",)

    def __init__(self, address=0):
        import ctypes

        self._b = ctypes.string_at(address, 16) if address else bytes(16)

    @property
    def bytes(self):
        return self._b


def _uuid_text(u):
    h = u.bytes.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class CUcheckpointGpuPair:
    __slots__ = ("_old", "_new")

    def __init__(self):
        self._old, self._new = CUuuid(), CUuuid()

    @property
    def oldUuid(self):
        return self._old

    @oldUuid.setter
    def oldUuid(self, u):
        self._old = CUuuid.__new__(CUuuid)
        self._old._b = bytes(u.bytes)

    @property
    def newUuid(self):
        return self._new

    @newUuid.setter
    def newUuid(self, u):
        self._new = CUuuid.__new__(CUuuid)
        self._new._b = bytes(u.bytes)


class CUcheckpointRestoreArgs:
    __slots__ = ("gpuPairs", "gpuPairsCount", "customStorageInfo_out")

    def __init__(self):
        self.gpuPairs, self.gpuPairsCount, self.customStorageInfo_out = [], 0, 0


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


def cuInit(Flags):
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
    if args is None or not args.gpuPairsCount:
        return _step("restore", pid, S.CU_PROCESS_STATE_CHECKPOINTED, S.CU_PROCESS_STATE_LOCKED)
    pairs = ",".join(f"{_uuid_text(p.oldUuid)}>{_uuid_text(p.newUuid)}" for p in args.gpuPairs)
    if args.gpuPairsCount != len(args.gpuPairs):
        _log(f"restore {pid} pairs={pairs} count={args.gpuPairsCount} CUDA_ERROR_INVALID_VALUE")
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if os.environ.get("FAKE_CUDA_FAIL") == "remap":
        _log(f"restore {pid} pairs={pairs} CUDA_ERROR_NOT_SUPPORTED")
        return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
    return _step("restore", pid, S.CU_PROCESS_STATE_CHECKPOINTED, S.CU_PROCESS_STATE_LOCKED, f" pairs={pairs}")


def cuCheckpointProcessUnlock(pid, args):
    return _step("unlock", pid, S.CU_PROCESS_STATE_LOCKED, S.CU_PROCESS_STATE_RUNNING)


# ---------------------------------------------------------------- virtual memory management

class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAllocationCompType(enum.IntEnum):
    CU_MEM_ALLOCATION_COMP_NONE = 0
    CU_MEM_ALLOCATION_COMP_GENERIC = 1


class CUmemLocation:
    def __init__(self):
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationFlags:
    def __init__(self):
        self.compressionType = CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_NONE


class CUmemAllocationProp:
    def __init__(self):
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.location = CUmemLocation()
        self.allocFlags = CUmemAllocationFlags()


class CUmemAccessDesc:
    def __init__(self):
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


GRANULARITY = 2 << 20
_BAD = CUresult.CUDA_ERROR_INVALID_VALUE
_reserved = {}   # va -> size
_handles = {}    # handle -> size
_mapped = {}     # va -> [size, handle, accessible]
_next_handle = [1]
class CUcontext:
    def __int__(self):
        return 0x1000


_CTX = CUcontext()
_current = [None]


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x02, 0x10, 0x20, 0x4000


def _mmap(addr, size, prot, extra):
    got = _libc().mmap(addr or None, size, prot, _MAP_PRIVATE | _MAP_ANON | extra, -1, 0)
    return None if got in (None, 2**64 - 1) else got


def _prop_ok(prop):
    return (prop is not None and prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            and prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and prop.location.id == 0)


def _within(table, va, size):
    """The start of the entry of ``table`` holding [va, va + size), or None."""
    for start, ent in table.items():
        length = ent[0] if isinstance(ent, list) else ent
        if start <= va and va + size <= start + length:
            return start
    return None


def _kernel_reserved(va, size):
    """True when /proc/self/maps has one PROT_NONE mapping covering [va, va + size): the
    reservation exists in the kernel, not only in this module's tables (after a CRIU restore,
    this is what proves the reservation came back)."""
    with open("/proc/self/maps") as f:
        for line in f:
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if lo <= va and va + size <= hi:
                return perms.startswith("---")
    return False


def _accessible(ptr, size):
    start = _within(_mapped, int(ptr), size)
    return start is not None and _mapped[start][2]


def cuDeviceGet(ordinal):
    if not _inited:
        return (CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)
    return (_OK, 0) if ordinal == 0 else (CUresult.CUDA_ERROR_INVALID_VALUE, 0)


def cuDevicePrimaryCtxRetain(dev):
    if not _inited:
        return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
    return (_OK, _CTX)


def cuCtxGetCurrent():
    return (_OK, _current[0])


def cuCtxSetCurrent(ctx):
    _current[0] = ctx
    return (_OK,)


def cuCtxSynchronize():
    return (_OK,) if _current[0] is _CTX else (CUresult.CUDA_ERROR_NOT_INITIALIZED,)


def _need_ctx():
    return _OK if _inited and _current[0] is _CTX else CUresult.CUDA_ERROR_NOT_INITIALIZED


def cuMemGetAllocationGranularity(prop, option):
    err = _need_ctx()
    if err == _OK and not _prop_ok(prop):
        err = _BAD
    return (err, GRANULARITY if err == _OK else 0)


def cuMemAddressReserve(size, alignment, addr, flags):
    err = _need_ctx()
    if err == _OK and (size <= 0 or size % GRANULARITY or flags):
        err = _BAD
    va = _mmap(0, size, _PROT_NONE, _MAP_NORESERVE) if err == _OK else None
    if err == _OK and va is None:
        err = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    if err == _OK:
        _reserved[va] = size
    return (err, va or 0)


def cuMemCreate(size, prop, flags):
    err = _need_ctx()
    if err == _OK and (size <= 0 or size % GRANULARITY or flags or not _prop_ok(prop)):
        err = _BAD
    if err != _OK:
        return (err, 0)
    h = _next_handle[0]
    _next_handle[0] += 1
    _handles[h] = size
    return (_OK, h)


def cuMemMap(ptr, size, offset, handle, flags):
    va, err = int(ptr), _need_ctx()
    if err == _OK and (_within(_reserved, va, size) is None or _handles.get(int(handle)) != size or offset or flags
                       or any(s < va + size and va < s + e[0] for s, e in _mapped.items())
                       or not _kernel_reserved(va, size)):
        err = _BAD
    if err == _OK and _mmap(va, size, _PROT_NONE, _MAP_FIXED) != va:
        err = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    if err == _OK:
        _mapped[va] = [size, int(handle), False]
    return (err,)


def cuMemSetAccess(ptr, size, desc, count):
    va, err = int(ptr), _need_ctx()
    if err == _OK and (va not in _mapped or _mapped[va][0] != size or count != 1 or len(desc) != 1
                       or desc[0].flags != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                       or desc[0].location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
        err = _BAD
    if err == _OK and _libc().mprotect(va, size, _PROT_RW) != 0:
        err = _BAD
    if err == _OK:
        _mapped[va][2] = True
    return (err,)


def cuMemUnmap(ptr, size):
    va, err = int(ptr), _need_ctx()
    if err == _OK and (va not in _mapped or _mapped[va][0] != size):
        err = _BAD
    if err == _OK and _mmap(va, size, _PROT_NONE, _MAP_FIXED | _MAP_NORESERVE) != va:
        err = _BAD
    if err == _OK:
        del _mapped[va]
    return (err,)


def cuMemRelease(handle):
    err = _need_ctx()
    if err == _OK and _handles.pop(int(handle), None) is None:
        err = _BAD
    return (err,)


def cuMemAddressFree(ptr, size):
    va, err = int(ptr), _need_ctx()
    if err == _OK and (_reserved.get(va) != size or _within(_mapped, va, 1) is not None):
        err = _BAD
    if err == _OK:
        _libc().munmap(va, size)
        del _reserved[va]
    return (err,)


def _host_addr(buf):
    import ctypes

    if isinstance(buf, int):
        return buf, None
    keep = (ctypes.c_char * len(buf)).from_buffer(buf) if not isinstance(buf, bytes) else ctypes.c_char_p(buf)
    return ctypes.cast(keep, ctypes.c_void_p).value, keep


def cuMemcpyHtoD(dstDevice, srcHost, ByteCount):
    import ctypes

    err = _need_ctx()
    if err == _OK and not _accessible(dstDevice, ByteCount):
        err = _BAD
    if err == _OK:
        src, _keep = _host_addr(srcHost)
        ctypes.memmove(int(dstDevice), src, ByteCount)
    return (err,)


def cuMemcpyDtoH(dstHost, srcDevice, ByteCount):
    import ctypes

    err = _need_ctx()
    if err == _OK and not _accessible(srcDevice, ByteCount):
        err = _BAD
    if err == _OK:
        dst, _keep = _host_addr(dstHost)
        ctypes.memmove(dst, int(srcDevice), ByteCount)
    return (err,)
