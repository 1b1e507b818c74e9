# Two entry points do all the set-up on a fresh machine: `make test` and `make bench`.
# The venv's Python: the one requires-python admits (the CPU torch wheel exists for 3.11).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint format typecheck bench asan clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The editable install builds the C extension in place, warnings as errors (setup.py).
$(STAMP): $(PY) pyproject.toml constraints-dev.txt setup.py shmreduce/_native.c
	$(PIP) install -q -c constraints-dev.txt torch==2.13.0
	SHMREDUCE_STRICT_BUILD=1 $(PIP) install -q -c constraints-dev.txt -e '.[test,bench]'
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

# The whole suite once with the extension built under AddressSanitizer (not part of
# `make test`: about twice as slow), then the normal build again. Children and the
# broker inherit the preloaded runtime; leak reports are off (CPython's and torch's
# own allocations at exit are not ours to judge). libstdc++ is preloaded too: ASan's
# __cxa_throw interceptor must find the real one before torch throws its first C++
# exception (else "CHECK failed" and an abort, in torch, not in our code).
ASAN_LIB = $(shell $(CC) -print-file-name=libasan.so) $(shell $(CC) -print-file-name=libstdc++.so.6)
asan: $(STAMP)
	SHMREDUCE_ASAN=1 SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 LD_PRELOAD="$(ASAN_LIB)" $(PY) -m pytest -q --timeout=600 $(PYTEST_ARGS); \
	status=$$?; SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force; exit $$status

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache shmreduce/*.so
