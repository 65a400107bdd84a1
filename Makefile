# loraserve — the commands a newcomer needs. Every target creates or refreshes .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/v1/*.proto)
PROTO_OUT := protos/v1/inference_pb2.py

.PHONY: venv protos demo test test-fast lint format bench clean

# (Re)install when pyproject.toml changes or the venv is missing.
$(STAMP): pyproject.toml $(wildcard */__init__.py)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
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
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Tests marked `exclusive` (health-check latencies under hostile traffic) run alone after the rest: next to
# another test process on a 2-core machine their p99 measures that process, not the server. Exit code 5
# (no test selected, e.g. PYTEST_ARGS naming one file) is no failure for either run.
test: venv $(PROTO_OUT)
	$(BIN)/python -m pytest $(XDIST) -m "not exclusive" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m exclusive $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: venv $(PROTO_OUT)
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not e2e" $(PYTEST_ARGS)

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
