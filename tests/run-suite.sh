#!/usr/bin/env bash
# The test suite in a fresh temp root of its own (make test, make test-fast; .ci/run runs make test).
#   usage: tests/run-suite.sh [pytest arguments...]
#
# Everything the suite makes goes into one new directory, removed afterwards: $TMPDIR (tempfile,
# launch()'s run dirs, multiprocessing, pytest's tmp_path under --basetemp), $RAY_TMPDIR (Ray's
# sessions and its address file) and hypothesis's directory (tests/conftest.py). So a leftover of
# an earlier run on the machine (/tmp/ray, say) can never make a run pass that would fail on a
# fresh machine, and the leak fixture fails a test that writes anywhere else
# (tests/helpers/hygiene.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# short, and under /tmp whatever $TMPDIR says: unix socket paths below it are limited to 107 bytes
root=$(mktemp -d /tmp/twt.XXXXXX)
start=$(date +%s.%N)
# its one line says where run-suite's wall time went besides pytest's own clock: pytest's process
# (its start-up before the session's clock, its exit) and the temp root's removal
finish() {
  local ended; ended=$(date +%s.%N)
  rm -rf "$root"
  echo "$start $ended $(date +%s.%N)" |
    awk '{printf "run-suite: the pytest process %.1f s, the temp root removed in %.1f s\n", $2-$1, $3-$2}' >&2
}
trap finish EXIT
# traverse-only for others: the client_group tests run a client as a second user below it
chmod 0711 "$root"
export TMPDIR="$root" RAY_TMPDIR="$root" PYTEST_TWT_ROOT="$root"
# The checkout first on PYTHONPATH for the whole run, as launch() and tests.helpers.cli.twt() put it
# for what they start: a test process's zygote is kept per interpreter-level environment
# (tests/helpers/zygote.py), and without this each test process started two - one for the
# starts with that path, one for those without - each a fresh interpreter importing the
# supervisor's and the workers' modules (~0.35 s of CPU)
export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
# Bytecode caches: the suite starts well over a thousand Python processes (supervisors, workers, twt
# commands, phase children) that import the same modules, and without a cache each compiles every
# module it imports from source (a third of a supervisor's start-up CPU). So PYTHONDONTWRITEBYTECODE,
# if set, is lifted for the run, and Python keeps its usual caches: the installed packages' (pip
# compiled them at install time) and our sources' __pycache__ (ignored by git). A cache per run
# ($PYTHONPYCACHEPREFIX) would hide the installed packages' caches: each of the first processes of
# every run compiled numpy, hypothesis, wasmtime, Ray, ... again (~1 s of CPU per process).
unset PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX
# One BLAS thread in every process of the run unless the caller says otherwise, as the stub
# backend's workers and the GPU check's fake runs set for themselves: numpy's OpenBLAS starts a
# thread per core at import (~25 ms more of it) and its threads spin between small products, CPU
# the other test workers' processes need on a 2-core machine.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
.venv/bin/python -m pytest --basetemp="$root/pt" "$@"
