"""The hardware check of the cuda backend (run by tests/gpu/check.sh; see ../shared/GPU.md).

    python3 tests/gpu/check_gpu.py [--mps] [--quick]

The orchestrator (this process) never initialises CUDA: every step that
touches the driver runs as ``check_gpu.py --phase NAME`` in a fresh child
process and prints one JSON line, and the supervisor steps go through a real
supervisor started with ``launch()``. What it shows:

1. pool ``maxSize`` is a hard cap (128 MiB refused under a 64 MiB cap,
   8 MiB steps stop at the cap), and ``RELEASE_THRESHOLD`` alone caps nothing;
2. a metered refusal makes no CUDA call (the driver module wrapped in a
   call counter); two tenants in their own worker processes: one over its
   cap gets ``GpuMemoryExhausted``, the other is unaffected; SIGKILL one and
   its counters are zeroed and ``cuMemGetInfo`` shows the memory back;
3. ``python3 -m pytest -m gpu -q tests/gpu``;
4. timings: cuInit + context + stream + pool per worker, metered alloc+free
   against raw ``cuMemAllocFromPoolAsync`` + ``cuMemFreeAsync`` (target:
   metering adds <= 10 %), the kernels against numpy, a tensor op through
   the WASM host (when ``worker.wasm`` is present);
5. with ``--mps``: a private MPS daemon, one tenant with ``isolation="mps"``,
   and the daemon stopped again whatever happens.

It prints a JSON summary, then a short table last. Exit code 0 when every
check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20


# =================================================================== child phases (CUDA inside)


def _driver() -> Any:
    """The real driver module (``--dry-run-fake`` swaps in tests.helpers.fake_cuda to test this script)."""
    import importlib

    return importlib.import_module(os.environ.get("GPU_CHECK_DRIVER_MODULE", "cuda.bindings.driver"))


def _nvrtc() -> Any:
    import importlib

    return importlib.import_module(os.environ.get("GPU_CHECK_NVRTC_MODULE", "cuda.bindings.nvrtc"))


def _ok(call: str, result: tuple[Any, ...]) -> Any:
    err = result[0]
    if err:
        d = _driver()
        _, name = d.cuGetErrorName(err)
        raise RuntimeError(f"{call} failed: {name.decode() if name else int(err)}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def _err_name(err: Any) -> str:
    return "CUDA_SUCCESS" if not err else str(getattr(err, "name", int(err)))


def phase_pool() -> dict[str, Any]:
    """maxSize refuses; RELEASE_THRESHOLD does not."""
    d = _driver()
    _ok("cuInit", d.cuInit(0))
    dev = _ok("cuDeviceGet", d.cuDeviceGet(0))
    ctx = _ok("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(dev))
    _ok("cuCtxSetCurrent", d.cuCtxSetCurrent(ctx))
    stream = _ok("cuStreamCreate", d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)))
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = int(_ok("granularity", d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def pool(max_size: int, threshold: int | None) -> Any:
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        props.maxSize = max_size
        p = _ok("cuMemPoolCreate", d.cuMemPoolCreate(props))
        if threshold is not None:
            _ok("cuMemPoolSetAttribute", d.cuMemPoolSetAttribute(
                p, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(threshold)))
        return p

    def drain(p: Any, ptrs: list[Any]) -> None:
        for ptr in ptrs:
            _ok("cuMemFreeAsync", d.cuMemFreeAsync(ptr, stream))
        _ok("cuStreamSynchronize", d.cuStreamSynchronize(stream))
        _ok("cuMemPoolDestroy", d.cuMemPoolDestroy(p))

    out: dict[str, Any] = {"granularity": gran}
    capped = pool(64 * MiB, None)
    err, ptr = d.cuMemAllocFromPoolAsync(128 * MiB, capped, stream)
    out["cap64_alloc128"] = _err_name(err)
    ptrs = [ptr] if not err else []
    steps, last = 0, "CUDA_SUCCESS"
    for _ in range(64):
        err, ptr = d.cuMemAllocFromPoolAsync(8 * MiB, capped, stream)
        if err:
            last = _err_name(err)
            break
        ptrs.append(ptr)
        steps += 1
    out["cap64_steps_of_8mib"] = steps
    out["cap64_step_error"] = last
    drain(capped, ptrs)
    threshold_only = pool(0, 64 * MiB)
    err, ptr = d.cuMemAllocFromPoolAsync(128 * MiB, threshold_only, stream)
    out["threshold64_alloc128"] = _err_name(err)
    err2, ptr2 = d.cuMemAllocFromPoolAsync(256 * MiB, threshold_only, stream)
    out["threshold64_alloc256_more"] = _err_name(err2)
    drain(threshold_only, [p for e, p in ((err, ptr), (err2, ptr2)) if not e])
    _ok("cuStreamDestroy", d.cuStreamDestroy(stream))
    _ok("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev))
    _, raw = d.cuDeviceGetName(256, dev)
    _, version = d.cuDriverGetVersion()
    out["device_name"] = raw.split(b"\0", 1)[0].decode(errors="replace")
    out["driver_version"] = int(version)
    return out


class _Counting:
    """The real driver module, counting calls (for "no CUDA call on refusal")."""

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


def phase_nocall() -> dict[str, Any]:
    from shared.errors import GpuMemoryExhausted
    from shared.quota import QuotaBlock
    from worker.allocator import MeteredAllocator
    from worker.backends.cuda import CudaBackend

    proxy = _Counting(_driver())
    out: dict[str, Any] = {}
    with QuotaBlock.create("gpucheck", gpu_memory_bytes_cap=64 * MiB) as block:
        backend = CudaBackend(0, gpu_cap_bytes=64 * MiB, driver=proxy)
        alloc = MeteredAllocator("gpucheck", block, backend)
        try:
            alloc.alloc(48 * MiB)
            before = proxy.count
            try:
                alloc.alloc(32 * MiB)
                out["refused"] = False
            except GpuMemoryExhausted:
                out["refused"] = True
            out["cuda_calls_during_refusal"] = proxy.count - before
            out["gpu_bytes_in_use"] = block.gpu_bytes_in_use
            # driver OOM after a successful consume: meter off (cap None) but pool capped at 64 MiB
            block.set_limits(gpu_memory_bytes_cap=None)
            try:
                alloc.alloc(32 * MiB)
                out["driver_refused"] = False
            except GpuMemoryExhausted as exc:
                out["driver_refused"] = "CUDA_ERROR_OUT_OF_MEMORY" in str(exc)
            out["gpu_bytes_after_driver_oom"] = block.gpu_bytes_in_use
        finally:
            alloc.free_all()
            backend.close()
    return out


def phase_meminfo() -> dict[str, Any]:
    d = _driver()
    _ok("cuInit", d.cuInit(0))
    dev = _ok("cuDeviceGet", d.cuDeviceGet(0))
    ctx = _ok("retain", d.cuDevicePrimaryCtxRetain(dev))
    _ok("set", d.cuCtxSetCurrent(ctx))
    free, total = _ok("cuMemGetInfo", d.cuMemGetInfo())
    d.cuDevicePrimaryCtxRelease(dev)
    return {"free": int(free), "total": int(total)}


def phase_timing(iterations: int) -> dict[str, Any]:
    import numpy as np

    from shared.device_budget import DeviceBudget
    from shared.quota import QuotaBlock
    from worker.allocator import MeteredAllocator
    from worker.backends.cuda import CudaBackend

    out: dict[str, Any] = {}
    d = _driver()
    t0 = time.perf_counter()
    _ok("cuInit", d.cuInit(0))
    out["cuinit_ms"] = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    backend = CudaBackend(0, gpu_cap_bytes=1 << 30, driver=_driver(), nvrtc=_nvrtc())
    out["ready_ms"] = (time.perf_counter() - t0) * 1000  # primary context + stream + pool
    t0 = time.perf_counter()
    second = CudaBackend(0, gpu_cap_bytes=1 << 30, driver=_driver(), nvrtc=_nvrtc())
    out["second_ready_ms"] = (time.perf_counter() - t0) * 1000
    second.close()
    pool, stream = backend._pool, backend._stream
    alloc_async, free_async, sync = d.cuMemAllocFromPoolAsync, d.cuMemFreeAsync, d.cuStreamSynchronize
    size = MiB
    with QuotaBlock.create("gpucheck", gpu_memory_bytes_cap=1 << 30) as blk, \
            DeviceBudget.create(0, 1 << 34) as owner:
        block = QuotaBlock.attach(blk.name, instance=0)
        budget = DeviceBudget.attach(owner.name)
        metered = MeteredAllocator("gpucheck", block, backend, budget=budget)

        def raw() -> None:
            for _ in range(iterations):
                err, ptr = alloc_async(size, pool, stream)
                if err:
                    raise RuntimeError(_err_name(err))
                free_async(ptr, stream)
            sync(stream)

        def unmetered() -> None:
            for _ in range(iterations):
                backend.free(backend.alloc(size))
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
    # kernels vs numpy
    n = 16 * 1024 * 1024 + 3
    rng = np.random.default_rng(1)
    xs = rng.standard_normal(n).astype(np.float32)
    ys = rng.standard_normal(n).astype(np.float32)
    x, y = backend.alloc(4 * n), backend.alloc(4 * n)
    backend.write(x, 0, memoryview(xs.tobytes()))
    backend.write(y, 0, memoryview(ys.tobytes()))
    t0 = time.perf_counter()
    backend.kernels()
    out["nvrtc_compile_ms"] = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    backend.axpy_f32(n, 0.75, x, y)
    out["axpy_16m_ms"] = (time.perf_counter() - t0) * 1000
    want = ys + np.float32(0.75) * xs
    got = np.frombuffer(backend.read(y, 0, 4 * n), np.float32)
    out["axpy_matches_numpy"] = bool(np.array_equal(got, want))
    t0 = time.perf_counter()
    total = backend.sum_f32(y, n)
    out["sum_16m_ms"] = (time.perf_counter() - t0) * 1000
    ref = float(np.sum(want, dtype=np.float64))
    out["sum_rel_error_vs_float64"] = abs(total - ref) / max(1.0, float(np.abs(want).sum()))
    out["sum_matches_numpy"] = out["sum_rel_error_vs_float64"] < 1e-6
    backend.fill_f32(y, 1.5, n)
    out["fill_matches"] = bool(np.all(np.frombuffer(backend.read(y, 0, 4 * n), np.float32) == 1.5))
    out["kernel_arch"] = backend.kernels().arch
    backend.close()
    return out


PHASES: dict[str, Callable[..., dict[str, Any]]] = {
    "pool": phase_pool,
    "nocall": phase_nocall,
    "meminfo": phase_meminfo,
    "timing": phase_timing,
}


# =================================================================== orchestrator (no CUDA here)


def run_phase(name: str, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, __file__, "--phase", name, *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"phase {name} exit {proc.returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def two_tenants() -> dict[str, Any]:
    from shared.errors import GpuMemoryExhausted
    from shared.spec import TenantSpec
    from supervisor.launch import launch

    out: dict[str, Any] = {}
    settings = {"backend": "cuda", "pool_size": 0, "heartbeat_interval_s": 0.5, "device_reserve_bytes": "1GiB"}
    with launch({"supervisor": settings}) as sup:
        c = sup.client
        out["backend_reason"] = c.status()["supervisor"]["backend_reason"]
        a = c.register(None, TenantSpec("alpha", gpu_memory_bytes_cap=256 * MiB, restart="never"))
        b = c.register(None, TenantSpec("beta", gpu_memory_bytes_cap=256 * MiB))
        c.alloc(a, 192 * MiB)
        try:
            c.alloc(a, 128 * MiB)
            out["alpha_over_cap_refused"] = False
        except GpuMemoryExhausted:
            out["alpha_over_cap_refused"] = True
        hb = c.alloc(b, 192 * MiB)
        c.write(b, hb, b"beta unaffected", offset=1000)
        out["beta_unaffected"] = c.read(b, hb, 15, offset=1000) == b"beta unaffected"
        status = c.status()
        recs = {t["tenant_id"]: t for t in status["tenants"]}
        out["alpha_refusals"] = recs["alpha"]["quota"]["gpu_refusals"]
        out["beta_refusals"] = recs["beta"]["quota"]["gpu_refusals"]
        out["budget_used_before_kill"] = status["devices"][0]["budget_used_bytes"]
        before = run_phase("meminfo")
        pid = recs["alpha"]["instances"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = c.status()
            alpha = next(t for t in st["tenants"] if t["tenant_id"] == "alpha")
            if alpha["gpu_bytes_in_use"] == 0 and st["devices"][0]["budget_used_bytes"] == 192 * MiB:
                break
            time.sleep(0.1)
        out["alpha_counter_zeroed"] = alpha["gpu_bytes_in_use"] == 0
        out["budget_used_after_kill"] = st["devices"][0]["budget_used_bytes"]
        time.sleep(1.0)  # let the driver finish tearing the dead context down
        after = run_phase("meminfo")
        if "error" not in before and "error" not in after:
            out["memory_returned_mib"] = (after["free"] - before["free"]) / MiB
        else:
            out["memory_error"] = before.get("error") or after.get("error")
    return out


def wasm_op() -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("worker.wasm") is None:
        return {"skipped": "worker.wasm not present"}
    guest = ROOT / "worker" / "guests" / "axpy_sum.wat"
    if not guest.exists():
        return {"skipped": "worker/guests/axpy_sum.wat not present"}
    import numpy as np

    from shared.spec import TenantSpec
    from supervisor.launch import launch

    n = 1 << 20
    xs = np.arange(n, dtype=np.float32) / n
    ys = np.ones(n, dtype=np.float32)
    with launch({"supervisor": {"backend": "cuda", "pool_size": 0}}) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("wasm", gpu_memory_bytes_cap=64 * MiB))
        hx, hy = c.alloc(cap, 4 * n), c.alloc(cap, 4 * n)
        c.write(cap, hx, xs.tobytes())
        times = []
        result: dict[str, Any] = {}
        digest = c.put_module(cap, guest.read_bytes())
        for _ in range(5):
            c.write(cap, hy, ys.tobytes())
            t0 = time.perf_counter()
            result = c.run_wasm(cap, digest, "run", [{"handle": hx}, {"handle": hy}, n, 0.5])
            times.append((time.perf_counter() - t0) * 1000)
        want = float(np.sum(ys + np.float32(0.5) * xs, dtype=np.float64))
        got = float(result["results"][0])
        return {"axpy_sum_1m_ms": statistics.median(times), "status": result["results"][1],
                "matches_numpy": abs(got - want) <= 1e-5 * abs(want)}


def mps_check() -> dict[str, Any]:
    from shared.spec import TenantSpec
    from supervisor.launch import launch

    pipe = tempfile.mkdtemp(prefix="twt-mps-pipe-", dir="/tmp")
    logs = tempfile.mkdtemp(prefix="twt-mps-log-", dir="/tmp")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    out: dict[str, Any] = {}
    started = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=30)
    if started.returncode:
        return {"error": f"nvidia-cuda-mps-control -d failed: {started.stderr.strip()}"}
    try:
        time.sleep(1.0)
        with launch({"supervisor": {"backend": "cuda", "pool_size": 0}}, env=env) as sup:
            c = sup.client
            cap = c.register(None, TenantSpec("mps", isolation="mps", gpu_memory_bytes_cap=256 * MiB,
                                              sm_percentage=50))
            c.register(None, TenantSpec("proc", isolation="process"))
            h = c.alloc(cap, 128 * MiB)
            c.write(cap, h, b"mps", offset=0)
            out["mps_tenant_works"] = c.read(cap, h, 3) == b"mps"
            out["isolation"] = {t["tenant_id"]: t["isolation"] for t in c.status()["tenants"]}
        clients = subprocess.run(["bash", "-c", "echo get_server_list | nvidia-cuda-mps-control"], env=env,
                                 capture_output=True, text=True, timeout=30)
        out["server_list"] = clients.stdout.strip()
    finally:
        subprocess.run(["bash", "-c", "echo quit | nvidia-cuda-mps-control"], env=env, capture_output=True,
                       timeout=60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--mps", action="store_true", help="also run the MPS check (starts a private daemon)")
    parser.add_argument("--quick", action="store_true", help="fewer timing iterations")
    parser.add_argument("--dry-run-fake", action="store_true",
                        help="run this script against the fake driver (tests the script, proves nothing)")
    args = parser.parse_args()
    if args.dry_run_fake:
        fake = "tests.helpers.fake_cuda"
        os.environ.update(GPU_CHECK_DRIVER_MODULE=fake, GPU_CHECK_NVRTC_MODULE=fake,
                          TWT_CUDA_DRIVER_MODULE=fake, TWT_CUDA_NVRTC_MODULE=fake)
    if args.phase:
        fn = PHASES[args.phase]
        result = fn(args.iterations) if args.phase == "timing" else fn()
        print(json.dumps(result))
        return 0

    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    rows: list[tuple[str, str, str, bool | None]] = []

    def step(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a failed step is reported, the others still run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        summary[name] = result
        print(f"# {name}: {json.dumps(result)}", flush=True)
        return result

    pool = step("pool", lambda: run_phase("pool"))
    summary["device"] = pool.get("device_name")
    summary["driver_version"] = pool.get("driver_version")
    rows.append(("maxSize 64 MiB, alloc 128 MiB", str(pool.get("cap64_alloc128")), "CUDA_ERROR_OUT_OF_MEMORY",
                 pool.get("cap64_alloc128") == "CUDA_ERROR_OUT_OF_MEMORY"))
    steps = pool.get("cap64_steps_of_8mib")
    rows.append(("maxSize 64 MiB, 8 MiB steps", f"{steps} then {pool.get('cap64_step_error')}", "<= 8, then OOM",
                 isinstance(steps, int) and 0 < steps <= 8 and pool.get("cap64_step_error") == "CUDA_ERROR_OUT_OF_MEMORY"))
    rows.append(("RELEASE_THRESHOLD 64 MiB only, alloc 128+256", f"{pool.get('threshold64_alloc128')}, "
                 f"{pool.get('threshold64_alloc256_more')}", "both succeed (not a cap)",
                 pool.get("threshold64_alloc128") == pool.get("threshold64_alloc256_more") == "CUDA_SUCCESS"))
    nocall = step("nocall", lambda: run_phase("nocall"))
    rows.append(("metered refusal: CUDA calls", str(nocall.get("cuda_calls_during_refusal")), "0",
                 nocall.get("refused") is True and nocall.get("cuda_calls_during_refusal") == 0))
    rows.append(("driver OOM after consume: rolled back", f"{nocall.get('driver_refused')}, "
                 f"{nocall.get('gpu_bytes_after_driver_oom')} B", "True, 48 MiB left",
                 nocall.get("driver_refused") is True and nocall.get("gpu_bytes_after_driver_oom") == 48 * MiB))
    two = step("two_tenants", two_tenants)
    rows.append(("tenant over cap / neighbour", f"{two.get('alpha_over_cap_refused')} / {two.get('beta_unaffected')}",
                 "True / True", two.get("alpha_over_cap_refused") is True and two.get("beta_unaffected") is True))
    returned = two.get("memory_returned_mib")
    rows.append(("SIGKILL: counters zeroed, memory back",
                 f"{two.get('alpha_counter_zeroed')}, {returned if returned is None else round(returned)} MiB",
                 "True, >= 192 MiB", two.get("alpha_counter_zeroed") is True and (returned or 0) >= 190))
    tests = step("pytest_gpu", lambda: _pytest())
    rows.append(("pytest -m gpu", tests.get("summary", tests.get("error", "")), "all passed", tests.get("ok")))
    timing = step("timing", lambda: run_phase("timing", "--iterations", "500" if args.quick else str(args.iterations)))
    rows.append(("cuInit / ctx+stream+pool ready", f"{_f(timing.get('cuinit_ms'))} / {_f(timing.get('ready_ms'))} ms",
                 "per worker", None if "error" not in timing else False))
    ratio = timing.get("metered_over_raw")
    rows.append(("alloc+free raw / backend / metered", f"{_f(timing.get('raw_us'))} / {_f(timing.get('backend_us'))} / "
                 f"{_f(timing.get('metered_us'))} us", "metered <= 1.10x raw",
                 None if ratio is None else ratio <= 1.10))
    rows.append(("metered / raw", _f(ratio, 3) + "x", "<= 1.10x", None if ratio is None else ratio <= 1.10))
    rows.append(("kernels vs numpy (16M floats)", f"axpy {timing.get('axpy_matches_numpy')}, sum "
                 f"{timing.get('sum_matches_numpy')}, fill {timing.get('fill_matches')}", "True",
                 all(timing.get(k) is True for k in ("axpy_matches_numpy", "sum_matches_numpy", "fill_matches"))))
    wasm = step("wasm", wasm_op)
    rows.append(("WASM axpy+sum 1M floats", wasm.get("skipped") or f"{_f(wasm.get('axpy_sum_1m_ms'))} ms, "
                 f"match {wasm.get('matches_numpy')}", "matches numpy",
                 None if "skipped" in wasm else wasm.get("matches_numpy") is True))
    # issue 18: the WASM ABI's tensor ops (every op vs numpy; GEMM via WASM vs cuBLAS, informative)
    from tests.gpu.phase_tensor_ops import run_in_child as tensor_ops_phase, table_rows as tensor_ops_rows

    ops = step("tensor_ops", lambda: tensor_ops_phase(quick=args.quick))
    rows += tensor_ops_rows(ops)
    if args.mps:
        mps = step("mps", mps_check)
        rows.append(("MPS tenant (private daemon)", str(mps.get("mps_tenant_works", mps.get("error"))), "True",
                     mps.get("mps_tenant_works") is True))
    print(json.dumps(summary, indent=1, default=str))
    print()
    print(f"GPU check - {summary.get('device')} - driver {summary.get('driver_version')} - {summary['date']}")
    width = max(len(r[0]) for r in rows)
    for name, got, want, ok in rows:
        mark = "ok  " if ok else ("----" if ok is None else "FAIL")
        print(f"{mark} {name:<{width}}  {got}   (want {want})")
    return 0 if all(ok is not False for *_, ok in rows) else 1


def _f(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def _pytest() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "gpu")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"ok": proc.returncode == 0 and "skipped" not in last, "summary": last,
            "output_tail": proc.stdout.strip().splitlines()[-15:] if proc.returncode else []}


if __name__ == "__main__":
    sys.exit(main())
