"""Mount policy against real CRIU (and a real vLLM engine): loop disks built here and cleaned up
in finalizers even when a test fails.

* test_small_tree_*: a small Python process in its own PID + mount namespace applies the policy
  (engine/mounts.make_private) on a host with unrelated ramfs/squashfs/ext4 mounts and a model
  disk with a second disk nested in the model directory; CRIU (RPC) dumps it with the external
  mounts mountpolicy finds and restores it with them bound back; a swapped disk is refused
  before CRIU.
* test_vllm_*: ``create`` / ``restore`` of the tiny model copied onto a loop disk, on the host
  and inside ``unshare --mount`` with container-like single-file binds over /etc/hosts and
  /etc/resolv.conf. These need create/restore to pass the external mounts to CRIU
  (MOUNTS-INTEGRATION.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import EAGER_ARGS, ROOT, TINY, remove_tree
from helpers import readable_by_engine

pytestmark = pytest.mark.integration


def _run(*argv, check=True, **kw):
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


class Disks:
    """Loop disks and mounts made by a test; :meth:`cleanup` undoes everything it can."""

    def __init__(self, base: Path):
        self.base = base
        self.mounts: list[str] = []

    def image(self, name: str, kind: str = "ext4", size: str = "64M", files: dict[str, str] | None = None) -> Path:
        img = self.base / f"{name}.img"
        if kind == "squashfs":
            src = self.base / f"{name}-src"
            src.mkdir()
            for n, t in (files or {"f": "x"}).items():
                (src / n).write_text(t)
            _run("mksquashfs", str(src), str(img), "-quiet", "-noappend")
        else:
            _run("truncate", "-s", size, str(img))
            _run("mkfs.ext4", "-q", "-F", str(img))
        return img

    def mount(self, what: str, where: str | Path, *opts: str) -> None:
        if not Path(where).exists():
            os.makedirs(where, exist_ok=True)
        _run("mount", *opts, what, str(where))
        self.mounts.append(str(where))

    def umount(self, where: str | Path) -> None:
        _run("umount", str(where))
        self.mounts.remove(str(where))

    def cleanup(self) -> None:
        for mp in reversed(self.mounts):
            _run("umount", "-l", mp, check=False)
        self.mounts = []
        for img in self.base.glob("*.img"):
            out = _run("losetup", "-j", str(img), check=False).stdout
            for line in out.splitlines():
                _run("losetup", "-d", line.split(":", 1)[0], check=False)
        remove_tree(self.base)


@pytest.fixture
def disks(request):
    for tool in ("mkfs.ext4", "mksquashfs", "losetup", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            msg = f"{tool} is missing (scripts/setup.sh installs it)"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(msg)  # never a silent skip of the mount matrix in CI
            pytest.skip(msg)
    base = Path(tempfile.mkdtemp(prefix="vsnap-mounts-", dir="/var/tmp"))
    d = Disks(base)
    request.addfinalizer(d.cleanup)
    return d


def _vfat_supported() -> bool:
    """This kernel mounts vfat (the CI machine's kernel has no vfat: /proc/filesystems)."""
    try:
        return "vfat" in Path("/proc/filesystems").read_text().split() and shutil.which("mkfs.vfat") is not None
    except OSError:
        return False


def _host_like(d: Disks) -> dict[str, Path]:
    """Unrelated mounts (ramfs, squashfs, ext4, a single-file bind from an ext4 disk, vfat where
    the kernel has it) plus a model disk with a nested disk."""
    mnt = d.base / "mnt"
    d.mount("ramfs", mnt / "ram", "-t", "ramfs")
    d.mount(str(d.image("sq", "squashfs")), mnt / "sq", "-o", "loop,ro")
    d.mount(str(d.image("other")), mnt / "other", "-o", "loop")
    (mnt / "other" / "hosts").write_text("10.0.0.1 elsewhere\n")
    (mnt / "bindfile").write_text("")
    d.mount(str(mnt / "other" / "hosts"), mnt / "bindfile", "--bind")
    if _vfat_supported():
        img = d.base / "efi.img"
        _run("truncate", "-s", "32M", str(img))
        _run("mkfs.vfat", str(img))
        d.mount(str(img), mnt / "efi", "-o", "loop")
    d.mount(str(d.image("data", size="128M")), mnt / "data", "-o", "loop")
    model = mnt / "data" / "model"
    model.mkdir()
    d.mount(str(d.image("shard", size="32M")), model / "shard", "-o", "loop")
    return {"mnt": mnt, "model": model, "shard": model / "shard", "data": mnt / "data"}


SMALL = r"""
import os, sys, time, json
os.closerange(3, 4096)
os.setsid()
sys.path.insert(0, sys.argv[1])
from vllm_snapshot.engine.mounts import make_private, ENGINE_TMPDIR
os.makedirs(ENGINE_TMPDIR, exist_ok=True)
import ctypes
make_private(needed=[sys.argv[2]])
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # no parent-death signal (unshare --kill-child set one)
f = open(os.path.join(sys.argv[2], "shard", "w.bin"))
i = 0
while True:
    i += 1
    f.seek(0)
    with open(sys.argv[3] + ".tmp", "w") as o:
        o.write(json.dumps({"i": i, "w": f.read()}))
    os.replace(sys.argv[3] + ".tmp", sys.argv[3])
    time.sleep(0.2)
"""


def _wait_state(path: Path, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = json.loads(path.read_text())
            if cond(s):
                return s
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"state {path} never satisfied the condition")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_small_tree_detaches_unrelated_mounts_and_restores_external_ones(disks, request):
    from vllm_snapshot.checkpoint import criu, mountpolicy
    from vllm_snapshot.engine import mounts as M

    p = _host_like(disks)
    (p["shard"] / "w.bin").write_text("weights-v1")
    state = disks.base / "state.json"
    script = disks.base / "small.py"
    script.write_text(SMALL)
    cmd = (f"exec {sys.executable} {script} {ROOT} {p['model']} {state} </dev/null >/dev/null 2>&1")
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                                 "--kill-child", "--", "sh", "-c", cmd], start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    request.addfinalizer(lambda: (launcher.kill(), launcher.wait()))
    _wait_state(state, lambda s: s["i"] >= 2)
    import psutil

    root = psutil.Process(launcher.pid).children()[0].pid
    request.addfinalizer(lambda: _kill(root))
    with open(f"/proc/{root}/mountinfo") as f:
        ns = M.parse_mountinfo(f.read())
    seen = {m.mount_point for m in ns}
    for gone in ("ram", "sq", "other"):
        assert str(p["mnt"] / gone) not in seen
    ext = mountpolicy.describe_externals(root)
    assert [e.mount_point for e in ext] == [str(p["data"]), str(p["shard"])]
    assert all(e.identity_kind in ("uuid", "fsid") for e in ext)

    work = disks.base / "criu"
    work.mkdir()
    runner = criu.Criu(criu.find_criu())
    runner.dump(criu.DumpOptions(pid=root, external=mountpolicy.dump_args(ext)), work, work)
    psutil.wait_procs([psutil.Process(launcher.pid)], timeout=20)
    before = json.loads(state.read_text())["i"]

    # a different disk at the nested mount point is refused before CRIU
    disks.umount(p["shard"])
    disks.mount(str(disks.image("impostor", size="32M")), p["shard"], "-o", "loop")
    bad = mountpolicy.check_restore(ext)
    assert len(bad) == 1 and bad[0].startswith(f"{p['shard']}: expected ext4 ") and "found ext4" in bad[0]
    disks.umount(p["shard"])
    bad = mountpolicy.check_restore(ext)
    assert bad and "found no mount there" in bad[0]
    disks.mount(str(disks.base / "shard.img"), p["shard"], "-o", "loop")
    assert mountpolicy.check_restore(ext) == []

    pid = runner.restore(criu.RestoreOptions(external=mountpolicy.restore_args(ext)), work, work)
    request.addfinalizer(lambda: _kill(pid))
    s = _wait_state(state, lambda s: s["i"] > before + 2)
    assert s["w"] == "weights-v1"
    with open(f"/proc/{pid}/mountinfo") as f:
        restored = {m.mount_point for m in M.parse_mountinfo(f.read())}
    assert {str(p["data"]), str(p["shard"]), "/proc", "/sys", "/dev", "/dev/shm"} <= restored
    _kill(pid)


# ---------------------------------------------------------------------------- vLLM


def _free_port() -> int:
    """A port the kernel picks at random (not the first free one of a fixed range: each test took
    18700 after the last, and a CI run met 18700 held by another engine of the run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(root: Path, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "vllm_snapshot", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


def _completion(port: int) -> str:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_vllm_model_on_loop_disk_with_nested_disk_and_unrelated_mounts(disks, request):
    p = _host_like(disks)
    for f in TINY.iterdir():
        shutil.copy2(f, p["model"] / f.name)
    readable_by_engine(p["model"])  # the engine runs as the unprivileged engine user
    snaps = disks.base / "snaps"
    port = _free_port()
    request.addfinalizer(lambda: _cli(snaps, "stop", "--port", str(port), timeout=120))
    r = _cli(snaps, "create", str(p["model"]), "--name", "m", "--keep-env", "PYTHONPATH", "-q", "--", *EAGER_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(snaps, "restore", "m", "--port", str(port), "--detach", "--log-file", str(disks.base / "e.log"), "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _completion(port)
    r = _cli(snaps, "stop", "--port", str(port))
    assert r.returncode == 0, r.stderr
    # the nested (empty) disk swapped for another one: model files are the same, the mount is not
    disks.umount(p["shard"])
    disks.mount(str(disks.image("impostor", size="32M")), p["shard"], "-o", "loop")
    r = _cli(snaps, "restore", "m", "--port", str(port), "--detach", "--log-file", str(disks.base / "e.log"), "-q")
    assert r.returncode == 3, r.stderr[-3000:]
    assert str(p["shard"]) in r.stderr and "expected ext4" in r.stderr
    assert "CRIU restore" not in r.stderr and not _port_open(port)
    # the model's whole disk unmounted: refused before CRIU, naming the mount; nothing left
    disks.umount(p["shard"])
    disks.umount(p["data"])
    from test_integration import engine_pids

    before = engine_pids()
    r = _cli(snaps, "restore", "m", "--port", str(port), "--detach", "--log-file", str(disks.base / "e.log"), "-q")
    assert r.returncode == 3, r.stderr[-3000:]
    assert f"{p['data']}: expected a mount of ext4" in r.stderr and "found no mount there" in r.stderr
    assert "CRIU restore" not in r.stderr and not _port_open(port)
    assert engine_pids(10, before) - before == set()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


CONTAINER = r"""
set -e
mkdir -p "$BASE/node"
mount -o loop "$BASE/node.img" "$BASE/node"
printf '127.0.0.1 localhost\n10.9.9.9 ctr-host\n' > "$BASE/node/hosts"
printf 'nameserver 127.0.0.1\n' > "$BASE/node/resolv.conf"
mount --bind "$BASE/node/hosts" /etc/hosts
mount --bind "$BASE/node/resolv.conf" /etc/resolv.conf
umount "$BASE/node"
# a container's volumes and image layers: the setup cache (venv) as a bind mount, the model
# on an overlay (lower: the copied model; upper/work: scratch)
mount --bind "$CACHE" "$CACHE"
mkdir -p "$BASE/upper" "$BASE/work" "$BASE/model"
mount -t overlay overlay -o "lowerdir=$BASE/model-lower,upperdir=$BASE/upper,workdir=$BASE/work" "$BASE/model"
"$PY" -m vllm_snapshot --root "$BASE/snaps" create "$MODEL" --name c --keep-env PYTHONPATH -q -- $ENGINE_ARGS
pid=$("$PY" -m vllm_snapshot --root "$BASE/snaps" restore c --port "$PORT" --detach --log-file "$BASE/c.log" -q | grep -E '^[0-9]+$' | tail -1)
nsenter -t "$pid" -m cat /etc/hosts > "$BASE/seen-hosts"
"$PY" -c "
import json, urllib.request
req = urllib.request.Request('http://127.0.0.1:$PORT/v1/completions', headers={'Content-Type': 'application/json'},
    data=json.dumps({'model': 'tiny-llama', 'prompt': 'hello', 'max_tokens': 2}).encode())
print(json.loads(urllib.request.urlopen(req, timeout=30).read())['choices'][0]['text'])" > "$BASE/completion"
"$PY" -m vllm_snapshot --root "$BASE/snaps" stop --port "$PORT"
"""


def test_vllm_container_like_file_binds_over_etc_hosts(disks, request):
    lower = disks.base / "model-lower"
    lower.mkdir()
    for f in TINY.iterdir():
        shutil.copy2(f, lower / f.name)
    readable_by_engine(lower)  # the engine runs as the unprivileged engine user (and $BASE/model is below it)
    model = disks.base / "model"
    disks.image("node", size="32M")
    port = _free_port()
    request.addfinalizer(lambda: _cli(disks.base / "snaps", "stop", "--port", str(port), timeout=120))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BASE": str(disks.base), "PY": sys.executable,
           "MODEL": str(model), "PORT": str(port), "ENGINE_ARGS": " ".join(EAGER_ARGS),
           "CACHE": os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot")}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", CONTAINER],
                       capture_output=True, text=True, timeout=900, env=env, cwd="/")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (disks.base / "seen-hosts").read_text() == "127.0.0.1 localhost\n10.9.9.9 ctr-host\n"
    assert (disks.base / "completion").read_text().strip()


def test_vllm_snapshot_root_on_its_own_disk_keeps_the_weights_file_reachable(disks, request):
    """The snapshot root (and so ROOT/.weights, the weights file the engine maps) on a data disk
    of its own, not the model's: the engine's mount namespace keeps that mount (an external
    mount, bound back at restore) instead of detaching it as unrelated; the restored engine maps
    its weights from it and serves."""
    store = disks.base / "store"
    disks.mount(str(disks.image("store", size="2G")), store, "-o", "loop")
    os.chmod(store, 0o700)
    snaps = store / "snaps"
    port = _free_port()
    request.addfinalizer(lambda: _cli(snaps, "stop", "--port", str(port), timeout=120))
    r = _cli(snaps, "create", str(TINY), "--name", "w", "--keep-env", "PYTHONPATH", "-q", "--", *EAGER_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    from vllm_snapshot.store import manifest as mf

    m = mf.read(snaps / "w")
    assert m.weights is not None and m.weights.path.startswith(str(snaps / ".weights") + "/")
    assert str(store) in {x.mount_point for x in m.criu.external_mounts}
    r = _cli(snaps, "restore", "w", "--port", str(port), "--detach", "--log-file", str(disks.base / "w.log"), "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    pid = int([ln for ln in r.stdout.split() if ln.isdigit()][-1])
    assert any(m.weights.path in Path(f"/proc/{c.pid}/maps").read_text()
               for c in psutil.Process(pid).children(recursive=True))
    assert _completion(port)
    r = _cli(snaps, "stop", "--port", str(port))
    assert r.returncode == 0, r.stderr
