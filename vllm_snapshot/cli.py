"""The ``vllm-snapshot`` command line (typer). The ONLY place errors become exit codes.

Heavy modules (torch, vllm, pycriu) are imported inside the commands that need them, so
``--help`` and ``inspect`` stay fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import SnapshotError, UsageError

app = typer.Typer(
    name="vllm-snapshot",
    help="Checkpoint an initialized vLLM engine with CRIU and restore it in seconds, safely.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_STATE = {"debug": False, "json": False}
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    _STATE["debug"] = debug


def _reporter(quiet: bool, as_json: bool):
    from .progress import make_reporter

    return make_reporter(quiet or as_json)


def _stderr_sink(b: bytes) -> None:
    try:
        sys.stderr.buffer.write(b)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


@app.command(context_settings=PASSTHROUGH)
def create(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Local model directory (or a Hugging Face id already in the local cache)."),
    snapshot_dir: Path = typer.Option(..., "--snapshot-dir", help="Where to publish the snapshot; must not exist."),
    oracle_prompt: str = typer.Option(None, "--oracle-prompt", help="Prompt of the one-token oracle."),
    sleep_level: int = typer.Option(2, "--sleep-level", min=0, max=2, help="GPU: sleep level before the dump (CPU engines are captured whole)."),
    compress: str = typer.Option("zstd:3", "--compress", help="none | zstd | zstd:LEVEL"),
    keep_env: List[str] = typer.Option([], "--keep-env", help="Pass this (otherwise scrubbed) variable to the engine."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the engine log to stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Start an engine on MODEL offline, record its oracle, dump it with CRIU. Extra
    arguments (optionally after --) are `vllm serve` engine args, checked by vLLM's parser."""
    from . import archive, ops, oracle, render

    engine_args = [a for a in ctx.args]
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    req = ops.CreateRequest(
        model=model, target=snapshot_dir, engine_args=engine_args,
        oracle_prompt=oracle_prompt or oracle.DEFAULT_PROMPT, sleep_level=sleep_level,
        compression=archive.Compression.parse(compress), keep_env=tuple(keep_env),
        engine_log=_stderr_sink if verbose else None)
    rep = _reporter(quiet, as_json)
    m = ops.create(req, rep)
    if as_json:
        render.emit_json({"snapshot": str(snapshot_dir.absolute()), "manifest": m.model_dump(mode="json")})
    elif not quiet:
        raw, stored = m.sizes["raw"], m.sizes["stored"]
        typer.echo(f"snapshot {snapshot_dir} created: oracle {m.oracle.text!r} (token {m.oracle.token_id}), "
                   f"images {render.human_bytes(raw)} raw, {render.human_bytes(stored)} stored, "
                   f"{sum(m.timings.values()):.1f} s")


@app.command()
def inspect(
    snapshot_dir: Path = typer.Argument(..., help="Snapshot directory."),
    as_json: bool = typer.Option(False, "--json", help="Stable JSON instead of tables."),
) -> None:
    """Show a snapshot's manifest: versions, model, engine args, oracle, sizes, timings."""
    from . import manifest, render

    m = manifest.read(snapshot_dir)
    if as_json:
        render.emit_json({"snapshot": str(snapshot_dir.absolute()), "manifest": m.model_dump(mode="json")})
    else:
        render.manifest_table(m, str(snapshot_dir))


@app.command()
def verify(
    snapshot_dir: Path = typer.Argument(..., help="Snapshot directory."),
    allow_mismatch: List[str] = typer.Option([], "--allow-mismatch", help="Identity field to tolerate (machine_id, cpu_model)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Every restore check without restoring: permissions, manifest, host identity, all
    image checksums, and a full re-hash of the model files."""
    from . import ops, render

    m, warnings = ops.validate(snapshot_dir, "full", frozenset(allow_mismatch), check_images=True)
    if as_json:
        render.emit_json({"snapshot": str(snapshot_dir.absolute()), "ok": True, "warnings": warnings})
    else:
        for w in warnings:
            typer.echo(f"warning: {w}", err=True)
        typer.echo(f"{snapshot_dir}: OK ({len(m.images)} images, {len(m.model.files)} model files verified)")


@app.command()
def restore(
    snapshot_dir: Path = typer.Argument(..., help="Snapshot directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on (bound only after the oracle matched)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    detach: bool = typer.Option(False, "--detach", help="Return once serving; print the engine PID."),
    log_file: Optional[Path] = typer.Option(None, "--log-file", help="With --detach: engine log file (default /var/log/vllm-snapshot/NAME-PORT.log)."),
    verify_model: str = typer.Option("quick", "--verify-model", help="quick (re-hash files whose stat changed) | full"),
    allow_mismatch: List[str] = typer.Option([], "--allow-mismatch", help="Identity field to tolerate (machine_id, cpu_model)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
) -> None:
    """Validate, restore with CRIU, check the oracle inside the engine, then serve the OpenAI
    API on HOST:PORT. Fails closed: on any mismatch nothing serves and nothing is left."""
    from . import ops, render

    if verify_model not in ("quick", "full"):
        raise UsageError("--verify-model must be quick or full")
    rep = _reporter(quiet, as_json)
    req = ops.RestoreRequest(snapshot=snapshot_dir, host=host, port=port, detach=detach,
                             log_file=log_file, verify_model=verify_model,
                             allow=frozenset(allow_mismatch),
                             engine_log=None if detach else _stderr_sink)
    r = ops.restore(req, rep)
    result = {"snapshot": str(snapshot_dir.absolute()), "pid": r.pid, "url": r.url,
              "timings": r.timings, "warnings": r.warnings, "oracle": "match"}
    if as_json:
        render.emit_json(result)
    elif not quiet:
        rep.info(f"serving {r.manifest.model.served_name} at {r.url} (engine PID {r.pid}); "
                 f"restore took {sum(r.timings.values()):.2f} s")
    if detach:
        if not as_json:
            typer.echo(r.pid)
        r.handle.close()
        return
    code = ops.serve_foreground(r, rep.info)
    raise typer.Exit(code)


@app.command()
def demo(
    snapshot_dir: Optional[Path] = typer.Option(None, "--snapshot-dir", help="Default: /var/lib/vllm-snapshot/demo-tiny-llama"),
    port: int = typer.Option(0, "--port", help="0 = pick a free port."),
    skip_cold: bool = typer.Option(False, "--skip-cold", help="Do not measure a cold start for comparison."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """On the embedded tiny model: create a snapshot if none exists, measure a cold start,
    restore, send one completion, print timings and the comparison, stop the engine."""
    from . import demo as demo_mod

    demo_mod.run(snapshot_dir, port, skip_cold, as_json)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the app, map errors to exit codes (see errors.py)."""
    try:  # typer >= 0.29 vendors its own click
        from typer._click import exceptions as click_exc
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click import exceptions as click_exc

    argv = sys.argv[1:] if argv is None else argv
    _STATE["json"] = "--json" in argv
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name="vllm-snapshot", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return 130
    except click_exc.ClickException as e:
        e.show()
        return e.exit_code
    except SnapshotError as e:
        if _STATE["debug"]:
            import traceback

            traceback.print_exc()
        if _STATE["json"]:
            from .render import emit_json

            emit_json({"error": e.to_json()})
        else:
            msg = e.message
            print(f"error [{e.code}]: {msg}", file=sys.stderr)
            if e.hint:
                print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, traceback with --debug
        if _STATE["debug"] or "--debug" in argv:
            raise
        print(f"error [internal]: {type(e).__name__}: {e}\nhint: re-run with --debug for a traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
