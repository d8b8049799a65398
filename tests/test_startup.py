"""Start-up of ``inspect`` and ``--help`` (docs/benchmarks.md target 5: each whole process <= 0.3 s).

Not timed (timings are scripts/bench.py's): these check, in a fresh interpreter started the
way the console script starts, that the fast commands import only what they use. Each entry of
the lists below cost start-up time once; see docs/benchmarks.md, "inspect and --help start-up".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from helpers import write_snapshot_dir

from vllm_snapshot.cli import app as cli, render
from vllm_snapshot.report import results

ROOT = Path(__file__).resolve().parent.parent

#: never imported by `inspect` (nor by --help): the commands that create, restore and manage
#: engines, and what they use
NOT_FOR_INSPECT = (
    "vllm_snapshot.ops", "vllm_snapshot.store.archive", "vllm_snapshot.checkpoint.criu", "vllm_snapshot.checkpoint.inventory",
    "vllm_snapshot.supervise.supervisor", "vllm_snapshot.effects.tools", "vllm_snapshot.cli.doctor", "vllm_snapshot.host.privilege",
    "vllm_snapshot.supervise.frontend", "vllm_snapshot.host.codeid", "vllm_snapshot.checkpoint.gpu", "vllm_snapshot.report.progress",
    "vllm_snapshot.store.registry", "vllm_snapshot.host.cgroups", "vllm_snapshot.store.model_digest", "vllm_snapshot.store.snapkey",
    # the other result dataclasses (~1 ms each to create): inspect's is vllm_snapshot.report.inspected
    "vllm_snapshot.report.results",
    "psutil", "zstandard", "httpx", "requests", "torch", "vllm", "pycriu", "transformers",
    # typer's rich help renderer (rich_markup_mode=None keeps click's plain help)
    "markdown_it", "rich.markdown",
)
#: --json prints JSON: no table, no rich at all
NOT_FOR_JSON = ("rich",)
#: a command's --help reads no snapshot: no manifest models, no digest, no table
NOT_FOR_HELP = ("vllm_snapshot.store.manifest", "vllm_snapshot.cli.render", "blake3", "rich")
#: nor does the top-level --help need pydantic (typer builds its option adapters, pydantic
#: TypeAdapters, for the options it processes: `inspect --help` processes the group's)
NOT_FOR_TOP_HELP = NOT_FOR_HELP + ("pydantic",)

#: runs argv as the console script does (sys.argv, main() without arguments), then reports the
#: modules imported and whether pydantic scanned the installed distributions for plugins
CHILD = """
import io, json, sys, contextlib
sys.argv = ["vllm-snapshot", *sys.argv[1:]]
from vllm_snapshot.cli.app import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main()
loader = sys.modules.get("pydantic.plugin._loader")
sys.stderr.write("\\nSTARTUP " + json.dumps({
    "rc": rc, "modules": sorted(sys.modules), "out": out.getvalue(),
    "plugin_scan": getattr(loader, "_plugins", None) is not None}) + "\\n")
"""


def _run(*argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=env)
    line = [x for x in p.stderr.splitlines() if x.startswith("STARTUP ")]
    assert line, p.stderr
    return json.loads(line[-1][len("STARTUP "):])


def _imported(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup") / "snap"
    write_snapshot_dir(d)
    return d


def test_inspect_imports_only_what_it_uses(snap):
    r = _run("inspect", str(snap))
    assert r["rc"] == 0 and "snapshot" in r["out"]
    assert _imported(r["modules"], NOT_FOR_INSPECT) == []
    # pydantic's plugin discovery reads every installed distribution's entry points
    assert r["plugin_scan"] is False


def test_inspect_json_imports_no_rich(snap):
    r = _run("inspect", str(snap), "--json")
    assert r["rc"] == 0 and json.loads(r["out"])["snapshot"] == str(snap)
    assert _imported(r["modules"], NOT_FOR_INSPECT + NOT_FOR_JSON) == []
    assert r["plugin_scan"] is False


@pytest.mark.parametrize("argv, never", [(["--help"], NOT_FOR_TOP_HELP), (["inspect", "--help"], NOT_FOR_HELP)])
def test_help_imports_no_manifest_nor_rich(argv, never):
    r = _run(*argv)
    assert r["rc"] == 0 and "Usage: vllm-snapshot" in r["out"]
    assert _imported(r["modules"], NOT_FOR_INSPECT + never) == []


def test_a_named_command_is_built_alone_and_the_group_is_whole_otherwise():
    names = sorted(typer.main.get_command(cli.app).commands)
    assert len(names) > 10
    for name in names:
        for argv in ([name], ["--debug", name, "x"], ["--root", "/r", name], ["--root=/r", name, "--help"]):
            assert sorted(cli._click_command(argv).commands) == [name], argv
    for argv in ([], ["--help"], ["--debug"], ["--root", "/r"], ["nosuch"], ["--bogus", "inspect"], ["--", "inspect"]):
        assert sorted(cli._click_command(argv).commands) == names, argv
    assert sorted(typer.main.get_command(cli.app).commands) == names  # the app itself is left whole


@pytest.mark.parametrize("name", sorted(typer.main.get_command(cli.app).commands))
def test_a_command_built_alone_behaves_as_in_the_whole_group(name, capsys, monkeypatch):
    """Its help and its usage errors read the same (the group's options and settings are kept)."""
    for argv in ([name, "--help"], ["--debug", name, "--help"], [name, "--json=maybe"]):
        alone = cli.main(list(argv)), *capsys.readouterr()
        with monkeypatch.context() as m:
            m.setattr(cli, "_click_command", lambda _argv: cli._human_help(typer.main.get_command(cli.app)))
            whole = cli.main(list(argv)), *capsys.readouterr()
        assert alone == whole, argv
        assert alone[0] in (0, 2), argv


def test_every_result_type_has_a_renderer():
    kinds = {n for n, c in vars(results).items() if isinstance(c, type) and hasattr(c, "to_json")}
    assert kinds and kinds == set(render._HUMAN)
