"""The commands on snapshots: ``create``, ``inspect``, ``verify``, ``list``, ``delete``, ``prune``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ...errors import UsageError
from .. import common
from ..common import app, PASSTHROUGH, JSON_HELP
from ..helpformat import Command, EngineArgsCommand


@app.command(context_settings=PASSTHROUGH, cls=EngineArgsCommand)
def create(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Local model directory (or a Hugging Face id already in the local cache)."),
    snapshot_dir: Optional[Path] = typer.Option(None, "--snapshot-dir", help="Where to publish the snapshot (a path); must not exist."),
    name: Optional[str] = typer.Option(None, "--name", help="Store under the snapshot root with this name (default: the model directory's name)."),
    oracle_prompt: str = typer.Option(None, "--oracle-prompt", help="Prompt of the one-token oracle."),
    sleep_level: int = typer.Option(2, "--sleep-level", min=0, max=2, help="GPU: sleep level before the dump (CPU engines are captured whole)."),
    compress: str = typer.Option("none", "--compress", help="none (default: fastest restore) | zstd | zstd:LEVEL (~5x smaller, restore decompresses)"),
    weights: str = typer.Option("auto", "--weights", help="auto (file on CPU, in-image on GPU) | file (a weights file shared by snapshots of the same weights: on CPU the engine maps it and the images do not hold the weights; on a GPU the level-2 wake copies the weights back from it instead of reloading the model files) | in-image"),
    keep_env: List[str] = typer.Option([], "--keep-env", help="Pass this (otherwise scrubbed) variable to the engine."),
    user: str = typer.Option("vllm-snapshot", "--user", help="Unprivileged user the engine tree runs as (no capabilities; made by setup)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Stream the engine log to stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Start an engine on MODEL offline, record its oracle, dump it with CRIU. Extra
    arguments (optionally after --) are `vllm serve` engine args, checked by vLLM's parser."""
    from ...store import archive, oracle, store
    from ... import ops
    from .. import render

    common.not_an_option(model, ctx, "MODEL")
    common.root_only("create")
    common.interruptible()
    engine_args = list(ctx.args)
    if engine_args and engine_args[0] == "--":
        engine_args = engine_args[1:]
    common.check_engine_arg_names(ctx, engine_args, load=True, quiet=quiet or as_json)
    if snapshot_dir is not None and name is not None:
        raise UsageError("give --snapshot-dir PATH or --name NAME, not both")
    if name is not None and not store.valid_name(name):
        raise UsageError(f"--name {name!r} is not a valid snapshot name: use {store.NAME_RULE}",
                         hint="or give a path with --snapshot-dir")
    if snapshot_dir is None:
        name = name or Path(model.rstrip("/")).name.replace("/", "--")
        if not store.valid_name(name):
            raise UsageError(f"cannot derive a snapshot name from {model!r}; pass --name or --snapshot-dir")
        snapshot_dir = store.ensure_root(common.root_dir()) / name
    from ...report.progress import LastLine

    rep = common.reporter(quiet, as_json)
    req = ops.CreateRequest(
        model=model, target=snapshot_dir, engine_args=engine_args,
        oracle_prompt=oracle.DEFAULT_PROMPT if oracle_prompt is None else oracle_prompt, sleep_level=sleep_level,
        compression=archive.Compression.parse(compress), keep_env=tuple(keep_env), user=user,
        engine_log=common.stderr_sink if verbose else LastLine(rep.detail), weights=weights)
    render.show(ops.create(req, rep), as_json, quiet)



@app.command(cls=Command)
def inspect(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root), directory, or IMAGE "
                                             "(HOST[:PORT]/REPO[:TAG|@sha256:...] or oci:DIR[:TAG])."),
    plain_http: bool = typer.Option(False, "--plain-http", help="IMAGE: HTTP to a registry on loopback."),
    as_json: bool = typer.Option(False, "--json", help="Stable JSON instead of tables."),
) -> None:
    """Show a snapshot's manifest: versions, model, engine args, oracle, sizes, timings, where it
    was built and (pulled ones) where it was pulled from. For an IMAGE: only the registry's
    manifest (its annotations) is read, no blob."""
    from ...fleet.reference import looks_like_image
    from .. import render

    if looks_like_image(snapshot):
        from ...effects.tools import local_tools
        from ...ops import fleet

        render.show(fleet.inspect_image(snapshot, plain_http, local_tools()), as_json)
        return
    from ...fleet.tools import read_pulled
    from ...report.inspected import Inspected
    from ...store import manifest

    from ...errors import CorruptSnapshotError

    snapshot_dir = common.resolve(snapshot).absolute()
    # only the manifest is read (strict schema + digest); nothing of the payload is used or run
    try:
        m = manifest.read(snapshot_dir)
    except CorruptSnapshotError as e:
        raise _damaged(e, snapshot_dir, as_json) from e
    render.show(Inspected(str(snapshot_dir), m, read_pulled(snapshot_dir)), as_json)


def _damaged(e, snapshot_dir: Path, as_json: bool):
    """``inspect`` of a snapshot whose manifest cannot be read (not JSON, cut short, the wrong
    schema, edited): what can still be read -- the directory, each member and its size
    (:func:`vllm_snapshot.store.layout.remains`) -- printed on stdout (``details.remains`` with
    ``--json``), and ``e`` (exit 5) saying what is wrong and what to do."""
    from ...store import layout
    from ...units import human_bytes

    left = layout.remains(snapshot_dir)
    e.details = {"directory": str(snapshot_dir), "manifest": str(snapshot_dir / layout.MANIFEST), "remains": left}
    e.hint = ("nothing else of it can be checked or restored without its manifest ("
              f"`vllm-snapshot verify` and `restore` refuse it the same way); {e.hint or layout.damaged_hint(snapshot_dir)}")
    if not as_json and left["members"]:
        width = max(len(x["name"]) + (x["kind"] == "dir") for x in left["members"])
        print(f"snapshot {snapshot_dir}: its manifest is damaged; what can still be read:")
        for x in left["members"]:
            name = x["name"] + ("/" if x["kind"] == "dir" else "")
            files = f" ({x['files']} file{'s' if x['files'] != 1 else ''})" if x["kind"] == "dir" else ""
            odd = "  (not a snapshot member)" if x["name"] in left["unexpected"] else ""
            print(f"  {name:<{width}}  {human_bytes(x['bytes']):>10}{files}{odd}")
        print(f"  {'total':<{width}}  {human_bytes(left['total_bytes']):>10}", flush=True)
    return e



@app.command(cls=Command)
def verify(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    allow_mismatch: List[str] = typer.Option([], "--allow-mismatch", help="Identity field to tolerate (machine_id, cpu_model)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing when it passes (the exit code says; errors go to stderr)."),
) -> None:
    """Every restore check without restoring: permissions, manifest, host identity, all
    image checksums, and a full re-hash of the model files. Every problem found is said at
    once (exit code: the first one's)."""
    from ... import ops
    from .. import render

    common.root_only("verify")
    render.show(ops.verify(common.resolve(snapshot), frozenset(allow_mismatch)), as_json, quiet)



@app.command("list", cls=Command)
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the names, one per line (as `podman images -q`)."),
) -> None:
    """Snapshots under the root: model, created, kind, sleep level, sizes, whether this host
    can restore them (host identity and model files; `verify` checks everything), last restore."""
    import dataclasses

    from ... import ops
    from .. import render

    listed = ops.list_snapshots(common.root_dir())
    note = common.system_root_note()
    if note is not None:
        listed = dataclasses.replace(listed, elsewhere=f"{note}: sudo vllm-snapshot list")
    render.show(listed, as_json, quiet)



@app.command(cls=Command)
def delete(
    snapshot: str = typer.Argument(..., help="Snapshot name (under the root) or directory."),
    force: bool = typer.Option(False, "--force", help="Stop engines restored from it first."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing when it succeeds (errors still go to stderr)."),
) -> None:
    """Delete a snapshot. Refuses while an engine restored from it runs, unless --force."""
    from ... import ops
    from .. import render

    common.root_only("delete")
    result = ops.delete(common.resolve(snapshot), force)
    if not quiet or as_json:
        render.show(result, as_json)



@app.command(cls=Command)
def prune(
    keep: Optional[int] = typer.Option(None, "--keep", min=0, help="Keep the N newest snapshots per model."),
    older_than: Optional[str] = typer.Option(None, "--older-than", help="Delete snapshots older than this (e.g. 7d, 12h, 30m)."),
    unusable: bool = typer.Option(False, "--unusable", help="Delete snapshots that can never be restored here as they "
                                  "are (list's ✗ for a recorded refusal, another host, changed model content); a ✗ "
                                  "an operator can fix is kept and named."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would be deleted."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Delete snapshots under the root (never ones with a running engine): beyond --keep N
    newest per model, --older-than a duration, and/or --unusable ones; always remove what killed commands left (temp dirs of crashed creates,
    staging dirs of killed restores, stale lock files). Deletes nothing under a root create and restore refuse
    (writable by group/others, another owner)."""
    from ... import ops
    from .. import render

    common.root_only("prune")
    older = ops.parse_duration(older_than) if older_than else None
    res = ops.prune(common.root_dir(), keep, older, dry_run, unusable=unusable)
    render.show(res, as_json)
    if res.exit_code:  # one it could not delete (said above, with why): the others went
        raise typer.Exit(res.exit_code)

