"""Front-end options: the ``vllm serve`` options that change the HTTP server and not the engine
(API key, TLS, CORS, root path, uvicorn logging, request logging), given at **restore** (and
``serve``/``switch``) and applied when the server starts after the oracle matched.

Why at restore: an option given at create is frozen into the snapshot's memory -- an API key
would sit in the images in clear, and every restore would serve with it. The engine's state
does not depend on them, so the restoring command owns them, like ``--host``/``--port``.

Who parses what:

* Lexically and without vLLM (importing its parser costs ~10-16 s), in
  :mod:`vllm_snapshot.engine.args`, the owner of the engine-argument table and its one walker:
  which tokens are front-end options (``split``), their values (``values``), what restore
  refuses (``refuse_engine_options``), so ``restore`` can refuse an engine option before CRIU
  and ``serve`` can keep them out of the snapshot key; then, here, :func:`check` validates
  values and files (TLS key and certificate load together, JSON lists, log levels) before CRIU.
* In the restored engine (``entrypoints/engine_root.py``): vLLM's own parser, kept from create, parses
  the same tokens into its namespace; the OpenAI app is rebuilt with vLLM's ``build_app``
  when an option it reads changed.

Secrets: API keys travel only through the engine's control pipe (never on a command line the
CLI builds, never in the registry, the manifest or a log). ``VLLM_API_KEY`` in the restoring
command's environment is used when no ``--api-key`` is given, as ``vllm serve`` does.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass, field

# the walker and the tables are the engine-argument owner's; split, values, secrets,
# without_secrets and refuse_engine_options are used here under the front end's name too
from ..engine.args import (FRONTEND_OPTIONS, flag_name, refuse_engine_options, secrets,  # noqa: F401
                           split, values, walk, without_secrets)
from ..errors import UsageError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: systemd credential name read for the API key when ``VLLM_API_KEY`` is unset
#: (``LoadCredential=vllm-api-key:/etc/vllm-snapshot/NAME.key``; systemd.exec(5), "Credentials")
CREDENTIAL = "vllm-api-key"


@dataclass
class Frontend:
    """What :func:`check` made of the front-end tokens. ``args``: the tokens to hand to the
    engine (with ``VLLM_API_KEY`` turned into ``--api-key``); ``api_keys``: the keys the
    canary may present (first one used); ``tls``: the server speaks HTTPS; ``files``: the TLS
    files the engine opens when it starts serving."""

    args: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)
    tls: bool = False
    files: list[str] = field(default_factory=list)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def describe(self) -> list[str]:
        """The settings in words, secret values never included (for logs and ``--json``)."""
        out = []
        if self.api_keys:
            out.append("API key required")
        if self.tls:
            out.append("TLS")
        flags = [flag_name(a) for a in self.args if a.startswith("--")]
        out += sorted({f for f in flags
                       if FRONTEND_OPTIONS.get(f, ("",))[0] not in ("api_key", "ssl_keyfile", "ssl_certfile")})
        return out


def _digest(salt: str, text: str) -> str:
    import blake3

    return f"{salt}:{blake3.blake3((salt + text).encode()).hexdigest()[:32]}"


def fingerprint(args: list[str], salt: str | None = None) -> str:
    """``SALT:DIGEST``: a salted BLAKE3 of the settings the front-end tokens ``args`` make (API
    key included; each setting once, last one wins, in a fixed order, so ``--a X --b Y`` and
    ``--b Y --a X`` are one), so that ``switch`` can tell whether an engine already serves
    with exactly these settings without anything recording the key itself. ``salt``: 16 hex
    digits, random when None. Pure when ``salt`` is given. Raises UsageError for tokens that
    are not front-end options (:func:`check` refuses those first)."""
    salt = salt or os.urandom(8).hex()
    return _digest(salt, json.dumps(sorted(values(list(args)).items())))


def same_settings(args: list[str], fp: str) -> bool:
    """True when ``fp`` (a :func:`fingerprint`) was made from the settings of ``args``; an
    empty ``fp`` (an engine registered before fingerprints) counts as "no options". A
    fingerprint of the token list itself (versions before settings were digested) counts
    too. Pure."""
    if not fp:
        return not args
    salt = fp.split(":", 1)[0] if ":" in fp else ""
    return bool(salt) and fp in (fingerprint(args, salt), _digest(salt, json.dumps(list(args))))


def carry(given: list[str], recorded: list[str]) -> tuple[list[str], list[str]]:
    """What an engine that replaces another (``switch``) serves with: each option of
    ``recorded`` (the front-end tokens the old engine was restored with) whose setting
    ``given`` does not name, then ``given`` -- an option given replaces the recorded one of the
    same setting (``--no-allow-credentials`` replaces ``--allow-credentials``). Returns
    ``(tokens, the flags carried over)``. Tokens of ``recorded`` that are not front-end options
    here (a newer vllm-snapshot's) are left out. Pure."""
    named = {FRONTEND_OPTIONS[name][0] for name, _tokens, vals in walk(given) if vals is not None}
    kept: list[str] = []
    flags: list[str] = []
    for name, tokens, vals in walk(recorded):
        if vals is None or FRONTEND_OPTIONS[name][0] in named:
            continue
        kept.extend(tokens)
        flags.append(name)
    return kept + list(given), flags


def check(args: list[str], environ: dict[str, str] | None = None) -> Frontend:
    """Validate front-end tokens before CRIU runs and return a :class:`Frontend`. An API key
    comes from ``--api-key``, else ``VLLM_API_KEY`` in ``environ``, else the systemd credential
    :data:`CREDENTIAL` (a file in ``$CREDENTIALS_DIRECTORY``). TLS needs both
    ``--ssl-keyfile`` and ``--ssl-certfile``, which must load together (Python's ``ssl``);
    ``--ssl-ca-certs`` must be readable PEM, ``--ssl-ciphers`` an OpenSSL cipher list that selects
    at least one cipher; CORS lists are JSON lists of strings. Raises
    UsageError naming the option and what to do."""
    refuse_engine_options(args)
    vals = values(args)
    out = Frontend(args=list(args))
    env = environ or {}
    key = env.get("VLLM_API_KEY", "")
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if not key and cred_dir and os.path.isfile(os.path.join(cred_dir, CREDENTIAL)):
        with open(os.path.join(cred_dir, CREDENTIAL)) as f:  # systemd LoadCredential=
            key = f.read().strip()
    if "api_key" in vals:
        out.api_keys = list(vals["api_key"])  # type: ignore[arg-type]
    elif key:
        out.api_keys = [key]
        out.args += ["--api-key", key]
    keyfile = (vals.get("ssl_keyfile") or [None])[-1]  # type: ignore[index]
    certfile = (vals.get("ssl_certfile") or [None])[-1]  # type: ignore[index]
    if bool(keyfile) != bool(certfile):
        raise UsageError("TLS needs both --ssl-keyfile and --ssl-certfile", hint="give the key and its certificate")
    for dest in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        for p in vals.get(dest) or []:  # type: ignore[union-attr]
            if not os.path.isfile(p) or not os.access(p, os.R_OK):
                raise UsageError(f"--{dest.replace('_', '-')} {p}: no readable file there")
            out.files.append(p)
    if certfile:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, OSError) as e:
            raise UsageError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile} do not load as a TLS key pair: {e}",
                             hint="give a PEM certificate and the private key that belongs to it") from e
        out.tls = True
    # what uvicorn does with them when it builds its SSL context (uvicorn/config.py
    # create_ssl_context): a bad value would otherwise fail after CRIU, the oracle and the bind
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for ca in vals.get("ssl_ca_certs") or []:  # type: ignore[union-attr]
        try:
            ctx.load_verify_locations(ca)
        except (ssl.SSLError, OSError) as e:
            raise UsageError(f"--ssl-ca-certs {ca}: not PEM CA certificates ({e})",
                             hint="give a file of PEM certificates, or leave the option out") from e
    for ciphers in vals.get("ssl_ciphers") or []:  # type: ignore[union-attr]
        try:
            ctx.set_ciphers(ciphers)
        except ssl.SSLError as e:
            raise UsageError(f"--ssl-ciphers {ciphers!r}: OpenSSL selects no cipher from it ({e})",
                             hint="give an OpenSSL cipher list, e.g. 'ECDHE+AESGCM', or leave the option out "
                                  "for uvicorn's default") from e
    for dest in ("allowed_origins", "allowed_methods", "allowed_headers"):
        for v in vals.get(dest) or []:  # type: ignore[union-attr]
            try:
                parsed = json.loads(v)
            except ValueError:
                parsed = None
            if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
                raise UsageError(f"--{dest.replace('_', '-')} {v!r}: expected a JSON list of strings",
                                 hint='e.g. --allowed-origins \'["https://app.example"]\'')
    for v in vals.get("uvicorn_log_level") or []:  # type: ignore[union-attr]
        if v not in LOG_LEVELS:
            raise UsageError(f"--uvicorn-log-level {v!r}: expected one of {', '.join(LOG_LEVELS)}")
    for dest in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        for v in vals.get(dest) or []:  # type: ignore[union-attr]
            if not v.isdigit() or int(v) <= 0:
                raise UsageError(f"--{dest.replace('_', '-')} {v!r}: expected a positive integer")
    return out
