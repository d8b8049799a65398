"""The commands of the ``vllm-snapshot`` app (:mod:`vllm_snapshot.cli.app`), by job; each module
registers its commands on :data:`vllm_snapshot.cli.common.app` when imported."""
