"""A registry whose certificate comes from a private certificate authority (a trial: every
registry session ignored the environment and passed no ``verify``, so only certifi's public
authorities were trusted and such a registry could not be used at all). Podman's and docker's
``certs.d/HOST:PORT/*.crt`` and ``$REQUESTS_CA_BUNDLE`` / ``$SSL_CERT_FILE`` are honoured now,
against a real docker-registry serving TLS on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT, engine_env
from tls import self_signed
from vllm_snapshot.dev import free_port
from vllm_snapshot.dev.registry_server import BINARY
from vllm_snapshot.errors import EnvironmentProblem
from vllm_snapshot.fleet import transport


def test_the_authority_trusted_for_a_host_is_its_certs_d_then_the_environment_then_the_public_ones(tmp_path):
    d = tmp_path / "certs.d"
    (d / "reg.example:5000").mkdir(parents=True)
    one = d / "reg.example:5000" / "ca.crt"
    one.write_text("-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n")
    assert transport.ca_bundle("reg.example:5000", (d,), environ={}) == str(one)
    assert transport.ca_bundle("other:5000", (d,), environ={}) is True  # certifi's
    env = {"REQUESTS_CA_BUNDLE": str(one)}
    assert transport.ca_bundle("other:5000", (d,), environ=env) == str(one)
    assert transport.ca_bundle("other:5000", (d,), environ={"SSL_CERT_FILE": str(one)}) == str(one)
    # several authorities for one registry: one private bundle holding them all
    (d / "reg.example:5000" / "b.crt").write_text("-----BEGIN CERTIFICATE-----\nBBB\n-----END CERTIFICATE-----\n")
    (d / "reg.example:5000" / "client.key").write_text("not an authority")
    both = Path(transport.ca_bundle("reg.example:5000", (d,), environ={}))
    assert both.read_text().count("BEGIN CERTIFICATE") == 2 and "not an authority" not in both.read_text()
    assert both.stat().st_mode & 0o777 == 0o600
    with pytest.raises(EnvironmentProblem, match=r"\$REQUESTS_CA_BUNDLE names /nonexistent"):
        transport.ca_bundle("other:5000", (d,), environ={"REQUESTS_CA_BUNDLE": "/nonexistent"})


@pytest.fixture()
def tls_registry(tmp_path):
    """docker-registry serving HTTPS on 127.0.0.1 with a self-signed certificate (its own authority)."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    (tmp_path / "storage").mkdir(mode=0o700)
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'storage'}\n"
                   f"http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {cert}\n    key: {key}\n")
    reg = subprocess.Popen([BINARY, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                if requests.get(f"https://127.0.0.1:{port}/v2/", verify=str(cert), timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.05)
        else:
            pytest.fail("docker-registry with TLS did not start")
        yield f"127.0.0.1:{port}", cert
    finally:
        reg.terminate()
        reg.wait()


def _inspect(image: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_snapshot", "inspect", image, "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_a_registry_with_a_private_authority_is_reached_once_that_authority_is_trusted(tls_registry):
    host, cert = tls_registry
    env = {k: v for k, v in engine_env().items() if k not in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")}
    untrusted = _inspect(f"{host}/fleet/tiny:v1", env)
    # exit 11 with the registry named and where to put its authority (was exit 1, "internal")
    assert untrusted.returncode == 11, untrusted.stdout + untrusted.stderr
    refused = json.loads(untrusted.stdout)["error"]
    assert "CERTIFICATE_VERIFY_FAILED" in refused["message"] and host in refused["message"]
    assert f"/etc/containers/certs.d/{host}/ca.crt" in refused["hint"] and "REQUESTS_CA_BUNDLE" in refused["hint"]
    trusted = _inspect(f"{host}/fleet/tiny:v1", {**env, "REQUESTS_CA_BUNDLE": str(cert)})
    out = trusted.stdout + trusted.stderr
    # the TLS handshake passed: what comes back is the registry's own answer (no such tag)
    assert "CERTIFICATE_VERIFY_FAILED" not in out and "SSL" not in out, out[-2000:]
    err = json.loads(trusted.stdout)["error"]
    assert trusted.returncode == 2 and "no such image" in err["message"] and "has no manifest 'v1'" in err["message"], err
    assert os.environ.get("REQUESTS_CA_BUNDLE") != str(cert)  # the test's own process untouched
