# The two commands of README.md: `make demo` (set up what is missing, run the main job) and
# `make test` (set up, run the whole test suite, CRIU + real vLLM integration tests included).
CACHE ?= /var/cache/vllm-snapshot
VENV  := $(CACHE)/venv
export VLLM_SNAPSHOT_CACHE := $(CACHE)
# extra pytest arguments, e.g. `make test PYTEST_ARGS=--durations=40` (.ci/run does)
PYTEST_ARGS ?=

.PHONY: setup demo test unit
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/vllm-snapshot demo

# two pytest-xdist workers, each taking the next test when it is free (docs/testing.md "Durations")
test: setup
	$(VENV)/bin/python -m pytest tests -n 2 --dist load $(PYTEST_ARGS)

unit: setup
	$(VENV)/bin/python -m pytest tests -m "not integration and not system" $(PYTEST_ARGS)
