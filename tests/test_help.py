"""``--help`` a person can read (issue "Operator experience"): ``--version``; the everyday
commands first; serve's usage shows that engine args follow; its 22 options in groups; types
as ``vllm serve --help`` writes them (``--port PORT``), not the implementation's
(``<int range>``); every option documented; no pointer into the source tree."""

from __future__ import annotations

import re

import pytest
import typer

from vllm_snapshot import __version__
from vllm_snapshot.cli import app as cli


def _help(capsys, *argv: str) -> str:
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"vllm-snapshot {__version__}\n"


def test_the_everyday_commands_come_first(capsys):
    out = _help(capsys)
    listed = re.findall(r"^  (\w+)\s{2,}", out.split("Commands:", 1)[1], re.M)
    assert listed[:4] == ["serve", "restore", "stop", "status"] and sorted(listed) == sorted(cli.COMMAND_ORDER)


def test_serve_usage_says_engine_args_follow_and_groups_its_options(capsys):
    out = _help(capsys, "serve")
    assert out.startswith("Usage: vllm-snapshot serve [OPTIONS] MODEL [[--] ENGINE ARGS]...\n")
    sections = re.findall(r"^(\S[^\n]*):$", out, re.M)
    assert sections == ["Arguments", "Serving", "Build (when no snapshot fits)", "Registry", "Output"]
    assert "--port PORT" in out and "--drain-timeout SECONDS" in out and "--keep-env VAR" in out
    assert _help(capsys, "restore").startswith(
        "Usage: vllm-snapshot restore [OPTIONS] SNAPSHOT [[--] FRONT-END OPTIONS]...\n")


@pytest.mark.parametrize("name", sorted(typer.main.get_command(cli.app).commands))
def test_every_option_is_documented_with_a_human_type(name, capsys):
    out = _help(capsys, name)
    assert not re.search(r"<(str|int|float|path|list|int range|float range)[^>]*>|\{[a-z]+\}", out), out
    assert "docs/" not in out and ".py" not in out, out  # no pointer into the source tree
    cmd = cli._click_command([name]).commands[name]
    for p in cmd.params:
        if p.param_type_name == "option" and "--help" not in p.opts:
            assert p.help, f"{name} {'/'.join(p.opts)} has no help"


def test_each_commands_help_speaks_of_that_command(capsys):
    # a trial: create's build options were headed "when no snapshot fits" (serve's case), and
    # push/pull's -q spoke of a detached engine's PID
    create = _help(capsys, "create", "--help")
    assert "\nBuild:\n" in create and "when no snapshot fits" not in create
    assert "when no snapshot fits" in _help(capsys, "serve", "--help")
    for cmd in ("push", "pull"):
        assert "detached" not in _help(capsys, cmd, "--help")
    assert "detached engine's PID" in _help(capsys, "restore", "--help")
