# Two entry points do all the set-up on a fresh machine: `make test` and `make bench`.
# The venv's Python: the one requires-python admits (the CPU torch wheel exists for 3.11).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint format typecheck bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints-dev.txt
	$(PIP) install -q -c constraints-dev.txt torch==2.13.0
	$(PIP) install -q -c constraints-dev.txt -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

test: lint typecheck
	$(PY) -m pytest -q --timeout=300 $(PYTEST_ARGS)

# ruff's rules and line length are in pyproject.toml; `make format` applies what `lint` checks.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/bench.py --update-readme $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
