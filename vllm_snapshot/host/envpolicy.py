"""The engine's environment policy: which variables reach the engine tree (and so the snapshot),
which names are secrets, and how engine args are redacted for the manifest. Pure; shared by the
launch (:mod:`vllm_snapshot.supervise.supervisor`), the snapshot key
(:mod:`vllm_snapshot.store.snapkey`) and create's manifest."""

from __future__ import annotations

import os

from ..engine.mounts import ENGINE_TMPDIR

#: Environment variables passed to the engine (everything else is dropped: tokens, keys,
#: cloud credentials never enter the engine's memory, hence never the snapshot).
#: ``LD_LIBRARY_PATH`` and ``NVIDIA_*`` are kept so the engine finds the NVIDIA driver where
#: ``vllm serve`` would (GKE-style hosts: ``/usr/local/nvidia/lib64`` found only through it);
#: its directories are needed paths of the engine's mount namespace
#: (:func:`vllm_snapshot.engine.mounts.driver_paths`) and part of the snapshot key.
ENV_ALLOW_EXACT = frozenset({"PATH", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR", "USER", "LOGNAME",
                             "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES",
                             "VLLM_SNAPSHOT_CACHE", "LD_LIBRARY_PATH"})
ENV_ALLOW_PREFIX = ("VLLM_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "NCCL_", "CUDA_", "LC_", "NVIDIA_")
#: Set in every engine environment, whatever the caller's: vLLM's usage-stats thread (on by
#: default) calls NVML through torch and never shuts it down, leaving ``/dev/nvidia*``
#: descriptors without a CUDA context in the tree (CRIU's CUDA plugin skips such a process and
#: the dump fails on the device, or create counts every GPU as used); it would also try to
#: reach the network, which the engine's namespace does not have.
ENV_FORCED = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
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


#: ``vllm serve`` flags that hold secrets; argparse (vLLM keeps ``allow_abbrev``) also accepts
#: any unambiguous prefix of them, e.g. ``--hf-tok``.
SECRET_FLAGS = ("--api-key", "--hf-token", "--ssl-keyfile")


def _secret_flag(flag: str) -> bool:
    name = flag[2:]
    if is_secret_name(name):
        return True
    return len(flag) >= 5 and any(s.startswith(flag) for s in SECRET_FLAGS)


def redact_args(args: list[str]) -> list[str]:
    """Engine args with values of secret-looking flags (``--api-key X``, ``--hf-token=X``,
    abbreviations such as ``--hf-tok X``, and every value of a multi-value flag such as
    ``--api-key k1 k2``) replaced by ``<redacted>`` (rule: :func:`is_secret_name` and
    :data:`SECRET_FLAGS`)."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next and not a.startswith("-"):
            out.append("<redacted>")
            continue  # argparse nargs="+": every following value belongs to the flag
        hide_next = False
        if a.startswith("--") and _secret_flag(a.split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=<redacted>")
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(a)
    return out


def scrubbed_env(base: dict[str, str], keep: tuple[str, ...] = (), user=None) -> dict[str, str]:
    """The engine's environment: allow-listed names from ``base``, secrets dropped unless named
    in ``keep``, plus ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` (never download) and
    :data:`ENV_FORCED` (no usage stats: no NVML descriptors left open). With
    ``user`` (a :class:`vllm_snapshot.host.privilege.User`, the engine user) HOME, USER and LOGNAME
    are that user's, so vLLM's and torch's caches under ``~/.cache`` are the user's own."""
    env = {}
    for k, v in base.items():
        allowed = k in ENV_ALLOW_EXACT or k.startswith(ENV_ALLOW_PREFIX)
        if (allowed and not is_secret_name(k)) or k in keep:
            env[k] = v
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.update(ENV_FORCED)
    env["PYTHONUNBUFFERED"] = "1"
    env["TMPDIR"] = ENGINE_TMPDIR  # a private tmpfs inside the engine's namespace
    env["UV_USE_IO_URING"] = "0"  # libuv (uvloop/uvicorn): no io_uring, CRIU cannot dump it
    # torch.distributed (gloo, world size 1) listens on the hostname's address; keep it on
    # loopback so the dumped tree holds no non-loopback listener.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # CRIU cannot checkpoint RDMA verbs: keep NCCL off InfiniBand (vLLM's own snapshot does too)
    env.setdefault("NCCL_IB_DISABLE", "1")
    # torch inductor's cache defaults to /tmp, which is the namespace's private tmpfs: its
    # ~150 MB precompiled header would be re-made at every create and tarred into every image.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(env.get("HOME", "/root"), ".cache", "vllm-snapshot", "torchinductor"))
    return env
