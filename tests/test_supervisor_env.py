"""The engine's environment (supervisor.scrubbed_env, is_secret_name) and the small pure helpers
of ops (redact_args, port_free). No engine is started."""

from __future__ import annotations

import socket

import pytest

from vllm_snapshot.host import ports
from vllm_snapshot.errors import BusyError
from vllm_snapshot.host.envpolicy import is_secret_name, redact_args, scrubbed_env

BASE = {
    "PATH": "/opt/bin:/usr/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "OMP_NUM_THREADS": "2",
    "CUDA_VISIBLE_DEVICES": "0",
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret2",
    "OPENAI_API_KEY": "sk-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "AWS_ACCESS_KEY_ID": "AKIA",
    "VLLM_API_KEY": "vllm-secret",
    "GITHUB_TOKEN": "ghp_x",
    "SOME_RANDOM_VAR": "x",
    "LD_PRELOAD": "/evil.so",
    "PYTHONPATH": "/somewhere",
    "HF_HUB_OFFLINE": "0",
    "HF_ENDPOINT": "https://example.invalid",
}


def test_scrubbed_env_drops_secrets_and_unknown_vars():
    env = scrubbed_env(dict(BASE))
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
              "AWS_ACCESS_KEY_ID", "VLLM_API_KEY", "GITHUB_TOKEN", "SOME_RANDOM_VAR", "LD_PRELOAD",
              "PYTHONPATH", "HF_ENDPOINT"):
        assert k not in env, k
    secrets = {v for k, v in BASE.items() if is_secret_name(k)}
    assert not secrets & set(env.values())


def test_scrubbed_env_keeps_allowed_names():
    env = scrubbed_env(dict(BASE))
    for k in ("PATH", "HOME", "LANG", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "OMP_NUM_THREADS",
              "CUDA_VISIBLE_DEVICES"):
        assert env[k] == BASE[k], k


def test_scrubbed_env_forces_offline_and_no_io_uring():
    env = scrubbed_env(dict(BASE))
    assert env["HF_HUB_OFFLINE"] == "1"  # even though the caller had 0
    assert env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["UV_USE_IO_URING"] == "0"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_scrubbed_env_keeps_the_driver_location_and_nvidia_settings():
    base = {**BASE, "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/usr/local/nvidia/lib",
            "NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
    env = scrubbed_env(base)
    for k in ("LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        assert env[k] == base[k], k
    assert "LD_PRELOAD" not in env  # the loader's other knob is still dropped
    assert "NVIDIA_API_KEY" not in scrubbed_env({"NVIDIA_API_KEY": "nvapi-x"})  # NGC key: a secret


def test_scrubbed_env_turns_usage_stats_off_whatever_the_caller_says():
    """vLLM's usage-stats thread opens NVML descriptors it never closes (GPU review 2, M1)."""
    for base in ({}, {"VLLM_NO_USAGE_STATS": "0", "DO_NOT_TRACK": "0"}):
        env = scrubbed_env(base, keep=("DO_NOT_TRACK",))
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


def test_offline_cannot_be_turned_off_even_with_keep():
    env = scrubbed_env({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"},
                       keep=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_scrubbed_env_keep_passes_a_named_secret_only():
    env = scrubbed_env(dict(BASE), keep=("HF_TOKEN",))
    assert env["HF_TOKEN"] == "hf_secret"
    assert "OPENAI_API_KEY" not in env and "HUGGING_FACE_HUB_TOKEN" not in env


def test_scrubbed_env_keep_of_an_absent_name_adds_nothing():
    env = scrubbed_env({"PATH": "/bin"}, keep=("HF_TOKEN",))
    assert "HF_TOKEN" not in env


def test_scrubbed_env_default_path_when_missing():
    env = scrubbed_env({})
    assert "/usr/bin" in env["PATH"].split(":")


def test_scrubbed_env_does_not_modify_its_input():
    base = dict(BASE)
    scrubbed_env(base)
    assert base == BASE


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "hf-token", "HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "AWS_SESSION_TOKEN", "api-key",
    "OPENAI_API_KEY", "VLLM_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "ssl-private-key",
    "GOOGLE_APPLICATION_CREDENTIALS", "MYAPIKEY", "AUTHTOKEN",
])
def test_is_secret_name_true(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "PATH", "max-model-len", "dtype", "served-model-name", "VLLM_CPU_KVCACHE_SPACE",
    # token counts and tokenizer settings are not secrets (real vLLM names)
    "tokenizer", "tokenizer-mode", "skip-tokenizer-init", "max-num-batched-tokens", "long-prefill-token-threshold",
    "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE", "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD",
    "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "VLLM_USE_FASTOKENS",
])
def test_is_secret_name_false(name):
    assert not is_secret_name(name)


def test_behaviour_vars_with_token_in_their_name_reach_the_engine():
    base = {"VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE": "128", "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD": "1024"}
    env = scrubbed_env(base)
    for k, v in base.items():
        assert env[k] == v


# ----------------------------------------------------------------------------- redact_args

def test_redact_args_separate_value():
    assert redact_args(["--api-key", "sk-123", "--max-model-len", "512"]) == [
        "--api-key", "<redacted>", "--max-model-len", "512"]


def test_redact_args_equals_value():
    assert redact_args(["--hf-token=hf_abc", "--dtype", "float32"]) == [
        "--hf-token=<redacted>", "--dtype", "float32"]


def test_redact_args_leaves_other_args_alone():
    args = ["--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny",
            "--tokenizer", "/models/tok", "--max-num-batched-tokens", "2048", "--enforce-eager"]
    assert redact_args(args) == args


def test_redact_args_does_not_modify_its_input_and_hides_every_secret():
    args = ["--api-key", "k1", "--hf-token", "t1", "--model-secret=s1"]
    out = redact_args(args)
    assert args == ["--api-key", "k1", "--hf-token", "t1", "--model-secret=s1"]
    assert not {"k1", "t1", "s1"} & set(out) and all("s1" not in a for a in out)


# ----------------------------------------------------------------------------- ports.port_free

def test_port_free_accepts_a_port_left_in_time_wait():
    # what a stopped engine leaves: its side of a closed connection in TIME_WAIT on the port;
    # restore must still bind it (SO_REUSEADDR), as vllm serve would
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT on `port`
    assert client.recv(1) == b""  # the FIN arrived
    client.close()
    srv.close()
    assert ports.port_free("127.0.0.1", port) is None
    ports.bind_listener("127.0.0.1", port).close()  # and restore's listener binds it right after


def test_port_free_refuses_a_listening_port_and_names_the_holder():
    import os

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        with pytest.raises(BusyError) as ei:
            ports.port_free("127.0.0.1", port)
        assert ei.value.exit_code == 9
        assert f"127.0.0.1:{port}" in ei.value.message
        if os.geteuid() == 0:  # psutil sees every socket's owner only as root
            assert f"PID {os.getpid()}" in ei.value.message
    finally:
        s.close()


def test_redact_args_catches_abbreviations_and_every_value():
    assert redact_args(["--hf-tok", "hf_x", "--dtype", "float32"]) == ["--hf-tok", "<redacted>", "--dtype", "float32"]
    assert redact_args(["--api-k=sk1"]) == ["--api-k=<redacted>"]
    assert redact_args(["--api-key", "k1", "k2", "--max-model-len", "512"]) == [
        "--api-key", "<redacted>", "<redacted>", "--max-model-len", "512"]
    assert redact_args(["--ma", "512"]) == ["--ma", "512"]  # too short to be a secret's prefix


def test_kill_reports_survivors(monkeypatch):
    import io

    from vllm_snapshot.supervise import supervisor
    from vllm_snapshot.errors import EngineError

    class P:
        pid = 4242

        def kill(self):
            pass

    h = supervisor.EngineHandle(4242, io.StringIO(), -1, supervisor.LogPump(-1, []), None)
    monkeypatch.setattr(h, "tree", lambda: [P()])
    monkeypatch.setattr(supervisor, "wait_gone", lambda procs, t: [4242])
    monkeypatch.setattr(h, "reap", lambda block=True: None)
    with pytest.raises(EngineError, match="survived SIGKILL: PIDs \\[4242\\]"):
        h.kill()


def test_engine_runs_the_supervisors_own_package():
    """The engine root imports vllm_snapshot from the same place as the supervisor speaking the
    protocol with it (not from an editable install pointing at another checkout)."""
    from pathlib import Path

    import vllm_snapshot
    from vllm_snapshot.supervise.supervisor import engine_import_env

    here = str(Path(vllm_snapshot.__file__).resolve().parent.parent)
    assert engine_import_env({"PATH": "/bin"}) == {"PATH": "/bin", "PYTHONPATH": here}
    got = engine_import_env({"PYTHONPATH": f"/opt/x:{here}:/opt/y"})["PYTHONPATH"]
    assert got == f"{here}:/opt/x:/opt/y"  # first, once; the kept entries stay in order
