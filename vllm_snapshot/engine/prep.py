"""Pre-dump preparation of the engine's child processes (EngineCore, workers): fewer bytes in
the images, same memory contents.

The engine root cannot run code in vLLM's children through vLLM (0.32's ``collective_rpc``
takes a method *name* unless ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is set, which we do not
set), but vLLM starts them with multiprocessing's ``spawn``, which re-imports the root's main
module (:mod:`vllm_snapshot.entrypoints.engine_root`) in each child as ``__mp_main__``. There,
:func:`install_child_hook` starts one daemon thread listening on an abstract unix socket named
after the child's PID. Abstract names belong to a network namespace, and every engine tree has
its own (:mod:`.net`): only processes of this tree can connect. At ``prepare-dump`` the root
(:func:`prepare_children`) connects to each child that has the hook, the child runs
:func:`prepare_self` and answers with its numbers, then closes the socket and ends the thread,
so neither is in the images.

What :func:`prepare_self` does (measured on the tiny demo engine, docs/history.md):

- ``gc.collect()`` and glibc's ``malloc_trim(0)`` (returns freed heap to the kernel; the root
  does the same for itself, :func:`trim_root`);
- the pages of the CPU KV cache that are entirely zero (every block no request has used yet)
  are given back with ``madvise(MADV_DONTNEED)``: in a private anonymous mapping the kernel
  maps a fresh zero page on the next access, so the contents are the same, but CRIU dumps
  only present pages (kernel zero pages excepted), so they leave the images. vLLM allocates
  the CPU KV cache with ``torch.zeros`` (every page touched): without this, a cache of N GiB
  adds N GiB of zeros to the images. The engine is idle at ``prepare-dump`` (no request in
  flight: nothing writes the KV cache), and only ranges inside private anonymous mappings
  (``/proc/self/maps``: no path) are touched.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import threading

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4  # <sys/mman.h>
#: Seconds the root waits for one child's answer (a GiB-sized KV cache scans in ~1 s).
CHILD_TIMEOUT_S = 120.0


def socket_name(pid: int) -> str:
    """The abstract socket name (without the leading NUL) of the hook of process ``pid`` (a PID
    of the engine's own PID namespace). Pure."""
    return f"vllm-snapshot-prep-{pid}"


def install_child_hook() -> None:
    """Listen for the root's ``prepare-dump`` in a daemon thread (called at import in
    vLLM's spawned children). Never raises: a child without the hook is simply not prepared."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.bind("\0" + socket_name(os.getpid()))
        s.listen(1)
    except OSError:
        return

    def serve() -> None:
        try:
            conn, _ = s.accept()
            with conn:
                conn.settimeout(CHILD_TIMEOUT_S)
                if conn.recv(16).strip() != b"prep":
                    return
                try:
                    out = prepare_self()
                except Exception as e:  # noqa: BLE001 - reported to the root, which logs it
                    out = {"error": f"{type(e).__name__}: {e}"}
                conn.sendall(json.dumps(out).encode() + b"\n")
        except OSError:
            pass
        finally:
            s.close()

    threading.Thread(target=serve, daemon=True, name="vllm-snapshot-prep").start()


def _anon_private_ranges() -> list[tuple[int, int]]:
    """(start, end) of this process's private anonymous mappings (no path: not the heap's
    ``[heap]``/``[stack]`` either), from ``/proc/self/maps``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5 and parts[1][3] == "p" and parts[1][1] == "w":
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def _tracked_objects() -> list:
    """Every object the garbage collector tracks, the frozen ones included: vLLM's EngineCore
    ``gc.freeze()``s its start-up heap (the model runner with it, when the worker runs in the
    EngineCore process), and ``gc.get_objects()`` does not list the permanent generation. The
    frozen set is unfrozen for the walk and frozen again (with whatever else is tracked now)."""
    if not gc.get_freeze_count():
        return gc.get_objects()
    gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        gc.freeze()


def _kv_cache_tensors() -> list:
    """The CPU KV cache tensors of this process's vLLM model runner(s): the tensors in a
    ``kv_caches`` list attribute of an object whose class name ends in ``ModelRunner``."""
    import torch

    seen, out = set(), []
    for o in _tracked_objects():
        if not type(o).__name__.endswith("ModelRunner"):
            continue
        kvs = getattr(o, "kv_caches", None)
        for t in kvs if isinstance(kvs, (list, tuple)) else ():
            for x in t if isinstance(t, (list, tuple)) else (t,):
                if isinstance(x, torch.Tensor) and x.device.type == "cpu" and id(x) not in seen:
                    seen.add(id(x))
                    out.append(x)
    return out


def drop_zero_pages(addr: int, nbytes: int, anon: list[tuple[int, int]], libc) -> int:
    """``madvise(MADV_DONTNEED)`` every run of whole pages in ``[addr, addr+nbytes)`` that lies
    inside one of the ``anon`` ranges and reads all zero. Returns the bytes given back.
    Raises OSError when madvise fails."""
    import numpy as np

    lo = -(-addr // PAGE) * PAGE
    hi = (addr + nbytes) // PAGE * PAGE
    dropped = 0
    for a, b in anon:
        s, e = max(lo, a), min(hi, b)
        if e <= s:
            continue
        buf = (ctypes.c_uint8 * (e - s)).from_address(s)
        pages = np.frombuffer(buf, dtype=np.uint64).reshape(-1, PAGE // 8)
        zero = ~pages.any(axis=1)
        # runs of consecutive zero pages
        edges = np.flatnonzero(np.diff(np.concatenate(([0], zero.astype(np.int8), [0]))))
        for start, stop in zip(edges[::2], edges[1::2]):
            ln = int(stop - start) * PAGE
            if libc.madvise(ctypes.c_void_p(s + int(start) * PAGE), ctypes.c_size_t(ln), MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
            dropped += ln
    return dropped


def _anon_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith("Anonymous:")), 0)


def prepare_self() -> dict:
    """gc, zero KV-cache pages given back, ``malloc_trim(0)``; returns ``{"pid",
    "anon_before", "anon_after", "kv_zero_bytes"}`` (bytes)."""
    before = _anon_kib() << 10
    gc.collect()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    kv = 0
    if "torch" in __import__("sys").modules:
        anon = _anon_private_ranges()
        storages = {}  # K and V (and layers sharing a cache) are views of one storage
        for t in _kv_cache_tensors():
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        for ptr, nbytes in storages.items():
            kv += drop_zero_pages(ptr, nbytes, anon, libc)
    libc.malloc_trim(0)
    return {"pid": os.getpid(), "anon_before": before, "anon_after": _anon_kib() << 10, "kv_zero_bytes": kv}


def trim_root() -> dict:
    """The engine root's own share of ``prepare-dump``, after its ``gc.collect()`` +
    ``gc.freeze()``: glibc's ``malloc_trim(0)`` (the freed heap given back to the kernel, so
    CRIU does not dump it; measured on the demo model's API server: 27 MiB of 540). Returns
    ``{"pid", "anon_before", "anon_after"}`` (bytes). Never raises for a libc without
    ``malloc_trim`` (musl): nothing is trimmed then."""
    before = _anon_kib() << 10
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    return {"pid": os.getpid(), "role": "root", "anon_before": before, "anon_after": _anon_kib() << 10}


def prepare_children(timeout_s: float = CHILD_TIMEOUT_S) -> list[dict]:
    """Ask every descendant of this process that has the hook to :func:`prepare_self`; returns
    their answers (a child without the hook is skipped; a failing one answers ``{"error"}``)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            c.settimeout(timeout_s)
            try:
                c.connect("\0" + socket_name(child.pid))
            except OSError:
                continue  # no hook (the resource tracker, a non-Python helper)
            c.sendall(b"prep\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            try:
                out.append(json.loads(data or b"{}"))
            except ValueError:
                out.append({"pid": child.pid, "error": f"unreadable answer {data[:80]!r}"})
        except OSError as e:
            out.append({"pid": child.pid, "error": str(e)})
        finally:
            c.close()
    return out
