"""Create's end of an engine's weights channel: the worker of the engine tree sends the table
of its large tensors over a unix socket in the tree's network namespace, writes them into a
file create makes (:data:`~vllm_snapshot.store.weights.TMP_PREFIX`), and gets a read-only fd of
the published weights file (:func:`~vllm_snapshot.store.weights.publish`), which it maps. The
worker's end is :mod:`vllm_snapshot.engine.weights`; the file's life in the store (publish,
pins, checks, removal) is :mod:`vllm_snapshot.store.weights`'."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

from ..errors import SnapshotError
from .weights import MAX_BYTES, TMP_PREFIX, ensure_dir, publish


def _send(sock: socket.socket, obj: dict, fd: int | None = None) -> None:
    from ..engine.weights import send_msg

    send_msg(sock, obj, fd)


def _recv(sock: socket.socket) -> tuple[dict, int | None]:
    from ..engine.weights import recv_msg

    msg, fd = recv_msg(sock)
    if fd is not None:  # create never expects an fd from the worker
        os.close(fd)
    return msg, None


def check_table(msg: dict) -> int:
    """The size (bytes) of the weights file the worker's ``table`` message describes. Raises
    ValueError when the table is not a sane one: entries in order, aligned, inside the size, at
    most :data:`MAX_BYTES`. Pure."""
    from ..engine.weights import ALIGN

    if msg.get("op") != "table":
        raise ValueError(f"expected the table, got {msg.get('op')!r}")
    size = msg.get("size")
    entries = msg.get("entries")
    if type(size) is not int or not 0 <= size <= MAX_BYTES or not isinstance(entries, list):
        raise ValueError(f"a weights file of {size!r} bytes")
    end = 0
    for e in entries:
        off, n = e.get("offset"), e.get("nbytes")
        if type(off) is not int or type(n) is not int or off % ALIGN or off < end or n <= 0 or off + n > size:
            raise ValueError(f"a table entry out of place: {json.dumps(e)[:200]}")
        end = off + n
    if end != size:
        raise ValueError(f"the table ends at {end}, the file at {size}")
    return size


#: Seconds :meth:`WeightsServer.result` waits for an exchange a worker began.
RESULT_WAIT_S = 30.0


class WeightsServer:
    """Create's end of the weights channel of the engine tree rooted at ``root_pid``: an
    abstract unix socket (:data:`vllm_snapshot.engine.weights.SOCKET_NAME`) in the tree's network
    namespace, served by a daemon thread. One worker of the tree (uid ``engine_uid``) may connect
    once: it sends its table, gets a writable fd of ``ROOT/.weights/.incoming-PID-RAND`` (0600),
    writes, and gets a read-only fd of the published file, which it maps. :meth:`result` gives
    what was published. Raises OSError when the socket cannot be made."""

    def __init__(self, root_pid: int, root: Path, engine_uid: int) -> None:
        from ..engine.weights import SOCKET_NAME
        from ..host.procs import run_in_namespace

        self.root = root
        self.root_pid = root_pid
        self.engine_uid = engine_uid
        self.done = threading.Event()
        #: set once a worker connected: its exchange is then awaited by :meth:`result`
        self.accepted = threading.Event()
        self.error: BaseException | None = None
        self.published: tuple[Path, str, bool] | None = None
        self.mapped: dict | None = None
        self._tmp: Path | None = None
        self._closed = False
        deadline = time.monotonic() + 10.0
        ours = os.readlink("/proc/thread-self/ns/net")
        while os.readlink(f"/proc/{root_pid}/ns/net") == ours:  # unshare --net not done yet
            if time.monotonic() > deadline:
                raise OSError(f"the engine root {root_pid} is not in a network namespace of its own")
            time.sleep(0.01)

        def make() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.bind("\0" + SOCKET_NAME)
            s.listen(1)
            return s

        self.sock = run_in_namespace(root_pid, "net", make)
        self.sock.settimeout(0.25)
        self._thread = threading.Thread(target=self._serve, name="weights-channel", daemon=True)
        self._thread.start()

    def _peer_ok(self, conn: socket.socket) -> str | None:
        import psutil

        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.engine_uid:
            return f"PID {pid} (uid {uid}) connected to the weights channel, not the engine user (uid {self.engine_uid})"
        try:
            tree = {p.pid for p in psutil.Process(self.root_pid).children(recursive=True)}
        except psutil.Error:
            tree = set()
        if pid not in tree:
            return f"PID {pid} connected to the weights channel, not a process of the engine tree {self.root_pid}"
        return None

    def _serve(self) -> None:
        conn = None
        try:
            while not self._closed:
                try:
                    conn, _ = self.sock.accept()
                    self.accepted.set()
                    break
                except socket.timeout:
                    continue
                except OSError:
                    if self._closed:  # closed before any worker came (the engine failed first)
                        return
                    raise
            if conn is None:
                return
            conn.settimeout(900.0)
            bad = self._peer_ok(conn)
            if bad:
                raise PermissionError(bad)
            msg, _ = _recv(conn)
            try:
                size = check_table(msg)
            except ValueError as e:
                _send(conn, {"op": "refused", "error": str(e)})
                raise
            d = ensure_dir(self.root)
            self._tmp = d / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
            fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                _send(conn, {"op": "write"}, fd)
            finally:
                os.close(fd)
            msg, _ = _recv(conn)
            if msg.get("op") != "written":
                raise ValueError(f"expected 'written', got {msg.get('op')!r}")
            final, digest, reused = publish(self._tmp, self.root)
            self._tmp = None
            self.published = (final, digest, reused)
            # opened through the engine root's /proc/PID/root: the fd's mount is then one of the
            # tree's own mount namespace, which CRIU's dump can name (an fd of one of the host's
            # mounts fails it: "Can't lookup mount=N")
            rfd = os.open(f"/proc/{self.root_pid}/root{final}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _send(conn, {"op": "map", "digest": digest}, rfd)
            finally:
                os.close(rfd)
            msg, _ = _recv(conn)
            if msg.get("op") != "mapped":
                raise ValueError(f"expected 'mapped', got {msg.get('op')!r}")
            self.mapped = msg
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self.error = e
            if conn is not None:
                try:
                    _send(conn, {"op": "refused", "error": f"{type(e).__name__}: {e}"})
                except OSError:
                    pass
        finally:
            if conn is not None:
                conn.close()
            if self._tmp is not None:
                self._tmp.unlink(missing_ok=True)
                self._tmp = None
            self.done.set()

    def result(self) -> tuple[Path, str, bool, dict] | None:
        """(path, digest, reused, what the worker mapped) of the published weights file; None
        when no worker used the channel. A worker that connected is waited for (at most
        :data:`RESULT_WAIT_S`): it may have sent its last message, and the engine gone on to
        report itself started, before this end read it. Raises SnapshotError (EngineError)
        naming what failed."""
        from ..errors import EngineError

        if self.accepted.is_set():
            self.done.wait(RESULT_WAIT_S)

        if self.error is not None:
            e = self.error
            if isinstance(e, SnapshotError):
                raise e
            raise EngineError(f"the engine's weights file could not be written: {type(e).__name__}: {e}",
                              hint="check the free space and the permissions of the snapshot root's .weights "
                                   "directory; or create with --weights in-image") from e
        if self.published is None or self.mapped is None:
            return None
        return (*self.published, self.mapped)

    def close(self) -> None:
        """Stop listening (an unfinished exchange is ended, its temp file removed)."""
        self._closed = True
        self.sock.close()
        self._thread.join(timeout=5.0)
