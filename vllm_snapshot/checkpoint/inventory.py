"""Inventory of an engine process tree before the CRIU dump, and the checks restore makes
against it.

:func:`inspect_tree` looks at a root PID and all its descendants (host PIDs, through psutil and
``/proc``) and refuses -- :class:`~vllm_snapshot.errors.UnsnapshottableError`, naming PID,
command and object, with a hint -- when the tree holds something CRIU cannot checkpoint, or
could only restore wrongly because it is shared with the world outside the tree:

- a connected TCP socket (IPv4/IPv6) whose peer socket is not held by a process of the tree;
- a unix socket whose peer socket is not held by the tree (peers come from the kernel's
  ``NETLINK_SOCK_DIAG`` / ``unix_diag``, the interface ``ss -x`` and CRIU themselves use);
- an io_uring instance (fd or mapping);
- a SysV shared memory segment also used by processes outside the tree (creator, last
  attacher or attach count), or a SysV semaphore set the tree and an outsider both operate on;
- an open RDMA/InfiniBand device (``/dev/infiniband/*``);
- a file lock on a file outside the private TMPDIR and ``/dev/shm`` of the engine's mount
  namespace;
- a TCP socket listening on a non-loopback address (the HTTP port is bound only after restore).

What is allowed is recorded in the returned :class:`Inventory`: loopback listeners (they live in
the engine's own network namespace, re-created fresh at every restore; only for snapshots whose
engine shared the host's namespace does restore check their ports free with
:func:`vllm_snapshot.host.ports.listeners_taken`) and every regular file the tree has open or mapped
(restore refuses changed or vanished ones with :func:`check_files`). The established-TCP and
listener checks still hold inside the namespace: a connection whose peer is not in the tree
could only go to another process of that namespace, i.e. none.

Pipes (the supervisor's control/events/log channels) are not sockets and are always fine.

The engine has a network namespace of its own (:mod:`vllm_snapshot.engine.net`):
``net_problems`` says why a tree's namespace is not an isolated loopback-only one, and create
refuses such a tree. It shares the host's IPC namespace; when a tree does not, the socket and
SysV look-ups run in a helper thread that joins the tree's namespace (needs root).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psutil

from ..errors import EngineError, EnvironmentProblem, UnsnapshottableError
from ..engine import net
from ..engine.mounts import PRIVATE as PRIVATE_MOUNTS
from ..store.manifest import TreeFile
from ..host.ipc import read_sysv, sem_last_pids
from ..host.procs import command, run_in_namespace, socket_inodes, tree
from ..host.sockets import (TCP_CLOSE, TCP_LISTEN, TCP_STATES, TCP_TIME_WAIT, UNIX_TYPES, TcpEntry, UnixEntry,
                            fmt_addr, is_loopback, read_tcp_table, read_unix_table)
# the records of the files the tree holds, and restore's check of them, live in .treefiles
from .treefiles import HASH_LIMIT_BYTES, JIT_CACHES, check_files, file_record  # noqa: F401

#: Mount points private to the engine's namespace (see engine/mounts.py): the tmpfs on /dev/shm
#: and the engine's TMPDIR. Files there are dumped with the tree, not recorded as host files.
PRIVATE_PREFIXES: tuple[str, ...] = PRIVATE_MOUNTS
#: Pseudo file systems: never recorded as files.
PSEUDO_PREFIXES: tuple[str, ...] = ("/proc", "/sys", "/dev")
HINT_TCP = ("CRIU can only restore TCP connections whose both ends are in the tree; close "
            "connections to outside peers before the dump (or run that peer inside the engine)")
HINT_UNIX = ("CRIU cannot restore a unix socket connected to a process outside the tree; "
             "close it before the dump (e.g. logging to /dev/log or a D-Bus connection)")
HINT_URING = ("CRIU cannot dump io_uring: set UV_USE_IO_URING=0 for libuv users, or "
              "sysctl kernel.io_uring_disabled=2 on this host")
HINT_SYSV = ("SysV IPC shared with processes outside the tree cannot be restored consistently; "
             "stop sharing it (use POSIX shm under /dev/shm, which is private to the engine)")
HINT_RDMA = ("CRIU cannot checkpoint RDMA/InfiniBand verbs; run the engine without RDMA "
             "(e.g. NCCL_IB_DISABLE=1, UCX_NET_DEVICES without mlx devices)")
HINT_LOCK = ("a lock on a host file would be re-taken at restore and may conflict with other "
             "processes; release it before the dump or keep the file under $TMPDIR or /dev/shm")
HINT_LISTEN = ("the engine must not listen on a non-loopback address before the dump (the HTTP "
               "port is bound only after restore); bind 127.0.0.1, or for gloo set "
               "GLOO_SOCKET_IFNAME=lo")



# ----------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Inventory:
    """What :func:`inspect_tree` found in an acceptable tree.

    - ``root_pid``: the root's host PID; ``pids``: root first, then descendants (host PIDs);
      ``commands``: their command lines (same order, truncated to 200 chars).
    - ``listeners``: ``(address, port)`` of each TCP socket of the tree listening on a
      loopback address (``"127.0.0.1"``, ``"::1"``, ...), sorted, without duplicates.
    - ``files``: :class:`~vllm_snapshot.store.manifest.TreeFile` of every regular file open or
      mapped (host view), sorted by path; recorded in the manifest as they are.
    - ``deleted_files``: absolute paths of deleted-but-open files (CRIU link-remaps them into
      their directory at dump; :mod:`vllm_snapshot.checkpoint.remaps` keeps those).
    - ``nvidia_files``: ``/dev/nvidia*`` device files the tree has open or mapped;
      ``cuda_pids``: the processes holding any of them (CUDA users).
    - ``net_problems``: why the root's network namespace is not isolated and loopback-only
      (:func:`vllm_snapshot.engine.net.isolation_problems`; empty = it is).
    """

    root_pid: int
    pids: tuple[int, ...]
    commands: tuple[str, ...]
    listeners: tuple[tuple[str, int], ...]
    files: tuple[TreeFile, ...]
    deleted_files: tuple[str, ...] = ()
    nvidia_files: tuple[str, ...] = ()
    cuda_pids: tuple[int, ...] = ()
    net_problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    """One reason to refuse: ``pid``/``command`` of the holder, ``kind`` (``tcp``, ``unix``,
    ``io_uring``, ``sysv-shm``, ``sysv-sem``, ``rdma``, ``lock``, ``listen``, ``traced``,
    ``ghost``), ``obj`` the
    offending object in words, ``hint`` what to do."""

    pid: int
    command: str
    kind: str
    obj: str
    hint: str

    def __str__(self) -> str:
        return f"PID {self.pid} ({self.command}): {self.obj}"


# ----------------------------------------------------------------------------- /proc readers

@dataclass
class _Proc:
    pid: int
    command: str
    fds: list[tuple[int, str]] = field(default_factory=list)  # (fd, readlink target)
    maps: list[tuple[str, int, str]] = field(default_factory=list)  # (dev "maj:min", inode, path)

    def sockets(self) -> dict[int, int]:
        """socket inode -> fd."""
        out = {}
        for fd, t in self.fds:
            if t.startswith("socket:["):
                out[int(t[8:-1])] = fd
        return out


def _read_proc(p: psutil.Process) -> _Proc | None:
    """fds and file mappings of one process; None when it exited meanwhile. Raises
    EnvironmentProblem when /proc is not readable (not root)."""
    pid = p.pid
    out = _Proc(pid, command(p))
    try:
        names = os.listdir(f"/proc/{pid}/fd")
        for n in names:
            try:
                out.fds.append((int(n), os.readlink(f"/proc/{pid}/fd/{n}")))
            except FileNotFoundError:
                continue
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6:
                    out.maps.append((parts[3], int(parts[4]), parts[5]))
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError as e:
        raise EnvironmentProblem(f"cannot inspect PID {pid} ({out.command}): {e}",
                                 hint="run vllm-snapshot as root") from e
    return out


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


# ----------------------------------------------------------------------------- socket holders

def _socket_owners(inodes: set[int]) -> dict[int, tuple[int, str]]:
    """socket inode -> (pid, command) of some process holding it, over all of /proc."""
    found: dict[int, tuple[int, str]] = {}
    if not inodes:
        return found
    for p in psutil.process_iter():
        try:
            for ino in socket_inodes(p.pid) & inodes:
                found.setdefault(ino, (p.pid, command(p, 120)))
        except psutil.Error:
            continue
        if len(found) == len(inodes):
            break
    return found


def _owner_text(owner: tuple[int, str] | None) -> str:
    return f"held by PID {owner[0]} ({owner[1]})" if owner else "not held by any process we can see"


# ----------------------------------------------------------------------------- inspect

def inspect_tree(root_pid: int, private_prefixes: tuple[str, ...] = PRIVATE_PREFIXES) -> Inventory:
    """Inspect the process tree rooted at host PID ``root_pid`` (root + all descendants).

    ``private_prefixes`` are mount points private to the tree's mount namespace (default
    :data:`PRIVATE_PREFIXES`): files under them are not recorded and locks on them are
    allowed. Returns a frozen :class:`Inventory` (loopback listeners, regular files with
    size/mtime/BLAKE3). Raises :class:`UnsnapshottableError` listing every offending object
    (``details``: list of ``{"pid", "command", "kind", "object"}``), EngineError when the root
    does not exist, EnvironmentProblem when ``/proc`` or sock_diag cannot be read (not root,
    no ``unix_diag``). Takes well under a second for an engine tree (files > 1 MiB are only
    stat()-ed).
    """
    procs = [x for x in (_read_proc(p) for p in tree(root_pid)) if x is not None]
    if not procs:
        raise EngineError(f"process {root_pid} does not exist (the engine exited?)")
    findings: list[Finding] = []
    tree_pids = {p.pid for p in procs}
    tree_socks: dict[int, _Proc] = {}
    for p in procs:
        for ino in p.sockets():
            tree_socks.setdefault(ino, p)

    listeners = _check_sockets(procs, tree_socks, findings)
    _check_uring_rdma(procs, findings)
    _check_sysv(procs, tree_pids, findings)
    _check_locks(procs, tree_pids, private_prefixes, findings)
    _check_traced(procs, tree_pids, findings)
    _check_ghosts(procs, findings)
    files = _collect_files(procs, private_prefixes)
    deleted = sorted({t[: -len(" (deleted)")] for p in procs for _fd, t in p.fds
                      if t.startswith("/") and t.endswith(" (deleted)")})
    nvidia = {p.pid: {t for _fd, t in p.fds if t.startswith("/dev/nvidia")}
              | {path for _d, _i, path in p.maps if path.startswith("/dev/nvidia")} for p in procs}

    if findings:
        hints = list(dict.fromkeys(f.hint for f in findings))
        raise UnsnapshottableError(
            "the engine tree holds what CRIU cannot checkpoint and restore safely:\n  "
            + "\n  ".join(map(str, findings)),
            hint=" | ".join(hints),
            details=[{"pid": f.pid, "command": f.command, "kind": f.kind, "object": f.obj} for f in findings])
    return Inventory(root_pid=procs[0].pid, pids=tuple(p.pid for p in procs),
                     commands=tuple(p.command for p in procs), listeners=tuple(sorted(listeners)),
                     files=files, deleted_files=tuple(deleted),
                     nvidia_files=tuple(sorted(set().union(*nvidia.values()))),
                     cuda_pids=tuple(pid for pid, fs in nvidia.items() if fs),
                     net_problems=tuple(_net_problems(procs[0].pid)))


def _net_problems(pid: int) -> list[str]:
    try:
        return net.isolation_problems(pid)
    except OSError as e:
        return [f"its network namespace cannot be read: {e}"]


#: CRIU's ``--ghost-limit`` default: deleted-but-open files (no name left to link back to) are
#: copied into the images only up to this size on disk (bytes). CRIU 4.2.1
#: ``criu/include/cr_options.h`` DEFAULT_GHOST_LIMIT, enforced in ``files-reg.c``
#: dump_ghost_remap ("Can't dump ghost file ... increase limit"). Kept, not raised: such a file
#: is usually a temp file the engine forgot, and copying it would put unknown data into every
#: snapshot; refusing before CRIU names it instead of failing inside the dump.
GHOST_LIMIT = 1 << 20


def _check_traced(procs: list[_Proc], tree_pids: set[int], findings: list[Finding]) -> None:
    """A thread traced by a process outside the tree (strace, gdb, py-spy): CRIU cannot seize it
    (ptrace allows one tracer), and the tracer would lose it at the dump."""
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                    tracer = next((int(line.split()[1]) for line in f if line.startswith("TracerPid:")), 0)
            except (OSError, ValueError, IndexError):
                continue
            if tracer and tracer not in tree_pids:
                try:
                    who = command(psutil.Process(tracer))
                except psutil.Error:
                    who = "?"
                findings.append(Finding(p.pid, p.command, "traced", f"thread {tid} is traced by PID {tracer} ({who})",
                                        "detach the tracer (strace, gdb, py-spy ...) and create again"))
                break


def _check_ghosts(procs: list[_Proc], findings: list[Finding]) -> None:
    """Deleted-but-open regular files whose last name is gone (``st_nlink`` 0) and that are
    larger on disk than :data:`GHOST_LIMIT`: CRIU's dump would fail on them."""
    for p in procs:
        for fd, t in p.fds:
            if not (t.startswith("/") and t.endswith(" (deleted)")):
                continue
            try:
                st = os.stat(f"/proc/{p.pid}/fd/{fd}")
            except OSError:
                continue
            size = st.st_blocks * 512
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and size > GHOST_LIMIT:
                findings.append(Finding(
                    p.pid, p.command, "ghost",
                    f"fd {fd}: deleted file {t[:-len(' (deleted)')]} still open, {size} bytes on disk "
                    f"(CRIU copies such files only up to {GHOST_LIMIT} bytes)",
                    "close the deleted file in the engine (or keep it linked) before create; "
                    "a model's custom code holding a deleted temp file is the usual cause"))


def _check_sockets(procs: list[_Proc], tree_socks: dict[int, _Proc], findings: list[Finding]) -> set[tuple[str, int]]:
    listeners: set[tuple[str, int]] = set()
    if not tree_socks:
        return listeners
    # one TCP table and one unix table per network namespace of the tree, and ours (a socket
    # can be passed into a tree living in another namespace)
    by_ns: dict[str, int | str] = {os.readlink("/proc/thread-self/ns/net"): "self"}
    for p in procs:
        try:
            by_ns.setdefault(os.readlink(f"/proc/{p.pid}/ns/net"), p.pid)
        except OSError:
            continue
    tcp: list[tuple[str, TcpEntry]] = []  # (net namespace, entry)
    unix: dict[int, UnixEntry] = {}
    for ns, ns_pid in by_ns.items():
        tcp += [(ns, e) for e in read_tcp_table(ns_pid)]
        unix.update(read_unix_table() if ns_pid == "self" else run_in_namespace(ns_pid, "net", read_unix_table))
    by_pair: dict[tuple[str, tuple[str, int], tuple[str, int]], list[int]] = {}
    for ns, e in tcp:
        by_pair.setdefault((ns, e.local, e.remote), []).append(e.inode)

    pending: list[tuple[_Proc, str, str, int]] = []  # (holder, kind, text, peer inode) for owner lookup
    for ns, e in tcp:
        holder = tree_socks.get(e.inode)
        if holder is None or e.inode == 0:
            continue
        proto = "TCP6" if e.v6 else "TCP"
        if e.state == TCP_LISTEN:
            if is_loopback(e.local[0]):
                listeners.add(e.local)
            else:
                findings.append(Finding(holder.pid, holder.command, "listen",
                                        f"{proto} socket listening on non-loopback address {fmt_addr(e.local)} "
                                        f"(socket:[{e.inode}])", HINT_LISTEN))
            continue
        if e.state in (TCP_CLOSE, TCP_TIME_WAIT):
            continue
        peers = by_pair.get((ns, e.remote, e.local), [])
        if any(i in tree_socks for i in peers):
            continue
        text = (f"{TCP_STATES.get(e.state, e.state)} {proto} connection {fmt_addr(e.local)} -> "
                f"{fmt_addr(e.remote)} (socket:[{e.inode}]) to a peer outside the tree")
        peer_ino = next((i for i in peers if i), 0)
        pending.append((holder, "tcp", text, peer_ino))

    for ino, holder in tree_socks.items():
        u = unix.get(ino)
        if u is None or u.peer == 0 or u.peer in tree_socks:
            continue
        pu = unix.get(u.peer)
        kind = UNIX_TYPES.get(u.type, str(u.type))
        name = f" bound to {pu.name!r}" if pu and pu.name else ""
        text = (f"unix {kind} socket:[{ino}] (fd {holder.sockets()[ino]}) connected to peer socket:[{u.peer}]"
                f"{name} outside the tree")
        pending.append((holder, "unix", text, u.peer))

    owners = _socket_owners({i for *_, i in pending if i})
    for holder, kind, text, peer_ino in pending:
        if kind == "tcp" and not peer_ino:
            text += " (remote host)"
        else:
            text += f" ({_owner_text(owners.get(peer_ino))})"
        findings.append(Finding(holder.pid, holder.command, kind, text, HINT_TCP if kind == "tcp" else HINT_UNIX))
    return listeners


def _check_uring_rdma(procs: list[_Proc], findings: list[Finding]) -> None:
    for p in procs:
        uring = [f"io_uring instance (fd {fd}: {t})" for fd, t in p.fds if "io_uring" in t]
        if not uring and any("io_uring" in path for _d, _i, path in p.maps):
            uring = ["io_uring instance (mapping anon_inode:[io_uring])"]
        for u in uring:
            findings.append(Finding(p.pid, p.command, "io_uring", u, HINT_URING))
        rdma = {t for _fd, t in p.fds if t.startswith("/dev/infiniband/")}
        rdma |= {path.split(" ")[0] for _d, _i, path in p.maps if path.startswith("/dev/infiniband/")}
        for dev in sorted(rdma):
            findings.append(Finding(p.pid, p.command, "rdma", f"RDMA/InfiniBand device {dev} open", HINT_RDMA))


def _check_sysv(procs: list[_Proc], tree_pids: set[int], findings: list[Finding]) -> None:
    attached: dict[int, list[_Proc]] = {}  # shmid -> one entry per mapping in the tree
    for p in procs:
        for _dev, ino, path in p.maps:
            if path.startswith("/SYSV"):
                attached.setdefault(ino, []).append(p)

    def outside(pid: int) -> bool:
        return pid > 0 and pid not in tree_pids

    def probe() -> tuple[list[dict[str, int]], dict[int, list[int]]]:
        return read_sysv("/proc/sysvipc/shm"), sem_last_pids()

    shm_rows, sems = run_in_namespace(procs[0].pid, "ipc", probe)
    for row in shm_rows:
        shmid = row.get("shmid")
        users = attached.get(shmid) if shmid is not None else None
        if not users:
            continue
        why = []
        if outside(row.get("cpid", 0)):
            why.append(f"created by PID {row['cpid']}")
        if outside(row.get("lpid", 0)):
            why.append(f"last attached/detached by PID {row['lpid']}")
        if row.get("nattch", 0) > len(users):
            why.append(f"{row['nattch']} attachments, {len(users)} of them in the tree")
        if why:
            p = users[0]
            findings.append(Finding(p.pid, p.command, "sysv-shm",
                                    f"SysV shared memory segment shmid {shmid} (key {row.get('key', 0):#x}) "
                                    f"shared with processes outside the tree: {', '.join(why)}", HINT_SYSV))
    for semid, pids in sems.items():
        inside = sorted({x for x in pids if x in tree_pids})
        out = sorted({x for x in pids if outside(x)})
        if inside and out:
            p = next(q for q in procs if q.pid == inside[0])
            findings.append(Finding(p.pid, p.command, "sysv-sem",
                                    f"SysV semaphore set semid {semid} also operated on by PID(s) "
                                    f"{', '.join(map(str, out))} outside the tree", HINT_SYSV))


def _check_locks(procs: list[_Proc], tree_pids: set[int], private_prefixes: tuple[str, ...],
                 findings: list[Finding]) -> None:
    seen: set[tuple[int, int]] = set()  # (st_dev, st_ino) of files whose locks we attributed
    private_devs: set[int] = set()
    for p in procs:
        for pre in private_prefixes:
            try:
                private_devs.add(os.stat(f"/proc/{p.pid}/root{pre}").st_dev)
            except OSError:
                pass
        for fd, target in p.fds:
            try:
                with open(f"/proc/{p.pid}/fdinfo/{fd}") as f:
                    locks = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("lock:")]
            except OSError:
                continue
            if not locks:
                continue
            try:
                st = os.stat(f"/proc/{p.pid}/fd/{fd}")
                seen.add((st.st_dev, st.st_ino))
            except OSError:
                pass
            if _under(target, private_prefixes):
                continue
            for lk in locks:  # "1: FLOCK  ADVISORY  WRITE 123 fe:00:456 0 EOF"
                c = lk.split()
                desc = " ".join(c[1:4]) if len(c) >= 4 else lk
                findings.append(Finding(p.pid, p.command, "lock", f"{desc} lock on {target} (fd {fd})", HINT_LOCK))
    # POSIX/flock locks /proc/locks attributes to the tree that no open fd showed (e.g. a
    # flock kept alive only by a mapping)
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return
    for ln in lines:
        c = ln.split()
        if len(c) < 6 or "->" in c:
            continue
        try:
            pid = int(c[4])
            maj, mnr, ino = c[5].split(":")
            key = (os.makedev(int(maj, 16), int(mnr, 16)), int(ino))
        except ValueError:
            continue
        if pid not in tree_pids or key in seen or key[0] in private_devs:
            continue
        seen.add(key)
        p = next(q for q in procs if q.pid == pid)
        findings.append(Finding(p.pid, p.command, "lock",
                                f"{c[1]} {c[3]} lock on inode {c[5]} (no open fd of the tree shows it)", HINT_LOCK))


def _collect_files(procs: list[_Proc], private_prefixes: tuple[str, ...]) -> tuple[TreeFile, ...]:
    records: dict[str, TreeFile] = {}
    done: set[tuple[str, str]] = set()  # (mount ns, path)
    for p in procs:
        try:
            mnt = os.readlink(f"/proc/{p.pid}/ns/mnt")
        except OSError:
            continue
        paths = [t for _fd, t in p.fds] + [path for _d, _i, path in p.maps]
        for path in paths:
            if not path.startswith("/") or path.endswith(" (deleted)"):
                continue
            if _under(path, PSEUDO_PREFIXES) or _under(path, private_prefixes) or (mnt, path) in done:
                continue
            done.add((mnt, path))
            try:
                view = os.stat(f"/proc/{p.pid}/root{path}")
            except OSError:
                continue  # gone meanwhile
            if not stat.S_ISREG(view.st_mode):
                continue
            try:
                host = os.stat(path)
            except FileNotFoundError:
                continue  # private to the tree's mount namespace
            if (host.st_dev, host.st_ino) != (view.st_dev, view.st_ino):
                continue  # the tree sees another file there (its own mount)
            if path in records:
                continue
            try:
                records[path] = file_record(path)
            except (OSError, ValueError):
                continue
    return tuple(records[k] for k in sorted(records))


__all__ = ["Inventory", "Finding", "inspect_tree", "check_files", "file_record", "read_tcp_table",
           "read_unix_table", "HASH_LIMIT_BYTES", "PRIVATE_PREFIXES", "JIT_CACHES"]
