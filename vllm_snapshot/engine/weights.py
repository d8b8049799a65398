"""Engine side of the weights file: runs INSIDE a CPU engine's worker process, right after vLLM
loaded and post-processed the weights, before the oracle, compile or warm-up ran.

Why: a CPU engine's weights are private anonymous memory, so every CRIU image holds a copy of
them (a 3.1 GiB model gave 4.6 GiB of images), every restore copies them back, and clones of
one snapshot hold one copy each. Memory that is a ``MAP_PRIVATE`` mapping of a file is dumped by
CRIU as a reference to that file (only pages written since are copied: design notes §7), and
restores file-backed, from the page cache on first touch, shared between every process mapping
the same file. So the worker writes its large parameters and buffers into one weights file and
re-points the tensors at a private mapping of it (copy-on-write: a write stays in the process).

The file belongs to the store and to root (0600 in a 0700 directory): the worker, which runs
as the unprivileged engine user, never opens it by name. Create (root) listens on an abstract
unix socket of the tree's own network namespace (:data:`SOCKET_NAME`; only processes of this
engine tree can connect); over it the worker sends the table of what it will write, receives a
writable fd of a new temp file, writes, and receives a read-only fd of the published,
content-addressed file (``BLAKE3.weights``), which it maps once and re-points the tensors at.

What stays in the process: parameters and buffers below :data:`MIN_BYTES`, non-CPU tensors, and
tensors that are not a dense slice of their storage. vLLM's CPU backend normally *copies* every
linear layer's weight into a oneDNN (or sgl-kernel) prepacked buffer that only the library
knows and then drops the torch tensor (``dispatch_cpu_unquantized_gemm``): nothing can map those
buffers from a file, so with a weights file the linear layers compute with
``torch.nn.functional.linear`` on the mapped weight instead (:func:`_keep_weights_gemm`).

A GPU engine (``--weights file`` on CUDA, :data:`MODE_WAKE`) writes its parameters the same way,
through bounded host copies, but keeps them on the device and keeps the read-only fd open
instead of mapping it: at sleep level 2 vLLM discards the weights and the wake, instead of
reloading and post-processing the model files (``reload_weights``), copies the file's
post-processed bytes back into the very storages (:func:`fill_held`, called through
:data:`FILL_RPC` on :class:`WakeFromWeightsFile`, a vLLM worker extension). CRIU re-opens the
fd at restore, as root, for an engine user who cannot open the file by name.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time

#: The abstract unix socket name (per network namespace) create listens on.
SOCKET_NAME = "vllm-snapshot-weights"
#: Set in the environment of vLLM's children by the engine root when create asked for a
#: weights file: the child hook then patches vLLM's loader (:func:`install`); its value is the mode.
ENV = "VLLM_SNAPSHOT_WEIGHTS"
#: :data:`ENV` of a CPU engine: its worker computes with a private mapping of the file.
MODE_MAP = "1"
#: :data:`ENV` of a GPU engine: its worker keeps the file open as the source of a level-2 wake.
MODE_WAKE = "wake"
#: The worker method (vLLM ``collective_rpc``) a GPU engine's wake calls instead of
#: ``reload_weights`` (:meth:`WakeFromWeightsFile.vllm_snapshot_fill_weights`).
FILL_RPC = "vllm_snapshot_fill_weights"
#: vLLM's ``--worker-extension-cls`` that adds :data:`FILL_RPC` to the worker.
EXTENSION = "vllm_snapshot.engine.weights.WakeFromWeightsFile"
#: Tensors smaller than this (bytes) stay in the process (norms, small biases).
MIN_BYTES = 1 << 16
#: File offsets of tensors are multiples of this (bytes): a page, and a cache-line multiple.
ALIGN = 1 << 12
#: Seconds the worker waits for create's socket, and for each answer.
CONNECT_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 900.0

#: Why a tensor that is a slice of a larger storage stays out of the file.
NOT_DENSE = "not the whole of a dense storage"
#: The mapping of the weights file (kept alive for the life of the process).
_MAPPED: list = []
#: A GPU worker's wake source: ``{"fd", "entries", "digest"}`` (the fd open for the life of
#: the process, so CRIU dumps it and re-opens the file at restore).
_HELD: dict = {}


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`. Pure."""
    return -(-n // ALIGN) * ALIGN


def send_msg(sock: socket.socket, obj: dict, fd: int | None = None) -> None:
    """Send one length-prefixed JSON message (4-byte big-endian length), with ``fd`` attached
    (SCM_RIGHTS) when given. Raises OSError."""
    import array

    data = json.dumps(obj).encode()
    payload = struct.pack(">I", len(data)) + data
    if fd is None:
        sock.sendall(payload)
    else:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_msg(sock: socket.socket, max_bytes: int = 64 << 20) -> tuple[dict, int | None]:
    """Receive one message of :func:`send_msg`: (object, fd or None). Raises OSError,
    ConnectionError (closed), ValueError (too long, not JSON)."""
    import array

    head, anc, _f, _a = sock.recvmsg(4, socket.CMSG_SPACE(4))
    fds = array.array("i")
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    while len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            raise ConnectionError("the weights channel closed")
        head += more
    (n,) = struct.unpack(">I", head)
    if n > max_bytes:
        raise ValueError(f"a weights-channel message of {n} bytes (at most {max_bytes})")
    body = b""
    while len(body) < n:
        more = sock.recv(min(n - len(body), 1 << 20))
        if not more:
            raise ConnectionError("the weights channel closed")
        body += more
    for extra in fds[1:]:
        os.close(extra)
    return json.loads(body), (fds[0] if fds else None)


def plan(named: list[tuple[str, object]], device: str = "cpu",
         min_bytes: int = MIN_BYTES) -> tuple[list[dict], list[dict], list]:
    """The weights file's table for ``named`` (name, tensor) pairs (parameters and buffers):
    one entry per distinct storage, in name order, each at an :data:`ALIGN`-ed offset:
    ``{"names", "offset", "nbytes", "dtype"}``; the tensors that stay in the process with the
    reason: ``{"name", "nbytes", "why"}``; and the storages (tensors), parallel to the table.
    Tied weights (one storage, two names) are written once. ``device``: the device type whose
    tensors go into the file (``cpu``: mapped in place; ``cuda``: the source of a level-2 wake,
    :func:`fill_in_place`). Tensors under ``min_bytes`` stay. Pure over the tensors."""
    import torch

    entries: list[dict] = []
    stays: list[dict] = []
    storages: list = []
    seen: dict[int, int] = {}
    offset = 0
    for name, t in sorted(named, key=lambda x: x[0]):
        if not isinstance(t, torch.Tensor):
            continue
        nbytes = t.numel() * t.element_size()
        if t.device.type != device:
            stays.append({"name": name, "nbytes": nbytes, "why": f"on {t.device.type}"})
            continue
        if nbytes < min_bytes or nbytes == 0:
            stays.append({"name": name, "nbytes": nbytes, "why": f"under {min_bytes >> 10} KiB" if nbytes else "empty"})
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen:
            entries[seen[key]]["names"].append(name)
            continue
        if not t.is_contiguous() or t.storage_offset() != 0 or st.nbytes() != nbytes:
            stays.append({"name": name, "nbytes": nbytes, "why": NOT_DENSE})
            continue
        seen[key] = len(entries)
        entries.append({"names": [name], "offset": offset, "nbytes": nbytes, "dtype": str(t.dtype)})
        storages.append(t)
        offset = align(offset + nbytes)
    return entries, stays, storages


def _named_tensors(model) -> list[tuple[str, object]]:
    out = [(f"param:{n}", p) for n, p in model.named_parameters(remove_duplicate=False)]
    out += [(f"buffer:{n}", b) for n, b in model.named_buffers(remove_duplicate=False)]
    return out


#: Bytes copied between a device tensor and the file per step (:func:`_write_all`,
#: :func:`fill_in_place`): bounds the host memory a GPU copy needs.
CHUNK = 64 << 20


def _write_all(fd: int, entries: list[dict], storages: list) -> None:
    """Write each storage's bytes at its entry's offset into ``fd``: a CPU tensor's own bytes
    (no copy), a device tensor's through :data:`CHUNK`-sized host copies. Raises OSError."""
    import torch

    for e, t in zip(entries, storages):
        flat = t.detach().reshape(-1).view(torch.uint8)
        done = 0
        while done < flat.numel():
            part = flat[done:done + CHUNK]
            view = memoryview((part if part.device.type == "cpu" else part.cpu()).numpy())
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], e["offset"] + done + written)
            done += len(view)


def _tensor(model, full: str):
    kind, name = full.split(":", 1)
    return dict(model.named_parameters(remove_duplicate=False) if kind == "param"
                else model.named_buffers(remove_duplicate=False)).get(name)


def fill_in_place(model, entries: list[dict], fd: int) -> int:
    """Copy each entry's bytes from the weights file ``fd`` into the tensors it names, in place:
    the same storages (a GPU engine woken from sleep level 2 has its weight tensors back at the
    addresses CUDA graphs and kernels captured, with undefined contents), so nothing is re-pointed
    and vLLM's post-processing is not run again -- the file holds the post-processed bytes.
    Returns the bytes copied. Raises RuntimeError when a named tensor is missing or has another
    dtype or size (the model is not the one the file was written from), OSError (the file)."""
    import torch

    done_bytes = 0
    for e in entries:
        dtype = getattr(torch, e["dtype"].removeprefix("torch."))
        dsts = [(_tensor(model, n), n) for n in e["names"]]
        for t, n in dsts:
            if t is None:
                raise RuntimeError(f"the weights file names {n}, which this model does not have")
            if t.dtype != dtype or t.numel() * t.element_size() != e["nbytes"] or not t.is_contiguous():
                raise RuntimeError(f"{n} is {t.dtype} x {t.numel()} here, the weights file has {e['dtype']}, "
                                   f"{e['nbytes']} bytes")
        flat = dsts[0][0].detach().reshape(-1).view(torch.uint8)  # tied names share this storage
        host = torch.empty(min(CHUNK, e["nbytes"]), dtype=torch.uint8)
        done = 0
        while done < e["nbytes"]:
            n = min(CHUNK, e["nbytes"] - done)
            got = os.preadv(fd, [memoryview(host[:n].numpy())], e["offset"] + done)
            if got != n:
                raise OSError(f"the weights file ended at {e['offset'] + done + got} bytes, inside {e['names'][0]}")
            flat[done:done + n].copy_(host[:n])
            done += n
        done_bytes += e["nbytes"]
    return done_bytes


def _repoint(model, entries: list[dict], mm: mmap.mmap) -> tuple[int, list[str]]:
    """Point every tensor named in ``entries`` at its bytes in the private mapping ``mm``, then
    zero the memory they held where nothing else references it (freed heap memory keeps its
    bytes, and CRIU would dump a stale copy of the weights). Returns (the bytes re-pointed, the
    names whose old memory something else still references: it stays, unzeroed). Raises
    RuntimeError when a tensor's bytes differ from the mapping's (the file is not what was
    written)."""
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    olds = []
    for e in entries:
        kind, name = e["names"][0].split(":", 1)
        olds.append((e["names"][0], (params[name] if kind == "param" else buffers[name]).untyped_storage()))
    moved = 0
    for e in entries:
        dtype = getattr(torch, e["dtype"].removeprefix("torch."))
        first = True
        for full in e["names"]:
            kind, name = full.split(":", 1)
            old = params[name] if kind == "param" else buffers[name]
            new = torch.frombuffer(mm, dtype=dtype, count=old.numel(), offset=e["offset"]).view(old.shape)
            if first and not torch.equal(new, old.detach()):
                raise RuntimeError(f"the weights file's bytes of {name} differ from the tensor's")
            first = False
            if kind == "param":
                old.data = new
            else:
                owner, _, attr = name.rpartition(".")
                mod = model.get_submodule(owner) if owner else model
                mod._buffers[attr] = new
        moved += e["nbytes"]
    del params, buffers
    held = []
    for name, st in olds:
        # 1: only ``st`` itself; more: a tensor elsewhere (a closure, a cache) still uses it
        if torch._C._storage_Use_Count(st._cdata) > 1:
            held.append(name)
        else:
            torch.empty(0, dtype=torch.uint8).set_(st).zero_()
    return moved, held


def _hand_over(entries: list[dict], stays: list[dict], storages: list, socket_name: str, use, write=None) -> dict:
    """The worker's side of the weights channel: connect to create's socket, send the table,
    write the storages into the fd create gives (``write(fd)`` instead, when given: a writer of
    its own, e.g. :mod:`vllm_snapshot.dev.gpu_engine`'s device copies without torch), receive a read-only fd of the published file,
    call ``use(rfd, size, digest)`` (which returns ``(bytes used, names that stay)``; it owns
    ``rfd``) and report what was used. ``storages`` is emptied once written (the caller's list:
    no reference to the loaded copies is left for :func:`_repoint`'s zeroing to count).
    Returns ``{"digest", "tensors", "bytes", "stays", "stays_bytes"}``. Raises OSError/ConnectionError (the channel), RuntimeError (create refused, or ``use``)."""
    size = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        while True:
            try:
                s.connect("\0" + socket_name)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        s.settimeout(ANSWER_TIMEOUT_S)
        send_msg(s, {"op": "table", "size": size, "entries": entries, "stays": stays})
        answer, wfd = recv_msg(s)
        if answer.get("op") != "write" or wfd is None:
            raise RuntimeError(f"create refused the weights file: {answer.get('error') or answer}")
        try:
            if write is not None:
                write(wfd)
            else:
                _write_all(wfd, entries, storages)
        finally:
            os.close(wfd)
        send_msg(s, {"op": "written"})
        answer, rfd = recv_msg(s)
        if answer.get("op") != "map" or rfd is None:
            raise RuntimeError(f"create could not publish the weights file: {answer.get('error') or answer}")
        try:
            if os.fstat(rfd).st_size != size:
                raise RuntimeError(f"the weights file has {os.fstat(rfd).st_size} bytes, not {size}")
        except BaseException:
            os.close(rfd)
            raise
        storages.clear()
        used, held = use(rfd, size, answer.get("digest"))
        stays = stays + [{"name": n, "nbytes": 0, "why": "its loaded copy is still referenced elsewhere"} for n in held]
        import gc

        gc.collect()
        out = {"digest": answer.get("digest"), "tensors": sum(len(e["names"]) for e in entries), "bytes": used,
               "stays": len(stays), "stays_bytes": sum(x["nbytes"] for x in stays)}
        send_msg(s, {"op": "mapped", **out})
        return out
    finally:
        s.close()


def map_model(model, socket_name: str = SOCKET_NAME) -> dict:
    """Hand the large CPU tensors of ``model`` to create and re-point them at a private mapping
    of the published weights file. Returns ``{"digest", "tensors", "bytes", "stays"}``.
    Raises OSError/ConnectionError (the channel), RuntimeError (create refused, or the file's
    bytes differ from the tensors')."""
    entries, stays, storages = plan(_named_tensors(model))

    def use(rfd: int, size: int, digest: str | None) -> tuple[int, list[str]]:
        try:
            # MAP_PRIVATE, readable and writable: a write stays in this process (copy-on-write)
            mm = mmap.mmap(rfd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        finally:
            os.close(rfd)
        if mm is None:
            return 0, []
        out = _repoint(model, entries, mm)
        _MAPPED.append(mm)
        return out

    return _hand_over(entries, stays, storages, socket_name, use)


def wake_plan(model, device: str = "cuda") -> tuple[list[dict], list[dict], list]:
    """:func:`plan` for the wake of a model whose parameters live on ``device``: every
    parameter (no size floor: at sleep level 2 all of them are discarded) -- not the buffers,
    which vLLM saves and restores itself across a level-2 sleep (and which may change after
    loading). Raises RuntimeError naming the parameters on ``device`` the file cannot hold (a
    slice of a larger storage): a wake from the file would leave them undefined."""
    named = [(f"param:{n}", p) for n, p in model.named_parameters(remove_duplicate=False)]
    entries, stays, storages = plan(named, device=device, min_bytes=0)
    lost = [x["name"] for x in stays if x["why"] == NOT_DENSE]
    if lost:
        raise RuntimeError(f"{len(lost)} parameters cannot be restored from a weights file at the wake "
                           f"(not the whole of a dense storage): {', '.join(lost[:5])}; create with --weights in-image")
    return entries, stays, storages


def hold_for_wake(model, socket_name: str = SOCKET_NAME, device: str = "cuda") -> dict:
    """Write every parameter of ``model`` on ``device`` into a weights file through create
    (:func:`wake_plan`; device tensors through bounded host copies) and keep the file's
    read-only fd open as the source of the level-2 wake (:func:`fill_held`); the tensors stay
    where they are. Returns what :func:`map_model` returns (``bytes``: bytes written). Raises
    what :func:`_hand_over` and :func:`wake_plan` raise."""
    entries, stays, storages = wake_plan(model, device)

    def use(rfd: int, size: int, digest: str | None) -> tuple[int, list[str]]:
        old = _HELD.get("fd")
        _HELD.update(fd=rfd, entries=entries, digest=digest)
        if old is not None:  # a second load (not seen in vLLM): the newest model's file
            os.close(old)
        return sum(e["nbytes"] for e in entries), []

    return _hand_over(entries, stays, storages, socket_name, use)


def fill_held(model) -> int:
    """The level-2 wake's weights: copy the held weights file's bytes into ``model``'s
    parameters, in place (:func:`fill_in_place`), then wait for the device. Returns the bytes
    copied. Raises RuntimeError when this process holds no weights file (the engine was made
    without one) or the model is not the file's; OSError (the file)."""
    if not _HELD:
        raise RuntimeError("this worker holds no weights file to wake from (the snapshot was made without one)")
    n = fill_in_place(model, _HELD["entries"], _HELD["fd"])
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return n


class WakeFromWeightsFile:
    """vLLM worker extension (``--worker-extension-cls``, set by the engine root of a GPU engine
    made with a weights file): adds :data:`FILL_RPC`, which the engine root's wake calls with
    ``collective_rpc`` after ``wake_up(tags=["weights"])`` instead of ``reload_weights``."""

    def vllm_snapshot_fill_weights(self) -> int:
        """Fill the woken weights from the held weights file (:func:`fill_held`) into the
        model of this worker (``self.model_runner``). Returns the bytes copied; raises what
        :func:`fill_held` raises."""
        t0 = time.monotonic()
        n = fill_held(self.model_runner.get_model())
        print(f"vllm-snapshot: woke {n} bytes of weights from the weights file {_HELD.get('digest')} "
              f"in {time.monotonic() - t0:.2f} s", flush=True)
        return n


def _keep_weights_gemm(original):
    """A ``dispatch_cpu_unquantized_gemm`` that keeps 2-D weights as torch tensors (linear
    layers compute with ``torch.nn.functional.linear`` on ``layer.weight``) instead of copying
    them into a library-owned prepacked buffer; other layers go to ``original``."""
    import torch

    def dispatch(layer, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if w is None or w.is_meta or w.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    return dispatch


def install(mode: str = MODE_MAP) -> None:
    """Patch vLLM in this (spawned child) process: every model loaded by a vLLM model loader
    is handed, once loaded and post-processed, to :func:`map_model` (``mode`` :data:`MODE_MAP`;
    linear layers then keep their weights as tensors) or to :func:`hold_for_wake`
    (:data:`MODE_WAKE`). A failure there fails the engine's start (create reports it). Raises
    ValueError for another mode."""
    if mode not in (MODE_MAP, MODE_WAKE):
        raise ValueError(f"{ENV}={mode!r}: not a weights-file mode")
    from vllm.model_executor.model_loader import base_loader

    load = base_loader.BaseModelLoader.load_model
    if getattr(load, "_vllm_snapshot", False):
        return
    if mode == MODE_MAP:
        from vllm.model_executor.layers import utils

        utils.dispatch_cpu_unquantized_gemm = _keep_weights_gemm(utils.dispatch_cpu_unquantized_gemm)

    def load_model(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        t0 = time.monotonic()
        out = map_model(model) if mode == MODE_MAP else hold_for_wake(model)
        what = "mapped" if mode == MODE_MAP else "written, held open as the level-2 wake's source"
        print(f"vllm-snapshot: weights file {out['digest']}: {out['tensors']} tensors, {out['bytes']} bytes {what} "
              f"({out['stays']} small or special tensors stay in memory) in {time.monotonic() - t0:.2f} s",
              flush=True)
        return model

    load_model._vllm_snapshot = True
    base_loader.BaseModelLoader.load_model = load_model
