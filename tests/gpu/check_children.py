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
import sys
import time
from typing import Any
from collections.abc import Callable

from shared.cuda_compat import driver_api

MiB = 1 << 20
NONCE_FLOATS = 256  # 1 KiB written by tenant A in the isolation phase
#: an allocation size no granule or alignment divides (3 MiB + 4097 B): the pool's rounding shows
ODD_ALLOC_BYTES = 3 * MiB + 4097
#: the float A fills its buffer with in the residual-data probe (B must never read it back)
RESIDUE_MARK = 1234.5678


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

    api = driver_api(d)  # the pool props' and MAX_POOL_SIZE's shape differ between cuda-bindings 12 and 13

    def pool(max_size: int, threshold: int | None) -> Any:
        p = ok("cuMemPoolCreate", d.cuMemPoolCreate(api.pool_props(d, 0, max_size)))
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
    max_attr = api.max_pool_size_attribute(d)  # None with cuda-bindings 12: not readable there
    out["cap64_max_pool_size_readback"] = None if max_attr is None else int(ok("get", d.cuMemPoolGetAttribute(
        capped, max_attr)))
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
    # odd sizes: the meter counts exact bytes, the pool aligns each allocation and reserves whole
    # granules - how many does a 64 MiB pool grant, and what do USED/RESERVED_MEM_CURRENT say then?
    odd = pool(64 * MiB, None)
    size = ODD_ALLOC_BYTES
    ptrs, steps, last = [], 0, "CUDA_SUCCESS"
    for _ in range(64 * MiB // size + 2):
        err, ptr = d.cuMemAllocFromPoolAsync(size, odd, stream)
        if err:
            last = err_name(err)
            break
        ptrs.append(ptr)
        steps += 1
    attr = d.CUmemPool_attribute
    out["odd_alloc_bytes"] = size
    out["odd_steps"] = steps
    out["odd_step_error"] = last
    out["odd_metered_allowance"] = 64 * MiB // size  # what the meter alone would grant under a 64 MiB cap
    out["odd_used_mem_current"] = int(ok("get", d.cuMemPoolGetAttribute(odd, attr.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)))
    out["odd_reserved_mem_current"] = int(ok("get", d.cuMemPoolGetAttribute(
        odd, attr.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)))
    drain(odd, ptrs)
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
    """Tenant B: allocate first (likely at the very address A got: each process's pool starts alike),
    fill it with B's own pattern, then read its own address and A's - with a copy (``copy``) or a
    kernel (``kernel``), each in a process of its own so a sticky error of one cannot mask the other.
    A's bytes must never come back; at A's address B may only see nothing (an error) or its own."""
    import numpy as np

    addr, nbytes, nonce_sum = int(args[0]), int(args[1]), float(args[2])
    mode = args[3] if len(args) > 3 else "copy"
    be = backend(64 * MiB)
    out: dict[str, Any] = {"mode": mode}
    own_values = np.full(nbytes // 4, 0.25, np.float32)
    own_sum = float(own_values.astype(np.float64).sum())
    own = be.alloc(nbytes)  # B's buffer first, before any probe
    be.write(own, 0, memoryview(own_values.tobytes()))
    out["own_addr"] = own.addr
    out["own_addr_is_a_addr"] = own.addr == addr
    out["own_reads_back"] = be.read(own, 0, nbytes) == own_values.tobytes()

    def verdict(total: float) -> str:
        if abs(total - nonce_sum) < 1e-2:
            return "A's bytes"
        return "B's own bytes" if abs(total - own_sum) < 1e-2 else "other bytes"

    d = be._drv.mod
    if mode == "copy":
        # a copy from A's address through B's context (raw call: no bounds check of ours in the way)
        dest = bytearray(nbytes)
        (err,) = d.cuMemcpyDtoHAsync(dest, addr, nbytes, be._stream)
        if not err:
            (err,) = d.cuStreamSynchronize(be._stream)
        out["copy"] = err_name(err)
        seen = verdict(float(np.frombuffer(bytes(dest), np.float32).astype(np.float64).sum())) if not err else "error"
        out["copy_saw"] = seen
        out["copy_got_a_bytes"] = seen == "A's bytes"
    else:
        # a kernel reading A's address (sum): on hardware an MMU fault (sticky, B's context only) unless
        # B's own buffer is mapped there
        try:
            from worker.backends.cuda import CudaBuffer

            total = be.sum_f32(CudaBuffer(nbytes, addr), nbytes // 4)  # A's address posing as B's buffer
            out["kernel"] = "CUDA_SUCCESS"
            out["kernel_saw"] = verdict(total)
        except Exception as exc:  # noqa: BLE001 - the expected outcome; reported by name
            out["kernel"] = getattr(exc, "result_name", type(exc).__name__)
            out["kernel_saw"] = "error"
        out["kernel_got_a_bytes"] = out["kernel_saw"] == "A's bytes"
    out["context_lost"] = be.context_lost
    be.close()
    return out


def child_residual_writer(args: list[str]) -> dict[str, Any]:
    """Tenant A of the residual-data probe: fill ``args[0]`` MiB with RESIDUE_MARK, report, then on the
    first "go" free it and give it back to the device (cuMemPoolTrimTo), report again, wait for the
    last "go" (or be SIGKILLed holding it: mode ``kill``, decided by the orchestrator)."""
    mib = int(args[0]) if args else 64
    be = backend(None)
    buf = be.alloc(mib * MiB)
    be.fill_f32(buf, RESIDUE_MARK, mib * MiB // 4)
    print(json.dumps({"pid": os.getpid(), "addr": buf.addr, "mib": mib}), flush=True)
    sys.stdin.readline()
    be.free(buf)
    be.reclaim()  # cuStreamSynchronize + cuMemPoolTrimTo(pool, 0): the memory is the device's again
    print(json.dumps({"freed": True, "reserved_after_trim": be.pool_attribute("RESERVED_MEM_CURRENT")}), flush=True)
    sys.stdin.readline()
    be.close()
    return {"closed": True}


def child_residual_reader(args: list[str]) -> dict[str, Any]:
    """Tenant B: allocate ``args[0]`` MiB in 16 MiB buffers *without writing them*, read them back and
    look for A's RESIDUE_MARK. The driver must hand a new process scrubbed memory, never A's bytes."""
    import numpy as np

    mib = int(args[0]) if args else 128
    be = backend(None)
    mark = np.float32(RESIDUE_MARK)
    found = 0
    nonzero = 0
    chunk = min(16, mib)
    bufs = [be.alloc(chunk * MiB) for _ in range(max(1, mib // chunk))]
    for buf in bufs:
        got = np.frombuffer(be.read(buf, 0, chunk * MiB), np.float32)
        found += int(np.count_nonzero(got == mark))
        nonzero += int(np.count_nonzero(got))
    be.close()
    return {"mib": chunk * len(bufs), "mark_floats_found": found, "nonzero_floats": nonzero}


def child_residual_reader_most(args: list[str]) -> dict[str, Any]:
    """Tenant B taking most of the device: ``cuMemGetInfo``'s free memory times ``args[0]`` (0.9),
    allocated in ``args[1]`` MiB buffers (256) *without writing them*, each searched for A's
    RESIDUE_MARK - wherever the driver put A's old pages, B's buffers cover them. Each buffer's max
    and min come from device reductions (the whole device in well under a second); a buffer that is
    not all zeros is read back and its floats counted."""
    import numpy as np

    fraction = float(args[0]) if args else 0.9
    chunk_mib = int(args[1]) if len(args) > 1 else 256
    device_scan = (args[2] if len(args) > 2 else "1") == "1"  # "0": read every buffer back (the fake's
    # reductions run float by float in Python)
    be = backend(None)
    free, total = _mem_info(be)
    want = int(free * fraction) // (chunk_mib * MiB)
    bufs = []
    t0 = time.perf_counter()
    for _ in range(want):
        try:
            bufs.append(be.alloc(chunk_mib * MiB))
        except Exception:  # noqa: BLE001 - the device's last bytes may be the driver's: stop there
            break
    mark = np.float32(RESIDUE_MARK)
    found = nonzero = 0
    piece = min(chunk_mib, 64) * MiB
    floats = chunk_mib * MiB // 4
    read_back = 0
    for buf in bufs:
        if device_scan and _all_zero(be, buf, floats):
            continue
        read_back += 1
        for off in range(0, chunk_mib * MiB, piece):
            got = np.frombuffer(be.read(buf, off, piece), np.float32)
            found += int(np.count_nonzero(got == mark))
            nonzero += int(np.count_nonzero(got))
    seconds = time.perf_counter() - t0
    be.close()
    return {"free_before": int(free), "total": int(total), "fraction": fraction, "mib": chunk_mib * len(bufs),
            "mark_floats_found": found, "nonzero_floats": nonzero, "buffers_read_back": read_back,
            "seconds": seconds}


def _all_zero(be: Any, buf: Any, floats: int) -> bool:
    """Every float of ``buf`` is 0, by two device reductions (max of x and of -x, both 0; a NaN
    anywhere wins a max, so it is never taken for zero)."""
    import numpy as np

    hi, lo = bytearray(4), bytearray(4)
    be.max_f32(buf, floats, memoryview(hi))
    be.scale_f32(buf, -1.0, floats)
    be.max_f32(buf, floats, memoryview(lo))
    be.scale_f32(buf, -1.0, floats)
    return bool(np.frombuffer(bytes(hi), np.float32)[0] == 0 and np.frombuffer(bytes(lo), np.float32)[0] == 0)


def _mem_info(be: Any) -> tuple[int, int]:
    """``cuMemGetInfo`` in the backend's context (the backend has no public call for it)."""
    free, total = be._drv.call("cuMemGetInfo")
    return int(free), int(total)


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
    import statistics  # here: the one step that takes a median (~8 ms of imports in every other child)

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
    out.update(match_cuda_major(str(out["cuda_driver_version"]), str(out["nvrtc_version"]), out["packages"]))
    return out


def match_cuda_major(driver_version: str, nvrtc_version: str, packages: dict[str, str]) -> dict[str, Any]:
    """Do NVRTC and cuBLAS belong to the driver's CUDA major (12 or 13)? ``{"cuda_major", "cublas_major"}``
    and, when not, ``"mismatch"``: one line saying which wheels to carry (check.sh installs
    ``.whl-cu<major>/`` itself when it is there). cuda-bindings 13 loads only ``libnvrtc.so.13``, a
    13.x cubin does not load on a 12.x driver, and cuBLAS 13 needs a 13.x driver: majors must match."""
    out: dict[str, Any] = {}
    drv, rtc = driver_version.split(".")[0], nvrtc_version.split(".")[0]
    if not drv.isdigit():
        out["mismatch"] = f"the CUDA driver is not usable ({driver_version})"
        return out
    major = int(drv)
    out["cuda_major"] = major
    if major not in (12, 13):
        out["mismatch"] = f"the driver's CUDA {driver_version} is neither 12.x nor 13.x: no wheel set for it"
        return out
    cublas = packages.get("nvidia-cublas-cu12") if major == 12 else packages.get("nvidia-cublas")
    other = packages.get("nvidia-cublas") if major == 12 else packages.get("nvidia-cublas-cu12")
    out["cublas_major"] = major if cublas else (int(str(other).split(".")[0]) if other else None)
    wheels = f"carry the CUDA {major} wheel set in .whl-cu{major}/ (docs/GPU-QUOTAS.md, 'Wheels for a device run')"
    if not rtc.isdigit() or int(rtc) != major:
        out["mismatch"] = f"NVRTC {nvrtc_version} does not match the driver's CUDA {driver_version}: {wheels}"
    elif out["cublas_major"] not in (None, major):
        out["mismatch"] = f"cuBLAS {out['cublas_major']}.x does not match the driver's CUDA {driver_version}: {wheels}"
    return out


def child_sleep(args: list[str]) -> dict[str, Any]:
    """Sleep ``args[0]`` seconds (the check's own tests: a child that hangs must not hang the check)."""
    time.sleep(float(args[0]) if args else 3600.0)
    return {"slept": True}


CHILDREN: dict[str, Callable[[list[str]], dict[str, Any]]] = {
    "environment": child_environment,
    "residual_reader_most": child_residual_reader_most,
    "sleep": child_sleep,
    "pool": child_pool,
    "nocall": child_nocall,
    "meminfo": child_meminfo,
    "holder": child_holder,
    "isolation_writer": child_isolation_writer,
    "isolation_reader": child_isolation_reader,
    "residual_writer": child_residual_writer,
    "residual_reader": child_residual_reader,
    "kernels": child_kernels,
    "timing": child_timing,
}


def run(name: str, args: list[str]) -> int:
    """Entry of a child process: run one step, print its result as the last JSON line."""
    print(json.dumps(CHILDREN[name](args)), flush=True)
    return 0
