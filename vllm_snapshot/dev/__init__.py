"""Development aids that ship with the package: the tiny test model (:mod:`.tiny_model`), a real
registry on loopback (:mod:`.registry_server`), the benchmarks' helpers (:mod:`.bench`) and the
pure half of their target tables (:mod:`.bench_targets`), the GPU checks of the local tools for
runs with the fake CUDA driver (:mod:`.fakegpu`), and the GPU device check's engine program
(:mod:`.gpu_engine`, run as a process of its own). Apart from :mod:`.bench` and :mod:`.fakegpu`
(above the seam, like the command line) and :mod:`.gpu_engine` (a program, like the engine
root), they import only the base modules."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
