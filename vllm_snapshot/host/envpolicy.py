"""The engine's environment policy: which variables reach the engine tree (and so the snapshot).
Which names are secrets (:func:`is_secret_name`) and how engine args are redacted for the
manifest (:func:`redact_args`) are :mod:`vllm_snapshot.engine.args`'s rules, used here for the
environment. Pure; shared by the launch (:mod:`vllm_snapshot.supervise.supervisor`), the
snapshot key (:mod:`vllm_snapshot.store.snapkey`) and create's manifest."""

from __future__ import annotations

import os

# the secret names and the redaction of args are the engine-argument owner's rules
from ..engine.args import SECRET_MARKERS, is_secret_name, redact_args  # noqa: F401
from ..paths import ENGINE_TMPDIR

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
