"""``python tests/fake_cli.py ARGS``: the real ``vllm-snapshot ARGS`` command line -- its signal
handlers, progress lines, cleanup and exit codes -- whose ``create`` launches the protocol-speaking
fake engine (tests/fake_engine.py) instead of vLLM, with the fake GPU side of
tests/test_gpu_sequencing.py (the fake CUDA driver behind CRIU's real CUDA plugin). CRIU, the
engine supervisor, the cgroups, the staging and the store are the real ones: a create that is
interrupted or killed here leaves behind what a real one would, in a few seconds instead of a
vLLM cold start. :func:`fake_env` is the environment it needs."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FAKECUDA = TESTS / "fakecuda"
#: The command line to run it with: ``[*FAKE_CLI, "create", ...]``.
FAKE_CLI = (sys.executable, str(Path(__file__).resolve()))


def fake_env(base: dict[str, str], scratch: Path) -> dict[str, str]:
    """``base`` plus what the fake engine and the fake CUDA driver need (as the ``fake_cuda`` and
    ``fake_tools`` fixtures of tests/test_gpu_sequencing.py set them), with the driver's state
    and CRIU helper cache under ``scratch`` (a directory made here)."""
    from vllm_snapshot.checkpoint import criu

    (scratch / "fakecuda").mkdir(parents=True, exist_ok=True)
    return {**base, "FAKE_CUDA_DIR": str(scratch / "fakecuda"),
            "PYTHONPATH": f"{FAKECUDA}:{TESTS.parent}:{base.get('PYTHONPATH', '')}",
            "CRIU_FAULT": "138",  # FI_PLUGIN_CUDA_FORCE_ENABLE: CRIU's CUDA plugin runs without a GPU
            "VLLM_FAKE_CUDA_CHILD": "1", "VLLM_SNAPSHOT_CRIU": criu.find_criu(),
            "VLLM_SNAPSHOT_CACHE": str(scratch / "cache"),
            "VLLM_CPU_KVCACHE_SPACE": "1"}  # the fake ignores engine args; this satisfies create's CPU check


def main() -> int:
    """Run the command line of ``sys.argv[1:]`` with the fake engine behind ``create``; returns
    its exit code."""
    sys.path.insert(0, str(TESTS))
    from test_gpu_sequencing import FAKE_ENGINE, FakeGpuCheckpoint, FakeGpuHost

    from vllm_snapshot.cli.app import main as cli_main
    from vllm_snapshot.effects.tools import local_tools

    def fake_tools():
        t = local_tools(engine_argv=FAKE_ENGINE)
        return dataclasses.replace(t, checkpoint=FakeGpuCheckpoint(t.checkpoint.criu), host=FakeGpuHost(t.host.criu))

    # what the create command calls without tools (the module: the package's attribute
    # ``vllm_snapshot.ops.create`` is the function)
    importlib.import_module("vllm_snapshot.ops.create").local_tools = fake_tools
    sys.argv[0] = "vllm-snapshot"
    return cli_main()  # argv None: the command line's own signal handlers, as `vllm-snapshot`

if __name__ == "__main__":
    sys.exit(main())
