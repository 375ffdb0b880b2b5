#!/usr/bin/env bash
# The cuda backend's hardware check (see ../shared/GPU.md and docs/GPU-QUOTAS.md, "Hardware check").
#
#   tests/gpu/check.sh [--quick] [--mps] [--only PHASE,...] [--json-out FILE]
#
# Installs the wheels carried in .whl/ (pyzmq, wasmtime, nvmath-python ... for a machine without network)
# into a private target directory (and those in .whl-extra/ only if nvmath does not import without them), builds the C atomics helper in place with the C compiler (no setuptools
# needed), then runs tests/gpu/check_gpu.py: pool maxSize vs RELEASE_THRESHOLD, metering before any
# CUDA call, cross-tenant isolation, two tenants (cap refusal, crash reclaim), a kernel fault that
# ends one worker only, kernels vs numpy, `pytest -m gpu`, timings, WASM, GPU-time shares (share, mix,
# wasm_share, foreign), a worker's CPU in a sync, 8 workers' budget vs cuMemGetInfo, the residual probe over
# most of the device, a run overrunning its deadline. tests/gpu/prepare_device.sh prepares the device call.
# Prints a short table last; exit 0 when every functional check passed (timings never decide it).
# About 4-5 minutes on one GPU; no phase starts after --deadline-s (320 s), and --json-out is rewritten
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

# NVRTC and cuBLAS must be of the driver's CUDA major (12 or 13): cuda-bindings 13 loads only libnvrtc.so.13,
# a CUDA 13 cubin does not load on a 12.x driver, cuBLAS 13 needs a 13.x driver. libcuda says which major
# (cuDriverGetVersion through ctypes: no Python package needed); the wheels carried for it in .whl-cu<major>/
# go ahead of everything else. The environment phase fails fast, with one line, if the majors still differ.
CUDA_MAJOR=$("$PY" -c 'import ctypes; v = ctypes.c_int(0); ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)); print(v.value // 1000)' 2> /dev/null || true)
if [[ -n "$CUDA_MAJOR" ]] && compgen -G ".whl-cu$CUDA_MAJOR/*.whl" > /dev/null; then
    CU_SITE=${GPU_CHECK_CU_SITE:-/tmp/twt-gpu-check-cu$CUDA_MAJOR}
    rm -rf "$CU_SITE"
    "$PY" -m pip install -q --no-index --no-deps --target "$CU_SITE" .whl-cu"$CUDA_MAJOR"/*.whl
    export PYTHONPATH="$CU_SITE:$PYTHONPATH"
    echo "check.sh: the driver reports CUDA $CUDA_MAJOR.x: using the wheels in .whl-cu$CUDA_MAJOR/"
fi

# nvmath-python (cuBLAS for the GEMM) imports cuda.core >= 0.5 and cuda.pathfinder >= 1.5.1 at import time.
# When the host's are older, the wheels carried in .whl-extra/ (cuda-core, cuda-pathfinder) are added, in
# name order, one more each time, until it imports; never when it imports already (the host's packages stay
# in charge). They go to a directory of their own, all installed by one pip call each time: `pip --target`
# replaces a top-level directory it installs into, so wheels sharing the `cuda/` namespace installed one by
# one would leave only the last one there.
if compgen -G ".whl-extra/*.whl" > /dev/null && ! "$PY" -c 'import nvmath.bindings.cublas' 2> /dev/null; then
    EXTRA=${GPU_CHECK_EXTRA_SITE:-/tmp/twt-gpu-check-extra}
    export PYTHONPATH="$EXTRA:$PYTHONPATH"
    picked=()
    for wheel in .whl-extra/*.whl; do
        picked+=("$wheel")
        echo "check.sh: nvmath.bindings.cublas does not import with this host's packages; adding ${picked[*]}"
        rm -rf "$EXTRA"
        "$PY" -m pip install -q --no-index --no-deps --target "$EXTRA" "${picked[@]}"
        if "$PY" -c 'import nvmath.bindings.cublas' 2> /dev/null; then break; fi
    done
fi
"$PY" -c 'import nvmath.bindings.cublas; print("imports")' 2>&1 | tail -1 | sed 's/^/check.sh: nvmath.bindings.cublas: /' || true

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
