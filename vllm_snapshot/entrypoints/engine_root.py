"""The engine root: runs INSIDE the snapshotted tree, as PID 1 of its own PID namespace (with
its own mount namespace and a loopback-only network namespace, see
:mod:`vllm_snapshot.engine.net`).

``python -m vllm_snapshot.entrypoints.engine_root SPEC_JSON``; SPEC is ``{"model", "engine_args",
"oracle_prompt", "sleep_level"}``. It builds a vLLM engine client (AsyncLLM: this process is the
API process, EngineCore and workers are its children), records the oracle (and the HTTP canary's
expectation), then obeys commands
on fd 0 and reports events on fd 3 (see :mod:`vllm_snapshot.engine.protocol`). The engine never
binds the HTTP port itself: on ``serve``, which the supervisor sends after a restored oracle
matched, it receives the listening socket the supervisor bound in the host's network namespace.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import threading
import traceback

from ..engine import args as engine_args_rules
from ..engine.args import PARALLEL_SIZES, argparse_reason, normalize_args, stray_error, unrestorable
from ..engine.protocol import CANARY_PROMPT, FD_EVENTS, cut_line, decode, drain_line, encode_event
from ..engine.spec import EngineSpec
from ..host.procs import set_parent_death_signal

_events = None


def emit(event: str, **kw) -> None:
    """Write one event line to fd 3; ignore a vanished reader (``--detach``). Raises
    ValueError for an event or fields the protocol does not define (:data:`EVENT_FIELDS`)."""
    global _events
    line = encode_event(event, **kw)  # outside the try: a payload off the table is a bug, not a vanished reader
    try:
        if _events is None:
            _events = os.fdopen(FD_EVENTS, "w", buffering=1)
        _events.write(line)
        _events.flush()
    except (OSError, ValueError):
        pass


def _commands(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
    for line in sys.stdin.buffer:
        cmd = decode(line)
        if cmd is None:
            continue
        loop.call_soon_threadsafe(q.put_nowait, cmd)
    loop.call_soon_threadsafe(q.put_nowait, None)  # EOF: the supervisor closed the pipe


#: vLLM's parser as built at create (kept in the snapshot: building it again after a restore
#: costs ~0.5 s; parsing front-end options with it costs ~1 ms)
_PARSER = None


def parse_engine_args(model: str, engine_args: list[str]):
    """Parse ``vllm serve`` engine args with vLLM's own parser. Raises SystemExit(2) on bad
    args (argparse prints the reason to stderr, which is the engine log), ValueError on what
    cannot be snapshotted or on a stray word (vLLM would load it as the model)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    global _PARSER
    parser = _PARSER = make_arg_parser(FlexibleArgumentParser(prog="vllm-snapshot create MODEL"))
    args = parser.parse_args(["--model", model, *engine_args])
    if getattr(args, "model_tag", None) is not None:  # a stray word: it would replace the model create hashed
        raise ValueError(stray_error([args.model_tag], "create").message)
    if getattr(args, "headless", False) or getattr(args, "grpc", False):
        raise ValueError("vllm-snapshot needs the HTTP frontend (no --headless/--grpc)")
    if getattr(args, "api_server_count", None) not in (None, 1):
        raise ValueError("vllm-snapshot supports one API server (--api-server-count 1)")
    args.api_server_count = None
    sizes = {f: getattr(args, f, 1) or 1 for f in PARALLEL_SIZES}
    if any(v != 1 for v in sizes.values()):
        raise ValueError("vllm-snapshot supports single-device (TP1) engines only: "
                         + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if v != 1))
    problems = unrestorable(args)
    if problems:
        raise ValueError("these settings would make a snapshot that can never be restored or validated:\n  "
                         + "\n  ".join(problems))
    try:
        validate_parsed_serve_args(args)  # vLLM's own quick checks (--chat-template names a file, ...)
    except Exception as e:  # noqa: BLE001  (TypeError, ValueError, VLLMValidationError: all refusals of args)
        raise ValueError(f"invalid engine arguments: {e}") from e
    return args


async def run_oracle(engine, prompt: str) -> dict:
    """Greedy one-token generation of ``prompt`` with top-5 logprobs, as an oracle dict."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1, logprobs=5, seed=0)
    final = None
    async for out in engine.generate(prompt, params, request_id=f"vllm-snapshot-oracle-{os.urandom(4).hex()}"):
        final = out
    if final is None:
        raise RuntimeError("oracle generation returned no output")
    cand = final.outputs[0]
    (tok,) = tuple(cand.token_ids)
    lps = cand.logprobs[0]
    lp = float(lps[tok].logprob)
    if not math.isfinite(lp):
        raise RuntimeError(f"oracle logprob is not finite: {lp}")
    top = sorted(lps.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))[:5]
    return {
        "prompt": prompt,
        "token_id": int(tok),
        "text": cand.text,
        "logprob": lp,
        "top_logprobs": [{"token_id": int(t), "logprob": float(v.logprob)} for t, v in top],
    }


def _device_kind() -> str:
    """``"cpu"`` or ``"cuda"``: vLLM's platform. Any other (ROCm, XPU, TPU, ...) raises
    RuntimeError: the GPU path here is CRIU's CUDA plugin and NVIDIA's checkpoint API only."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    raise RuntimeError(f"vLLM runs on {getattr(current_platform, 'device_name', None) or type(current_platform).__name__}; "
                       "vllm-snapshot supports CPU and NVIDIA CUDA engines only")


def wake_rpc(weights_file: bool, kind: str) -> str:
    """The worker method a level-2 wake calls to put the weights back: the weights file's
    fill (:data:`vllm_snapshot.engine.weights.FILL_RPC`) for a GPU engine made with one, else
    vLLM's ``reload_weights`` (from the model files, post-processed again). Pure."""
    if weights_file and kind == "cuda":
        from ..engine.weights import FILL_RPC

        return FILL_RPC
    return "reload_weights"


async def prepare_app(engine, args):
    """Build the OpenAI FastAPI app and its state before the dump, so that a restore only has
    to bind the socket and start uvicorn. Same calls as vLLM's ``build_and_serve``."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    # Import uvicorn's protocol, lifespan and loop modules now (Config.load() does), so they
    # are in the image and not imported after a restore.
    import uvicorn

    uvicorn.Config(app, log_level=args.uvicorn_log_level, log_config=None).load()
    return app


async def apply_frontend(engine, args, app, tokens: list[str]):
    """Apply the front-end options given at restore (:mod:`vllm_snapshot.engine.args`) to the
    create-time ``args``: vLLM's own parser (the one kept from create) parses ``tokens``; each
    option given replaces the create-time value; the OpenAI app is rebuilt with vLLM's
    ``build_app`` when an option it reads changed (API key, CORS, root path, ...), and request
    logging is switched on the engine client. Returns the app to serve. Raises SystemExit
    (argparse: bad value) or ValueError."""
    if not tokens:
        return app
    engine_args_rules.refuse_engine_options(tokens)
    given = set(engine_args_rules.values(tokens))  # which dests the tokens set (lexically, as the CLI checked)
    parser = _PARSER
    if parser is None:  # a snapshot from before the parser was kept
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-snapshot restore"))
    ns = parser.parse_args(["--model", args.model, *tokens])
    for dest in given:
        setattr(args, dest, getattr(ns, dest))
    if "enable_log_requests" in given and hasattr(engine, "log_requests"):
        engine.log_requests = bool(args.enable_log_requests)
    if given & engine_args_rules.APP_DESTS or app is None:
        app = await prepare_app(engine, args)
    return app


#: What a ``serve`` without ``drain_s`` (an older supervisor) drains for on SIGTERM (seconds).
DEFAULT_DRAIN_S = 30.0


#: After the second signal: how long a cancelled request's connection may take to send its
#: error response and close before it is aborted (seconds).
CUT_GRACE_S = 1.0


def _abort_connections(server) -> None:
    """Abort the transport of every connection ``server`` (uvicorn) still has open."""
    for conn in list(server.server_state.connections):
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.abort()


def install_drain(loop: asyncio.AbstractEventLoop, server, drain_s: float) -> None:
    """Make SIGTERM/SIGINT drain the uvicorn ``server`` instead of vLLM's default (which stops
    the engine client at once, ``shutdown_timeout`` 0: every request in flight is aborted and
    its client gets an empty reply).

    First signal: uvicorn's graceful shutdown (``server.should_exit``): the listening socket is
    closed (no new connection; the port is free for the next engine), idle keep-alive
    connections are closed, requests in flight run to completion for at most ``drain_s``
    seconds (``config.timeout_graceful_shutdown``; uvicorn cancels what is left then), and
    the engine client is shut down afterwards, with nothing left to abort. A second signal
    cuts the drain short: the requests still running are cancelled now (``stop
    --drain-timeout`` shorter than the engine's own bound sends it), and the connections still
    open :data:`CUT_GRACE_S` later are aborted (a client that stopped reading would hold the
    shutdown until ``drain_s``)."""
    server.config.timeout_graceful_shutdown = drain_s
    state = {"signals": 0}

    def say(line: str) -> None:
        """The line on stderr, best effort: stderr is the log file of a detached engine, and on a
        full filesystem the write raises ENOSPC -- raised here it ended the handler before
        ``should_exit``, so the engine never drained and `stop` had to SIGKILL it."""
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    def on_signal(signum: int) -> None:
        state["signals"] += 1
        busy = len(server.server_state.tasks)
        name = signal.Signals(signum).name  # a trial read "signal 15": named, as the supervisor names its own
        server.should_exit = True  # first: whatever the log line below meets
        if state["signals"] == 1:
            say(drain_line(name, busy, drain_s))
            return
        say(cut_line(name, busy))
        for task in list(server.server_state.tasks):
            task.cancel(msg="vllm-snapshot: stopped before the request finished")
        # a connection whose client does not read keeps its unsent bytes (and the graceful
        # shutdown waiting for it) forever: closed hard a second later
        loop.call_later(CUT_GRACE_S, _abort_connections, server)

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, on_signal, s)


async def serve(app, args, sock, host: str | None, port: int, drain_s: float = DEFAULT_DRAIN_S) -> None:
    """Serve ``app`` on the listening socket ``sock`` (bound to ``host:port`` by the supervisor
    in the host's network namespace) until SIGINT/SIGTERM: vLLM's ``setup_server`` checks
    without its bind, then its ``serve_http`` with the keyword arguments its
    ``build_and_serve`` passes (vllm 0.32 entrypoints/launchers/launcher.py; uvicorn serves on
    given sockets). A signal drains (:func:`install_drain`): in-flight requests finish within
    ``drain_s`` seconds, then this returns and the caller shuts the engine client down."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.launcher import serve_http, validate_api_server_args
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.utils.system_utils import set_ulimit

    args.host = host
    args.port = port
    validate_api_server_args(args)
    set_ulimit()
    h = f"[{host}]" if host and ":" in host else (host or "0.0.0.0")
    emit("binding", address=f"http://{h}:{port}")
    kwargs = {}
    log_config = get_uvicorn_log_config(args)
    if log_config is not None:
        kwargs["log_config"] = log_config
    loop = asyncio.get_running_loop()
    try:
        serving = loop.create_task(serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host, port=args.port,
            log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count, **kwargs))
        # serve_http sets app.state.server and installs its own SIGTERM/SIGINT handlers (abort
        # the engine client at once) before its first await: replace them once it got there
        while not serving.done() and getattr(app.state, "server", None) is None:
            await asyncio.sleep(0)
        if not serving.done():
            install_drain(loop, app.state.server, drain_s)
        shutdown = await serving
        await shutdown
    finally:
        sock.close()


async def run(spec: EngineSpec) -> int:
    loop = asyncio.get_running_loop()
    import contextlib
    import io

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = parse_engine_args(spec.model, list(spec.engine_args))
            # the same function `serve` uses, so the key recorded here is the one it computes
            normalized = normalize_args(list(spec.engine_args))
    except SystemExit as e:
        # argparse printed usage + "prog: error: REASON"; pass the reason on
        emit("error", kind="usage", message=f"invalid engine arguments: {argparse_reason(captured.getvalue())}")
        return int(e.code or 2)
    except ValueError as e:
        emit("error", kind="usage", message=str(e))
        return 2
    if spec.served_model_name and not getattr(args, "served_model_name", None):
        args.served_model_name = [spec.served_model_name]  # a Hugging Face id, served by its id
    try:
        kind = _device_kind()
    except RuntimeError as e:
        emit("error", kind="usage", message=str(e))
        return 2
    sleep_level = spec.sleep_level if kind == "cuda" else 0
    if spec.weights_file:
        from ..engine import weights as ew

        if kind == "cpu":
            os.environ[ew.ENV] = ew.MODE_MAP  # vLLM's children (spawned after this) map their weights
        else:
            # the worker writes its parameters into the weights file and keeps it open; the
            # level-2 wake copies them back from it (ew.FILL_RPC) instead of reloading the model
            if getattr(args, "worker_extension_cls", ""):
                emit("error", kind="usage", message="--worker-extension-cls cannot be combined with a weights file "
                     "on a GPU (the weights file's wake is a worker extension of its own); create with --weights in-image")
                return 2
            if sleep_level < 2:
                emit("error", kind="usage", message=f"a weights file on a GPU is the source of a level-2 wake; "
                     f"with --sleep-level {sleep_level} the weights are never discarded: create with --weights in-image "
                     "or --sleep-level 2")
                return 2
            os.environ[ew.ENV] = ew.MODE_WAKE
            args.worker_extension_cls = ew.EXTENSION
            ew.install(ew.MODE_WAKE)  # an EngineCore forked from here inherits it; a spawned one installs it itself
    if sleep_level:
        args.enable_sleep_mode = True

    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    q: asyncio.Queue = asyncio.Queue()
    app = None
    async with contextlib.AsyncExitStack() as stack:
        try:
            engine = await stack.enter_async_context(build_async_engine_client(args))
        except Exception as e:  # noqa: BLE001
            reason = engine_args_rules.config_refusal(e)  # a bad value, before any engine process started
            if reason is None:
                raise  # a runtime failure (out of memory, a crash): the engine's own error, exit 8
            traceback.print_exc()
            emit("error", kind="usage", message=f"invalid engine arguments: {reason}")
            return 2
        oracle = await run_oracle(engine, spec.oracle_prompt)
        # what the HTTP canary of every restore expects: the same request on a short prompt
        # (engine/protocol.py CANARY_PROMPT), so the restore's second forward pass is cheap
        canary = await run_oracle(engine, CANARY_PROMPT)
        import torch
        import vllm

        emit("initialized", oracle=oracle, canary=canary, info={
            "kind": kind, "vllm": vllm.__version__, "torch": torch.__version__,
            "served_model_name": (args.served_model_name or [args.model])[0],
            "normalized_args": normalized,
        })
        threading.Thread(target=_commands, args=(loop, q), daemon=True, name="control").start()
        while True:
            cmd = await q.get()
            if cmd is None or cmd.get("cmd") == "exit":
                return 0
            name = cmd.get("cmd")
            try:
                if name == "oracle":
                    emit("oracle", oracle=await run_oracle(engine, cmd.get("prompt") or spec.oracle_prompt))
                elif name == "sleep":
                    await engine.reset_prefix_cache()
                    await engine.sleep(level=int(cmd.get("level", sleep_level)))
                    emit("slept")
                elif name == "wake":
                    # Level 2 discards weights: wake the weights, reload them (from the weights
                    # file, else from the model path), then the KV cache, and drop prefix-cache
                    # entries computed before.
                    await engine.wake_up(tags=["weights"])
                    if sleep_level >= 2:
                        await engine.collective_rpc(wake_rpc(spec.weights_file, kind))
                    await engine.wake_up(tags=["kv_cache"])
                    await engine.reset_prefix_cache()
                    emit("woken")
                elif name == "prepare-dump":
                    import gc

                    set_parent_death_signal(0)  # CRIU would deliver it right after restore

                    if app is None:
                        app = await prepare_app(engine, args)

                    gc.collect()
                    # vLLM's server lifespan (freeze_gc_heap) runs a full gc.collect(2) before it
                    # answers: over this heap (~0.66 M objects) that took ~0.4 s of every
                    # restore's "http_ready". Frozen here, that collection after a restore only
                    # scans what was allocated since (vLLM freezes at the same point itself; a
                    # frozen object is never freed, as after vLLM's own freeze).
                    gc.freeze()
                    # the children (EngineCore, workers): gc, malloc_trim, zero KV pages out
                    from ..engine.prep import prepare_children, trim_root

                    for r in await loop.run_in_executor(None, prepare_children):
                        print(f"vllm-snapshot prepare-dump: {json.dumps(r)}", file=sys.stderr)
                    # and this process: its freed heap given back (the children trimmed theirs)
                    print(f"vllm-snapshot prepare-dump: {json.dumps(trim_root())}", file=sys.stderr)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    # what the code identity pins (vllm_snapshot.host.codeid): the distributions
                    # owning these modules, found on this sys.path
                    emit("dump-ready", modules=sorted({m.split(".", 1)[0] for m in list(sys.modules)}),
                         sys_path=list(sys.path))
                elif name == "attach":
                    # a restored tree dies with the restore that adopted it (a SIGKILLed
                    # restore must not leave an engine nobody knows about) until `serve`
                    set_parent_death_signal(signal.SIGKILL)
                    emit("attached")
                elif name == "serve":
                    from ..engine.net import receive_listener
                    from ..host.procs import mark_served

                    # named as served before the parent-death signal may go (--detach): from
                    # now on no reclaim anywhere on the host takes this tree for a leftover
                    mark_served()
                    # the supervisor bound host:port in the host's namespace; we get the socket
                    sock = receive_listener(str(cmd.get("handoff") or ""))
                    # foreground: the engine must not outlive its supervisor; --detach: it must
                    set_parent_death_signal(signal.SIGKILL if cmd.get("die_with_parent") else 0)
                    captured = io.StringIO()
                    try:
                        with contextlib.redirect_stderr(captured):
                            app = await apply_frontend(engine, args, app, list(cmd.get("frontend") or []))
                    except SystemExit:
                        sock.close()
                        emit("error", kind="usage",
                             message=f"invalid front-end options: {argparse_reason(captured.getvalue())}")
                        return 2
                    drain_s = cmd.get("drain_s")
                    await serve(app, args, sock, cmd.get("host"), int(cmd["port"]),
                                DEFAULT_DRAIN_S if drain_s is None else float(drain_s))
                    return 0
                else:
                    emit("error", kind="protocol", message=f"unknown command {name!r}")
            except Exception as e:  # noqa: BLE001 - report, the supervisor decides
                traceback.print_exc()
                emit("error", kind=name or "engine", message=f"{type(e).__name__}: {e}")
                if name == "serve":
                    return 1


def main() -> int:
    # CRIU refuses a tree whose session leader lives outside its PID namespace.
    try:
        os.setsid()
    except OSError:
        pass

    def _term(signum, frame):  # PID 1 of a namespace ignores SIGTERM unless handled
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    spec = EngineSpec.from_json(sys.argv[1])
    user = spec.user
    if os.getpid() == 1:  # our own PID + mount + network namespace (always, when launched by create)
        from ..engine.mounts import link_inductor_cache, make_private
        from ..engine.net import loopback_up

        try:
            make_private(link_inductor=user is None)
            loopback_up()
        except OSError as e:
            emit("error", kind="engine", message=str(e))
            return 1
    if user is not None:
        # the namespaces are set up: the rest of the tree (vLLM, the HTTP server) runs as the
        # engine user with no capability (vllm_snapshot/host/privilege.py), for good
        from ..host.privilege import drop_to

        try:
            drop_to(user.uid, user.gid, list(user.groups))
            set_parent_death_signal(signal.SIGKILL)  # the uid change cleared --kill-child's
            if os.getpid() == 1:
                link_inductor_cache()
        except OSError as e:
            emit("error", kind="engine", message=f"cannot run the engine as {user.name}: {e}")
            return 1
    try:
        # Plain asyncio, not uvloop: libuv >= 1.45 opens io_uring instances, which CRIU
        # cannot dump ("Unknown shit 600 (anon_inode:[io_uring])").
        return asyncio.run(run(spec))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        emit("error", kind="engine", message=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__mp_main__":
    # vLLM's children (spawned by multiprocessing) import this module under this name: their
    # hook for prepare-dump (see vllm_snapshot.engine.prep)
    from vllm_snapshot.engine.prep import install_child_hook

    install_child_hook()
    if os.environ.get("VLLM_SNAPSHOT_WEIGHTS"):  # create asked for a weights file (its value: the mode)
        from vllm_snapshot.engine.weights import install as _install_weights

        _install_weights(os.environ["VLLM_SNAPSHOT_WEIGHTS"])

if __name__ == "__main__":
    code = main()
    # The engine is shut down at this point. Skip interpreter finalization: with vLLM's and
    # torch's native threads still around, finalization of a restored engine was seen to
    # segfault (exit 139) after a clean shutdown, which would misreport the exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
