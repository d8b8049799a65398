"""Fleet end to end (issue 31), real vLLM + CRIU + a real registry (Debian's docker-registry,
CNCF distribution 2.8, on 127.0.0.1 with filesystem storage in a temp dir and its access log
captured). One push of a hard-linked copy of the session snapshot is shared by the module;
tests that damage or interrupt a registry get their own.

A second "node" is a process in its own mount + UTS namespaces with another /etc/machine-id
(bind-mounted) and hostname, and an empty store: pull and restore run there."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import EAGER_ARGS, ENGINE_ARGS, ROOT, TINY, cli, engine_env
from vllm_snapshot.dev.registry_server import RegistryServer
from test_fleet import _keypair
from test_integration import free_port, post

pytestmark = pytest.mark.integration

REPO = "fleet/tiny"


def _private(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def _listed(root: Path) -> list[str]:
    p = cli("--root", str(root), "list", "--json", check=True)
    return [s["name"] if isinstance(s, dict) and "name" in s else s for s in _snapshots_of(json.loads(p.stdout))]


def _snapshots_of(doc) -> list:
    return doc.get("snapshots", doc) if isinstance(doc, dict) else doc


def _tag_resolves(reg: RegistryServer, tag: str, repo: str = REPO) -> bool:
    r = requests.get(f"http://{reg.host}/v2/{repo}/manifests/{tag}",
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    return r.status_code == 200


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    r = RegistryServer(tmp_path_factory.mktemp("registry"))
    yield r
    r.stop()


@pytest.fixture
def own_registry(tmp_path):
    r = RegistryServer(tmp_path / "own-registry")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    good = _keypair(d, "good")
    other = _keypair(d, "other")
    return {"key": good[0], "pub": good[1], "other_pub": other[1]}


def _clone(snapshot: Path, where: Path) -> Path:
    _private(where.parent)
    subprocess.run(["cp", "-al", str(snapshot), str(where)], check=True)
    return where


@pytest.fixture(scope="module")
def pushed(snapshot, registry, keys, tmp_path_factory):
    """A copy of the session snapshot pushed (signed) to ``REPO:v1``, then deleted locally."""
    copy = _clone(snapshot, tmp_path_factory.mktemp("node-a") / "store" / "tiny-copy")
    p = cli("push", str(copy), f"{registry.host}/{REPO}:v1", "--plain-http", "--sign-key", str(keys["key"]),
            "--json", check=True)
    result = json.loads(p.stdout)
    cli("delete", str(copy), check=True)
    assert not copy.exists()
    return {"image": f"{registry.host}/{REPO}:v1", "digest": result["digest"], "result": result}


def _node_script(cmds: list[list[str]], machine_id: str, hostname: str, binds: dict[str, str] | None = None) -> list[str]:
    """argv running ``cmds`` (each a vllm-snapshot argv) one after another in a new mount + UTS
    namespace whose /etc/machine-id holds ``machine_id`` and whose hostname is ``hostname``;
    ``binds`` {source: target} are bind-mounted there first."""
    import shlex

    mid = Path(f"/var/tmp/vsnap-machine-id-{os.getpid()}-{hostname}")
    mid.write_text(machine_id + "\n")
    lines = ["set -e", f"mount --bind {shlex.quote(str(mid))} /etc/machine-id", f"hostname {shlex.quote(hostname)}"]
    for src, dst in (binds or {}).items():
        lines.append(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}")
    for argv in cmds:
        lines.append(" ".join(shlex.quote(a) for a in [sys.executable, "-m", "vllm_snapshot", *argv]))
    return ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", "\n".join(lines)]


def on_node(cmds: list[list[str]], machine_id: str = "b" * 32, hostname: str = "node-b",
            binds: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(_node_script(cmds, machine_id, hostname, binds), capture_output=True, text=True,
                              timeout=timeout, env=engine_env(), cwd=ROOT)
    finally:
        Path(f"/var/tmp/vsnap-machine-id-{os.getpid()}-{hostname}").unlink(missing_ok=True)


def completion(port: int) -> dict:
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0,
            "logprobs": 2, "seed": 0}
    c = post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]
    return {"text": c["text"], "logprobs": c["logprobs"]["token_logprobs"]}


def _stop(pid: int) -> None:
    procs = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    cli("stop", "--pid", str(pid), timeout=120)
    psutil.wait_procs(procs, timeout=30)


def test_pull_on_another_node_restores_with_the_same_oracle_and_completion(snapshot, registry, pushed, keys,
                                                                          tmp_path):
    root_b = _private(tmp_path / "node-b-store")
    port_b, port_a = free_port(), free_port()
    mark = len(registry.requests_log())
    p = on_node([["--root", str(root_b), "pull", pushed["image"], "--plain-http", "--name", "tiny",
                  "--verify-key", str(keys["pub"]), "--json"],
                 ["--root", str(root_b), "restore", "tiny", "--port", str(port_b), "--detach", "--json"],
                 ["--root", str(root_b), "inspect", "tiny", "--json"]])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    docs = [json.loads(x) for x in re.findall(r"^\{.*?^\}$|^\{.*\}$", p.stdout, re.M | re.S)]
    pulled, restored, inspected = docs[0], docs[1], docs[2]
    assert pulled["digest"] == pushed["digest"] and pulled["verified_by"].startswith("sha256:")
    assert restored["oracle"] == "match" and not restored["warnings"], restored  # no --allow-mismatch needed
    try:
        got = completion(port_b)
    finally:
        _stop(restored["pid"])
    # where it was built (this host) and where it was pulled from, both shown
    assert inspected["pulled"]["image"] == pushed["image"] and inspected["pulled"]["hostname"] == "node-b"
    assert inspected["pulled"]["machine_id"] == "b" * 32
    assert inspected["built"]["machine_id"] == Path("/etc/machine-id").read_text().strip()
    # every layer but the weights file's: on this one machine the session snapshot's weights file
    # is at its recorded path, so the "node" has it (tests/test_fleet_weights_integration.py pulls
    # onto a node without it)
    assert pulled["weights_reused"] == "present" and pulled["weights_fetched_bytes"] == 0
    assert len(registry.blob_gets(mark)) >= pushed["result"]["blobs"] - _weights_layers(registry, "v1")
    # the original, restored here, answers the same
    r = cli("restore", str(snapshot), "--port", str(port_a), "--detach", "--json", check=True)
    a = json.loads(r.stdout)
    try:
        assert completion(port_a) == got
    finally:
        _stop(a["pid"])


def test_a_kernel_that_differs_is_refused_before_any_blob(registry, pushed, tmp_path):
    raw = requests.get(f"http://{registry.host}/v2/{REPO}/manifests/v1",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).content
    doc = json.loads(raw)
    here = doc["annotations"]["org.vllm-snapshot.class.kernel"]
    doc["annotations"]["org.vllm-snapshot.class.kernel"] = "5.4.0-other"
    r = requests.put(f"http://{registry.host}/v2/{REPO}/manifests/otherkernel", data=json.dumps(doc),
                     headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    assert r.status_code == 201, r.text
    root = _private(tmp_path / "store")
    mark = len(registry.requests_log())
    p = cli("--root", str(root), "pull", f"{registry.host}/{REPO}:otherkernel", "--plain-http")
    assert p.returncode == 3, p.stderr
    assert "kernel" in p.stderr and "5.4.0-other" in p.stderr and here in p.stderr
    assert registry.blob_gets(mark) == []
    assert _listed(root) == [] and os.listdir(root) == []
    # inspect IMAGE reads only the manifest
    p = cli("inspect", f"{registry.host}/{REPO}:otherkernel", "--plain-http", "--json", check=True)
    assert json.loads(p.stdout)["annotations"]["org.vllm-snapshot.class.kernel"] == "5.4.0-other"
    assert registry.blob_gets(mark) == []


def test_other_model_bytes_at_the_recorded_path_are_refused_before_any_blob(registry, pushed, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(TINY, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["_fleet_test"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    root = _private(tmp_path / "store")
    mark = len(registry.requests_log())
    p = on_node([["--root", str(root), "pull", pushed["image"], "--plain-http"]], binds={str(other): str(TINY)})
    assert p.returncode == 4, p.stderr
    assert str(TINY) in p.stderr and "other model bytes" in p.stderr
    assert registry.blob_gets(mark) == []
    assert os.listdir(root) == []


def test_unsigned_or_wrongly_signed_is_refused(registry, pushed, keys, tmp_path):
    root = _private(tmp_path / "store")
    p = cli("--root", str(root), "pull", pushed["image"], "--plain-http", "--verify-key", str(keys["other_pub"]))
    assert p.returncode == 13 and "no signature beside it verifies" in p.stderr, p.stderr
    # the same artifact under a digest reference, its signature tag removed: unsigned
    sig_tag = pushed["digest"].replace(":", "-") + ".sig"
    sig = requests.get(f"http://{registry.host}/v2/{REPO}/manifests/{sig_tag}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    sig_digest = sig.headers["Docker-Content-Digest"]
    assert requests.delete(f"http://{registry.host}/v2/{REPO}/manifests/{sig_digest}", timeout=10).status_code == 202
    try:
        p = cli("--root", str(root), "pull", pushed["image"], "--plain-http", "--verify-key", str(keys["pub"]))
        assert p.returncode == 13 and "is not signed" in p.stderr, p.stderr
        assert _listed(root) == [] and os.listdir(root) == []
    finally:  # put the signature back for the other tests
        r = requests.put(f"http://{registry.host}/v2/{REPO}/manifests/{sig_tag}", data=sig.content,
                         headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
        assert r.status_code == 201


def _weights_layers(reg: RegistryServer, tag: str, repo: str = REPO) -> int:
    """How many layers of the artifact at ``tag`` are the weights file's."""
    doc = requests.get(f"http://{reg.host}/v2/{repo}/manifests/{tag}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
    return sum(d["mediaType"] == "application/vnd.vllm-snapshot.weights-file.v1" for d in doc["layers"])


def _config_digest(reg: RegistryServer, tag: str, repo: str = REPO) -> str:
    return requests.get(f"http://{reg.host}/v2/{repo}/manifests/{tag}",
                        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()[
        "config"]["digest"]


def test_kill_during_pull_lists_nothing_and_the_next_pull_fetches_only_the_missing_blobs(registry, pushed, tmp_path):
    root = _private(tmp_path / "store")
    blobs = pushed["result"]["blobs"]
    mark = len(registry.requests_log())
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "--root", str(root), "pull", pushed["image"],
                             "--plain-http", "--name", "tiny"], cwd=ROOT, env=engine_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(registry.blob_gets(mark)) < 1 + max(2, blobs // 3) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.005)  # the config and a third of the layers sent: the download is under way
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL, "the pull finished before it could be killed"
    assert _listed(root) == []
    assert [n for n in os.listdir(root) if not n.startswith(".")] == []  # only the hidden partial dir
    partial = root / (".pull-" + pushed["digest"].split(":")[1])
    assert os.stat(partial).st_mode & 0o777 == 0o700
    marks = os.listdir(partial / ".parts")
    marked = len([m for m in marks if m.isdigit()])  # layers downloaded, digest-checked and flushed before the kill
    cut = {int(m.removesuffix(".at")) for m in marks if m.endswith(".at")}  # layers cut off half-way
    assert 0 < marked < blobs, (marked, blobs)
    time.sleep(1)  # the registry logs the killed connections' requests too
    mark = len(registry.requests_log())
    p = cli("--root", str(root), "pull", pushed["image"], "--plain-http", "--name", "tiny", "--json", check=True)
    got = json.loads(p.stdout)
    nw = _weights_layers(registry, "v1")  # the weights file is at its recorded path here: never fetched
    assert got["digest"] == pushed["digest"] and got["reused_blobs"] == marked + nw
    cfg = _config_digest(registry, "v1")
    deadline = time.monotonic() + 10  # the registry writes an access-log line a moment after the response
    while len(layer_gets := [x for x in registry.blob_gets(mark) if cfg not in x]) < blobs - marked - nw \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    layer_gets = [x for x in registry.blob_gets(mark) if cfg not in x]
    assert len(layer_gets) == blobs - marked - nw  # only the missing layers were requested
    layers = requests.get(f"http://{registry.host}/v2/{REPO}/manifests/v1",
                          headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()["layers"]
    for i in cut:  # of a layer cut off half-way, only the rest (a range: 206)
        assert any(layers[i]["digest"] in line and '" 206 ' in line for line in layer_gets), (i, layer_gets)
    assert got["reused_bytes"] + got["fetched_bytes"] == got["bytes"] and got["fetched_bytes"] < got["bytes"]
    assert _listed(root) == ["tiny"] and os.listdir(root) == ["tiny"]  # the partial dir became the snapshot
    assert not (root / "tiny" / ".parts").exists()
    cli("--root", str(root), "verify", "tiny", check=True)


def test_two_pulls_of_one_artifact_at_once_both_publish_verified_snapshots(registry, pushed, tmp_path):
    """The second finds the partial dir locked by the first and stages in a dir of its own."""
    root = _private(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "--root", str(root), "pull", pushed["image"],
                               "--plain-http", "--name", name, "--json"], cwd=ROOT, env=engine_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("one", "two")]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert all(json.loads(o[0])["digest"] == pushed["digest"] for o in outs)
    assert sorted(_listed(root)) == ["one", "two"] and sorted(os.listdir(root)) == ["one", "two"]
    for name in ("one", "two"):
        cli("--root", str(root), "verify", name, check=True)


def test_kill_during_push_leaves_no_tag(snapshot, own_registry, tmp_path):
    copy = _clone(snapshot, tmp_path / "a" / "tiny")
    mark = len(own_registry.requests_log())
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "push", str(copy),
                             f"{own_registry.host}/{REPO}:v1", "--plain-http"], cwd=ROOT, env=engine_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not any(
            '"PUT /v2/' in line and "/blobs/uploads/" in line for line in own_registry.requests_log()[mark:]):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL, "the push finished before it could be killed"
    assert not _tag_resolves(own_registry, "v1")
    tags = requests.get(f"http://{own_registry.host}/v2/{REPO}/tags/list", timeout=10)
    assert tags.status_code == 404 or not (tags.json().get("tags") or [])


def _interrupt(args: list[str], under_way) -> tuple[int, float, str]:
    """Run ``vllm-snapshot ARGS``, SIGINT it once ``under_way()``: (exit code, seconds from the
    SIGINT to the exit, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", *args], cwd=ROOT, env=engine_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not under_way() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"{args[:4]} ended before it could be interrupted: {proc.stderr.read()[-2000:]}"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    return proc.returncode, time.monotonic() - t0, err


_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<bytes>\d+)')


def _access(reg: RegistryServer, since: int) -> list[dict]:
    """The access-log lines from index ``since`` as dicts: method, path, status, bytes (sent)."""
    time.sleep(1.0)  # the registry logs a request once its handler is done, an aborted one too
    return [m.groupdict() for line in reg.requests_log()[since:] if (m := _ACCESS.search(line))]


def test_ctrl_c_of_a_pull_or_a_push_exits_130_cutting_the_transfers_in_flight_leaving_nothing_listed_or_tagged(
        snapshot, own_registry, tmp_path):
    """A trial: Ctrl-C of a pull took 12.7 s to exit, of a push ~7 s: every transfer thread
    finished its layer (up to 256 MiB). Now they stop between chunks. Proven by the registry's
    access log, not by a bound in seconds (which flaked under load, and which the tiny model's
    layers could meet even when finished): the 256 MiB parts in flight at the SIGINT were cut
    (a blob GET sent less than the blob; an upload begun and never completed)."""
    copy = _clone(snapshot, tmp_path / "a" / "tiny")
    image = f"{own_registry.host}/{REPO}:v1"
    cli("push", str(copy), image, "--plain-http", check=True)
    root = _private(tmp_path / "store")
    mark = len(own_registry.requests_log())
    rc, took, err = _interrupt(["--root", str(root), "pull", image, "--plain-http", "--name", "tiny"],
                               lambda: len(own_registry.blob_gets(mark)) >= 2)  # the config and a layer sent
    assert rc == 130 and "interrupted" in err, err[-2000:]
    gets = [a for a in _access(own_registry, mark) if a["method"] == "GET" and "/blobs/sha256:" in a["path"]]
    cut = [a["path"] for a in gets
           if int(a["bytes"]) < own_registry.blob_path(a["path"].rsplit("/", 1)[1]).stat().st_size]
    assert cut, f"pull exited {took:.2f} s after SIGINT, and every blob it had begun was sent whole: {gets}"
    assert _listed(root) == [] and [n for n in os.listdir(root) if not n.startswith(".")] == []
    mark = len(own_registry.requests_log())
    began: list[float] = []

    def uploading() -> bool:
        if not began and any('"POST /v2/' in x and "/blobs/uploads/" in x for x in own_registry.requests_log()[mark:]):
            began.append(time.monotonic())
        return bool(began) and time.monotonic() - began[0] >= 0.3
    rc, took, err = _interrupt(["push", str(copy), f"{own_registry.host}/fleet/other:v1", "--plain-http"], uploading)
    assert rc == 130 and "interrupted" in err, err[-2000:]
    log = _access(own_registry, mark)
    begun = [a for a in log if a["method"] == "POST" and "/blobs/uploads/" in a["path"] and a["status"] == "202"]
    done = [a for a in log if a["method"] == "PUT" and "/blobs/uploads/" in a["path"] and a["status"] == "201"]
    assert len(done) < len(begun), f"push exited {took:.2f} s after SIGINT, every upload it had begun completed: {log}"
    assert not _tag_resolves(own_registry, "v1", "fleet/other")


def test_pull_reuses_the_same_artifact_already_in_the_store_and_push_refuses_a_foreign_folder(
        registry, pushed, snapshot, tmp_path):
    root = _private(tmp_path / "store")
    cli("--root", str(root), "pull", pushed["image"], "--plain-http", "--name", "trial-pulled", check=True)
    mark = len(registry.requests_log())
    p = cli("--root", str(root), "pull", pushed["image"], "--plain-http", "--json", check=True)
    got = json.loads(p.stdout)
    assert got["already"] and got["snapshot"] == str(root / "trial-pulled") and got["digest"] == pushed["digest"]
    assert got["MB_s"] == 0.0 and got["fetched_bytes"] == 0
    time.sleep(0.5)  # the registry logs a moment after the response
    assert registry.blob_gets(mark) == [] and _listed(root) == ["trial-pulled"]
    dest = tmp_path / "trial-nonempty"
    dest.mkdir()
    (dest / "file.txt").write_text("mine")
    p = cli("push", str(snapshot), f"oci:{dest}:v1")
    assert p.returncode == 2 and f"{dest} is not empty (file.txt) and not an OCI image layout" in p.stderr, p.stderr
    assert os.listdir(dest) == ["file.txt"]
    p = cli("push", str(snapshot), "oci:/etc/passwd:v1")
    assert p.returncode == 2 and "/etc/passwd is a file, not a directory" in p.stderr, p.stderr


def test_a_byte_flipped_in_a_blob_at_rest_refuses_the_pull_naming_it(snapshot, own_registry, tmp_path):
    copy = _clone(snapshot, tmp_path / "a" / "tiny")
    cli("push", str(copy), f"{own_registry.host}/{REPO}:v1", "--plain-http", check=True)
    doc = requests.get(f"http://{own_registry.host}/v2/{REPO}/manifests/v1",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
    layer = max((d for d in doc["layers"] if "org.vllm-snapshot.member" in d["annotations"]), key=lambda d: d["size"])
    blob = own_registry.blob_path(layer["digest"])
    with open(blob, "r+b") as f:
        f.seek(layer["size"] // 2)
        b = f.read(1)
        f.seek(layer["size"] // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    root = _private(tmp_path / "store")
    p = cli("--root", str(root), "pull", f"{own_registry.host}/{REPO}:v1", "--plain-http")
    assert p.returncode == 5, p.stderr
    assert layer["digest"] in p.stderr and layer["annotations"]["org.vllm-snapshot.member"] in p.stderr
    assert _listed(root) == [] and os.listdir(root) == []


def test_oci_layout_round_trip(snapshot, tmp_path):
    layout = tmp_path / "layout"
    copy = _clone(snapshot, tmp_path / "a" / "tiny")
    cli("push", str(copy), f"oci:{layout}:v1", check=True)
    assert (layout / "oci-layout").is_file() and (layout / "index.json").is_file()
    root = _private(tmp_path / "store")
    p = cli("--root", str(root), "pull", f"oci:{layout}:v1", "--json", check=True)
    name = Path(json.loads(p.stdout)["snapshot"]).name
    assert _listed(root) == [name]
    for rel in ("manifest.json", *(f"images/{n}" for n in os.listdir(snapshot / "images"))):
        assert (root / name / rel).read_bytes() == (snapshot / rel).read_bytes(), rel
    cli("--root", str(root), "verify", name, check=True)
    # restore IMAGE: the store holds that artifact already (same name, same digest): restored, not pulled again
    port = free_port()
    r = cli("--root", str(root), "restore", f"oci:{layout}:v1", "--port", str(port), "--detach", "--json", check=True)
    got = json.loads(r.stdout)
    try:
        assert Path(got["snapshot"]) == root / name and got["oracle"] == "match"
        assert len(completion(port)["logprobs"]) == 4
    finally:
        _stop(got["pid"])
    assert _listed(root) == [name]


def test_serve_with_a_registry_pushes_from_the_first_node_and_the_second_pulls(snapshot, own_registry, tmp_path):
    """Node A holds a snapshot of the key (create's, as `serve` finds it): it restores it and
    pushes it under its key; node B (its own namespaces, empty store) pulls and restores it --
    no cold start."""
    root_a = _private(tmp_path / "a")
    _clone(snapshot, root_a / "tiny")
    repo = f"{own_registry.host}/fleet/serve"
    port_a, port_b = free_port(), free_port()
    p = cli("--root", str(root_a), "serve", str(TINY), "--port", str(port_a), "--detach", "--json",
            "--registry", repo, "--plain-http", "--", *ENGINE_ARGS, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    a = json.loads(p.stdout)
    _stop(a["pid"])
    assert a["path"] == "restored" and _tag_resolves(own_registry, a["key"], "fleet/serve")
    # the push ran after the engine served: its seconds apart from the time to serving
    assert a["push_s"] > 0 and a["serving_after_s"] == round(a["total_s"] - a["push_s"], 3), a
    root_b = _private(tmp_path / "b")
    p = on_node([["--root", str(root_b), "serve", str(TINY), "--port", str(port_b), "--detach", "--json",
                  "--registry", repo, "--plain-http", "--", *ENGINE_ARGS]])
    assert p.returncode == 0, p.stderr[-4000:]
    b = json.loads(p.stdout)
    try:
        assert b["path"] == "pulled" and b["key"] == a["key"] and "engine_start" not in b["timings"]
        assert b["push_s"] is None  # the repository had it: nothing pushed
        assert len(completion(port_b)["logprobs"]) == 4  # four tokens generated (their text may be partial UTF-8)
    finally:
        _stop(b["pid"])


def _complete(reg: RegistryServer, repo: str, tag: str) -> str | None:
    """The digest the tag names when every blob of that manifest is in the registry; None when
    the tag does not resolve. Raises AssertionError when it names an incomplete artifact."""
    r = requests.get(f"http://{reg.host}/v2/{repo}/manifests/{tag}",
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    doc = r.json()
    for d in [doc["config"], *doc["layers"]]:
        h = requests.head(f"http://{reg.host}/v2/{repo}/blobs/{d['digest']}", timeout=10)
        assert h.status_code == 200, f"the tag names a manifest whose blob {d['digest']} is missing"
    return r.headers["Docker-Content-Digest"]


def test_two_nodes_serving_one_key_at_once_both_serve_and_the_tag_never_names_an_incomplete_artifact(
        own_registry, tmp_path):
    """Two "nodes" (own namespaces, machine ids, stores, key locks and engine registries, as two
    machines have)
    start `serve --registry` for one key together, with empty stores and an empty repository:
    both build (a registry has no lock to share), both serve; each pushes only when the tag is
    absent once its build is done, manifest last. Polled all along, the tag never names an
    artifact with a blob missing; at the end it names one of theirs, which a third node pulls and
    verifies."""
    import threading

    from vllm_snapshot import paths

    repo_path = "fleet/race"
    repo = f"{own_registry.host}/{repo_path}"
    # The host-wide CRIU lock also guards the engine cgroups, which the two "nodes" share on this
    # one machine (two real machines share none): each node's /run holds that one lock file,
    # bind-mounted; its key locks and engine registry are its own.
    host_run = paths.run_dir()
    host_run.mkdir(parents=True, exist_ok=True)
    criu_lock = host_run / "criu.lock"
    os.close(os.open(criu_lock, os.O_WRONLY | os.O_CREAT, 0o600))
    nodes = {}
    for n in ("a", "b"):
        run = _private(tmp_path / f"run-{n}")
        (run / "criu.lock").touch(mode=0o600)
        nodes[n] = {"root": _private(tmp_path / f"store-{n}"), "port": free_port(), "run": run,
                    "env": {**engine_env(), "VLLM_SNAPSHOT_RUN_DIR": str(run)}}
    key: list[str] = []
    seen: set[str] = set()
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                if key and (d := _complete(own_registry, repo_path, key[0])):
                    seen.add(d)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            time.sleep(0.05)

    procs = {}
    for n, node in nodes.items():
        script = _node_script([["--root", str(node["root"]), "serve", str(TINY), "--port", str(node["port"]),
                                "--detach", "--json", "--registry", repo, "--plain-http", "--", *EAGER_ARGS]],
                              ("a" if n == "a" else "b") * 32, f"node-{n}-race",
                              binds={str(criu_lock): str(node["run"] / "criu.lock")})
        procs[n] = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=node["env"], cwd=ROOT)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    out: dict[str, dict] = {}
    done: dict[str, tuple[str, str]] = {}
    try:
        deadline = time.monotonic() + 1200
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if not key:  # the tag a push will use: the key of the first snapshot a node published
                for node in nodes.values():
                    for m in node["root"].glob("*/manifest.json"):
                        k = json.loads(m.read_text()).get("key")
                        if k:
                            key.append(k["value"] if isinstance(k, dict) else k)
                            break
                    if key:
                        break
            time.sleep(0.2)
        for n, p in procs.items():
            done[n] = p.communicate(timeout=60)
    finally:
        stop.set()
        poller.join(30)
        for n, p in procs.items():
            if n not in done:
                p.kill()
                done[n] = p.communicate()
        for n in ("a", "b"):
            Path(f"/var/tmp/vsnap-machine-id-{os.getpid()}-node-{n}-race").unlink(missing_ok=True)
        for n, node in nodes.items():  # every engine that serves is stopped, whatever failed
            try:
                out[n] = json.loads(done[n][0])
            except ValueError:
                continue
            if "pid" in out[n]:
                cli("stop", "--pid", str(out[n]["pid"]), timeout=120, env=node["env"])
    for n, p in procs.items():
        assert p.returncode == 0, f"node {n}: {done[n][1][-4000:]}"
    assert not errors, errors[0]
    a, b = out["a"], out["b"]
    print(f"node a: {a['path']}, node b: {b['path']}; digests the tag named: {len(seen)}")
    assert a["key"] == b["key"] and {a["path"], b["path"]} <= {"built", "pulled"} and "built" in {a["path"], b["path"]}
    final = _complete(own_registry, repo_path, a["key"])
    assert final is not None and seen, "the tag never resolved while the nodes ran"
    # whatever the tag names now is a whole snapshot of the key: a third node pulls and verifies it
    root_c = _private(tmp_path / "store-c")
    p = cli("--root", str(root_c), "pull", f"{repo}:{a['key']}", "--plain-http", "--name", "c", "--json", check=True)
    assert json.loads(p.stdout)["digest"] == final
    cli("--root", str(root_c), "verify", "c", check=True)
