"""A real, shaped link between a registry and a node, in network namespaces the test makes.

Two namespaces, ``vsnap-reg-PID`` (the registry: Debian's docker-registry bound to
``10.231.0.1:5000`` there) and ``vsnap-node-PID`` (the node), joined by a veth pair
(10.231.0.1/30 - 10.231.0.2/30), nothing else in either but ``lo``: the traffic cannot leave
them. Each end of the veth is shaped on egress:

- **rate**: ``tc qdisc ... tbf rate RATE`` (both directions);
- **loss**: an nftables rule in each namespace's output hook, ``numgen random mod 100 < LOSS
  counter drop`` (both directions; the stack hands the veth GSO segments of up to 64 KiB, so
  a dropped "packet" is up to 45 wire segments: harsher than netem's per-frame loss);
- **delay**: tests/link_proxy.py, a relay in the node's namespace (see its docstring: this
  kernel has no ``sch_netem``); the node's commands reach the registry as
  ``127.0.0.1:PORT`` there. That is also why the relay exists at all: the client speaks plain
  HTTP only to a loopback host (``--plain-http``), and it trusts only certifi's public CAs (no
  ``REQUESTS_CA_BUNDLE``: its sessions set ``trust_env = False``), so a registry at 10.231.0.1
  would need a certificate from a public CA.

When the kernel has ``sch_netem``, :class:`ShapedLink` uses it for the delay instead (``tc
qdisc add ... netem delay D rate R``) and the relay adds none. Every namespace, process and
file is removed by :meth:`ShapedLink.close` (deleting a namespace deletes its veth end)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from vllm_snapshot.dev.registry_server import BINARY

HERE = Path(__file__).resolve().parent
REG_ADDR, NODE_ADDR = "10.231.0.1", "10.231.0.2"
REG_PORT = 5000


def _run(*argv: str, input: str | None = None) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def netem_available() -> tuple[bool, str]:
    """(whether ``tc qdisc add ... netem`` works on this kernel, the evidence): tried on a
    dummy veth in a throwaway namespace."""
    ns = f"vsnap-probe-{os.getpid()}"
    _run("ip", "netns", "add", ns)
    try:
        _run("ip", "-n", ns, "link", "add", "vsp0", "type", "veth", "peer", "name", "vsp1")
        p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "vsp0", "root", "netem",
                            "delay", "20ms"], capture_output=True, text=True, timeout=30)
        return p.returncode == 0, (p.stderr or p.stdout).strip()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class ShapedLink:
    """The two namespaces, the shaped veth, the registry in one and the relay in the other.

    ``rate_mbit`` (Mbit/s, each direction), ``loss_pct`` (percent of the packets each end
    sends, 0-100, an integer), ``delay_ms`` (one-way, each direction). ``host`` is what the
    node's commands use as the registry (``127.0.0.1:PORT``, plain HTTP); :meth:`on_node`
    prefixes an argv to run it in the node's namespace. Raises RuntimeError (with the failing
    command's words) when a step fails; whatever was made is removed first."""

    def __init__(self, base: Path, rate_mbit: int = 1000, loss_pct: int = 1, delay_ms: float = 20.0):
        self.base = base
        self.rate_mbit, self.loss_pct, self.delay_ms = rate_mbit, loss_pct, delay_ms
        tag = str(os.getpid())[-6:]
        self.reg_ns, self.node_ns = f"vsnap-reg-{tag}", f"vsnap-node-{tag}"
        self.reg_if, self.node_if = f"vsl{tag}r", f"vsl{tag}n"
        self.registry = self.relay = None
        self._made: list[str] = []
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the link
    def _setup(self) -> None:
        for ns in (self.reg_ns, self.node_ns):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", self.reg_if, "netns", self.reg_ns, "type", "veth",
             "peer", "name", self.node_if, "netns", self.node_ns)
        self.netem, self.netem_evidence = netem_available()
        for ns, dev, addr in ((self.reg_ns, self.reg_if, REG_ADDR), (self.node_ns, self.node_if, NODE_ADDR)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            if self.netem:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                     "delay", f"{self.delay_ms}ms", "rate", f"{self.rate_mbit}mbit")
            else:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{self.rate_mbit}mbit", "burst", "1mb", "latency", "50ms")
            if self.loss_pct:
                _run("ip", "netns", "exec", ns, "nft", "-f", "-", input=(
                    "table ip vsnap_link {\n chain out {\n  type filter hook output priority 0; policy accept;\n"
                    f"  oifname \"{dev}\" numgen random mod 100 < {self.loss_pct} counter drop\n }}\n}}\n"))
        self._start_registry()
        self._start_relay()

    def _start_registry(self) -> None:
        d = self.base / "registry"
        self.storage = d / "storage"
        self.storage.mkdir(parents=True, mode=0o700)
        self.registry_log = d / "registry.log"
        cfg = d / "config.yml"
        cfg.write_text("version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
                       f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                       f"http:\n  addr: {REG_ADDR}:{REG_PORT}\n")
        self._reg_out = open(self.registry_log, "ab")
        self.registry = subprocess.Popen(["ip", "netns", "exec", self.reg_ns, BINARY, "serve", str(cfg)],
                                         stdout=self._reg_out, stderr=subprocess.STDOUT,
                                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        deadline = time.monotonic() + 20
        while "listening on" not in self.registry_log.read_text(errors="replace"):
            if self.registry.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start in {self.reg_ns}: "
                                   f"{self.registry_log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)

    def _start_relay(self) -> None:
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns, sys.executable, str(HERE / "link_proxy.py"),
             "--listen", "127.0.0.1:0", "--upstream", f"{REG_ADDR}:{REG_PORT}",
             "--delay-ms", str(0 if self.netem else self.delay_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.relay.stdout.readline()
        m = re.match(r"listening (\S+):(\d+)", line)
        if not m:
            raise RuntimeError(f"the relay did not start in {self.node_ns}: {line!r} {self.relay.stderr.read()[-2000:]}")
        self.host = f"127.0.0.1:{m.group(2)}"

    # ------------------------------------------------------------------ use
    def on_node(self, argv: list[str]) -> list[str]:
        """``argv`` run in the node's network namespace."""
        return ["ip", "netns", "exec", self.node_ns, *argv]

    def qdisc_stats(self, side: str = "reg") -> tuple[int, int]:
        """(bytes sent, overlimits: packets held back because the rate was exceeded) of the qdisc
        of the registry's (``reg``) or the node's (``node``) veth end."""
        ns, dev = (self.reg_ns, self.reg_if) if side == "reg" else (self.node_ns, self.node_if)
        out = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev)
        return int(re.search(r"Sent (\d+) bytes", out).group(1)), int(re.search(r"overlimits (\d+)", out).group(1))

    def qdisc_sent(self, side: str = "reg") -> int:
        """Bytes the qdisc of that end has sent."""
        return self.qdisc_stats(side)[0]

    def round_trip(self) -> float:
        """Seconds of one ``GET /v2/`` from the node's namespace to the registry on a new
        connection (the request and the answer each cross the link once)."""
        code = ("import socket, time; s = socket.create_connection(('127.0.0.1', %s)); t = time.monotonic(); "
                "s.sendall(b'GET /v2/ HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n'); "
                "assert s.recv(65536).startswith(b'HTTP/1.1 200'); print(time.monotonic() - t)") % self.host.split(":")[1]
        return float(_run(*self.on_node([sys.executable, "-c", code])))

    def dropped(self, side: str = "reg") -> int:
        """Packets the loss rule of that end has dropped so far."""
        ns = self.reg_ns if side == "reg" else self.node_ns
        out = _run("ip", "netns", "exec", ns, "nft", "list", "table", "ip", "vsnap_link")
        return int(re.search(r"counter packets (\d+)", out).group(1))

    def describe(self) -> str:
        how = "netem" if self.netem else f"tbf + a {self.delay_ms} ms relay (no netem: {self.netem_evidence})"
        return f"{self.rate_mbit} Mbit/s, {self.loss_pct}% loss, {self.delay_ms} ms one way ({how})"

    def close(self) -> None:
        """Stop the relay and the registry, delete both namespaces (and so the veth)."""
        for p in (self.relay, self.registry):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.relay is not None:
            self.relay.stdout.close()
            self.relay.stderr.close()
        if self.registry is not None:
            self._reg_out.close()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
