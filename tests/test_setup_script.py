"""scripts/setup.sh on a simulated bare machine, and every shell script through bash -n and
shellcheck.

The bare machine: the real script runs with shims first on PATH for the package managers only --
``dpkg-query`` knows no package until the ``apt-get`` shim has "installed" it (it records what it
was asked), and the ``python3.11`` shim makes a real venv (without pip) whose ``pip`` records what
it was asked and whose site-packages reach the real venv's (what ``pip install -e .[cpu,dev]``
would have put there). Everything else is real: ``criu check`` on the CRIU that setup built,
``useradd`` of a throw-away engine user, ``runuser``/``setfacl`` on a checkout copied below a
0700 directory the user cannot traverse (like a clone under /root), the tiny model generated.
A session on a fresh machine found the bug this guards: installing ``acl`` from inside the
traverse check replaced the caller's path with "acl" and setup exited 1.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from conftest import CACHE

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"
CRIU_SRC = CACHE / "criu-4.2.1"


def shell_scripts() -> list[Path]:
    """Every tracked file of the repo that is a shell script (by its #! line)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in out.decode().split("\0"):
        p = ROOT / name
        if not name or not p.is_file():
            continue
        with open(p, "rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and (first.rstrip().endswith(b"sh") or b"bash" in first):
            found.append(p)
    return found


def test_the_shell_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in shell_scripts()}
    assert {".ci/run", "scripts/setup.sh", "scripts/gpu_check.sh", "scripts/gpu_carry.sh",
            "scripts/timeshare.sh", "vllm_snapshot/checkpoint/criu_ruid.sh"} <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shell_script_parses_and_is_shellcheck_clean(script):
    cp = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    sc = shutil.which("shellcheck")
    if sc is None:  # scripts/setup.sh installs it: under CI this skip fails the run (conftest)
        pytest.skip("shellcheck is not installed (scripts/setup.sh installs it)")
    cp = subprocess.run([sc, "-x", str(script)], capture_output=True, text=True, timeout=60, cwd=script.parent)
    assert cp.returncode == 0, cp.stdout


def _ancestors(p: Path) -> list[Path]:
    return [p, *p.parents]


def _shim(d: Path, name: str, body: str) -> None:
    (d / name).write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    (d / name).chmod(0o755)


@pytest.fixture()
def bare_machine():
    """(env, checkout, state dir, engine user): a copy of the checkout below a 0700 directory,
    an empty setup cache holding only the CRIU build, shims for dpkg-query/apt-get/python3.11.
    The engine user is removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("setup.sh runs as root")
    if not (CRIU_SRC / "criu" / "criu").is_file():
        pytest.skip(f"scripts/setup.sh has not built CRIU at {CRIU_SRC}")
    # under /var/tmp: mkdtemp makes it 0700, which the engine user cannot traverse
    top = Path(tempfile.mkdtemp(prefix="vsnap-bare-", dir="/var/tmp"))
    user = "vsnap-bare-" + uuid.uuid4().hex[:8]
    try:
        checkout = top / "home" / "clone"
        checkout.mkdir(parents=True)
        os.chmod(top / "home", 0o700)
        for part in ("scripts", "vllm_snapshot"):
            shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "pyproject.toml", checkout / "pyproject.toml")
        cache = top / "cache"
        cache.mkdir()
        os.symlink(CRIU_SRC, cache / "criu-4.2.1")  # the build itself is not repeated (minutes)
        state = top / "state"
        state.mkdir()
        shims = top / "shims"
        shims.mkdir()
        (state / "installed").touch()
        _shim(shims, "dpkg-query", f"""# dpkg-query -W -f=FORMAT PKG: a bare machine knows only what apt-get installed
pkg=${{@: -1}}
if grep -qx -- "$pkg" {state}/installed; then printf 'install ok installed'; exit 0; fi
echo "dpkg-query: no packages found matching $pkg" >&2; exit 1
""")
        _shim(shims, "apt-get", f"""echo "apt-get $*" >> {state}/apt.log
install=0
for a in "$@"; do
  case $a in
    install) install=1 ;;
    -*) ;;
    *) if [ $install = 1 ]; then echo "$a" >> {state}/installed; fi ;;
  esac
done
""")
        real_venv_site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip()
        base_python = subprocess.run([sys.executable, "-c", "import sys, os; print(os.path.realpath(sys.executable))"],
                                     capture_output=True, text=True, check=True).stdout.strip()
        _shim(shims, "python3.11", f"""# python3.11 -m venv DIR: a real venv without pip; its pip records what it is asked
if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = venv ]; then
  dir=${{@: -1}}
  {base_python} -m venv --without-pip "$dir"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo {real_venv_site} > "$site/zz-what-pip-would-install.pth"
  printf '#!/bin/sh\\necho "pip $*" >> {state}/pip.log\\n' > "$dir/bin/pip"
  chmod 0755 "$dir/bin/pip"
  exit 0
fi
exec {base_python} "$@"
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_SNAPSHOT", "PYTHON"))}
        env.update(PATH=f"{shims}:/usr/sbin:/usr/bin:/sbin:/bin", VLLM_SNAPSHOT_CACHE=str(cache),
                   VLLM_SNAPSHOT_ENGINE_USER=user, VLLM_SNAPSHOT_ENGINE_HOME=str(top / "engine-home"))
        yield env, checkout, state, user
    finally:
        # ACL entries setup may have added outside this test's directory (the interpreter's
        # directories, e.g. a pyenv Python under /root): take them back before the user goes
        for d in {*_ancestors(Path(os.path.realpath(sys.base_prefix)) / "lib"), *_ancestors(Path(os.path.realpath(sys.executable)).parent)}:
            if not str(d).startswith(str(top)):
                subprocess.run(["setfacl", "-x", f"u:{user}", str(d)], capture_output=True)
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", user], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


def test_setup_on_a_bare_machine_installs_what_it_needs_and_finishes(bare_machine):
    env, checkout, state, user = bare_machine
    cp = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True,
                        env=env, cwd=checkout, timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    err = cp.stderr
    # what it asked the package manager for, once each (apt-get update once, before the first install)
    apt = (state / "apt.log").read_text().splitlines()
    assert apt[0].startswith("apt-get update") and sum(a.startswith("apt-get update") for a in apt) == 1
    installed = (state / "installed").read_text().split()
    assert len(installed) == len(set(installed)), installed
    for pkg in ("build-essential", "libprotobuf-dev", "protobuf-c-compiler", "libnl-3-dev", "iproute2",
                "e2fsprogs", "squashfs-tools", "dosfstools", "shellcheck", "systemd", "acl"):
        assert pkg in installed, (pkg, apt)
    # the venv: pip was asked for the project with the cpu and dev extras
    pip = (state / "pip.log").read_text()
    assert f"install -q -e {checkout}[cpu,dev]" in pip, pip
    # the engine user exists, with search permission (x, not read) on the 0700 directory
    pw = pwd.getpwnam(user)
    assert pw.pw_dir == env["VLLM_SNAPSHOT_ENGINE_HOME"] and Path(pw.pw_dir).stat().st_uid == pw.pw_uid
    acl = subprocess.run(["getfacl", "-cp", str(checkout.parent)], capture_output=True, text=True, check=True).stdout
    assert f"user:{user}:--x" in acl, acl
    assert subprocess.run(["runuser", "-u", user, "--", "test", "-r", str(checkout / "vllm_snapshot" / "cli" / "app.py")]).returncode == 0
    assert f"granting {user} search permission (ACL u:{user}:x) on {checkout.parent}" in err
    # the tiny model, and each step said how long it took
    assert (Path(env["VLLM_SNAPSHOT_CACHE"]) / "models" / "tiny-llama" / "config.json").is_file()
    for label in ("CRIU build", "CRIU check", "system packages", "venv", "engine user", "tiny model"):
        assert f"[setup] {label}: done in " in err, err
    assert "[setup] ready in " in err
    # idempotent: a second run asks for nothing and reinstalls nothing
    before = (state / "apt.log").read_text()
    cp = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True,
                        env=env, cwd=checkout, timeout=300)
    assert cp.returncode == 0, cp.stderr
    assert (state / "apt.log").read_text() == before
    assert "creating the system user" not in cp.stderr and "granting" not in cp.stderr
