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

test: venv $(PROTO_OUT)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv $(PROTO_OUT)
	$(BIN)/python -m pytest -m "not slow and not e2e" $(PYTEST_ARGS)

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
