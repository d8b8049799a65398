"""engine/net.py and handoff.py: the engine's loopback-only network namespace, and handing the
listening socket bound in the host's namespace to the engine. Namespaces need root: those tests
are skipped (with the reason) without it."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from vllm_snapshot.supervise import handoff
from vllm_snapshot.host import ports
from vllm_snapshot.engine import net
from vllm_snapshot.errors import BusyError, EngineError, UsageError

from fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1234      10    0    0    0     0          0         0     1234      10    0    0    0     0       0          0
  eth0:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
"""
ROUTE = """Iface	Destination	Gateway 	Flags	RefCnt	Use	Metric	Mask		MTU	Window	IRTT
eth0	00000000	0101A8C0	0003	0	0	0	00000000	0	0	0
"""
IPV6_ROUTE = ("00000000000000000000000000000001 80 00000000000000000000000000000000 00 "
              "00000000000000000000000000000000 00000000 00000001 00000000 80200001       lo\n")


def test_interfaces_and_route_devices_parse_proc_texts():
    assert net.interfaces(NET_DEV) == ["lo", "eth0"]
    assert net.route_devices(ROUTE, IPV6_ROUTE) == {"eth0", "lo"}
    assert net.route_devices(ROUTE.splitlines()[0] + "\n", "") == set()


def test_our_own_namespace_is_not_isolated():
    problems = net.isolation_problems(os.getpid())
    assert problems and "shares the supervisor's network namespace" in problems[0]


def _in_new_netns(lo_up: bool) -> subprocess.Popen:
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from vllm_snapshot.engine.net import loopback_up; "
            + ("loopback_up(); " if lo_up else "") + "print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen(["unshare", "--net", "--", os.sys.executable, "-c", code,
                          str(__import__("pathlib").Path(net.__file__).resolve().parents[2])],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@ROOT_ONLY
def test_a_fresh_namespace_with_lo_up_is_isolated():
    p = _in_new_netns(lo_up=True)
    try:
        assert net.isolation_problems(p.pid) == []
        out = subprocess.run(["nsenter", "-t", str(p.pid), "-n", "ip", "-br", "link"], capture_output=True,
                             text=True, check=True).stdout
        assert out.split()[:2] in (["lo", "UNKNOWN"], ["lo", "UP"]), out  # lo is up (its state reads UNKNOWN)
    finally:
        p.kill()
        p.wait()


@ROOT_ONLY
def test_an_extra_interface_is_a_problem():
    p = _in_new_netns(lo_up=True)
    try:
        # a veth pair made inside the child's namespace (the host's stays untouched)
        subprocess.run(["nsenter", "-t", str(p.pid), "-n", "ip", "link", "add", "vsnap0", "type", "veth",
                        "peer", "name", "vsnap1"], check=True)
        problems = net.isolation_problems(p.pid)
        assert any("vsnap0" in x and "vsnap1" in x for x in problems), problems
    finally:
        p.kill()
        p.wait()


def test_bind_listener_like_vllm_serve():
    s = ports.bind_listener("127.0.0.1", 0)
    try:
        port = s.getsockname()[1]
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        with pytest.raises(BusyError, match=f"127.0.0.1:{port} is not free.*PID {os.getpid()}"):
            ports.bind_listener("127.0.0.1", port)
        ports.bind_listener("127.0.0.2", port).close()  # another loopback address: free
    finally:
        s.close()
    v6 = ports.bind_listener("::1", 0)
    try:
        assert v6.family == socket.AF_INET6
        with pytest.raises(BusyError, match=r"\[::1\]:\d+ is not free"):
            ports.bind_listener("::1", v6.getsockname()[1])
    finally:
        v6.close()
    with pytest.raises(UsageError, match="'localhost' is a name; give the address"):
        ports.bind_listener("localhost", 0)
    with pytest.raises(UsageError, match="not a numeric"):
        ports.bind_listener("no such host", 0)  # not a name at all: never looked up
    with pytest.raises(UsageError, match="not an address of this host"):
        ports.bind_listener("192.0.2.1", 0)  # TEST-NET-1: never assigned here, nothing is sent


class _Engine(FakeEngine):
    """The engine side in a thread of this process (SO_PEERCRED reports our PID): a whole
    :class:`FakeEngine` (tied to the Engine Protocol by test_protocols) whose ``send("serve")``
    takes the listening socket."""

    def __init__(self, root_pid: int):
        super().__init__([], pid=root_pid)
        self.sent: list[tuple[str, dict]] = []
        self.got: list[socket.socket] = []
        self.errors: list[BaseException] = []

    def send(self, cmd: str, **kw) -> None:
        self.sent.append((cmd, kw))

        def take() -> None:
            try:
                self.got.append(net.receive_listener(kw["handoff"], timeout_s=10))
            except BaseException as e:  # noqa: BLE001
                self.errors.append(e)

        threading.Thread(target=take, daemon=True).start()


def test_handoff_passes_the_listening_socket_and_the_engine_serves_on_it():
    port = ports.bind_listener("127.0.0.1", 0).getsockname()[1]  # closed at once: a free port
    eng = _Engine(os.getpid())
    handoff.serve_engine(eng, "127.0.0.1", port, die_with_parent=True)
    ((cmd, kw),) = eng.sent
    assert cmd == "serve" and kw["host"] == "127.0.0.1" and kw["port"] == port and kw["handoff"]
    for _ in range(100):
        if eng.got or eng.errors:
            break
        time.sleep(0.05)
    assert not eng.errors and len(eng.got) == 1
    srv = eng.got[0]
    try:
        assert srv.getsockname() == ("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:  # accepted by the backlog
            conn, _ = srv.accept()
            conn.sendall(b"ok")
            assert c.recv(2) == b"ok"
            conn.close()
        # the supervisor kept no copy: the port is held by the engine's socket alone
        with pytest.raises(BusyError):
            ports.port_free("127.0.0.1", port)
    finally:
        srv.close()
    ports.port_free("127.0.0.1", port)


def test_handoff_refuses_a_peer_that_is_not_the_engine_root():
    other = subprocess.Popen(["sleep", "60"])  # named as the engine root; our thread connects
    try:
        with pytest.raises(EngineError, match=f"not the engine root {other.pid}"):
            handoff.serve_engine(_Engine(root_pid=other.pid), "127.0.0.1", 0, die_with_parent=True)
    finally:
        other.kill()
        other.wait()


def test_handoff_times_out_when_the_engine_never_connects():
    silent = FakeEngine([], pid=os.getpid())  # alive, takes "serve", never connects
    with pytest.raises(EngineError, match="did not take the listening socket within 0 s"):
        handoff.serve_engine(silent, "127.0.0.1", 0, die_with_parent=True, accept_timeout_s=0.5)
    assert silent.sent == ["serve"]


def test_handoff_gives_up_at_once_when_the_engine_dies():
    class Dead(FakeEngine):
        polls = 0

        def alive(self) -> bool:
            self.polls += 1
            return False

    dead = Dead([], pid=os.getpid())
    with pytest.raises(EngineError, match="exited before it took"):
        handoff.serve_engine(dead, "127.0.0.1", 0, die_with_parent=True)
    assert dead.polls == 1  # at the first poll, not at the 60 s deadline


def test_receive_listener_without_a_name_says_why():
    with pytest.raises(ValueError, match="without a hand-off socket"):
        net.receive_listener("")


def _resolver(table: dict[str, list[str]]):
    """A getaddrinfo over ``table`` (name -> addresses); numeric hosts resolve to themselves."""
    def resolve(host, port, type=0, flags=0):
        import ipaddress as ip

        try:
            ip.ip_address(host)
            return [(socket.AF_INET6 if ":" in host else socket.AF_INET, type, 6, "", (host, 0))]
        except ValueError:
            if flags & socket.AI_NUMERICHOST or host not in table:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, 0)) for a in table[host]]
    return resolve


def test_a_host_name_is_resolved_once_to_a_loopback_or_local_address():
    # a trial: `--host localhost` was refused although `vllm serve` and unit files use it
    r = _resolver({"localhost": ["::1", "127.0.0.1"], "box": ["10.1.2.3"], "far": ["192.0.2.1"]})
    assert ports.resolve_host("127.0.0.2", r, set()) == "127.0.0.2"  # numeric: as given
    assert ports.resolve_host("localhost", r, set()) == "127.0.0.1"  # IPv4 first, as vllm serve binds a name
    assert ports.resolve_host("box", r, {"10.1.2.3"}) == "10.1.2.3"
    with pytest.raises(UsageError, match="'far' resolves to 192.0.2.1, which is no address of this host"):
        ports.resolve_host("far", r, {"10.1.2.3"})
    with pytest.raises(UsageError, match="'nowhere' is neither an IPv4/IPv6 address nor a name that resolves here"):
        ports.resolve_host("nowhere", r, set())
    assert ports.resolve_host("localhost") in ("127.0.0.1", "::1")  # this host's own resolver


def test_restore_binds_the_address_localhost_stands_for_and_says_so(capsys):
    from vllm_snapshot.cli import common

    assert common.host_address("localhost", quiet=False) in ("127.0.0.1", "::1")
    assert "--host localhost: binding " in capsys.readouterr().err
    assert common.host_address("127.0.0.1", quiet=False) == "127.0.0.1" and capsys.readouterr().err == ""
