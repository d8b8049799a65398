"""A fake engine root (run as a script: ``local_tools(engine_argv=(python, THIS_FILE))``) that speaks vllm-snapshot's engine protocol and claims to be a CUDA
engine, so the GPU create/restore sequencing (sleep rehearsal, wake before the oracle) runs
through real CRIU on a machine without a GPU. It prints ``CALL <cmd>`` for every command and
serves ``/health``, ``/calls`` (commands seen since the last restore-visible reset),
``/prompts`` (the prompts of the completions it answered) and ``/v1/completions`` (the oracle of
the prompt asked: another token for the canary's prompt) after ``serve``, on the listening
socket the supervisor hands over (like the real engine, it lives in a network namespace of its
own). It records the canary at ``initialized`` as the real engine root does. ``VLLM_FAKE_ORACLE_SHIFT`` (env) changes the logprob at every wake (a reload that produced
other weights). ``VLLM_FAKE_CUDA_CHILD=1`` (env) starts a child, like vLLM's EngineCore under
its non-CUDA API root, with a thread named ``fakecuda-rst``: the CUDA process of
tests/fakecuda's fake driver. ``VLLM_FAKE_START_S`` (env, seconds) delays ``initialized``, as a
real engine's load does; ``VLLM_FAKE_BALLAST_MB`` (env) holds that many MiB of written memory, so
that the dump and its checksums take as long as a small real engine's (tests/fake_cli.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from vllm_snapshot.entrypoints.engine_root import emit
from vllm_snapshot.engine.mounts import make_private
from vllm_snapshot.engine.net import loopback_up, receive_listener
from vllm_snapshot.engine.protocol import CANARY_PROMPT, decode
from vllm_snapshot.engine.spec import EngineSpec
from vllm_snapshot.host.procs import mark_served, set_parent_death_signal

CALLS: list[str] = []
PROMPTS: list[str] = []
STATE = {"logprob": -1.25, "awake": True}


def oracle(prompt: str) -> dict:
    # the canary's prompt gets another token: a canary that asked the wrong prompt differs
    tok, text = (43, " there") if prompt == CANARY_PROMPT else (42, " fake")
    return {"prompt": prompt, "token_id": tok, "text": text, "logprob": STATE["logprob"],
            "top_logprobs": [{"token_id": tok, "logprob": STATE["logprob"]}, {"token_id": 7, "logprob": -3.5}]}


def serve(spec: EngineSpec, sock, host: str, port: int) -> None:
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
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/calls":
                self._send(200, {"calls": CALLS})
            elif self.path == "/prompts":
                self._send(200, {"prompts": PROMPTS})
            else:
                self._send(404, {})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n) or b"{}")
            PROMPTS.append(req.get("prompt", ""))
            o = oracle(req.get("prompt", ""))
            self._send(200, {"choices": [{"text": o["text"], "token_ids": [o["token_id"]],
                                          "logprobs": {"token_logprobs": [o["logprob"]]}}]})

    srv = HTTPServer((host, port), H, bind_and_activate=False)  # on the supervisor's socket
    srv.socket.close()
    srv.socket = sock
    emit("binding", address=f"http://{host}:{port}")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    srv.shutdown()


CUDA_CHILD = r"""
import ctypes, threading, time
def restore_thread():
    ctypes.CDLL(None).prctl(15, b"fakecuda-rst", 0, 0, 0)  # PR_SET_NAME: the fake driver's marker
    threading.Event().wait()
threading.Thread(target=restore_thread, daemon=True).start()
while True:
    time.sleep(3600)
"""


def start_cuda_child() -> None:
    """The fake CUDA process (see the module docstring); returns once its thread is named."""
    import glob
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for comm in glob.glob(f"/proc/{child.pid}/task/*/comm"):
            try:
                if open(comm).read().strip() == "fakecuda-rst":
                    return
            except OSError:
                pass
        time.sleep(0.02)
    raise RuntimeError("the fake CUDA child did not start")


def main() -> int:
    os.setsid()
    spec = EngineSpec.from_json(sys.argv[1])  # as the real engine root reads it
    make_private()
    loopback_up()
    user = spec.user
    if user:  # as the real engine root does (vllm_snapshot/entrypoints/engine_root.py)
        from vllm_snapshot.host.privilege import drop_to

        drop_to(user.uid, user.gid, list(user.groups))
        set_parent_death_signal(signal.SIGKILL)
    if os.environ.get("VLLM_FAKE_CUDA_CHILD"):
        start_cuda_child()
    ballast = bytearray(b"\x5a") * (int(os.environ.get("VLLM_FAKE_BALLAST_MB", "0")) << 20)  # noqa: F841 - held
    time.sleep(float(os.environ.get("VLLM_FAKE_START_S", "0")))
    prompt = spec.oracle_prompt
    emit("initialized", oracle=oracle(prompt), canary=oracle(CANARY_PROMPT),
         info={"kind": "cuda", "vllm": "fake", "torch": "fake", "served_model_name": "fake",
               "normalized_args": {"raw": json.dumps(list(spec.engine_args))}})
    for line in sys.stdin:
        cmd = decode(line)
        if cmd is None:
            continue
        name = cmd["cmd"]
        CALLS.append(name)
        print(f"CALL {name}", flush=True)
        if name == "oracle":
            emit("oracle", oracle=oracle(cmd.get("prompt") or prompt))
        elif name == "sleep":
            STATE["awake"] = False
            emit("slept")
        elif name == "wake":
            STATE["awake"] = True
            STATE["logprob"] += float(os.environ.get("VLLM_FAKE_ORACLE_SHIFT", "0"))
            emit("woken")
        elif name == "prepare-dump":
            set_parent_death_signal(0)  # as the real engine: CRIU would deliver it after restore
            CALLS.clear()  # what the test reads after a restore starts here
            # the same fields as the real engine root: the code identity pins what it imported
            emit("dump-ready", modules=sorted({m.split(".", 1)[0] for m in list(sys.modules)}), sys_path=list(sys.path))
        elif name == "attach":
            set_parent_death_signal(signal.SIGKILL)
            emit("attached")
        elif name == "serve":
            mark_served()  # as the real engine root
            set_parent_death_signal(signal.SIGKILL if cmd.get("die_with_parent") else 0)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            serve(spec, receive_listener(cmd.get("handoff", "")), cmd["host"], int(cmd["port"]))
            return 0
        elif name == "exit":
            return 0
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)
