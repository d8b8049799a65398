"""The fleet over a bad network with a real snapshot (issue 40): the session snapshot pushed
and pulled by the CLI through tests/faultproxy.py in front of Debian's docker-registry -- a
registry that wants bearer tokens and expires one mid-push and one mid-pull, a body limit
(the 256 MiB parts go up in PATCH chunks), connections reset and stalled in the middle of
blobs, a resume answered 416. Both commands exit 0, the pulled copy verifies, and the pull
fetched every byte it needed (the component tests of each fault: tests/test_fleet_net.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import requests

from conftest import cli, engine_env
from faultproxy import Fault, FaultProxy
from vllm_snapshot.dev.registry_server import RegistryServer
from vllm_snapshot.fleet import oci

pytestmark = pytest.mark.integration


def test_push_and_pull_of_a_real_snapshot_through_resets_stalls_a_body_limit_and_expiring_tokens(snapshot, tmp_path):
    store_a = tmp_path / "a"
    store_a.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    copy = store_a / "tiny"
    subprocess.run(["cp", "-al", str(snapshot), str(copy)], check=True)
    env = {**engine_env(), "VLLM_SNAPSHOT_NET_TIMEOUT": "3", "VLLM_SNAPSHOT_NET_BACKOFF": "0.05"}
    reg = RegistryServer(tmp_path / "registry")
    try:
        with FaultProxy(reg.host, token_auth=True, body_limit=32 << 20) as px:
            px.add(Fault("expire-token", method="PATCH", skip=2),
                   Fault("reset", method="PATCH", after=5 << 20, skip=4),
                   Fault("reset", method="PUT", path="/blobs/uploads/", after=100_000))
            image = f"{px.host}/fleet/net:v1"
            p = cli("push", str(copy), image, "--plain-http", "--json", env=env)
            assert p.returncode == 0, p.stderr[-3000:]
            pushed = json.loads(p.stdout)
            assert any("413" in w for w in pushed["warnings"]), pushed["warnings"]
            assert [e["fault"] for e in px.log].count("expire-token") == 1
            tokens_after_push = px.token_requests
            assert tokens_after_push == 2  # the first one, one after the expiry: not one per thread
            px.clear()
            man = requests.get(f"http://{reg.host}/v2/fleet/net/manifests/v1", timeout=30,
                               headers={"Accept": oci.OCI_MANIFEST}).json()
            big = [x["digest"] for x in man["layers"] if x["size"] >= 4 << 20 and x["mediaType"] != oci.WEIGHTS_TYPE]
            assert len(big) >= 2, [(x["mediaType"], x["size"]) for x in man["layers"]]
            faults = [Fault("stall", method="GET", path=big[0], after=1 << 20, seconds=60, ranged=False)]
            faults += [Fault("reset", method="GET", path=d, after=3 << 20, ranged=False) for d in big[1:4]]
            px.add(*faults, Fault("expire-token", method="GET", path="/blobs/", skip=3),
                   Fault("range416", method="GET", times=1))
            root = tmp_path / "b"
            root.mkdir(mode=0o700)
            p = cli("--root", str(root), "pull", image, "--plain-http", "--name", "tiny", "--json", env=env)
            assert p.returncode == 0, p.stderr[-3000:]
            got = json.loads(p.stdout)
            assert got["digest"] == pushed["digest"]
            assert got["fetched_bytes"] + got["reused_bytes"] >= got["bytes"]
            assert px.token_requests == tokens_after_push + 2
            cuts = [e for e in px.log if e["method"] == "GET" and e["fault"] in ("reset", "stall")]
            assert len(cuts) == len(faults), px.log
            assert any("ranges" in w for w in got["warnings"]), got["warnings"]
            assert sorted(os.listdir(root)) == ["tiny"]
            cli("--root", str(root), "verify", "tiny", check=True)
    finally:
        reg.stop()
