# Two entry points do all the set-up on a fresh machine: `make test` and `make bench`.
# The venv's Python: requires-python admits 3.10 and newer (3.10 to 3.13 are built and
# tested), but the one CPU torch wheel on the dev and CI machines (constraints-dev.txt) is for 3.11. The others: `make pythons`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The torch the venv gets, and the pins it is installed under. `make suite-torch` sets both
# for its own venv; everything else runs on the pinned 2.13.0 CPU wheel.
TORCH ?= 2.13.0
CONSTRAINTS ?= constraints-dev.txt

.PHONY: install test lint format typecheck pythons suite-python suite-torch install-check gpu-check bench bench-chart bench-ddp asan tsan debug stress clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The editable install builds the C extension in place, warnings as errors (setup.py).
$(STAMP): $(PY) pyproject.toml constraints-dev.txt setup.py $(wildcard shmreduce/_native/*.c shmreduce/_native/*.h)
	$(PIP) install -q -c $(CONSTRAINTS) torch==$(TORCH)
	SHMREDUCE_STRICT_BUILD=1 $(PIP) install -q -c $(CONSTRAINTS) -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

test: lint typecheck
	$(PY) -m pytest -q --timeout=300 --durations=15 $(PYTEST_ARGS)

# ruff's rules and line length are in pyproject.toml; `make format` applies what `lint` checks.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# mypy checks as Python 3.10, the lowest declared (pyproject.toml); `make pythons` adds 3.13.
typecheck: $(STAMP)
	$(PY) -m mypy

# Every Python declared, without torch (not part of `make test`: 2 to 3 minutes, most of
# it pip): mypy as 3.13, the highest declared (3.10 is `make typecheck`), then per
# interpreter a throwaway venv that builds the extension warning-free (`pip install .`),
# imports the package and runs the tests that need no torch (.ci/pythons says which).
# PYTHONS=3.12 picks some; an interpreter is python3.X on PATH, else pyenv's.
PYTHONS ?= 3.10 3.11 3.12 3.13
pythons: $(STAMP)
	$(PY) -m mypy --python-version 3.13
	.ci/pythons $(PYTHONS)

# The whole of `make test` on another Python, in its own venv .venv-3.X (not part of
# `make test`). torch 2.13.0 comes from PyPI there: on Linux x86_64 the CUDA build, about
# 2.6 GB to download and 4.7 GB installed (docs/compatibility.md).
SUITE_PYTHON ?= 3.12
suite-python:
	$(MAKE) test PYTHON="$$(.ci/pythons --which $(SUITE_PYTHON))" VENV=.venv-$(SUITE_PYTHON)

# The whole of `make test` against another torch release, in its own venv .venv-torch-X
# (not part of `make test`): TORCH=2.14.1 picks it, pip finds it as it finds 2.13.0 (a
# wheel on local disk or the registry; on Linux x86_64 PyPI's build is the CUDA one, which
# runs on the CPU: 2.14.1 is about 5.4 GB installed). The other pins of constraints-dev.txt
# stay. tests/test_torch_api.py fails first, naming the wrapper, if a private API changed
# (docs/compatibility.md).
suite-torch:
	test -x .venv-torch-$(TORCH)/bin/python || $(PYTHON) -m venv .venv-torch-$(TORCH)
	grep -v '^torch==' constraints-dev.txt > .venv-torch-$(TORCH)/constraints.txt
	$(MAKE) test VENV=.venv-torch-$(TORCH) TORCH=$(TORCH) CONSTRAINTS=.venv-torch-$(TORCH)/constraints.txt

# `pip install .` beside that venv's torch changes no installed package (needs a package
# index for pip's isolated build; not part of `make test`). The venv is left as it is.
install-check:
	.ci/install_keeps_torch.sh .venv-torch-$(TORCH)

# The GPU check, on a GPU machine as it comes (often cut off from package indexes): its own
# python3 with torch, pytest, hypothesis and cloudpickle, the extension built in place, no
# venv and no install; then the suite's CUDA tests. Without CUDA every test skips, saying so.
gpu-check:
	python3 setup.py -q build_ext --inplace
	python3 -m pytest -q tests/gpu
	python3 -m pytest -q tests/test_semantics.py -k cuda

bench: $(STAMP)
	$(PY) benchmarks/bench.py --update-readme $(BENCH_ARGS)

# Re-renders the benchmark tables (README's summary, docs/benchmarks.md's whole table) and
# the chart from the stored results (benchmarks/results/results.json), measuring nothing:
# after a change to how they are drawn, or to carry them onto rewritten pages.
bench-chart: $(STAMP)
	$(PY) benchmarks/bench.py --from-results benchmarks/results/results.json --update-readme

# The native core's tests once with its assert()s of internal invariants compiled in
# (SHMREDUCE_DEBUG_BUILD=1: no -DNDEBUG; not part of `make test`), then the normal build
# again; the status is the tests'.
DEBUG_TESTS ?= tests/test_native.py tests/test_bad_input.py tests/test_semantics.py tests/test_thread_races.py tests/test_exact_lifetimes.py
debug: $(STAMP)
	SHMREDUCE_DEBUG_BUILD=1 SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force
	$(PY) -m pytest -q $(DEBUG_TESTS) $(PYTEST_ARGS); \
	status=$$?; SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force; exit $$status

# One copy per host (benchmarks/bench_ddp.py): 4 torchrun ranks sharing a 1 GiB dataset against
# each rank holding its own, and a rank SIGKILLed mid-run. Not part of `make bench`: about 3
# minutes on 2 cores, 4.7 GiB of memory and 6 GiB free in /dev/shm. Writes
# benchmarks/results/ddp.json and prints the table of docs/benchmarks.md.
bench-ddp: $(STAMP)
	$(PY) benchmarks/bench_ddp.py

# The whole suite once with the extension built under AddressSanitizer (not part of
# `make test`: about twice as slow), then the normal build again. Children and the
# broker inherit the preloaded runtime; leak reports are off (CPython's and torch's
# own allocations at exit are not ours to judge). libstdc++ is preloaded too: ASan's
# __cxa_throw interceptor must find the real one before torch throws its first C++
# exception (else "CHECK failed" and an abort, in torch, not in our code). SIGBUS is
# left to the program (handle_sigbus=0): a tensor in a file another process cut ends it
# with SIGBUS, as without ASan (tests/test_cut_files.py), not with ASan's abort.
ASAN_LIB = $(shell $(CC) -print-file-name=libasan.so) $(shell $(CC) -print-file-name=libstdc++.so.6)
asan: $(STAMP)
	SHMREDUCE_ASAN=1 SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:handle_sigbus=0 LD_PRELOAD="$(ASAN_LIB)" $(PY) -m pytest -q --timeout=600 $(PYTEST_ARGS); \
	status=$$?; SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force; exit $$status

# The threaded tests once with the extension built under ThreadSanitizer (not part of
# `make test`: about 4 minutes on 2 cores), then the normal build again; the status is
# the tests' (66: TSan reported a race, in this process or in a child). CPython and torch
# are not instrumented: TSan sees our C code's accesses, and theirs only through its
# interceptors (memcpy, free); .ci/tsan.supp silences what torch's OpenMP threads do and
# names nothing of ours. Each process writes its reports to build/tsan/report.PID; the
# lines that name shmreduce/_native/ are printed at the end. The loading process of
# test_threads_stress.py is spawned, not forked: TSan stops checking in a child forked
# from a process with threads (die_after_fork=0 lets such a child live on, unchecked;
# it may still abort with "dup thread with used id" when it starts a thread, a TSan
# limit, not ours): TSAN_SKIP leaves out the tests whose forked children start threads
# (test_concurrent_sends' queue consumers and first-share children). setarch -R: without ASLR, TSan's fixed shadow layout never meets a
# mapping made before it started ("FATAL: ThreadSanitizer: unexpected memory mapping"
# on kernels with more mmap randomisation bits).
TSAN_LIB = $(shell $(CC) -print-file-name=libtsan.so)
TSAN_TESTS ?= tests/test_threads_stress.py tests/test_concurrent_sends.py tests/test_native.py
TSAN_SKIP ?= not several_queues and not first_shares_from_several_threads and not overlapping_tensors
TSAN_OPTIONS_ALL = suppressions=$(CURDIR)/.ci/tsan.supp:log_path=$(CURDIR)/build/tsan/report:report_signal_unsafe=0:die_after_fork=0:halt_on_error=0:exitcode=66:history_size=7:second_deadlock_stack=1
tsan: $(STAMP)
	SHMREDUCE_TSAN=1 SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force
	rm -rf build/tsan && mkdir -p build/tsan
	TSAN_OPTIONS="$(TSAN_OPTIONS_ALL)" SHMREDUCE_STRESS_START=spawn setarch "$$(uname -m)" -R \
		env LD_PRELOAD="$(TSAN_LIB)" $(PY) -m pytest -q --timeout=900 -k "$(TSAN_SKIP)" $(TSAN_TESTS) $(PYTEST_ARGS); \
	status=$$?; SHMREDUCE_STRICT_BUILD=1 $(PY) setup.py -q build_ext --inplace --force; \
	echo "ThreadSanitizer: $$(cat build/tsan/report.* 2>/dev/null | grep -c '^WARNING: ThreadSanitizer') reports in build/tsan/, these in shmreduce/_native/:"; \
	cat build/tsan/report.* 2>/dev/null | grep 'shmreduce/_native/' | sort | uniq -c | sort -rn; \
	exit $$status

# The threaded stress alone, longer than `make test` runs it (3 s a case there):
# STRESS_SECONDS=60 a case by default (about 5 minutes in all); `make stress
# STRESS_SECONDS=600` is the long run (about 45 minutes).
STRESS_SECONDS ?= 60
stress: $(STAMP)
	SHMREDUCE_STRESS_SECONDS=$(STRESS_SECONDS) $(PY) -m pytest -q --timeout=$$(( $(STRESS_SECONDS) + 600 )) tests/test_threads_stress.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache shmreduce/*.so
