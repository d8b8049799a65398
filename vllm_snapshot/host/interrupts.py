"""Interruption of create, restore and switch: SIGINT, SIGTERM and SIGHUP (what Ctrl-C,
``systemctl stop``/``timeout`` and a closed terminal send) become :class:`Interrupted`, an
exception, so every cleanup of the interrupted step runs (engine or restored tree killed,
staging and temp dirs removed, lock and registry entry released) and the command exits 130.

Around a CRIU run the signal is *deferred* (:func:`deferred`): stopping CRIU halfway could
leave a tree frozen or half-restored outside anyone's control. The CRIU run is bounded by its
own timeout (:data:`vllm_snapshot.checkpoint.criu.DEFAULT_TIMEOUT_S`), and the interruption is raised as
soon as it returns.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

from ..errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state: dict = {"depth": 0, "pending": None, "fired": None}


def _interrupted(signum: int) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(f"interrupted by {name}; stopped what was running and cleaned up",
                       details={"signal": name})


def _handler(signum, frame) -> None:
    _state["fired"] = signum
    if _state["depth"]:
        _state["pending"] = signum
        return
    raise _interrupted(signum)


def fired() -> Interrupted | None:
    """The interruption, when a signal came: a C extension running when the handler raised may
    have turned :class:`Interrupted` into another exception (protobuf reports a TypeError);
    the CLI maps any failure after a signal to this."""
    return _interrupted(_state["fired"]) if _state["fired"] is not None else None


def reset() -> None:
    """Forget a signal seen earlier in this process (each command starts clean)."""
    _state["fired"] = None
    _state["pending"] = None
    _state["depth"] = 0


def install() -> None:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` for the rest of this process (main
    thread only, as Python delivers signals there). An :class:`Interrupted` that Python could
    not propagate is not lost: see :func:`_unraisable`."""
    import sys

    for s in SIGNALS:
        signal.signal(s, _handler)
    if getattr(sys.unraisablehook, "__name__", "") != "_unraisable":
        _state["next_hook"] = sys.unraisablehook
        sys.unraisablehook = _unraisable


def _unraisable(info) -> None:
    """``sys.unraisablehook``: Python cannot raise out of an at-fork callback, a ``__del__`` or
    a weakref callback; it reports the exception there and goes on. A signal whose handler ran
    in such a place -- ``subprocess.Popen`` forks right after a phase starts, and logging's
    at-fork lock callbacks run then -- would be lost, and the command would carry on (a create
    SIGTERMed at "starting engine" published its snapshot, exit 0). The signal is delivered
    again 50 ms later instead, where it can raise."""
    import os
    import threading

    if isinstance(info.exc_value, Interrupted) and _state["fired"] is not None:
        threading.Timer(0.05, os.kill, (os.getpid(), _state["fired"])).start()
        return
    _state.get("next_hook", _default_unraisable)(info)


def _default_unraisable(info) -> None:
    import sys

    sys.__unraisablehook__(info)


def hold() -> None:
    """Start holding signals (as :func:`deferred` does) until :func:`release`: a restore calls
    it the moment its engine serves validated, so a late signal cannot cut the bookkeeping
    (registry, last restore) of an engine that keeps running. A detached restore never
    releases: its command has done its job, and a signal after that is dropped (exit 0, not a
    130 that would claim nothing runs)."""
    _state["depth"] += 1


def release() -> None:
    """End a :func:`hold`; raise :class:`Interrupted` when a signal came meanwhile."""
    _state["depth"] = max(0, _state["depth"] - 1)
    if _state["depth"] == 0 and _state["pending"] is not None:
        signum, _state["pending"] = _state["pending"], None
        raise _interrupted(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold signals for the duration of the block; raise :class:`Interrupted` right after it
    when one came (not when the block itself raised: that error wins)."""
    hold()
    try:
        yield
    except BaseException:
        _state["depth"] = max(0, _state["depth"] - 1)
        raise
    release()
