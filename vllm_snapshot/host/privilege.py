"""Least privilege: the engine tree runs as an unprivileged user with no capabilities.

What runs as root and why: the CLI (the supervisor) and CRIU. CRIU needs CAP_SYS_ADMIN and
more to dump and restore a process tree; the supervisor creates the engine's PID, mount and
network namespaces (``unshare``), and binds the HTTP port in the host's namespace. The engine
tree -- vLLM's API server (the process that faces the network), EngineCore, its workers,
tokenizers, a model's custom code -- needs none of that. So the engine root, PID 1 of its own
namespaces, starts as root only to set those namespaces up (private mounts, ``lo`` up), then
:func:`drop_to` makes it the engine user for good, before vLLM is imported: supplementary
groups set to the user's, real/effective/saved uid and gid set to the user's, the capability
bounding set emptied, ambient and inheritable capabilities cleared (a uid change from 0 clears
the permitted and effective sets, capabilities(7) "Effect of user ID changes on
capabilities"), and ``PR_SET_NO_NEW_PRIVS`` set (no setuid binary or file capability can give
any of it back, prctl(2)). Everything vLLM forks inherits that.

CRIU restores the credentials it dumped (uids, gids, groups, the five capability sets and
no_new_privs: criu/cr-restore.c ``prepare_creds`` / the restorer's ``restore_creds``), so a
restored tree runs with the same ones; restore checks that in /proc (:func:`creds_problems`)
and refuses to serve otherwise.

The default user is the dedicated system user :data:`DEFAULT_USER`, created by
``scripts/setup.sh`` (HOME :data:`DEFAULT_HOME`, shell nologin); ``create --user NAME`` names
another. Root is refused.
"""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

#: The engine user ``create`` uses unless ``--user`` says otherwise (made by scripts/setup.sh).
DEFAULT_USER = "vllm-snapshot"
#: Its home (vLLM's compile cache ~/.cache/vllm and torch inductor's cache live below it).
DEFAULT_HOME = "/var/lib/vllm-snapshot-engine"
#: What to run when the user is missing (scripts/setup.sh does exactly this).
USERADD_HINT = (f"run scripts/setup.sh (as root), or: useradd --system --user-group --home-dir {DEFAULT_HOME} "
                f"--create-home --shell /usr/sbin/nologin {DEFAULT_USER}")

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


@dataclass(frozen=True)
class User:
    """An engine user as the password and group databases say now: ``groups`` are the
    supplementary group ids (``getgrouplist``, primary gid included, sorted)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def require_root(what: str) -> None:
    """The one root check: raise EnvironmentProblem (exit 11) naming the command ``what``
    when this process is not root (CRIU, the engine namespaces, the snapshot store and the
    engine registry are root's), before anything runs."""
    from ..errors import EnvironmentProblem

    if os.geteuid() != 0:
        raise EnvironmentProblem(f"vllm-snapshot {what} must run as root (CRIU, the engine namespaces, "
                                 "the snapshot store and the engine registry are root's)", hint="run it with sudo")


def lookup(name: str, getpwnam: Callable = pwd.getpwnam,
           grouplist: Callable[[str, int], list[int]] = os.getgrouplist) -> User:
    """The user ``name`` (a name or a decimal uid) from the password database. Raises
    KeyError when there is no such user."""
    pw = pwd.getpwuid(int(name)) if name.isdigit() and getpwnam is pwd.getpwnam else getpwnam(name)
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(sorted(set(grouplist(pw.pw_name, pw.pw_gid)))), pw.pw_dir)


def identity_problems(recorded_name: str, uid: int, gid: int, groups: Iterable[int],
                      getpwnam: Callable = pwd.getpwnam, getpwuid: Callable = pwd.getpwuid,
                      grouplist: Callable[[str, int], list[int]] = os.getgrouplist) -> list[str]:
    """Why the recorded engine user (``recorded_name`` with ``uid``/``gid``/``groups``) is not
    the same user on this host: deleted, re-numbered, its uid given to another name, its
    primary group or group list changed. Empty when it is the same. Pure over the lookups."""
    out = []
    try:
        pw = getpwnam(recorded_name)
    except KeyError:
        pw = None
        out.append(f"user {recorded_name!r} (uid {uid}) does not exist on this host")
    try:
        owner = getpwuid(uid).pw_name
    except KeyError:
        owner = None
    if owner is not None and owner != recorded_name:
        out.append(f"uid {uid} belongs to {owner!r} here, not to {recorded_name!r}")
    if pw is not None:
        if pw.pw_uid != uid:
            out.append(f"user {recorded_name!r} has uid {pw.pw_uid} here, the snapshot's engine runs as uid {uid}")
        if pw.pw_gid != gid:
            out.append(f"user {recorded_name!r} has primary gid {pw.pw_gid} here, the snapshot's engine runs as gid {gid}")
        now = sorted(set(grouplist(recorded_name, pw.pw_gid)))
        if pw.pw_gid == gid and now != sorted(set(groups)):
            out.append(f"user {recorded_name!r} is in groups {now} here, the snapshot's engine holds {sorted(set(groups))}")
    return out


# ---------------------------------------------------------------- /proc/PID/status

@dataclass(frozen=True)
class Creds:
    """Credentials of one process from ``/proc/PID/status`` (proc(5)): real, effective,
    saved, filesystem uids and gids; supplementary groups; capability sets as integers
    (bit N = capability N); NoNewPrivs (0/1); Seccomp mode (0 none, 1 strict, 2 filter)."""

    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    cap_inh: int
    cap_prm: int
    cap_eff: int
    cap_bnd: int
    cap_amb: int
    no_new_privs: int
    seccomp: int = 0


def parse_status(text: str) -> Creds:
    """:class:`Creds` from ``/proc/PID/status`` text. Raises ValueError when a field is
    missing (CapAmb and NoNewPrivs exist since Linux 4.3 / 4.10). Pure."""
    f: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            f[k.strip()] = v.strip()
    try:
        return Creds(uids=tuple(int(x) for x in f["Uid"].split()), gids=tuple(int(x) for x in f["Gid"].split()),
                     groups=tuple(sorted(int(x) for x in f.get("Groups", "").split())),
                     cap_inh=int(f["CapInh"], 16), cap_prm=int(f["CapPrm"], 16), cap_eff=int(f["CapEff"], 16),
                     cap_bnd=int(f["CapBnd"], 16), cap_amb=int(f["CapAmb"], 16),
                     no_new_privs=int(f["NoNewPrivs"]), seccomp=int(f.get("Seccomp", "0")))
    except KeyError as e:
        raise ValueError(f"/proc status without {e.args[0]}") from e


#: Capability names by number (linux/include/uapi/linux/capability.h, 0-40).
CAP_NAMES = ("chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
             "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
             "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
             "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control",
             "setfcap", "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read",
             "perfmon", "bpf", "checkpoint_restore")


def cap_name(n: int) -> str:
    """``CAP_SYS_TIME`` for 25; ``cap_N`` past the table. Pure."""
    return f"CAP_{CAP_NAMES[n].upper()}" if n < len(CAP_NAMES) else f"cap_{n}"


def caps_beyond(core_creds: dict, own_status: str) -> list[int]:
    """Capability numbers the dumped root process held (``creds`` of CRIU's ``core-PID.img``:
    ``cap_prm``/``cap_eff``/``cap_inh`` as [low 32 bits, high 32 bits]) that this process has
    not in its permitted set (``/proc/self/status`` text). CRIU restores a task's capabilities
    with capset(2), which cannot grant what the restorer lacks: CRIU 4.2.1 then logs "Unable to
    restore capabilities" and its restore hangs (measured under the units' bounding set). Pure."""
    def val(v) -> int:
        return (int(v[0]) | int(v[1]) << 32) if isinstance(v, (list, tuple)) else int(v or 0)

    held = val(core_creds.get("cap_prm")) | val(core_creds.get("cap_eff")) | val(core_creds.get("cap_inh"))
    own = parse_status(own_status).cap_prm
    return [n for n in range(64) if held >> n & 1 and not own >> n & 1]


def creds_problems(pid: int, c: Creds, uid: int, gid: int, groups: Iterable[int]) -> list[str]:
    """What in process ``pid``'s credentials differs from the engine user's (``uid``,
    ``gid``, supplementary ``groups``) with no capability at all and NoNewPrivs set. Pure."""
    out = []
    if set(c.uids) != {uid}:
        out.append(f"PID {pid}: uids {'/'.join(map(str, c.uids))}, expected {uid}")
    if set(c.gids) != {gid}:
        out.append(f"PID {pid}: gids {'/'.join(map(str, c.gids))}, expected {gid}")
    if sorted(set(c.groups)) != sorted(set(groups)):
        out.append(f"PID {pid}: groups {list(c.groups)}, expected {sorted(set(groups))}")
    for name, label in (("cap_inh", "CapInh"), ("cap_prm", "CapPrm"), ("cap_eff", "CapEff"), ("cap_bnd", "CapBnd"),
                        ("cap_amb", "CapAmb")):
        v = getattr(c, name)
        if v:
            out.append(f"PID {pid}: {label} {v:016x}, expected 0")
    if c.no_new_privs != 1:
        out.append(f"PID {pid}: NoNewPrivs {c.no_new_privs}, expected 1")
    return out


def tree_problems(creds: dict[int, Creds], uid: int, gid: int, groups: Iterable[int],
                  pids: Iterable[int] = ()) -> list[str]:
    """Problems with a tree's credentials (``creds``: pid -> :class:`Creds`, e.g. from
    :func:`tree_creds`): every process must run as ``uid``/``gid``/``groups`` with no
    capability and NoNewPrivs set, and each of ``pids`` must be among them. Pure."""
    groups = tuple(groups)
    out = [f"PID {p}: no credentials read (gone?)" for p in pids if p not in creds]
    if not creds:
        out.append("no process of the tree found")
    for pid in sorted(creds):
        out += creds_problems(pid, creds[pid], uid, gid, groups)
    return out


def tree_creds(pids: Iterable[int]) -> dict[int, Creds]:
    """pid -> :class:`Creds` for each PID still there (host PIDs; gone ones are left out)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = parse_status(Path(f"/proc/{pid}/status").read_text())
        except (OSError, ValueError):
            continue
    return out


# ---------------------------------------------------------------- the drop (inside the engine)

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 63


def drop_to(uid: int, gid: int, groups: Iterable[int]) -> None:
    """Become ``uid``/``gid`` with supplementary ``groups`` for good, with every capability set
    empty and NoNewPrivs set (the module doc says how). Must run as root (it needs CAP_SETUID,
    CAP_SETGID, CAP_SETPCAP). The parent-death signal is cleared by the uid change (prctl(2)):
    the caller sets it again. Raises OSError naming the step that failed; PermissionError when
    the result still holds a capability."""
    if uid == 0:
        raise PermissionError("refusing to 'drop' to uid 0")
    libc = ctypes.CDLL(None, use_errno=True)

    def prctl(what: str, *args: int) -> None:
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl({what}): {os.strerror(err)}")

    os.setgroups(sorted(set(groups)))
    os.setresgid(gid, gid, gid)
    for cap in range(_last_cap() + 1):  # the bounding set: needs CAP_SETPCAP, so before setuid
        prctl(f"PR_CAPBSET_DROP {cap}", PR_CAPBSET_DROP, cap, 0, 0, 0)
    prctl("PR_CAP_AMBIENT_CLEAR_ALL", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.setresuid(uid, uid, uid)  # from 0 to non-0: permitted and effective sets cleared
    hdr, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(hdr), data) != 0:  # inheritable too
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    prctl("PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    got = parse_status(Path("/proc/self/status").read_text())
    problems = creds_problems(os.getpid(), got, uid, gid, groups)
    if problems:
        raise PermissionError("privileges not dropped: " + "; ".join(problems))


# ---------------------------------------------------------------- what the user can read

#: Runs as the engine user (``python -I -S -c``): argv[1] is JSON
#: ``{"read": [dirs/files walked and opened], "exec": [dirs traversed], "nowrite": [...],
#: "write": [...]}``; prints a JSON list of problems.
_CHECKER = r"""
import json, os, sys
spec = json.loads(sys.argv[1]); out = []
def walk(top):
    if os.path.isfile(top):
        yield top; return
    if not os.access(top, os.R_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", top)
    for d, dirs, files in os.walk(top, onerror=lambda e: (_ for _ in ()).throw(e), followlinks=True):
        for n in files:
            yield os.path.join(d, n)
for p in spec["read"]:
    try:
        for f in walk(p):
            if os.path.exists(f):  # a dangling link is the model digest's business
                os.close(os.open(f, os.O_RDONLY))
    except OSError as e:
        f = e.filename or p
        why = f"cannot read {f}: {e.strerror}"
        d = os.path.dirname(os.path.abspath(f))
        blocked = None
        while d and d != "/":  # the outermost directory this user cannot pass is the one to fix
            if not os.access(d, os.X_OK):
                blocked = d
            d = os.path.dirname(d)
        if blocked:
            why += f" (the directory {blocked} is not searchable by this user)"
        out.append(why)
for p in spec["exec"]:
    try:
        os.stat(p)
        if not os.access(p, os.R_OK | os.X_OK):
            out.append(f"cannot read {p}: Permission denied")
    except OSError as e:
        out.append(f"cannot reach {p}: {e.strerror}")
for p in spec["nowrite"]:
    if os.access(p, os.W_OK):
        out.append(f"can write {p} (it must be read-only to the engine)")
for p in spec["write"]:
    if not os.access(p, os.W_OK | os.X_OK):
        out.append(f"cannot write {p}")
print(json.dumps(out))
"""


def access_problems(user: User, read: Iterable[Path] = (), reach: Iterable[Path] = (),
                    nowrite: Iterable[Path] = (), write: Iterable[Path] = (), timeout_s: float = 120.0) -> list[str]:
    """What ``user`` cannot do that the engine needs, checked by a short Python process that
    runs as that user (so every permission the kernel checks counts: modes, ACLs, parent
    directories, mount flags): every file under each of ``read`` opened for reading (links
    followed), each of ``reach`` readable and traversable, none of ``nowrite`` writable, each
    of ``write`` writable. A ``read`` path that does not exist (as root sees it) is not
    checked: its absence is the business of what reads it (restore's model check says "does not
    exist"); as the user a missing path and one it cannot search look alike. Needs root. Returns
    human lines (empty: all good). Raises OSError when the checker cannot run."""
    spec = {"read": [str(p) for p in read if os.path.lexists(p)], "exec": [str(p) for p in reach], "nowrite": [str(p) for p in nowrite],
            "write": [str(p) for p in write]}
    p = subprocess.run([sys.executable, "-I", "-S", "-c", _CHECKER, json.dumps(spec)], capture_output=True, text=True,
                       user=user.uid, group=user.gid, extra_groups=list(user.groups), cwd="/", env={"PATH": "/usr/bin:/bin"},
                       timeout=timeout_s)
    if p.returncode != 0:
        raise OSError(f"the access check as {user.name} failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def python_paths() -> dict[str, Path]:
    """What of this Python the engine imports: the interpreter, the environment (venv), the
    standard library, and the vllm, torch and vllm_snapshot packages (found without importing
    them). what -> path."""
    import importlib.util
    import sysconfig

    out = {"Python environment": Path(sys.prefix), "Python interpreter": Path(sys.executable).resolve(),
           "standard library": Path(sysconfig.get_paths()["stdlib"]),
           "vllm_snapshot package": Path(__file__).resolve().parents[1]}
    for name in ("vllm", "torch"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or [])[:1] if spec else []:
            out[f"{name} package"] = Path(loc)
    return out


__all__ = ["DEFAULT_HOME", "DEFAULT_USER", "Creds", "User", "access_problems", "creds_problems", "drop_to",
           "identity_problems", "lookup", "parse_status", "python_paths", "tree_creds", "tree_problems"]
