"""What the commands share: the typer ``app`` they register on, the state the group's options set
(:data:`STATE`), option help texts, and helpers (the snapshot root, NAME -> directory, root
only, reporters, checks of engine args)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError, q

app = typer.Typer(
    name="vllm-snapshot",
    help="Checkpoint an initialized vLLM engine with CRIU and restore it in seconds, safely.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain click help: the rich help renderer imports markdown-it and costs ~0.2 s per call
    rich_markup_mode=None,
    # -h as well, like `vllm serve -h` (every command inherits it from the group's context)
    context_settings={"help_option_names": ["-h", "--help"]},
)

STATE: dict = {"debug": False, "json": False, "root": None, "interruptible": False}
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
JSON_HELP = "Print the result as stable JSON (schema_version 1) on stdout."
QUIET_HELP = "No progress or result lines; errors still go to stderr."
#: -q of the commands that can start a detached engine
QUIET_DETACH_HELP = QUIET_HELP[:-1] + " (a detached engine's PID still goes to stdout)."
PORT_HELP = "TCP port to serve on (bound only after the oracle matched)."
DRAIN_HELP = ("Seconds the engine lets requests in flight finish when it is stopped (SIGTERM, `stop`, "
              "`switch`): it takes no new connection meanwhile. Default $VLLM_SNAPSHOT_DRAIN_TIMEOUT, else 30.")
MERGE_PAGES_HELP = ("Restore the engine's memory KSM-mergeable (prctl PR_SET_MEMORY_MERGE): clones of one snapshot "
                    "then share their identical pages when the host runs KSM (/sys/kernel/mm/ksm/run = 1). "
                    "Off by default: KSM merges host-wide, a timing side channel; use it only where every "
                    "process on the host is trusted.")


def drain(given: Optional[float]) -> float:
    """``--drain-timeout`` or ``$VLLM_SNAPSHOT_DRAIN_TIMEOUT`` or the default (seconds)."""
    from ..store.registry import drain_timeout

    return drain_timeout(given)


def root_dir() -> Path:
    """The snapshot root (``--root``, ``$VLLM_SNAPSHOT_ROOT``, the default). Raises UsageError
    when it exists and is not a directory (every command: a file as --root made restore say
    "NAME does not exist" and prune "nothing to prune")."""
    from .. import paths

    root = paths.snapshot_root(STATE["root"])
    if os.path.lexists(root) and not root.is_dir():
        raise UsageError(f"the snapshot root {root} is not a directory", hint="check --root / VLLM_SNAPSHOT_ROOT")
    return root


def system_root_note() -> str | None:
    """For a user other than root on the default (per-user) root: where root's snapshots are and
    that reading them needs sudo -- or None (root, ``--root``/``$VLLM_SNAPSHOT_ROOT`` given, or
    root has no snapshot root). A trial's non-root ``list`` said "no snapshots" while root had three."""
    from .. import paths

    if os.geteuid() == 0 or STATE["root"] is not None or os.environ.get("VLLM_SNAPSHOT_ROOT"):
        return None
    if not os.path.isdir(paths.DEFAULT_ROOT):
        return None
    return f"root's snapshots are in {paths.DEFAULT_ROOT}, which only root can read"


def resolve(ref: str) -> Path:
    """A snapshot NAME (under the root) or PATH -> its directory. A name or path that names no
    snapshot but a model (a model directory, or a model's name) selects that model's one snapshot
    under the root (saying so on stderr); several are a UsageError listing them. A name that
    names nothing is a UsageError with close names ("did you mean"), or -- for a user other than
    root -- an EnvironmentProblem saying where root's snapshots are."""
    from ..errors import EnvironmentProblem
    from ..store import layout, store
    from . import suggest

    root = root_dir()
    path = store.resolve(ref, root)
    try:
        if (path / layout.MANIFEST).exists() or (path.exists() and not (path / "config.json").exists()):
            return path  # a snapshot, or something else that is not a model: judged by the command
    except OSError:  # not readable by this user: the command says so
        return path
    is_path = "/" in ref or ref in (".", "..")
    snaps = store.list_snapshots(root) if os.access(root, os.R_OK | os.X_OK) else []
    of_model = suggest.snapshots_of_model(ref, snaps)
    if len(of_model) == 1:
        print(f"[vllm-snapshot] {ref} is a model, not a snapshot: using its snapshot {of_model[0].name}",
              file=sys.stderr, flush=True)
        return of_model[0]
    if len(of_model) > 1:
        raise UsageError(f"{ref} is the model of {len(of_model)} snapshots under {root}: "
                         + ", ".join(p.name for p in of_model), hint="name one of them (`vllm-snapshot list` shows them)")
    if is_path:
        return path  # the command says what is wrong with it
    note = system_root_note()
    if note is not None:
        raise EnvironmentProblem(f"snapshot {ref!r} does not exist in your own store {root}; {note}",
                                 hint=f"run it with sudo (sudo vllm-snapshot ... {q(ref)})")
    hint = suggest.did_you_mean(ref, [p.name for p in snaps])
    # plain `list` shows the root of $VLLM_SNAPSHOT_ROOT or the default; one given as --root, not
    from .. import paths

    lister = "vllm-snapshot list" if paths.snapshot_root(None) == root else f"vllm-snapshot --root {q(root)} list"
    raise UsageError(f"snapshot {ref!r} does not exist under {root}",
                     hint=hint or f"`{lister}` shows the snapshots there (a name means ROOT/NAME)")


def root_only(what: str) -> None:
    """Commands that need root say so with the documented exit code (11), not with a
    permission error halfway through or an empty answer."""
    from ..host.privilege import require_root

    require_root(what)


def interruptible() -> None:
    """SIGINT/SIGTERM/SIGHUP -> Interrupted (exit 130) after every cleanup ran. Installed by
    ``main`` for the real command; create/restore/switch/demo make sure of it."""
    from ..host import interrupts

    if STATE.get("interruptible"):
        interrupts.install()


def merge_pages_notice(rep, state=None) -> None:
    """For ``--merge-pages``: tell ``rep`` (info) when KSM does not run on this host, so the
    mark merges nothing yet. ``state``: a :class:`~vllm_snapshot.checkpoint.criu.merge.KsmState`
    (default: read from /sys/kernel/mm/ksm)."""
    from ..checkpoint.criu.merge import ksm_state

    state = ksm_state() if state is None else state
    if state.run is not None and not state.running:
        rep.info(f"--merge-pages: KSM is not running on this host (/sys/kernel/mm/ksm/run = {state.run}): the "
                 "engine's memory is marked mergeable, but nothing is merged until run = 1")


def reporter(quiet: bool, as_json: bool):
    from ..report.progress import make_reporter

    return make_reporter(quiet or as_json)


def host_address(host: str | None, quiet: bool) -> str | None:
    """``--host`` as the one address it stands for (:func:`vllm_snapshot.host.ports.resolve_host`:
    a name such as ``localhost`` is resolved here, once, and the line says which address is
    bound, unless ``quiet``); None stays None. Raises UsageError for a name that does not
    resolve to an address of this host."""
    if host is None:
        return None
    from ..host.ports import resolve_host

    addr = resolve_host(host)
    if addr != host and not quiet:
        print(f"[vllm-snapshot] --host {host}: binding {addr} (the address {host} resolves to here)",
              file=sys.stderr, flush=True)
    return addr


def stderr_sink(b: bytes) -> None:
    try:
        sys.stderr.buffer.write(b)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


def own_options(ctx: typer.Context) -> list[str]:
    """Every option name of the running command (``--port``, ``-q``, ``--no-rollback``)."""
    return [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]


def not_an_option(value: str, ctx: typer.Context, what: str) -> None:
    """Refuse an unknown option that click, which passes unknown options through to vLLM here,
    took for the positional ``what`` (``restore --prot 8603 NAME``: "--prot" as the snapshot).
    Raises UsageError with the closest of the command's own options and vLLM's."""
    argv = STATE.get("argv") or []
    head = argv[:argv.index("--")] if "--" in argv else argv
    if not value.startswith("-") or value == "-" or value not in head:  # after --: a positional
        return
    from ..engine.args import flag_name
    from ..store import argnames
    from ..suggest import did_you_mean

    own = own_options(ctx)
    options = argnames.known_options() or frozenset()
    if what == "MODEL" and value not in own and options and argnames.unknown_flags([value], options) == []:
        # `serve --dtype float32 MODEL`: vLLM's parser takes that order, our command line does not
        raise UsageError(f"{value} is a vLLM engine arg given before {what}: {what} goes first here",
                         hint=f"vllm-snapshot {ctx.command.name} {what} {value} ... (engine args after {what})")
    guess = did_you_mean(flag_name(value), set(own) | options)
    raise UsageError(f"no such option: {value} (where {what} was expected)",
                     hint=guess or f"`vllm-snapshot {ctx.command.name} --help` lists the options")


def check_engine_arg_names(ctx: typer.Context, engine_args: list[str], load: bool = False, quiet: bool = True,
                           usage: str | None = "") -> None:
    """Refuse, in milliseconds, an engine arg that is no option of vLLM's (nor of this command),
    with "did you mean" (:mod:`vllm_snapshot.store.argnames`), and -- unless ``usage`` is None
    (restore: front-end options only, judged by their own check) -- an abbreviated engine arg
    (``--kv-cache-memory-byte``: our rules read whole names) and a stray word among them
    (``serve MODEL --dtype float32 extra``: vLLM would load "extra" as the model), all in one
    error, ``usage``
    being the command's synopsis for the hint ("" for ``COMMAND MODEL [engine args]``). vLLM's
    option names and arities come from the cache setup wrote; when it is missing: with
    ``load`` (create) they are read from vLLM's parser now (~20 s, once per vLLM version), else
    vLLM's parse checks the args later."""
    from ..store import argnames

    if not engine_args:
        return
    phase = "reading vLLM's engine arg names (once per vLLM version)"
    options = argnames.known_options()
    if options is None and load:
        with reporter(quiet, False).phase("engine_arg_names", phase):
            options = argnames.known_options(load=True)
    found: list[UsageError] = []
    try:
        argnames.check(engine_args, own_options(ctx), ctx.command.name, options)  # a typo first: no parse for it
    except UsageError as e:
        if usage is None:
            raise
        found.append(e)
    if usage is None:
        return
    unknown = bool(found)
    found += argnames.abbreviation_errors(engine_args, options)  # vLLM's parser would take them; our rules not
    arity = argnames.known_arities()
    if arity is None and load:  # a file an older setup wrote: the names without their arities
        with reporter(quiet, False).phase("engine_arg_names", phase):
            arity = argnames.known_arities(load=True)
    try:
        if not unknown:  # after an unknown option its value would read as a stray word too
            argnames.check_stray_words(engine_args, ctx.command.name, arity, usage or None)
    except UsageError as e:
        found.append(e)
    if found:
        from ..errors import combined

        raise combined(found)


class UsageChecks:
    """The checks of one command line, each in ``with checks.one():``: a UsageError in one is
    kept and the next one still runs; :meth:`done` raises them all as one
    (:func:`vllm_snapshot.errors.combined`, exit 2), so several bad options are said in one run,
    not one per run."""

    def __init__(self) -> None:
        self.found: list = []

    def one(self):
        """A context in which a UsageError is kept instead of raised."""
        import contextlib

        @contextlib.contextmanager
        def kept():
            try:
                yield
            except UsageError as e:
                self.found.append(e)

        return kept()

    def done(self) -> None:
        """Raise what was kept (the first one's message first, then the others), if anything."""
        if self.found:
            from ..errors import combined

            raise combined(self.found)
