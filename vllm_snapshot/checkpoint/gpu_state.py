"""The state of restored CUDA processes: what our ``cuda-checkpoint`` helper reports for each
(:func:`restored_states`) and the check that every recorded CUDA process came back running
(:func:`check_restored`). :mod:`vllm_snapshot.checkpoint.gpu` re-exports these names."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import EnvironmentProblem


#: Runs a ``cuda-checkpoint`` command line and returns (exit status, stdout + stderr).
HelperRun = Callable[[Sequence[str]], "tuple[int, str]"]


#: The state :func:`restored_states` reports for a recorded CUDA process the driver finds no
#: CUDA context in after the restore.
NO_CUDA = "without CUDA state"


def restored_states(pids: Sequence[int], run: HelperRun, recorded: bool = False) -> list[tuple[int, str]]:
    """``(pid, state)`` of every CUDA process among ``pids`` (host PIDs of a restored tree), as
    our ``cuda-checkpoint`` reports them: ``--get-restore-tid`` exit 0 marks a CUDA process
    (exit 1: none, or ``gone`` when the process vanished), then ``--get-state``. ``recorded``:
    ``pids`` are the processes that had CUDA at the dump, so one without CUDA now is reported
    (:data:`NO_CUDA`) instead of left out. A helper that cannot reach the driver (exit 3) or
    cannot run at all (any other exit) raises EnvironmentProblem. States: running, locked,
    checkpointed, failed, gone, :data:`NO_CUDA`, or ``unknown (<message>)``."""
    from .cuda_checkpoint import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE

    out = []
    for pid in pids:
        rc, text = run(["--get-restore-tid", "--pid", str(pid)])
        if rc == EXIT_UNAVAILABLE:
            raise EnvironmentProblem(f"cannot check the restored CUDA processes: {text.strip()}",
                                     hint="run `vllm-snapshot doctor` on this host")
        if rc == EXIT_FAILED and "no such process" in text:
            out.append((pid, "gone"))
            continue
        if rc == EXIT_FAILED:
            if recorded:
                out.append((pid, NO_CUDA))
            continue  # the driver says: not a CUDA process
        if rc != EXIT_OK:
            raise EnvironmentProblem(f"cannot check the restored CUDA processes: cuda-checkpoint exited {rc}: "
                                     f"{text.strip()[:300]}")
        rc, text = run(["--get-state", "--pid", str(pid)])
        out.append((pid, text.strip() if rc == EXIT_OK else f"unknown ({text.strip()[:200]})"))
    return out


def check_restored(states: Sequence[tuple[int, str]], expected: int | None = None) -> None:
    """Raise CriuError unless at least one CUDA process was found (``expected``: exactly that
    many, the CUDA processes recorded at the dump) and every one is ``running``. CRIU 4.2.1
    only logs a failed RESUME_DEVICES_LATE hook (criu/cr-restore.c: 2259-2274) and resumes the
    tree anyway, so a process whose GPU state was not restored or unlocked comes back locked
    and blocks on its next CUDA call.

    ``gone`` is a failure: a process of the just-restored tree that exited before its GPU state
    could be checked -- a recorded CUDA process (or, for snapshots that did not record them,
    any process of the tree) -- means the engine is not the one recorded; fail closed. Pure."""
    from ..errors import CriuError

    bad = [(p, s) for p, s in states if s != "running"]
    if bad:
        said = [f"PID {p} exited" if s == "gone" else f"PID {p} is {s}" for p, s in bad]
        raise CriuError("CRIU restored the tree, but not every CUDA process of it is running: " + ", ".join(said)
                        + " (expected running); stopped the tree",
                        hint="see the CRIU restore log (grep cuda_plugin); free GPU memory or check the GPU, then retry")
    if not states:
        raise CriuError("CRIU restored the tree, but no process of it has CUDA state: the GPU state was not restored",
                        hint="see the CRIU restore log (grep cuda_plugin)")
    if expected is not None and len(states) != expected:
        raise CriuError(f"CRIU restored the tree, but {len(states)} of its processes have CUDA state where the dump "
                        f"had {expected}; stopped the tree", hint="see the CRIU restore log (grep cuda_plugin)")
