"""A protocol-speaking engine whose one child holds GPU memory as vLLM's level-2 sleep leaves it:
the engine program of part D of scripts/gpu_check.sh, which runs ``ops.create`` and
``ops.restore`` with it (``local_tools(engine_argv=ENGINE_ARGV)``) where vLLM does not fit.

``python -m vllm_snapshot.dev.gpu_engine SPEC_JSON`` is the engine root, started by the supervisor
as the real one (:mod:`vllm_snapshot.entrypoints.engine_root`) is: PID 1 of its own PID + mount +
network namespace, commands on fd 0, events on fd 3 (:mod:`vllm_snapshot.engine.protocol`), its
log on fds 1 and 2. In that order it makes its mounts private, brings ``lo`` up and drops to the
engine user, as the real root does. It is a **non-CUDA root**, like vLLM's API process: it
imports neither torch nor the driver bindings. It starts one **CUDA child**
(``python -m vllm_snapshot.dev.gpu_engine --cuda-child MODEL_DIR``, like EngineCore), which with
``cuda.bindings.driver`` (as vLLM's csrc/cumem_allocator.cpp does it) reserves a VA range
(``cuMemAddressReserve``), creates and maps physical memory there (``cuMemCreate``,
``cuMemMap``, ``cuMemSetAccess``) and copies the model's ``weights.bin`` into it. The commands,
through a pipe from the root to the child:

* ``sleep`` (level 2): ``cuMemUnmap`` + ``cuMemRelease``; the **reservation stays**.
* ``wake``: ``cuMemCreate`` + ``cuMemMap`` again **at the same VA** and copy ``weights.bin``
  from the model directory again (the reload) -- or, made with a weights file (``create
  --weights file``: the spec's ``weights_file``), from the weights file: at start the child
  copies its GPU memory into it through create's weights channel
  (:func:`vllm_snapshot.engine.weights._hand_over`, the vLLM worker's own path) and keeps the
  published file's read-only fd open, which CRIU dumps and re-opens at restore; the wake reads
  the fd (a GPU vLLM engine's ``--weights file`` wake, :data:`vllm_snapshot.engine.weights.FILL_RPC`).
* ``oracle`` (the canary's record too, and every ``POST /v1/completions`` once serving): a
  checksum computed on the GPU memory -- a kernel's int64 sum over the range (torch over
  ``__cuda_array_interface__``) and the sha256 of a device-to-host copy of every byte -- as the
  oracle's ``text``, whatever the prompt. A restored
  engine whose wake did not bring the weights back answers another text (or an error), so the
  oracle check of ``restore`` proves the wake.

``serve`` answers ``GET /health`` and ``POST /v1/completions`` (the oracle's fields) on the
listening socket the supervisor hands over, until SIGTERM/SIGINT (``stop``), then exits 0.

With the fake ``cuda.bindings.driver`` of tests/fakecuda first on the engine's PYTHONPATH (CPU
hosts, tests) the child runs the same calls over host memory: it names a thread as the fake
calls a CUDA process (``RESTORE_THREAD``) and its "kernel" is a host sum; torch is not imported.

Engine args (``create``'s, recorded in the snapshot): ``--break-restored-wake no-reload|no-remap``
makes every wake after ``attach`` (that is, of a restored tree) map without copying the weights
back, or not map at all -- a broken wake, for the tests that show part D fails on one.

The model: a directory :func:`write_model` makes (``config.json`` with ``model_type``
:data:`MODEL_TYPE`, ``weights.bin``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

#: The engine root's command (``SPEC_JSON`` is appended), for ``local_tools(engine_argv=...)``.
ENGINE_ARGV: tuple[str, ...] = (sys.executable, "-m", "vllm_snapshot.dev.gpu_engine")
#: ``config.json``'s ``model_type`` of a model :func:`write_model` made.
MODEL_TYPE = "gpu-check-vmm"
WEIGHTS = "weights.bin"
#: What seeds ``weights.bin``'s bytes (shake-256 of it).
SEED = b"weights-20250101"
BREAK_MODES = ("no-reload", "no-remap")


def write_model(path: Path, mib: int) -> Path:
    """Write the engine's model to ``path`` (a directory made here, 0755): ``config.json`` and
    ``weights.bin``, ``mib`` MiB of shake-256 bytes (deterministic), both 0644. Returns ``path``.
    Raises OSError (``path`` exists, or cannot be written)."""
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    (path / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "architectures": ["GpuCheckVmm"],
                                                  "weights": WEIGHTS}))
    (path / WEIGHTS).write_bytes(hashlib.shake_256(SEED).digest(mib << 20))
    for f in ("config.json", WEIGHTS):
        os.chmod(path / f, 0o644)
    return path


# ---------------------------------------------------------------- the CUDA child

def child_main(model_dir: str, weights_file: bool = False) -> int:
    """The CUDA child (see the module doc): one JSON line on the reply channel when ready
    (``{"ok": true, "va", "bytes", "checksum", "torch"}``) and one per command read from stdin
    (``sleep``, ``wake``, ``wake no-reload``, ``wake no-remap``, ``answer``); a failure is
    ``{"ok": false, "error"}``. ``weights_file``: the weights go into a weights file at start
    and every wake reads them from it (the module doc). Returns 0 at EOF."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the root reads this; anything printed goes to the log
    os.dup2(2, 1)

    def say(**kw) -> None:
        reply.write(json.dumps(kw) + "\n")

    try:
        st = _VmmState(Path(model_dir))
        if weights_file:
            st.hold_weights_file()
        say(ok=True, va=st.va, bytes=st.size, checksum=st.checksum(), torch=st.torch_version,
            weights_file=st.held is not None)
    except Exception as e:  # noqa: BLE001 - the root reports it as the engine's start error
        say(ok=False, error=f"start: {type(e).__name__}: {e}")
        return 1
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "sleep":
                st.sleep()
                say(ok=True, va=st.va)
            elif words[0] == "wake":
                st.wake(words[1] if len(words) > 1 else "")
                say(ok=True, va=st.va)
            elif words[0] == "answer":
                say(ok=True, checksum=st.checksum())
            else:
                say(ok=False, error=f"unknown child command {words[0]!r}")
        except Exception as e:  # noqa: BLE001 - reported to the root, which reports it to the supervisor
            say(ok=False, error=f"{words[0]}: {type(e).__name__}: {e}")
    return 0


class _VmmState:
    """The child's GPU memory: a VA range of ``weights.bin``'s size (rounded up to the driver's
    granularity), mapped and holding the weights, or unmapped (asleep) with the range kept."""

    def __init__(self, model_dir: Path) -> None:
        from cuda.bindings import driver as cu

        self.cu, self.weights = cu, model_dir / WEIGHTS
        self.held: int | None = None  # the weights file's fd (hold_weights_file): the wake's source
        self.fake = hasattr(cu, "RESTORE_THREAD")  # tests/fakecuda: no GPU, no torch
        self.torch = None
        self.torch_version = "none (the fake driver)"
        if self.fake:
            import ctypes

            name = cu.RESTORE_THREAD.encode()

            def restore_thread() -> None:  # what the fake driver calls a CUDA process
                ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
                threading.Event().wait()

            threading.Thread(target=restore_thread, daemon=True).start()
        else:
            import torch

            self.torch, self.torch_version = torch, torch.__version__
        self._ok(cu.cuInit(0), "cuInit")
        dev = self._ok(cu.cuDeviceGet(0), "cuDeviceGet")
        # csrc/cumem_allocator.cpp ensure_context(): the device's primary context, current
        cur = self._ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is None or int(cur) == 0:
            self._ok(cu.cuCtxSetCurrent(self._ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")),
                     "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        prop.allocFlags.compressionType = cu.CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_NONE
        self.prop = prop
        gran = self._ok(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        n = self.nbytes = self.weights.stat().st_size
        self.size = max(1, -(-n // gran)) * gran
        self.va = int(self._ok(cu.cuMemAddressReserve(self.size, 0, 0, 0), "cuMemAddressReserve"))  # kept for good
        self.handle = self._create_and_map()
        self._load()

    @staticmethod
    def _ok(res, what: str):
        err = res[0]
        if int(err) != 0:
            raise RuntimeError(f"{what}: {getattr(err, 'name', err)}")
        return res[1] if len(res) > 1 else None

    def _create_and_map(self):  # csrc/cumem_allocator.cpp create_and_map()
        cu = self.cu
        h = self._ok(cu.cuMemCreate(self.size, self.prop, 0), "cuMemCreate")
        self._ok(cu.cuMemMap(self.va, self.size, 0, h, 0), f"cuMemMap at {self.va:#x}")
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = 0
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._ok(cu.cuMemSetAccess(self.va, self.size, [acc], 1), "cuMemSetAccess")
        return h

    def _load(self) -> None:  # the weights from the weights file or the model directory, host -> device
        if self.held is not None:
            data = os.pread(self.held, self.nbytes, 0)
            if len(data) != self.nbytes:
                raise RuntimeError(f"the weights file ended at {len(data)} of {self.nbytes} bytes")
        else:
            data = self.weights.read_bytes()
        data += bytes(self.size - len(data))
        self._ok(self.cu.cuMemcpyHtoD(self.va, data, self.size), "cuMemcpyHtoD")
        self._ok(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def hold_weights_file(self) -> None:
        """Copy the weights from the GPU memory into a weights file through create's weights
        channel (one entry: the weights' bytes) and keep the published file's fd: from now on
        the wake reads the weights from it. Raises what :func:`vllm_snapshot.engine.weights._hand_over`
        raises."""
        from ..engine import weights as ew

        entry = {"names": ["param:weights"], "offset": 0, "nbytes": self.nbytes, "dtype": "torch.uint8"}

        def write(fd: int) -> None:  # device -> host -> file, as the vLLM worker's bounded copies
            host = bytearray(self.size)
            self._ok(self.cu.cuMemcpyDtoH(host, self.va, self.size), "cuMemcpyDtoH")
            view, done = memoryview(host)[:self.nbytes], 0
            while done < self.nbytes:
                done += os.pwrite(fd, view[done:], done)

        def use(rfd: int, size: int, digest: str | None) -> tuple[int, list[str]]:
            self.held = rfd
            return size, []

        out = ew._hand_over([entry], [], [], ew.SOCKET_NAME, use, write=write)
        print(f"gpu_engine: weights file {out['digest']}: {self.nbytes} bytes written, held open as fd {self.held}",
              flush=True)

    def sleep(self) -> None:
        """Level 2 (csrc/cumem_allocator.cpp unmap_and_release()): the VA stays reserved."""
        if self.handle is None:
            raise RuntimeError("already asleep")
        self._ok(self.cu.cuMemUnmap(self.va, self.size), "cuMemUnmap")
        self._ok(self.cu.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def wake(self, broken: str = "") -> None:
        """Create and map at the same VA, then reload the weights (``broken``: one of
        :data:`BREAK_MODES` skips the reload, or the mapping too)."""
        if self.handle is not None:
            raise RuntimeError("not asleep")
        if broken == "no-remap":
            return
        self.handle = self._create_and_map()
        if broken != "no-reload":
            self._load()

    def checksum(self) -> str:
        """``sum=<int64 sum of the int32 words, by a kernel> sha=<sha256 of a device-to-host
        copy of every byte, 16 hex>``. Raises RuntimeError (e.g. the range is not mapped)."""
        host = bytearray(self.size)
        self._ok(self.cu.cuMemcpyDtoH(host, self.va, self.size), "cuMemcpyDtoH")
        if self.torch is None:  # the fake driver: its memory is this process's
            import ctypes

            words = (ctypes.c_int32 * (self.size // 4)).from_address(self.va)
            total = sum(words[::4096])
        else:
            torch = self.torch

            class View:  # the VMM range as a tensor, without a copy
                __cuda_array_interface__ = {"shape": (self.size // 4,), "typestr": "<i4", "data": (self.va, False),
                                            "version": 2}

            total = int(torch.as_tensor(View(), device="cuda").sum(dtype=torch.int64).item())
        return f"sum={total} sha={hashlib.sha256(host).hexdigest()[:16]}"


# ---------------------------------------------------------------- the engine root

class _Child:
    """The root's end of the CUDA child: one command line, one JSON reply, one at a time."""

    def __init__(self, model_dir: str, weights_file: bool = False) -> None:
        argv = [sys.executable, "-m", "vllm_snapshot.dev.gpu_engine", "--cuda-child", model_dir]
        self.proc = subprocess.Popen(argv + (["--weights-file"] if weights_file else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, text=True)
        self.lock = threading.Lock()
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CUDA child exited (status {self.proc.wait()}); its error is in the log")
        got = json.loads(line)
        if not got.get("ok"):
            raise RuntimeError(got.get("error", "the CUDA child failed"))
        return got

    def ask(self, command: str) -> dict:
        """Send ``command``, return the child's reply. Raises RuntimeError (the child failed)."""
        with self.lock:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return self._read()


_events = None


def emit(event: str, **kw) -> None:
    """One event on fd 3 (:func:`vllm_snapshot.engine.protocol.encode_event`); a vanished
    reader (``--detach``) is ignored."""
    from ..engine.protocol import FD_EVENTS, encode_event

    global _events
    line = encode_event(event, **kw)
    try:
        if _events is None:
            _events = os.fdopen(FD_EVENTS, "w", buffering=1)
        _events.write(line)
        _events.flush()
    except (OSError, ValueError):
        pass


def _oracle(prompt: str, checksum: str) -> dict:
    return {"prompt": prompt, "token_id": 0, "text": checksum, "logprob": -1.0,
            "top_logprobs": [{"token_id": 0, "logprob": -1.0}]}


def _serve(sock, host: str, port: int, answer) -> None:
    """HTTP on the handed-over listening socket until SIGTERM/SIGINT: ``GET /health``, ``POST
    /v1/completions`` (``answer()``: the oracle's fields, freshly computed)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/completions":
                return self._send(404, {})
            try:
                o = answer()
            except RuntimeError as e:
                return self._send(500, {"error": str(e)})
            self._send(200, {"choices": [{"text": o["text"], "token_ids": [o["token_id"]],
                                          "logprobs": {"token_logprobs": [o["logprob"]]}}]})

    srv = ThreadingHTTPServer((host, port), H, bind_and_activate=False)
    srv.socket.close()
    srv.socket = sock
    emit("binding", address=f"http://{host}:{port}")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    srv.shutdown()


def root_main(spec_json: str) -> int:
    """The engine root (see the module doc). Returns its exit status."""
    from ..engine.protocol import CANARY_PROMPT, decode
    from ..engine.spec import EngineSpec
    from ..host.procs import mark_served, set_parent_death_signal

    try:
        os.setsid()  # CRIU refuses a tree whose session leader lives outside its PID namespace
    except OSError:
        pass
    spec = EngineSpec.from_json(spec_json)
    ap = argparse.ArgumentParser(prog="gpu_engine", add_help=False)
    ap.add_argument("--break-restored-wake", choices=BREAK_MODES, default="")
    try:
        args = ap.parse_args(list(spec.engine_args))
    except SystemExit:
        emit("error", kind="usage", message=f"engine args {list(spec.engine_args)}: only --break-restored-wake "
                                            f"{'|'.join(BREAK_MODES)}")
        return 2
    user = spec.user
    if os.getpid() == 1:  # entrypoints/engine_root.py's order: mounts, lo, then the engine user
        from ..engine.mounts import link_inductor_cache, make_private
        from ..engine.net import loopback_up

        make_private(link_inductor=user is None)
        loopback_up()
    if user is not None:
        from ..host.privilege import drop_to

        drop_to(user.uid, user.gid, list(user.groups))
        set_parent_death_signal(signal.SIGKILL)  # the uid change cleared --kill-child's
        if os.getpid() == 1:
            link_inductor_cache()
    try:
        child = _Child(spec.model, spec.weights_file)
    except (OSError, RuntimeError, ValueError) as e:
        emit("error", kind="engine", message=f"the CUDA child did not start: {e}")
        return 1
    prompt = spec.oracle_prompt
    print(f"gpu_engine: CUDA child {child.proc.pid}: {json.dumps(child.ready)}", flush=True)
    # the HTTP canary's record too, as the real engine root (its answer does not depend on the prompt)
    emit("initialized", oracle=_oracle(prompt, child.ready["checksum"]),
         canary=_oracle(CANARY_PROMPT, child.ready["checksum"]),
         info={"kind": "cuda", "vllm": "none (vllm_snapshot.dev.gpu_engine)", "torch": child.ready["torch"],
               "served_model_name": spec.served_model_name or MODEL_TYPE,
               "normalized_args": {"raw": json.dumps(list(spec.engine_args))}})
    restored = False
    for line in sys.stdin:
        cmd = decode(line)
        if cmd is None:
            continue
        name = cmd.get("cmd")
        print(f"CALL {name}", flush=True)
        try:
            if name == "oracle":
                emit("oracle", oracle=_oracle(cmd.get("prompt") or prompt, child.ask("answer")["checksum"]))
            elif name == "sleep":
                child.ask("sleep")
                emit("slept")
            elif name == "wake":
                child.ask(f"wake {args.break_restored_wake}" if restored else "wake")
                emit("woken")
            elif name == "prepare-dump":
                set_parent_death_signal(0)  # CRIU would deliver it right after restore
                emit("dump-ready", modules=sorted({m.split(".", 1)[0] for m in list(sys.modules)}),
                     sys_path=list(sys.path))
            elif name == "attach":
                restored = True
                set_parent_death_signal(signal.SIGKILL)
                emit("attached")
            elif name == "serve":
                from ..engine.net import receive_listener

                mark_served()
                sock = receive_listener(str(cmd.get("handoff") or ""))
                set_parent_death_signal(signal.SIGKILL if cmd.get("die_with_parent") else 0)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait
                _serve(sock, cmd["host"], int(cmd["port"]), lambda: _oracle(prompt, child.ask("answer")["checksum"]))
                return 0
            elif name == "exit":
                return 0
            else:
                emit("error", kind="protocol", message=f"unknown command {name!r}")
        except Exception as e:  # noqa: BLE001 - report, the supervisor decides
            emit("error", kind=name or "engine", message=f"{type(e).__name__}: {e}")
            if name == "serve":
                return 1
    return 0  # EOF before serve: the supervisor is gone


def main(argv: list[str]) -> int:
    """``--cuda-child MODEL_DIR``: the child; else ``SPEC_JSON``: the engine root."""
    if argv[:1] == ["--cuda-child"] and len(argv) in (2, 3) and argv[2:] in ([], ["--weights-file"]):
        return child_main(argv[1], argv[2:] == ["--weights-file"])
    if len(argv) != 1:
        print("usage: python -m vllm_snapshot.dev.gpu_engine SPEC_JSON | --cuda-child MODEL_DIR [--weights-file]",
              file=sys.stderr)
        return 2
    return root_main(argv[0])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
