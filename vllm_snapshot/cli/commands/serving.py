"""The commands that run engines: ``serve``, ``restore``, ``switch``, ``stop``, ``status``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ...errors import UsageError
from .. import common
from ..common import app, PASSTHROUGH, JSON_HELP, QUIET_DETACH_HELP, PORT_HELP, DRAIN_HELP, MERGE_PAGES_HELP
from ..helpformat import Command, EngineArgsCommand, FrontendCommand


@app.command(cls=Command)
def status(
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the engines' root PIDs, one per line (as `podman ps -q`)."),
) -> None:
    """Engines restored on this host: snapshot, PID, address, started, mode."""
    from ... import ops
    from .. import render

    common.root_only("status")
    render.show(ops.status(), as_json, quiet)



@app.command(cls=Command)
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
    from ... import ops
    from .. import render

    given = [w for w, x in (("a snapshot", snapshot), ("--port", port), ("--pid", pid)) if x is not None]
    if len(given) != 1:
        raise UsageError("give a snapshot, --port or --pid (exactly one of them"
                         + (f"; got {' and '.join(given)})" if given else "; got none)"),
                         hint="`vllm-snapshot status` lists the engines with their snapshot, port and PID")
    common.root_only("stop")
    render.show(ops.stop_engines(common.resolve(snapshot) if snapshot else None, port, pid=pid, drain_s=drain_timeout),
                as_json, quiet)



@app.command(context_settings=PASSTHROUGH, cls=EngineArgsCommand)
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
    merge_pages: bool = typer.Option(False, "--merge-pages", help=MERGE_PAGES_HELP),
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
    from ...supervise import frontend
    from ... import ops
    from .. import render
    from ...store import store

    common.root_only("switch")
    common.interruptible()
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    argv = common.STATE.get("argv") or []
    if model is not None and snapshot is not None and "--" in argv and snapshot in argv[argv.index("--") + 1:][:1]:
        # click filled the optional SNAPSHOT with the first engine arg after --
        engine_args, snapshot = [snapshot, *engine_args], None
    if snapshot is not None:
        common.not_an_option(snapshot, ctx, "SNAPSHOT")
    if (snapshot is None) == (model is None):
        raise UsageError("give a SNAPSHOT or --model MODEL (one of them, not both)")
    common.check_engine_arg_names(ctx, engine_args,
                                  usage=None if model is None else "switch --model MODEL --port P -- [engine args]")
    front, engine_args = frontend.split(engine_args)  # API key, TLS, CORS, ...: applied at restore
    common.drain(drain_timeout)  # a bad $VLLM_SNAPSHOT_DRAIN_TIMEOUT: a usage error before anything runs
    host = common.host_address(host, quiet or as_json)
    rep = common.reporter(quiet, as_json)
    if merge_pages:
        common.merge_pages_notice(rep)
    if model is None:
        if engine_args:
            raise UsageError(f"unexpected arguments {' '.join(engine_args)!r}: engine args go with --model MODEL",
                             hint="a snapshot's engine args are frozen at create; front-end options (API key, "
                                  "TLS, CORS, ...) are accepted after --")
        switched = ops.switch(common.resolve(snapshot), host, port, log_file, rep, rollback,
                              frontend=tuple(front), drain_s=drain_timeout, handover=handover, merge_pages=merge_pages)
        _handed_off()
        render.show(switched, as_json, quiet)
        return
    req = ops.ServeRequest(model=model, root=store.ensure_root(common.root_dir()), engine_args=engine_args, port=port,
                           log_file=log_file, build="never" if no_build else "auto", detach=True,
                           frontend=tuple(front), drain_s=common.drain(drain_timeout), merge_pages=merge_pages)
    switched, _path = ops.switch_model(req, host, rollback, rep, handover=handover)
    _handed_off()
    render.show(switched, as_json, quiet)



@app.command(context_settings=PASSTHROUGH, cls=FrontendCommand)
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
    merge_pages: bool = typer.Option(False, "--merge-pages", help=MERGE_PAGES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_DETACH_HELP),
) -> None:
    """Validate, restore with CRIU, check the oracle inside the engine, then serve the OpenAI
    API on HOST:PORT. SNAPSHOT may be an IMAGE (HOST[:PORT]/REPO[:TAG] or oci:DIR[:TAG]): it
    is pulled into the store first (as `pull`), unless the store holds that artifact already. Fails closed: on any mismatch nothing serves and nothing is left.
    Front-end options of `vllm serve` may follow (--api-key or VLLM_API_KEY, --ssl-keyfile/
    --ssl-certfile/--ssl-ca-certs, --allowed-origins/-methods/-headers, --root-path,
    --uvicorn-log-level, --enable-log-requests, ...); engine options are frozen in the snapshot."""
    from ... import ops
    from .. import render

    common.not_an_option(snapshot, ctx, "SNAPSHOT")
    common.root_only("restore")
    extra = list(ctx.args)  # front-end options: ops.restore checks them (frontend.check) before CRIU
    if extra and extra[0] == "--":
        extra = extra[1:]
    common.check_engine_arg_names(ctx, extra, usage=None)  # front-end options: judged by ops.restore
    common.interruptible()
    checks = common.UsageChecks()  # several bad options: all said in one run, before any phase starts
    with checks.one():
        _check_verify_model(verify_model)
    with checks.one():
        _check_log_file(log_file, detach)
    with checks.one():
        common.drain(drain_timeout)
    with checks.one():
        _check_allow_mismatch(allow_mismatch)
    with checks.one():
        host = common.host_address(host, quiet or as_json)
    with checks.one():  # what can be judged by the words alone (engine options, stray words, values)
        from ...engine.args import refuse_engine_options, values

        refuse_engine_options(extra)
        values(extra)
    checks.done()
    rep, lifecycle = _lifecycle_reporter(quiet, as_json)
    from ...fleet.reference import looks_like_image

    if looks_like_image(snapshot):
        from ...effects.tools import local_tools
        from ...ops import fleet

        snapshot_dir = fleet.ensure_pulled(fleet.PullRequest(snapshot, common.root_dir(), None, plain_http, verify_key),
                                           rep, local_tools())
    else:
        snapshot_dir = common.resolve(snapshot)
    req = ops.RestoreRequest(snapshot=snapshot_dir, host=host, port=port, detach=detach,
                             log_file=log_file, verify_model=verify_model,
                             allow=frozenset(allow_mismatch), engine_log=(log := ForegroundLog()), frontend=tuple(extra),
                             drain_s=common.drain(drain_timeout), merge_pages=merge_pages)
    if merge_pages:
        common.merge_pages_notice(rep)
    r, engine = ops.restore(req, rep)
    if detach:
        _handed_off()
    render.show(r, as_json, quiet)
    _run_engine(r, engine, rep, lifecycle, detach, quiet or as_json, log)



def _check_verify_model(verify_model: str) -> None:
    if verify_model not in ("quick", "full"):
        raise UsageError(f"--verify-model must be quick or full, not {verify_model!r}")


def _check_allow_mismatch(fields: List[str]) -> None:
    from ...host.identity import OVERRIDABLE

    bad = sorted(set(fields) - OVERRIDABLE)
    if bad:
        raise UsageError(f"--allow-mismatch cannot override {', '.join(bad)}: only {' and '.join(sorted(OVERRIDABLE))} may differ on "
                         "purpose", hint="anything else that differs needs a snapshot made on this host")


def _check_log_file(log_file: Optional[Path], detach: bool) -> None:
    if log_file is not None and not detach:
        raise UsageError("--log-file applies to --detach; in the foreground the engine log goes to stderr",
                         hint="add --detach, or redirect stderr (2>>FILE)")


def _lifecycle_reporter(quiet: bool, as_json: bool):
    """(reporter, systemd lifecycle): under systemd (NOTIFY_SOCKET) each phase is a STATUS=."""
    from ...host import notify
    from ...report.progress import NotifyingReporter

    rep = common.reporter(quiet, as_json)
    lifecycle = notify.ServiceLifecycle.from_env()
    if lifecycle.active:
        rep = NotifyingReporter(rep)  # STATUS=<phase> as each phase starts
    return rep, lifecycle


def _handed_off() -> None:
    """A detached engine serves and is registered: from here on SIGINT/SIGTERM/SIGHUP no longer
    interrupt the command (it only prints and returns; exit 0). Before, a Ctrl-C in that last
    moment exited 130 -- "interrupted, cleaned up" -- while the engine went on serving."""
    import signal

    from ...host import interrupts

    if common.STATE.get("interruptible"):  # the real command (an in-process call keeps its handlers)
        for s in interrupts.SIGNALS:
            signal.signal(s, signal.SIG_IGN)


class ForegroundLog:
    """The engine log of a foreground restore/serve, onto stderr (``sink``), less the engine's own
    line about each signal this command forwarded to it: the command names the signal it
    received (a Ctrl-C: SIGINT) and what happens, and the engine's line would name the SIGTERM
    it was sent -- two lines, two signals, for one Ctrl-C. A signal sent to the engine by anyone
    else (``stop``, ``kill``) keeps the engine's line."""

    def __init__(self, sink=common.stderr_sink) -> None:
        self.sink = sink
        self.forwarded = 0  # signals forwarded whose engine line has not come yet

    def said(self) -> None:
        """This command has said that it received a signal and forwards it to the engine."""
        self.forwarded += 1

    def __call__(self, chunk: bytes) -> None:
        if self.forwarded:
            from ...engine.protocol import SIGNAL_LINE

            chunk, n = SIGNAL_LINE.subn(b"", chunk, count=self.forwarded)
            self.forwarded -= n
            if not chunk:
                return
        self.sink(chunk)


def _run_engine(r, engine, rep, lifecycle, detach: bool, silent: bool = False, log: ForegroundLog | None = None) -> None:
    """After a restore: detached -> return; foreground -> READY=1, serve until the engine
    exits (SIGINT/SIGTERM/SIGHUP stop it), exit with its code; an engine that dies by itself
    raises EngineError (exit 8, see ``ops.serve_foreground``). The line naming the signal the
    command received is printed on stderr even when ``silent`` (``-q``/``--json``: the
    reporter prints nothing), so a log or the journal says what stopped the engine; ``log``
    (the engine log's sink) then leaves out the engine's own line about it."""
    from ... import ops

    if detach:
        engine.close()
        return
    # READY only now (oracle matched, port bound, canary passed); STOPPING on shutdown
    lifecycle.ready(f"serving {r.served_name} on {r.url}")

    def on_signal(msg: str) -> None:
        lifecycle.stopping()
        if log is not None:  # one line for the signal: this one; the engine's echo is left out
            log.said()
        if silent:
            print(f"vllm-snapshot: {msg}", file=sys.stderr, flush=True)
        else:
            rep.info(msg)

    try:
        code = ops.serve_foreground(r, engine, on_signal)
    finally:
        lifecycle.stopping()  # once: a no-op when a signal already said so
    raise typer.Exit(code)



@app.command(context_settings=PASSTHROUGH, cls=EngineArgsCommand)
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
    weights: str = typer.Option("auto", "--weights", help="auto (file on CPU, in-image on GPU) | file (a build's weights in a weights file shared by snapshots of the same weights: mapped on CPU, the level-2 wake's source on a GPU) | in-image (part of the key)"),
    keep_env: List[str] = typer.Option([], "--keep-env", help="Pass this (otherwise scrubbed) variable to the engine."),
    user: str = typer.Option("vllm-snapshot", "--user", help="Unprivileged user a build's engine tree runs as (its HOME is part of the key)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the engine log of a build to stderr."),
    drain_timeout: Optional[float] = typer.Option(None, "--drain-timeout", min=0, help=DRAIN_HELP),
    registry: Optional[str] = typer.Option(None, "--registry", help="HOST[:PORT]/REPO (or oci:DIR): the snapshot key "
                                           "is the tag; pull it when this node has none, push one built here."),
    plain_http: bool = typer.Option(False, "--plain-http", help="--registry: HTTP to a registry on loopback."),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", help="--registry: sign what is pushed (PEM EC P-256)."),
    verify_key: Optional[Path] = typer.Option(None, "--verify-key", help="--registry: pull only what this key signed."),
    merge_pages: bool = typer.Option(False, "--merge-pages", help=MERGE_PAGES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (which path, timings)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_DETACH_HELP),
) -> None:
    """Like `vllm serve MODEL [engine args]`: restore the snapshot made for exactly this model,
    these args and this host class (the key); if there is none or it is refused, pull it from
    --registry when given and this node fits, else build one (cold start, oracle, dump) and
    restore that (and push it to --registry). The port is bound only after the oracle matched."""
    from ...engine.args import pop_option
    from ...store import archive, oracle, store
    from ...supervise import frontend
    from ... import ops
    from .. import render

    common.not_an_option(model, ctx, "MODEL")
    common.root_only("serve")
    common.interruptible()
    checks = common.UsageChecks()  # several bad options: all said in one run
    if no_build and rebuild:
        with checks.one():
            raise UsageError("--no-build and --rebuild contradict each other")
    from ...ops.create import weights_mode

    with checks.one():
        weights_mode(weights, "cpu")  # a bad --weights now, not after the key
    with checks.one():
        _check_verify_model(verify_model)
    with checks.one():
        _check_log_file(log_file, detach)
    with checks.one():
        archive.Compression.parse(compress)
    if oracle_prompt is not None:
        from ...ops.create import check_oracle_prompt

        with checks.one():
            check_oracle_prompt(oracle_prompt)
    if registry is None and (plain_http or sign_key or verify_key):
        with checks.one():
            raise UsageError("--plain-http, --sign-key and --verify-key apply to --registry")
    with checks.one():
        common.drain(drain_timeout)
    checks.done()
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    common.check_engine_arg_names(ctx, engine_args)
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
    host = common.host_address(h if h is not None else host, quiet or as_json)
    if p is not None:
        if not p.isdigit() or not 1 <= int(p) <= 65535:
            raise UsageError(f"--port {p!r}: expected a port number 1-65535")
        port = int(p)
    from ...report.progress import LastLine

    rep, lifecycle = _lifecycle_reporter(quiet, as_json)
    cache = None
    if registry is not None:
        from ...effects.tools import local_tools
        from ...ops.fleet import RegistryCache

        cache = RegistryCache(registry, local_tools(), rep, plain_http, sign_key, verify_key)
    req = ops.ServeRequest(
        model=model, root=store.ensure_root(common.root_dir()), engine_args=engine_args, host=host, port=port,
        detach=detach, log_file=log_file, verify_model=verify_model,
        build="never" if no_build else "always" if rebuild else "auto",
        oracle_prompt=oracle.DEFAULT_PROMPT if oracle_prompt is None else oracle_prompt, sleep_level=sleep_level,
        compression=archive.Compression.parse(compress), keep_env=tuple(keep_env), user=user,
        engine_log=(log := ForegroundLog()), create_log=common.stderr_sink if verbose else LastLine(rep.detail), frontend=tuple(front),
        drain_s=common.drain(drain_timeout), registry=cache, weights=weights, merge_pages=merge_pages)
    if merge_pages:
        common.merge_pages_notice(rep)
    served, engine = ops.serve(req, rep)
    if detach:
        _handed_off()
    render.show(served, as_json, quiet)
    _run_engine(served.restored, engine, rep, lifecycle, detach, quiet or as_json, log)

