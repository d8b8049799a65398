"""A TCP relay with a delay line: the latency half of a shaped link (tests/shaped_link.py).

This kernel has no ``sch_netem`` (``tc qdisc add dev X root netem delay 20ms``: "Error:
Specified qdisc kind is unknown.", ``CONFIG_NET_SCH_NETEM`` is not set in /proc/config.gz, and
the kernel loads no modules) and no ``sch_fq`` for an eBPF departure-time delay, so the
kernel shapes rate (``tbf``) and loss (nftables ``numgen random``) and this relay adds the
delay: every chunk read from one side is written to the other ``delay`` seconds after it
arrived, in both directions, through a queue bounded by ``window`` bytes (when it is full the
relay stops reading, so the sender's TCP backs off as behind a real window). A request and its
response thus take ``2 * delay`` more, as over a link with that one-way delay; what it does
not emulate is the effect of the delay on TCP's own loss recovery (the relay's connection to
the registry sees the loss at a short round trip).

Run as ``python link_proxy.py --listen HOST:PORT --upstream HOST:PORT --delay-ms N``; it prints
``listening HOST:PORT`` (the port it bound, when PORT is 0) on stdout once it accepts, and runs
until killed."""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
import time

CHUNK = 256 * 1024


class DelayLine:
    """A FIFO of (due time, bytes), at most ``window`` bytes in it; ``put`` blocks when full,
    ``get`` returns the next chunk once it is due (None at the end)."""

    def __init__(self, delay_s: float, window: int):
        self.delay_s, self.window = delay_s, window
        self.q: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.ended = False
        self.cv = threading.Condition()

    def put(self, data: bytes) -> None:
        with self.cv:
            while self.held and self.held + len(data) > self.window and not self.ended:
                self.cv.wait()
            self.q.append((time.monotonic() + self.delay_s, data))
            self.held += len(data)
            self.cv.notify_all()

    def end(self) -> None:
        with self.cv:
            self.ended = True
            self.cv.notify_all()

    def get(self) -> bytes | None:
        with self.cv:
            while not self.q and not self.ended:
                self.cv.wait()
            if not self.q:
                return None
            due, data = self.q[0]
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        with self.cv:
            self.q.popleft()
            self.held -= len(data)
            self.cv.notify_all()
        return data


def _pump(src: socket.socket, dst: socket.socket, delay_s: float, window: int, both: list[socket.socket]) -> None:
    line = DelayLine(delay_s, window)

    def read() -> None:
        try:
            while data := src.recv(CHUNK):
                line.put(data)
        except OSError:
            pass
        line.end()

    def write() -> None:
        try:
            while (data := line.get()) is not None:
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in both:  # one side is gone: so is the connection
                try:
                    s.close()
                except OSError:
                    pass

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()


def serve(listen: tuple[str, int], upstream: tuple[str, int], delay_s: float, window: int) -> None:
    """Accept on ``listen`` forever; relay each connection to ``upstream`` through two delay
    lines. Prints ``listening HOST:PORT`` once bound."""
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(listen)
    ls.listen(64)
    print(f"listening {ls.getsockname()[0]}:{ls.getsockname()[1]}", flush=True)
    while True:
        c, _ = ls.accept()
        try:
            u = socket.create_connection(upstream, timeout=10)
            u.settimeout(None)
        except OSError:
            c.close()
            continue
        for s in (c, u):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _pump(c, u, delay_s, window, [c, u])
        _pump(u, c, delay_s, window, [c, u])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT (PORT 0: any)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay in each direction")
    ap.add_argument("--window", type=int, default=8 << 20, help="bytes in flight per direction per connection")
    a = ap.parse_args(argv)

    def hp(s: str) -> tuple[str, int]:
        h, _, p = s.rpartition(":")
        return h, int(p)
    serve(hp(a.listen), hp(a.upstream), a.delay_ms / 1000.0, a.window)


if __name__ == "__main__":
    main(sys.argv[1:])
