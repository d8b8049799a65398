"""The rules about ``vllm serve`` engine args, read lexically and without vLLM (importing its
parser costs ~10-16 s): the one owner of what a token means here. Its users: create and serve
(:func:`check_engine_args`, :func:`arg_value`), the GPU check of restore (:func:`last_value`),
the snapshot key (:func:`has_flag`), restore's front-end split (:data:`FRONTEND_OPTIONS`,
:func:`flag_name`), the engine root's own parse and the key's normalization
(:func:`unrestorable`, :data:`PARALLEL_SIZES`, :func:`argparse_reason`). The engine's parse
with vLLM's parser (``entrypoints/engine_root.py``) stays the authority for what vLLM accepts; these rules
refuse early what would make a snapshot unrestorable, before any engine starts.

Pure, and imports only :mod:`vllm_snapshot.errors` (a layer-1 leaf: tests/test_layering.py).
Secrets in args (``--api-key`` values in logs) are :mod:`vllm_snapshot.host.envpolicy`'s rule
(``redact_args``), with the secret names of the environment.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..errors import UsageError

#: The sides an option belongs to: the engine's (frozen into the snapshot at create), the
#: HTTP front end's (given at restore/serve/switch, applied when the server starts), or the
#: restoring command's own (``--host``/``--port``: the snapshot's engine binds nothing until restore).
ENGINE, FRONTEND, RESTORE = "engine", "frontend", "restore"
#: What a secret option's value is: ``VALUE`` a secret itself (never written anywhere: not in
#: the manifest, the registry or a log), ``FILE`` the path of a secret (redacted in the
#: manifest's args; the registry keeps it so ``switch`` can carry it over).
VALUE, FILE = "value", "file"

_TLS_AT_RESTORE = "TLS is set up when the server starts; give the TLS options to restore/serve instead"


@dataclass(frozen=True)
class Option:
    """One ``vllm serve`` option this package has a rule about.

    ``flag``: its exact name; ``dest``: the attribute vLLM's parser stores it under; ``arity``:
    0 a switch (with its ``--no-`` form as a row of its own where vLLM has one), 1 one value,
    ``"?"`` an optional value, ``"+"`` one or more values (argparse ``nargs="+"``); ``side``:
    :data:`ENGINE`, :data:`FRONTEND` or :data:`RESTORE`; ``secret``: "" or :data:`VALUE` /
    :data:`FILE`; ``at_create``: why create refuses it ("" when it does not); ``at_restore``:
    why restore/serve/switch refuse it as a front-end option ("" when they apply it)."""

    flag: str
    dest: str
    arity: int | str
    side: str
    secret: str = ""
    at_create: str = ""
    at_restore: str = ""


def _switch(flag: str, dest: str, no: bool = True) -> tuple[Option, ...]:
    rows = (Option(flag, dest, 0, FRONTEND),)
    return rows + ((Option("--no-" + flag[2:], dest, 0, FRONTEND),) if no else ())


#: The one table of ``vllm serve`` options with a rule here (vLLM 0.32:
#: ``vllm/entrypoints/launchers/cli_args.py`` FrontendArgs, ``vllm/engine/arg_utils.py``
#: EngineArgs). tests/test_frontend.py checks every row's flag, dest and arity against vLLM's
#: own parser, the authority for what vLLM accepts.
OPTIONS: tuple[Option, ...] = (
    Option("--host", "host", 1, RESTORE),
    Option("--port", "port", 1, RESTORE),
    Option("--api-key", "api_key", "+", FRONTEND, secret=VALUE,
           at_create="an API key would be frozen into the snapshot's memory; give it to restore/serve instead "
                     "(--api-key, or VLLM_API_KEY in their environment)"),
    Option("--ssl-keyfile", "ssl_keyfile", 1, FRONTEND, secret=FILE, at_create=_TLS_AT_RESTORE),
    Option("--ssl-certfile", "ssl_certfile", 1, FRONTEND, at_create=_TLS_AT_RESTORE),
    Option("--ssl-ca-certs", "ssl_ca_certs", 1, FRONTEND, at_create=_TLS_AT_RESTORE),
    Option("--ssl-ciphers", "ssl_ciphers", 1, FRONTEND),
    *_switch("--enable-ssl-refresh", "enable_ssl_refresh"),
    Option("--allowed-origins", "allowed_origins", 1, FRONTEND),
    Option("--allowed-methods", "allowed_methods", 1, FRONTEND),
    Option("--allowed-headers", "allowed_headers", 1, FRONTEND),
    *_switch("--allow-credentials", "allow_credentials"),
    Option("--root-path", "root_path", 1, FRONTEND),
    Option("--uvicorn-log-level", "uvicorn_log_level", 1, FRONTEND),
    *_switch("--disable-uvicorn-access-log", "disable_uvicorn_access_log"),
    Option("--disable-access-log-for-endpoints", "disable_access_log_for_endpoints", 1, FRONTEND),
    *_switch("--enable-log-requests", "enable_log_requests"),
    *_switch("--enable-request-id-headers", "enable_request_id_headers"),
    *_switch("--disable-fastapi-docs", "disable_fastapi_docs"),
    Option("--h11-max-incomplete-event-size", "h11_max_incomplete_event_size", 1, FRONTEND),
    Option("--h11-max-header-count", "h11_max_header_count", 1, FRONTEND),
    Option("--uds", "uds", 1, FRONTEND, at_create="a unix socket listener (restore binds --host/--port)",
           at_restore="a unix socket listener (restore binds --host/--port)"),
    Option("--middleware", "middleware", 1, FRONTEND, at_create="custom middleware (it may reject or change the canary)",
           at_restore="custom middleware (it may reject or change the canary)"),
    Option("--ssl-cert-reqs", "ssl_cert_reqs", 1, FRONTEND,
           at_restore="client certificates (mutual TLS): the readiness check and the canary have none to present"),
    Option("--hf-token", "hf_token", "?", ENGINE, secret=VALUE),  # refused by check_engine_args, abbreviations too
    Option("--speculative-config", "speculative_config", 1, ENGINE,
           at_create="speculative decoding (a draft model is not reloaded after sleep)"),
)
BY_FLAG: dict[str, Option] = {o.flag: o for o in OPTIONS}

#: ``vllm serve`` options that belong to restore: the snapshot's engine binds nothing until
#: restore, which takes the address from its own ``--host``/``--port`` (``--uds``: refused).
RESTORE_OWNED_ARGS = tuple(o.flag for o in OPTIONS if o.side == RESTORE) + ("--uds",)
#: Front-end options given at restore/serve/switch, flag -> (dest, arity).
FRONTEND_OPTIONS: dict[str, tuple[str, int | str]] = {
    o.flag: (o.dest, o.arity) for o in OPTIONS if o.side == FRONTEND and not o.at_restore}
#: Front-end settings no restore can honour, flag -> why.
REFUSED_AT_RESTORE: dict[str, str] = {o.flag: o.at_restore for o in OPTIONS if o.at_restore}
#: Front-end settings refused at create, dest -> why: secrets and TLS belong to restore, the
#: rest can never be validated by the canary (:func:`unrestorable` over vLLM's parse).
FRONTEND_REFUSED: dict[str, str] = {o.dest: o.at_create for o in OPTIONS if o.side == FRONTEND and o.at_create}
#: The same and the engine's, by flag, for create's early check (exact flag names; the
#: engine-side check, :func:`unrestorable` over vLLM's parse, also catches abbreviations).
EARLY_REFUSED: dict[str, str] = {o.flag: o.at_create for o in OPTIONS if o.at_create}
#: Flags whose values are (or name) secrets; argparse (vLLM keeps ``allow_abbrev``) also
#: accepts any unambiguous prefix of them, e.g. ``--hf-tok``.
SECRET_FLAGS = tuple(o.flag for o in OPTIONS if o.secret)
#: Front-end dests whose values are secrets: never written to disk (registry, manifest, logs).
SECRET_DESTS = frozenset(o.dest for o in OPTIONS if o.side == FRONTEND and o.secret == VALUE)
#: Dests the OpenAI app reads when vLLM builds it (``build_app``/``init_entrypoints_middleware``):
#: changing one means rebuilding the app in the restored engine.
APP_DESTS = frozenset({"api_key", "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
                       "root_path", "enable_request_id_headers", "disable_fastapi_docs"})
#: restore's/serve's/switch's own options (typer parses them; a misspelt one reaches the walker)
OWN_OPTIONS = ("--host", "--port", "--detach", "--log-file", "--verify-model", "--allow-mismatch", "--json",
               "--quiet", "--no-build", "--rebuild", "--model", "--rollback", "--no-rollback", "--keep-env",
               "--oracle-prompt", "--sleep-level", "--compress", "--verbose")

#: Every parallel size of vLLM 0.32's engine args; a snapshot is of one device.
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                  "prefill_context_parallel_size", "decode_context_parallel_size")
#: Parsed ``vllm serve`` destinations that never change the engine's state (left out of the
#: normalized args, hence of the snapshot key).
ARGS_IGNORED = frozenset({"model", "model_tag", "dispatch_function", "subparser", "config"})
#: Name markers of secrets, in environment variables and option names alike.
SECRET_MARKERS = ("SECRET", "PASSWORD", "API_KEY", "APIKEY", "CREDENTIAL", "PRIVATE")


def flag_name(token: str) -> str:
    """The option name of one token: ``"--flag=V"`` -> ``"--flag"``; any other token as is. Pure."""
    return token.split("=", 1)[0]


#: An arity lookup for :func:`walk`: flag name -> arity (0, 1, ``"?"``, ``"+"``), None for a
#: token that is not an option of the walk.
Arity = Callable[[str], "int | str | None"]


def frontend_arity(name: str) -> int | str | None:
    """The arity of a front-end option accepted at restore (:data:`FRONTEND_OPTIONS`), else None."""
    opt = FRONTEND_OPTIONS.get(name)
    return None if opt is None else opt[1]


def walk(args: Sequence[str], arity: Arity = frontend_arity) -> Iterator[tuple[str, list[str], list[str] | None]]:
    """The one walker of ``vllm serve`` argv: each option of ``args`` as ``(name, tokens,
    values)``; ``tokens`` the slice it took as given, ``values`` its values (``[]`` for a switch,
    or for an option given last without its value) -- or ``None`` for a token ``arity`` does not
    know (then ``tokens`` is that one token). A value is the ``=`` part, else the next token
    (arity 1), else the next token unless it starts with ``-`` (``"?"``), else every following
    token up to the next ``-``-prefixed one (``"+"``, as argparse reads ``nargs="+"``). Pure."""
    i = 0
    while i < len(args):
        tok = args[i]
        name = flag_name(tok)
        start, i = i, i + 1
        n = arity(name) if tok.startswith("-") else None
        if n is None:
            yield name, [tok], None
            continue
        vals = [tok.split("=", 1)[1]] if "=" in tok else []
        if "=" not in tok and n == 1 and i < len(args):
            vals.append(args[i])
            i += 1
        elif "=" not in tok and n in ("?", "+"):
            while i < len(args) and not args[i].startswith("-") and (n == "+" or not vals):
                vals.append(args[i])
                i += 1
        yield name, list(args[start:i]), vals


def _one(flag: str) -> Arity:
    return lambda name: 1 if name == flag else None


def arg_value(engine_args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``vllm serve`` args (``--flag V`` or ``--flag=V``), last one
    wins; None when absent (or given last with no value). Exact names only. Pure."""
    val = None
    for _name, _tokens, vals in walk(engine_args, _one(flag)):
        if vals:
            val = vals[-1]
    return val


def pop_option(args: Sequence[str], flag: str) -> tuple[list[str], str | None]:
    """``(args without flag V / flag=V, its last value or None)``: ``serve`` lifts its own
    ``--host``/``--port`` out of ``vllm serve``-style engine args. A ``flag`` given last with
    no value stays in the rest. Pure."""
    rest: list[str] = []
    val = None
    for _name, tokens, vals in walk(args, _one(flag)):
        if vals:
            val = vals[-1]
        else:
            rest.extend(tokens)
    return rest, val


def has_flag(engine_args: Iterable[str], flag: str) -> bool:
    """True when ``flag`` is given (``--flag``, ``--flag V`` or ``--flag=V``), exact name. Pure."""
    return any(flag_name(a) == flag for a in engine_args)


def last_value(engine_args: Sequence[str], flag: str, shortest: str) -> str | None:
    """The value of the last token vLLM's argparse would take for ``flag``: the full name or an
    abbreviation of at least ``shortest`` (no other option may start with it), with dashes or
    underscores, as ``--f V`` or ``--f=V``; None when absent. For args recorded before
    snapshots kept vLLM's normalized form (``manifest.key.normalized_args``). Pure."""
    raw: str | None = None
    args = list(engine_args)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if len(name) < len(shortest) or not flag.startswith(name):
            continue
        if eq:
            raw = value
        elif i + 1 < len(args):
            raw = args[i + 1]
    return raw


def argparse_reason(stderr_text: str) -> str:
    """The REASON of argparse's ``prog: error: REASON`` in captured stderr (its last non-empty
    line when there is none). Pure."""
    lines = [ln for ln in stderr_text.splitlines() if ln.strip()]
    return next((ln.split("error:", 1)[1].strip() for ln in reversed(lines) if "error:" in ln),
                lines[-1] if lines else "rejected by vLLM's argument parser")


#: Exception type names of vLLM's argument and config validation: pydantic's (vLLM's config
#: classes are pydantic dataclasses: "1 validation error for ModelConfig / Value error, ...")
#: and vLLM's own (``--chat-template`` that names no file).
_VALIDATION_ERRORS = ("ValidationError", "VLLMValidationError")


def config_refusal(exc: BaseException) -> str | None:
    """The engine's own words when ``exc`` -- raised while vLLM built the engine config from
    the args, before any engine process started -- is a refusal of the args (a bad value: a
    ``--max-model-len`` above the model's, a ``--chat-template`` that names no file): a pydantic
    or vLLM validation error in its chain (``__cause__``/``__context__``), or a ValueError or
    TypeError raised inside ``create_engine_config``; None for anything else (a runtime
    failure: out of memory, a crash, an engine core that died). The words: the ``Value error,``
    lines of a pydantic error without its ``[type=...]`` and link lines, else its first
    line. Pure."""
    import traceback as tb_mod

    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    found = next((x for x in seen if type(x).__name__ in _VALIDATION_ERRORS), None)
    if found is None:
        found = next((x for x in seen if isinstance(x, (ValueError, TypeError))
                      and any(f.name == "create_engine_config" for f in tb_mod.extract_tb(x.__traceback__))), None)
    if found is None:
        return None
    lines = [ln.strip() for ln in str(found).splitlines() if ln.strip()]
    values = [ln.split("Value error,", 1)[1].split(" [type=", 1)[0].strip() for ln in lines if "Value error," in ln]
    if values:
        return "; ".join(values)
    words = [ln.split(" [type=", 1)[0] for ln in lines if not ln.startswith("For further information")]
    return "; ".join(words[:3]) or type(found).__name__


def stray_words(engine_args: Sequence[str], arity: Arity) -> list[tuple[str, str | None]]:
    """The words of ``engine_args`` that no option takes as its value (``arity``: how many
    values each option takes, None for a token that is none of them), each as ``(word, the
    switch right before it or None)``: vLLM's parser would take the first as its positional
    ``model_tag`` -- the model to load instead of MODEL -- and refuse the next ones. Tokens
    starting with ``-`` (options, negative numbers) are never words here. Pure."""
    out: list[tuple[str, str | None]] = []
    before: str | None = None
    for name, tokens, vals in walk(engine_args, arity):
        if vals is None and not tokens[0].startswith("-"):
            out.append((tokens[0], before))
        before = name if vals is not None and not vals and arity(name) == 0 else None
    return out


def valueless(engine_args: Sequence[str], arity: Arity) -> list[str]:
    """The options of ``engine_args`` that take a value (``arity`` 1 or ``"+"``) but are given
    none: last, or (arity 1) followed by another ``--`` option, which vLLM's parser refuses
    ("expected one argument"). As given, in order. Pure."""
    out = []
    for name, tokens, vals in walk(engine_args, arity):
        if vals is None or "=" in tokens[0]:
            continue
        n = arity(name)
        if (n in (1, "+") and not vals) or (n == 1 and vals[0].startswith("--") and len(vals[0]) > 2):
            out.append(name)
    return out


def stray_error(words: Sequence[tuple[str, str | None]] | Sequence[str], command: str,
                usage: str | None = None) -> UsageError:
    """The UsageError for stray ``words`` among the engine args of ``vllm-snapshot COMMAND``
    (:func:`stray_words`' pairs, or bare words), naming them and what to do; ``usage``: the
    command's synopsis for the hint (default ``COMMAND MODEL [engine args]``)."""
    pairs = [(w, None) if isinstance(w, str) else w for w in words]
    names = ", ".join(repr(w) for w, _ in pairs)
    after = next(((w, s) for w, s in pairs if s), None)
    why = ""
    if after and not after[1].startswith("--") and len(after[1]) > 2:  # -O3: a short option, its value attached
        why = f" ({after[1]} carries its value: it takes no other)"
    elif after:
        why = f" ({after[1]} is a switch: it takes no value)"
    return UsageError(f"unexpected argument{'s' if len(pairs) > 1 else ''} {names} among the engine args{why}: "
                      f"`vllm-snapshot {command}` takes one MODEL, and every other word must be an option's value",
                      hint=f"the model goes first (`vllm-snapshot {usage or command + ' MODEL [engine args]'}`); "
                           "give the word to its option (--flag VALUE) or leave it out",
                      details={"unexpected": [w for w, _ in pairs]})


def check_engine_args(engine_args: Sequence[str]) -> None:
    """Refuse engine args the snapshot could only record and ignore, and (early, before the
    engine starts) the settings that make a snapshot unrestorable (a parallel size above 1,
    logits as logprobs, front-end settings restore owns) -- the engine's parse
    (:func:`unrestorable` over vLLM's namespace, in ``entrypoints/engine_root.py``) stays the authority,
    abbreviations included. Pure. Raises UsageError naming the flag, with the remedy."""
    for a in engine_args:
        flag = flag_name(a)
        if flag == "--uds":
            raise UsageError("--uds: a restored engine serves TCP only (restore hands it a socket bound to "
                             "--host/--port after the oracle matched)", hint="use --host/--port of serve/restore")
        if flag in RESTORE_OWNED_ARGS:
            raise UsageError(f"{flag} is not an engine arg here: the snapshot's engine binds nothing until restore",
                             hint=f"pass {flag} to `vllm-snapshot restore`, serve or switch instead")
        if flag.startswith("--hf-t") and "--hf-token".startswith(flag):  # argparse takes abbreviations
            raise UsageError("--hf-token would put a Hugging Face token into the snapshot's memory (the images), "
                             "and the engine never downloads: it runs offline",
                             hint="download the model first (e.g. `huggingface-cli download`), then create "
                                  "without --hf-token")
        if flag in EARLY_REFUSED and flag in FRONTEND_OPTIONS:  # a front-end option: restore owns it
            raise UsageError(f"{flag} is not taken at create: {EARLY_REFUSED[flag]}",
                             hint=f"create without it; then `vllm-snapshot restore NAME {flag} ...` (or serve/switch)"
                                  + (", or VLLM_API_KEY in restore's environment" if flag == "--api-key" else ""))
        if flag in EARLY_REFUSED:
            raise UsageError(f"{flag}: {EARLY_REFUSED[flag]}; a snapshot made with it could never be restored "
                             "or validated", hint=f"create without {flag}")
    sizes = [(flag, v) for flag, v in _values_of(engine_args, PARALLEL_FLAGS) if v.strip() not in ("1", "")]
    if sizes:
        raise UsageError("a snapshot is of one device: vllm-snapshot supports single-device (TP1) engines only, not "
                         + ", ".join(f"{flag} {v}" for flag, v in sizes),
                         hint="create without the parallel size (or with 1)")
    modes = [v for _flag, v in _values_of(engine_args, ("--logprobs-mode", "--logprobs_mode"))]
    if modes and modes[-1] in ("raw_logits", "processed_logits"):
        raise UsageError(f"--logprobs-mode {modes[-1]}: the oracle compares logprobs in nats; logits break its "
                         "tolerance, so a snapshot made with it could never be validated",
                         hint="create without --logprobs-mode, or with raw_logprobs/processed_logprobs")


#: The option names (long, with ``_`` too, and vLLM's short ones) of every :data:`PARALLEL_SIZES`.
PARALLEL_FLAGS = tuple(f for d, short in zip(PARALLEL_SIZES, ("-tp", "-pp", "-dp", "-pcp", "-dcp"))
                       for f in ("--" + d.replace("_", "-"), "--" + d, short))


def _values_of(engine_args: Sequence[str], flags: Sequence[str]) -> list[tuple[str, str]]:
    """``(flag, value)`` of each of ``flags`` (exact names, one value each) in ``engine_args``,
    in order. Pure."""
    return [(name, vals[0]) for name, _tokens, vals in walk(engine_args, lambda n: 1 if n in flags else None)
            if vals]


def unrestorable(args) -> list[str]:
    """Settings of parsed ``vllm serve`` args (vLLM's argparse namespace) that make a snapshot
    unrestorable or its oracle meaningless, each as ``"--flag: why"``. Pure (over the namespace)."""
    out = [f"--{k.replace('_', '-')}: {why}" for k, why in FRONTEND_REFUSED.items() if getattr(args, k, None)]
    if getattr(args, "speculative_config", None):
        out.append("--speculative-config: speculative decoding (a draft model is not reloaded after sleep, and "
                   "the oracle checks one model only)")
    mode = getattr(args, "logprobs_mode", None)
    if mode in ("raw_logits", "processed_logits"):
        out.append(f"--logprobs-mode {mode}: the oracle compares logprobs in nats; logits break its tolerance")
    return out


def split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(front-end tokens, the rest)`` of ``vllm serve``-style ``args``, order kept within
    each. Pure. A front-end option's values go with it (``--api-key A B``: every following
    token up to the next ``-``-prefixed one)."""
    front: list[str] = []
    rest: list[str] = []
    for _name, tokens, vals in walk(args):
        (rest if vals is None else front).extend(tokens)
    return front, rest


def without_secrets(args: Sequence[str]) -> list[str]:
    """Front-end ``args`` without the options whose values are secrets (:data:`SECRET_DESTS`:
    the API key), order kept: what may be written to disk (the registry's record of what an
    engine serves with). Pure."""
    return [tok for name, tokens, vals in walk(args)
            if not (vals is not None and FRONTEND_OPTIONS[name][0] in SECRET_DESTS) for tok in tokens]


def secrets(args: Sequence[str]) -> list[str]:
    """The tokens of ``args`` that :func:`without_secrets` leaves out (``--api-key K``). Pure."""
    return [tok for name, tokens, vals in walk(args)
            if vals is not None and FRONTEND_OPTIONS[name][0] in SECRET_DESTS for tok in tokens]


def values(args: Sequence[str]) -> dict[str, list[str] | bool]:
    """Front-end tokens as dest -> values (list) or switch state (bool), last one wins. Pure.
    Raises UsageError for a token that is not a front-end option, a switch given a value or an
    option without one."""
    out: dict[str, list[str] | bool] = {}
    for name, tokens, vals in walk(args):
        if vals is None:
            raise UsageError(f"{tokens[0]!r} is not a front-end option")
        dest, arity = FRONTEND_OPTIONS[name]
        if arity == 0:
            if vals:
                raise UsageError(f"{name} takes no value")
            out[dest] = not name.startswith("--no-")
            continue
        if not vals or any(v == "" for v in vals):
            raise UsageError(f"{name} needs a value")
        out[dest] = vals
    return out


def refuse_engine_options(args: Sequence[str], where: str = "restore") -> None:
    """Raise UsageError naming the first option of ``args`` that is not a front-end option
    (an engine option: frozen in the snapshot), an abbreviation of front-end options (naming
    what it could mean), a refused front-end setting (:data:`REFUSED_AT_RESTORE`), restore's
    own ``--host``/``--port``, or a stray value. Values of known options are skipped by their
    arity. Pure."""
    for name, tokens, vals in walk(args):
        if vals is not None:
            continue
        tok = tokens[0]
        if name in REFUSED_AT_RESTORE:
            raise UsageError(f"{name}: {REFUSED_AT_RESTORE[name]}", hint="leave it out")
        if name in ("--host", "--port"):
            raise UsageError(f"{name} is {where}'s own option, not a front-end option to pass on",
                             hint=f"give {name} before any --")
        if not tok.startswith("-"):
            raise UsageError(f"unexpected argument {tok!r}: {where} takes one SNAPSHOT, and what follows it are "
                             "front-end options of `vllm serve` (--flag [value])",
                             hint="engine args are frozen in the snapshot; front-end options are --flag [value]")
        could = sorted(o for o in (*FRONTEND_OPTIONS, *REFUSED_AT_RESTORE) if name.startswith("--") and len(name) > 2
                       and o.startswith(name))
        if could:  # `--api`: vLLM's parser takes abbreviations; frozen options could not be told from them
            raise UsageError(f"{name} is an abbreviation, and abbreviations are not accepted here; it could mean "
                             f"{' or '.join(could)}",
                             hint="spell the option out in full")
        import difflib

        near = difflib.get_close_matches(name, [*FRONTEND_OPTIONS, *OWN_OPTIONS], n=1, cutoff=0.75)
        if near:  # a typo, not an engine option: say so instead of sending the user to re-create
            raise UsageError(f"unknown option {name} (did you mean {near[0]}?)",
                             hint=f"`vllm-snapshot {where} --help` lists its options")
        raise UsageError(
            f"{name} is not an option {where} can apply: engine options are frozen in the snapshot at create",
            hint="front-end options (API key, TLS, CORS, --root-path, logging) are accepted here; for engine "
                 "options create a new snapshot (or use `vllm-snapshot serve MODEL ARGS`, which builds one)")


def is_secret_name(name: str) -> bool:
    """True for variable/flag names that look like they hold a secret (:data:`SECRET_MARKERS`).

    ``TOKEN`` counts only in the last word (``HF_TOKEN``, ``--hf-token``, ``GITHUB_TOKEN``): token
    counts and tokenizer settings (``VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE``,
    ``VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD``, ``--tokenizer``, ``--max-num-batched-tokens``) are
    not secrets and must reach the engine / the manifest unchanged. Pure."""
    up = name.upper().replace("-", "_")
    if any(m in up for m in SECRET_MARKERS):
        return True
    return up.rstrip("_").rsplit("_", 1)[-1].endswith("TOKEN")


def _secret_arity(name: str) -> int | str | None:
    """``"+"`` for a flag whose values must be hidden (a secret-looking name, or an
    abbreviation of :data:`SECRET_FLAGS` of at least 5 characters), else None: every following
    value is hidden, whatever the flag's real arity."""
    if not name.startswith("--"):
        return None
    if is_secret_name(name[2:]) or (len(name) >= 5 and any(s.startswith(name) for s in SECRET_FLAGS)):
        return "+"
    return None


def redact_args(args: Sequence[str]) -> list[str]:
    """Engine args with values of secret-looking flags (``--api-key X``, ``--hf-token=X``,
    abbreviations such as ``--hf-tok X``, and every value of a multi-value flag such as
    ``--api-key k1 k2``) replaced by ``<redacted>`` (rule: :func:`is_secret_name` and
    :data:`SECRET_FLAGS`). Pure."""
    out: list[str] = []
    for name, tokens, vals in walk(args, _secret_arity):
        if vals is None:
            out.extend(tokens)
        elif "=" in tokens[0]:
            out.append(name + "=<redacted>")
        else:
            out.append(tokens[0])
            out += ["<redacted>"] * len(vals)
    return out


def normalize_namespace(got: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, str]:
    """The options of a parsed ``vllm serve`` namespace whose value differs from the parser's
    default: ``{dest: JSON text of the value}``, sorted, without :data:`ARGS_IGNORED`.
    Secret-looking destinations (``hf_token``) keep only a BLAKE3 of their value. Pure."""
    import blake3

    out = {}
    for k in sorted(got):
        if k in ARGS_IGNORED or got[k] == defaults.get(k, object()):
            continue
        text = json.dumps(got[k], sort_keys=True, default=repr)
        out[k] = "blake3:" + blake3.blake3(text.encode()).hexdigest() if is_secret_name(k) else text
    return out


def normalize_args(engine_args: Sequence[str], on_parser=None) -> dict[str, str]:
    """Normalize ``vllm serve`` engine args with vLLM's own parser (imports vLLM: ~16 s on a
    small host): :func:`normalize_namespace` of the parse against the parser's defaults; the
    snapshot key's engine part. The engine program and ``serve`` both call it, so the key
    recorded at create is the one serve computes. ``os.environ`` is as it was before:
    importing vLLM sets variables there (TORCHINDUCTOR_CACHE_DIR=/tmp/..., LD_LIBRARY_PATH,
    PYTORCH_NVML_BASED_CUDA_CHECK, ...) that would reach the engine's environment and the key's
    env part of a create in this process. ``on_parser(parser)``, when given, sees vLLM's parser
    before the parse (``serve`` keeps its option names for the next typo). Raises SystemExit
    (argparse) on args vLLM rejects, UsageError on a stray word (:func:`stray_error`)."""
    import os

    saved = dict(os.environ)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-snapshot serve MODEL"))
        if on_parser is not None:
            on_parser(parser)
        got = vars(parser.parse_args(["--model", "MODEL", *engine_args]))
        if got.get("model_tag") is not None:  # a stray word: vLLM would load it as the model
            raise stray_error([str(got["model_tag"])], "serve")
        base = vars(parser.parse_args(["--model", "MODEL"]))
        return normalize_namespace(got, base)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def memoizable(engine_args: Iterable[str]) -> bool:
    """False when the args name a file whose content the parse depends on (``--config``): those
    are normalized afresh every time. Pure."""
    return not has_flag(engine_args, "--config")
