"""vllm_snapshot.checkpoint.inventory against small REAL process trees (no kernel mocks).

Every child is a ``python -c`` started with subprocess in its own session; it reports
readiness (a JSON line) over a pipe and then sleeps. The ``spawn`` fixture SIGKILLs each
child's whole process group (grandchildren included) at teardown; children also get
PR_SET_PDEATHSIG so nothing outlives a crashed test run.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vllm_snapshot.checkpoint import inventory as inv
from vllm_snapshot.host import ports
from vllm_snapshot.errors import EngineError, UnsnapshottableError

pytestmark = pytest.mark.timeout(60)

PRELUDE = r'''
import ctypes, json, os, socket, subprocess, sys, time
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL
_W = int(sys.argv[1])
def ready(**kw):
    os.write(_W, (json.dumps(kw) + "\n").encode())
def hold():
    while True:
        time.sleep(60)
'''

# a grandchild: same prelude, readiness on its own pipe, read back by the child
GRANDCHILD_SPAWN = r'''
def spawn_grandchild(code, *args):
    r, w = os.pipe()
    g = subprocess.Popen([sys.executable, "-c", PRELUDE_SRC + code, str(w), *map(str, args)], pass_fds=(w,))
    os.close(w)
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(r, 4096)
        if not chunk:
            raise SystemExit("grandchild died")
        line += chunk
    os.close(r)
    return g, json.loads(line)
'''

libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0
#: the tests model an engine namespace whose private mounts are /tmp and /dev/shm
TEST_PRIVATE = ("/tmp", "/dev/shm")


class Child:
    def __init__(self, proc: subprocess.Popen, info: dict):
        self.proc, self.info, self.pid = proc, info, proc.pid


@pytest.fixture
def spawn():
    children: list[subprocess.Popen] = []

    def _spawn(code: str, *args, grandchildren: bool = False, **popen) -> Child:
        src = PRELUDE
        if grandchildren:
            src += f"PRELUDE_SRC = {PRELUDE!r}\n" + GRANDCHILD_SPAWN
        r, w = os.pipe()
        p = subprocess.Popen([sys.executable, "-c", src + code, str(w), *map(str, args)],
                             pass_fds=(w,), start_new_session=True, **popen)
        children.append(p)
        os.close(w)
        try:
            buf = b""
            deadline = time.monotonic() + 10
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    raise AssertionError("child did not become ready in 10 s")
                chunk = os.read(r, 4096)
                if not chunk:
                    raise AssertionError(f"child exited before ready (rc={p.wait(5)})")
                buf += chunk
        finally:
            os.close(r)
        return Child(p, json.loads(buf))

    yield _spawn
    for p in children:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
        for s in (p.stdin, p.stdout, p.stderr):
            if s:
                s.close()


@pytest.fixture
def data_dir():
    """A directory OUTSIDE /tmp (files under /tmp are private to the engine and not recorded)."""
    base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else str(Path.home())
    d = Path(tempfile.mkdtemp(prefix="vllm-snapshot-inv-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def refused(pid: int) -> UnsnapshottableError:
    with pytest.raises(UnsnapshottableError) as ei:
        inv.inspect_tree(pid)
    return ei.value


# ----------------------------------------------------------------------------- refusals

def test_outbound_tcp_to_outside_peer_refused(spawn):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        c = spawn("s = socket.create_connection(('127.0.0.1', int(sys.argv[2])))\n"
                  "ready(local=s.getsockname()[1]); hold()", port)
        conn, _ = srv.accept()
        err = refused(c.pid)
        assert f"PID {c.pid} " in err.message
        assert f"127.0.0.1:{port}" in err.message and "ESTABLISHED TCP connection" in err.message
        assert f"held by PID {os.getpid()}" in err.message  # the peer's owner is named
        assert err.hint and "TCP" in err.hint
        assert {"pid": c.pid, "kind": "tcp"}.items() <= err.details[0].items()
        conn.close()
    finally:
        srv.close()


def test_unix_socket_to_outside_peer_refused(spawn, tmp_path):
    path = str(tmp_path / "outside.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    try:
        c = spawn("s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[2]); ready(); hold()", path)
        conn, _ = srv.accept()
        err = refused(c.pid)
        assert f"PID {c.pid} " in err.message
        assert "unix stream socket" in err.message and path in err.message
        assert f"held by PID {os.getpid()}" in err.message
        conn.close()
    finally:
        srv.close()


def test_io_uring_refused(spawn):
    c = spawn(
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "params = ctypes.create_string_buffer(120)\n"
        "fd = libc.syscall(425, 4, params)\n"
        "ready(fd=fd, errno=ctypes.get_errno()); hold()")
    if c.info["fd"] < 0:
        pytest.skip(f"io_uring_setup unavailable here: {os.strerror(c.info['errno'])}")
    err = refused(c.pid)
    assert f"PID {c.pid} " in err.message
    assert f"io_uring instance (fd {c.info['fd']}" in err.message
    assert "UV_USE_IO_URING=0" in err.hint and "io_uring_disabled" in err.hint


def test_sysv_shm_shared_with_parent_refused(spawn):
    libc.shmget.restype = ctypes.c_int
    shmid = libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600)
    if shmid < 0:
        pytest.skip(f"shmget: {os.strerror(ctypes.get_errno())}")
    try:
        c = spawn("libc = ctypes.CDLL(None, use_errno=True); libc.shmat.restype = ctypes.c_void_p\n"
                  "a = libc.shmat(int(sys.argv[2]), None, 0)\n"
                  "assert a not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()\n"
                  "ready(); hold()", shmid)
        err = refused(c.pid)
        assert f"PID {c.pid} " in err.message
        assert f"shmid {shmid}" in err.message and f"created by PID {os.getpid()}" in err.message
    finally:
        libc.shmctl(shmid, IPC_RMID, None)


class SemBuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


def test_sysv_semaphore_shared_with_parent_refused(spawn):
    semid = libc.semget(IPC_PRIVATE, 2, IPC_CREAT | 0o600)
    if semid < 0:
        pytest.skip(f"semget: {os.strerror(ctypes.get_errno())}")
    try:
        assert libc.semop(semid, ctypes.byref(SemBuf(0, 1, 0)), 1) == 0  # the parent uses sem 0
        c = spawn("class B(ctypes.Structure):\n"
                  "    _fields_ = [('n', ctypes.c_ushort), ('op', ctypes.c_short), ('fl', ctypes.c_short)]\n"
                  "libc = ctypes.CDLL(None, use_errno=True)\n"
                  "assert libc.semop(int(sys.argv[2]), ctypes.byref(B(1, 1, 0)), 1) == 0\n"
                  "ready(); hold()", semid)
        err = refused(c.pid)
        assert f"PID {c.pid} " in err.message
        assert f"semid {semid}" in err.message and str(os.getpid()) in err.message
    finally:
        libc.semctl(semid, 0, IPC_RMID)


def test_flock_on_host_file_refused_but_private_tmp_allowed(spawn, data_dir, tmp_path):
    code = ("import fcntl\nf = open(sys.argv[2], 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "ready(fd=f.fileno()); hold()")
    host_file = data_dir / "locked"
    c = spawn(code, host_file)
    err = refused(c.pid)
    assert f"PID {c.pid} " in err.message
    assert f"FLOCK ADVISORY WRITE lock on {host_file} (fd {c.info['fd']})" in err.message
    # /tmp is private tmpfs inside the engine's namespace: a lock there is dumped with the tree
    c2 = spawn(code, tmp_path / "locked")
    inv.inspect_tree(c2.pid, private_prefixes=TEST_PRIVATE)


def test_listener_on_all_addresses_refused(spawn):
    c = spawn("s = socket.create_server(('0.0.0.0', 0)); ready(port=s.getsockname()[1]); hold()")
    err = refused(c.pid)
    assert f"PID {c.pid} " in err.message
    assert f"listening on non-loopback address 0.0.0.0:{c.info['port']}" in err.message
    assert "GLOO_SOCKET_IFNAME=lo" in err.hint


def test_loopback_listener_recorded_and_port_check(spawn):
    c = spawn("s = socket.create_server(('127.0.0.1', 0)); ready(port=s.getsockname()[1]); hold()")
    port = c.info["port"]
    got = inv.inspect_tree(c.pid, private_prefixes=TEST_PRIVATE)
    assert got.listeners == (("127.0.0.1", port),)
    problems = ports.listeners_taken(got.listeners)
    assert len(problems) == 1
    assert f"127.0.0.1:{port}" in problems[0] and f"PID {c.pid} (" in problems[0]
    os.killpg(c.pid, signal.SIGKILL)
    c.proc.wait(10)
    assert ports.listeners_taken(got.listeners) == []


def test_grandchild_is_part_of_the_tree(spawn):
    c = spawn("g, info = spawn_grandchild("
              "\"s = socket.create_server(('0.0.0.0', 0)); ready(port=s.getsockname()[1]); hold()\")\n"
              "ready(gpid=g.pid, port=info['port']); hold()", grandchildren=True)
    gpid = c.info["gpid"]
    err = refused(c.pid)
    assert f"PID {gpid} " in err.message and f"0.0.0.0:{c.info['port']}" in err.message
    assert f"PID {c.pid} " not in err.message


# ----------------------------------------------------------------------------- accepted tree

ACCEPTED_CHILD = r'''
import mmap
data, private = sys.argv[2], sys.argv[3]
f = open(data, "rb")                      # regular file, open
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # ... and mapped
t = open(private, "rb")                   # under /tmp: the engine's private tmpfs, not recorded
pr, pw = os.pipe()                        # plain pipes
a, b = socket.socketpair()                # unix pair inside the tree
srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]
g, info = spawn_grandchild(
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[2]))); ready(); hold()", port)
conn, _ = srv.accept()                    # loopback TCP between two processes of the tree
ready(port=port, gpid=g.pid)
hold()
'''


def test_tree_with_internal_channels_accepted_and_files_checked(spawn, data_dir, tmp_path):
    data = data_dir / "weights.bin"
    data.write_bytes(b"x" * 5000)
    private = tmp_path / "private.txt"
    private.write_text("private")
    c = spawn(ACCEPTED_CHILD, data, private, grandchildren=True,
              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    got = inv.inspect_tree(c.pid, private_prefixes=TEST_PRIVATE)
    assert got.root_pid == c.pid and got.pids[0] == c.pid and c.info["gpid"] in got.pids
    assert len(got.commands) == len(got.pids)
    assert got.listeners == (("127.0.0.1", c.info["port"]),)
    by_path = {f.path: f for f in got.files}
    rec = by_path[str(data)]
    st = data.stat()
    assert (rec.size, rec.mtime_ns) == (5000, st.st_mtime_ns)
    assert rec.blake3 is not None and len(rec.blake3) == 64
    assert str(private) not in by_path and not any(p.startswith("/tmp/") for p in by_path)
    assert not any(p.startswith(("/proc/", "/sys/", "/dev/")) for p in by_path)
    assert os.path.realpath(sys.executable) in by_path  # the interpreter binary is mapped
    assert inv.check_files(got.files) == []
    assert inv.check_files([f.model_dump() for f in got.files]) == []  # JSON round trip

    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touch alone: content decides
    assert inv.check_files([rec]) == []
    data.write_bytes(b"y" * 5000)
    (problem,) = inv.check_files(got.files)
    assert str(data) in problem and "content differs" in problem
    data.write_bytes(b"y" * 10)
    (problem,) = inv.check_files([rec])
    assert "size 5000 -> 10" in problem
    data.unlink()
    (problem,) = inv.check_files(got.files)
    assert problem == f"{data} vanished"


def test_large_file_mtime_and_jit_cache_remedy(data_dir):
    big = data_dir / "big.so"
    with open(big, "wb") as f:
        f.truncate(inv.HASH_LIMIT_BYTES + 1)
    rec = inv.file_record(str(big))
    assert rec.blake3 is None and rec.size == inv.HASH_LIMIT_BYTES + 1
    os.utime(big, ns=(rec.mtime_ns, rec.mtime_ns + 10**9))
    (problem,) = inv.check_files([rec])
    assert "mtime" in problem

    kernel = data_dir / ".triton" / "cache" / "abc" / "kernel.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"k1")
    rec = inv.file_record(str(kernel))
    kernel.write_bytes(b"k2")
    (problem,) = inv.check_files([rec])
    assert "Triton kernel cache" in problem and "TRITON_CACHE_DIR" in problem
    kernel.unlink()
    (problem,) = inv.check_files([rec])
    assert "vanished" in problem and "TRITON_CACHE_DIR" in problem


def test_missing_root_and_free_port():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(EngineError) as ei:
        inv.inspect_tree(p.pid)
    assert str(p.pid) in str(ei.value)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert ports.listeners_taken([("127.0.0.1", port)]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a file under /dev (root)")
def test_nvidia_device_files_and_their_holders_are_found(spawn):
    # a stand-in for /dev/nvidia0 (a regular file: no driver here); only the path matters
    dev = "/dev/nvidia-vsnap-test"
    with open(dev, "w"):
        pass
    try:
        c = spawn(f"f = open({dev!r}); ready(); hold()")
        got = inv.inspect_tree(c.pid, private_prefixes=TEST_PRIVATE)
        assert got.nvidia_files == (dev,) and got.cuda_pids == (c.pid,)
    finally:
        os.unlink(dev)


def test_large_jit_cache_files_are_pinned_by_content(tmp_path):
    d = tmp_path / "cache" / "torch_compile_cache" / "x"
    d.mkdir(parents=True)
    f = d / "kernel.so"
    f.write_bytes(b"A" * (inv.HASH_LIMIT_BYTES + 10))
    rec = inv.file_record(str(f))
    assert rec.blake3 is not None  # over the size limit, but a JIT cache: digested
    assert inv.check_files([rec]) == []
    os.utime(f, ns=(rec.mtime_ns + 10**9, rec.mtime_ns + 10**9))  # touched, same bytes: fine
    assert inv.check_files([rec]) == []
    f.write_bytes(b"B" * (inv.HASH_LIMIT_BYTES + 10))  # rewritten in place, same size
    problems = inv.check_files([rec])
    assert len(problems) == 1 and "content differs" in problems[0] and "torch.compile cache" in problems[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="ptrace-attaches to another process (root)")
def test_traced_process_refused_naming_the_tracer(spawn):
    import ctypes

    c = spawn("ready(); hold()")
    assert inv.inspect_tree(c.pid).pids  # not traced: accepted
    libc = ctypes.CDLL(None, use_errno=True)
    PTRACE_SEIZE = 0x4206
    assert libc.ptrace(PTRACE_SEIZE, c.pid, None, None) == 0, os.strerror(ctypes.get_errno())
    err = refused(c.pid)
    assert f"is traced by PID {os.getpid()}" in err.message
    assert "detach the tracer" in err.hint
    assert [d["kind"] for d in err.details] == ["traced"]


def test_deleted_open_file_over_criu_ghost_limit_refused_small_one_accepted(spawn, data_dir):
    code = ("p = sys.argv[2]; f = open(p, 'wb'); f.write(os.urandom(int(sys.argv[3]))); f.flush(); os.unlink(p)\n"
            "ready(fd=f.fileno()); hold()")
    small = spawn(code, data_dir / "small.bin", 64 * 1024)
    assert str(data_dir / "small.bin") in inv.inspect_tree(small.pid).deleted_files
    big = spawn(code, data_dir / "big.bin", 2 * inv.GHOST_LIMIT)
    err = refused(big.pid)
    assert f"fd {big.info['fd']}: deleted file {data_dir / 'big.bin'} still open" in err.message
    assert [d["kind"] for d in err.details] == ["ghost"]
    assert "close the deleted file" in err.hint
