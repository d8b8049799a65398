"""ops.serve_foreground: through the fakes (every branch, the clock and the signals driven by
the test), and over a real child process standing in for the restored engine root with the
real signal forwarding (each such case runs in a subprocess of its own: the signals go to it)."""

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
    from vllm_snapshot.ops.foreground import serve_foreground
    from vllm_snapshot.effects.runtime import LocalRuntimeTools
    from vllm_snapshot.effects.tools import local_tools
    import dataclasses

    SIG, GRACE, IGNORE_TERM = signal.Signals[sys.argv[1]], float(sys.argv[2]), sys.argv[3] == "1"
    # the engine root: exits 0 on SIGTERM (a drained engine), or ignores it (a stuck one)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if IGNORE_TERM else
           "signal.signal(signal.SIGTERM, lambda *a: exit(0))\n")
        + "time.sleep(60)"])

    class Engine:
        root_pid = child.pid
        def reap(self, block=False):  # as EngineHandle.reap: a signal N is 128 + N
            rc = child.poll()
            return rc if rc is None or rc >= 0 else 128 - rc
        def kill(self):
            child.kill(); child.wait()
        def drain_log(self, timeout):
            pass
        def close(self):
            pass

    class Runtime(LocalRuntimeTools):  # the real signal forwarding; the registry left alone
        def unregister(self, pid):
            print("unregistered", pid)

    interrupts.install()  # as the CLI: any signal not forwarded would become exit 130
    time.sleep(0.3)  # the child's handler is set
    threading.Timer(0.2, os.kill, (os.getpid(), SIG)).start()
    t0 = time.monotonic()
    code = serve_foreground(SimpleNamespace(pid=child.pid, drain_s=GRACE, served_name="tiny", url="http://x"), Engine(), print, stop_grace_s=GRACE,
                            tools=dataclasses.replace(local_tools(), runtime=Runtime()))
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


# ------------------------------------------------------------------ through the fakes

from vllm_snapshot.ops.foreground import FOREGROUND_POLL_S, serve_foreground  # noqa: E402

from fakes import FakeEngine, FakeWorld  # noqa: E402


class _Engine(FakeEngine):
    """Exits with ``code`` once it was sent SIGTERM ``after`` times (never: None)."""

    def __init__(self, w: FakeWorld, after: int | None, code: int = 0) -> None:
        super().__init__(w.calls, pid=777)
        self.w, self.after, self.code = w, after, code
        self.drained = False

    def reap(self, block: bool = True) -> int | None:
        self.w.calls.append("engine.reap")
        return self.code if self.after is not None and len(self.w.terminated) >= self.after else None

    def drain_log(self, timeout_s: float = 5.0) -> None:
        self.drained = True
        self.w.calls.append("engine.drain_log")

    def kill(self, grace: float = 0.0) -> None:
        self.killed_at = self.w._t  # the fake clock's time
        super().kill(grace)


def _serve(w: FakeWorld, engine: _Engine, signals_at: dict[float, int], grace: float | None = 10.0,
           drain_s: float = 5.0) -> tuple[int, list[str]]:
    """serve_foreground with the fake clock (a poll sleeps ``FOREGROUND_POLL_S``) and the signals of
    ``signals_at`` (clock time -> signum) delivered through the handler it installed."""
    from types import SimpleNamespace

    said: list[str] = []

    def on_sleep(now: float) -> None:
        assert now < 1000, "serve_foreground never stopped"
        for at in [a for a in signals_at if a <= now]:
            assert w.signal_handler is not None, "a signal came while nothing forwarded it"
            w.signal_handler(signals_at.pop(at))

    w.on_sleep = on_sleep
    code = serve_foreground(SimpleNamespace(pid=777, drain_s=drain_s, served_name="tiny", url="http://127.0.0.1:8123"), engine, said.append, stop_grace_s=grace,
                            tools=w.tools)
    return code, said


def test_a_signal_is_forwarded_as_sigterm_and_the_engines_code_returned():
    import signal

    w = FakeWorld()
    eng = _Engine(w, after=1, code=0)
    code, said = _serve(w, eng, {1.0: signal.SIGHUP})
    assert code == 0 and w.terminated == [777] and not eng.killed
    assert said == ["received SIGHUP; stopping the engine (draining: requests in flight may "
                    "finish for up to 5 s)"]
    c = w.calls
    # signals forwarded from before the first look until the log is drained; then closed and unregistered
    assert c.index("forward_signals") < c.index("engine.reap") < c.index("terminate")
    assert c.index("engine.drain_log") < c.index("forward_signals.end") < c.index("engine.close") < c.index("unregister")
    assert w.signal_handler is None  # the old handlers are back


def test_the_signal_received_is_named_not_the_sigterm_forwarded():
    # a trial: Ctrl-C to a foreground serve was logged as "signal 15" (what the engine is sent)
    import signal

    w = FakeWorld()
    code, said = _serve(w, _Engine(w, after=1, code=0), {1.0: signal.SIGINT})
    assert code == 0 and said[0].startswith("received SIGINT; stopping the engine"), said


def test_a_second_signal_cuts_the_drain_short():
    import signal

    w = FakeWorld()
    eng = _Engine(w, after=2, code=143)
    code, said = _serve(w, eng, {1.0: signal.SIGTERM, 2.0: signal.SIGINT})
    assert code == 143 and w.terminated == [777, 777] and not eng.killed
    assert said[1].endswith("stopping the engine now (requests still in flight are cut)")


def test_an_engine_that_does_not_stop_within_the_grace_is_killed():
    import signal

    w = FakeWorld()
    eng = _Engine(w, after=None)
    code, _ = _serve(w, eng, {1.0: signal.SIGTERM}, grace=3.0)
    assert code == 128 + signal.SIGKILL and eng.killed
    assert w.terminated == [777]
    # killed on the first look after the grace (the fake clock: +1 s per reading, a poll's sleep)
    assert 1.0 + 3.0 < eng.killed_at <= 1.0 + 3.0 + 2 * (1.0 + FOREGROUND_POLL_S) + 1.0, eng.killed_at
    assert w.calls.index("engine.kill") < w.calls.index("engine.close") < w.calls.index("unregister")


def test_the_default_grace_is_the_drain_plus_the_teardown_time():
    import signal

    from vllm_snapshot.store.registry import TEARDOWN_S

    w = FakeWorld()
    eng = _Engine(w, after=None)
    code, _ = _serve(w, eng, {0.5: signal.SIGTERM}, grace=None, drain_s=2.0)
    assert code == 137 and eng.killed
    grace = 2.0 + TEARDOWN_S
    assert 0.5 + grace < eng.killed_at <= 0.5 + grace + 2 * (1.0 + FOREGROUND_POLL_S) + 1.0, eng.killed_at


def test_an_engine_that_exits_by_itself_needs_no_signal_and_is_unregistered_even_when_draining_fails():
    w = FakeWorld()
    eng = _Engine(w, after=0, code=0)  # `vllm-snapshot stop` from another shell: drained, exit 0
    assert _serve(w, eng, {})[0] == 0 and w.terminated == [] and "unregister" in w.calls

    w = FakeWorld()
    eng = _Engine(w, after=0)

    def boom(timeout_s: float = 5.0) -> None:
        raise OSError("log pipe gone")

    eng.drain_log = boom
    import pytest

    with pytest.raises(OSError):
        _serve(w, eng, {})
    assert w.calls[-2:] == ["engine.close", "unregister"] and w.signal_handler is None


def test_an_engine_killed_while_serving_is_an_engine_failure_naming_pid_signal_and_log():
    # a trial: `kill -9 <engine PID>` under a foreground restore exited 137 with no message
    import pytest

    from vllm_snapshot.errors import EngineError

    w = FakeWorld()
    eng = _Engine(w, after=0, code=137)
    with pytest.raises(EngineError) as ei:
        _serve(w, eng, {})
    e = ei.value
    assert e.exit_code == 8 and e.code == "engine-failed"
    assert "PID 777" in e.message and "killed by SIGKILL (exit status 137)" in e.message, e.message
    assert "stderr" in e.hint and "journalctl" in e.hint and "oom" in e.hint.lower(), e.hint
    assert e.details["signal"] == "SIGKILL" and e.details["exit_status"] == 137
    assert w.terminated == [] and w.calls[-2:] == ["engine.close", "unregister"]


def test_an_engine_that_crashes_while_serving_names_its_exit_status():
    import pytest

    from vllm_snapshot.errors import EngineError

    w = FakeWorld()
    with pytest.raises(EngineError) as ei:
        _serve(w, _Engine(w, after=0, code=3), {})
    assert "exited with status 3" in ei.value.message and ei.value.details["signal"] is None


def test_an_engine_killed_by_a_real_sigkill_is_reported_through_the_real_forwarding():
    cp = subprocess.run([sys.executable, "-c", HARNESS_KILLED], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "EngineError engine-failed 8" in cp.stdout and "killed by SIGKILL" in cp.stdout, cp.stdout + cp.stderr
    assert "unregistered" in cp.stdout


HARNESS_KILLED = HARNESS.replace(
    "threading.Timer(0.2, os.kill, (os.getpid(), SIG)).start()",
    "threading.Timer(0.2, os.kill, (child.pid, signal.SIGKILL)).start()  # kill -9 <engine PID>",
).replace(
    "code = serve_foreground(",
    "try:\n    code = serve_foreground(",
).replace(
    "                        tools=dataclasses.replace(local_tools(), runtime=Runtime()))",
    "                        tools=dataclasses.replace(local_tools(), runtime=Runtime()))\n"
    "except Exception as e:\n    print(type(e).__name__, e.code, e.exit_code, e.message); code = None",
).replace("SIG, GRACE, IGNORE_TERM = signal.Signals[sys.argv[1]], float(sys.argv[2]), sys.argv[3] == \"1\"",
          "SIG, GRACE, IGNORE_TERM = signal.SIGTERM, 5.0, False")
