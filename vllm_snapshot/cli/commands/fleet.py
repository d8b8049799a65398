"""The commands between hosts and an OCI registry: ``push``, ``pull``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ...errors import UsageError
from .. import common
from ..common import app, JSON_HELP, QUIET_HELP
from ..helpformat import Command


@app.command(cls=Command)
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
    from ...effects.tools import local_tools
    from ...ops import fleet
    from .. import render

    chunk = None
    if chunk_size is not None:
        from ...fleet.transport import parse_size

        try:
            chunk = parse_size(chunk_size)
        except ValueError:
            chunk = -1
        if chunk != 0 and not 1024 <= chunk:
            raise UsageError(f"--chunk-size {chunk_size!r} is not a size of at least 1024 bytes (or 0)",
                             hint="e.g. --chunk-size 16M")
    common.root_only("push")
    common.interruptible()
    render.show(fleet.push(fleet.PushRequest(common.resolve(snapshot), image, plain_http, sign_key, chunk),
                           common.reporter(quiet, as_json), local_tools()), as_json, quiet)



@app.command(cls=Command)
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
    from ...effects.tools import local_tools
    from ...ops import fleet
    from .. import render

    common.root_only("pull")
    common.interruptible()
    render.show(fleet.pull(fleet.PullRequest(image, common.root_dir(), name, plain_http, verify_key),
                           common.reporter(quiet, as_json), local_tools()), as_json, quiet)

