"""Development aids that ship with the package: the tiny test model (:mod:`.tiny_model`), a real
registry on loopback (:mod:`.registry_server`), the benchmarks' helpers (:mod:`.bench`) and the
pure half of their target tables (:mod:`.bench_targets`). Apart from :mod:`.bench` (which drives
the product from above the seam, like the command line), they import only the base modules."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
