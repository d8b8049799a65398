"""TCP ports on this host: probing a bind, naming the owner of a port, the recorded loopback
listeners of a snapshot, and URLs. The one owner of socket probing (create, restore and
doctor ask here)."""

from __future__ import annotations

import errno as _errno
import ctypes
import ipaddress
import os
import socket
from typing import Iterable

import psutil

from ..errors import BusyError, UsageError
from .procs import brief, socket_fds, socket_inodes
from .sockets import TCP_LISTEN, tcp_table


def url(host: str, port: int, scheme: str = "http") -> str:
    """``http://HOST:PORT`` with IPv6 literals bracketed (``http://[::1]:8000``)."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{h}:{port}"


def fmt_addr(addr: str, port: int) -> str:
    """``127.0.0.1:80`` / ``[::1]:80``."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def port_owner(port: int, host: str | None = None) -> tuple[int, str] | None:
    """(PID, command) of the process listening on TCP ``port`` (on ``host`` or a wildcard
    address when given: several engines may share a port on different addresses), else any
    holding it, or None when unknown (not root, or nobody)."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return None
    wild = {"0.0.0.0", "::"}
    rank: dict[int, int] = {}  # pid -> 0 best (listening on host), 1 listening elsewhere, 2 other state
    for c in conns:
        if c.laddr and c.laddr.port == port and c.pid:
            listening = c.status == psutil.CONN_LISTEN
            r = (0 if host is None or c.laddr.ip == host or c.laddr.ip in wild else 1) if listening else 2
            rank[c.pid] = min(r, rank.get(c.pid, 3))
    if not rank:
        return None
    best = min(rank, key=lambda pid: rank[pid])
    try:
        return best, brief(psutil.Process(best).cmdline())[:200] or "?"
    except psutil.Error:
        return best, "?"


def local_addresses() -> set[str]:
    """Every IPv4/IPv6 address of this host's interfaces (in the caller's network namespace),
    without an IPv6 scope (``fe80::1%eth0`` -> ``fe80::1``); empty when unreadable."""
    try:
        return {a.address.split("%", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family in (socket.AF_INET, socket.AF_INET6)}
    except (psutil.Error, OSError):
        return set()


def resolve_host(host: str, resolve=socket.getaddrinfo, local: set[str] | None = None) -> str:
    """The one address ``--host`` stands for: ``host`` itself when numeric; for a name
    (``localhost``, the machine's own name) the address the resolver gives first -- IPv4 first,
    as ``vllm serve`` binds a name (an ``AF_INET`` socket) -- when it is a loopback address or
    one of this host's (:func:`local_addresses`). Resolved once, at the command line: the bind
    (in the host's namespace, after the oracle matched), the URL, the engine registry and a later
    ``switch``/``stop`` all name the port by that one address. ``resolve``/``local``: for
    tests. Raises UsageError for a name that does not resolve or resolves to no address of
    this host."""
    try:
        resolve(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        return host
    except (socket.gaierror, UnicodeError):
        pass
    try:
        infos = resolve(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise UsageError(f"--host {host!r} is neither an IPv4/IPv6 address nor a name that resolves here ({why})",
                         hint="give the address to listen on, e.g. 127.0.0.1, 0.0.0.0 or ::1") from e
    addrs = list(dict.fromkeys(i[4][0] for i in infos))
    ordered = [a for a in addrs if ":" not in a] + [a for a in addrs if ":" in a]
    mine = local_addresses() if local is None else local
    usable = [a for a in ordered if ipaddress.ip_address(a.split("%", 1)[0]).is_loopback or a in mine]
    if not usable:
        raise UsageError(f"--host {host!r} resolves to {', '.join(addrs) or 'no address'}, which is no address of "
                         "this host: nothing could listen there",
                         hint="give an address of this host, e.g. 127.0.0.1, 0.0.0.0 or ::1")
    return usable[0]


def port_free(host: str, port: int) -> None:
    """Refuse when ``host:port`` cannot be bound now (TCP, SO_REUSEADDR, so TIME_WAIT does not
    count). Raises UsageError for a non-numeric host or an address this host does not have,
    BusyError naming the owner when the port is taken."""
    bind_listener(host, port, listen=False).close()


#: Backlog of the listening socket until uvicorn takes it over (it calls listen() again with
#: its own ``backlog``, 2048 by default).
LISTEN_BACKLOG = 128


def bind_listener(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` in the caller's network namespace, listening unless
    ``listen`` is false, as ``vllm serve`` makes its own (vllm 0.32
    entrypoints/launchers/launcher.py ``create_server_socket``: IPv6 family for an IPv6
    literal, SO_REUSEADDR, no SO_REUSEPORT, dual-stack ``::``). The restore supervisor binds it
    in the host's namespace and passes it to the engine, which lives in a namespace of its own.
    Raises UsageError for a non-numeric host or an address this host does not have, BusyError
    naming the owner when the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror as e:
        try:  # a name: say which addresses it stands for here (/etc/hosts first, as the resolver does)
            addrs = sorted({i[4][0] for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        except (socket.gaierror, UnicodeError):
            addrs = []
        if addrs:
            raise UsageError(f"--host {host!r} is a name; give the address to listen on ({host} is "
                             f"{' and '.join(addrs)} here): the URL, the engine registry and a later switch "
                             "name the port by one address",
                             hint=f"--host {addrs[0]}") from e
        raise UsageError(f"--host {host!r} is not a numeric IPv4/IPv6 address ({e.strerror})",
                         hint="use e.g. 127.0.0.1, 0.0.0.0 or ::1") from e
    fam, _type, _proto, _canon, addr = infos[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        if listen:
            s.listen(LISTEN_BACKLOG)
    except OSError as e:
        s.close()
        if e.errno == _errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host} is not an address of this host: {e.strerror}") from e
        owner = port_owner(port, host)
        who = f" (held by PID {owner[0]}: {owner[1]})" if owner else ""
        ours = bool(owner) and owner[1].startswith("vllm-snapshot engine")
        raise BusyError(f"port {fmt_addr(host, port)} is not free{who}: {e.strerror}",
                        hint=(f"`vllm-snapshot status` shows that engine; `vllm-snapshot stop --port {port}` stops "
                              f"it, `vllm-snapshot switch NAME --port {port}` replaces it" if ours else
                              "choose another --port or stop what listens there")) from e
    return s


def listeners_taken(listeners: Iterable[tuple[str, int] | list]) -> list[str]:
    """For each recorded loopback listener ``(address, port)``, try to bind it now. Returns
    one message per address that cannot be bound, naming the holder when known. Empty list =
    all free. Raises nothing."""
    problems = []
    owners: dict[str, list[str]] = {}
    for addr, port in listeners:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, int(port)))
        except OSError:
            owner = port_owner(int(port), addr)
            who = f"PID {owner[0]} ({owner[1]})" if owner else "an unknown owner"
            owners.setdefault(who, []).append(fmt_addr(addr, int(port)))
        finally:
            s.close()
    for who, addrs in owners.items():
        problems.append(f"{len(addrs)} of them held by {who}: {', '.join(addrs[:4])}"
                        + (f" and {len(addrs) - 4} more" if len(addrs) > 4 else ""))
    return problems


#: pidfd_getfd(2) (Linux >= 5.6; one number on every architecture since the syscall tables were unified)
SYS_PIDFD_GETFD = 438
def listening_inodes(port: int | None = None, net: str = "/proc/self/net") -> set[int]:
    """Inodes of the TCP sockets listening on ``port`` (any address; None: on any port) in the
    caller's network namespace, read from ``NET/tcp`` and ``NET/tcp6``; empty when none or
    unreadable."""
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            rows = tcp_table(f"{net}/{name}")
        except OSError:
            continue
        out |= {e.inode for e in rows if e.state == TCP_LISTEN and (port is None or e.local[1] == port)}
    return out


def _getfd(pid: int, fd: int) -> int:
    """A duplicate (close-on-exec) of process ``pid``'s descriptor ``fd`` (pidfd_getfd(2); needs
    ptrace rights over it: root). Raises OSError."""
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd of fd {fd} of PID {pid}: {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%", 1)[0]) == ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return a == b


def take_listener(pid: int, host: str, port: int) -> socket.socket:
    """A duplicate of the listening TCP socket bound to ``host:port`` in the caller's network
    namespace that process ``pid`` holds (an engine root: the socket its supervisor bound and
    handed to it), taken with pidfd_getfd(2) (root). The socket is the same one, not a new
    bind: connections queued in its backlog are accepted by whoever accepts next, none is reset
    when one holder closes its descriptor. Raises LookupError when ``pid`` holds no such socket,
    OSError when it cannot be taken (the process is gone, a kernel before 5.6, not root)."""
    candidates = listening_inodes(port)
    held = socket_inodes(pid) & candidates
    if not held:
        raise LookupError(f"PID {pid} holds no socket listening on {fmt_addr(host, port)} in this network namespace")
    for fd, ino in sorted(socket_fds(pid).items()):
        if ino not in held:
            continue
        sock = socket.socket(fileno=_getfd(pid, fd))
        try:
            name = sock.getsockname()
            if (sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and name[1] == port and _same_address(name[0], host)):
                return sock
        except OSError:
            pass
        sock.close()
    raise LookupError(f"PID {pid} holds no socket listening on {fmt_addr(host, port)} (it listens on that port "
                      "on another address)")


def accepting(pid: int, sock: socket.socket) -> bool:
    """Whether an epoll instance of process ``pid`` watches ``sock`` (a ``tfd`` line of its
    ``/proc/PID/fdinfo`` names the socket's inode): its event loop waits for connections on it
    (asyncio registers a listening socket in its selector while it serves, and removes it when it
    stops). False when ``pid`` is gone or none does."""
    ino = os.fstat(sock.fileno()).st_ino
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        for line in info.splitlines():
            if line.startswith("tfd:") and " ino:" in line and int(line.split(" ino:", 1)[1].split()[0], 16) == ino:
                return True
    return False


def holds_socket(pid: int, sock: socket.socket) -> bool:
    """Whether process ``pid`` still has a descriptor of ``sock`` (the same open socket: its
    inode among ``pid``'s fds). False when ``pid`` is gone."""
    return os.fstat(sock.fileno()).st_ino in socket_inodes(pid)
