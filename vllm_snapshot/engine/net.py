"""The engine's network namespace: loopback only.

Every engine tree runs in a network namespace of its own (``unshare --net`` at create; at
restore CRIU re-creates the namespace it dumped, a fresh one per restore). It holds nothing
but ``lo``, so

* vLLM's loopback listeners (torch.distributed/gloo keeps about a dozen, their port numbers
  are in the images) can never collide with another engine's or the host's: any number of
  engines restored from one snapshot run side by side;
* the engine has no route out while it is created (offline by construction, on top of
  ``HF_HUB_OFFLINE=1``); :func:`isolation_problems` checks that from outside before the dump.

The OpenAI port is not bound in here: the supervisor binds ``--host``/``--port`` in the
host's namespace and passes the listening socket over the control channel
(:mod:`vllm_snapshot.engine.protocol`, ``serve``). A socket keeps the namespace it was created
in, so the engine serves the host's addresses exactly as ``vllm serve`` would.

A new network namespace starts with ``lo`` down (network_namespaces(7)); :func:`loopback_up`
brings it up before vLLM starts. CRIU restores its state (up, with 127.0.0.1/8 and ::1) in the
namespace it creates at restore.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def loopback_up() -> None:
    """Set ``lo`` up in the calling process's network namespace (``ip link set lo up``,
    without needing iproute2 inside). Raises OSError (e.g. EPERM without CAP_NET_ADMIN)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[:18])[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def interfaces(net_dev: str) -> list[str]:
    """Interface names of a ``/proc/PID/net/dev`` text. Pure."""
    return [line.split(":", 1)[0].strip() for line in net_dev.splitlines()[2:] if ":" in line]


def route_devices(route: str, ipv6_route: str) -> set[str]:
    """Devices that carry a route in ``/proc/PID/net/route`` (IPv4 main table, device in the
    first column) and ``/proc/PID/net/ipv6_route`` (every table, device in the last column)
    texts. Pure."""
    devs = {line.split()[0] for line in route.splitlines()[1:] if line.split()}
    devs |= {line.split()[-1] for line in ipv6_route.splitlines() if line.split()}
    return devs


def isolation_problems(pid: int, proc: str = "/proc") -> list[str]:
    """Why process ``pid``'s network namespace is not an isolated, loopback-only one (empty
    list: it is): it is the caller's own namespace, it has an interface other than ``lo``, or
    a route through another device. Read from ``/proc``; raises OSError when ``pid`` is gone."""
    out = []
    ns = os.readlink(f"{proc}/{pid}/ns/net")
    if ns == os.readlink(f"{proc}/self/ns/net"):
        out.append(f"it shares the supervisor's network namespace ({ns})")
    with open(f"{proc}/{pid}/net/dev") as f:
        other = [i for i in interfaces(f.read()) if i != "lo"]
    if other:
        out.append("its network namespace has interfaces besides lo: " + ", ".join(other))
    with open(f"{proc}/{pid}/net/route") as f4:
        r4 = f4.read()
    try:
        with open(f"{proc}/{pid}/net/ipv6_route") as f6:
            r6 = f6.read()
    except FileNotFoundError:  # IPv6 disabled
        r6 = ""
    devs = route_devices(r4, r6) - {"lo"}
    if devs:
        out.append("it has routes through " + ", ".join(sorted(devs)))
    return out


#: Seconds the engine waits to connect to the supervisor's hand-off socket and receive.
HANDOFF_TIMEOUT_S = 30.0


def receive_listener(name: str, timeout_s: float = HANDOFF_TIMEOUT_S) -> socket.socket:
    """The listening TCP socket the supervisor hands over (``serve``): connect to the abstract
    unix socket ``name`` (which the supervisor created in this network namespace) and receive
    one fd with ``SCM_RIGHTS``. Raises ValueError (no name given, nothing or something else
    received), OSError (connect/receive failed, timeout)."""
    import array

    if not name:
        raise ValueError("serve came without a hand-off socket: the supervisor binds --host/--port in the "
                         "host's network namespace and hands the socket over (use the same vllm-snapshot "
                         "version for create and restore)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect("\0" + name)
        _msg, anc, _flags, _addr = s.recvmsg(16, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not fds:
        raise ValueError(f"the supervisor's hand-off socket {name!r} sent no fd")
    for extra in fds[1:]:
        os.close(extra)
    sock = socket.socket(fileno=fds[0])
    if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        sock.close()
        raise ValueError("the hand-off brought an fd that is not a listening TCP socket")
    return sock
