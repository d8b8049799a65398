"""README's Quick start on a real bare Debian 12 root (marker ``system``).

tests/test_setup_script.py runs scripts/setup.sh with shims for the package managers: fast, but
blind to what a package really brings. Twice a fresh machine failed where the shims passed (the
last time: ``acl`` installed only when a grant was needed, so ``getfacl`` was missing wherever
the clone was not below a 0700 directory). This test runs the real thing:

- the root: ``mmdebstrap --variant=minbase bookworm`` from the host's own apt sources (read at
  run time), cached as ``$VLLM_SNAPSHOT_CACHE/bare-root/bookworm.tar`` (built under a lock into a
  temporary name, then renamed: a partial one is never used); every run extracts a pristine copy
  under /var/tmp and removes it afterwards;
- entered with ``unshare --mount --propagation private --pid --fork --kill-child`` and
  ``chroot`` (tests/bare_root/enter.sh): /proc of the new PID namespace, /sys and /dev bound,
  tmpfs on /run, /tmp and /dev/shm. Every mount lives in that private namespace, so nothing is
  mounted on the host at any time and nothing needs unmounting, however the run ends; the
  namespace's processes die with it. Not systemd-nspawn: it is not installed by default, and it
  drops capabilities and installs a seccomp filter by default, so ``criu check`` would not see
  what root on a real machine sees;
- the checkout: a ``git clone`` of the repository under test with the working tree's tracked
  files copied over it, at /src (mode 0755, not below a 0700 directory: the case that broke);
- inside (tests/bare_root/inside.sh): the README's command for a bare machine (``apt-get ...
  make``), the real ``make setup`` (real apt-get, real pip, the real CRIU build), ``vllm-snapshot
  doctor``, unit tests that need what setup installs (shellcheck, setfacl/getfacl, useradd,
  systemd-analyze, CRIU) with ``CI=true``, and ``make setup`` again from a copy below /root (0700).

Kept fast by caches under ``$VLLM_SNAPSHOT_CACHE/bare-root`` shared between runs (apt's .deb
files, pip's cache), the host's pip configuration (its files copied in, the local directories
they name bound read-only, ``PIP_*`` passed on) and the CRIU source tarball setup already fetched.
The engine user setup creates lives in the root's /etc/passwd only; the host is not changed
except for those caches.
"""

from __future__ import annotations

import configparser
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from conftest import CACHE

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
ENTER = ROOT / "tests" / "bare_root" / "enter.sh"
SUITE = "bookworm"
BARE = CACHE / "bare-root"
TARBALL = BARE / f"{SUITE}.tar"
#: unit tests run inside the root: each needs something setup installs or makes
UNIT_SUBSET = [
    "tests/test_setup_script.py",  # shellcheck, setfacl/getfacl, useradd/runuser, the CRIU build
    "tests/test_notify.py",        # systemd-analyze (package systemd)
    "tests/test_manifest.py",
    "tests/test_store.py",
]
BUILD_TIMEOUT_S = 900      # mmdebstrap: 21 s measured
INSIDE_TIMEOUT_S = 3600    # everything inside the root: 5-6 min measured, with nothing cached
#: where inside.sh leaves its results, inside the root (on its disk, not a tmpfs)
OUT_INSIDE = "/root/bare-root-out"
#: the pip settings whose values may name local files or directories
PIP_PATH_KEYS = ("find-links", "index-url", "extra-index-url", "constraint", "cert", "client-cert")


def host_apt_sources() -> list[Path]:
    """The host's apt source files (``/etc/apt/sources.list`` when it has an entry, then
    ``/etc/apt/sources.list.d/*.sources`` and ``*.list``), in that order. mmdebstrap reads each
    file given as a mirror argument, so the root is built from the host's own mirrors and the
    root's apt uses them too. Raises AssertionError when the host has none."""
    files = []
    main = Path("/etc/apt/sources.list")
    if main.is_file() and any(ln.split()[:1] == ["deb"] for ln in main.read_text().splitlines()):
        files.append(main)
    d = Path("/etc/apt/sources.list.d")
    files += sorted(d.glob("*.sources")) + sorted(d.glob("*.list"))
    assert files, "the host has no apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d)"
    return files


def cached_root_tarball(timeout: float = BUILD_TIMEOUT_S) -> tuple[Path, float]:
    """``(tarball, seconds spent building it)``: the cached minbase root of ``bookworm``,
    built with mmdebstrap when missing (0.0 seconds when it was there). Concurrent callers
    wait on a lock; the tarball is written under a temporary name and renamed when complete,
    so a crash leaves only a temporary file, removed by the next build. Raises AssertionError
    (with mmdebstrap's last output) when the build fails, subprocess.TimeoutExpired after
    ``timeout`` seconds."""
    BARE.mkdir(parents=True, exist_ok=True)
    with open(BARE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if TARBALL.is_file():
            return TARBALL, 0.0
        for stale in BARE.glob(f"{SUITE}.tar.tmp-*"):  # a build killed before its rename
            stale.unlink()
        tmp = BARE / f"{SUITE}.tar.tmp-{os.getpid()}"
        t0 = time.monotonic()
        cp = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", SUITE, str(tmp),
                             *map(str, host_apt_sources())], capture_output=True, text=True, timeout=timeout)
        if cp.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise AssertionError(f"mmdebstrap exited {cp.returncode}:\n{cp.stderr[-4000:]}")
        os.rename(tmp, TARBALL)
        return TARBALL, time.monotonic() - t0


def _local_path(value: str) -> Path | None:
    """The local path a pip setting's value names (``file://`` URL or absolute path), or None."""
    if value.startswith("file://"):
        return Path(urlparse(value).path)
    return Path(value) if value.startswith("/") else None


def host_pip_config() -> tuple[list[Path], list[Path], dict[str, str]]:
    """``(files, directories, environment)``: the host's pip configuration, for the root to get
    the same. ``files``: the config files that exist (``PIP_CONFIG_FILE``, /etc/pip.conf,
    ``$XDG_CONFIG_DIRS``/pip/pip.conf, ~/.config/pip/pip.conf, ~/.pip/pip.conf) and the files
    their settings or ``PIP_*`` variables name (constraints, a CA bundle): to copy to the same
    path inside. ``directories``: the local directories they name (``find-links`` wheel
    directories, ``file://`` indexes): to bind read-only at the same path. ``environment``: the
    ``PIP_*`` variables of this process."""
    home = Path.home()
    candidates = [Path(os.environ["PIP_CONFIG_FILE"])] if os.environ.get("PIP_CONFIG_FILE") else []
    candidates += [Path("/etc/pip.conf")]
    candidates += [Path(d) / "pip" / "pip.conf" for d in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if d]
    candidates += [home / ".config" / "pip" / "pip.conf", home / ".pip" / "pip.conf"]
    configs = [p for p in dict.fromkeys(candidates) if p.is_file()]
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    settings = [(k[4:].lower().replace("_", "-"), v) for k, v in env.items()]
    for conf in configs:
        cp = configparser.ConfigParser(interpolation=None)
        cp.read(conf)
        settings += [(k, cp[s][k]) for s in cp.sections() for k in cp[s]]
    files, dirs = list(configs), []
    for key, value in settings:
        if key not in PIP_PATH_KEYS:
            continue
        for path in filter(None, map(_local_path, value.split())):
            if path.is_dir():
                # a file:// index (PEP 503, DIR/simple/NAME/index.html) links to its files beside
                # it (../../files/...): bind the directory above it too
                dirs.append(path.parent if key.endswith("index-url") else path)
            elif path.is_file():
                files.append(path)
    return list(dict.fromkeys(files)), list(dict.fromkeys(dirs)), env


def pip_cert_files() -> list[Path]:
    """The CA bundles the host's pip configuration names (``cert``, ``PIP_CERT``): the root's
    ``ca-certificates`` package (git recommends it) rewrites /etc/ssl/certs/ca-certificates.crt
    from Debian's list when it is installed, so a copy also goes to the root's
    /usr/local/share/ca-certificates, which every rewrite includes."""
    values = [os.environ.get("PIP_CERT", "")]
    for conf in host_pip_config()[0]:
        if conf.suffix == ".conf":
            cp = configparser.ConfigParser(interpolation=None)
            cp.read(conf)
            values += [cp[s]["cert"] for s in cp.sections() if "cert" in cp[s]]
    return [p for p in dict.fromkeys(filter(None, map(_local_path, values))) if p.is_file()]


def readme_prerequisites() -> str:
    """The command README's Quick start tells a new user to run first on a bare machine: the
    ``apt-get`` line of its first ``sh`` block. Raises AssertionError when there is none or it
    does not install ``make`` (which ``make demo`` and ``make test`` need, and a minimal
    Debian lacks)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("apt-get")]
    assert lines, f"README's Quick start has no apt-get line for a bare machine:\n{block}"
    assert re.search(r"\binstall\b.*\bmake\b", lines[0]), lines[0]
    return lines[0]


def checkout_into(dest: Path) -> None:
    """Make ``dest`` a ``git clone`` of the repository under test whose working tree is this
    checkout's (tracked files as they are now, committed or not; deleted ones removed;
    untracked ones not copied). Raises CalledProcessError when git fails."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(dest)], check=True, timeout=300)
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src, dst = ROOT / name, dest / name
        if src.is_file() or src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            shutil.copy2(src, dst, follow_symlinks=False)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()


def mounts_below(path: Path) -> list[str]:
    """The mount points at or below ``path`` in this process's mount namespace."""
    prefix = str(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")
        if mp == prefix or mp.startswith(prefix + "/"):
            found.append(mp)
    return found


def setup_steps(log: str) -> dict[str, str]:
    """``{step: "how long"}`` from the "[setup] STEP: done in T" and "[setup] ready in T" lines
    of the first ``make setup`` in ``log`` (the one on the bare root; the later one, from the
    copy below /root, reuses its cache)."""
    first = log.split("[bare-root] make setup: ", 1)[0]
    steps = {m[1]: m[2] for m in re.finditer(r"^\[setup\] (.+?): done in (.+)$", first, re.M)}
    ready = re.search(r"^\[setup\] ready in (.+?):", first, re.M)
    if ready:
        steps["total"] = ready[1]
    return steps


@pytest.fixture()
def bare_root():
    """A pristine bare Debian 12 root extracted from the cached tarball under /var/tmp, with the
    checkout at /src and setup's CRIU source tarball in its cache: ``(root, build seconds)``.
    Removed afterwards, unless something is still mounted below it (then the test fails and the
    directory is left, so no rm can reach through a mount)."""
    if os.geteuid() != 0:
        pytest.skip("the bare root is built and entered as root")
    for tool in ("mmdebstrap", "unshare", "chroot", "git"):
        if shutil.which(tool) is None:  # scripts/setup.sh installs mmdebstrap: under CI this fails
            pytest.skip(f"{tool} is not installed (scripts/setup.sh installs mmdebstrap)")
    tarball, build_s = cached_root_tarball()
    top = Path(tempfile.mkdtemp(prefix="vsnap-bare-root-", dir="/var/tmp"))
    root = top / "root"
    try:
        root.mkdir()
        subprocess.run(["tar", "-xf", str(tarball), "-C", str(root), "--numeric-owner"], check=True, timeout=300)
        shutil.copy2("/etc/resolv.conf", root / "etc" / "resolv.conf", follow_symlinks=True)
        checkout_into(root / "src")
        os.chmod(root / "src", 0o755)
        src = CACHE / "criu-src"
        if src.is_dir():  # fetched by the host's setup: the root's setup builds from it, fetching nothing
            shutil.copytree(src, root / "var" / "cache" / "vllm-snapshot" / "criu-src")
        yield root, build_s
    finally:
        left = mounts_below(top)
        if left:
            pytest.fail(f"still mounted below {top} (left in place): {left}")
        # rm (not shutil.rmtree: minutes for a few GB on a busy 2-core box), and never across a
        # file system boundary, should a mount have survived after all
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], timeout=900)


@pytest.mark.timeout(4800)  # the root's build (900 s at most) and the inner run (3600 s at most) bound it
def test_readme_quick_start_on_a_bare_debian_root(bare_root, tmp_path):
    root, build_s = bare_root
    t0 = time.monotonic()
    prereq = readme_prerequisites()
    files, dirs, pip_env = host_pip_config()
    for f in files:
        dst = root / str(f).lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    for i, cert in enumerate(pip_cert_files()):
        local = root / "usr" / "local" / "share" / "ca-certificates"
        local.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cert, local / f"vllm-snapshot-host-pip-{i}.crt")
    binds = [a for d in dirs for a in ("--ro", str(d))]
    for name, inside in (("apt-archives", "/var/cache/apt/archives"), ("pip-cache", "/root/.cache/pip")):
        (BARE / name).mkdir(parents=True, exist_ok=True)
        binds += ["--rw", str(BARE / name), inside]
    env = {"HOME": "/root", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LANG": "C.UTF-8", "TERM": "dumb", "DEBIAN_FRONTEND": "noninteractive", **pip_env}
    env.update({k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")})
    cmd = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
           "bash", str(ENTER), str(root), *binds, "--",
           "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
           "bash", "/src/tests/bare_root/inside.sh", OUT_INSIDE, prereq, *UNIT_SUBSET]
    log_path = tmp_path / "bare-root.log"
    with open(log_path, "w") as log:
        try:
            cp = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=INSIDE_TIMEOUT_S)
            rc = cp.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    out = root / OUT_INSIDE.lstrip("/")
    steps = [ln.split("\t") for ln in (out / "steps.tsv").read_text().splitlines()] if (out / "steps.tsv").is_file() else []
    summary = (f"bare root: tarball built in {build_s:.0f} s (0: cached); inside: "
               + ", ".join(f"{label} {s} s (exit {r})" for label, r, s in steps)
               + f"; setup steps: {setup_steps(text)}; test wall time {wall:.0f} s (+ build)")
    print(summary)
    assert rc == 0, f"the run in the bare root exited {rc}\n{summary}\n--- last lines of {log_path}:\n{text[-8000:]}"
    # every step ran, and setup said how long each of its steps took
    assert [s[0] for s in steps] == ["prerequisites", "make setup", "doctor", "unit tests",
                                     "make setup (checkout under /root)"], summary
    for label in ("CRIU build", "CRIU check", "system packages", "venv", "engine user", "tiny model"):
        assert f"[setup] {label}: done in " in text, text[-8000:]
    assert re.search(r"building CRIU 4\.2\.1", text), "the CRIU build did not run in the bare root"
    assert "using CRIU built from source" in text, text[-8000:]
    # doctor in the chroot: create and restore can work (no check of severity error failed)
    doctor = json.loads((out / "doctor.json").read_text())
    checks = {c["name"]: c for c in doctor["checks"]}
    failed = [c for c in doctor["checks"] if not c["ok"] and c["severity"] == "error"]
    assert not failed and doctor["ok"] and (out / "doctor.rc").read_text().strip() == "0", json.dumps(doctor, indent=1)
    for name in ("root", "criu", "criu-check", "vllm", "pycriu", "python-for-all-users", "engine-user",
                 "engine-user:python", "engine-user:home", "engine-user:models",
                 "program:unshare", "program:mount", "program:tar", "program:ip"):
        assert checks[name]["ok"], (name, checks[name])
    # the checkout below /root (0700): setup granted the engine user search permission with setfacl
    assert "granting vllm-snapshot search permission (ACL u:vllm-snapshot:x) on /root" in text, text[-8000:]
    # setup's engine user was created in the root's /etc/passwd (chroot: the host's is not reachable)
    assert "\nvllm-snapshot:" in (root / "etc" / "passwd").read_text()
