"""Every driver and NVRTC call the backend, the kernels and the hardware check make through the
fake is replayed into the real cuda.bindings: its argument conversion (before libcuda loads) must
accept them all. No GPU needed; catches a wrongly typed argument that the fake would let through.

Into both supported majors: the fake speaks the call shapes of either (``FAKE_CUDA_BINDINGS``), and
the calls it recorded in each are replayed into the real binding of that major - the environment's
own, and the other one installed on first use beside the virtual environment
(tests/helpers/replay_bindings.py, ``bindings_path``). The environment's major replays the run's
one dry run of the whole check; the other one the check's phases that make every backend call
(:data:`OTHER_MAJOR_PHASES`), the exercise below and the supervisor's probe.

The check (the run's one dry run, shared with tests/gpu: tests/helpers/gpu_dry_run.py) runs every
phase (``pytest`` does nothing on the fake: it needs a device), so the tensor ops (their kernels'
``int`` parameters, argmax's copy into a slice of guest memory), the isolation reader, the fault
path, the regions and the WASM host are all in the replay. Their cuBLAS calls (fake_cublas's
``CublasRecorder``) are replayed into the real ``nvmath.bindings.cublas`` where nvmath-python is
installed (the ``cuda`` extra); everywhere, the fake cuBLAS converts its arguments as those bindings
do (``convert_args``), and a control test holds the two to the same verdicts."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import fake_cuda, gpu_dry_run
from tests.helpers.fake_cublas import FakeCublas, convert_args
from tests.helpers.replay_bindings import Replayer, load_records, replay_env

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(240)

pytest.importorskip("cuda.bindings.driver")

# what the check does not reach: the PTX fallback, pool attributes, read_into, mem_info
EXERCISE = """
from worker.backends.cuda import CudaBackend
from tests.helpers import fake_cuda, gpu_dry_run
fake_cuda.instance()._fake.nvrtc_archs = ("compute_90",)   # this NVRTC "does not know" sm_90: PTX path
b = CudaBackend(0, gpu_cap_bytes=8 << 20, release_threshold=4 << 20,
                driver="tests.helpers.fake_cuda", nvrtc="tests.helpers.fake_cuda")
x = b.alloc(4096)
b.write(x, 0, memoryview(bytes(4096)))
b.fill_f32(x, 1.0, 1024)
b.axpy_f32(1024, 2.0, x, x)
b.sum_f32(x, 1024)
b.begin_run(None)                      # queued work: events every few ops, a drain at the run's end
for _ in range(40):
    b.add_f32(x, x, x, 1024)
b.end_run(None)
import time
from shared.quota import QuotaBlock
from worker.device_time import DeviceGate
with QuotaBlock.create("replay") as owner:   # queued ops under the gate: the device thread's stretch timer
    blk = QuotaBlock.attach(owner.name, instance=0)
    gate = DeviceGate(blk, b)
    until = time.monotonic_ns() + 60 * 10**9
    for _ in range(3):
        gate.submit("scale_f32", b.scale_f32, (x, 1.0, 1024), until)
    gate.submit("fill_f32", b.fill_f32, (x, 1.0, 1024), until)
    y = b.alloc(4096)
    gate.submit("add_f32", b.add_f32, (x, x, y, 1024), until)
    gate.sync(until)                     # settled: cuEventQuery, cuEventElapsedTime per pair
    assert gate._qtimer.pairs_settled >= 5 and blk.gpu_time_ns > 0, gate._qtimer.pairs_settled
    gate.close()                         # the ring's events destroyed
    blk.close()
    b.free(y)
b._drv.call("cuStreamQuery", b._stream)   # as after a cuBLAS error
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
b.reclaim()                            # cuStreamSynchronize + cuMemPoolTrimTo
b.close()
from tests.gpu.phase_regions import run   # the GPU check's region phase (cuMemAllocHost baseline)
run("tests.helpers.fake_cuda", sizes_mib=(1,), repeat=1)
from supervisor.lifecycle.backend_select import probe_cuda   # its child measures a context per device
probe = probe_cuda(driver_module="tests.helpers.fake_cuda", nvrtc_module="tests.helpers.fake_cuda")
assert probe["ok"] and probe["devices"][0]["context_bytes_source"] == "measured", probe
"""
#: the cuda-bindings majors the project supports: each one's calls replayed into its real binding
MAJORS = (12, 13)
#: the hardware check's phases recorded for the major that the run's one dry run does not cover:
#: every backend call is in them (the share, WASM and supervisor phases repeat the same calls)
OTHER_MAJOR_PHASES = "environment,pool,metering,isolation,kernels,tensor_ops,timing,regions"

REQUIRED = {"cuInit", "cuDevicePrimaryCtxRetain", "cuStreamCreate", "cuMemPoolCreate", "cuMemPoolSetAttribute",
            "cuMemPoolGetAttribute", "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemcpyHtoDAsync",
            "cuMemcpyDtoHAsync", "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuStreamSynchronize",
            "cuMemGetInfo", "cuMemHostRegister", "cuMemHostUnregister", "cuMemAllocHost", "cuMemFreeHost",
            "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetCUBIN", "nvrtcGetPTX",
            "nvrtcDestroyProgram", "cuMemAlloc", "cuMemFree", "cuModuleUnload", "cuDeviceGetAttribute",
            "cuDeviceGetName", "cuDriverGetVersion", "cuMemGetAllocationGranularity", "cuMemPoolDestroy",
            "cuStreamDestroy", "cuDevicePrimaryCtxRelease", "cuCtxSetCurrent", "cuCtxGetCurrent", "nvrtcVersion",
            # context flags, the context's measured cost, queued-work events, trims
            "cuDevicePrimaryCtxSetFlags", "cuCtxCreate", "cuCtxDestroy", "cuEventCreate", "cuEventRecord",
            "cuEventQuery", "cuEventDestroy", "cuStreamQuery", "cuMemPoolTrimTo", "cuEventElapsedTime"}
#: what the GEMM path and the check's direct baseline call (worker/backends/_cublas.py, phase_tensor_ops)
REQUIRED_CUBLAS = {"create", "set_stream", "set_pointer_mode", "set_workspace", "get_version", "sgemm", "destroy"}
#: every phase of the hardware check that runs on the fake (pytest needs a device) is in the replay
PHASES = "environment,pool,metering,isolation,residual,tenants,fault,kernels,tensor_ops,timing,regions,wasm"


OWN_MAJOR = fake_cuda.installed_bindings_major()


#: one replay server per major for the module (tests/helpers/replay_bindings.py, ``Replayer``): a
#: replay in a fresh interpreter paid the bindings' imports each time
_REPLAYERS: dict[int, Replayer] = {}


@pytest.fixture(scope="module", autouse=True)
def _replay_servers() -> Iterator[None]:
    yield
    while _REPLAYERS:
        _REPLAYERS.popitem()[1].close()


def _replay(record_dir: Path, major: int | None = None) -> dict[str, object]:
    """Replay ``record_dir`` into the real cuda-bindings ``major`` (the environment's own by default)."""
    want = major or OWN_MAJOR or 13
    if want not in _REPLAYERS:
        _REPLAYERS[want] = Replayer(want, ROOT)
    result: dict[str, object] = _REPLAYERS[want].replay(record_dir, timeout_s=120)
    if major is not None:  # the binding replayed into is the one asked for, not the environment's
        assert str(result["bindings_version"]).startswith(f"{major}."), result["bindings_version"]
    return result


@pytest.mark.parametrize("major", MAJORS)
def test_every_call_through_the_fake_is_accepted_by_the_real_bindings(major: int, tmp_path: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    env = {**os.environ, "FAKE_CUDA_RECORD_CALLS": str(tmp_path), "PYTHONPATH": str(ROOT),
           "FAKE_CUDA_BINDINGS": str(major)}
    if major == OWN_MAJOR:
        # the run's one dry run of the whole check, recorded (tests/helpers/gpu_dry_run.py): its records
        # are copied, as the exercise below adds its own
        check = gpu_dry_run.dry_run(tmp_path_factory)
        assert check.proc.returncode == 0, gpu_dry_run.why_failed(check.proc)
        assert set(PHASES.split(",")) <= set(json.loads(check.json_out.read_text())["phases"])
        for recorded in check.record_dir.iterdir():
            shutil.copyfile(recorded, tmp_path / recorded.name)
    else:
        # its processes forked from a preloaded interpreter, as the run's one dry run's
        other = gpu_dry_run.run_check(["--dry-run-fake", "--quick", "--only", OTHER_MAJOR_PHASES],
                                      timeout_s=gpu_dry_run.TIMEOUT_S, env=env, forked=True)
        assert other.returncode == 0, gpu_dry_run.why_failed(other)
    exercise = subprocess.run([sys.executable, "-c", EXERCISE], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env=env)
    assert exercise.returncode == 0, exercise.stderr[-2000:]
    result = _replay(tmp_path, major)
    assert result["failures"] == []
    # the calls whose shape differs between the majors were made in this major's shape
    shapes = {(name, len(args)) for name, args in load_records(str(tmp_path)) if name == "cuCtxCreate"}
    assert shapes == {("cuCtxCreate", 2 if major == 12 else 3)}, shapes
    assert REQUIRED <= set(result["names"]), REQUIRED - set(result["names"])  # type: ignore[arg-type]
    # the tensor ops were in it: their kernels take ``int`` parameters, argmax copies into a slice
    records = load_records(str(tmp_path))
    launch_types = {t for name, args in records if name == "cuLaunchKernel" for t in args[9][1]}
    assert {ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_void_p} <= launch_types, launch_types
    dests = {args[0].kind for name, args in records if name == "cuMemcpyDtoHAsync" and isinstance(args[0], fake_cuda.Buf)}
    assert {"memoryview", "ndarray", "bytearray"} <= dests, dests
    cublas = result["cublas"]
    assert isinstance(cublas, dict)
    recorded = {name for name, _ in load_records(str(tmp_path), ".cublas")}
    assert REQUIRED_CUBLAS <= recorded, REQUIRED_CUBLAS - recorded
    if "skipped" not in cublas:  # nvmath-python installed here: the real bindings took every call
        assert cublas["failures"] == []
        assert REQUIRED_CUBLAS <= set(cublas["names"])


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


#: (call, arguments, what the real bindings do: None = accepted, else the exception type); ``STREAM`` stands
#: for a driver stream object (the fake's here, the real binding's when compared with nvmath)
STREAM = object()
CUBLAS_CASES: list[tuple[str, tuple[object, ...], type[Exception] | None]] = [
    ("sgemm", (1, 0, 0, 2, 2, 2, 0, 0, 2, 0, 2, 0, 0, 2), None),
    ("sgemm", (1, 0, 0, 2, 2, 2, ctypes.c_float(1.0), 0, 2, 0, 2, 0, 0, 2), TypeError),  # alpha: its address
    ("sgemm", (1, 0, 0, 1 << 31, 2, 2, 0, 0, 2, 0, 2, 0, 0, 2), OverflowError),  # past int: sgemm_64
    ("sgemm", (1, 0, 0, 2, 2, 2, 1 << 63, 0, 2, 0, 2, 0, 0, 2), OverflowError),
    ("sgemm", (1, 0, 0, 2, 2, 2, 0, 0, 2, 0, 2, 0, 0), TypeError),  # 13 arguments
    ("sgemm", (1, 0, 0, np.int64(2), 2, 2, 0, 0, 2, 0, 2, 0, 0, 2), None),  # an int parameter takes __int__
    ("sgemm", (1, 0, 0, 2, 2, 2, 0, np.int64(4096), 2, 0, 2, 0, 0, 2), TypeError),  # a pointer: int only
    ("sgemm_64", (1, 0, 0, 1 << 31, 2, 2, 0, 0, 1 << 31, 0, 2, 0, 0, 1 << 31), None),
    ("set_stream", (1, STREAM), TypeError),  # the stream object itself: int(stream) is what it takes
    ("set_stream", (1, 5), None),
    ("set_workspace", (1, 0, -1), OverflowError),
    ("set_workspace", (1, None, 0), TypeError),
    ("set_workspace", (1, 4096, 4 << 20), None),
    ("set_pointer_mode", (1, 0), None),
    ("destroy", ("1",), TypeError),
    ("get_version", (1,), None),
]


def _fake_args(args: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(fake_cuda.CUstream(5) if a is STREAM else a for a in args)


@pytest.mark.parametrize("name, args, refused", CUBLAS_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CUBLAS_CASES)])
def test_the_fake_cublas_converts_arguments_as_the_real_bindings(name: str, args: tuple[object, ...],
                                                                  refused: type[Exception] | None) -> None:
    """The fake refuses what nvmath.bindings.cublas refuses (the table; held to the real one below)."""
    if refused is None:
        convert_args(name, _fake_args(args))
    else:
        with pytest.raises(refused):
            convert_args(name, _fake_args(args))


def test_the_conversion_table_is_the_real_bindings(tmp_path: Path) -> None:
    """Every case of the table replayed into the real nvmath.bindings.cublas (in a child process, as the
    replay runs: nvmath loads libraries at import) gets the verdict the table says."""
    with open(tmp_path / "1.cublas", "wb") as f:
        for name, args, _ in CUBLAS_CASES:
            pickle.dump((name, _fake_args(args)), f)
    result = _replay(tmp_path)["cublas"]
    assert isinstance(result, dict)
    if "skipped" in result:
        pytest.skip(str(result["skipped"]))  # nvmath-python is the cuda extra's; CI has the table only
    want = ["accepted" if refused is None else refused.__name__ for _, _, refused in CUBLAS_CASES]
    assert result["outcomes"] == want


def test_a_fake_cublas_call_with_a_wrong_type_fails_before_it_acts() -> None:
    drv = fake_cuda.FakeDriver()
    cublas = FakeCublas(drv)
    with pytest.raises(TypeError):
        cublas.set_stream(1, fake_cuda.CUstream(5))
    assert cublas.calls == []  # refused at conversion, like the bindings: nothing happened


def test_the_cublas_replay_catches_a_wrongly_typed_argument(tmp_path: Path) -> None:
    """The control for the cuBLAS replay (needs nvmath-python; the conversion table above runs anywhere)."""
    bad = [("sgemm", (1, 0, 0, 2, 2, 2, ctypes.c_float(1.0), 0, 2, 0, 2, 0, 0, 2)),
           ("set_workspace", (1, 0, -1)),
           ("set_stream", (1, "stream"))]
    with open(tmp_path / "1.cublas", "wb") as f:
        for record in bad:
            pickle.dump(record, f)
    result = _replay(tmp_path)["cublas"]
    assert isinstance(result, dict)
    if "skipped" in result:
        pytest.skip(str(result["skipped"]))
    assert len(result["failures"]) == 3, result


def test_the_fake_refuses_a_launch_with_extra_none_as_the_bindings_do(tmp_path: Path) -> None:
    """``cuLaunchKernel(..., extra)`` takes 0; the real binding refuses None (TypeError), so the fake does."""
    import ctypes as c

    fake = fake_cuda.FakeDriver()
    fake.cuInit(0)
    _, dev = fake.cuDeviceGet(0)
    _, ctx = fake.cuDevicePrimaryCtxRetain(dev)
    fake.cuCtxSetCurrent(ctx)
    with pytest.raises(TypeError):
        fake.cuLaunchKernel(fake_cuda.CUfunction(1), 1, 1, 1, 1, 1, 1, 0, fake_cuda.CUstream(0),
                            ((1,), (c.c_uint64,)), None)
    with open(tmp_path / "1.calls", "wb") as f:
        pickle.dump(("cuLaunchKernel", (fake_cuda.CUfunction(1), 1, 1, 1, 1, 1, 1, 0, fake_cuda.CUstream(0),
                                        ((1,), (c.c_uint64,)), None)), f)
    failures = _replay(tmp_path)["failures"]
    assert isinstance(failures, list) and len(failures) == 1 and "TypeError" in failures[0]


#: run with the real binding of one major first on the path: the fake of that major against it
SHAPES = r"""
import json
import cuda.bindings
import cuda.bindings.driver as real
from tests.helpers import fake_cuda

major = int(cuda.bindings.__version__.split(".")[0])
f = fake_cuda.FakeDriver(bindings_major=major)
out = {"version": cuda.bindings.__version__, "bad": []}
for m in f.CUmemPool_attribute:
    if int(getattr(real.CUmemPool_attribute, m.name, -1)) != int(m):
        out["bad"].append(f"CUmemPool_attribute.{m.name}")
out["max_pool_size"] = [hasattr(real.CUmemPool_attribute, "CU_MEMPOOL_ATTR_MAX_POOL_SIZE"),
                        hasattr(f.CUmemPool_attribute, "CU_MEMPOOL_ATTR_MAX_POOL_SIZE")]
real_fields = {a for a in dir(real.CUmemPoolProps()) if not a.startswith("_") and a != "getPtr"}
out["props"] = [sorted(real_fields), sorted(f.CUmemPoolProps._fields)]
params = real.cuCtxCreate.__doc__.split("\n", 1)[0].split("(", 1)[1].rstrip(")").split(",")
try:
    f.cuCtxCreate(*([None] * (len(params) - 2)), 0, fake_cuda.CUdevice(0))
    out["ctx_create_arity"] = len(params)
except TypeError as exc:
    out["ctx_create_arity"] = f"the fake refuses {len(params)} arguments: {exc}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("major", MAJORS)
def test_the_fake_of_each_major_has_that_real_bindings_shapes(major: int) -> None:
    """Where the majors differ (pool attributes, pool props, cuCtxCreate's arguments), the fake of
    each major has exactly the real binding's shape - checked against that real binding."""
    proc = subprocess.run([sys.executable, "-c", SHAPES], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=replay_env(major, ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"].startswith(f"{major}.")
    assert out["bad"] == []
    assert out["max_pool_size"] == [major >= 13, major >= 13]
    assert out["props"][0] == out["props"][1]
    assert out["ctx_create_arity"] == (2 if major == 12 else 3)


def _shaped(major: int) -> list[tuple[str, tuple[object, ...]]]:
    """The three calls whose shape differs, as the fake of ``major`` records them."""
    from shared.cuda_compat import DriverApi

    f = fake_cuda.FakeDriver(bindings_major=major)
    calls: list[tuple[str, tuple[object, ...]]] = [
        ("cuCtxCreate", (*([None] if major == 13 else []), 0, fake_cuda.CUdevice(0))),
        ("cuMemPoolCreate", (DriverApi(major, "").pool_props(f, 0, 2 << 20),))]
    if major == 13:
        calls.append(("cuMemPoolGetAttribute", (fake_cuda.CUmemoryPool(16),
                                                f.CUmemPool_attribute.CU_MEMPOOL_ATTR_MAX_POOL_SIZE)))
    return calls


@pytest.mark.parametrize("recorded, replayed, failing", [(13, 13, 0), (13, 12, 3), (12, 12, 0), (12, 13, 1)])
def test_each_major_refuses_the_other_majors_shapes(recorded: int, replayed: int, failing: int,
                                                    tmp_path: Path) -> None:
    """The control for the two replays: 13.x's cuCtxCreate, pool props and MAX_POOL_SIZE fail in the
    real 12.9 binding (the three places a 12.x host broke), 12.x's cuCtxCreate fails in 13.x - so a
    call made in the wrong major's shape cannot pass either replay."""
    with open(tmp_path / "1.calls", "wb") as f:
        for record in _shaped(recorded):
            pickle.dump(record, f)
    failures = _replay(tmp_path, replayed)["failures"]
    assert isinstance(failures, list) and len(failures) == failing, failures
