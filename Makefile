# The two commands of README.md: `make demo` (set up what is missing, run the main job) and
# `make test` (set up, run the whole test suite, CRIU + real vLLM integration tests included).
CACHE ?= /var/cache/vllm-snapshot
VENV  := $(CACHE)/venv
export VLLM_SNAPSHOT_CACHE := $(CACHE)

.PHONY: setup demo test unit
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/vllm-snapshot demo

test: setup
	$(VENV)/bin/python -m pytest tests

unit: setup
	$(VENV)/bin/python -m pytest tests -m "not integration and not system"
