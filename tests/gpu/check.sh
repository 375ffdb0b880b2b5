#!/usr/bin/env bash
# The cuda backend's hardware check (see ../shared/GPU.md and docs/GPU-QUOTAS.md, "Hardware check").
#
#   tests/gpu/check.sh [--quick] [--mps]
#
# Installs the wheels carried in .whl/ (pyzmq, wasmtime, ... for a machine without network) into a
# private target directory, builds the C atomics helper in place, then runs tests/gpu/check_gpu.py:
# pool maxSize vs RELEASE_THRESHOLD, metering before any CUDA call, two tenant workers (cap refusal,
# neighbour unaffected, SIGKILL -> counters zeroed and memory back), `pytest -m gpu`, timings.
# Prints a short table last; exit 0 when every check passed. A few minutes on one GPU.
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

"$PY" setup.py -q build_ext --inplace > /dev/null

if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,compute_mode --format=csv || true
fi
"$PY" -c 'import sys; print("python", sys.version.split()[0])'
"$PY" -m pip list 2> /dev/null | grep -i -E '^(cuda-bindings|cuda-python|numpy|pyzmq|wasmtime) ' || true

exec "$PY" tests/gpu/check_gpu.py "$@"
