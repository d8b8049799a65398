"""CRIU, split by job (as runc keeps ``criu_opts_linux.go`` apart from ``criu_linux.go``):

* :mod:`.options` -- frozen dump/restore options and the pure code that fills CRIU's RPC
  message from them;
* :mod:`.find` -- the binary, its version, the CUDA plugin of the same build, CRIU's config
  files, the environment of a CUDA run;
* :mod:`.logs` -- log excerpts, known failures in words, the CUDA run's log checks, kept logs;
* :mod:`.runner` -- :class:`Criu`: one ``criu swrk`` per call, spawned here with its own
  environment and spoken to in CRIU's RPC messages over a socket pair; the watchdog;
* :mod:`.images` -- reading what the dumped tree held from CRIU's images.

The names below are the package's face: callers write ``criu.find_criu()``, ``criu.Criu``.
"""

from .find import (CONFIG_FILES, CUDA_PLUGIN, MIN_VERSION, SYSTEM_PLUGIN_DIRS, check_config_libdir,  # noqa: F401
                   config_libdirs, criu_version, cuda_env, find_criu, find_cuda_plugin, paired, parse_version,
                   plugin_candidates, version_ok)
from .images import caps_missing  # noqa: F401
from .logs import BENIGN_CUDA_ERROR, check_cuda_log, check_cuda_run, explain, keep_log, log_excerpt  # noqa: F401
from .options import (CRIU_DEFAULT_TIMEOUT_S, DUMP_LOG, FREEZE_MARGIN_S, FREEZE_TIMEOUT_ENV,  # noqa: F401
                      HELPER_RUN_S, LOG_LEVEL, NETWORK_LOCK_ISOLATED, RESTORE_LOG, SHARED_FLAGS, DumpOptions,
                      RestoreOptions, apply_flags, check_flags, dump_argv, dump_rpc, freeze_timeout, restore_rpc)
from .runner import (BEFORE_MEMORY_NOTIFY, DEFAULT_TIMEOUT_S, RUID_WRAPPER, Criu, RpcFailed, Swrk,  # noqa: F401
                     dump_real_ids, env_timeout, own_caps_setpriv, restore_notified)
