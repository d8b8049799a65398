"""Pre-dump preparation of the engine's children (vllm_snapshot.engine.prep): zero pages of a
private anonymous mapping are given back without changing what the process reads, and the
root reaches its children's hooks."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_snapshot.engine import prep

ROOT = Path(__file__).resolve().parent.parent


def _present_pages(addr: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (length // prep.PAGE))()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec)


def test_drop_zero_pages_keeps_contents_and_frees_only_zero_pages():
    n = 16
    m = mmap.mmap(-1, n * prep.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    addr = ctypes.addressof(buf)
    m[:] = b"\0" * len(m)  # touch every page
    m[3 * prep.PAGE + 17] = 7
    m[10 * prep.PAGE + prep.PAGE - 1] = 9
    before = bytes(m)
    assert _present_pages(addr, len(m)) == n
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # an unaligned range: only whole pages inside it are considered
    dropped = prep.drop_zero_pages(addr + 5, len(m) - 5, prep._anon_private_ranges(), libc)
    assert dropped == (n - 2 - 1) * prep.PAGE  # two data pages kept; the partial first page too
    assert _present_pages(addr, len(m)) == 3
    assert bytes(m) == before
    del buf
    m.close()


def test_drop_zero_pages_ignores_memory_outside_anonymous_mappings():
    m = mmap.mmap(-1, 4 * prep.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    addr = ctypes.addressof(buf)
    m[:] = b"\0" * len(m)
    libc = ctypes.CDLL(None, use_errno=True)
    assert prep.drop_zero_pages(addr, len(m), [], libc) == 0
    assert _present_pages(addr, len(m)) == 4
    del buf
    m.close()


def test_root_reaches_a_child_hook_and_the_hook_closes_after_one_request():
    code = ("import time; from vllm_snapshot.engine.prep import install_child_hook; install_child_hook(); "
            "print('ready', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
        (got,) = prep.prepare_children(timeout_s=30)
        assert got["pid"] == p.pid and got["kv_zero_bytes"] == 0 and got["anon_before"] > 0
        for _ in range(50):  # the listener is gone once it answered
            if not prep.prepare_children(timeout_s=5):
                break
            time.sleep(0.05)
        assert prep.prepare_children(timeout_s=5) == []
    finally:
        p.kill()
        p.wait()


def test_kv_cache_of_a_frozen_model_runner_is_found_and_its_zero_pages_given_back():
    # vLLM's EngineCore gc.freeze()s its start-up heap; with the worker in that process (CPU,
    # UniProcExecutor) the model runner is in the permanent generation, which gc.get_objects()
    # does not list. Run in a child: the test freezes the GC.
    code = """
import gc, json, torch
from vllm_snapshot.engine import prep
class CPUModelRunner:
    pass
r = CPUModelRunner()
r.kv_caches = [torch.zeros(16 << 20 >> 2, dtype=torch.float32)]  # 16 MiB: its own mmap
r.kv_caches[0][5] = 1.0
gc.collect(); gc.freeze()
assert r not in gc.get_objects()
out = prep.prepare_self()
print(json.dumps({**out, "frozen": gc.get_freeze_count(), "sum": float(r.kv_caches[0].sum())}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = __import__("json").loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                                  capture_output=True, text=True, timeout=120).stdout)
    assert got["kv_zero_bytes"] >= (16 << 20) - 3 * prep.PAGE  # all but the page holding the 1.0 (and edges)
    assert got["sum"] == 1.0 and got["frozen"] > 0


def test_trim_root_gives_back_the_freed_heap_a_live_block_pins():
    """The root's share of prepare-dump: glibc's malloc_trim(0) returns the free pages inside
    the heap (below a block still in use, which a plain free() never gives back), so CRIU does
    not dump them; what is still in use keeps its bytes."""
    code = (
        "import ctypes, json, sys; sys.path.insert(0, sys.argv[1]); from vllm_snapshot.engine import prep\n"
        "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]; libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() keeps it\n"
        "blocks = [libc.malloc(4000) for _ in range(20000)]  # ~80 MB of small blocks in the main heap\n"
        "for b in blocks: ctypes.memset(b, 7, 4000)\n"
        "keep = libc.malloc(4000); ctypes.memset(keep, 9, 4000)  # above them: the heap's top stays\n"
        "for b in blocks: libc.free(b)\n"
        "r = prep.trim_root(); r['kept'] = ctypes.string_at(keep, 4000) == b'\\x09' * 4000\n"
        "print(json.dumps(r))\n")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = __import__("json").loads(out.stdout)
    assert r["pid"] > 0 and r["role"] == "root" and r["kept"]
    assert r["anon_before"] - r["anon_after"] > 60 << 20, r  # most of the ~80 MB freed came back
