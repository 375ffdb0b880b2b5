"""Every driver and NVRTC call the backend, the kernels and the hardware check make through the
fake is replayed into the real cuda.bindings: its argument conversion (before libcuda loads) must
accept them all. No GPU needed; catches a wrongly typed argument that the fake would let through."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import fake_cuda

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)

pytest.importorskip("cuda.bindings.driver")

# what the check does not reach: the PTX fallback, pool attributes, read_into, mem_info
EXERCISE = """
from worker.backends.cuda import CudaBackend
from tests.helpers import fake_cuda
fake_cuda.instance()._fake.nvrtc_archs = ("compute_90",)   # this NVRTC "does not know" sm_90: PTX path
b = CudaBackend(0, gpu_cap_bytes=8 << 20, release_threshold=4 << 20,
                driver="tests.helpers.fake_cuda", nvrtc="tests.helpers.fake_cuda")
x = b.alloc(4096)
b.write(x, 0, memoryview(bytes(4096)))
b.fill_f32(x, 1.0, 1024)
b.axpy_f32(1024, 2.0, x, x)
b.sum_f32(x, 1024)
b.read_into(x, 8, memoryview(bytearray(16)))
b.pool_attribute("USED_MEM_CURRENT")
b.mem_info()
import os
from shared.region import Region
r = Region.create("t", 1 << 16, prefix="replay%d" % os.getpid())   # a region as the worker pins it
addr = b.pin_host(r.data)
assert addr is not None
b.write_host(x, 0, r.data[:4096], addr)
b.read_host(x, 0, r.data[:4096], addr)
b.unpin_host(addr)
r.unlink()
r.close()
b.free(x)
b.close()
from tests.gpu.phase_regions import run   # the GPU check's region phase (cuMemAllocHost baseline)
run("tests.helpers.fake_cuda", sizes_mib=(1,), repeat=1)
"""

REQUIRED = {"cuInit", "cuDevicePrimaryCtxRetain", "cuStreamCreate", "cuMemPoolCreate", "cuMemPoolSetAttribute",
            "cuMemPoolGetAttribute", "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemcpyHtoDAsync",
            "cuMemcpyDtoHAsync", "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuStreamSynchronize",
            "cuMemGetInfo", "cuMemHostRegister", "cuMemHostUnregister", "cuMemAllocHost", "cuMemFreeHost",
            "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetCUBIN", "nvrtcGetPTX",
            "nvrtcDestroyProgram"}


def _replay(record_dir: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.replay_bindings", str(record_dir)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_every_call_through_the_fake_is_accepted_by_the_real_bindings(tmp_path: Path) -> None:
    env = {**os.environ, "FAKE_CUDA_RECORD_CALLS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    check = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--dry-run-fake", "--quick",
                            "--only", "pool,metering,isolation,tenants,fault,kernels,timing"],
                           capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    assert check.returncode == 0, check.stdout[-2000:]
    exercise = subprocess.run([sys.executable, "-c", EXERCISE], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env=env)
    assert exercise.returncode == 0, exercise.stderr[-2000:]
    result = _replay(tmp_path)
    assert result["failures"] == []
    assert REQUIRED <= set(result["names"]), REQUIRED - set(result["names"])  # type: ignore[arg-type]


def test_the_replay_catches_a_wrongly_typed_argument(tmp_path: Path) -> None:
    """The control: the replay can fail."""
    bad = [("cuMemAllocFromPoolAsync", ("1048576", fake_cuda.CUmemoryPool(16), fake_cuda.CUstream(0))),
           ("nvrtcCompileProgram", (fake_cuda.nvrtcProgram(32), 1, ["--fmad=false"])),
           ("cuMemcpyHtoDAsync", (fake_cuda.CUdeviceptr(4096), fake_cuda.Buf("bytes", b"x"), 1, "stream"))]
    with open(tmp_path / "1.calls", "wb") as f:
        for record in bad:
            pickle.dump(record, f)
    result = _replay(tmp_path)
    failures = result["failures"]
    assert isinstance(failures, list) and len(failures) == 3, failures
