"""Errors with stable codes and exit codes.

Every failure the CLI reports is a :class:`SnapshotError`; ``cli/app.py`` is the only place that
turns one into an exit code. The table (also in docs/cli.md, "Exit codes"):

==== ======================== ====================================================
exit code                     meaning
==== ======================== ====================================================
0    -                        success
1    ``internal``             unexpected failure (a bug: run with ``--debug``)
2    ``usage``                bad command line, bad engine args, target exists
3    ``incompatible-host``    host identity differs from the snapshot's
4    ``model-changed``        model files differ from those the snapshot was made from
5    ``corrupt-snapshot``     missing/extra/corrupt files, bad manifest, unsafe snapshot permissions
6    ``oracle-mismatch``      the restored engine's oracle differs from the recorded one
7    ``criu-failed``          CRIU dump/restore failed (its log excerpt is in the message)
8    ``engine-failed``        the engine failed to start, died, or timed out
9    ``busy``                 a port, PID, or lock needed is held by someone else
10   ``unsnapshottable``      the engine tree holds something CRIU cannot restore safely
11   ``environment``          this host lacks something required (root, CRIU, vLLM), a
                              directory above a snapshot is writable by others, or a
                              filesystem refused a write (full, read-only, busy, denied:
                              :func:`from_os_error`)
12   ``insufficient-resources`` not enough memory here (MemAvailable or cgroup) to restore
13   ``untrusted-artifact``   pull --verify-key: the artifact is unsigned, or no signature by that key
130  ``interrupted``          SIGINT/SIGTERM/SIGHUP stopped the command; it cleaned up
==== ======================== ====================================================
"""

from __future__ import annotations

import errno as _errno
import shlex as _shlex


def q(word: object) -> str:
    """``word`` (a path, a user name, an image reference: anything ``str`` takes) as one shell
    word, for every command a message or hint tells an operator to paste (``rm -r``, ``chmod``,
    ``setfacl``, ``umount``, ``vllm-snapshot ...``): :func:`shlex.quote`, which leaves an ordinary
    path (letters, digits and ``@%+=:,./-_``) unchanged and single-quotes any other --
    ``/srv/my snaps`` -> ``'/srv/my snaps'``, so a pasted ``rm -r`` removes that directory, not
    ``/srv/my`` and ``./snaps``. Pure."""
    return _shlex.quote(str(word))


class SnapshotError(Exception):
    """Base error. ``code`` is a stable string for ``--json``; ``exit_code`` an int.

    ``hint`` is one line telling the operator what to do; ``details`` is JSON-able context
    (e.g. the list of differing fields).
    """

    code = "internal"
    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, details: object = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def to_json(self) -> dict:
        """JSON form: ``{"code", "exit_code", "message", "hint", "details"}``."""
        return {
            "code": self.code,
            "exit_code": self.exit_code,
            "message": self.message,
            "hint": self.hint,
            "details": self.details,
        }


def first_lines(e: BaseException) -> str:
    """A one-line summary of ``e`` for a table cell or a progress line: the first line of its
    message (``SnapshotError.message``, else ``str(e)``), plus the second one stripped when
    there is one (often the reason). Pure; never raises for any exception."""
    lines = (getattr(e, "message", None) or str(e)).splitlines() or [""]
    return lines[0] + (" " + lines[1].strip() if len(lines) > 1 else "")


def combined(found: list[SnapshotError]) -> SnapshotError:
    """One error for the refusals ``found`` by one validation (or one command line), in check order: the first one --
    its class, exit code, hint and details, as when it was the only one -- with every other one
    after it in words (``and N more problems``, each with its code and hint), so an operator fixes
    them all in one go instead of meeting the next one at the next run; with dict or no
    details, ``details["also"]`` lists them (``code``, ``message``, ``hint``). Pure."""
    first, rest = found[0], found[1:]
    if not rest:
        return first
    lines = [first.message, f"and {len(rest)} more problem{'s' if len(rest) > 1 else ''} (fix each before running it again):"]
    for e in rest:
        msg = e.message.replace("\n", "\n    ")
        lines.append(f"  - [{e.code}] {msg}" + (f"\n    hint: {e.hint}" if e.hint else ""))
    also = [{"code": e.code, "exit_code": e.exit_code, "message": e.message, "hint": e.hint} for e in rest]
    details = first.details
    if details is None or isinstance(details, dict):
        details = {**(details or {}), "also": also}
    return type(first)("\n".join(lines), hint=first.hint, details=details)


class UsageError(SnapshotError):
    code, exit_code = "usage", 2


class IncompatibleHostError(SnapshotError):
    code, exit_code = "incompatible-host", 3


class ModelChangedError(SnapshotError):
    code, exit_code = "model-changed", 4


class CorruptSnapshotError(SnapshotError):
    code, exit_code = "corrupt-snapshot", 5


class OracleMismatchError(SnapshotError):
    code, exit_code = "oracle-mismatch", 6


class CriuError(SnapshotError):
    code, exit_code = "criu-failed", 7


class EngineError(SnapshotError):
    code, exit_code = "engine-failed", 8


class BusyError(SnapshotError):
    code, exit_code = "busy", 9


class UnsnapshottableError(SnapshotError):
    code, exit_code = "unsnapshottable", 10


class EnvironmentProblem(SnapshotError):
    code, exit_code = "environment", 11


class InsufficientResources(SnapshotError):
    """This host (or the memory cgroup the engine would run in) cannot hold the restored tree
    right now; nothing was started. May pass once memory is freed."""

    code, exit_code = "insufficient-resources", 12


class UntrustedArtifactError(SnapshotError):
    """``pull``/``restore IMAGE``/``serve --registry`` with ``--verify-key``: the artifact is
    unsigned, or no signature beside it verifies with the key (a trust refusal: the artifact
    may be intact; nothing was downloaded)."""

    code, exit_code = "untrusted-artifact", 13


class Interrupted(SnapshotError):
    """SIGINT, SIGTERM or SIGHUP stopped the command; everything it had started was cleaned
    up (see :mod:`vllm_snapshot.host.interrupts`)."""

    code, exit_code = "interrupted", 130


#: errnos of a filesystem refusing a write that say something about this host, not a bug:
#: :func:`from_os_error` turns them into :class:`EnvironmentProblem` (exit 11)
ENVIRONMENT_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT, _errno.EROFS, _errno.EBUSY, _errno.EACCES,
                                _errno.EPERM})


def from_os_error(e: OSError) -> SnapshotError | None:
    """The :class:`EnvironmentProblem` (exit 11) for an OSError the host's filesystem raised
    (no space or quota left, read-only, a busy path such as a mount point, permission denied),
    naming the path(s) it names and what to do; None for any other errno (a bug: ``internal``).
    The CLI's last resort for a command with no words of its own for that failure. Pure."""
    if not isinstance(e, OSError) or e.errno not in ENVIRONMENT_ERRNOS:
        return None
    path = e.filename if e.filename is not None else None
    where = f" ({path} -> {e.filename2})" if path is not None and e.filename2 is not None else ""
    at = f" {path}" if path is not None else ""
    details = {"errno": _errno.errorcode.get(e.errno, str(e.errno)), "path": None if path is None else str(path),
               "path2": None if e.filename2 is None else str(e.filename2)}
    if e.errno in (_errno.ENOSPC, _errno.EDQUOT):
        what = "no space left" if e.errno == _errno.ENOSPC else "the disk quota is used up"
        return EnvironmentProblem(f"{what} on the filesystem of{at or ' a path it wrote'}{where}",
                                  hint="free space there (`df -h` shows it) or choose another path, then run the "
                                       "command again", details=details)
    if e.errno == _errno.EROFS:
        return EnvironmentProblem(f"the filesystem of{at or ' a path it writes'} is read-only{where}",
                                  hint="remount it read-write, or choose a path on a writable filesystem (--root, "
                                       "VLLM_SNAPSHOT_ROOT, VLLM_SNAPSHOT_LOG_DIR)", details=details)
    if e.errno == _errno.EBUSY:
        return EnvironmentProblem(f"{path if path is not None else 'a path'} is busy{where}: a mount point, or "
                                  "in use by another process",
                                  hint=f"unmount it (`umount {q(path)}`) or stop what uses it (`fuser -vm {q(path)}`), "
                                       "then run the command again" if path is not None else
                                  "unmount it or stop what uses it, then run the command again", details=details)
    return EnvironmentProblem(f"permission denied:{at or ' ' + (e.strerror or str(e))}{where}",
                              hint="vllm-snapshot needs root for snapshots, CRIU and the engine registry; as root, "
                                   "an immutable attribute (`lsattr`) or a security module (SELinux, AppArmor) "
                                   "may refuse it", details=details)


ALL_ERRORS: tuple[type[SnapshotError], ...] = (
    SnapshotError,
    UsageError,
    IncompatibleHostError,
    ModelChangedError,
    CorruptSnapshotError,
    OracleMismatchError,
    CriuError,
    EngineError,
    BusyError,
    UnsnapshottableError,
    EnvironmentProblem,
    Interrupted,
    InsufficientResources,
    UntrustedArtifactError,
)
