# loraserve — the commands a newcomer needs. Every target creates or refreshes .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/v1/*.proto)
PROTO_OUT := protos/v1/inference_pb2.py

.PHONY: venv protos demo test test-fast test-tpu bench-tpu wheelhouse lint format bench clean

# Python writes bytecode for what these commands import, whatever the shell says: some images set
# PYTHONDONTWRITEBYTECODE, and then every process compiles every module it imports again (the tests start
# servers, CLIs and benchmarks as processes; the repository's own modules alone cost ~0.5 s a start). Each
# module is compiled once, by the first process that imports it, so nothing is compiled ahead: pip's
# --no-compile and no compileall (the few thousand of the venv's 22k files that anything imports, not all of
# them: compileall took 47 s on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

# (Re)install when pyproject.toml changes or the venv is missing.
$(STAMP): pyproject.toml $(wildcard */__init__.py)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

$(PROTO_OUT): $(PROTO_SRC) protos/build.py $(STAMP)
	$(BIN)/python -m loraserve.protos.build

protos: venv
	$(BIN)/python -m loraserve.protos.build

demo: venv $(PROTO_OUT)
	$(BIN)/loraserve demo

# Test files are spread over TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process so its
# module fixtures are built once); they share one JAX compilation cache. TEST_WORKERS=0 runs in-process.
# Three on the 2-core machines: many tests wait on servers and subprocesses, and the third process fills those
# waits (2026-12-08, a 2-core EPYC: 896 s with two, 733 s with three, the same 1850 tests passing).
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Tests marked `exclusive` (health-check latencies under hostile traffic) run alone after the rest: next to
# another test process on a 2-core machine their p99 measures that process, not the server. That run reads
# only the files that mark tests so (found by grep, so a new one needs no list; collecting the whole suite
# again would cost ~12 s), or PYTEST_ARGS when given. Exit code 5 (no test selected, e.g. PYTEST_ARGS naming
# one file) is no failure for either run.
EXCLUSIVE_FILES = $(shell grep -rlE --include='test_*.py' 'mark\.exclusive\b' tests)
test: venv $(PROTO_OUT)
	$(BIN)/python -m pytest $(XDIST) -m "not exclusive" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m exclusive $(or $(PYTEST_ARGS),$(EXCLUSIVE_FILES)) || [ $$? -eq 5 ]

test-fast: venv $(PROTO_OUT)
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not e2e" $(PYTEST_ARGS)

# On a TPU VM: the suite's TPU selection in one process (one process at a time holds a chip), against loraserve
# as installed in $(PYTHON) (pip install '.[tpu,registry,demo]' pytest-timeout hypothesis; docs/tpu.md), not
# this venv. The selection and why it runs from outside the checkout: tests/tpu.sh.
test-tpu:
	PYTHON=$(PYTHON) bash tests/tpu.sh $(PYTEST_ARGS)

# On a TPU VM: the TPU benchmark set in one command of at most ~7.5 minutes, merged into $(OUT)/tpu-bench.json
# (OUT: default ./device-out; TPU_BENCH_* choose the sub-steps: bench/tpu_session.sh, docs/tpu.md).
bench-tpu:
	PYTHON=$(PYTHON) bash bench/tpu_session.sh bench

# loraserve's wheel and every wheel it needs, for hosts that reach no package index (docs/tpu.md): install
# there with pip install --no-index --find-links $(WHEELHOUSE) 'loraserve[$(WHEELHOUSE_EXTRAS)]'.
# WHEELHOUSE_ARGS: more deploy/wheelhouse.py options (--python, --platform, --skip what the host has, --with).
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_EXTRAS ?= tpu,registry
wheelhouse: venv $(PROTO_OUT)
	$(BIN)/python deploy/wheelhouse.py --out $(WHEELHOUSE) --extras $(WHEELHOUSE_EXTRAS) $(WHEELHOUSE_ARGS)

lint: venv $(PROTO_OUT)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: venv $(PROTO_OUT)
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis protos/v1/*_pb2*.py protos/v1/*_pb2.pyi protos/v1/__init__.py
