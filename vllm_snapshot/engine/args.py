"""The rules about ``vllm serve`` engine args, read lexically and without vLLM (importing its
parser costs ~10-16 s): the one owner of what a token means here. Its users: create and serve
(:func:`check_engine_args`, :func:`arg_value`), the GPU check of restore (:func:`last_value`),
the snapshot key (:func:`has_flag`), restore's front-end split (:data:`FRONTEND_OPTIONS`,
:func:`flag_name`), the engine root's own parse and the key's normalization
(:func:`unrestorable`, :data:`PARALLEL_SIZES`, :func:`argparse_reason`). The engine's parse
with vLLM's parser (``engine/main.py``) stays the authority for what vLLM accepts; these rules
refuse early what would make a snapshot unrestorable, before any engine starts.

Pure, and imports only :mod:`vllm_snapshot.errors` (a layer-1 leaf: tests/test_layering.py).
Secrets in args (``--api-key`` values in logs) are :mod:`vllm_snapshot.host.envpolicy`'s rule
(``redact_args``), with the secret names of the environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import UsageError

#: ``vllm serve`` options that belong to restore: the snapshot's engine binds nothing until
#: restore, which takes the address from its own ``--host``/``--port``.
RESTORE_OWNED_ARGS = ("--host", "--port", "--uds")

#: Front-end options (the HTTP server's, not the engine's), given at restore/serve/switch:
#: flag -> (dest, arity): 0 a switch (with its ``--no-`` form where vLLM has one), 1 one
#: value, "+" one or more values. vLLM 0.32 ``vllm/entrypoints/launchers/cli_args.py``
#: (FrontendArgs) and ``vllm/engine/arg_utils.py`` (``--enable-log-requests``);
#: tests/test_frontend.py checks the table against vLLM's own parser.
FRONTEND_OPTIONS: dict[str, tuple[str, int | str]] = {
    "--api-key": ("api_key", "+"),
    "--ssl-keyfile": ("ssl_keyfile", 1),
    "--ssl-certfile": ("ssl_certfile", 1),
    "--ssl-ca-certs": ("ssl_ca_certs", 1),
    "--ssl-ciphers": ("ssl_ciphers", 1),
    "--enable-ssl-refresh": ("enable_ssl_refresh", 0),
    "--no-enable-ssl-refresh": ("enable_ssl_refresh", 0),
    "--allowed-origins": ("allowed_origins", 1),
    "--allowed-methods": ("allowed_methods", 1),
    "--allowed-headers": ("allowed_headers", 1),
    "--allow-credentials": ("allow_credentials", 0),
    "--no-allow-credentials": ("allow_credentials", 0),
    "--root-path": ("root_path", 1),
    "--uvicorn-log-level": ("uvicorn_log_level", 1),
    "--disable-uvicorn-access-log": ("disable_uvicorn_access_log", 0),
    "--no-disable-uvicorn-access-log": ("disable_uvicorn_access_log", 0),
    "--disable-access-log-for-endpoints": ("disable_access_log_for_endpoints", 1),
    "--enable-log-requests": ("enable_log_requests", 0),
    "--no-enable-log-requests": ("enable_log_requests", 0),
    "--enable-request-id-headers": ("enable_request_id_headers", 0),
    "--no-enable-request-id-headers": ("enable_request_id_headers", 0),
    "--disable-fastapi-docs": ("disable_fastapi_docs", 0),
    "--no-disable-fastapi-docs": ("disable_fastapi_docs", 0),
    "--h11-max-incomplete-event-size": ("h11_max_incomplete_event_size", 1),
    "--h11-max-header-count": ("h11_max_header_count", 1),
}

#: Every parallel size of vLLM 0.32's engine args; a snapshot is of one device.
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                  "prefill_context_parallel_size", "decode_context_parallel_size")
#: Front-end settings refused at create, dest -> why: secrets and TLS belong to restore
#: (:mod:`vllm_snapshot.supervise.frontend`), the rest can never be validated by the canary.
FRONTEND_REFUSED = {
    "api_key": "an API key would be frozen into the snapshot's memory; give it to restore/serve instead "
               "(--api-key, or VLLM_API_KEY in their environment)",
    "ssl_keyfile": "TLS is set up when the server starts; give the TLS options to restore/serve instead",
    "ssl_certfile": "TLS is set up when the server starts; give the TLS options to restore/serve instead",
    "ssl_ca_certs": "TLS is set up when the server starts; give the TLS options to restore/serve instead",
    "uds": "a unix socket listener (restore binds --host/--port)",
    "middleware": "custom middleware (it may reject or change the canary)",
}
#: The same, by flag, for create's early check (exact flag names; the engine-side check,
#: :func:`unrestorable` over vLLM's parse, also catches abbreviations): flag -> reason.
EARLY_REFUSED = {"--" + k.replace("_", "-"): why for k, why in FRONTEND_REFUSED.items()}
EARLY_REFUSED["--speculative-config"] = "speculative decoding (a draft model is not reloaded after sleep)"


def flag_name(token: str) -> str:
    """The option name of one token: ``"--flag=V"`` -> ``"--flag"``; any other token as is. Pure."""
    return token.split("=", 1)[0]


def arg_value(engine_args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``vllm serve`` args (``--flag V`` or ``--flag=V``), last one
    wins; None when absent (or given last with no value). Exact names only. Pure."""
    val = None
    for i, a in enumerate(engine_args):
        if a == flag and i + 1 < len(engine_args):
            val = engine_args[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


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


def check_engine_args(engine_args: Sequence[str]) -> None:
    """Refuse engine args the snapshot could only record and ignore, and (early, before the
    engine starts) the settings that make a snapshot unrestorable -- the engine's parse
    (:func:`unrestorable` over vLLM's namespace, in ``engine/main.py``) stays the authority,
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
