"""A minimal ``sd_notify`` client (standard library only), for ``Type=notify`` systemd units.

The protocol, as sd_notify(3) describes it: the service manager passes the address of a
datagram socket in ``$NOTIFY_SOCKET``; the service sends one ``AF_UNIX`` ``SOCK_DGRAM``
datagram per notification holding newline-separated ``VARIABLE=value`` assignments
(``READY=1``, ``STATUS=...``, ``STOPPING=1``, ``MAINPID=...``). A value starting with ``/``
is a file-system socket path; one starting with ``@`` names a socket in the abstract
namespace (the ``@`` stands for a leading NUL byte). When ``$NOTIFY_SOCKET`` is unset the
service was not started by a notify-aware manager and every call is a no-op returning
``False`` -- like ``sd_notify()`` returning 0.

Failures to send are never fatal here (sd_notify(3) treats notification as advisory): the
functions return ``False`` and the caller carries on; a unit that never receives ``READY=1``
fails by its own ``TimeoutStartSec=``.
"""

from __future__ import annotations

import os
import socket

ENV = "NOTIFY_SOCKET"


def _address(value: str) -> str | bytes | None:
    """The ``sendto`` address for a ``$NOTIFY_SOCKET`` value, ``None`` if unsupported.

    sd_notify(3): "@" -> abstract namespace (leading NUL byte); "/" -> path. Other forms
    (e.g. ``vsock:`` addresses newer systemd versions accept) are not supported here.
    """
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def notify(state: str) -> bool:
    """Send ``state`` (newline-separated ``VARIABLE=value`` lines, see sd_notify(3)) as one
    datagram to ``$NOTIFY_SOCKET``.

    Returns True when the datagram was sent; False when ``$NOTIFY_SOCKET`` is unset or empty,
    has an unsupported form, or sending failed (the error is swallowed: notification is
    advisory).
    """
    value = os.environ.get(ENV, "")
    if not value:
        return False
    addr = _address(value)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), addr)
        return True
    except OSError:
        return False


def _one_line(text: str) -> str:
    # Each assignment is one line (sd_notify(3)); a newline in a status would start a new,
    # unintended assignment.
    return " ".join(str(text).splitlines())


def ready(status: str | None = None, mainpid: int | None = None) -> bool:
    """``READY=1`` (sd_notify(3): "service startup is finished"), optionally with ``STATUS=``
    and ``MAINPID=`` in the same datagram."""
    lines = ["READY=1"]
    if status is not None:
        lines.append(f"STATUS={_one_line(status)}")
    if mainpid is not None:
        lines.append(f"MAINPID={int(mainpid)}")
    return notify("\n".join(lines))


def status(text: str) -> bool:
    """``STATUS=text``: a one-line, human-readable state, shown by ``systemctl status``
    (sd_notify(3))."""
    return notify(f"STATUS={_one_line(text)}")


def stopping() -> bool:
    """``STOPPING=1``: the service is beginning its shutdown (sd_notify(3))."""
    return notify("STOPPING=1")


class ServiceLifecycle:
    """The fences of a ``Type=notify`` service around a foreground restore: ``READY=1`` (with
    ``MAINPID`` = this process) only once the engine serves, ``STOPPING=1`` once when shutting
    down. Inactive (every call a no-op) when ``$NOTIFY_SOCKET`` is unset."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._stopping_sent = False

    @classmethod
    def from_env(cls) -> "ServiceLifecycle":
        return cls(bool(os.environ.get(ENV)))

    def ready(self, status_text: str) -> None:
        if self.active:
            ready(status_text, mainpid=os.getpid())

    def stopping(self) -> None:
        if self.active and not self._stopping_sent:
            self._stopping_sent = True
            stopping()
