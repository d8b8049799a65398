"""A Hugging Face id from the local cache (never downloaded): resolved at the requested
revision, recorded, and served under its id as `vllm serve org/model` would (real engine +
CRIU)."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from vllm_snapshot.store import manifest as mf

from conftest import EAGER_ARGS, TINY, cli, engine_env
from helpers import readable_by_engine
from test_integration import free_port, post

pytestmark = pytest.mark.integration
REV = "0123456789abcdef0123456789abcdef01234567"


def test_hf_id_served_by_its_id_at_its_revision(tmp_path, engine_tmp):
    hub = engine_tmp / "hub"
    snap_dir = hub / "models--acme--tiny" / "snapshots" / REV
    snap_dir.mkdir(parents=True)
    for f in TINY.iterdir():
        shutil.copy2(f, snap_dir / f.name)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text(REV)
    readable_by_engine(hub)  # the engine runs as the unprivileged engine user
    env = {**engine_env(), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    args = [a for a in EAGER_ARGS]
    i = args.index("--served-model-name")
    del args[i:i + 2]  # served under the id by default
    out = tmp_path / "snap"
    # a revision the cache does not hold: refused before the engine starts
    bad = cli("create", "acme/tiny", "--snapshot-dir", str(out), "--", *args, "--revision", "v9", env=env, timeout=120)
    assert bad.returncode == 2 and "revision 'v9'" in bad.stderr, bad.stderr[-2000:]
    assert not out.exists()
    cli("create", "acme/tiny", "--snapshot-dir", str(out), "--", *args, "--revision", "main", env=env, timeout=600,
        check=True)
    m = mf.read(out)
    assert m.model.requested == "acme/tiny" and m.model.revision == REV and m.model.served_name == "acme/tiny"
    port = free_port()
    r = json.loads(cli("restore", str(out), "--port", str(port), "--detach", "--json", env=env, timeout=300,
                       check=True).stdout)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
            assert [d["id"] for d in json.loads(resp.read())["data"]] == ["acme/tiny"]
        body = post(f"http://127.0.0.1:{port}/v1/completions", {"model": "acme/tiny", "prompt": "Hi", "max_tokens": 1})
        assert body["model"] == "acme/tiny"
    finally:
        cli("stop", "--port", str(port), env=env, timeout=120)
    assert r["pid"]
