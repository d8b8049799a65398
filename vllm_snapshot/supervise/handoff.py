"""Supervisor side of serving: hand the listening socket bound in the host's network namespace
to an engine that lives in a network namespace of its own.

Why: every engine tree has its own loopback-only network namespace (engine/net.py), so its
recorded loopback listeners never collide and any number of clones of one snapshot can run.
``--host``/``--port`` must still mean the host's addresses, exactly as for ``vllm serve``. A
socket keeps the network namespace it was created in, so the supervisor binds ``host:port``
here (:func:`vllm_snapshot.host.ports.bind_listener`) and passes the socket to the engine; the
engine accepts the host's connections on it while the rest of its traffic stays inside.

How: CRIU's ``--inherit-fd`` hands back pipes and files, not a bound TCP socket, and a channel fd
that is a unix socket would be a socket of the host's namespace that CRIU's dump of the tree's
namespace does not find. So the hand-off happens after restore, through a rendezvous: in a
helper thread that joined the engine's network namespace, the supervisor creates an abstract
unix socket (abstract names are per network namespace: only processes of that namespace, i.e.
of the engine tree, can connect) and tells the engine its name with ``serve``; the engine
connects, the supervisor checks with ``SO_PEERCRED`` that the peer is the engine root, and
sends the listening socket with ``SCM_RIGHTS``. Nothing of this is in the snapshot.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from typing import Callable

from ..errors import EngineError
from ..host.procs import run_in_namespace
#: Seconds to wait for the engine to connect to the hand-off socket.
ACCEPT_TIMEOUT_S = 60.0


class Handoff:
    """An abstract unix listening socket in the network namespace of ``root_pid``. Raises
    OSError when it cannot be created (the process is gone, not root)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.name = f"vllm-snapshot-handoff-{os.getpid()}-{os.urandom(8).hex()}"

        def make() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\0" + self.name)
            s.listen(1)
            return s

        # a socket belongs to the namespace of the thread that creates it
        self.sock = run_in_namespace(root_pid, "net", make)

    def give(self, listener: socket.socket, timeout_s: float = ACCEPT_TIMEOUT_S,
             alive: Callable[[], bool] = lambda: True) -> None:
        """Wait for the engine root to connect and send it ``listener``. Raises EngineError
        when no connection comes within ``timeout_s`` seconds, ``alive()`` turns false while
        waiting (the engine died), or the peer is another process."""
        deadline = time.monotonic() + timeout_s
        self.sock.settimeout(0.25)
        while True:
            try:
                conn, _ = self.sock.accept()
                break
            except socket.timeout:
                if not alive():
                    raise EngineError("the engine exited before it took the listening socket") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"the engine did not take the listening socket within {timeout_s:.0f} s") from None
        conn.settimeout(timeout_s)
        with conn:
            pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if pid != self.root_pid:
                raise EngineError(f"PID {pid} connected to the hand-off socket, not the engine root {self.root_pid}")
            conn.sendmsg([b"L"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [listener.fileno()]))])

    def close(self) -> None:
        self.sock.close()


def serve_engine(engine, host: str, port: int, die_with_parent: bool, frontend: tuple[str, ...] = (),
                 drain_s: float | None = None, accept_timeout_s: float = ACCEPT_TIMEOUT_S,
                 listener: socket.socket | None = None) -> None:
    """Bind ``host:port`` here (the host's network namespace), send ``serve`` to ``engine``
    (an :class:`vllm_snapshot.effects.tools.Engine` whose tree lives in its own namespace) and hand it
    the listening socket. ``frontend``: front-end option tokens the engine applies before it
    serves (:mod:`vllm_snapshot.supervise.frontend`; they may hold an API key: they travel only in the
    control pipe). ``drain_s``: how long the engine lets requests in flight finish when it is
    signalled to stop (seconds; None: the engine's default). ``accept_timeout_s``: how long the
    engine has to take the socket (seconds). Our copy is closed afterwards: the engine holds
    the port alone. ``listener``: a socket already listening on ``host:port`` to hand over
    instead of binding one (a switch's hand-over: the old engine's own socket, so the port never
    stops listening); the caller keeps its copy and closes it.
    Raises BusyError/UsageError (the port), EngineError (the engine did not take it)."""
    from ..host import ports

    ours = listener is None
    if listener is None:
        listener = ports.bind_listener(host, port)
    try:
        try:
            handoff = Handoff(engine.root_pid)
        except OSError as e:
            raise EngineError(f"cannot reach the engine's network namespace (PID {engine.root_pid}): {e}") from e
        try:
            engine.send("serve", host=host, port=port, die_with_parent=die_with_parent, handoff=handoff.name,
                        frontend=list(frontend), **({} if drain_s is None else {"drain_s": float(drain_s)}))
            handoff.give(listener, accept_timeout_s, alive=engine.alive)
        finally:
            handoff.close()
    finally:
        if ours:
            listener.close()
