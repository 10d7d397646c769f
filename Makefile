# Two commands do all the setup: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install model serve test lint format bench experiment bench-offline bench-serving bench-routing bench-forward bench-structured bench-lora soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build on these machines (a plain `torch` pulls a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/python -m batcher.model_files

# Ctrl-C stops the app and the local Ray cluster `serve run` started (tests/test_make_serve.py).
SERVE_CONFIG ?= serve_config.yaml
serve: model
	$(BIN)/serve run $(SERVE_CONFIG)

# Two pytest workers: the tests on the session's Serve cluster run in one (tests/conftest.py groups
# them), the rest beside them; TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: model
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# ruff: lint and format check (CI runs it before the tests); `make format` rewrites in place.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Load-test a running server: make bench BENCH_URL=http://127.0.0.1:8000 BENCH_ARGS="--request-rate 1,2,4"
BENCH_URL ?= http://127.0.0.1:8000
BENCH_ARGS ?=
bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.bench --base-url $(BENCH_URL) $(BENCH_ARGS)

# This stack against llama.cpp's server, one user and a burst of 64 (run it alone: docs/load_tests.md).
FORWARD_ARGS ?=
bench-forward: model
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.forward_bench $(FORWARD_ARGS)

experiment: model
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.experiment

bench-offline: model
	$(BIN)/python -m load_tests.offline

bench-serving: model
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.serving

# What structured outputs cost a batch: 0%, 20%, 100% of requests constrained (docs/structured_outputs.md).
bench-structured: model
	$(BIN)/python -m load_tests.structured_bench

# Multi-LoRA: a batch's step with 8 adapters vs the base; a multiplexed fleet vs one deployment per adapter.
bench-lora: model
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.lora_step_bench
	$(BIN)/python -m load_tests.lora_fleet_bench

bench-routing: model
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m load_tests.router_micro
	$(BIN)/python -m load_tests.eviction_micro --ray --json results/eviction_micro.json
	$(BIN)/python -m load_tests.exchange_micro --json results/exchange_micro.json
	$(BIN)/python -m load_tests.routing
	$(BIN)/python -m load_tests.routing --replicas 4 --workloads trace --json results/routing_trace.json

# Mixed traffic against its own local app: make soak SOAK_ARGS="--minutes 10 --rate 1" (--help for the rest)
SOAK_ARGS ?= --minutes 10 --rate 1
soak: model
	$(BIN)/python -m load_tests.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV)
