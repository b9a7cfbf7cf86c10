# The two commands of the README: `make run` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UPSTREAM ?= http://127.0.0.1:8080/v1
HOST ?= 127.0.0.1
PORT ?= 4141

.PHONY: run test lint bench clean

$(BIN)/ctxproxy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

run: $(BIN)/ctxproxy
	$(BIN)/ctxproxy serve --upstream $(UPSTREAM) --host $(HOST) --port $(PORT)

test: $(BIN)/ctxproxy
	scripts/test-deps
	scripts/real-model
	$(BIN)/ruff check proxy store config tests bench
	$(BIN)/mypy
	$(BIN)/pytest

lint: $(BIN)/ctxproxy
	$(BIN)/ruff check proxy store config tests bench
	$(BIN)/mypy

bench: $(BIN)/ctxproxy
	$(BIN)/python bench/latency.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
