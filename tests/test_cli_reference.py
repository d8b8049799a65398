"""docs/cli.md says what ``--help`` says: every command of the CLI has a synopsis line in its
first block, every option of every command is listed in its synopsis, and nothing listed there
is missing from the command (a trial found ``delete -q`` working but undocumented)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from vllm_snapshot.cli import app as cli

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def _synopses() -> dict[str, str]:
    """``{command: its synopsis text}`` from docs/cli.md's first block ("" for the globals)."""
    text = CLI_DOC.read_text()
    block = text.split("# CLI reference", 1)[1].split("```", 2)[1]
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


def test_every_command_and_option_of_the_cli_is_in_the_reference_and_nothing_else():
    group = typer.main.get_command(cli.app)
    synopses = _synopses()
    assert sorted(synopses) == sorted(["", *group.commands]), "commands in docs/cli.md vs the CLI"
    problems = []
    for name, params in [("", group.params)] + [(n, c.params) for n, c in group.commands.items()]:
        listed = set(OPTION.findall(synopses[name]))
        options = _options(params)
        for names in options:
            if not listed & set(names):
                problems.append(f"{name or 'global'}: {'/'.join(names)} is not in docs/cli.md")
        known = {n for names in options for n in names}
        problems += [f"{name or 'global'}: docs/cli.md lists {o}, which the command does not take"
                     for o in sorted(listed - known)]
    assert problems == []


def test_the_readme_points_to_the_reference_and_keeps_no_copy_of_it():
    """One copy of the reference: README.md links to docs/cli.md and holds no synopsis block of
    its own (a second copy would drift from the one this file checks)."""
    readme = (ROOT / "README.md").read_text()
    assert "docs/cli.md" in readme
    assert not re.search(r"^vllm-snapshot [a-z]+ ", readme, re.M), "a CLI synopsis in README.md"


def test_the_exit_code_table_names_every_error_class_and_nothing_else():
    """docs/cli.md's exit-code table (the only copy for users) lists exactly the ``(exit code,
    --json code)`` pairs of the error classes in errors.py, plus 0 (success) and 141 (a closed
    pipe, no JSON)."""
    from vllm_snapshot import errors

    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.SnapshotError)]
    expected = {(c.exit_code, c.code) for c in classes}
    text = CLI_DOC.read_text().split("\n## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([a-z-]+)` \|", text, re.M)
    assert rows, "no exit-code table in docs/cli.md"
    assert {(int(n), c) for n, c in rows} == expected
    listed = {int(n) for n in re.findall(r"^\| (\d+) \|", text, re.M)}
    assert listed == {0, 141} | {n for n, _ in expected}


def test_the_options_the_readme_gives_to_restore_are_the_ones_restore_takes():
    """A trial: the README said `--uds` belongs to serve/restore; restore refused it."""
    from vllm_snapshot.engine.args import REFUSED_AT_RESTORE, RESTORE_OWNED_ARGS

    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"((?:`--[a-z-]+`(?:, | and )?)+) belongs? to `serve`/`restore`", readme)
    assert said, "README.md no longer says which options belong to serve/restore"
    flags = re.findall(r"`(--[a-z-]+)`", said.group(1))
    assert flags and not [f for f in flags if f in REFUSED_AT_RESTORE]
    assert "--uds" in RESTORE_OWNED_ARGS and "`--uds` is refused everywhere" in readme
