"""The fleet over a real, shaped link (issue 40), real vLLM + CRIU + Debian's docker-registry.

The registry runs in a network namespace of its own, the "nodes" in another, joined by a veth
pair shaped on both ends (tests/shaped_link.py: rate with ``tbf``, loss with an nftables
rule, the one-way delay in a relay because this kernel has no ``sch_netem``). Each node is, as
in tests/test_fleet_integration.py, a process in its own mount + UTS namespaces with another
/etc/machine-id and hostname and an empty store. Across the link: a push, a pull (timed, and
bounded below by what the link's rate allows: the shaping is real), and ``serve --registry``
on an empty node, which pulls and restores and answers a completion inside the node's
namespace. The link's counters prove the bytes crossed it and that packets were dropped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ENGINE_ARGS, ROOT, TINY, cli, engine_env
from shaped_link import ShapedLink
from test_fleet_integration import _clone, _node_script, _private, _stop
from test_integration import free_port

pytestmark = pytest.mark.integration

RATE_MBIT, LOSS_PCT, DELAY_MS = 1000, 1, 20


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    lk = ShapedLink(tmp_path_factory.mktemp("link"), rate_mbit=RATE_MBIT, loss_pct=LOSS_PCT, delay_ms=DELAY_MS)
    yield lk
    lk.close()


def _node(link: ShapedLink, cmds: list[list[str]], name: str, timeout: float = 900) -> tuple[list[dict], float]:
    """Run vllm-snapshot ``cmds`` on a node called ``name`` behind the link; (their JSON
    outputs, seconds). Asserts they succeeded."""
    mid = "".join(f"{b:02x}" for b in name.encode())[:32].ljust(32, "0")
    t0 = time.monotonic()
    try:
        p = subprocess.run(link.on_node(_node_script(cmds, mid, name)), capture_output=True, text=True,
                           timeout=timeout, env=engine_env(), cwd=ROOT)
    finally:
        Path(f"/var/tmp/vsnap-machine-id-{os.getpid()}-{name}").unlink(missing_ok=True)
    took = time.monotonic() - t0
    assert p.returncode == 0, f"{name}: {p.stdout[-2000:]}\n{p.stderr[-5000:]}"
    return [json.loads(x) for x in re.findall(r"^\{.*?^\}$|^\{.*\}$", p.stdout, re.M | re.S)], took


def _completion_on_node(link: ShapedLink, port: int) -> dict:
    code = ("import json, requests; r = requests.post('http://127.0.0.1:%d/v1/completions', json={'model': "
            "'tiny-llama', 'prompt': 'Once upon a time', 'max_tokens': 4, 'temperature': 0.0, 'logprobs': 2, "
            "'seed': 0}, timeout=120); r.raise_for_status(); print(json.dumps(r.json()))" % port)
    p = subprocess.run(link.on_node([sys.executable, "-c", code]),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)["choices"][0]


def test_push_pull_and_serve_with_a_registry_across_a_shaped_link(snapshot, link, tmp_path):
    print(f"link: {link.describe()}")
    rtt = link.round_trip()
    assert rtt >= 2 * DELAY_MS / 1000, rtt  # the delay is there: a request and its answer cross once each
    key = json.loads((snapshot / "manifest.json").read_text())["key"]
    key = key["value"] if isinstance(key, dict) else key
    repo = f"{link.host}/fleet/link"
    image = f"{repo}:{key}"
    # node A pushes a copy of the session snapshot
    copy = _clone(snapshot, tmp_path / "a" / "tiny")
    (pushed,), push_wall = _node(link, [["push", str(copy), image, "--plain-http", "--json"]], "node-a")
    sent_before = link.qdisc_sent("node")
    assert pushed["sent_bytes"] > 0 and sent_before >= pushed["sent_bytes"], (pushed, sent_before)
    # node B pulls it into an empty store: no faster than the link's rate allows
    root_b = _private(tmp_path / "store-b")
    (reg_sent, held), drops = link.qdisc_stats("reg"), link.dropped("reg")
    (pulled,), pull_wall = _node(link, [["--root", str(root_b), "pull", image, "--plain-http", "--name", "tiny",
                                         "--json"]], "node-b")
    assert pulled["digest"] == pushed["digest"] and pulled["fetched_bytes"] > 0
    sent, held_now = link.qdisc_stats("reg")
    assert sent - reg_sent >= pulled["fetched_bytes"], (sent - reg_sent, pulled)  # every byte came over the veth
    assert held_now > held, "the rate limit never held a packet of the pull back"
    floor_s = pulled["fetched_bytes"] * 8 / (RATE_MBIT * 1e6)
    assert pulled["seconds"] >= floor_s * 0.9, (pulled["seconds"], floor_s)  # no faster than the rate
    assert link.dropped("reg") > drops, "the loss rule dropped no packet of the pull"
    cli("--root", str(root_b), "verify", "tiny", check=True)
    # node C: serve --registry on an empty store pulls (across the link) and restores
    root_c = _private(tmp_path / "store-c")
    port = free_port()  # in the node's namespace; free here too, so no registry entry names it
    (served,), serve_wall = _node(link, [["--root", str(root_c), "serve", str(TINY), "--port", str(port),
                                          "--detach", "--json", "--registry", repo, "--plain-http", "--",
                                          *ENGINE_ARGS]], "node-c")
    try:
        assert served["path"] == "pulled" and served["key"] == key and served["push_s"] is None, served
        assert "engine_start" not in served["timings"]
        c = _completion_on_node(link, port)
        assert len(c["logprobs"]["token_logprobs"]) == 4
    finally:
        _stop(served["pid"])
    print(f"round trip {rtt * 1000:.1f} ms; push {pushed['sent_bytes'] / 1e6:.0f} MB in {pushed['seconds']:.1f} s ({push_wall:.1f} s wall); "
          f"pull {pulled['fetched_bytes'] / 1e6:.0f} MB in {pulled['seconds']:.1f} s ({pulled['MB_s']} MB/s, "
          f"floor {floor_s:.1f} s, {pull_wall:.1f} s wall); serve --registry {serve_wall:.1f} s wall "
          f"({served['total_s']} s); drops reg/node {link.dropped('reg')}/{link.dropped('node')}")
