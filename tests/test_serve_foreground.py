"""ops.serve_foreground over a real child process standing in for the restored engine root:
the signals a foreground restore gets are forwarded as SIGTERM and its exit code returned; the
grace -> SIGKILL path. Each case runs in a subprocess of its own (the signals go to it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HARNESS = textwrap.dedent(r"""
    import os, signal, subprocess, sys, threading, time
    from types import SimpleNamespace
    from vllm_snapshot.host import interrupts
    from vllm_snapshot.ops.restore import serve_foreground

    SIG, GRACE, IGNORE_TERM = signal.Signals[sys.argv[1]], float(sys.argv[2]), sys.argv[3] == "1"
    # the engine root: exits 0 on SIGTERM (a drained engine), or ignores it (a stuck one)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if IGNORE_TERM else
           "signal.signal(signal.SIGTERM, lambda *a: exit(0))\n")
        + "time.sleep(60)"])

    class Engine:
        root_pid = child.pid
        def reap(self, block=False):
            return child.poll()
        def kill(self):
            child.kill(); child.wait()
        def drain_log(self, timeout):
            pass
        def close(self):
            pass

    class Tools:
        def unregister(self, pid):
            print("unregistered", pid)

    interrupts.install()  # as the CLI: any signal not forwarded would become exit 130
    time.sleep(0.3)  # the child's handler is set
    threading.Timer(0.2, os.kill, (os.getpid(), SIG)).start()
    t0 = time.monotonic()
    code = serve_foreground(SimpleNamespace(pid=child.pid, drain_s=GRACE), Engine(), print, stop_grace_s=GRACE,
                            tools=Tools())
    print("code", code, "alive", child.poll() is None, "took", round(time.monotonic() - t0, 1))
""")


def _run(sig: str, grace: float = 5.0, ignore_term: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HARNESS, sig, str(grace), "1" if ignore_term else "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_sigterm_sigint_and_sighup_are_forwarded_and_the_engines_exit_code_returned():
    for sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        cp = _run(sig)
        assert cp.returncode == 0, (sig, cp.stdout, cp.stderr)
        assert "stopping the engine (draining" in cp.stdout and "code 0 alive False" in cp.stdout, (sig, cp.stdout)
        assert "unregistered" in cp.stdout


def test_an_engine_that_does_not_stop_is_killed_after_the_grace():
    cp = _run("SIGTERM", grace=1.0, ignore_term=True)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "code 137 alive False" in cp.stdout, cp.stdout
