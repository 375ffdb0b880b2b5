#!/usr/bin/env bash
# The cuda backend's hardware check (see ../shared/GPU.md and docs/GPU-QUOTAS.md, "Hardware check").
#
#   tests/gpu/check.sh [--quick] [--mps] [--only PHASE,...] [--json-out FILE]
#
# Installs the wheels carried in .whl/ (pyzmq, wasmtime, ... for a machine without network) into a
# private target directory, builds the C atomics helper in place with the C compiler (no setuptools
# needed), then runs tests/gpu/check_gpu.py: pool maxSize vs RELEASE_THRESHOLD, metering before any
# CUDA call, cross-tenant isolation, two tenants (cap refusal, crash reclaim), a kernel fault that
# ends one worker only, kernels vs numpy, `pytest -m gpu`, timings, WASM.
# Prints a short table last; exit 0 when every functional check passed (timings never decide it).
# About 2-3 minutes on one GPU; no phase starts after --deadline-s (250 s), and --json-out is rewritten
# after every phase, so an outer timeout still leaves the figures measured so far.
# Never changes clocks, power, compute mode, MIG or persistence; --mps starts and always stops a
# private MPS daemon (its own pipe and log directories under /tmp).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${GPU_CHECK_SITE:-/tmp/twt-gpu-check-site}
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" tests/gpu/build_ext.py
"$PY" -c 'import zmq, msgpack, psutil, numpy, cuda.bindings.driver' || {
    echo "check.sh: a required module is missing (see above); carry its wheel in .whl/ or set PYTHONPATH" >&2
    exit 2
}

if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,compute_mode --format=csv || true
fi
"$PY" -c 'import sys; print("python", sys.version.split()[0])'
"$PY" -m pip list 2> /dev/null | grep -i -E '^(cuda-bindings|cuda-python|nvidia-cuda-nvrtc.*|numpy|pyzmq|wasmtime) ' || true

exec "$PY" tests/gpu/check_gpu.py "$@"
