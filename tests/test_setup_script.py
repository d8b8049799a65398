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

import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import tomllib
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


def _others_reach(p: Path) -> bool:
    """True when a user with no special rights (mode bits for "other") can reach ``p``."""
    p = Path(os.path.realpath(p))
    return all(d.stat().st_mode & 0o001 for d in p.parents) and bool(p.stat().st_mode & 0o005)


def _python_shim(d: Path, base: str, state: Path, real_venv_site: str) -> Path:
    """``d/python3.11``: runs ``base``, except ``-m venv DIR``, which makes a real venv of
    ``base`` without pip whose site-packages reach the real venv's (what ``pip install -e
    .[cpu,dev]`` would have put there) and whose ``pip`` records what it is asked; asked for
    ``-e CHECKOUT[...]`` it does what an editable install does: CHECKOUT on sys.path and the
    ``vllm-snapshot`` console script."""
    d.mkdir(parents=True, exist_ok=True)
    module, func = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["vllm-snapshot"].split(":")
    _shim(d, "python3.11", f"""if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = venv ]; then
  dir=${{@: -1}}
  {base} -m venv --without-pip "$dir"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo {real_venv_site} > "$site/zz-what-pip-would-install.pth"
  cat > "$dir/bin/pip" <<'PIP'
#!/bin/bash
set -euo pipefail
echo "pip $*" >> {state}/pip.log
bin=$(cd "$(dirname "$0")" && pwd)
prev=
for a in "$@"; do
  if [ "$prev" = -e ]; then
    site=$("$bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "${{a%%[*}}" > "$site/__editable__.vllm_snapshot.pth"
    printf '#!%s\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n' "$bin/python" > "$bin/vllm-snapshot"
    chmod 0755 "$bin/vllm-snapshot"
  fi
  prev=$a
done
PIP
  chmod 0755 "$dir/bin/pip"
  exit 0
fi
exec {base} "$@"
""")
    return d / "python3.11"


@pytest.fixture()
def bare_machine():
    """(env, checkout, state dir, engine user, fake pyenv): a copy of the checkout below a 0700
    directory, an empty setup cache holding only the CRIU build, shims for dpkg-query/apt-get,
    and two ``python3.11`` on PATH: first a "pyenv" one whose interpreter (a copy of a real
    one) lies below that 0700 directory, as a pyenv Python under /root does, then one every
    user can run. The engine user is removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("setup.sh runs as root")
    if not (CRIU_SRC / "criu" / "criu").is_file():
        pytest.skip(f"scripts/setup.sh has not built CRIU at {CRIU_SRC}")
    top = Path(tempfile.mkdtemp(prefix="vsnap-bare-", dir="/var/tmp"))
    os.chmod(top, 0o755)  # the cache below it is reachable by every user, like /var/cache
    user = "vsnap-bare-" + uuid.uuid4().hex[:8]
    try:
        checkout = top / "home" / "clone"
        checkout.mkdir(parents=True)
        os.chmod(top / "home", 0o700)  # like /root: the engine user cannot traverse it
        for part in ("scripts", "vllm_snapshot"):
            shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "pyproject.toml", checkout / "pyproject.toml")
        cache = top / "cache"
        cache.mkdir()
        os.symlink(CRIU_SRC, cache / "criu-4.2.1")  # the build itself is not repeated (minutes)
        # nor the demo model's conversion (~25 s each time): setup finds it complete and keeps it
        (cache / "models").mkdir()
        os.symlink(CACHE / "models" / "smollm2-135m-instruct", cache / "models" / "smollm2-135m-instruct")
        for names in CACHE.glob("vllm-serve-options-*.json"):  # nor vLLM's parser import (~20 s)
            shutil.copy2(names, cache / names.name)
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
        if not _others_reach(Path(base_python)):  # this venv's own Python is a pyenv one under /root
            base_python = "/usr/bin/python3.11"
            assert Path(base_python).is_file(), "scripts/setup.sh installs Debian's python3.11"
        pyenv_bin = top / "root" / ".pyenv" / "versions" / "3.11" / "bin"
        pyenv_bin.mkdir(parents=True)
        os.chmod(top / "root", 0o700)
        shutil.copy2(base_python, pyenv_bin / "python3.11")
        pyenv = _python_shim(top / "root" / ".pyenv" / "shims", str(pyenv_bin / "python3.11"), state, real_venv_site)
        _python_shim(shims, base_python, state, real_venv_site)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_SNAPSHOT", "PYTHON"))}
        env.update(PATH=f"{pyenv.parent}:{shims}:/usr/sbin:/usr/bin:/sbin:/bin", VLLM_SNAPSHOT_CACHE=str(cache),
                   VLLM_SNAPSHOT_ENGINE_USER=user, VLLM_SNAPSHOT_ENGINE_HOME=str(top / "engine-home"))
        yield env, checkout, state, user, pyenv
    finally:
        # ACL entries setup may have added outside this test's directory (the interpreter's
        # directories, e.g. a pyenv Python under /root): take them back before the user goes
        for d in {*_ancestors(Path(os.path.realpath(sys.base_prefix)) / "lib"), *_ancestors(Path(os.path.realpath(sys.executable)).parent)}:
            if not str(d).startswith(str(top)):
                subprocess.run(["setfacl", "-x", f"u:{user}", str(d)], capture_output=True)
        subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", user], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture()
def plain_user():
    """A throw-away user with no rights of its own (removed afterwards) and a HOME for it."""
    from helpers import throwaway_user

    with throwaway_user("vsnap-plain") as u:
        yield u


def _setup(env: dict, checkout: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env=env, cwd=checkout, timeout=300)


def _as_user(user: tuple[str, Path], *argv: str) -> subprocess.CompletedProcess:
    name, home = user
    return subprocess.run(["runuser", "-u", name, "--", "env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", *argv],
                          capture_output=True, text=True, cwd="/", timeout=120)


def test_setup_on_a_bare_machine_installs_what_it_needs_and_finishes(bare_machine):
    env, checkout, state, user, pyenv = bare_machine
    cp = _setup(env, checkout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    err = cp.stderr
    # what it asked the package manager for, once each (apt-get update once, before the first install)
    apt = (state / "apt.log").read_text().splitlines()
    assert apt[0].startswith("apt-get update") and sum(a.startswith("apt-get update") for a in apt) == 1
    installed = (state / "installed").read_text().split()
    assert len(installed) == len(set(installed)), installed
    for pkg in ("build-essential", "libprotobuf-dev", "protobuf-c-compiler", "libnl-3-dev", "iproute2",
                "e2fsprogs", "squashfs-tools", "dosfstools", "shellcheck", "systemd", "acl", "docker-registry",
                "nftables", "libnuma1", "podman", "runc", "catatonit", "openssl"):
        assert pkg in installed, (pkg, apt)
    # the venv: pip was asked for the project with the cpu and dev extras
    pip = (state / "pip.log").read_text()
    assert f"install -q -e {checkout}[cpu,dev,demo]" in pip, pip
    # the engine user exists, with search permission (x, not read) on the 0700 directory
    pw = pwd.getpwnam(user)
    assert pw.pw_dir == env["VLLM_SNAPSHOT_ENGINE_HOME"] and Path(pw.pw_dir).stat().st_uid == pw.pw_uid
    acl = subprocess.run(["getfacl", "-cp", str(checkout.parent)], capture_output=True, text=True, check=True).stdout
    assert f"user:{user}:--x" in acl, acl
    assert subprocess.run(["runuser", "-u", user, "--", "test", "-r", str(checkout / "vllm_snapshot" / "cli" / "app.py")]).returncode == 0
    assert f"granting {user} search permission (ACL u:{user}:x) on {checkout.parent}" in err
    # the "pyenv" python3.11 first on PATH was passed over, saying why; the venv is another's
    pyenv_python = pyenv.parent.parent / "versions" / "3.11" / "bin" / "python3.11"
    assert (f"not building the venv from {pyenv}: its interpreter {pyenv_python} lies below "
            f"{pyenv_python.parents[4]} (mode 700, owner root), which other users cannot traverse") in err, err
    assert f"home = {pyenv_python.parent}" not in (Path(env["VLLM_SNAPSHOT_CACHE"]) / "venv" / "pyvenv.cfg").read_text()
    # the checkout below that 0700 directory: only root and the engine user can start the CLI, and setup says so
    assert (f"warning: the checkout {checkout}/vllm_snapshot lies below {checkout.parent} (mode 700, owner root), "
            "which other users cannot traverse: vllm-snapshot (installed editable from it) starts only for root") in err, err
    # the tiny model, and each step said how long it took
    assert (Path(env["VLLM_SNAPSHOT_CACHE"]) / "models" / "tiny-llama" / "config.json").is_file()
    for label in ("CRIU build", "CRIU check", "system packages", "venv", "engine user", "tiny model", "demo model",
                  "vLLM option names"):
        assert f"[setup] {label}: done in " in err, err
    assert "[setup] ready in " in err
    # idempotent: a second run asks for nothing and reinstalls nothing
    before = (state / "apt.log").read_text()
    cp = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True,
                        env=env, cwd=checkout, timeout=300)
    assert cp.returncode == 0, cp.stderr
    assert (state / "apt.log").read_text() == before
    assert "creating the system user" not in cp.stderr and "granting" not in cp.stderr
    assert "rebuilding the venv" not in cp.stderr and "building the venv from" not in cp.stderr


def test_setup_builds_a_venv_that_users_other_than_root_can_start(bare_machine, plain_user):
    """docs/cli.md: inspect, list and doctor work without root. A "pyenv" Python first on PATH lies
    below a 0700 directory (as one under /root does): the venv built from it would not start
    for any other user ("Permission denied" from exec), so setup builds it from one they can run."""
    env, checkout, state, user, pyenv = bare_machine
    os.chmod(checkout.parent, 0o755)  # a checkout every user can read (e.g. under /opt)
    cp = _setup(env, checkout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "warning: the checkout" not in cp.stderr, cp.stderr
    cli = Path(env["VLLM_SNAPSHOT_CACHE"]) / "venv" / "bin" / "vllm-snapshot"
    run = _as_user(plain_user, str(cli), "list")
    assert run.returncode == 0, run.stdout + run.stderr
    if os.path.isdir("/var/lib/vllm-snapshot"):  # root's store: named, with sudo, instead of "no snapshots"
        assert "root's snapshots are in /var/lib/vllm-snapshot" in run.stdout, run.stdout
    else:
        assert "no snapshots" in run.stdout, run.stdout


def test_setup_rebuilds_a_venv_that_users_other_than_root_cannot_start(bare_machine, plain_user):
    """A venv an older setup built from a Python below a 0700 directory (the stamp says it is
    current) is rebuilt from one every user can run, and setup says why."""
    env, checkout, state, user, pyenv = bare_machine
    os.chmod(checkout.parent, 0o755)
    venv = Path(env["VLLM_SNAPSHOT_CACHE"]) / "venv"
    subprocess.run([str(pyenv), "-m", "venv", str(venv)], check=True, env=env)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e", f"{checkout}[cpu,dev,demo]"], check=True, env=env)
    (venv / ".stamp").write_text(hashlib.sha256((checkout / "pyproject.toml").read_bytes()).hexdigest()[:16] + "\n")
    old = pyenv.parent.parent / "versions" / "3.11" / "bin" / "python3.11"
    assert os.path.realpath(venv / "bin" / "python") == str(old)
    cp = _setup(env, checkout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert (f"[setup] rebuilding the venv {venv}: its interpreter {old} lies below {old.parents[4]} (mode 700, "
            "owner root), which other users cannot traverse, so users other than root could not start vllm-snapshot") in cp.stderr, cp.stderr
    assert "[setup] venv: done in " in cp.stderr
    assert os.path.realpath(venv / "bin" / "python") != str(old)
    run = _as_user(plain_user, str(venv / "bin" / "vllm-snapshot"), "list")
    assert run.returncode == 0, run.stdout + run.stderr


def test_setup_refuses_a_PYTHON_that_users_other_than_root_cannot_run(bare_machine):
    env, checkout, state, user, pyenv = bare_machine
    cp = _setup({**env, "PYTHON": str(pyenv)}, checkout)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    old = pyenv.parent.parent / "versions" / "3.11" / "bin" / "python3.11"
    assert (f"PYTHON={pyenv} cannot build the venv: its interpreter {old} lies below {old.parents[4]} (mode 700, "
            "owner root), which other users cannot traverse. Users other than root could not start vllm-snapshot") in cp.stderr, cp.stderr
    assert not (Path(env["VLLM_SNAPSHOT_CACHE"]) / "venv").exists()


def test_setup_keeps_a_PYTHON_every_user_can_run(bare_machine, plain_user):
    """The override still works: PYTHON names the interpreter, here one that is not first on PATH."""
    env, checkout, state, user, pyenv = bare_machine
    os.chmod(checkout.parent, 0o755)
    good = Path(env["PATH"].split(":")[1]) / "python3.11"
    cp = _setup({**env, "PYTHON": str(good)}, checkout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"[setup] building the venv from {good} (" in cp.stderr and "not building the venv from" not in cp.stderr
    run = _as_user(plain_user, str(Path(env["VLLM_SNAPSHOT_CACHE"]) / "venv" / "bin" / "vllm-snapshot"), "list")
    assert run.returncode == 0, run.stdout + run.stderr
