# Every target creates .venv itself when it is missing: a fresh clone needs
# nothing installed by hand beyond python3 (>= 3.11), gcc and the Python headers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.twt-installed

.PHONY: all demo test bench lint typecheck clean

all: test

$(STAMP): pyproject.toml setup.py shared/_atomics.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

## make demo: the main job - a supervisor, five tenants, bundled WASM guests
demo: $(STAMP)
	$(BIN)/twt demo

## make test: the whole suite (type check first, then pytest)
test: $(STAMP)
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest

## make bench: every benchmark program, ratios against baselines measured in the same run
bench: $(STAMP)
	$(BIN)/twt bench all

typecheck: $(STAMP)
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) build *.egg-info shared/*.so
