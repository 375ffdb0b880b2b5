"""The cuda backend on a real NVIDIA GPU (``-m gpu``; run by tests/gpu/check.sh).

Skipped only when no device is present: cuda-bindings missing, libcuda
missing (the probe's "CUDA driver not loadable"), or no device
(``CUDA_ERROR_NO_DEVICE`` / zero devices). Any other probe failure runs the
tests, which then fail: a broken driver must not look like "no GPU".

These tests run CUDA in the pytest process (never forked afterwards:
supervisors are started with ``launch()``, i.e. fork+exec).
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shared.errors import GpuMemoryExhausted
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from supervisor.lifecycle.backend_select import probe_cuda
from tests.helpers.cluster import FAST, tenant, wait_for
from worker.allocator import MeteredAllocator
from worker.backends.base import DeviceOutOfMemory
from worker.backends.cuda import CudaBackend

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

MiB = 1 << 20
_NO_DEVICE = ("cuda-bindings not importable", "CUDA driver not loadable", "no CUDA device", "CUDA_ERROR_NO_DEVICE")


@functools.cache
def _probe() -> dict[str, Any]:
    return probe_cuda()


@pytest.fixture(autouse=True)
def _device_present() -> None:
    probe = _probe()
    reason = str(probe.get("reason", ""))
    if not probe.get("ok") and any(marker in reason for marker in _NO_DEVICE):
        pytest.skip(f"no NVIDIA GPU here: {reason}")


@pytest.fixture
def cuda_backend() -> Iterator[CudaBackend]:
    b = CudaBackend(0, gpu_cap_bytes=64 * MiB)
    yield b
    b.close()


def test_pool_max_size_is_a_hard_cap(cuda_backend: CudaBackend) -> None:
    assert cuda_backend.pool_max_size == 64 * MiB
    with pytest.raises(DeviceOutOfMemory, match="CUDA_ERROR_OUT_OF_MEMORY"):
        cuda_backend.alloc(128 * MiB)
    bufs = []
    with pytest.raises(DeviceOutOfMemory):
        for _ in range(64):
            bufs.append(cuda_backend.alloc(8 * MiB))
    assert len(bufs) == 8  # 8 MiB is whole granules: an earlier refusal would be the pool's own rounding
    for buf in bufs:
        cuda_backend.free(buf)
    # the whole cap once freed - after a synchronize, as a tenant's next request brings one (every copy
    # and kernel waits for its stream): stream-ordered frees complete there, and the pool may then
    # reuse (or release and remap) those 8 MiB blocks for one 64 MiB block under the same maxSize
    cuda_backend._drv.call("cuStreamSynchronize", cuda_backend._stream)
    cuda_backend.free(cuda_backend.alloc(64 * MiB))


def test_release_threshold_alone_does_not_cap() -> None:
    b = CudaBackend(0, release_threshold=64 * MiB)
    try:
        assert b.pool_max_size == 0
        assert b.pool_attribute("RELEASE_THRESHOLD") == 0  # reported, never set by the backend
        d = b._drv.mod
        b._drv.call("cuMemPoolSetAttribute", b._pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    d.cuuint64_t(64 * MiB))
        bufs = [b.alloc(128 * MiB), b.alloc(256 * MiB)]  # past the threshold: fine
        assert b.pool_attribute("RELEASE_THRESHOLD") == 64 * MiB
        for buf in bufs:
            b.free(buf)
    finally:
        b.close()


def test_freed_memory_goes_back_to_the_device(cuda_backend: CudaBackend) -> None:
    free_before = cuda_backend.mem_info()[0]
    buf = cuda_backend.alloc(48 * MiB)
    cuda_backend.free(buf)
    cuda_backend.reclaim()  # cuStreamSynchronize + cuMemPoolTrimTo(pool, 0)
    assert cuda_backend.pool_attribute("RESERVED_MEM_CURRENT") == 0
    assert abs(cuda_backend.mem_info()[0] - free_before) <= 8 * MiB  # other processes may move it a little


def test_the_primary_context_sleeps_on_waits(cuda_backend: CudaBackend) -> None:
    flags = int(cuda_backend._drv.call("cuCtxGetFlags"))
    assert flags & 7 == 4  # CU_CTX_SCHED_BLOCKING_SYNC


def test_queued_work_is_bounded_and_drained_at_run_end(cuda_backend: CudaBackend) -> None:
    import time

    x = cuda_backend.alloc(64 * MiB)
    cuda_backend.begin_run(time.monotonic() + 60)
    for _ in range(400):
        cuda_backend.add_f32(x, x, x, 16 * MiB)
    assert len(cuda_backend._inflight) <= 4
    cuda_backend.end_run(time.monotonic() + 60)
    assert int(cuda_backend._drv.mod.cuStreamQuery(cuda_backend._stream)[0]) == 0  # idle
    cuda_backend.free(x)


def test_metered_refusal_makes_no_cuda_call() -> None:
    from tests.gpu.check_gpu import _Counting

    from cuda.bindings import driver

    proxy = _Counting(driver)
    with QuotaBlock.create("gpu-test", gpu_memory_bytes_cap=64 * MiB) as block:
        b = CudaBackend(0, gpu_cap_bytes=64 * MiB, driver=proxy)
        alloc = MeteredAllocator("gpu-test", block, b)
        try:
            alloc.alloc(48 * MiB)
            before = proxy.count
            with pytest.raises(GpuMemoryExhausted):
                alloc.alloc(32 * MiB)
            assert proxy.count == before
            block.set_limits(gpu_memory_bytes_cap=None)  # now only the pool's maxSize stands
            with pytest.raises(GpuMemoryExhausted, match="CUDA_ERROR_OUT_OF_MEMORY"):
                alloc.alloc(32 * MiB)
            assert block.gpu_bytes_in_use == 48 * MiB  # the driver's refusal was rolled back
        finally:
            alloc.free_all()
            b.close()
        assert block.gpu_bytes_in_use == 0


@pytest.mark.parametrize("n", [1, 1000, 1 << 20, (1 << 22) + 3])
def test_copies_and_kernels_match_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    xs = rng.standard_normal(n).astype(np.float32)
    ys = rng.standard_normal(n).astype(np.float32)
    b = CudaBackend(0, gpu_cap_bytes=256 * MiB)
    try:
        x, y = b.alloc(4 * n), b.alloc(4 * n)
        b.write(x, 0, memoryview(xs.tobytes()))
        assert b.read(x, 0, 4 * n) == xs.tobytes()
        b.fill_f32(y, -2.5, n)
        assert np.all(np.frombuffer(b.read(y, 0, 4 * n), np.float32) == -2.5)
        b.write(y, 0, memoryview(ys.tobytes()))
        b.axpy_f32(n, 0.3, x, y)
        want = ys + np.float32(0.3) * xs
        assert np.array_equal(np.frombuffer(b.read(y, 0, 4 * n), np.float32), want)
        b.axpy_f32(n, 2.0, y, y)
        want = want + np.float32(2.0) * want
        assert np.array_equal(np.frombuffer(b.read(y, 0, 4 * n), np.float32), want)
        ref = float(np.add.reduce(want, dtype=np.float32))
        scale = float(np.abs(want).sum())
        assert b.sum_f32(y, n) == pytest.approx(ref, abs=max(1e-6, 1e-6 * scale))
        out = bytearray(8)
        b.read_into(y, 4, memoryview(out))
        assert bytes(out) == want.tobytes()[4:12]
    finally:
        b.close()


def test_close_releases_the_primary_context() -> None:
    from cuda.bindings import driver

    b = CudaBackend(0, gpu_cap_bytes=8 * MiB)
    b.alloc(MiB)
    dev = b._dev
    err, _, active = driver.cuDevicePrimaryCtxGetState(dev)
    assert not err and active
    b.close()
    err, _, active = driver.cuDevicePrimaryCtxGetState(dev)
    assert not err and not active  # nothing else in this process holds it


def test_supervisor_on_the_gpu_end_to_end() -> None:
    from supervisor.client.launch import launch

    with launch({"supervisor": {**FAST, "backend": "cuda"}}) as sup:
        c = sup.client
        st = c.status()
        assert st.supervisor.backend == "cuda" and "CUDA driver" in st.supervisor.backend_reason
        a = c.register(None, TenantSpec("a", gpu_memory_bytes_cap=64 * MiB, restart="never"))
        b = c.register(None, TenantSpec("b", gpu_memory_bytes_cap=64 * MiB))
        c.alloc(a, 48 * MiB)
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(a, 32 * MiB)
        hb = c.alloc(b, 48 * MiB)
        c.write(b, hb, b"fine", offset=0)
        assert c.read(b, hb, 4) == b"fine"
        pid = tenant(c.status(), "a").instances[0].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: tenant(c.status(), "a").gpu_bytes_in_use == 0, timeout_s=30, what="reclaim")
        wait_for(lambda: c.status().devices[0].budget_used_bytes == 48 * MiB, timeout_s=30,
                 what="device budget back")
        assert tenant(c.status(), "b").gpu_bytes_in_use == 48 * MiB


def test_a_kernel_fault_is_sticky_for_the_rest_of_the_process() -> None:
    """In a child process: a sticky error must not reach this pytest process's context."""
    import subprocess
    import sys

    code = (
        "from worker.backends.cuda import CudaBackend\n"
        "from shared.errors import CudaError\n"
        "b = CudaBackend(0, gpu_cap_bytes=8 << 20)\n"
        "buf = b.alloc(1 << 20)\n"
        "try:\n"
        "    b.inject_kernel_fault()\n"
        "except CudaError as exc:\n"
        "    print('fault', exc.result_name)\n"
        "try:\n"
        "    b.write(buf, 0, memoryview(b'x' * 8))\n"
        "    print('after', 'CUDA_SUCCESS')\n"
        "except CudaError as exc:\n"
        "    print('after', exc.result_name)\n"
        "print('lost', b.context_lost)\n"
        "b.close()\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["fault"] in ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED")
    assert lines["after"] == lines["fault"]  # sticky: the next call fails the same way
    assert lines["lost"] == lines["fault"]
