"""Supervisor side of an engine tree: pipes, launch into a PID + mount namespace, events, logs.

The engine root is started as ``unshare --pid --fork --mount-proc -- python -m
vllm_snapshot.engine.main SPEC``: it becomes PID 1 of a new PID namespace with its own /proc,
calls ``setsid()`` itself (CRIU refuses a tree whose session leader is outside its PID
namespace), and owns only fds opened inside the namespace plus three pipes from us (pipes have
no mount, so CRIU can dump them; design notes: an inherited /dev/null cannot be dumped).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

import psutil

from .engine.protocol import EVENTS_FD
from .errors import EngineError

#: Environment variables passed to the engine (everything else is dropped: tokens, keys,
#: cloud credentials never enter the engine's memory, hence never the snapshot).
ENV_ALLOW_EXACT = frozenset({"PATH", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR", "USER", "LOGNAME",
                             "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES",
                             "VLLM_SNAPSHOT_CACHE"})
ENV_ALLOW_PREFIX = ("VLLM_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "NCCL_", "CUDA_", "LC_")
SECRET_MARKERS = ("SECRET", "PASSWORD", "API_KEY", "APIKEY", "CREDENTIAL", "PRIVATE")


def is_secret_name(name: str) -> bool:
    """True for variable/flag names that look like they hold a secret.

    ``TOKEN`` counts only in the last word (``HF_TOKEN``, ``--hf-token``, ``GITHUB_TOKEN``): token
    counts and tokenizer settings (``VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE``,
    ``VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD``, ``--tokenizer``, ``--max-num-batched-tokens``) are
    not secrets and must reach the engine / the manifest unchanged."""
    up = name.upper().replace("-", "_")
    if any(m in up for m in SECRET_MARKERS):
        return True
    return up.rstrip("_").rsplit("_", 1)[-1].endswith("TOKEN")


def scrubbed_env(base: dict[str, str], keep: tuple[str, ...] = ()) -> dict[str, str]:
    """The engine's environment: allow-listed names from ``base``, secrets dropped unless named
    in ``keep``, plus ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` (never download)."""
    env = {}
    for k, v in base.items():
        allowed = k in ENV_ALLOW_EXACT or k.startswith(ENV_ALLOW_PREFIX)
        if (allowed and not is_secret_name(k)) or k in keep:
            env[k] = v
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    from .engine.mounts import ENGINE_TMPDIR

    env["TMPDIR"] = ENGINE_TMPDIR  # a private tmpfs inside the engine's namespace
    env["UV_USE_IO_URING"] = "0"  # libuv (uvloop/uvicorn): no io_uring, CRIU cannot dump it
    # torch.distributed (gloo, world size 1) listens on the hostname's address; keep it on
    # loopback so the dumped tree holds no non-loopback listener.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torch inductor's cache defaults to /tmp, which is the namespace's private tmpfs: its
    # ~150 MB precompiled header would be re-made at every create and tarred into every image.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(env.get("HOME", "/root"), ".cache", "vllm-snapshot", "torchinductor"))
    return env


def pipe_key(pid: int, fd: int) -> str:
    """``pipe:[inode]`` of ``pid``'s ``fd`` (what CRIU's ``--inherit-fd`` matches)."""
    return os.readlink(f"/proc/{pid}/fd/{fd}")


class LogPump(threading.Thread):
    """Copies engine log bytes from a pipe to sinks (our stderr, a file) until EOF."""

    def __init__(self, fd: int, sinks: list[Callable[[bytes], None]]):
        super().__init__(daemon=True, name="engine-log")
        self.fd = fd
        self.sinks = sinks
        self.tail: list[bytes] = []

    def run(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                break
            if not data:
                break
            for s in list(self.sinks):
                try:
                    s(data)
                except Exception:  # noqa: BLE001 - a broken sink must not stop the pump
                    pass
            buf = (buf + data)[-16384:]
            self.tail = buf.splitlines()[-40:]
        try:
            os.close(self.fd)
        except OSError:
            pass

    def tail_text(self, n: int = 20) -> str:
        return "\n".join(line.decode(errors="replace") for line in self.tail[-n:])


@dataclass
class EngineHandle:
    """A running engine tree we supervise. ``root_pid`` is the host PID of the namespace init
    (the tree's root); ``control`` is our write end, ``events_fd`` our read end."""

    root_pid: int
    control: IO[str]
    events_fd: int
    log: LogPump
    launcher: subprocess.Popen | None = None
    _buf: bytes = b""
    _pending: list[dict] = field(default_factory=list)

    def send(self, cmd: str, **kw) -> None:
        """Send one command. Raises EngineError when the engine is gone."""
        try:
            self.control.write(json.dumps({"cmd": cmd, **kw}) + "\n")
            self.control.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineError(f"engine is gone (sending {cmd!r}: {e})\n{self.log.tail_text()}") from e

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.root_pid)
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait_event(self, name: str, timeout: float, on_tick: Callable[[], None] | None = None) -> dict:
        """Wait for event ``name``; return it. Raises EngineError on an ``error`` event, EOF,
        death of the engine, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "error":
                    tail = "" if ev.get("kind") == "usage" else "\n" + self.log.tail_text()
                    raise EngineError(
                        f"engine error ({ev.get('kind', 'error')}): {ev.get('message')}{tail}",
                        details=ev,
                    )
                if ev.get("event") == name:
                    return ev
                self._pending.append(ev)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"timed out after {timeout:.0f} s waiting for the engine ({name})\n{self.log.tail_text()}")
            r, _, _ = select.select([self.events_fd], [], [], min(left, 0.5))
            if on_tick:
                on_tick()
            if r:
                data = os.read(self.events_fd, 65536)
                if not data:
                    time.sleep(0.2)
                    self.log.join(timeout=2)
                    raise EngineError(
                        f"engine exited while waiting for {name!r}\n{self.log.tail_text()}",
                        hint="the engine log above says why",
                    )
                self._buf += data

    def tree(self) -> list[psutil.Process]:
        """The root and all its descendants (empty when gone)."""
        try:
            root = psutil.Process(self.root_pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, grace: float = 0.0) -> None:
        """Stop the tree: SIGTERM + ``grace`` seconds, then SIGKILL the namespace init (which
        kills every process of its PID namespace); reap it when it is our child."""
        procs = self.tree()
        if grace > 0 and procs:
            try:
                os.kill(self.root_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            psutil.wait_procs(procs, timeout=grace)
        for p in self.tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.reap()

    def reap(self, block: bool = True) -> int | None:
        """waitpid the root if it is our child; returns its exit code (signal -> 128+sig)."""
        try:
            pid, status = os.waitpid(self.root_pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)

    def close(self) -> None:
        for closer in (self.control.close, lambda: os.close(self.events_fd)):
            try:
                closer()
            except OSError:
                pass
        if self.launcher is not None:
            try:
                self.launcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.launcher.kill()


PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


#: The module run as the engine root. Tests substitute a protocol-speaking fake engine through
#: ``VLLM_SNAPSHOT_ENGINE_MODULE`` to exercise the GPU sequencing without a GPU.
ENGINE_MODULE = "vllm_snapshot.engine.main"


def launch(spec: dict, env: dict[str, str], log_sinks: list[Callable[[bytes], None]], python: str = sys.executable,
           module: str = ENGINE_MODULE) -> EngineHandle:
    """Start the engine root (``python -m module SPEC``) in a new PID + mount namespace;
    return its handle.

    Raises EngineError when it cannot be started.
    """
    from .engine.mounts import ENGINE_TMPDIR

    os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)  # the mount point, on the host's disk
    ctl_r, ctl_w = os.pipe()
    log_r, log_w = os.pipe()
    ev_r, ev_w = os.pipe()

    def child_setup() -> None:
        # unshare dies with us (kill -9 of `create` included), and --kill-child makes the
        # engine root (PID 1 of the namespace, whose death ends the namespace) die with unshare.
        # The engine clears its own death signal before the dump (CRIU would deliver it right
        # after a restore).
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.dup2(ev_w, EVENTS_FD)
        if ev_w != EVENTS_FD:
            os.close(ev_w)

    # The engine root makes its mount namespace private first (engine/mounts.py): host tmpfs
    # mounts are detached and fresh tmpfs are mounted on /dev/shm and /tmp.
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private", "--kill-child", "--",
            python, "-m", module, json.dumps(spec)]
    try:
        launcher = subprocess.Popen(
            argv, stdin=ctl_r, stdout=log_w, stderr=log_w, env=env, close_fds=True,
            pass_fds=(EVENTS_FD,), start_new_session=True, preexec_fn=child_setup, cwd="/",
        )
    except OSError as e:
        for fd in (ctl_r, ctl_w, log_r, log_w, ev_r, ev_w):
            os.close(fd)
        raise EngineError(f"cannot start the engine: {e}") from e
    for fd in (ctl_r, log_w, ev_w):
        os.close(fd)
    pump = LogPump(log_r, log_sinks)
    pump.start()
    root = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(launcher.pid).children()
        except psutil.NoSuchProcess:
            kids = []
        if kids:
            root = kids[0].pid
            break
        if launcher.poll() is not None:
            break
        time.sleep(0.02)
    handle = EngineHandle(root or -1, os.fdopen(ctl_w, "w"), ev_r, pump, launcher)
    if root is None:
        handle.close()
        raise EngineError(f"the engine did not start (unshare exited {launcher.returncode})\n{pump.tail_text()}")
    return handle


def restored_handle(root_pid: int, ctl_w: int, ev_r: int, log_r: int, log_sinks: list[Callable[[bytes], None]]) -> EngineHandle:
    """Handle for a tree CRIU restored as our child, talking over the fresh pipes we passed in."""
    pump = LogPump(log_r, log_sinks)
    pump.start()
    return EngineHandle(root_pid, os.fdopen(ctl_w, "w"), ev_r, pump, None)


__all__ = ["EngineHandle", "launch", "restored_handle", "scrubbed_env", "pipe_key", "is_secret_name"]
