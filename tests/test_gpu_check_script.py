"""scripts/gpu_check.sh, gpu_check_lib.sh, gpu_check_tree.py and gpu_carry.sh: what can run
without a GPU.

The device check itself needs a GPU machine; here: the shell scripts parse and are
shellcheck-clean; the verdict (gpu_check_lib.sh ``verdict``) says PASS only when part C's CRIU
dump, restore and wake passed and nothing failed or was not run -- fed every combination of
other results it never says PASS without them; a ``[N/A]`` memory reading (MIG) is no arithmetic
error; the diagnostics come back as two files; the script says NOT RUN -- never FAIL -- where it
cannot run (no GPU, a gVisor kernel); the carry holds CRIU, ``ip``, pycriu and python3.12 wheels
of what the harness imports, under the 64 MiB limit; and a dry run of the whole script with the
fake driver (tests/fakecuda) installs the carried wheels, exports the carried ``ip`` to CRIU,
and runs parts C and D through real CRIU, so a harness bug is found here and not with the GPU's
scarce minutes. Part D (scripts/gpu_check_ops.py: ``ops.create``/``ops.restore`` of
vllm_snapshot/dev/gpu_engine.py) passes through real CRIU with the fake driver and fails when
the restored engine's wake does not bring its weights back.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import skip_on_gpu_host

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu_check.sh"
LIB = ROOT / "scripts" / "gpu_check_lib.sh"
CARRY = ROOT / "scripts" / "gpu_carry.sh"
TREE = ROOT / "scripts" / "gpu_check_tree.py"
OPS = ROOT / "scripts" / "gpu_check_ops.py"
VENV_PY = Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot")) / "venv" / "bin" / "python"

#: part C's steps whose PASS the verdict requires (names as gpu_check_tree.py prints them)
#: part C's check of the GPU remap path (the identity device map on the restore)
REMAP_STEP = "C restore with the identity device map (the remap path)"
FAKE_GPU = "GPU-00000000-0000-4000-8000-00000000fa4e"  # gpu_check_tree.FAKE_GPU
C_REQUIRED = ["C criu dump (product's LocalCheckpointTools.dump)", "C criu restore (product's LocalCheckpointTools.restore_tree)",
              "C wake (create + map at the same VA)", "C same output after restore + wake"]
#: part D's steps (names as gpu_check_ops.py prints them)
D_STEPS = ["D create (ops.create)", "D create's sleep rehearsal, then prepare-dump",
           "D the plugin checkpointed the CUDA child, not the root", "D restore (ops.restore with wake, oracle, canary)",
           "D same output after restore + wake", "D stop (ops.stop_engines)", "D the fake driver's checkpoint calls"]
#: part D's steps of its default, a wake from the weights file (``--weights file``)
D_FILE_STEPS = ["D create wrote the weights file from the GPU memory (the wake's source)",
                "D the restored CUDA child holds the weights file open"]


@pytest.mark.parametrize("script", [CHECK, LIB, CARRY])
def test_scripts_parse_and_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    sc = shutil.which("shellcheck")
    assert sc, "shellcheck is not installed: run scripts/setup.sh (it installs it)"
    cp = subprocess.run([sc, "-x", str(script)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout


# ---------------------------------------------------------------- the verdict (H2)

def _verdict(tmp_path, rows: list[tuple[str, str]]) -> tuple[int, str]:
    f = tmp_path / "results.tsv"
    f.write_text("".join(f"{st}\t{name}\tdetail of {name}\n" for st, name in rows))
    cp = subprocess.run(["bash", str(CHECK), "--verdict", str(f)], capture_output=True, text=True, timeout=30)
    return cp.returncode, cp.stdout.strip().splitlines()[-1] if cp.stdout.strip() else cp.stderr


PART_A = [("PASS", "helper -h"), ("PASS", "A lock"), ("PASS", "A checkpoint"), ("PASS", "A same checksum after restore")]


@pytest.mark.parametrize("rows, code, says", [
    # H2: part A alone used to say PASS
    (PART_A, 3, "NOT RUN (CRIU did not checkpoint and restore a CUDA process"),
    (PART_A + [("SKIP", "C/B criu dump/restore")], 3, "NOT RUN (C/B criu dump/restore"),
    (PART_A + [("NOTRUN", "C/B CRIU")], 3, "NOT RUN (C/B CRIU: detail of C/B CRIU"),
    (PART_A + [("NOTRUN", "C product invocation")], 3, "NOT RUN (C product invocation"),
    (PART_A + [("PASS", n) for n in C_REQUIRED], 0, "GPU_CHECK: PASS"),
    (PART_A + [("PASS", n) for n in C_REQUIRED] + [("INFO", "B criu CLI")], 0, "GPU_CHECK: PASS"),
    (PART_A + [("PASS", n) for n in C_REQUIRED] + [("FAIL", "B criu restore")], 1, "GPU_CHECK: FAIL (1 failed)"),
    (PART_A + [("PASS", n) for n in C_REQUIRED] + [("NOTRUN", "C/B criu check")], 3, "NOT RUN (C/B criu check"),
    (PART_A + [("PASS", n) for n in C_REQUIRED] + [("SKIP", "anything")], 3, "NOT RUN (anything"),
    ([("DRYRUN", "fake driver")] + [("PASS", n) for n in C_REQUIRED], 3, "NOT RUN (dry run: fake driver"),
    ([("PASS", n) for n in C_REQUIRED[:3]], 3, "not passed: C same output after restore + wake"),
    ([("PASS", n) for n in C_REQUIRED[1:]], 3, "not passed: C criu dump"),
    ([("FAIL", C_REQUIRED[0])] + [("PASS", n) for n in C_REQUIRED[1:]], 1, "GPU_CHECK: FAIL (1 failed)"),
    ([("PASS", n) for n in C_REQUIRED] + [("BOGUS", "x")], 1, "GPU_CHECK: FAIL (1 failed)"),
    ([], 3, "GPU_CHECK: NOT RUN"),
])
def test_verdict(tmp_path, rows, code, says):
    got, line = _verdict(tmp_path, rows)
    assert (got, says in line) == (code, True), line


def test_no_criu_run_is_never_pass(tmp_path):
    """Every combination of statuses for everything but part C's CRIU steps: never PASS."""
    names = ["helper -h", "A lock", "A checkpoint", "C/B criu check", "C tree started", "C sleep (unmap + release, VA kept)",
             "B criu dump", "B criu restore"]
    seen = set()
    for statuses in itertools.product(["PASS", "INFO", "FAIL", "NOTRUN", "SKIP"], repeat=3):
        for pick in itertools.combinations(names, 3):
            rows = list(zip(statuses, pick))
            got, line = _verdict(tmp_path, rows)
            assert got != 0 and "PASS" != line.split(": ", 1)[-1], (rows, line)
            seen.add(got)
            break  # one pick per status combination keeps this under a few seconds
    assert seen == {1, 3}


def test_verdict_needs_a_results_file():
    cp = subprocess.run(["bash", str(CHECK), "--verdict", "/nonexistent/results.tsv"], capture_output=True, text=True,
                        timeout=30)
    assert cp.returncode == 2 and "no such file" in cp.stderr


# ---------------------------------------------------------------- library functions (L6, M2)

def _lib(tmp_path, body: str, path_dirs: list[Path] = ()) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "work").mkdir(exist_ok=True)
    script = (f"set -uo pipefail; . {LIB}; START=$(date +%s); MIB=256; OUT={out}; WORK={tmp_path / 'work'}; "
              f"LOG=$OUT/gpu_check.log; RESULTS_FILE=$OUT/results.tsv; : >$RESULTS_FILE; {body}")
    env = {**os.environ, "PATH": ":".join([*map(str, path_dirs), os.environ["PATH"]])}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)


def _fake_program(d: Path, name: str, script: str) -> None:
    d.mkdir(exist_ok=True)
    (d / name).write_text("#!/bin/sh\n" + script)
    (d / name).chmod(0o755)


def test_memory_reading_n_a_is_no_arithmetic_error(tmp_path):
    """L6: under MIG nvidia-smi answers memory.used with [N/A]; the check says so (INFO), it
    does not abort on a bash arithmetic error."""
    _fake_program(tmp_path / "bin", "nvidia-smi", 'echo "[N/A]"\n')
    cp = _lib(tmp_path, 'a=$(gpu_used_mib); b=$(gpu_used_mib); echo "got=[$a]"; '
                        'mem_moved "A GPU memory released" "$a" "$b" down; echo rc=$?; cat $RESULTS_FILE',
              [tmp_path / "bin"])
    assert "got=[]" in cp.stdout and "rc=0" in cp.stdout, cp.stdout + cp.stderr
    assert "INFO\tA GPU memory released\tnot measurable" in cp.stdout
    assert "syntax error" not in cp.stderr and "operand expected" not in cp.stderr, cp.stderr


def test_memory_reading_numbers_are_checked(tmp_path):
    cp = _lib(tmp_path, 'mem_moved "down ok" 1000 700 down; mem_moved "down short" 1000 900 down; '
                        'mem_moved "up ok" 700 1000 up; cat $RESULTS_FILE')
    assert "PASS\tdown ok\t" in cp.stdout and "FAIL\tdown short\t" in cp.stdout and "PASS\tup ok\t" in cp.stdout


def test_pack_leaves_two_files(tmp_path):
    """M2: the device returns at most 8 files; everything but gpu_check.log goes into one archive,
    a file over 4 MiB as its last 4 MiB."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_check.log").write_text("the log\n")
    for i in range(14):
        (out / f"diag-{i}.txt").write_text(f"diagnostic {i}\n")
    (out / "kept").mkdir()
    (out / "kept" / "criu-dump.log").write_text("kept log\n")
    (out / "big.log").write_bytes(b"a" * (5 << 20) + b"THE END")
    cp = _lib(tmp_path, "pack")
    assert cp.returncode == 0, cp.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "gpu_check.tgz"]
    with tarfile.open(out / "gpu_check.tgz") as t:
        names = {n.removeprefix("./") for n in t.getnames()}
        assert {f"diag-{i}.txt" for i in range(14)} | {"kept/criu-dump.log", "big.log", "results.tsv"} <= names
        big = t.extractfile("./big.log").read()
    assert len(big) == 4 << 20 and big.endswith(b"THE END")
    assert (out / "gpu_check.log").read_text().startswith("the log\n")


# ---------------------------------------------------------------- preconditions

def _run_check(tmp_path, path_dirs: list[Path], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_BUDGET_S")}
    env["PATH"] = ":".join([*map(str, path_dirs), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    env["OUT"] = str(tmp_path / "out")
    env.update(extra_env or {})
    return subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_no_gpu_is_not_run_not_fail(tmp_path):
    if any(shutil.which("nvidia-smi", path=p) for p in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
        skip_on_gpu_host("this host has nvidia-smi")
    cp = _run_check(tmp_path, [])
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "GPU_CHECK: NOT RUN" in cp.stdout and "FAIL" not in cp.stdout
    assert "NOTRUN  precondition: no GPU: nvidia-smi is not installed" in cp.stdout
    assert "GPU_CHECK: NOT RUN" in (tmp_path / "out" / "gpu_check.log").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log", "gpu_check.tgz"]


def test_gvisor_kernel_is_not_run_before_anything_else(tmp_path):
    fake = tmp_path / "bin"
    _fake_program(fake, "uname", 'echo 4.4.0\n')  # gVisor's runsc reports this kernel
    _fake_program(fake, "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-x)"\n')
    cp = _run_check(tmp_path, [fake])
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "gVisor kernel (uname -r = 4.4.0)" in cp.stdout and "GPU_CHECK: NOT RUN" in cp.stdout
    assert "FAIL" not in cp.stdout


# ---------------------------------------------------------------- the carry (H3)

def _build_carry(tmp_path: Path, python_version: str) -> Path:
    src = Path(os.environ.get("VLLM_SNAPSHOT_CACHE", "/var/cache/vllm-snapshot")) / "criu-4.2.1"
    assert (src / "criu" / "criu").is_file(), "scripts/setup.sh has not built CRIU here"
    (tmp_path / "scripts").mkdir()
    shutil.copy(CARRY, tmp_path / "scripts" / "gpu_carry.sh")  # it writes <its repo>/.criu-carry
    cp = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_carry.sh"), str(src)], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "GPU_CARRY_PYTHON": python_version})
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return tmp_path / ".criu-carry"


def _harness_third_party() -> set[str]:
    """Distributions outside the standard library that the harness's imports of vllm_snapshot
    load (in the setup venv, where they are installed)."""
    code = ("import sys, importlib.metadata as m\n"
            "before = set(sys.modules)\n"
            "from vllm_snapshot.checkpoint import criu, mountpolicy, inventory; from vllm_snapshot.store import layout; from vllm_snapshot.host import privilege; from vllm_snapshot.supervise import supervisor\n"
            "from vllm_snapshot.engine import mounts, net\n"
            "from vllm_snapshot.host.procs import tree\n"
            "from vllm_snapshot.effects.tools import local_tools\n"
            "from vllm_snapshot.errors import SnapshotError\n"
            # part D's harness (gpu_check_ops.py): the operations and every role of the seam
            "from vllm_snapshot import ops; from vllm_snapshot.effects import http; "
            "from vllm_snapshot.dev import gpu_engine, fakegpu; from vllm_snapshot.report.progress import Reporter\n"
            "local_tools()\n"
            "tops = {n.split('.')[0] for n in set(sys.modules) - before} - set(sys.stdlib_module_names) - {'vllm_snapshot'}\n"
            "dists = m.packages_distributions()\n"
            "print(' '.join(sorted({d.lower().replace('_', '-') for t in tops for d in dists.get(t, [])})))\n")
    cp = subprocess.run([str(VENV_PY), "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cp.returncode == 0, cp.stderr
    return set(cp.stdout.split())


@pytest.mark.integration
def test_carry_holds_criu_ip_pycriu_and_py312_wheels_under_the_limit(tmp_path):
    carry = _build_carry(tmp_path, "3.12")
    for f in ("bin/criu", "bin/ip", "plugins/cuda_plugin.so", "python/pycriu/__init__.py", "python/pycriu/rpc_pb2.py",
              "MANIFEST", ".gitignore"):
        assert (carry / f).is_file(), f
    assert [p.name for p in (carry / "plugins").iterdir()] == ["cuda_plugin.so"]  # -L loads every .so there
    wheels = sorted(p.name for p in (carry / "wheels").glob("*.whl"))
    dists = {w.split("-")[0].replace("_", "-").lower() for w in wheels}
    # what the harness imports beyond the GPU image's packages (psutil and protobuf are in it)
    assert _harness_third_party() - {"psutil", "protobuf"} <= dists, (wheels, _harness_third_party())
    for w in wheels:  # pure Python, or CPython 3.12 manylinux x86_64
        tags = w.removesuffix(".whl").split("-")[-3:]
        assert tags[0] in ("py3", "cp312") and (tags[2] == "any" or "manylinux" in tags[2] and "x86_64" in tags[2]), w
    total = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=ROOT, check=True).stdout.split(b"\0")
    repo = sum((ROOT / os.fsdecode(f)).stat().st_size for f in tracked if f and (ROOT / os.fsdecode(f)).is_file())
    assert total <= 60 * 2**20 and total + repo <= 64 * 2**20, (total, repo)  # the 64 MiB carry limit, repo included
    # the carried pycriu is importable on its own path (part C puts it on PYTHONPATH)
    cp = subprocess.run([sys.executable, "-c", "import pycriu, sys; print(pycriu.__file__)"], capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(carry / "python")}, timeout=60)
    assert cp.stdout.strip() == str(carry / "python" / "pycriu" / "__init__.py"), cp.stderr
    cp = subprocess.run([str(carry / "bin" / "ip"), "-V"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0 and "iproute2" in cp.stdout, cp.stdout + cp.stderr


# ---------------------------------------------------------------- the dry run through real CRIU

def test_no_carried_criu_is_not_run_with_the_reason(tmp_path):
    """H2: without .criu-carry the check used to SKIP parts C and B and could say PASS."""
    cp = _run_check(tmp_path, [], {"GPU_CHECK_FAKE": "1", "GPU_CHECK_CARRY": str(tmp_path / "none"),
                                   "PYTHON": str(VENV_PY)})
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "NOTRUN  C/B CRIU: no carried CRIU at" in cp.stdout
    assert "CRIU did not checkpoint and restore a CUDA process" in cp.stdout.strip().splitlines()[-1]


@pytest.mark.integration
def test_too_little_time_for_part_c_is_not_run(tmp_path):
    carry = _build_carry(tmp_path, _venv_python_version())
    cp = _run_check(tmp_path, [], {"GPU_CHECK_FAKE": "1", "GPU_CHECK_CARRY": str(carry), "PYTHON": str(VENV_PY),
                                   "GPU_CHECK_BUDGET_S": "100"})
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "NOTRUN  C product invocation: too little time left" in cp.stdout, cp.stdout
    assert "PASS    C criu dump" not in cp.stdout and "C tree started" not in cp.stdout


def _venv_python_version() -> str:
    return subprocess.run([str(VENV_PY), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.integration
def test_dry_run_of_the_whole_check_with_the_fake_driver(tmp_path):
    """gpu_check.sh end to end on this CPU host (GPU_CHECK_FAKE=1): the carried wheels (for this
    venv's Python) installed with pip --no-index --target and used, the carried `ip` run by CRIU
    through CR_IP_TOOL, part C through real CRIU as the engine user with the product's scrubbed
    environment, the diagnostics packed into two files, and the verdict NOT RUN (no GPU: never
    PASS), with every part C step PASS."""
    carry = _build_carry(tmp_path, _venv_python_version())
    real_ip = carry / "bin" / "ip.real"
    (carry / "bin" / "ip").rename(real_ip)
    ip_log = tmp_path / "ip.calls"
    _fake_program(carry / "bin", "ip", f'echo "$*" >>{ip_log}\nexec {real_ip} "$@"\n')  # who runs the carried ip
    fc = tmp_path / "fakecuda"
    fc.mkdir()
    out = tmp_path / "out"
    cp = _run_check(tmp_path, [], {"GPU_CHECK_FAKE": "1", "GPU_CHECK_CARRY": str(carry), "PYTHON": str(VENV_PY),
                                   "GPU_CHECK_MIB": "4", "FAKE_CUDA_DIR": str(fc), "HF_TOKEN": "not-for-the-engine"})
    assert cp.returncode == 3, cp.stdout + cp.stderr
    last = cp.stdout.strip().splitlines()[-1]
    assert last.startswith("GPU_CHECK: NOT RUN (dry run: fake driver"), cp.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "gpu_check.tgz"]
    files = {}
    with tarfile.open(out / "gpu_check.tgz") as t:
        for m in t.getmembers():
            if m.isfile():
                files[m.name.removeprefix("./")] = t.extractfile(m).read().decode(errors="replace")
    results = [ln.split("\t") for ln in files["results.tsv"].splitlines()]
    assert [r[0] for r in results if r[0] not in ("PASS", "DRYRUN")] == [], results
    names = [r[1] for r in results]
    for step in ("C/B criu check", "C/B ip runs here", "C product modules import", "C engine user", "C tree started",
                 "C tree runs as the engine user", "C root has no CUDA", "C child is a running CUDA process",
                 "C sleep (unmap + release, VA kept)", "C inventory + external mounts (create's checks)", *C_REQUIRED,
                 "C restored tree runs as the engine user", REMAP_STEP):
        assert step in names, (step, names)
    for step in D_STEPS + D_FILE_STEPS:  # the dry run: part D wakes from the weights file
        assert step in names, (step, names)
    assert "partD.txt" in files and "D the plugin checkpointed" in files["partD.txt"]
    # part D's fake driver has a log of its own: create's dump, restore's restore
    d_calls = [c.split()[0] for c in (fc / "partD" / "calls.log").read_text().splitlines()
               if not c.startswith("get-restore-tid")]
    assert d_calls == ["lock", "checkpoint", "restore", "unlock"]
    imported = dict((r[1], r[2]) for r in results)["C product modules import"]
    assert "/site/pydantic/__init__.py" in imported  # the carried wheel, not the venv's pydantic
    assert "as uid " in dict((r[1], r[2]) for r in results)["C tree started"]
    # CRIU ran the carried ip (CR_IP_TOOL) to save the engine's network namespace
    assert "addr save" in ip_log.read_text() and "route save" in ip_log.read_text()
    # the engine ran with the product's scrubbed environment: no secret, no test knob
    env_line = next(ln for ln in files["partC.txt"].splitlines() if ln.startswith("engine environment (names):"))
    assert "HF_TOKEN" not in env_line and "FAKE_CUDA_DIR" not in env_line and "HF_HUB_OFFLINE" in env_line
    calls = [c.split()[0] for c in (fc / "calls.log").read_text().splitlines() if not c.startswith("get-restore-tid")]
    assert calls == ["lock", "checkpoint", "restore", "unlock"]
    # the restore took the remap path: the identity device map reached the (fake) driver's gpuPairs
    restore = next(c for c in (fc / "calls.log").read_text().splitlines() if c.startswith("restore "))
    assert f"pairs={FAKE_GPU}>{FAKE_GPU} CUDA_SUCCESS" in restore, restore
    env_txt = files["environment.txt"]  # L7
    for section in ("## /proc/self/mountinfo", "## LD_LIBRARY_PATH", "## ldconfig -p | grep -E 'libcuda|libnvidia-ml'",
                    "## command -v ip"):
        assert section in env_txt, section
    assert "pydantic " in env_txt and "blake3 " in env_txt
    for f in ("partC-dump.log", "partC-restore.log"):
        assert "cuda_plugin: initialized" in files[f]


@pytest.mark.integration
def test_part_c_harness_through_real_criu_with_the_fake_driver(tmp_path):
    """The whole part C sequence on this CPU host: the product's LocalCheckpointTools.dump/restore_tree,
    its mount policy, scrubbed environment and privilege drop; PID + mount + network namespace,
    non-CUDA root + 'CUDA' child with a reserved-but-unmapped VA range (level-2 sleep), dump,
    restore, the product's log, state and credential checks, wake at the same VA, same output."""
    from vllm_snapshot.checkpoint import criu

    binary = criu.find_criu()
    fc = tmp_path / "fakecuda"
    fc.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'fakecuda'}:{ROOT}", "FAKE_CUDA_DIR": str(fc),
           "CRIU_FAULT": "138"}
    before = set(Path("/var/lib/vllm-snapshot-gpu-check").glob("tree.*"))
    cp = subprocess.run([sys.executable, str(TREE), "--criu", binary, "--user", "vllm-snapshot",
                         "--out", str(tmp_path / "out"), "--mib", "4", "--fake"],
                        capture_output=True, text=True, env=env, timeout=300)
    results = [ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert results and all(r.startswith("RESULT PASS") for r in results), results
    names = " | ".join(results)
    for step in ("root has no CUDA", "child is a running CUDA process", "tree runs as the engine user",
                 "sleep (unmap + release, VA kept)", *C_REQUIRED, "restored tree runs as the engine user", REMAP_STEP):
        assert step in names
    calls = [c for c in (fc / "calls.log").read_text().splitlines() if not c.startswith("get-restore-tid")]
    assert [c.split()[0] for c in calls] == ["lock", "checkpoint", "restore", "unlock"]
    assert f"pairs={FAKE_GPU}>{FAKE_GPU}" in calls[2]
    assert "timeoutMs=" in calls[0] and calls[0].split("timeoutMs=")[1].split()[0] != "10000"  # not CRIU's 10 s
    assert set(Path("/var/lib/vllm-snapshot-gpu-check").glob("tree.*")) == before  # its work dir is gone
    for log in ("partC-dump.log", "partC-restore.log"):
        assert "cuda_plugin: initialized" in (tmp_path / "out" / log).read_text()


def test_part_d_engine_child_sleeps_wakes_and_answers_on_the_fake_driver(tmp_path):
    """Part D's CUDA child alone (vllm_snapshot/dev/gpu_engine.py --cuda-child) on the fake
    driver: the checksum of the weights at start; asleep, nothing to read (the range is
    unmapped); a wake maps at the same VA and reloads the same checksum; a wake without the
    reload (fresh memory) or without the mapping answers something else."""
    from vllm_snapshot.dev import gpu_engine

    model = gpu_engine.write_model(tmp_path / "model", 4)
    script = "sleep\nanswer\nwake\nanswer\nsleep\nwake no-reload\nanswer\nsleep\nwake no-remap\nanswer\n"
    cp = subprocess.run([sys.executable, "-m", "vllm_snapshot.dev.gpu_engine", "--cuda-child", str(model)], input=script,
                        capture_output=True, text=True, timeout=60, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'fakecuda'}:{ROOT}",
                             "FAKE_CUDA_DIR": str(tmp_path)})
    got = [json.loads(ln) for ln in cp.stdout.splitlines()]  # one reply when ready, then one per command
    assert cp.returncode == 0 and len(got) == 11, cp.stdout + cp.stderr
    ready, slept, asleep_answer, woken, answer, _, woken_fresh, fresh, _, woken_unmapped, unmapped = got
    assert ready["ok"] and ready["bytes"] == 4 << 20 and ready["checksum"].startswith("sum=")
    assert slept == {"ok": True, "va": ready["va"]}
    assert asleep_answer["ok"] is False and "cuMemcpyDtoH: CUDA_ERROR_INVALID_VALUE" in asleep_answer["error"]
    assert woken == {"ok": True, "va": ready["va"]} and answer == {"ok": True, "checksum": ready["checksum"]}
    assert woken_fresh == woken and fresh["ok"] and fresh["checksum"].startswith("sum=0 ")
    assert woken_unmapped == woken
    assert unmapped["ok"] is False and "cuMemcpyDtoH: CUDA_ERROR_INVALID_VALUE" in unmapped["error"]


def _part_d(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str], set[Path]]:
    """Run scripts/gpu_check_ops.py --fake as gpu_check.sh's dry run does; (its run, its RESULT
    lines, the work dirs it left)."""
    from vllm_snapshot.checkpoint import criu

    fc = tmp_path / "fakecuda"
    fc.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'fakecuda'}:{ROOT}", "FAKE_CUDA_DIR": str(fc),
           "CRIU_FAULT": "138"}
    before = set(Path("/var/lib/vllm-snapshot-gpu-check").glob("ops.*"))
    cp = subprocess.run([sys.executable, str(OPS), "--criu", criu.find_criu(), "--user", "vllm-snapshot",
                         "--out", str(tmp_path / "out"), "--mib", "4", "--fake", *extra],
                        capture_output=True, text=True, env=env, timeout=300)
    left = set(Path("/var/lib/vllm-snapshot-gpu-check").glob("ops.*")) - before
    return cp, [ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")], left


def _engines_of(work_dirs: set[str]) -> list[str]:
    """Command lines of live processes of gpu_engine runs whose model lies in one of ``work_dirs``
    (names of ops.* directories)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "vllm_snapshot.dev.gpu_engine" in cmd and any(f"/{d}/" in cmd for d in work_dirs):
            found.append(cmd)
    return found


@pytest.mark.integration
@pytest.mark.parametrize("weights", ["file", "in-image"])
def test_part_d_create_and_restore_through_the_ops_with_the_fake_driver(tmp_path, weights):
    """Part D on this CPU host: ops.create, ops.restore and ops.stop_engines of the
    protocol-speaking VMM engine (vllm_snapshot/dev/gpu_engine.py) through real CRIU with the
    fake driver: create's rehearsal and dump, the plugin on the CUDA child only, the restored
    engine's wake re-maps and reloads (its checksum oracle matches, in the engine and over HTTP),
    stop drains it; the work dir is gone. ``file``: create wrote the GPU memory into a weights
    file through the weights channel, the CUDA child (the engine user) kept it open, CRIU
    re-opened the root-only file for it at restore, and the wake read the weights from it."""
    cp, results, left = _part_d(tmp_path, "--weights", weights)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert results and all(r.startswith("RESULT PASS") for r in results), results
    names = " | ".join(results)
    for step in D_STEPS + (D_FILE_STEPS if weights == "file" else []):
        assert f"RESULT PASS {step}: " in names, step
    assert (weights == "file") == any(step in names for step in D_FILE_STEPS)
    create = next(r for r in results if r.startswith("RESULT PASS D create (ops.create)"))
    assert "engine cuda, sleep level 2" in create and "oracle 'sum=" in create
    recorded = create.split("oracle ", 1)[1]
    same = next(r for r in results if "D same output after restore + wake" in r)
    assert same.split(": ", 1)[1].startswith(f"{recorded} vs {recorded}")
    assert left == set()
    out = tmp_path / "out"
    assert "cuda_plugin: initialized" in (out / "partD-criu-dump.log").read_text()
    assert "CALL prepare-dump" in (out / "partD-engine-create.log").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("broken, says", [
    ("no-reload", "the restored engine's oracle differs; refusing to serve: text: expected 'sum="),
    ("no-remap", "cuMemcpyDtoH: CUDA_ERROR_INVALID_VALUE"),  # the range stayed unmapped
])
def test_part_d_fails_when_the_restored_wake_does_not_bring_the_weights_back(tmp_path, broken, says):
    """A restored engine whose wake maps fresh memory without reloading the weights, or does not
    map at all: part D fails at the restore (its oracle check), serves nothing, leaves no
    process and no work dir."""
    cp, results, left = _part_d(tmp_path, "--break-restored-wake", broken)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert any(r.startswith("RESULT PASS D create (ops.create)") for r in results), results  # create's wake is not broken
    fail = [r for r in results if r.startswith("RESULT FAIL")]
    assert len(fail) == 1 and fail[0].startswith("RESULT FAIL D restore (ops.restore with wake, oracle, canary): "), results
    assert says in fail[0], fail[0]
    assert not any("same output" in r or "D stop" in r for r in results), results
    assert left == set()
    work = {ln.split("/var/lib/vllm-snapshot-gpu-check/", 1)[1].split("/", 1)[0]
            for ln in cp.stdout.splitlines() if "/var/lib/vllm-snapshot-gpu-check/ops." in ln}
    assert work and _engines_of(work) == []


# ---------------------------------------------------------------- the fake VMM (M3's stand-in)

FAKE_VMM_SEQUENCE = r"""
import ctypes
from pathlib import Path
from cuda.bindings import driver as cu
ok = cu.CUresult.CUDA_SUCCESS
bad = cu.CUresult.CUDA_ERROR_INVALID_VALUE
assert cu.cuInit(0) == (ok,)
_, dev = cu.cuDeviceGet(0)
assert cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(dev)[1]) == (ok,)
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
size = cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)[1]
err, va = cu.cuMemAddressReserve(size, 0, 0, 0)
assert err == ok
acc = cu.CUmemAccessDesc()
acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

def create_and_map():
    e, h = cu.cuMemCreate(size, prop, 0)
    assert e == ok
    assert cu.cuMemMap(va, size, 0, h, 0) == (ok,)
    assert cu.cuMemcpyHtoD(va, b"x" * 8, 8) == (bad,)  # not accessible before cuMemSetAccess
    assert cu.cuMemSetAccess(va, size, [acc], 1) == (ok,)
    return h

h = create_and_map()
assert cu.cuMemcpyHtoD(va, b"weights!", 8) == (ok,)
buf = bytearray(8)
assert cu.cuMemcpyDtoH(buf, va, 8) == (ok,) and bytes(buf) == b"weights!"
e, h2 = cu.cuMemCreate(size, prop, 0)
assert cu.cuMemMap(va, size, 0, h2, 0) == (bad,)  # already mapped
assert cu.cuMemMap(va + size, size, 0, h2, 0) == (bad,)  # outside the reservation
# sleep level 2: unmap + release, the reservation stays
assert cu.cuMemUnmap(va, size) == (ok,) and cu.cuMemRelease(h) == (ok,)
assert cu.cuMemcpyDtoH(buf, va, 8) == (bad,)
maps = Path("/proc/self/maps").read_text()
assert any(ln.startswith(f"{va:x}-") and ln.split()[1].startswith("---") for ln in maps.splitlines())
h = create_and_map()  # wake: at the same VA
assert cu.cuMemcpyDtoH(buf, va, 8) == (ok,) and bytes(buf) == bytes(8)  # fresh memory: the reload's job
assert cu.cuMemUnmap(va, size) == (ok,) and cu.cuMemRelease(h) == (ok,) and cu.cuMemRelease(h2) == (ok,)
# a range the kernel no longer holds as a reservation cannot be mapped (what a reservation
# lost in a restore would look like), even while this module's tables still list it
ctypes.CDLL(None).munmap(ctypes.c_void_p(va), ctypes.c_size_t(size))
e, h = cu.cuMemCreate(size, prop, 0)
assert cu.cuMemMap(va, size, 0, h, 0) == (bad,)
print("fake VMM ok")
"""


def test_fake_vmm_keeps_the_reservation_and_checks_the_driver_rules():
    """The fake driver's VMM calls (what part C's child makes in a dry run) follow the real
    driver's rules, so a child that released its reservation at sleep could not re-map at wake.
    In a process of its own: the fake ``cuda`` package must not shadow anything in this one."""
    cp = subprocess.run([sys.executable, "-c", FAKE_VMM_SEQUENCE], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "fakecuda")})
    assert cp.returncode == 0 and "fake VMM ok" in cp.stdout, cp.stdout + cp.stderr


CONTRACT = r"""
import importlib.util, inspect, re, sys
from cuda.bindings import driver as real
spec = importlib.util.spec_from_file_location("fakedriver", sys.argv[1])
fake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake)
sys.path.insert(0, sys.argv[2])
import gpu_check_tree
source = open(sys.argv[3]).read() if len(sys.argv) > 3 else gpu_check_tree.CHILD
# the driver's calls, types and enums (the fake's own knobs, e.g. RESTORE_THREAD, are not the driver's)
used = sorted({n for n in re.findall(r"\bcu\.(\w+)", source) if n.lower().startswith("cu")})
problems = []
for name in used:
    for mod, what in ((real, "cuda-bindings"), (fake, "the fake")):
        if not hasattr(mod, name):
            problems.append(f"{what} has no {name}")
    if name.startswith("cu") and callable(getattr(real, name, None)) and hasattr(fake, name):
        doc = (getattr(real, name).__doc__ or "").split("\n")[0]
        want = [p.strip().split(":")[0].split()[-1] for p in doc[doc.index("(") + 1: doc.rindex(")")].split(",") if p.strip()]
        got = list(inspect.signature(getattr(fake, name)).parameters)
        if want != got:
            problems.append(f"{name}: cuda-bindings takes {want}, the fake {got}")
import ast
def is_cu(v):  # `cu` or `self.cu`
    return isinstance(v, ast.Name) and v.id == "cu" or isinstance(v, ast.Attribute) and v.attr == "cu"
for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_cu(node.func.value)
            and node.func.attr.startswith("cu")):
        doc = (getattr(real, node.func.attr).__doc__ or "").split("\n")[0]
        n = len([p for p in doc[doc.index("(") + 1: doc.rindex(")")].split(",") if p.strip()])
        if len(node.args) + len(node.keywords) != n:
            problems.append(f"line {node.lineno}: {node.func.attr} called with {len(node.args) + len(node.keywords)} "
                            f"arguments, cuda-bindings takes {n}")
for cls, attrs in (("CUmemAllocationProp", ("type", "location", "allocFlags")), ("CUmemAccessDesc", ("location", "flags"))):
    for mod, what in ((real, "cuda-bindings"), (fake, "the fake")):
        obj = getattr(mod, cls)()
        problems += [f"{what} {cls} has no {a}" for a in attrs if not hasattr(obj, a)]
        problems += [f"{what} {cls}.location has no {a}" for a in ("type", "id") if not hasattr(obj.location, a)]
for enum, member in (("CUmemAllocationType", "CU_MEM_ALLOCATION_TYPE_PINNED"), ("CUmemLocationType", "CU_MEM_LOCATION_TYPE_DEVICE"),
                     ("CUmemAccess_flags", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE"),
                     ("CUmemAllocationGranularity_flags", "CU_MEM_ALLOC_GRANULARITY_MINIMUM"),
                     ("CUmemAllocationCompType", "CU_MEM_ALLOCATION_COMP_NONE")):
    if int(getattr(getattr(real, enum), member)) != int(getattr(getattr(fake, enum), member)):
        problems.append(f"{enum}.{member} differs")
print(len(used), "calls and types checked")
print("\n".join(problems))
sys.exit(1 if problems else 0)
"""


@pytest.mark.parametrize("child", [None, ROOT / "vllm_snapshot" / "dev" / "gpu_engine.py"], ids=["part C", "part D"])
def test_the_childs_driver_calls_match_cuda_bindings_and_the_fake(child):
    """What part C's child and part D's engine (vllm_snapshot/dev/gpu_engine.py) call exists in
    the real cuda-bindings (a dev extra; its import needs no GPU) with the fake's parameter
    names, so the dry run exercises the calls the GPU run makes."""
    cp = subprocess.run([str(VENV_PY), "-c", CONTRACT, str(ROOT / "tests" / "fakecuda" / "cuda" / "bindings" / "driver.py"),
                         str(ROOT / "scripts"), *([str(child)] if child else [])], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert int(cp.stdout.split()[0]) >= 15, cp.stdout  # the calls were found: reserve, create, map, ...


def test_part_e_writes_and_fills_the_weights_file_with_the_products_functions(tmp_path):
    # the same steps as on the GPU, on CPU tensors: the script's own logic (on the GPU its
    # results are the device copies'); a fill that does not bring the bytes back must FAIL
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_weights.py"), "--out", str(tmp_path),
                          "--mib", "16", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("RESULT PASS E weights file written from the device: 16 storages, 16 MiB")
    assert lines[1].startswith("RESULT PASS E wake filled from the weights file: 16 MiB") and "same output: True" in lines[1]
    assert list(tmp_path.iterdir()) == []  # its file removed
    broken = tmp_path / "sitecustomize.py"  # a fill that copies nothing
    broken.write_text("from vllm_snapshot.engine import weights as ew\new.fill_in_place = lambda m, e, fd: 0\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_weights.py"), "--out", str(tmp_path),
                          "--mib", "16", "--device", "cpu"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert "RESULT FAIL E wake filled from the weights file" in out.stdout, out.stdout + out.stderr
