"""How ``--help`` reads: the option groups of the long commands, ``vllm serve``-style metavars,
and a usage line that ends with what a command passes through to vLLM; and the one rule click
lacks for our options: an option that takes a value is not given ``--`` or another option as
its value (:func:`missing_values`)."""

from __future__ import annotations

import typer


class Command(typer.core.TyperCommand):
    """A command whose plain (click) help groups its options under :data:`PANEL_OF`'s headings
    and whose usage line ends with :attr:`usage_tail` (what it passes through to vLLM)."""

    usage_tail = ""

    def parse_args(self, ctx, args):
        missing_values(self.get_params(ctx), args)
        return super().parse_args(ctx, args)

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


def missing_values(params, args: list[str]) -> None:
    """Refuse (UsageError, exit 2) an option of the command (``params``: its click parameters)
    that takes a value but is followed by ``--`` or by what looks like an option (``--name
    --dtype``, ``--oracle-prompt -- --dtype``): click would take that word as the value, and
    ``--name --`` made a snapshot named ``--`` and passed the engine args on as its own. A
    negative number and ``-`` (stdin) are values; ``--opt=-x`` gives a value that starts with
    ``-`` on purpose. Only the words before the first ``--`` that no option took are read."""
    import re

    from ..errors import UsageError

    takes = {o for p in params if getattr(p, "param_type_name", "") == "option"
             and not getattr(p, "is_flag", False) and not getattr(p, "count", False) for o in p.opts}
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            return
        if tok in takes and i + 1 < len(args):
            nxt = args[i + 1]
            if nxt == "--" or (nxt.startswith("-") and len(nxt) > 1 and not re.fullmatch(r"-\d+(\.\d*)?", nxt)):
                raise UsageError(f"{tok} needs a value: it is followed by {nxt!r}, which is "
                                 + ("the end of the options" if nxt == "--" else "an option, not a value"),
                                 hint=f"give it as {tok} VALUE" + ("" if tok == "--name" else
                                                                  f" (or {tok}=VALUE for a value that starts with -)"))
            i += 1
        i += 1


class EngineArgsCommand(Command):
    usage_tail = "[[--] ENGINE ARGS]..."


class FrontendCommand(Command):
    usage_tail = "[[--] FRONT-END OPTIONS]..."


#: the option groups of the long commands' help, in order, and which option is in which
BUILD_PANEL = "Build (when no snapshot fits)"
PANELS = ("Serving", BUILD_PANEL, "Registry", "Output")
PANELLED = {"serve", "restore", "switch", "create"}
PANEL_OF = {
    **dict.fromkeys(("host", "port", "detach", "log_file", "verify_model", "allow_mismatch", "drain_timeout",
                     "no_build", "rebuild", "rollback", "handover", "model", "merge_pages"), "Serving"),
    **dict.fromkeys(("oracle_prompt", "sleep_level", "compress", "weights", "keep_env", "user", "verbose",
                     "snapshot_dir", "name"), BUILD_PANEL),
    **dict.fromkeys(("registry", "plain_http", "sign_key", "verify_key"), "Registry"),
    **dict.fromkeys(("as_json", "quiet", "help"), "Output"),
}
#: metavars of options and arguments by parameter name, as `vllm serve --help` writes them
#: (``--port PORT``), instead of the implementation's types (``<int range>``); others: NAME.upper()
METAVARS = {
    "drain_timeout": "SECONDS", "sleep_level": "0|1|2", "verify_model": "quick|full", "compress": "none|zstd[:LEVEL]",
    "weights": "auto|file|in-image", "keep_env": "VAR", "allow_mismatch": "FIELD", "older_than": "AGE", "keep": "N",
    "log_file": "FILE", "snapshot_dir": "DIR", "root": "DIR", "sign_key": "PEM", "verify_key": "PEM",
    "oracle_prompt": "TEXT", "registry": "HOST[:PORT]/REPO", "chunk_size": "SIZE",
}


def human_help(cmd):
    """Give every option and argument of ``cmd`` (a click command or group, and its commands) a
    human metavar (:data:`METAVARS`); returns ``cmd``. Mutates the click objects; cheap."""
    for p in cmd.params:
        if p.metavar is None and not getattr(p, "is_flag", False):
            p.metavar = METAVARS.get(p.name) or p.name.upper()
    for sub in getattr(cmd, "commands", {}).values():
        human_help(sub)
    return cmd
