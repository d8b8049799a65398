"""Programs of the package that run as processes of their own (as vLLM keeps its programs in
``vllm/entrypoints/`` and its libraries in ``vllm/engine/``): :mod:`.engine_root`, the engine
root that runs inside the snapshotted tree (``python -m vllm_snapshot.entrypoints.engine_root``).
Nothing in the package imports them; they import the libraries below them."""
