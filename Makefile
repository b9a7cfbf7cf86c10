# The two commands of the README: `make run` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UPSTREAM ?= http://127.0.0.1:8080/v1
HOST ?= 127.0.0.1
PORT ?= 4141

.PHONY: run test lint bench clean

# `make run` installs the proxy alone; `make test` adds the test and bench extras (mini-swe-agent brings pandas,
# which sqlite-utils imports when present: about 120 MB the proxy itself does not need).
$(BIN)/ctxproxy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.extras: $(BIN)/ctxproxy
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

run: $(BIN)/ctxproxy
	$(BIN)/ctxproxy serve --upstream $(UPSTREAM) --host $(HOST) --port $(PORT)

# The core's and the store's own tests (unit, property, in-process): `make test` runs them first under the coverage
# gate ([tool.coverage] in pyproject.toml), then the rest untraced. On CPython 3.11 a tracer slows every line it
# sees, measured or not: the whole suite under it took 303 s instead of 184 s; these alone reach the same coverage.
CORE_TESTS := $(addprefix tests/test_,$(addsuffix .py,project rewriting fenced stubs tokens id_tokens checked_since primed arguments hashing \
	templates trajectories unknown_results journal memory_journal recovery retention failures context_tools fenced_tools \
	folds mirror_writes prefix_index shared_work store_postgres locks forked journal_size prefix arrival new_runs checkpoints \
	writer))

test: $(VENV)/.extras
	scripts/test-deps
	scripts/real-model
	$(BIN)/ruff check ctxproxy proxy store config tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest $(CORE_TESTS) --cov
	$(BIN)/pytest $(addprefix --ignore=,$(CORE_TESTS))

lint: $(VENV)/.extras
	$(BIN)/ruff check ctxproxy proxy store config tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: $(VENV)/.extras
	$(BIN)/python bench/latency.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage
