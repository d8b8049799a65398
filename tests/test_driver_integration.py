"""The engine reaches the NVIDIA driver where ``vllm serve`` would, proven without a GPU by a
stand-in (real vLLM on CPU, real CRIU), in a container-like mount namespace (``unshare --mount``):

* a fake ``libcuda.so.1`` (compiled here: ``cuDriverGetVersion`` answers 12345) lives on a
  "node" ext4 disk and is bind-mounted into the "container" as a single FILE in a system library
  directory, with the ``libcuda.so.1`` symlink beside it, and the container's loader cache
  (``/etc/ld.so.cache``, written by ldconfig as nvidia-container-toolkit's hook does) lists it;
* a GKE-style driver directory (``.../usr-local-nvidia``, a bind of a subtree of that disk, its
  own mount) holds a fake ``libnvidia-ml.so.1`` (``nvmlInit*`` answer "driver not loaded", as on
  a host without the kernel module), found only through ``LD_LIBRARY_PATH``;
* a probe in the engine (a ``sitecustomize`` on the engine's ``PYTHONPATH``, passed with
  ``--keep-env PYTHONPATH``) loads both with ctypes in every engine process but the root, i.e.
  in vLLM's children, started after the engine applied its mount policy and dropped to the
  engine user; it exits the process (71) when a library cannot be loaded.

Before the engine kept ``LD_LIBRARY_PATH`` and named the driver in its needed paths, ``create``
failed here (the probe could not find ``libnvidia-ml.so.1``; with ``--keep-env LD_LIBRARY_PATH``
it failed on the detached file bind). Now create and restore both work, the restored children
have both libraries mapped, the two mounts are recorded as external mounts, and a restore
without the driver directory mounted is refused before CRIU, naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EAGER_ARGS, ROOT, TINY
from helpers import readable_by_engine
from test_mounts_integration import Disks, _cli, _free_port

pytestmark = pytest.mark.integration

FAKE_CUDA = r"""
int cuDriverGetVersion(int *v) { *v = 12345; return 0; }
"""
FAKE_NVML = r"""
int nvmlInitWithFlags(unsigned int flags) { return 9; }  /* NVML_ERROR_DRIVER_NOT_LOADED */
int nvmlInit_v2(void) { return 9; }
int nvmlInit(void) { return 9; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return r == 9 ? "Driver Not Loaded" : "Unknown Error"; }
"""
PROBE = r"""# test probe of tests/test_driver_integration.py: runs in vLLM's children of the engine tree
import os
import sys


def _probe():
    try:
        with open("/proc/1/cmdline", "rb") as f:
            cmdline = f.read()
        ours = b"vllm_snapshot.entrypoints.engine_root" in cmdline or b"vllm_snapshot.engine.main" in cmdline
    except OSError:
        return
    if not ours or os.getpid() == 1:  # outside an engine tree, or its root (before the mount policy)
        return
    import ctypes

    got, failed = [], []
    for lib, call in (("libcuda.so.1", "cuDriverGetVersion"), ("libnvidia-ml.so.1", "nvmlInit_v2")):
        try:
            fn = getattr(ctypes.CDLL(lib), call)
            if call == "cuDriverGetVersion":
                v = ctypes.c_int(0)
                got.append(f"{call}={fn(ctypes.byref(v))}/{v.value}")
            else:
                got.append(f"{call}={fn()}")
        except Exception as e:  # noqa: BLE001
            failed.append(f"{lib}: {type(e).__name__}: {e}")
    if failed:
        print(f"vsnap-driver-probe: FAILED in pid {os.getpid()}: {'; '.join(failed)}", file=sys.stderr, flush=True)
        os._exit(71)
    print(f"vsnap-driver-probe: ok pid {os.getpid()} {' '.join(got)}", file=sys.stderr, flush=True)


_probe()
"""

CONTAINER = r"""
set -e
cd "$BASE"
mkdir -p node ctr/usr-lib ctr/usr-local-nvidia
mount -o loop node.img node
mkdir -p node/usr-lib node/nvidia/lib64
cp build/libcuda.so node/usr-lib/libcuda.so.580.65.06
cp build/libnvidia-ml.so node/nvidia/lib64/libnvidia-ml.so.1
chmod -R a+rX node
# nvidia-container-toolkit: each driver library bind-mounted as a single file, the soname link
# beside it, the container's loader cache rewritten by ldconfig
: > ctr/usr-lib/libcuda.so.580.65.06
mount --bind node/usr-lib/libcuda.so.580.65.06 ctr/usr-lib/libcuda.so.580.65.06
ln -s libcuda.so.580.65.06 ctr/usr-lib/libcuda.so.1
# GKE: the driver directory is a mount of its own, found through LD_LIBRARY_PATH
mount --bind node/nvidia ctr/usr-local-nvidia
umount node
printf '%s\ninclude /etc/ld.so.conf.d/*.conf\n' "$BASE/ctr/usr-lib" > ld.so.conf
ldconfig -X -C "$BASE/ld.so.cache" -f "$BASE/ld.so.conf"
chmod 0644 "$BASE/ld.so.cache"
mount --bind "$BASE/ld.so.cache" /etc/ld.so.cache
ldconfig -p | grep -F "$BASE/ctr/usr-lib/libcuda.so.1"
export LD_LIBRARY_PATH="$BASE/ctr/usr-local-nvidia/lib64"
export PYTHONPATH="$ROOT:$BASE/probe"
if ! "$PY" -m vllm_snapshot --root "$BASE/snaps" create "$MODEL" --name d --keep-env PYTHONPATH $EXTRA -q -v \
    -- $ENGINE_ARGS 2> create.err; then
  grep -a vsnap-driver-probe create.err >&2 || true
  tail -c 3000 create.err >&2
  exit 1
fi
echo created
"$PY" -m vllm_snapshot --root "$BASE/snaps" inspect d --json > inspect.json
pid=$("$PY" -m vllm_snapshot --root "$BASE/snaps" restore d --port "$PORT" --detach --log-file "$BASE/r.log" -q | grep -E '^[0-9]+$' | tail -1)
"$PY" - "$pid" > maps.json <<'PY'
import json, sys, psutil
root = psutil.Process(int(sys.argv[1]))
out = {}
for p in [root, *root.children(recursive=True)]:
    with open(f"/proc/{p.pid}/maps") as f:
        out[p.pid] = sorted({l.split()[-1] for l in f if "libcuda" in l or "libnvidia-ml" in l})
print(json.dumps(out))
PY
"$PY" -c "
import json, urllib.request
req = urllib.request.Request('http://127.0.0.1:$PORT/v1/completions', headers={'Content-Type': 'application/json'},
    data=json.dumps({'model': 'tiny-llama', 'prompt': 'hello', 'max_tokens': 2}).encode())
print(json.loads(urllib.request.urlopen(req, timeout=30).read())['choices'][0]['text'])" > completion
"$PY" -m vllm_snapshot --root "$BASE/snaps" stop --port "$PORT"
# the driver directory gone: refused before CRIU, naming it
umount ctr/usr-local-nvidia
set +e
"$PY" -m vllm_snapshot --root "$BASE/snaps" restore d --port "$PORT" --detach --log-file "$BASE/r2.log" -q 2> refused.txt
echo $? > refused.rc
"""


@pytest.fixture
def node_disk(request):
    """A scratch dir under /var/tmp holding an empty ext4 image ``node.img`` (the GPU node's
    disk); loop devices and mounts are undone in a finalizer."""
    for tool in ("mkfs.ext4", "losetup", "unshare", "gcc", "ldconfig"):
        if shutil.which(tool) is None:
            msg = f"{tool} is missing (scripts/setup.sh installs it)"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(msg)  # never a silent skip in CI
            pytest.skip(msg)
    import tempfile

    d = Disks(Path(tempfile.mkdtemp(prefix="vsnap-driver-", dir="/var/tmp")))
    request.addfinalizer(d.cleanup)
    d.image("node", size="32M")
    return d.base


def _compile(src: str, soname: str, out: Path) -> None:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f"-Wl,-soname,{soname}", "-o", str(out), str(c)],
                   check=True, capture_output=True, text=True)


def run_stand_in(base: Path, port: int, extra: str = "") -> subprocess.CompletedProcess:
    """Build the stand-in driver under ``base`` (which holds ``node.img``) and run create,
    restore, a completion, stop and a refused restore in a private mount namespace. ``extra``:
    more create options (e.g. ``--keep-env LD_LIBRARY_PATH``)."""
    build = base / "build"
    build.mkdir()
    _compile(FAKE_CUDA, "libcuda.so.1", build / "libcuda.so")
    _compile(FAKE_NVML, "libnvidia-ml.so.1", build / "libnvidia-ml.so")
    (base / "probe").mkdir()
    (base / "probe" / "sitecustomize.py").write_text(PROBE)
    model = base / "model"
    model.mkdir()
    for f in TINY.iterdir():
        shutil.copy2(f, model / f.name)
    (base / "ctr").mkdir()
    for p in (model, base / "probe", base / "ctr"):
        readable_by_engine(p)
    env = {**os.environ, "ROOT": str(ROOT), "BASE": str(base), "PY": sys.executable, "MODEL": str(model),
           "PORT": str(port), "ENGINE_ARGS": " ".join(EAGER_ARGS), "EXTRA": extra}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", CONTAINER],
                          capture_output=True, text=True, timeout=1200, env=env, cwd="/")


def test_engine_loads_the_driver_from_a_file_bind_and_an_ld_library_path_mount(node_disk, request):
    base = node_disk
    port = _free_port()
    request.addfinalizer(lambda: _cli(base / "snaps", "stop", "--port", str(port), timeout=120))
    r = run_stand_in(base, port)
    log = base / "snaps" / "d" / "engine-create.log"
    create_log = log.read_text(errors="replace") if log.exists() else "(no create log)"
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:] + "\n--- create log ---\n" + create_log[-3000:]

    probes = [line for line in create_log.splitlines() if "vsnap-driver-probe" in line]
    print("\n".join(probes))
    assert probes and all("ok pid" in line and "cuDriverGetVersion=0/12345 nvmlInit_v2=9" in line
                          for line in probes), probes

    lib_cuda = f"{base}/ctr/usr-lib/libcuda.so.580.65.06"
    lib_nvml = f"{base}/ctr/usr-local-nvidia/lib64/libnvidia-ml.so.1"
    ext = {e["mount_point"]: e for e in json.loads((base / "inspect.json").read_text())["manifest"]["criu"]["external_mounts"]}
    assert lib_cuda in ext and f"{base}/ctr/usr-local-nvidia" in ext, sorted(ext)
    assert ext[lib_cuda]["root"] == "/usr-lib/libcuda.so.580.65.06"  # the single-file bind

    maps = json.loads((base / "maps.json").read_text())
    print("external mounts:", sorted(ext), "\nrestored maps:", maps)
    assert any(lib_cuda in libs and lib_nvml in libs for libs in maps.values()), maps
    assert (base / "completion").read_text().strip()

    assert (base / "refused.rc").read_text().strip() == "3", (base / "refused.txt").read_text()
    refused = (base / "refused.txt").read_text()
    assert f"{base}/ctr/usr-local-nvidia: expected a mount of ext4" in refused and "CRIU restore" not in refused
