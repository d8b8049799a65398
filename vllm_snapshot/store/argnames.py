"""The option names of ``vllm serve`` (vLLM's own parser is their source), kept on disk per
vLLM version so a mistyped engine arg is refused in milliseconds with "did you mean", not after
the ~16 s import of vLLM's parser or a cold start.

The file is ``$VLLM_SNAPSHOT_CACHE/vllm-serve-options-VERSION.json``: ``{"vllm": VERSION,
"options": [every option string of the parser, sorted], "arity": {option: 0 | 1 | "?" | "+"}}``
(how many values each option takes, :func:`parser_arities`: what tells a stray word among the
engine args from an option's value; files written before it lack ``arity`` and are rewritten
with it by the next parse). It is written (atomically) by
setup (``python -m vllm_snapshot.engine.argnames``), by every parse of engine args in the CLI
process (:func:`remember`) and by :func:`known_options` ``(load=True)``; a missing or
unreadable file means "not known yet": the args are then left to vLLM's parse, which stays the
authority (abbreviations, values).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..engine.args import flag_name
from ..errors import UsageError


def cache_file(version: str | None = None) -> Path:
    """Where the option names of vLLM ``version`` (default: the installed one) are kept."""
    from ..host.identity import vllm_version
    from ..paths import cache_dir

    return cache_dir() / f"vllm-serve-options-{version or vllm_version()}.json"


def parser_options(parser) -> list[str]:
    """Every option string of an argparse parser (``--dtype``, ``-tp``, ``--no-enforce-eager``),
    sorted. Pure."""
    return sorted({s for a in parser._actions for s in a.option_strings})


def parser_arities(parser) -> dict[str, int | str]:
    """How many values each option string of an argparse parser takes, as :func:`walk
    <vllm_snapshot.engine.args.walk>` reads them: 0 (a switch), 1, ``"?"`` (an optional value)
    or ``"+"`` (every following value: ``nargs`` ``"+"``, ``"*"`` or a count above 1). Pure."""
    out: dict[str, int | str] = {}
    for a in parser._actions:
        n = a.nargs
        arity: int | str = 1 if n is None or n == 1 else 0 if n == 0 else "?" if n == "?" else "+"
        for s in a.option_strings:
            out[s] = arity
    return dict(sorted(out.items()))


def _read() -> dict | None:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remember(options: Iterable[str], arity: dict[str, int | str] | None = None) -> None:
    """Write the option names of the installed vLLM (``options``, from its parser) and, when
    given, how many values each takes (``arity``, :func:`parser_arities`) to :func:`cache_file`,
    atomically; a file that has them already is kept (one without ``arity`` is rewritten when
    ``arity`` is given). Silently nothing when the cache is not writable (another user than
    root) -- they are only a shortcut."""
    from ..host.identity import vllm_version

    version = vllm_version()
    target = cache_file(version)
    try:
        if target.is_file() and (arity is None or isinstance((_read() or {}).get("arity"), dict)):
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        data: dict = {"vllm": version, "options": sorted(set(options))}
        if arity is not None:
            data["arity"] = dict(sorted(arity.items()))
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0)
        os.chmod(tmp, 0o644)
        os.rename(tmp, target)
    except OSError:
        try:
            os.unlink(tmp)  # type: ignore[possibly-undefined]
        except (OSError, NameError):
            pass


def _from_parser(arity: bool = False):
    """Build vLLM's ``vllm serve`` parser (imports vLLM: ~16 s on a small host) and return its
    option strings (with ``arity``: ``(options, parser_arities)``); ``os.environ`` is left as it
    was (importing vLLM sets variables there)."""
    saved = dict(os.environ)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return (parser_options(parser), parser_arities(parser)) if arity else parser_options(parser)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def known_options(load: bool = False) -> frozenset[str] | None:
    """The installed vLLM's ``vllm serve`` option names from :func:`cache_file`; when it is
    missing: with ``load``, from vLLM's parser (slow, then remembered), else None."""
    data = _read()
    if data is not None and isinstance(data.get("options"), list):
        return frozenset(str(o) for o in data["options"])
    if not load:
        return None
    options, arity = _from_parser(arity=True)
    remember(options, arity)
    return frozenset(options)


def known_arities(load: bool = False) -> dict[str, int | str] | None:
    """How many values each ``vllm serve`` option takes (:func:`parser_arities`), from
    :func:`cache_file`; when it does not say: with ``load``, from vLLM's parser (slow, then
    remembered), else None."""
    data = _read()
    if data is not None and isinstance(data.get("arity"), dict):
        return {str(k): v for k, v in data["arity"].items() if v in (0, 1, "?", "+")}
    if not load:
        return None
    options, arity = _from_parser(arity=True)
    remember(options, arity)
    return arity


def arity_lookup(arity: dict[str, int | str]):
    """The :data:`Arity <vllm_snapshot.engine.args.Arity>` of vLLM's parser from its table
    (:func:`known_arities`): an option's arity under any name vLLM's parser takes for it (with
    ``_`` for ``-``, a unique abbreviation), 1 for a dotted config field (``--compilation-config.mode
    3``), 0 for a short option with its value attached (``-O3``), None for anything else. Pure."""
    longs = [o for o in arity if o.startswith("--")]
    shorts = [o for o in arity if not o.startswith("--") and len(o) >= 2]

    def lookup(flag: str) -> int | str | None:
        if flag in arity:
            return arity[flag]
        if _optimization_level(flag) and OPTIMIZATION_LEVEL in arity:
            return 1 if flag == "-O" else 0  # `-O 3`, `-O3`, `-O=3` (the value given with it)
        if flag in ("-", "--") or flag[1:2].isdigit() or flag[1:2] == ".":
            return None  # not an option: stdin, the end of options, a negative number
        if "." in flag and _known(flag.split(".", 1)[0], frozenset(arity)):
            return 1  # vLLM's parser reads `--config.field VALUE` itself: always one value
        if flag.startswith("--"):
            norm = "--" + flag[2:].replace("_", "-")
            if norm in arity:
                return arity[norm]
            could = [o for o in longs if o.startswith(norm)]
            return arity[could[0]] if len(could) == 1 else None
        return 0 if any(flag.startswith(o) for o in shorts) else None

    return lookup


def check_stray_words(engine_args: Sequence[str], command: str, arity: dict[str, int | str] | None,
                      usage: str | None = None) -> None:
    """Refuse (UsageError, exit 2) a word among ``engine_args`` that no option takes as its
    value (:func:`vllm_snapshot.engine.args.stray_words`): vLLM's parser would load the first
    as the model -- and an option given without its value
    (:func:`vllm_snapshot.engine.args.valueless`), all in one error. ``arity`` None (not known yet): nothing is checked here (vLLM's parse refuses
    it later, :func:`vllm_snapshot.engine.args.normalize_args`); ``usage``: for the hint
    (:func:`vllm_snapshot.engine.args.stray_error`). Pure."""
    from ..engine.args import stray_error, stray_words, valueless
    from ..errors import combined

    if arity is None:
        return
    lookup = arity_lookup(arity)
    found = [UsageError(f"{flag} needs a value", hint=f"give it as {flag} VALUE (or {flag}=VALUE)")
             for flag in valueless(engine_args, lookup)]
    words = stray_words(engine_args, lookup)
    if words:
        found.insert(0, stray_error(words, command, usage))
    if found:
        raise combined(found)


#: What vLLM's parser turns ``-O3``, ``-O 3``, ``-O=3`` and ``-Odecode`` into before argparse sees
#: them (vllm/utils/argparse_utils.py): ``-O`` is not among its option strings.
OPTIMIZATION_LEVEL = "--optimization-level"


def _optimization_level(flag: str) -> bool:
    """True for ``-O`` and ``-O<VALUE>`` (vLLM's short form of :data:`OPTIMIZATION_LEVEL`). Pure."""
    return flag.startswith("-O") and not flag.startswith("--")


def _known(flag: str, options: frozenset[str]) -> bool:
    """True when vLLM's parser would take ``flag`` (a token starting with ``-``, without its
    ``=VALUE``) as one of ``options``: exactly, with ``_`` for ``-`` (vLLM's parser accepts
    ``--max_model_len``), as a unique abbreviation (argparse's), or a short option with its value
    attached (``-O3``). Pure."""
    if flag in options:
        return True
    if _optimization_level(flag) and OPTIMIZATION_LEVEL in options:
        return True
    if "." in flag[1:] and not flag[1:2].isdigit():  # a dotted config field: `--compilation-config.mode`
        return _known(flag.split(".", 1)[0], options)
    if flag.startswith("--"):
        norm = "--" + flag[2:].replace("_", "-")
        if norm in options:
            return True
        return sum(o.startswith(norm) for o in options if o.startswith("--")) == 1
    return any(flag.startswith(o) for o in options if not o.startswith("--") and len(o) >= 2)


def unknown_flags(engine_args: Sequence[str], options: frozenset[str]) -> list[str]:
    """The tokens of ``engine_args`` that look like options (``-x``, ``--x``, ``--x=V``; not a
    negative number, not ``-`` or ``--``) and that vLLM's parser would not take (:func:`_known`),
    as given (without ``=VALUE``), in order. Pure."""
    out = []
    for a in engine_args:
        flag = flag_name(a)
        if not flag.startswith("-") or flag in ("-", "--") or flag[1:2].isdigit() or flag[1:2] == ".":
            continue
        if not _known(flag, options) and flag not in out:
            out.append(flag)
    return out


def abbreviated(engine_args: Sequence[str], options: frozenset[str]) -> list[tuple[str, str]]:
    """The ``--`` options of ``engine_args`` that vLLM's parser would take only as an
    abbreviation (argparse's unique prefix: ``--kv-cache-memory-byte``), each as ``(as given,
    the whole name)``, in order, once each. Whole names, ``_`` for ``-``, dotted config fields,
    ``--no-`` forms and vLLM's short options (``-tp``, ``-O3``) are not abbreviations. Pure."""
    out: list[tuple[str, str]] = []
    for a in engine_args:
        flag = flag_name(a)
        if not flag.startswith("--") or flag == "--" or flag[2:3] in ("", "-") or "." in flag:
            continue
        norm = "--" + flag[2:].replace("_", "-")
        if norm in options:
            continue
        could = [o for o in options if o.startswith("--") and o.startswith(norm)]
        if len(could) == 1 and (flag, could[0]) not in out:
            out.append((flag, could[0]))
    return out


def abbreviation_errors(engine_args: Sequence[str], options: frozenset[str] | None) -> list[UsageError]:
    """A UsageError for each abbreviated engine arg (:func:`abbreviated`): vLLM's parser would
    take it, but our own rules read whole names (the snapshot key, the KV-cache size check,
    ``inspect``), so an abbreviation is refused before anything runs, naming the whole name.
    ``options`` None (not known yet): none. Pure."""
    if options is None:
        return []
    return [UsageError(f"{flag} is an abbreviation of vLLM's {whole}: write it out in full: {whole}",
                       hint=f"did you mean {whole}? (engine args are written out in full)")
            for flag, whole in abbreviated(engine_args, options)]


def check(engine_args: Sequence[str], own: Iterable[str], command: str, options: frozenset[str] | None) -> None:
    """Refuse (UsageError, exit 2) an option in ``engine_args`` that is neither one of vLLM's
    (``options``; None: not known, nothing is checked) -- naming the closest of vLLM's and of
    ``command``'s own options ``own`` ("did you mean --port?") -- or that abbreviates one of
    ``own`` (``--weight`` for ``--weights``: vLLM's parser would take it as another option's
    abbreviation, ``--weight-transfer-config``). Pure."""
    if options is None:
        return
    own = set(own)
    where = "vllm-snapshot " + command
    for a in engine_args:  # `serve --weight file`: vLLM would take it as --weight-transfer-config
        flag = flag_name(a)
        if not flag.startswith("--") or flag in options or "--" + flag[2:].replace("_", "-") in options:
            continue
        ours = sorted(o for o in own if o.startswith(flag) and o != flag)
        if ours:
            theirs = sorted(o for o in options if o.startswith("--" + flag[2:].replace("_", "-")))
            raise UsageError(f"{flag} is not a whole option name: it abbreviates `{where}`'s {' and '.join(ours)}"
                             + (f", and vLLM would read it as {', '.join(theirs[:3])}" if theirs else ""),
                             hint=f"did you mean {ours[0]}? (write options out in full)")
    bad = unknown_flags(engine_args, options)
    if not bad:
        return
    from ..suggest import did_you_mean

    flag = bad[0]
    guess = did_you_mean(flag, own | options)
    raise UsageError(f"{flag} is neither an option of `{where}` nor a vLLM engine arg"
                     + (f" (also unknown: {', '.join(bad[1:])})" if bad[1:] else ""),
                     hint=guess or f"`{where} --help` lists its options; `vllm serve --help` the engine args")


def main(argv: list[str] | None = None) -> int:
    """Write the installed vLLM's option names to the cache (setup runs this); print the path."""
    options, arity = _from_parser(arity=True)
    remember(options, arity)
    print(cache_file())
    return 0


if __name__ == "__main__":
    sys.exit(main())
