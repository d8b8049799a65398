"""What the benchmarks (scripts/bench*.py) and ``vllm-snapshot demo`` share: a cold start of
``vllm serve`` to its first completion, the memory of a process tree, the CLI run for its
``--json`` answer, a client that polls a port through a ``switch``, and the JSON a run prints.

It drives the product from above the seam, as the command line does (tests/test_layering.py
places it just below ``cli``); nothing in the product imports it but ``cli/demo.py``."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

from . import free_port
from ..effects.http import http_json
from ..errors import EngineError
from ..host.envpolicy import scrubbed_env
from .tiny_model import ENGINE_ARGS

__all__ = ["COLD_TIMEOUT_S", "ENGINE_ARGS", "Poller", "cli", "cold_start", "emit", "free_port", "poll_once",
           "private", "summarize", "tree_memory"]

COLD_TIMEOUT_S = 600.0
#: ``vllm-snapshot`` as a child process on this interpreter (and so on this checkout's code)
VS = [sys.executable, "-m", "vllm_snapshot"]

def tree_memory(pid: int) -> dict:
    """``{"rss", "pss", "processes"}`` (bytes) of process ``pid`` and its descendants
    (psutil; PSS divides shared pages among their sharers)."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    rss = pss = 0
    for p in procs:
        try:
            mi = p.memory_full_info()
        except psutil.Error:
            continue
        rss += mi.rss
        pss += getattr(mi, "pss", mi.rss)
    return {"rss": rss, "pss": pss, "processes": len(procs)}


#: The benchmarks' "first completion": a cold start's timing ends at the first one that
#: succeeds, a restore's at one right after the restore returned, so both sides do the same work.
FIRST_COMPLETION = {"prompt": "Hello", "max_tokens": 1}


def first_completion(port: int, served: str, timeout: float = 5) -> tuple[int, dict | str]:
    """POST :data:`FIRST_COMPLETION` (one token of "Hello") for the model served as ``served``
    to ``http://127.0.0.1:port``; (HTTP status, parsed body). Raises URLError/OSError."""
    return http_json(f"http://127.0.0.1:{port}/v1/completions", {"model": served, **FIRST_COMPLETION}, timeout=timeout)


def cold_start(model: Path, port: int, engine_args: list[str] | None = None, memory: dict | None = None) -> float:
    """Seconds from launching ``vllm.entrypoints.openai.api_server`` (``engine_args``, default
    the demo's) to its first successful completion (:func:`first_completion`); the server is stopped afterwards. With
    ``memory`` (a dict), :func:`tree_memory` of the server's tree after that completion is put
    into it. Raises EngineError."""
    import getpass
    import shutil
    import tempfile

    env = scrubbed_env(dict(os.environ))
    # its own temp dir (ZMQ sockets, vllm_dist_* files), removed afterwards: the engine TMPDIR
    # of scrubbed_env is a mount point for engines' private tmpfs, not a place on the host
    tmp = tempfile.mkdtemp(prefix="vllm-snapshot-cold-", dir="/var/tmp")
    env["TMPDIR"] = tmp
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:  # keep torch inductor's precompiled header cached, as for engines (engine/mounts.py)
        os.makedirs(inductor, mode=0o700, exist_ok=True)
        os.symlink(inductor, os.path.join(tmp, f"torchinductor_{getpass.getuser()}"))
    args = list(engine_args or ENGINE_ARGS)
    # the served model name is the value of their --served-model-name, else the model path
    served = args[args.index("--served-model-name") + 1] if "--served-model-name" in args[:-1] else str(model)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *args]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if p.poll() is not None:
                raise EngineError(f"cold-start server exited with {p.returncode}")
            if time.monotonic() - t0 > COLD_TIMEOUT_S:
                raise EngineError("cold-start server did not answer in time")
            try:
                status, _ = first_completion(port, served)
                if status == 200:
                    took = time.monotonic() - t0
                    if memory is not None:
                        memory.update(tree_memory(p.pid))
                    return took
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
    finally:
        try:
            os.killpg(p.pid, 15)
            p.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)



def cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> dict:
    """``vllm-snapshot ARGS --json`` as a child process (from ``cwd``: another checkout's code);
    its JSON answer. Raises SystemExit naming the command and the end of its output when it fails."""
    p = subprocess.run([*VS, *args, "--json"], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"vllm-snapshot {' '.join(args)} failed ({p.returncode}): {p.stdout[-1500:]} {p.stderr[-1500:]}")
    return json.loads(p.stdout)


def private(d: Path) -> Path:
    """``d`` made (it must not exist) with mode 0700, as the store and its parents must be."""
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    return d


def emit(res: dict, json_out: Path | None) -> None:
    """A run's results: printed as JSON, and written to ``json_out`` when given."""
    out = json.dumps(res, indent=2)
    print(out)
    if json_out:
        json_out.write_text(out + "\n")


def poll_once(port: int, model: str) -> str:
    """One poll of 127.0.0.1:``port`` with a one-token completion of ``model``: ``ok``,
    ``refused`` or ``failed: WHY``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1})
    try:
        try:
            conn.connect()
        except ConnectionRefusedError:
            return "refused"
        except OSError as e:
            return f"failed: connect {type(e).__name__}: {e}"
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            return "ok" if r.status == 200 else f"failed: HTTP {r.status}"
        except (OSError, http.client.HTTPException) as e:
            return f"failed: {type(e).__name__}: {e}"
    finally:
        conn.close()


class Poller:
    """Polls ``port`` every ``every_s`` seconds in a thread; ``rows``: (start, end, outcome)."""

    def __init__(self, port: int, every_s: float, model: str) -> None:
        self.rows: list[tuple[float, float, str]] = []
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                out = poll_once(port, model)
                self.rows.append((t0, time.monotonic(), out))
                self._stop.wait(max(0.0, every_s - (time.monotonic() - t0)))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """Stops polling; :func:`summarize` of the polls."""
        self._stop.set()
        self._thread.join(30)
        return summarize(self.rows)


def summarize(rows: list[tuple[float, float, str]]) -> dict:
    """``dark`` (s), ``refused``, ``failed`` (counts, with the first failure), ``wait`` (s),
    ``polls`` of a poll log. Pure."""
    dark, since = 0.0, None
    for t0, t1, out in rows:
        if out == "ok":
            if since is not None:
                dark = max(dark, t1 - since)
                since = None
        elif since is None:
            since = t0
    if since is not None:
        dark = max(dark, rows[-1][1] - since)
    failed = [o for _, _, o in rows if o.startswith("failed")]
    return {"dark": dark, "refused": sum(o == "refused" for _, _, o in rows), "failed": len(failed),
            "first_failure": failed[0] if failed else "", "polls": len(rows),
            "wait": max((t1 - t0 for t0, t1, o in rows if o == "ok"), default=0.0)}
