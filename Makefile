# Every target creates .venv itself when it is missing: a fresh clone needs
# nothing installed by hand beyond python3 (>= 3.11), gcc and the Python headers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.twt-installed

.PHONY: all demo test test-fast bench lint typecheck clean

all: test

$(STAMP): pyproject.toml setup.py shared/_atomics.c worker/_stubexec.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# an editable install as a plain path in a .pth file (setuptools' compat mode), not the
	@# default's import finder: that finder's module (and the pathlib it imports) ran in every
	@# interpreter the suite starts, well over a thousand a run: ~8 ms of CPU each that a process
	@# would not otherwise spend (docs/BUILD.md, "A worker's start"). Where a setuptools no longer has compat mode, the default install.
	$(BIN)/python -m pip install -q -e '.[test]' --config-settings editable_mode=compat 2>/dev/null \
		|| $(BIN)/python -m pip install -q -e '.[test]'
	@# the Zig toolchain's wasi-libc and runtimes, built once here rather than by the first C guest
	@# built (~20 s of CPU on a fresh machine; the SDK tests and twt build reuse Zig's cache)
	$(BIN)/twt build --prepare
	@# our own modules' bytecode, as a wheel install would have compiled it (an editable install does
	@# not): the suite's first processes no longer each compile the same ~190 modules at once
	$(BIN)/python -m compileall -q -j 0 supervisor worker shared
	@touch $@

#: the cuda-bindings major the venv lacks (12.x beside 13.x, or the reverse), for the replay test
#: (tests/helpers/replay_bindings.py): a pip install --target beside the venv, once
OTHER_BINDINGS := $(VENV)/.twt-other-bindings
$(OTHER_BINDINGS): $(STAMP) tests/helpers/replay_bindings.py
	$(BIN)/python -m tests.helpers.replay_bindings --prepare
	@touch $@

## make demo: the main job - a supervisor, five tenants, bundled WASM guests
demo: $(STAMP)
	$(BIN)/twt demo

#: pytest-xdist workers for make test: 6, whatever the cores (the count the suite is run and
#: measured with on 2 cores). Each worker costs ~1.3 s of CPU to start and collect (more with its
#: own zygote), but a fifth of the suite's modules mostly wait (Ray, drains, deadlines, TCP
#: sessions), and a core idles while every worker on it waits at once: on one core 3 workers left
#: it idle 5-7 % of a run, 4 workers 1-4 %, 6 workers 0.1-0.2 %, for ~2 s of CPU more than 4
#: (docs/BUILD.md, "Parallel workers")
TEST_WORKERS ?= 6

## make test: the whole suite (lint first, then pytest in a fresh temp root, tests/run-suite.sh, with the
## type check beside it); it fails if either fails
#: --max-worker-restart=0: a test that kills its xdist worker fails the run at once (xdist would
#: rerun it on fresh workers, and once hung after replacing one until CI's time limit).
#: mypy runs on one core (~10 s of CPU on a fresh clone, no cache): beside the tests it no longer
#: leaves the other core idle before them; its output is printed after theirs.
#: The set-up step ($(OTHER_BINDINGS)) runs beside the lint and the suite's start (its workers'
#: imports and collection), not before them: a replay that needs it before it is done waits for it
#: (it takes replay_bindings' install lock and reads its completion file), never sees half of it.
#: Its output is printed after the tests'; if it failed, make test fails. (The suite's debug build
#: needs no set-up: a C debug build links the release libraries the install step prepared.)
#: (Named through SETUP_MAKE, not $(MAKE) on the recipe line: GNU make runs every line that names
#: $(MAKE) even under `make -n`, which would then run the whole suite.)
#: Its last line says where the wall time went outside pytest's own clock: the lint, the suite's
#: script (pytest's process and the temp root's removal: run-suite.sh's own line) and the wait
#: for mypy and the set-up step after the tests.
SETUP_MAKE = $(MAKE) --no-print-directory
test: $(STAMP)
	@t0=$$(date +%s.%N); \
	$(SETUP_MAKE) $(OTHER_BINDINGS) > $(VENV)/.twt-prepare.log 2>&1 & \
	prep=$$!; \
	if ! $(BIN)/ruff check .; then wait $$prep; exit 1; fi; \
	t1=$$(date +%s.%N); \
	$(BIN)/python -m mypy > $(VENV)/.twt-mypy.log 2>&1 & mypy=$$!; \
	tests/run-suite.sh -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --max-worker-restart=0 --durations=20; \
	rc=$$?; t2=$$(date +%s.%N); wait $$mypy; mrc=$$?; wait $$prep; prc=$$?; t3=$$(date +%s.%N); \
	echo "set-up ($(OTHER_BINDINGS)):"; cat $(VENV)/.twt-prepare.log; \
	echo "mypy:"; cat $(VENV)/.twt-mypy.log; \
	echo "$$t0 $$t1 $$t2 $$t3" | awk '{printf "make test (wall): lint %.1f s, tests/run-suite.sh %.1f s, then %.1f s waiting for mypy and the set-up\n", $$2-$$1, $$3-$$2, $$4-$$3}'; \
	if [ $$prc -ne 0 ]; then echo "make test: the set-up step failed (above)"; exit $$prc; fi; \
	if [ $$mrc -ne 0 ]; then echo "make test: the type check failed (above)"; exit $$mrc; fi; exit $$rc

## make test-fast: the inner loop - every test that starts no process (no supervisor, worker, Ray),
## less the `slow` ones (exhaustive model checks, long hypothesis runs: make test runs them)
test-fast: $(STAMP)
	tests/run-suite.sh -n 2 -m "not process and not gpu and not slow"

## make bench: every benchmark program, ratios against baselines measured in the same run
bench: $(STAMP)
	$(BIN)/twt bench all

## make lint: ruff with the project's small rule set (pyproject.toml [tool.ruff]); make test runs it first
lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) build *.egg-info shared/*.so
