"""SysV IPC of the calling thread's IPC namespace: the ``/proc/sysvipc`` tables
(:func:`read_sysv`) and the PID of the last ``semop`` on each semaphore (:func:`sem_last_pids`)."""

from __future__ import annotations

import ctypes

#: semctl command: PID of the last semop on one semaphore
_GETPID = 11
_libc = ctypes.CDLL(None, use_errno=True)


def read_sysv(path: str) -> list[dict[str, int]]:
    """The rows of one ``/proc/sysvipc/*`` table as {column: int}; [] when it does not exist."""
    try:
        with open(path) as f:
            head = f.readline().split()
            rows = []
            for line in f:
                try:
                    rows.append({k: int(v) for k, v in zip(head, line.split())})
                except ValueError:
                    continue
            return rows
    except FileNotFoundError:
        return []


def sem_last_pids() -> dict[int, list[int]]:
    """semid -> PID of the last semop on each of its semaphores (0 = none) in the calling
    thread's IPC namespace."""
    out = {}
    _libc.semctl.restype = ctypes.c_int
    for row in read_sysv("/proc/sysvipc/sem"):
        semid, nsems = row.get("semid"), row.get("nsems", 0)
        if semid is None:
            continue
        pids = []
        for i in range(nsems):
            r = _libc.semctl(ctypes.c_int(semid), ctypes.c_int(i), ctypes.c_int(_GETPID))
            pids.append(r if r > 0 else 0)
        out[semid] = pids
    return out
