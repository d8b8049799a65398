"""The agent's container image for tests/test_pod_integration.py, built here with no download.

Base: the bare Debian 12 minbase root tests/test_bare_root.py caches
(``$VLLM_SNAPSHOT_CACHE/bare-root/bookworm.tar``, made with mmdebstrap from the host's apt
sources when missing). Added to it, from **this host's installed packages** (``dpkg -L``, files
and symlinks, byte for byte): what the agent runs that minbase lacks -- the Python interpreter
the venv was made from (python3.11 and its standard library), ``ip`` (iproute2: CRIU saves
network namespaces with it), libnuma and libgomp (vLLM's CPU kernels) -- with their
dependencies (``apt-cache depends --recurse --installed``) that minbase does not have. CRIU's
own libraries are among them (protobuf-c, libnl, libnet, nftables, ...). The engine user's
``/etc/passwd`` and ``/etc/group`` lines are copied too: a snapshot records the engine user's
uid, gid and groups and restore refuses another. Then ``ldconfig -r`` and ``podman import``.

What the image does **not** hold, bound from the node instead (hostPath volumes in the pod, as
an operator would keep one copy on the node): the venv with vLLM and torch, CRIU and pycriu
(setup.sh's cache, ``/var/cache/vllm-snapshot``), the checkout (the venv installs it
editable), the models, the engine user's HOME (its compile caches), and the snapshot store."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from conftest import CACHE

#: what the agent runs that minbase lacks (their dependencies are added too)
PACKAGES = ["python3.11", "python3.11-dev", "g++", "openssl", "iproute2", "libnuma1", "libgomp1", "libprotobuf-c1", "libnl-3-200", "libnet1",
            "libnftables1", "libbsd0", "libaio1"]
#: alternatives apt-cache lists for a dependency minbase satisfies with another package
NOT_WANTED = {"libelogind0", "usr-is-merged"}
ENGINE_USER = os.environ.get("VLLM_SNAPSHOT_ENGINE_USER", "vllm-snapshot")


def _base_packages(tarball: Path) -> set[str]:
    with tarfile.open(tarball) as tf:
        status = tf.extractfile("./var/lib/dpkg/status").read().decode()
    return {ln.split()[1] for ln in status.splitlines() if ln.startswith("Package:")}


def packages_to_add(tarball: Path) -> list[str]:
    """The host packages whose files go into the image: :data:`PACKAGES` and their installed
    dependencies, less what the base root has. Raises AssertionError when one is not
    installed here (scripts/setup.sh installs them)."""
    cp = subprocess.run(["apt-cache", "depends", "--recurse", "--installed", "--no-recommends", "--no-suggests",
                         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", "--no-pre-depends",
                         *PACKAGES], capture_output=True, text=True, check=True)
    closure = {ln.split(":")[0] for ln in cp.stdout.splitlines() if ln and not ln.startswith((" ", "<"))}
    missing = [p for p in PACKAGES if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                                     text=True).stdout.strip() != "install ok installed"]
    assert not missing, f"not installed on this host: {missing} (scripts/setup.sh installs them)"
    return sorted(closure - _base_packages(tarball) - NOT_WANTED)


def build_rootfs(tarball: Path, dest: Path) -> list[str]:
    """Extract ``tarball`` into ``dest`` and add the host's files of :func:`packages_to_add`,
    the engine user and the loader cache. Returns the packages added."""
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(dest)], check=True)
    pkgs = packages_to_add(tarball)
    listed = subprocess.run(["dpkg", "-L", *pkgs], capture_output=True, text=True, check=True).stdout.splitlines()
    files = sorted({f.lstrip("/") for f in listed if f.startswith("/") and (os.path.islink(f) or os.path.isfile(f))})
    src = subprocess.Popen(["tar", "-C", "/", "-cf", "-", "--no-recursion", "-T", "-"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    dst = subprocess.Popen(["tar", "-C", str(dest), "-xf", "-"], stdin=src.stdout)
    src.stdout.close()
    src.stdin.write("\n".join(files).encode() + b"\n")
    src.stdin.close()
    assert src.wait() == 0 and dst.wait() == 0, "copying the host's package files into the root failed"
    for db in ("passwd", "group"):
        line = next(ln for ln in Path(f"/etc/{db}").read_text().splitlines() if ln.startswith(f"{ENGINE_USER}:"))
        with open(dest / "etc" / db, "a") as f:
            f.write(line + "\n")
    subprocess.run(["ldconfig", "-r", str(dest)], check=True)
    return pkgs


def import_image(podman: list[str], rootfs: Path, tag: str, env: dict | None = None) -> None:
    """``podman import`` the directory ``rootfs`` as ``tag`` (``podman`` is the argv prefix with
    its storage options, ``env`` its environment)."""
    src = subprocess.Popen(["tar", "-C", str(rootfs), "-cf", "-", "."], stdout=subprocess.PIPE)
    cp = subprocess.run([*podman, "import", "--quiet", "-", tag], stdin=src.stdout, capture_output=True, text=True,
                        env=env)
    src.stdout.close()
    assert src.wait() == 0 and cp.returncode == 0, f"podman import failed: {cp.stderr[-2000:]}"


def remove_rootfs(rootfs: Path) -> None:
    shutil.rmtree(rootfs, ignore_errors=True)
