"""HTTP to the engine this process just bound: the JSON request helper, ``/health``, and the
canary (one completion of the prompt create recorded for it -- the manifest's ``canary``, else,
in snapshots made before that, the oracle's -- compared with that record,
:func:`vllm_snapshot.store.oracle.compare_http`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ..store.manifest import Manifest
from ..store.oracle import Oracle


def canary_expected(m: Manifest) -> Oracle:
    """What the HTTP canary of ``m`` asks and expects: the manifest's ``canary`` (a short prompt
    create recorded with the oracle's request, so the restore's second forward pass is cheap),
    else the oracle itself (a snapshot made before canaries were recorded). Pure."""
    return m.canary if m.canary is not None else m.oracle


def canary_request(m: Manifest) -> dict:
    """The HTTP canary's body for the prompt of :func:`canary_expected`: the oracle's own
    request -- greedy, exactly one token (``min_tokens`` masks EOS as the in-engine oracle
    does), seeded, token ids returned -- with neutral sampling values sent explicitly, so
    defaults from the model's ``generation_config.json`` (which vLLM's server applies to
    requests, not to the engine's own oracle) cannot change it. Pure."""
    return {"model": m.model.served_name, "prompt": canary_expected(m).prompt, "max_tokens": 1, "min_tokens": 1,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "logprobs": 5,
            "return_token_ids": True}


def http_json(url: str, body: dict | None = None, timeout: float = 30.0,
               api_key: str | None = None) -> tuple[int, dict | str]:
    """POST ``body`` (or GET) ``url``; (status, parsed JSON or text). ``https://`` URLs are not
    certificate-checked: they are the listener this process bound itself a moment ago (the
    certificate's names need not include the loopback address we connect to). Raises
    URLError/OSError."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    ctx = None
    if url.startswith("https://"):
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            raw = r.read().decode()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def health(url: str) -> bool:
    """True when ``url/health`` answers 200 (within 2 s)."""
    try:
        status, _ = http_json(f"{url}/health", timeout=2)
        return status == 200
    except (urllib.error.URLError, OSError):
        return False


def canary(url: str, m: Manifest, api_key: str | None = None) -> list[str]:
    """Differences between an HTTP completion (:func:`canary_request`) and what create recorded
    for it (:func:`canary_expected`); a failed or malformed answer is one difference."""
    from ..store import oracle

    try:
        status, body = http_json(f"{url}/v1/completions", canary_request(m), api_key=api_key)
    except (urllib.error.URLError, OSError) as e:
        return [f"canary request failed: {e}"]
    if status != 200 or not isinstance(body, dict):
        return [f"canary request failed: HTTP {status}: {str(body)[:200]}"]
    try:
        choice = body["choices"][0]
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or [None]
        ids = choice.get("token_ids") or [None]
        return oracle.compare_http(canary_expected(m), choice.get("text"), lps[0], ids[0])
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        return [f"canary response is malformed ({type(e).__name__}: {e}): {str(body)[:200]}"]
