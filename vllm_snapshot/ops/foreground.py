"""The foreground server: block while a restored engine serves, forward the signals that stop
it (it drains), SIGKILL it after its grace, and say how it ended (:func:`serve_foreground`,
:func:`died_while_serving`). Through the runtime and clock roles only."""

from __future__ import annotations

import signal
from typing import Callable

from ..errors import EngineError
from ..store.registry import TEARDOWN_S
from ..report.results import Restored
from ..effects.protocols import Clock, RuntimeTools
from ..effects.handles import Engine
from ..effects.tools import Tools, local_tools


#: Seconds between two looks at a foreground engine (has it exited? is its grace over?).
FOREGROUND_POLL_S = 0.2


def serve_foreground(r: Restored, engine: Engine, on_signal_msg: Callable[[str], None] | None = None,
                     stop_grace_s: float | None = None, tools: Tools | None = None) -> int:
    """Block until the restored engine exits; every SIGINT/SIGTERM/SIGHUP (a closed terminal)
    is forwarded to it as SIGTERM: the first makes it drain (no new connection, requests in flight finish within
    ``r.drain_s`` seconds) and exit 0, a second cuts the drain short. SIGKILL after
    ``stop_grace_s`` seconds from the first signal (default ``r.drain_s`` + the engine's
    teardown time, :data:`vllm_snapshot.store.registry.TEARDOWN_S`). Returns the engine's exit code
    (137 when it had to be killed); unregisters it. An engine that ends by itself with a
    status other than 0 (killed, crashed) while no signal asked it to stop raises
    EngineError (exit 8) naming its PID, the signal or status and where its log is
    (:func:`died_while_serving`); one stopped by ``vllm-snapshot stop`` exits 0 and returns 0."""
    t = tools or local_tools()
    return _serve_until_exit(t.runtime, t.clock, r, engine, on_signal_msg,
                             r.drain_s + TEARDOWN_S if stop_grace_s is None else stop_grace_s)


def _signame(signum: int) -> str:
    """``SIGINT`` for 2; ``signal N`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def how_it_ended(code: int) -> tuple[str, str | None]:
    """(in words, signal name or None) for an engine root's exit code as ``reap`` gives it
    (a signal N is ``128 + N``): ``("killed by SIGKILL (exit status 137)", "SIGKILL")``,
    ``("exited with status 3", None)``."""
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = None
        if name is not None:
            return f"killed by {name} (exit status {code})", name
    return f"exited with status {code}", None


def died_while_serving(r: Restored, code: int) -> EngineError:
    """The error for a foreground engine that ended while serving without being asked to
    (no signal to the command): its PID, what ended it (``code`` as ``reap`` gives it: a
    signal N is ``128 + N``) and where its log is (the command's stderr: the journal under
    systemd). ``details``: ``{"stage": "serving", "pid", "exit_status", "signal", "log": None}``."""
    said, sig = how_it_ended(code)
    return EngineError(
        f"the engine (PID {r.pid}) serving {r.served_name} on {r.url} ended while serving: {said}; "
        "it was not stopped through this command",
        hint="its log is the output above (stderr; under systemd: `journalctl -u UNIT`); "
             + ("a SIGKILL nobody sent by hand is often the kernel's OOM killer: `dmesg | grep -i oom`"
                if sig == "SIGKILL" else "its last lines say why"),
        details={"stage": "serving", "pid": r.pid, "exit_status": code, "signal": sig, "log": None})


def _serve_until_exit(rt: RuntimeTools, clock: Clock, r: Restored, engine: Engine,
                      on_signal_msg: Callable[[str], None] | None, stop_grace_s: float) -> int:
    """:func:`serve_foreground` over its two roles: signals and the registry (``rt``), time."""
    stopping: dict[str, float | None] = {"at": None}

    def _fwd(signum: int) -> None:
        if on_signal_msg:
            # by name (a trial's Ctrl-C read as "signal 15": the engine's own line names the
            # SIGTERM it is sent, this one what the command received)
            on_signal_msg(f"received {_signame(signum)}; stopping the engine" + (
                f" (draining: requests in flight may finish for up to {r.drain_s:g} s)" if stopping["at"] is None
                else " now (requests still in flight are cut)"))
        stopping["at"] = stopping["at"] or clock.monotonic()
        rt.terminate(engine.root_pid)

    try:
        with rt.forward_signals(_fwd):
            while True:
                code = engine.reap(block=False)
                if code is not None:
                    break
                at = stopping["at"]
                if at and clock.monotonic() - at > stop_grace_s:
                    engine.kill()
                    code = 128 + signal.SIGKILL
                    break
                clock.sleep(FOREGROUND_POLL_S)
            engine.drain_log(5.0)  # stragglers of the namespace die with its init
            if stopping["at"] is None and code != 0:
                raise died_while_serving(r, code)
            return code
    finally:
        engine.close()
        rt.unregister(r.pid)
