"""The ``vllm-snapshot`` command line (typer). The ONLY place errors become exit codes.

The entry: the group's own options (``--root``, ``--debug``, ``--version``), the order
``--help`` lists the commands in, and :func:`main`. The commands live in
:mod:`vllm_snapshot.cli.commands` (by job) and register on :data:`app`
(:mod:`vllm_snapshot.cli.common`); their help's layout is :mod:`vllm_snapshot.cli.helpformat`.

Heavy modules (torch, vllm, pycriu) are imported inside the commands that need them, so
``--help`` and ``inspect`` stay fast.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import SnapshotError, UsageError
from . import common
from .commands import fleet, host, serving, snapshots  # noqa: F401 (importing them registers their commands on app)
from .common import app
from .helpformat import METAVARS, PANELS, human_help as _human_help  # noqa: F401 (as before the split)

_STATE = common.STATE


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"vllm-snapshot {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    root: Optional[Path] = typer.Option(None, "--root", envvar="VLLM_SNAPSHOT_ROOT", readable=False,
                                        help="Where named snapshots live (default /var/lib/vllm-snapshot as root)."),
) -> None:
    _STATE["debug"] = debug
    _STATE["root"] = root


#: the order `--help` lists the commands in: the everyday ones first
COMMAND_ORDER = ("serve", "restore", "stop", "status", "switch", "list", "inspect", "create", "verify", "delete",
                 "prune", "push", "pull", "doctor", "demo")
app.registered_commands.sort(key=lambda c: COMMAND_ORDER.index(c.name or c.callback.__name__.removesuffix("_cmd")))


def main_error(e: SnapshotError) -> int:
    """Report ``e`` (one ``error [code]: message`` block + ``hint:`` on stderr, or the JSON
    error object with ``--json``); return its exit code."""
    if _STATE["json"]:
        from .render import emit_json

        emit_json({"error": e.to_json()})
    else:
        _error_lines(f"error [{e.code}]", e.message, e.hint)
    return e.exit_code


def _error_lines(head: str, message: str, hint: str | None) -> None:
    """``HEAD: message`` and ``hint: ...`` on stderr; the words ``error``/``hint`` in colour on
    a terminal (not with ``$NO_COLOR``), plain in a log or a pipe."""
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    red, yellow, off = ("\x1b[1;31m", "\x1b[33m", "\x1b[0m") if color else ("", "", "")
    print(f"{red}{head}{off}: {message}", file=sys.stderr)
    if hint:
        print(f"{yellow}hint{off}: {hint}", file=sys.stderr)


def _subcommand(argv: list[str]) -> str | None:
    """The command ``argv`` names after the group's own options (``--debug``, ``--root V``),
    or None (no command, ``--help``, an unknown option or name)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--debug" or a.startswith("--root="):
            i += 1
        elif a == "--root":
            i += 2
        elif a.startswith("-"):
            return None
        else:
            return a
    return None


def _click_command(argv: list[str]):
    """The click command that runs ``argv``. typer builds every command's parameters when it
    makes the group (~10 ms of ``inspect``'s start-up, whose budget is 0.3 s); when ``argv`` names
    a command only that one is built, in a group that is otherwise the same (its options,
    callback and settings). The group's own help, no arguments and an unknown name get the
    whole group (its help lists every command; click suggests names)."""
    name = _subcommand(argv)
    only = [c for c in app.registered_commands
            if name is not None and (c.name or typer.main.get_command_name(c.callback.__name__)) == name]
    if not only:
        cmd = typer.main.get_command(app)
    else:
        one = copy.copy(app)  # shares the callback and settings; app itself is left whole
        one.registered_commands = only
        cmd = typer.main.get_command(one)
    _human_help(cmd)
    return cmd


GLOBAL_OPTIONS = ("--root", "--debug")


def _global_options_first(argv: list[str]) -> None:
    """Refuse a global option written after the command (``restore NAME --root DIR``): it was
    taken as an engine option, or the snapshot was looked up under the default root. Raises
    UsageError naming the right place."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    cmd_at = next((i for i, a in enumerate(head) if not a.startswith("-")
                   and not (i and head[i - 1] == "--root")), None)
    if cmd_at is None:
        return
    for a in head[cmd_at + 1:]:
        opt = a.split("=", 1)[0]
        if opt in GLOBAL_OPTIONS:
            raise UsageError(f"{opt} is an option of vllm-snapshot itself: put it before the command",
                             hint=f"vllm-snapshot {opt} ... {head[cmd_at]} ...")


def _after_signal(e: SnapshotError, sig: SnapshotError | None) -> SnapshotError:
    """The error to report: ``e``, or -- when a signal came first (``sig``, an Interrupted) --
    the interruption, saying what ``e`` was: a terminal's Ctrl-C reaches the whole foreground
    process group, CRIU and the engine included, so their failure is the signal's doing and the
    command has cleaned up as for any interruption (exit 130, not the CRIU/engine code)."""
    from ..errors import Interrupted

    if sig is None or isinstance(e, Interrupted):
        return e
    lines = e.message.splitlines() if e.message else [type(e).__name__]
    first = lines[0]
    if first.endswith("log excerpt:"):  # CRIU's message: the excerpt is on the next lines, not here
        errors = [re.sub(r"^\(\s*[\d.]+\)\s*", "", ln.strip()) for ln in lines[1:] if "Error" in ln]  # no timestamp
        first = first.removesuffix("log excerpt:").rstrip("; ")
        first += f" ({errors[0]})" if errors else (f" (its log: {e.details['log']})"
                                                   if isinstance(e.details, dict) and e.details.get("log") else "")
    return Interrupted(f"{sig.message} (the signal reached its child processes too; what they reported: {first})",
                       hint=e.hint, details={**(sig.details or {}), "then": {"code": e.code, "message": e.message}})


def unknown_option(option: str, command, cmd_name: str) -> tuple[str, str]:
    """``(message, hint)`` for an option ``command`` (a click command) does not have: "did you
    mean" its closest option when there is one, else every option it has (click's own "Possible
    options" named only the close ones: ``list --keep`` got "--help" alone). Pure."""
    from ..suggest import did_you_mean

    opts = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    opts += [] if "--help" in opts else ["--help"]  # click adds it outside the params
    guess = did_you_mean(option, opts)
    listed = ", ".join(sorted(opts, key=lambda o: (o.lstrip("-").lower(), o)))
    return f"no such option: {option}", (f"{guess} (`{cmd_name}` takes {listed})" if guess
                                          else f"`{cmd_name}` takes {listed}; `{cmd_name} --help` says what they do")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the app, map errors to exit codes (see errors.py)."""
    try:  # typer >= 0.29 vendors its own click
        from typer._click import exceptions as click_exc
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click import exceptions as click_exc

    from ..host import interrupts

    # the real command installs the signal handlers (an in-process call from a test or a
    # library keeps its own)
    _STATE["interruptible"] = argv is None
    if argv is None:
        argv = sys.argv[1:]
        interrupts.install()  # from the first moment: SIGTERM during start-up exits 130 too
    interrupts.reset()
    _STATE["argv"] = list(argv)
    _STATE["json"] = "--json" in (argv[:argv.index("--")] if "--" in argv else argv)  # after --: vLLM's
    cmd = _click_command(argv)
    try:
        _global_options_first(argv)
        rv = cmd.main(args=argv, prog_name="vllm-snapshot", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        return 130
    except click_exc.NoArgsIsHelpError as e:  # no command: the help, as git/podman print it, not an error line
        print(e.format_message(), file=sys.stderr)  # where click puts it: stdout stays empty for a script
        return e.exit_code  # 2, click's (a command is missing)
    except click_exc.ClickException as e:
        cmd_name = getattr(getattr(e, "ctx", None), "command_path", None) or "vllm-snapshot"
        msg = e.format_message()
        what = "commands" if "command" in msg.lower() else "options and arguments"
        hint = f"`{cmd_name} --help` lists the {what}"
        if isinstance(e, click_exc.NoSuchOption) and getattr(e, "ctx", None) is not None:
            msg, hint = unknown_option(e.option_name, e.ctx.command, cmd_name)
        if _STATE["json"]:
            from .render import emit_json

            emit_json({"error": {"code": "usage", "exit_code": e.exit_code, "message": msg,
                                 "hint": hint, "details": None}})
        else:  # click's own errors (an unknown option, a missing argument) in our format
            _error_lines("error [usage]", msg[:1].lower() + msg[1:], hint)
        return e.exit_code
    except SnapshotError as e:
        if _STATE["debug"]:
            import traceback

            traceback.print_exc()
        return main_error(_after_signal(e, interrupts.fired()))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, traceback with --debug
        if type(e).__name__ == "PipeClosed":  # render.PipeClosed (`list | head -1`): not an internal error
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            except OSError:
                pass
            return 141  # 128 + SIGPIPE, what a shell reports for a program its pipe closed on
        from ..host.interrupts import fired

        if fired() is not None and not _STATE["debug"]:
            return main_error(fired())  # a signal surfaced as another exception (cleanup ran)
        from ..errors import from_os_error

        host = from_os_error(e) if isinstance(e, OSError) else None
        if host is not None:  # the host's filesystem refused (full, read-only, busy, denied): exit 11
            if _STATE["debug"] or "--debug" in argv:
                import traceback

                traceback.print_exc()
            return main_error(host)
        if _STATE["debug"] or "--debug" in argv:
            raise
        print(f"error [internal]: {type(e).__name__}: {e}\nhint: re-run with --debug for a traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
