"""The steps of the hardware check that touch CUDA: each runs in a fresh child process.

``check_gpu.py --child NAME [ARGS...]`` runs ``CHILDREN[NAME]`` and prints its
result as one JSON line (a child that waits for the orchestrator, like the
isolation writer, prints several). The orchestrator never initialises CUDA
itself: forking after CUDA init is unsafe, and a sticky error must end only
the process that caused it.

Which driver: ``GPU_CHECK_DRIVER_MODULE`` / ``GPU_CHECK_NVRTC_MODULE``, the
real ``cuda.bindings`` modules by default; ``--dry-run-fake`` names
``tests.helpers.fake_cuda`` to test the script itself (that proves nothing
about hardware).

To add a child step: write ``def child_NAME(args: list[str]) -> dict`` below
and add it to ``CHILDREN``; the orchestrator calls it with ``run_child``.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

MiB = 1 << 20
NONCE_FLOATS = 256  # 1 KiB written by tenant A in the isolation phase


def driver() -> Any:
    """The driver module under test (real unless the check runs on the fake)."""
    return importlib.import_module(os.environ.get("GPU_CHECK_DRIVER_MODULE", "cuda.bindings.driver"))


def nvrtc() -> Any:
    return importlib.import_module(os.environ.get("GPU_CHECK_NVRTC_MODULE", "cuda.bindings.nvrtc"))


def ok(call: str, result: tuple[Any, ...]) -> Any:
    """A raw call's value(s), or RuntimeError with the driver's error name."""
    err = result[0]
    if err:
        raise RuntimeError(f"{call} failed: {err_name(err)}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def err_name(err: Any) -> str:
    if not err:
        return "CUDA_SUCCESS"
    return str(getattr(err, "name", None) or int(err))


def primary_context(d: Any) -> Any:
    """cuInit, then device 0's primary context made current (raw driver calls); the device.

    The caller releases it (``cuDevicePrimaryCtxRelease(dev)``) when done.
    """
    ok("cuInit", d.cuInit(0))
    dev = ok("cuDeviceGet", d.cuDeviceGet(0))
    ctx = ok("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(dev))
    ok("cuCtxSetCurrent", d.cuCtxSetCurrent(ctx))
    return dev


def backend(cap: int | None = 1 << 30) -> Any:
    """A tenant worker's backend on device 0 (the fake cuBLAS with the fake driver, else nvmath's)."""
    from worker.backends.cuda import CudaBackend

    drv = driver()
    cublas = None
    if getattr(drv, "__name__", "") == "tests.helpers.fake_cuda":
        from tests.helpers import fake_cuda
        from tests.helpers.fake_cublas import FakeCublas

        cublas = FakeCublas(fake_cuda.instance())
    return CudaBackend(0, gpu_cap_bytes=cap, driver=drv, nvrtc=nvrtc(), cublas=cublas)


class Counting:
    """A driver module that counts its calls (for "no CUDA call on a metered refusal")."""

    def __init__(self, mod: Any) -> None:
        self._mod = mod
        self.count = 0
        self.__name__ = f"counting({mod.__name__})"

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._mod, name)
        if name.startswith("cu") and callable(value) and not isinstance(value, type):
            def counted(*args: Any) -> Any:
                self.count += 1
                return value(*args)
            return counted
        return value


# ----------------------------------------------------------------------------------- steps


def child_pool(args: list[str]) -> dict[str, Any]:
    """maxSize refuses past the cap; RELEASE_THRESHOLD alone refuses nothing (raw driver calls)."""
    d = driver()
    dev = primary_context(d)
    stream = ok("cuStreamCreate", d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)))

    def pool(max_size: int, threshold: int | None) -> Any:
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        props.maxSize = max_size
        p = ok("cuMemPoolCreate", d.cuMemPoolCreate(props))
        if threshold is not None:
            ok("cuMemPoolSetAttribute", d.cuMemPoolSetAttribute(
                p, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(threshold)))
        return p

    def drain(p: Any, ptrs: list[Any]) -> None:
        for ptr in ptrs:
            ok("cuMemFreeAsync", d.cuMemFreeAsync(ptr, stream))
        ok("cuStreamSynchronize", d.cuStreamSynchronize(stream))
        ok("cuMemPoolDestroy", d.cuMemPoolDestroy(p))

    out: dict[str, Any] = {}
    capped = pool(64 * MiB, None)
    err, ptr = d.cuMemAllocFromPoolAsync(128 * MiB, capped, stream)
    out["cap64_alloc128"] = err_name(err)
    ptrs = [ptr] if not err else []
    steps, last = 0, "CUDA_SUCCESS"
    for _ in range(64):
        err, ptr = d.cuMemAllocFromPoolAsync(8 * MiB, capped, stream)
        if err:
            last = err_name(err)
            break
        ptrs.append(ptr)
        steps += 1
    out["cap64_steps_of_8mib"] = steps
    out["cap64_step_error"] = last
    drain(capped, ptrs)
    threshold_only = pool(0, 64 * MiB)
    err, ptr = d.cuMemAllocFromPoolAsync(128 * MiB, threshold_only, stream)
    out["threshold64_alloc128"] = err_name(err)
    err2, ptr2 = d.cuMemAllocFromPoolAsync(256 * MiB, threshold_only, stream)
    out["threshold64_alloc256_more"] = err_name(err2)
    drain(threshold_only, [p for e, p in ((err, ptr), (err2, ptr2)) if not e])
    ok("cuStreamDestroy", d.cuStreamDestroy(stream))
    _, raw = d.cuDeviceGetName(256, dev)
    _, version = d.cuDriverGetVersion()
    ok("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev))
    out["device_name"] = raw.split(b"\0", 1)[0].decode(errors="replace")
    out["driver_version"] = int(version)
    return out


def child_nocall(args: list[str]) -> dict[str, Any]:
    """A metered refusal makes no CUDA call; a driver OOM after the meter said yes is rolled back."""
    from shared.errors import GpuMemoryExhausted
    from shared.quota import QuotaBlock
    from worker.allocator import MeteredAllocator
    from worker.backends.cuda import CudaBackend

    proxy = Counting(driver())
    out: dict[str, Any] = {}
    with QuotaBlock.create("gpucheck", gpu_memory_bytes_cap=64 * MiB) as block:
        be = CudaBackend(0, gpu_cap_bytes=64 * MiB, driver=proxy, nvrtc=nvrtc())
        alloc = MeteredAllocator("gpucheck", block, be)
        try:
            alloc.alloc(48 * MiB)
            before = proxy.count
            try:
                alloc.alloc(32 * MiB)
                out["refused"] = False
            except GpuMemoryExhausted:
                out["refused"] = True
            out["cuda_calls_during_refusal"] = proxy.count - before
            block.set_limits(gpu_memory_bytes_cap=None)  # meter off: only the pool's maxSize stands
            try:
                alloc.alloc(32 * MiB)
                out["driver_refused"] = False
            except GpuMemoryExhausted as exc:
                out["driver_refused"] = "CUDA_ERROR_OUT_OF_MEMORY" in str(exc)
            out["gpu_bytes_after_driver_oom"] = block.gpu_bytes_in_use
        finally:
            alloc.free_all()
            be.close()
    return out


def child_meminfo(args: list[str]) -> dict[str, Any]:
    """cuMemGetInfo from a fresh context (its own context is in both of two readings)."""
    d = driver()
    dev = primary_context(d)
    free, total = ok("cuMemGetInfo", d.cuMemGetInfo())
    ok("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev))
    return {"free": int(free), "total": int(total)}


def child_holder(args: list[str]) -> dict[str, Any]:
    """A worker-like context + stream + pool, held (per-context memory, ready time); on the first
    "go" it also loads what a worker holds after its first tensor op and GEMM - both kernel modules
    with their scratch and a cuBLAS handle - and holds again; the second "go" ends it."""
    t0 = time.perf_counter()
    be = backend()
    ready_ms = (time.perf_counter() - t0) * 1000
    print(json.dumps({"ready_ms": ready_ms, "pid": os.getpid()}), flush=True)
    sys.stdin.readline()
    loaded: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        be.kernels()
        ops = be.tensor_ops()
        loaded["kernels_load_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        ops.cublas  # noqa: B018 - creates the handle (cublasCreate) on the tenant stream
        loaded["cublas_create_ms"] = (time.perf_counter() - t0) * 1000
    except Exception as exc:  # noqa: BLE001 - reported; the memory reading says what did load
        loaded["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(loaded), flush=True)
    sys.stdin.readline()
    be.close()
    return {"ready_ms": ready_ms, **loaded}


def child_isolation_writer(args: list[str]) -> dict[str, Any]:
    """Tenant A: write a nonce, report its device address, wait, then check it is intact."""
    import numpy as np

    nonce = np.random.default_rng(int(args[0]) if args else 7).uniform(1.0, 2.0, NONCE_FLOATS).astype(np.float32)
    be = backend(64 * MiB)
    buf = be.alloc(nonce.nbytes)
    be.write(buf, 0, memoryview(nonce.tobytes()))
    print(json.dumps({"addr": buf.addr, "nbytes": nonce.nbytes, "pid": os.getpid(),
                      "nonce_sum": float(nonce.astype(np.float64).sum())}), flush=True)
    sys.stdin.readline()  # the orchestrator lets the reader try, then says go on
    intact = be.read(buf, 0, nonce.nbytes) == nonce.tobytes()
    other = be.alloc(MiB)  # and A's context still works after B's fault
    be.fill_f32(other, 3.0, 16)
    works = np.all(np.frombuffer(be.read(other, 0, 64), np.float32) == 3.0)
    be.close()
    return {"nonce_intact": bool(intact), "context_works": bool(works)}


def child_isolation_reader(args: list[str]) -> dict[str, Any]:
    """Tenant B: read A's address with a copy, then with a kernel; never may A's bytes come back."""
    import numpy as np

    addr, nbytes, nonce_sum = int(args[0]), int(args[1]), float(args[2])
    be = backend(64 * MiB)
    out: dict[str, Any] = {}
    dest = bytearray(nbytes)
    d = be._drv.mod
    # 1. a copy from A's address through B's context (raw call: no bounds check of ours in the way)
    (err,) = d.cuMemcpyDtoHAsync(dest, addr, nbytes, be._stream)
    if not err:
        (err,) = d.cuStreamSynchronize(be._stream)
    out["copy"] = err_name(err)
    values = np.frombuffer(bytes(dest), np.float32)
    out["copy_got_a_bytes"] = bool(not err and abs(float(values.astype(np.float64).sum()) - nonce_sum) < 1e-3)
    # 2. a kernel reading A's address (sum): on hardware an MMU fault, sticky, ending this process's context
    try:
        from worker.backends.cuda import CudaBuffer

        total = be.sum_f32(CudaBuffer(nbytes, addr), nbytes // 4)  # A's address posing as B's buffer
        out["kernel"] = "CUDA_SUCCESS"
        out["kernel_got_a_bytes"] = abs(total - nonce_sum) < 1e-2
    except Exception as exc:  # noqa: BLE001 - the expected outcome; reported by name
        out["kernel"] = getattr(exc, "result_name", type(exc).__name__)
        out["kernel_got_a_bytes"] = False
    out["context_lost"] = be.context_lost
    be.close()
    return out


def child_kernels(args: list[str]) -> dict[str, Any]:
    """fill, axpy and sum against numpy (float32 tolerance), after a real NVRTC compile."""
    import numpy as np

    n = int(args[0]) if args else 16 * MiB + 3
    be = backend(None)
    out: dict[str, Any] = {"n": n}
    rng = np.random.default_rng(1)
    xs = rng.standard_normal(n).astype(np.float32)
    ys = rng.standard_normal(n).astype(np.float32)
    x, y = be.alloc(4 * n), be.alloc(4 * n)
    be.write(x, 0, memoryview(xs.tobytes()))
    be.write(y, 0, memoryview(ys.tobytes()))
    t0 = time.perf_counter()
    be.kernels()
    out["nvrtc_compile_ms"] = (time.perf_counter() - t0) * 1000
    out["kernel_arch"] = be.kernels().arch
    t0 = time.perf_counter()
    be.axpy_f32(n, 0.75, x, y)
    out["axpy_ms"] = (time.perf_counter() - t0) * 1000
    want = ys + np.float32(0.75) * xs
    got = np.frombuffer(be.read(y, 0, 4 * n), np.float32)
    out["axpy_max_abs_err"] = float(np.max(np.abs(got - want)))
    out["axpy_matches_numpy"] = bool(np.allclose(got, want, rtol=1e-6, atol=1e-6))
    t0 = time.perf_counter()
    total = be.sum_f32(y, n)
    out["sum_ms"] = (time.perf_counter() - t0) * 1000
    ref32 = float(np.sum(got, dtype=np.float32))
    ref64 = float(np.sum(got, dtype=np.float64))
    scale = max(1.0, float(np.abs(got).sum()))
    out["sum_rel_error"] = abs(total - ref64) / scale
    out["sum_vs_numpy_float32_rel"] = abs(total - ref32) / scale
    out["sum_matches_numpy"] = out["sum_rel_error"] < 1e-6
    be.fill_f32(y, 1.5, n)
    out["fill_matches_numpy"] = bool(np.array_equal(np.frombuffer(be.read(y, 0, 4 * n), np.float32),
                                                    np.full(n, 1.5, np.float32)))
    be.close()
    return out


def child_timing(args: list[str]) -> dict[str, Any]:
    """Context + stream + pool ready time; metered alloc+free against raw pool calls (medians of 7)."""
    from shared.device_budget import DeviceBudget
    from shared.quota import QuotaBlock
    from worker.allocator import MeteredAllocator

    iterations = int(args[0]) if args else 2000
    out: dict[str, Any] = {"iterations": iterations}
    d = driver()
    t0 = time.perf_counter()
    ok("cuInit", d.cuInit(0))
    out["cuinit_ms"] = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    be = backend()
    out["ready_ms"] = (time.perf_counter() - t0) * 1000
    pool, stream = be._pool, be._stream
    alloc_async, free_async, sync = d.cuMemAllocFromPoolAsync, d.cuMemFreeAsync, d.cuStreamSynchronize
    size = MiB
    with QuotaBlock.create("gpucheck", gpu_memory_bytes_cap=1 << 30) as blk, \
            DeviceBudget.create(0, 1 << 40) as owner:
        block = QuotaBlock.attach(blk.name, instance=0)
        budget = DeviceBudget.attach(owner.name)
        metered = MeteredAllocator("gpucheck", block, be, budget=budget)

        def raw() -> None:
            for _ in range(iterations):
                err, ptr = alloc_async(size, pool, stream)
                if err:
                    raise RuntimeError(err_name(err))
                free_async(ptr, stream)
            sync(stream)

        def unmetered() -> None:
            for _ in range(iterations):
                be.free(be.alloc(size))
            sync(stream)

        def with_meter() -> None:
            a, f = metered.alloc_buffer, metered.free_buffer
            for _ in range(iterations):
                f(a(size))
            sync(stream)

        runs: dict[str, list[float]] = {"raw": [], "backend": [], "metered": []}
        for fn in (raw, unmetered, with_meter):  # warm-up
            fn()
        for _ in range(7):
            for name, fn in (("raw", raw), ("backend", unmetered), ("metered", with_meter)):
                t0 = time.perf_counter()
                fn()
                runs[name].append((time.perf_counter() - t0) / iterations * 1e6)
        for name, values in runs.items():
            out[f"{name}_us"] = statistics.median(values)
        out["metered_over_raw"] = out["metered_us"] / out["raw_us"]
        out["metering_only_over_backend"] = out["metered_us"] / out["backend_us"]
        block.close()
        budget.close()
    be.close()
    return out


#: the distributions whose versions the environment step reports (absent ones are left out)
DISTRIBUTIONS = ("cuda-bindings", "cuda-python", "cuda-core", "cuda-pathfinder", "nvmath-python",
                 "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "nvidia-cublas", "nvidia-cublas-cu12",
                 "numpy", "pyzmq", "wasmtime", "msgpack", "psutil", "pytest", "pytest-timeout")


def child_environment(args: list[str]) -> dict[str, Any]:
    """What this run is made of: package versions, the driver's CUDA level, NVRTC's, cuBLAS bindings.

    No context is created (``cuDriverGetVersion`` and ``nvrtcVersion`` need
    none). A newer NVRTC than the driver (a 13.x cubin on a 12.x driver) or
    cuBLAS bindings that do not import (nvmath-python needs cuda-core >= 0.5)
    show here first, by name, instead of as failed kernels further on.
    """
    from importlib import metadata

    out: dict[str, Any] = {"python": sys.version.split()[0], "packages": {}}
    for dist in DISTRIBUTIONS:
        try:
            out["packages"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        err, version = driver().cuDriverGetVersion()
        out["cuda_driver_version"] = f"{int(version) // 1000}.{int(version) % 1000 // 10}" if not err \
            else err_name(err)
    except RuntimeError as exc:  # libcuda missing: the loader's error
        out["cuda_driver_version"] = f"not loadable: {type(exc).__name__}: {exc}"
    try:
        err, major, minor = nvrtc().nvrtcVersion()
        out["nvrtc_version"] = f"{major}.{minor}" if not err else err_name(err)
    except RuntimeError as exc:
        out["nvrtc_version"] = f"not loadable: {type(exc).__name__}: {exc}"
    if os.environ.get("GPU_CHECK_DRIVER_MODULE", "cuda.bindings.driver") != "cuda.bindings.driver":
        out["cublas_bindings"] = "fake (tests.helpers.fake_cublas)"
    else:
        try:
            importlib.import_module("nvmath.bindings.cublas")
            out["cublas_bindings"] = "nvmath.bindings.cublas imports"
        except Exception as exc:  # noqa: BLE001 - reported by name: the GEMM rows will say cuBLAS missing
            out["cublas_bindings"] = f"not importable: {type(exc).__name__}: {exc}"
    drv_major = str(out["cuda_driver_version"]).split(".")[0]
    rtc_major = str(out["nvrtc_version"]).split(".")[0]
    if drv_major.isdigit() and rtc_major.isdigit() and int(rtc_major) > int(drv_major):
        out["warning"] = (f"NVRTC {out['nvrtc_version']} is newer than the driver's CUDA {out['cuda_driver_version']}:"
                          " its cubins and PTX may not load (install the nvidia-cuda-nvrtc of the driver's major)")
    return out


def child_sleep(args: list[str]) -> dict[str, Any]:
    """Sleep ``args[0]`` seconds (the check's own tests: a child that hangs must not hang the check)."""
    time.sleep(float(args[0]) if args else 3600.0)
    return {"slept": True}


CHILDREN: dict[str, Callable[[list[str]], dict[str, Any]]] = {
    "environment": child_environment,
    "sleep": child_sleep,
    "pool": child_pool,
    "nocall": child_nocall,
    "meminfo": child_meminfo,
    "holder": child_holder,
    "isolation_writer": child_isolation_writer,
    "isolation_reader": child_isolation_reader,
    "kernels": child_kernels,
    "timing": child_timing,
}


def run(name: str, args: list[str]) -> int:
    """Entry of a child process: run one step, print its result as the last JSON line."""
    print(json.dumps(CHILDREN[name](args)), flush=True)
    return 0
