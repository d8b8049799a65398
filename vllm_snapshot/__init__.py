"""vllm-snapshot: checkpoint an initialized vLLM engine with CRIU and restore it safely."""

__version__ = "0.1.0"
