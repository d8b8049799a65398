"""Weights files end to end (real vLLM on CPU, real CRIU; marker ``integration``): the restored
worker maps the store's weights file, the images hold no copy of the weights, outputs match an
engine whose weights are in the images, a flipped byte or a missing file refuses before CRIU,
snapshots of the same weights share one file, and ``delete`` removes it with the last snapshot
that names it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from vllm_snapshot.store import manifest as mf
from vllm_snapshot.store import weights as sw

from conftest import ENGINE_ARGS, TINY, cli
from test_integration import free_port, port_accepts, stop

pytestmark = pytest.mark.integration

PAGE = 4096


def _tree(pid: int) -> list[int]:
    return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _gone(pids: list[int], timeout_s: float) -> bool:
    """True once none of ``pids`` runs (zombies waiting for their reaper do not), within ``timeout_s``."""
    procs = []
    for p in pids:
        try:
            procs.append(psutil.Process(p))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    try:
        return all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running())
    except psutil.NoSuchProcess:
        return True


def _snippets(tensor: str = "model.embed_tokens.weight", n: int = 4, size: int = 256) -> list[bytes]:
    """``n`` runs of ``size`` bytes of ``tensor`` as the checkpoint stores it (float32, the
    engine's dtype). The token embedding: bytes every engine holds as they are (vLLM computes
    with it directly). A linear layer's weight (not one vLLM fuses, like ``o_proj``): an engine
    mapping a weights file computes with it as loaded; one whose weights are in its images
    repacks it (oneDNN), so it is not searched for there."""
    from safetensors import safe_open

    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        raw = f.get_tensor(tensor).contiguous().view(-1).numpy().tobytes()
    step = len(raw) // (n + 1)
    return [raw[i * step:i * step + size] for i in range(1, n + 1)]


def _found_in(files: list[Path], snippets: list[bytes]) -> list[bool]:
    """For each snippet: whether one of ``files`` holds it (at any offset)."""
    found = [False] * len(snippets)
    keep = max(len(x) for x in snippets)
    for path in files:
        with open(path, "rb") as f:
            tail = b""
            while chunk := f.read(64 << 20):
                buf = tail + chunk
                for i, x in enumerate(snippets):
                    found[i] = found[i] or x in buf
                tail = buf[-keep:]
    return found


def _pages(snapshot: Path) -> list[Path]:
    return sorted((snapshot / "images").glob("pages-*.img"))  # uncompressed (the default)


@pytest.fixture(scope="module")
def in_image(snap_root) -> Path:
    """A snapshot of the same model with the weights in the images (the control)."""
    target = snap_root / "tiny-in-image"
    cli("create", str(TINY), "--snapshot-dir", str(target), "--weights", "in-image", "--", *ENGINE_ARGS, check=True)
    return target


def _completions(port: int) -> tuple[dict, str, list[float]]:
    """A greedy completion with logprobs, and the same request streamed (text, logprobs)."""
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    args = dict(model="tiny-llama", prompt="The quick brown fox", max_tokens=12, temperature=0, logprobs=2)
    whole = c.completions.create(**args).model_dump()
    text, lps = "", []
    for ev in c.completions.create(stream=True, **args):
        ch = ev.choices[0]
        text += ch.text
        lps += list(ch.logprobs.token_logprobs or []) if ch.logprobs else []
    return whole, text, lps


def test_the_restored_worker_maps_the_weights_file_and_no_image_holds_the_weights(snapshot, snap_root, in_image):
    m = mf.read(snapshot)
    w = m.weights
    assert w is not None and w.tensors > 0 and w.mapped_bytes > 0
    path = Path(w.path)
    assert path.parent == snap_root / sw.DIR and path.name == f"{w.blake3}{sw.SUFFIX}"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert sw.hash_file(path) == w.blake3
    assert w.path not in {f.path for f in (m.carried.files if m.carried else ())}  # never copied
    snippets = _snippets()
    assert all(_found_in([path], snippets))  # the weights file holds the embedding ...
    # ... and the images do not; the control: with the weights in the images, they hold it
    assert all(_found_in(_pages(in_image), snippets)), "the control's images lack the weights: the search is broken"
    assert not any(_found_in(_pages(snapshot), snippets))
    # the session snapshot is compiled (no --enforce-eager): inductor computes with the mapped
    # linear weights, it made no copy of its own (a frozen constant would be in the images)
    linear = _snippets("model.layers.1.self_attn.o_proj.weight") + _snippets("model.layers.0.mlp.down_proj.weight")
    assert "--enforce-eager" not in m.engine.engine_args
    assert all(_found_in([path], linear)) and not any(_found_in(_pages(snapshot), linear))
    assert mf.read(in_image).weights is None
    results = {}
    for snap in (snapshot, in_image):
        port = free_port()
        p = cli("restore", str(snap), "--port", str(port), "--detach", "--json", timeout=300, check=True)
        pid = json.loads(p.stdout)["pid"]
        tree = _tree(pid)
        try:
            maps = {q: Path(f"/proc/{q}/maps").read_text() for q in tree}
            holders = [q for q, text in maps.items() if w.path in text]
            assert (len(holders) == 1) == (snap == snapshot), holders  # the worker, and only for the file snapshot
            results[snap] = _completions(port)
        finally:
            stop(pid)
        assert not port_accepts(port)
        assert _gone(tree, 10)
    (whole, text, lps), (whole2, text2, lps2) = results[snapshot], results[in_image]
    choice = whole["choices"][0]
    assert choice["text"] == text and choice["logprobs"]["token_logprobs"] == lps  # streaming = not streaming
    # the same tokens as the engine whose weights are in the images; logprobs equal up to the
    # GEMM kernel (F.linear on the mapped weight vs. vLLM's prepacked oneDNN copy)
    assert choice["text"] == whole2["choices"][0]["text"]
    assert all(abs(a - b) < 1e-3 for a, b in zip(lps, lps2)), (lps, lps2)
    # nothing the engines did reached the file (copy-on-write): it still hashes to its name
    v = cli("verify", str(snapshot), "--json", timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr


def _with_weights(clone: Path, rec: mf.WeightsFile) -> None:
    """Point the clone's manifest at ``rec`` (resealed: a manifest edited by hand would fail
    its digest instead)."""
    m = mf.read(clone)
    os.unlink(clone / "manifest.json")  # a hard link shared with the session snapshot: replace, never write through
    mf.write_atomic(mf.seal(m.model_copy(update={"weights": rec})), clone)


def test_a_flipped_byte_in_the_weights_file_refuses_before_criu(snapshot, clone_snapshot, tmp_path):
    m = mf.read(snapshot)
    clone = clone_snapshot("flipped")
    copy = tmp_path / "copy.weights"
    shutil.copy2(m.weights.path, copy)
    os.chmod(copy, 0o600)
    _with_weights(clone, sw.record(copy, m.weights.blake3, m.weights.tensors, m.weights.mapped_bytes))
    st = copy.stat()
    with open(copy, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the content says it
    port = free_port()
    p = cli("restore", str(clone), "--port", str(port), "--detach", timeout=300)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "error [model-changed]" in p.stderr and f"the weights file {copy} changed since create" in p.stderr
    # refused while validating: no CRIU run, so no engine process was ever made; the port never bound
    assert "validating" in p.stderr and "CRIU restore" not in p.stderr and not port_accepts(port)


def test_a_missing_weights_file_refuses_naming_it(snapshot, clone_snapshot, tmp_path):
    m = mf.read(snapshot)
    clone = clone_snapshot("missing")
    gone = tmp_path / ("0" * 64 + ".weights")
    _with_weights(clone, m.weights.model_copy(update={"path": str(gone)}))
    p = cli("restore", str(clone), "--port", str(free_port()), "--detach", timeout=300)
    assert p.returncode == 4, p.stdout + p.stderr
    assert f"the weights file {gone} is missing" in p.stderr and "serve" in p.stderr
    v = cli("verify", str(clone))
    assert v.returncode == 4 and str(gone) in v.stderr
    listed = json.loads(cli("--root", str(clone.parent), "list", "--json", check=True).stdout)
    (row,) = [r for r in listed["snapshots"] if r["name"] == "missing"]
    assert not row["compatible"] and "missing" in row["why"] and row["weights"] == str(gone)


def test_snapshots_of_the_same_weights_share_one_file_which_goes_with_the_last(snapshot, snap_root, tmp_path):
    m = mf.read(snapshot)
    second = snap_root / "tiny-seqs8"
    cli("create", str(TINY), "--snapshot-dir", str(second), "--", *ENGINE_ARGS, "--max-num-seqs", "8", check=True)
    m2 = mf.read(second)
    assert m2.key.value != m.key.value  # another snapshot, other engine args ...
    assert m2.weights.path == m.weights.path and m2.weights.inode == m.weights.inode  # ... one weights file
    assert len([p for p in (snap_root / sw.DIR).iterdir() if p.name.endswith(sw.SUFFIX)]) == 1
    d = cli("delete", str(second), "--json", check=True)
    assert json.loads(d.stdout)["weights_removed"] == []  # the session snapshot still names it
    assert Path(m.weights.path).exists()
    # a root where one snapshot names the file: deleting it removes the file
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    subprocess.run(["cp", "-al", str(snapshot), str(root / "only")], check=True)
    (root / sw.DIR).mkdir(mode=0o700)
    own = root / sw.DIR / Path(m.weights.path).name
    shutil.copy2(m.weights.path, own)
    _with_weights(root / "only", sw.record(own, m.weights.blake3, m.weights.tensors, m.weights.mapped_bytes))
    listed = cli("--root", str(root), "list", check=True).stdout
    assert "weights" in listed and own.name[:8] in listed
    d = cli("--root", str(root), "delete", "only", "--json", check=True)
    assert json.loads(d.stdout)["weights_removed"] == [str(own)] and not own.exists()
    assert Path(m.weights.path).exists()
