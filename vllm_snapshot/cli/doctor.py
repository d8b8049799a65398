"""``vllm-snapshot doctor``: can this host create and restore snapshots? What is missing?

:func:`run_checks` returns one :class:`Check` per fact, in a fixed order. Every fact comes
from a :class:`Probes` object (``RealProbes`` here; tests pass a fake), so each check is a
pure function of what the probes answer and can be tested for hosts this machine is not
(no root, no CRIU, old CRIU, GPU hosts, ...).

Severity: ``error`` -- create or restore cannot work until this is fixed (:func:`exit_code`
is then 11, :class:`~vllm_snapshot.errors.EnvironmentProblem`'s exit code); ``warning`` --
they can work but something is degraded or risky; ``info`` -- a fact worth seeing (versions,
settings). A check that passed has ``ok=True`` whatever its severity.

Which CRIU features are checked, and why (names as ``criu check --feature NAME`` takes them
in CRIU 4.2.1, ``feature_list`` in ``criu/cr-check.c``): ``ns_pid`` (``NSpid:`` in
/proc/PID/status: the engine tree is PID 1 of its own PID namespace), ``clone3_set_tid``
(restoring the namespace's PIDs exactly), ``move_mount_set_group`` (CRIU's mount-v2 engine
for the private mount namespace), ``fdinfo_lock`` (``--file-locks``), ``kcmp_epoll`` (epoll
instances of asyncio/ZMQ). ``uffd-noncoop`` and ``pidfd_store`` are deliberately not
checked: they serve ``--lazy-pages`` and pre-dump/page-server, which vllm-snapshot does not use.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from ..checkpoint import criu as criu_mod
from .. import paths
from ..errors import EnvironmentProblem, q
from .probes import (CAPS_RECOMMENDED, CAPS_REQUIRED, CRIU_CHECK_TIMEOUT_S, CRIU_FEATURES, DEFAULT_SNAPSHOT_ROOT,
                     DEV_SHM, IO_URING_SYSCTL, MIN_FREE_DEV_SHM, MIN_FREE_SNAPSHOT_ROOT, MIN_GPU_DRIVER, PROC_GPUS,
                     SUPPORTED_VLLM, Check, Probes, RealProbes, Severity, empty_cgroups)  # noqa: F401 (re-exported)

_CAP_USE = {"CAP_NET_ADMIN": "TCP repair (--tcp-established)", "CAP_SYS_RESOURCE": "rlimits, PR_SET_MM",
            "CAP_DAC_OVERRIDE": "files of other users"}
# recommended capabilities whose absence the product works around (docs/security.md, "Containers
# whose root lacks CAP_SYS_RESOURCE"): a note, not a warning that stays on every such host
_CAP_HANDLED = {"CAP_SYS_RESOURCE": "a dump runs CRIU as the engine user to read its rlimits, "
                "a restore sets the memory layout with PR_SET_MM_MAP, which does not need it"}


# ----------------------------------------------------------------------------- helpers

def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _caps(p: Probes) -> int | None:
    text = p.read_text("/proc/self/status") or ""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", text, re.M)
    return int(m.group(1), 16) if m else None


def _missing_caps(eff: int, wanted: dict[str, int], last_cap: int | None) -> list[str]:
    # A capability newer than the kernel (e.g. CAP_CHECKPOINT_RESTORE before 5.9) is not asked for.
    return [n for n, bit in wanted.items() if (last_cap is None or bit <= last_cap) and not eff >> bit & 1]


def _kernel_tuple(release: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ----------------------------------------------------------------------------- checks

def _check_root(p: Probes) -> list[Check]:
    euid = p.euid()
    eff = _caps(p)
    lc_text = p.read_text("/proc/sys/kernel/cap_last_cap")
    last_cap = int(lc_text) if lc_text and lc_text.strip().isdigit() else None
    out = []
    if eff is None:
        req_missing, rec_missing, caps_known = [], [], False
    else:
        req_missing = _missing_caps(eff, CAPS_REQUIRED, last_cap)
        rec_missing = _missing_caps(eff, CAPS_RECOMMENDED, last_cap)
        caps_known = True
    if euid != 0:
        out.append(Check("root", False, "error",
                         f"running as uid {euid}; create and restore need root (CRIU needs CAP_SYS_ADMIN and more)",
                         "run vllm-snapshot as root (sudo)"))
    elif req_missing:
        out.append(Check("root", False, "error",
                         f"root, but missing capabilities: {', '.join(req_missing)} (a restricted container?)",
                         "run in the host's namespaces with full capabilities (e.g. a privileged container)"))
    else:
        out.append(Check("root", True, "error",
                         "root with the capabilities CRIU needs" if caps_known
                         else "root (effective capabilities could not be read)"))
    handled = [c for c in rec_missing if c in _CAP_HANDLED]
    unhandled = [c for c in rec_missing if c not in _CAP_HANDLED]
    note = ("; no " + ", ".join(handled) + " (as root in many containers), which is handled: "
            + "; ".join(_CAP_HANDLED[c] for c in handled)) if handled else ""
    if euid == 0 and unhandled:
        out.append(Check("capabilities", False, "warning",
                         "missing " + ", ".join(f"{c} ({_CAP_USE[c]})" for c in unhandled)
                         + ": CRIU may fail on those steps" + note,
                         "grant them if a dump or restore fails on such a step"))
    elif euid == 0 and handled:
        out.append(Check("capabilities", True, "warning", note[2].upper() + note[3:]))
    return out


def _check_criu(p: Probes) -> tuple[list[Check], str | None]:
    binary = p.find_criu()
    if binary is None:
        return [Check("criu", False, "error", "CRIU not found ($VLLM_SNAPSHOT_CRIU, "
                      "$VLLM_SNAPSHOT_CACHE/bin/criu, PATH)",
                      "install CRIU >= 4.2 (Ubuntu 24.04+/Debian 13+: apt install criu) or run scripts/setup.sh")], None
    rc, out = p.run([binary, "--version"], 10)
    v = criu_mod.parse_version(out)
    if rc != 0 or v is None:
        return [Check("criu", False, "error", f"cannot read `{q(binary)} --version`: {_last_line(out)}",
                      "reinstall CRIU (scripts/setup.sh)")], binary
    if not criu_mod.version_ok(v):
        return [Check("criu", False, "error", f"CRIU {v} at {binary} is older than 4.2 (4.1 fails on kernels >= 6.16)",
                      "install CRIU >= 4.2, or run scripts/setup.sh (builds 4.2.1 into /var/cache/vllm-snapshot)")], binary
    return [Check("criu", True, "error", f"CRIU {v} at {binary}")], binary


def _not_checked(name: str, euid: int, why: str) -> Check:
    """A check only root can make, seen by another user: not a failure of the host (the
    ``root`` check already fails), so no false "not supported" or "could not run"."""
    return Check(name, False, "info", f"not checked as uid {euid}: {why} needs root",
                 "run `sudo vllm-snapshot doctor` to check it")


def _check_criu_kernel(p: Probes, binary: str) -> list[Check]:
    euid = p.euid()
    if euid != 0:  # `criu check` as another user only says it lacks capabilities
        return [_not_checked("criu-check", euid, "`criu check`"),
                *(_not_checked(f"criu-feature:{feat}", euid, f"`criu check --feature {feat}` ({why})")
                  for feat, _sev, why in CRIU_FEATURES)]
    out = []
    rc, text = p.run([binary, "check"], CRIU_CHECK_TIMEOUT_S)
    if rc == 0:
        out.append(Check("criu-check", True, "error", f"`criu check`: {_last_line(text)}"))
    else:
        out.append(Check("criu-check", False, "error", f"`criu check` exited {rc}: {_last_line(text)}",
                         f"run `{q(binary)} check` as root and fix what it reports (kernel config, capabilities)"))
    for feat, sev, why in CRIU_FEATURES:
        rc, text = p.run([binary, "check", "--feature", feat], CRIU_CHECK_TIMEOUT_S)
        name = f"criu-feature:{feat}"
        if rc == 0:
            out.append(Check(name, True, sev, f"supported; used for: {why}"))
        else:
            out.append(Check(name, False, sev, f"not supported: {_last_line(text)} -- needed for: {why}",
                             "a newer kernel (and CRIU >= 4.2) provides it"))
    return out


def _check_io_uring(p: Probes) -> Check:
    v = p.read_text(IO_URING_SYSCTL)
    ours = ("the engine avoids io_uring anyway (UV_USE_IO_URING=0, plain asyncio) and create "
            "refuses a tree holding one (exit 10: CRIU cannot dump it)")
    if v is None:
        return Check("io_uring", True, "info",
                     f"kernel.io_uring_disabled is absent (kernel < 6.6: io_uring allowed); {ours}")
    v = v.strip()
    meaning = {"0": "io_uring allowed for all processes",
               "1": "io_uring only for CAP_SYS_ADMIN or kernel.io_uring_group (root engines still can)",
               "2": "io_uring disabled for all processes"}.get(v, "unknown value")
    remedy = "" if v == "2" else "optional: sysctl -w kernel.io_uring_disabled=2 rules it out host-wide"
    return Check("io_uring", True, "info", f"kernel.io_uring_disabled={v} ({meaning}); {ours}", remedy)


def _check_ksm(p: Probes) -> Check:
    """KSM's state for ``restore --merge-pages`` (docs/weights.md): info only, nothing needs it."""
    base = "/sys/kernel/mm/ksm/"
    run = (p.read_text(base + "run") or "").strip()
    use = "restore/serve/switch --merge-pages"
    if run == "1":
        scan, sleep = ((p.read_text(base + n) or "?").strip() for n in ("pages_to_scan", "sleep_millisecs"))
        return Check("ksm", True, "info", f"KSM runs (run=1, pages_to_scan={scan}, sleep_millisecs={sleep}): engines "
                     f"restored with {use} share their identical pages")
    if run in ("0", "2"):
        return Check("ksm", True, "info", f"KSM is not running (run={run}): {use} marks the engine's memory "
                     "mergeable, but nothing is merged", "optional, to share identical pages between clones: "
                     "echo 1 > /sys/kernel/mm/ksm/run (docs/security.md: KSM's side channels)")
    return Check("ksm", True, "info", f"this kernel has no KSM (/sys/kernel/mm/ksm): {use} is refused")


def _check_kernel(p: Probes) -> list[Check]:
    rel = p.kernel_release()
    kt = _kernel_tuple(rel)
    if kt is not None and kt < (5, 9):
        k = Check("kernel", False, "warning", f"Linux {rel}: older than 5.9 (no CAP_CHECKPOINT_RESTORE, "
                  "untested with vllm-snapshot)", "use a kernel >= 5.9 (Ubuntu 24.04 / Debian 13 ship 6.x)")
    else:
        k = Check("kernel", True, "info", f"Linux {rel} (restore needs the snapshot's)")
    g = p.glibc()
    return [k, Check("glibc", True, "info", f"{g} (restore needs the snapshot's)")]


def _unsafe_parent(p: Probes, path: str, euid: int) -> str | None:
    # The same rule restore applies (layout.check_dir_safety): parents owned by us or root,
    # not group/world-writable unless sticky and root-owned.
    for parent in Path(path).parents:
        st = p.stat(str(parent))
        if st is None:
            continue
        if st.st_uid not in (0, euid):
            return f"parent {parent} is owned by uid {st.st_uid}"
        if stat.S_IMODE(st.st_mode) & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
            return f"parent {parent} is writable by group/others"
    return None


def _check_snapshot_root(p: Probes, root: str) -> list[Check]:
    euid = p.euid()
    st = p.lstat(root)
    out = []
    if st is None:
        out.append(Check("snapshot-root", False, "warning", f"{root} does not exist (the default snapshot location)",
                         f"install -d -m 0700 {q(root)}"))
    elif stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        out.append(Check("snapshot-root", False, "error",
                         f"{root} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                         "restore refuses snapshots below it", "replace it with a real directory (mode 0700)"))
    elif st.st_uid not in (0, euid):
        out.append(Check("snapshot-root", False, "error", f"{root} is owned by uid {st.st_uid}; restore refuses "
                         "snapshots below it", f"chown root:root {q(root)}"))
    elif stat.S_IMODE(st.st_mode) & 0o022:
        out.append(Check("snapshot-root", False, "error", f"{root} has mode {stat.S_IMODE(st.st_mode):04o} "
                         "(group/world-writable); restore refuses snapshots below it", f"chmod 0700 {q(root)}"))
    elif (why := _unsafe_parent(p, root, euid)) is not None:
        out.append(Check("snapshot-root", False, "error", f"{why}; restore refuses snapshots below {root}",
                         "fix the ownership/mode of that directory"))
    else:
        mode = stat.S_IMODE(st.st_mode)
        note = "" if mode & 0o077 == 0 else " (0700 recommended: snapshot names stay private)"
        w = "" if p.writable(root) else "; not writable (create will fail there, restore works)"
        out.append(Check("snapshot-root", True, "warning", f"{root}: mode {mode:04o}, owner uid {st.st_uid}{note}{w}"))
    # free space on the file system that holds (or would hold) the root
    probe = root
    while p.lstat(probe) is None and probe not in ("/", ""):
        probe = os.path.dirname(probe) or "/"
    free = p.free_bytes(probe)
    if free is None:
        out.append(Check("snapshot-root-space", False, "warning", f"cannot read free space of {probe}"))
    elif free < MIN_FREE_SNAPSHOT_ROOT:
        out.append(Check("snapshot-root-space", False, "warning",
                         f"{_gib(free)} free at {probe}; a snapshot needs about the engine's memory (weights included)",
                         "free space or put snapshots on a larger file system"))
    else:
        out.append(Check("snapshot-root-space", True, "warning", f"{_gib(free)} free at {probe}"))
    return out


def _check_mounts(p: Probes) -> list[Check]:
    """The host's mounts as the engine's namespace will treat them (engine/mounts.py): which
    are detached, which become CRIU external mounts (bound back at restore), which refuse.
    The model is not known here: a model's own disk shows as detached and becomes external
    at create."""
    from ..engine import mounts as M

    text = p.mountinfo()
    if not text:
        return [Check("mounts", False, "warning", "cannot read /proc/self/mountinfo", "run as root")]
    env = {"HOME": p.env("HOME") or "/root", "LD_LIBRARY_PATH": p.env("LD_LIBRARY_PATH") or ""}
    got = M.classify(M.parse_mountinfo(text), M.needed_paths(None, env))  # the driver included

    def fmt(action: str, why: bool) -> list[str]:
        return list(dict.fromkeys(f"{m.mount_point} ({m.fs_type})" + (f": {r}" if why else "")
                                  for m, a, r in got if a == action))

    det, ext, ref = fmt(M.DETACH, False), fmt(M.EXTERNAL, True), fmt(M.REFUSE, True)
    out = [Check("mounts-detached", True, "info", f"{len(det)} detached in the engine's namespace (not needed; "
                 "a mount holding the model becomes external at create): " + (", ".join(det) or "none")),
           Check("mounts-external", True, "info", f"{len(ext)} passed to CRIU as external mounts: "
                 + ("; ".join(ext) or "none"))]
    if ref:
        out.append(Check("mounts-refused", False, "error", "mounts the engine needs but CRIU cannot checkpoint: "
                         + "; ".join(ref), "move the venv/caches to a local disk (not FUSE, not an automount)"))
    return out



def _check_leftovers(p: Probes, root: str) -> Check:
    if p.euid() != 0:  # staging, the engine registry and the store are root's: another user sees none
        return _not_checked("leftovers", p.euid(), "looking for leftovers (root's staging, engine registry and cgroups)")
    from .render import partial_pull_line

    left = p.leftovers(root)
    # kept on purpose (prune keeps them): said, never a failed check
    kept = "".join(f"; {partial_pull_line(x)}" for x in (p.partial_pulls(root) or []))
    if not left:
        return Check("leftovers", True, "warning",
                     "no leftovers of killed creates or restores, no empty engine cgroups" + kept)
    return Check("leftovers", False, "warning",  # each says what it holds: an empty cgroup holds nothing
                 f"{len(left)} leftover(s) of killed commands or exited engines: " + "; ".join(left[:5])
                 + (" ..." if len(left) > 5 else "") + kept,
                 "vllm-snapshot prune (or the next create/restore) removes them")


def _check_dev_shm(p: Probes) -> Check:
    st = p.stat(DEV_SHM)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return Check("dev-shm", False, "error", f"{DEV_SHM} is missing; the engine mounts its private tmpfs there",
                     "mount a tmpfs on /dev/shm (mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm)")
    mode = stat.S_IMODE(st.st_mode)
    free = p.free_bytes(DEV_SHM)
    if free is None or free < MIN_FREE_DEV_SHM:
        return Check("dev-shm", False, "warning",
                     f"{DEV_SHM}: mode {mode:04o}, {'unknown' if free is None else _gib(free)} free; "
                     "restore stages images on disk (slower) when it lacks room",
                     "enlarge /dev/shm (mount -o remount,size=... /dev/shm)")
    return Check("dev-shm", True, "warning", f"{DEV_SHM}: mode {mode:04o}, {_gib(free)} free (restore staging)")


def _check_programs(p: Probes) -> list[Check]:
    why = {"unshare": "starts the engine in its own PID + mount + network namespace",
           "mount": "mounts the engine's private /tmp and /dev/shm",
           "tar": "CRIU dumps tmpfs contents with it",
           # CRIU 4.2.1 criu/net.c runs `ip addr|route save` at dump and `ip ... restore` at
           # restore for a tree with its own network namespace (every engine's)
           "ip": "CRIU saves and restores the engine's network namespace (addresses, routes) with it"}
    short = {"unshare": "engine namespaces", "mount": "private tmpfs mounts", "tar": "CRIU tmpfs dumps",
             "ip": "CRIU network namespace dumps"}
    package = {"unshare": "util-linux", "mount": "mount", "tar": "tar", "ip": "iproute2"}
    out = []
    for name, reason in why.items():
        path = p.which(name)
        if path:
            out.append(Check(f"program:{name}", True, "error", f"{path} ({short[name]})"))
        else:
            out.append(Check(f"program:{name}", False, "error", f"`{name}` is not on PATH; it {reason}",
                             f"apt install {package[name]}"))
    return out


def _check_python(p: Probes) -> list[Check]:
    out = []
    v = p.vllm_version()
    if v == "absent":
        out.append(Check("vllm", False, "error", f"vLLM is not installed for {sys.executable}",
                         "pip install 'vllm-snapshot[cpu]' (or [cuda]) into this environment"))
    elif v == "unknown":
        out.append(Check("vllm", False, "warning", "vLLM is installed but its version cannot be read "
                         "(vllm/_version.py); snapshots record it for restore",
                         "reinstall vLLM"))
    elif v.split("+")[0] != SUPPORTED_VLLM:
        out.append(Check("vllm", False, "warning", f"vLLM {v}: the engine was checked against vLLM {SUPPORTED_VLLM} "
                         "(it uses vLLM's server internals, which move between releases)",
                         f"pip install 'vllm-snapshot[cuda]' (pins vllm=={SUPPORTED_VLLM}) or [cpu]"))
    else:
        out.append(Check("vllm", True, "error", f"vLLM {v}"))
    err = p.import_error("pycriu")
    if err is None:
        out.append(Check("pycriu", True, "error", "importable"))
    else:
        out.append(Check("pycriu", False, "error", f"pycriu is not importable: {err}",
                         "run scripts/setup.sh (adds CRIU's lib/ to the venv), or apt install python3-criu "
                         "for a system Python"))
    return out


#: What of this Python other users need to start the CLI (``inspect``, ``list``, ``doctor``
#: work without root), from :meth:`Probes.python_paths`: key -> (mode bits "other" needs, fix).
_FOR_EVERY_USER = (
    ("Python interpreter", stat.S_IXOTH, "make setup (it rebuilds the venv on a Python every user can run, passing "
     "over one under /root)"),
    ("standard library", stat.S_IROTH | stat.S_IXOTH, "make setup (it rebuilds the venv on a Python every user can "
     "run, passing over one under /root)"),
    ("Python environment", stat.S_IROTH | stat.S_IXOTH, "make setup (it rebuilds the venv where every user can "
     "read it)"),
    ("vllm_snapshot package", stat.S_IROTH | stat.S_IXOTH, "clone the checkout where every user can read it "
     "(e.g. /opt or /srv), then make setup"),
)


def _out_of_others_reach(p: Probes, path: str, need: int) -> str | None:
    """Why users other than root (and than those an ACL names) cannot use ``path``: a directory
    above it without o+x, or ``path`` itself without ``need``; None when they can, or when a
    stat fails (nothing to say). Mode bits only, as setup's check."""
    target = Path(path)
    for d in reversed(target.parents):
        st = p.stat(str(d))
        if st is None:
            return None
        if not st.st_mode & stat.S_IXOTH:
            return (f"lies below {d} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}), which other users "
                    "cannot traverse")
    st = p.stat(path)
    if st is None or st.st_mode & need == need:
        return None
    return f"has mode {stat.S_IMODE(st.st_mode):04o}: other users lack {'r' if need & stat.S_IROTH else ''}x"


def _check_python_for_every_user(p: Probes) -> Check:
    """A warning, not an error (root can still create and restore): when the interpreter (a
    pyenv Python under /root), the standard library, the venv or the checkout are out of other
    users' reach, no user but root (and the engine user, given an ACL) can start the CLI."""
    py = p.python_paths()
    exe = py.get("Python interpreter", "?")
    for key, need, fix in _FOR_EVERY_USER:
        path = py.get(key)
        why = _out_of_others_reach(p, path, need) if path else None
        if why:
            return Check("python-for-all-users", False, "warning",
                         f"users other than root cannot start vllm-snapshot: its {key} {path} {why}"
                         + ("" if key == "Python interpreter" else f" (interpreter {exe})")
                         + "; inspect, list and doctor are meant to work for every user", fix)
    return Check("python-for-all-users", True, "warning",
                 f"every user can start vllm-snapshot (its interpreter {exe})")


def _check_plugin(p: Probes, criu_binary: str | None) -> list[Check]:
    # the same lookup CRIU runs use (criu.find_cuda_plugin: paired with the binary), with this
    # probe's files and cache setting; then the config files that could redirect CRIU's libdir
    cache = p.env("VLLM_SNAPSHOT_CACHE")
    try:
        found = criu_mod.find_cuda_plugin(criu_binary, is_file=p.is_file, cache=Path(cache) if cache else None)
    except EnvironmentProblem as e:
        return [Check("criu-cuda-plugin", False, "error", e.message, e.hint or "")]
    out = [Check("criu-cuda-plugin", True, "error", f"{found}")]
    env = {"HOME": p.env("HOME") or "/root", "CRIU_CONFIG_FILE": p.env("CRIU_CONFIG_FILE") or ""}
    bad = [(f, d) for f, d in criu_mod.config_libdirs(p.read_text, env) if d.rstrip("/") != str(found.parent)]
    if bad:
        out.append(Check("criu-config-libdir", False, "error",
                         "; ".join(f"{f} sets libdir {d}" for f, d in bad) + f": CRIU would not load {found}",
                         "remove the libdir line (it beats CRIU_LIBS_DIR)"))
    return out


def _check_gpu(p: Probes, criu_binary: str | None) -> list[Check]:
    if not p.is_dir(PROC_GPUS):
        return [Check("gpu", True, "info", f"no NVIDIA GPU ({PROC_GPUS} absent): CPU engines")]
    out = []
    try:
        gpus = p.gpus()
    except EnvironmentProblem as e:
        gpus = []
        out.append(Check("gpu", False, "error", e.message, e.hint or "check the NVIDIA driver (nvidia-smi)"))
    if gpus:
        names = "; ".join(f"{g.name} ({g.uuid})" for g in gpus)
        out.append(Check("gpu", True, "error", f"{len(gpus)} GPU(s): {names}"))
        drivers = sorted({g.driver for g in gpus})
        majors = [int(m.group(1)) for d in drivers if (m := re.match(r"(\d+)", d))]
        if majors and min(majors) >= MIN_GPU_DRIVER:
            out.append(Check("gpu-driver", True, "error", f"NVIDIA driver {', '.join(drivers)}"))
        else:
            out.append(Check("gpu-driver", False, "error",
                             f"NVIDIA driver {', '.join(drivers)}: the checkpoint driver API needs r{MIN_GPU_DRIVER} or newer",
                             f"install an NVIDIA driver >= {MIN_GPU_DRIVER}"))
    out += _check_plugin(p, criu_binary)
    err = p.import_error("cuda.bindings.driver")
    if err is not None:
        out.append(Check("cuda-checkpoint", False, "error",
                         f"the cuda-checkpoint helper needs cuda-bindings: {err}",
                         "pip install 'vllm-snapshot[cuda]' (cuda-bindings >= 13)"))
    else:
        # The same test CRIU's plugin makes (cuda_checkpoint_supports_flag): `-h` exits 0 and
        # mentions --action. Our -h probes the driver (cuInit, driver API >= 12080), so this
        # is a real driver call, not a static text.
        rc, text = p.run([sys.executable, "-W", "ignore", "-m", "vllm_snapshot.checkpoint.cuda_checkpoint", "-h"], 60)
        if rc == 0 and "--action" in text:
            out.append(Check("cuda-checkpoint", True, "error",
                             "vllm-snapshot-cuda-checkpoint reaches the driver's checkpoint API"))
        elif rc == 0:
            out.append(Check("cuda-checkpoint", False, "error",
                             "the NVIDIA driver has no checkpoint API: " + " ".join(text.split())[:300],
                             f"install an NVIDIA driver >= {MIN_GPU_DRIVER}"))
        else:
            out.append(Check("cuda-checkpoint", False, "error",
                             f"`python -m vllm_snapshot.checkpoint.cuda_checkpoint -h` exited {rc}: {_last_line(text)}",
                             "check the NVIDIA driver (nvidia-smi) and reinstall vllm-snapshot with the [cuda] extra"))
    return out


def _check_engine_user(p: Probes) -> list[Check]:
    """The engine user (:data:`privilege.DEFAULT_USER`): exists and is not root; can read
    (and not write) the Python environment the engine imports; has a writable HOME (compile
    caches); can read the model store (``$VLLM_SNAPSHOT_CACHE/models``) when there is one."""
    from ..host import privilege

    name = privilege.DEFAULT_USER
    u = p.engine_user(name)
    if u is None:
        return [Check("engine-user", False, "error", f"the engine user {name} does not exist (the engine tree runs "
                      "as it, without capabilities)", privilege.USERADD_HINT)]
    if u.uid == 0:
        return [Check("engine-user", False, "error", f"the engine user {name} has uid 0: the engine would run as root",
                      f"userdel {name}, then: {privilege.USERADD_HINT}")]
    out = [Check("engine-user", True, "error", f"{name} (uid {u.uid}, gid {u.gid}, HOME {u.home})")]
    store = str(paths.model_store(p.env))
    euid = p.euid()
    if euid != 0:  # the checks below run a process as that user (setuid, setgroups: root's)
        names = ["engine-user:python", "engine-user:home"] + (["engine-user:models"] if p.is_dir(store) else [])
        return out + [_not_checked(c, euid, f"a check run as {name}") for c in names]
    py = p.python_paths()
    probs = p.user_access(u, reach=list(py.values()),
                          nowrite=[v for k, v in py.items() if k.endswith(("environment", "package"))])
    out.append(Check("engine-user:python", not probs, "error",
                     "; ".join(probs[:3]) if probs else f"can read, not write, {py.get('Python environment', '?')}",
                     "" if not probs else "install vllm-snapshot and its venv where every user can read them (root-owned, mode 0755; "
                     "scripts/setup.sh grants search permission on a /root ancestor with an ACL)"))
    probs = p.user_access(u, write=[u.home])
    out.append(Check("engine-user:home", not probs, "error",
                     "; ".join(probs) if probs else f"{u.home} is writable (vLLM's compile cache)",
                     "" if not probs else f"install -d -o {q(name)} -g {u.gid} -m 0700 {q(u.home)}"))
    if p.is_dir(store):
        probs = p.user_access(u, read=[store])
        out.append(Check("engine-user:models", not probs, "warning",
                         "; ".join(probs[:3]) if probs else f"can read every model under {store}",
                         "" if not probs else f"chmod -R a+rX {q(store)}, or setfacl -R -m u:{q(name)}:rX {q(store)}"))
    return out


def run_checks(probes: Probes | None = None, *, snapshot_root: str = DEFAULT_SNAPSHOT_ROOT) -> list[Check]:
    """Every check, in a fixed order: root/capabilities, CRIU (version, ``criu check``,
    features), io_uring, kernel, glibc, KSM (for ``--merge-pages``), snapshot root (permissions, free space), /dev/shm,
    helper programs, vLLM, pycriu, whether every user can start the CLI (its interpreter, venv
    and checkout within other users' reach), the engine user (exists, reads the venv and the model
    store, writable HOME), and on GPU hosts the GPU, driver, CRIU CUDA plugin and
    cuda-checkpoint helper."""
    p = probes or RealProbes()
    checks: list[Check] = []
    checks += _check_root(p)
    crit, binary = _check_criu(p)
    checks += crit
    if binary is not None:
        checks += _check_criu_kernel(p, binary)
    checks.append(_check_io_uring(p))
    checks += _check_kernel(p)
    checks.append(_check_ksm(p))
    checks += _check_snapshot_root(p, snapshot_root)
    checks.append(_check_dev_shm(p))
    checks.append(_check_leftovers(p, snapshot_root))
    checks += _check_mounts(p)
    checks += _check_programs(p)
    checks += _check_python(p)
    checks.append(_check_python_for_every_user(p))
    checks += _check_engine_user(p)
    checks += _check_gpu(p, binary)
    return checks


def exit_code(checks: Sequence[Check]) -> int:
    """0 when no ``error``-severity check failed (create and restore can work), else 11
    (:class:`EnvironmentProblem`'s exit code)."""
    return EnvironmentProblem.exit_code if any(not c.ok and c.severity == "error" for c in checks) else 0
