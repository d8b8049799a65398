"""Operations: sequencing only. Every side effect goes through
:class:`vllm_snapshot.effects.tools.Tools`, one role each (``tools=None`` means
:func:`~vllm_snapshot.effects.tools.local_tools`), so the
step order is unit-tested with a fake (``tests/test_ops_order.py``).

* :mod:`.create` -- create: start the engine, oracle, (sleep rehearsal), inventory, dump, publish.
* :mod:`.restore` -- validate (every check before CRIU), restore, oracle, bind, canary; serve
  in the foreground.
* :mod:`.serve` -- serve MODEL [args]: the snapshot of this key restored, or built then restored.
* :mod:`.manage` -- describe (list rows), delete, prune, status, stop.
* :mod:`.switch` -- switch: the target validated, then a hand-over of the port (or stop, restore, rollback).
"""

from .cleanup import run_cleanups
from .create import CreateRequest, check_cpu_kv_cache, create
from .manage import delete, describe, list_snapshots, parse_duration, prune, status, stop_engines
from .restore import RestoreRequest, restore, serve_foreground, validate, verify
from .serve import ServeRequest, serve, switch_model
from .switch import switch

__all__ = ["CreateRequest", "RestoreRequest", "check_cpu_kv_cache", "create", "delete", "describe", "list_snapshots",
           "parse_duration", "prune", "restore", "run_cleanups", "serve", "serve_foreground", "ServeRequest", "status", "switch_model",
           "stop_engines", "switch", "validate", "verify"]
