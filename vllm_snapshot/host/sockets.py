"""The kernel's socket tables, read in one place: TCP sockets of a network namespace from
``/proc/PID/net/tcp`` and ``tcp6`` (:func:`tcp_table`, :func:`read_tcp_table`; states as the
kernel's numbers, :data:`TCP_STATES`) and unix sockets with their peers from
``NETLINK_SOCK_DIAG`` (:func:`read_unix_table`). Used by the port checks (:mod:`.ports`), the
registry's drain count and the dump inventory."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from ..errors import EnvironmentProblem

#: The kernel's TCP states (include/net/tcp_states.h), as ``/proc/net/tcp`` writes them (hex).
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}
TCP_ESTABLISHED, TCP_TIME_WAIT, TCP_CLOSE, TCP_LISTEN = 1, 6, 7, 10
#: unix socket types (``SOCK_*``) in words
UNIX_TYPES = {1: "stream", 2: "datagram", 5: "seqpacket"}


@dataclass(frozen=True)
class TcpEntry:
    """One TCP socket: ``local``/``remote`` (address text, port), ``state`` (:data:`TCP_STATES`),
    ``inode`` (the ``socket:[N]`` of its holders' fds), ``v6`` (read from ``tcp6``)."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    inode: int
    v6: bool


def _hex_addr(h: str) -> str:
    ip, _ = h.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return ipaddress.IPv6Address(words).compressed


def _hex_port(h: str) -> int:
    return int(h.split(":")[1], 16)


def tcp_table(path: str, v6: bool | None = None) -> list[TcpEntry]:
    """Every socket of one ``/proc/.../net/tcp`` or ``tcp6`` table (``v6`` None: told by the
    name). Raises OSError when the table cannot be read, ValueError/IndexError on a malformed
    line."""
    v6 = path.endswith("6") if v6 is None else v6
    out = []
    with open(path, "rb", buffering=0) as f:  # whole-table reads: fewer pieces for the kernel to cut it in
        raw = b"".join(iter(lambda: f.read(1 << 20), b""))
    for line in raw.decode("ascii", "replace").splitlines()[1:]:
        c = line.split()
        if len(c) < 10:
            continue
        out.append(TcpEntry((_hex_addr(c[1]), _hex_port(c[1])), (_hex_addr(c[2]), _hex_port(c[2])),
                            int(c[3], 16), int(c[9]), v6))
    return out


def read_tcp_table(pid: int | str = "self") -> list[TcpEntry]:
    """Every TCP socket of PID's network namespace from ``/proc/PID/net/tcp`` and ``tcp6``
    (addresses as strings, ports as ints, state as the kernel's number, :data:`TCP_LISTEN` =
    10); a table that does not exist (no IPv6) is left out. Raises OSError for another read
    failure."""
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            out += tcp_table(f"/proc/{pid}/net/{name}", v6)
        except FileNotFoundError:
            continue
    return out


def fmt_addr(a: tuple[str, int]) -> str:
    """``host:port``, ``[v6]:port``. Pure."""
    return f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}"


def is_loopback(addr: str) -> bool:
    """True for a loopback address (an IPv4-mapped one too). Pure."""
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback



# ----------------------------------------------------------------------------- unix sockets

@dataclass(frozen=True)
class UnixEntry:
    """One unix socket: ``peer`` the peer's inode (0 = none), ``name`` the bound path (``@name``
    abstract, None unbound)."""

    inode: int
    type: int
    state: int
    peer: int
    name: str | None


def read_unix_table() -> dict[int, UnixEntry]:
    """Every unix socket of the calling thread's network namespace, with its peer, from the
    kernel's ``NETLINK_SOCK_DIAG`` (``unix_diag``): inode -> entry (``peer`` 0 = none; ``name``
    the bound path, ``@name`` for abstract, None unbound). Raises EnvironmentProblem when the
    kernel does not answer (``unix_diag`` not available)."""
    NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
    NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
    NLMSG_ERROR, NLMSG_DONE = 2, 3
    UDIAG_SHOW_NAME, UDIAG_SHOW_PEER = 0x1, 0x4
    UNIX_DIAG_NAME, UNIX_DIAG_PEER = 0, 2
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0,
                      UDIAG_SHOW_NAME | UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
    msg = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req
    out: dict[int, UnixEntry] = {}
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise EnvironmentProblem(f"cannot open a sock_diag netlink socket: {e}",
                                 hint="the kernel needs unix_diag (modprobe unix_diag); CRIU needs it too") from e
    with s:
        s.sendall(msg)
        while True:
            data = s.recv(1 << 16)
            if not data:
                break
            off = 0
            while off + 16 <= len(data):
                ln, typ, _fl, _seq, _pid = struct.unpack_from("=IHHII", data, off)
                if ln < 16:
                    break
                body = data[off + 16: off + ln]
                off += (ln + 3) & ~3
                if typ == NLMSG_DONE:
                    return out
                if typ == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0]
                    raise EnvironmentProblem(f"unix_diag refused the socket dump: {os.strerror(code)}",
                                             hint="the kernel needs unix_diag (modprobe unix_diag); CRIU needs it too")
                if typ != SOCK_DIAG_BY_FAMILY or len(body) < 16:
                    continue
                _fam, utype, ustate, _pad, ino = struct.unpack_from("=BBBBI", body)
                peer, name, a = 0, None, 16
                while a + 4 <= len(body):
                    rl, rt = struct.unpack_from("=HH", body, a)
                    if rl < 4:
                        break
                    val = body[a + 4: a + rl]
                    if rt == UNIX_DIAG_PEER and len(val) >= 4:
                        peer = struct.unpack_from("=I", val)[0]
                    elif rt == UNIX_DIAG_NAME and val:
                        name = "@" + val[1:].rstrip(b"\0").decode(errors="replace") if val[:1] == b"\0" \
                            else val.rstrip(b"\0").decode(errors="replace")
                    a += (rl + 3) & ~3
                out[ino] = UnixEntry(ino, utype, ustate, peer, name)
    return out
