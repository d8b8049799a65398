"""README's CLI reference says what ``--help`` says: every option of every command is listed
in its synopsis, and nothing listed there is missing from the command (a trial found
``delete -q`` working but undocumented)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from vllm_snapshot.cli import app as cli

README = Path(__file__).resolve().parent.parent / "README.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def _synopses() -> dict[str, str]:
    """``{command: its synopsis text}`` from README's CLI reference block ("" for the globals)."""
    text = README.read_text()
    block = text.split("## CLI reference", 1)[1].split("```", 2)[1]
    out: dict[str, str] = {}
    cmd = None
    for line in block.splitlines():
        m = re.match(r"vllm-snapshot\s+(\S+)", line)
        if m:
            cmd = "" if m.group(1).startswith("[") else m.group(1)
            out[cmd] = out.get(cmd, "") + line[m.end():] if cmd else line[len("vllm-snapshot"):].split("COMMAND")[0]
        elif cmd is not None and line.startswith(" "):
            out[cmd] += " " + line
    # what follows `[--]`/`[-- ` is passed through (engine args, vllm serve's front-end options)
    return {c: re.split(r"\[--[\] ]", text, maxsplit=1)[0] for c, text in out.items()}


def _options(params) -> list[tuple[str, ...]]:
    """Each option as the tuple of its names (``--quiet``, ``-q``; ``--rollback``, ``--no-rollback``)."""
    return [tuple(p.opts) + tuple(p.secondary_opts) for p in params if p.param_type_name == "option"
            and "--help" not in p.opts]


def test_every_command_and_option_of_the_cli_is_in_the_readme_reference_and_nothing_else():
    group = typer.main.get_command(cli.app)
    synopses = _synopses()
    assert sorted(synopses) == sorted(["", *group.commands]), "commands in README vs the CLI"
    problems = []
    for name, params in [("", group.params)] + [(n, c.params) for n, c in group.commands.items()]:
        listed = set(OPTION.findall(synopses[name]))
        options = _options(params)
        for names in options:
            if not listed & set(names):
                problems.append(f"{name or 'global'}: {'/'.join(names)} is not in README")
        known = {n for names in options for n in names}
        problems += [f"{name or 'global'}: README lists {o}, which the command does not take"
                     for o in sorted(listed - known)]
    assert problems == []
