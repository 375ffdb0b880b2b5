"""The worker's device gate: ops in ~2 ms chunks with unchanged results, timed and charged.

Chunking is forced with a tiny chunk target so that every splittable op runs
in many pieces; results are compared with the same op run whole (bit for
bit for elementwise ops and softmax, within float32 rounding for GEMM). The
cuda path runs against the fake driver: views are pointer offsets, the time
comes from CUDA events on the tenant stream.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.errors import KernelTimeout
from shared.gpu_time import GpuTimeBoard
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from tests.helpers.fake_cublas import FakeCublas
from tests.helpers import timeouts
from tests.helpers.fake_cuda import FakeDriver
from worker.backends.base import Backend, DeviceBuffer
from worker.backends.cuda import CudaBackend
from worker.backends.stub import StubBackend
from worker.chunks import CostModel, plan
from worker.context import TenantContext
from worker.device_time import DeviceGate
from worker.wasm import WasmHost, guest_source

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["stub", "cuda"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    be: Backend
    if request.param == "stub":
        be = StubBackend()
    else:
        fake = FakeDriver(memory_bytes=1 << 30)
        be = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
    try:
        yield be
    finally:
        be.close()


def put(be: Backend, values: Any) -> DeviceBuffer:
    arr = np.ascontiguousarray(values, dtype=np.float32).ravel()
    buf = be.alloc(max(4, arr.nbytes))
    be.write(buf, 0, memoryview(arr.tobytes()))
    return buf


def get(be: Backend, buf: DeviceBuffer, n: int) -> Any:
    return np.frombuffer(be.read(buf, 0, 4 * n), dtype=np.float32).copy()


def whole_and_chunked(be: Backend, block: QuotaBlock, name: str, make: Callable[[], tuple[Any, ...]],
                      result: Callable[[tuple[Any, ...]], Any]) -> tuple[Any, Any, DeviceGate]:
    """Run op ``name`` once whole (straight on the backend) and once through a gate in tiny chunks."""
    args = make()
    getattr(be, name)(*args)
    whole = result(args)
    args = make()
    gate = DeviceGate(block, be, chunk_s=1e-9)  # 1 ns: a row or a few elements a chunk
    chunks_before = gate.chunks
    gate.op(name, getattr(be, name), args)
    assert gate.chunks - chunks_before > 3, "the op was not split"
    return whole, result(args), gate


def test_the_stub_loads_numpy_before_the_first_ops_lease_not_under_it() -> None:
    """A stub op runs under the device lease: a fresh worker whose first op imported numpy held every other
    tenant's device work up for the import. In a fresh process: the backend's construction (a bind)
    imports nothing, and numpy is loaded by the time the gate asks for the lease for the first op."""
    code = (
        "import sys\n"
        "from shared.gpu_time import GpuTimeBoard\nfrom shared.quota import QuotaBlock\n"
        "from worker.backends.stub import StubBackend\nfrom worker.device_time import DeviceGate\n"
        "board = GpuTimeBoard.create(0)\nowner = QuotaBlock.create('np')\n"
        "blk = QuotaBlock.attach(owner.name, instance=0)\n"
        "w = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))\n"
        "be = StubBackend()\nprint('numpy' in sys.modules)\n"
        "gate = DeviceGate(blk, be, w)\nseen = []\nacquire = gate._acquire\n"
        "gate._acquire = lambda *a: seen.append('numpy' in sys.modules) or acquire(*a)\n"
        "buf = be.alloc(256)\ngate.op('scale_f32', be.scale_f32, (buf, 2.0, 64))\nprint(seen[0])\n"
        "gate.release(); gate.close(); w.close(); blk.close(); owner.unlink(); owner.close()\n"
        "board.unlink(); board.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeouts.scaled(60),
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"]


def test_gemm_by_row_blocks_matches_within_rounding(backend: Backend, block: QuotaBlock) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 19)), rng.standard_normal((19, 23))
    m, k, n = 37, 19, 23
    whole, chunked, gate = whole_and_chunked(
        backend, block, "matmul_f32",
        lambda: (put(backend, a), put(backend, b), put(backend, np.zeros(m * n)), m, k, n),
        lambda args: get(backend, args[2], m * n))
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked.reshape(m, n), (a.astype(np.float32) @ b.astype(np.float32)), rtol=1e-4,
                               atol=1e-4)
    gate.close()


@pytest.mark.parametrize("name", ["add_f32", "mul_f32", "unary_f32", "scale_f32", "softmax_rows_f32",
                                  "add_rows_f32", "fill_f32", "axpy_f32"])
def test_elementwise_and_row_ops_split_bit_for_bit(backend: Backend, block: QuotaBlock, name: str) -> None:
    rng = np.random.default_rng(1)
    rows, cols = 29, 13
    x = rng.standard_normal(rows * cols)
    y = rng.standard_normal(rows * cols)
    n = rows * cols
    makers: dict[str, tuple[Callable[[], tuple[Any, ...]], Callable[[tuple[Any, ...]], Any]]] = {
        "add_f32": (lambda: (put(backend, x), put(backend, y), put(backend, np.zeros(n)), n),
                    lambda a: get(backend, a[2], n)),
        "mul_f32": (lambda: (put(backend, x), put(backend, y), put(backend, np.zeros(n)), n),
                    lambda a: get(backend, a[2], n)),
        "unary_f32": (lambda: (2, put(backend, x), put(backend, np.zeros(n)), n), lambda a: get(backend, a[2], n)),
        "scale_f32": (lambda: (put(backend, x), 0.37, n), lambda a: get(backend, a[0], n)),
        "softmax_rows_f32": (lambda: (put(backend, x), rows, cols), lambda a: get(backend, a[0], n)),
        "add_rows_f32": (lambda: (put(backend, x), put(backend, y[:cols]), rows, cols),
                         lambda a: get(backend, a[0], n)),
        "fill_f32": (lambda: (put(backend, x), 2.5, n), lambda a: get(backend, a[0], n)),
        "axpy_f32": (lambda: (n, 0.5, put(backend, x), put(backend, y)), lambda a: get(backend, a[3], n)),
    }
    make, result = makers[name]
    whole, chunked, gate = whole_and_chunked(backend, block, name, make, result)
    np.testing.assert_array_equal(chunked, whole)
    gate.close()


def test_argmax_rows_split_writes_each_rows_answer(block: QuotaBlock) -> None:
    be = StubBackend()
    rng = np.random.default_rng(2)
    rows, cols = 31, 7
    x = rng.standard_normal(rows * cols)
    out = bytearray(4 * rows)
    gate = DeviceGate(block, be, chunk_s=1e-9)
    gate.op("argmax_rows_f32", be.argmax_rows_f32, (put(be, x), rows, cols, memoryview(out)))
    assert gate.chunks > 3
    assert list(np.frombuffer(out, dtype="<i4")) == list(x.reshape(rows, cols).argmax(axis=1))


def test_reductions_and_transpose_split_too(backend: Backend, block: QuotaBlock) -> None:
    """max, argmax and transpose are bit-identical in chunks; sum within float32 rounding."""
    rng = np.random.default_rng(3)
    rows, cols = 41, 17
    x = rng.standard_normal(rows * cols).astype(np.float32)
    gate = DeviceGate(block, backend, chunk_s=1e-9)
    xb = put(backend, x)
    before = gate.chunks
    total = gate.op("sum_f32", backend.sum_f32, (xb, rows * cols))
    assert gate.chunks - before > 3
    assert total == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-5, abs=1e-4)
    out = bytearray(4)
    before = gate.chunks
    gate.op("max_f32", backend.max_f32, (xb, rows * cols, memoryview(out)))
    assert gate.chunks - before > 3
    assert np.frombuffer(out, dtype="<f4")[0] == x.max()
    x[200] = np.nan
    gate.op("max_f32", backend.max_f32, (put(backend, x), rows * cols, memoryview(out)))
    assert np.isnan(np.frombuffer(out, dtype="<f4")[0])  # a NaN still wins
    if backend.transposes_in_blocks:
        t = put(backend, np.zeros(rows * cols))
        before = gate.chunks
        gate.op("transpose_f32", backend.transpose_f32, (put(backend, x), t, rows, cols))
        assert gate.chunks - before > 3
        np.testing.assert_array_equal(get(backend, t, rows * cols).reshape(cols, rows), x.reshape(rows, cols).T)
    gate.close()


def test_a_new_shape_starts_with_a_short_chunk() -> None:
    """Chunk sizes come from a cost model per op and shape: a skinny GEMM after square ones gets a
    first chunk near the target, not one sized by the square GEMMs' ns per row."""
    be = StubBackend()
    costs = CostModel(*be.device_rates())
    square = plan("matmul_f32", be, (put(be, np.ones(4)), put(be, np.ones(4)), put(be, np.ones(4)), 512, 512, 512))
    skinny = plan("matmul_f32", be, (put(be, np.ones(4)), put(be, np.ones(4)), put(be, np.ones(4)), 1 << 20, 8, 8))
    assert square is not None and skinny is not None and square.shape != skinny.shape
    target = 2_000_000
    # the device does 40 GFLOP/s on the square GEMM (2x the model's rate), but a skinny one is
    # memory-bound at 5 GB/s (near the model's 4): sized by the square one's ns per flop, its first
    # chunk would be ~6x the target
    assert be.device_rates() == (2e10, 4e9)
    true_ns = {square.shape: lambda u: u * square.flops / 40.0,
               skinny.shape: lambda u: u * skinny.bytes / 5.0 + skinny.fixed_bytes / 5.0}
    for _ in range(20):
        units = costs.units_for("matmul_f32", square, target, square.units)
        costs.observe("matmul_f32", square, units, int(true_ns[square.shape](units)))
    units = costs.units_for("matmul_f32", skinny, target, skinny.units)
    first = true_ns[skinny.shape](units)
    assert first <= 2 * target
    # what one rate per op name (ns per k*n of a row, learned on the square GEMMs) would have given
    per_name = square.flops / 40.0 / (512 * 512)
    assert true_ns[skinny.shape](target / (per_name * 8 * 8)) > 4 * target
    costs.observe("matmul_f32", skinny, units, int(first))
    units = costs.units_for("matmul_f32", skinny, target, skinny.units)
    assert 0.5 * target <= true_ns[skinny.shape](units) <= 1.5 * target  # corrected by measurement


def test_the_cost_model_keeps_a_bounded_number_of_shapes() -> None:
    be = StubBackend()
    costs = CostModel(*be.device_rates())
    buf = put(be, np.ones(4))
    for cols in range(1, 3000):
        p = plan("softmax_rows_f32", be, (buf, 1, cols))
        assert p is not None
        costs.observe("softmax_rows_f32", p, 1, 1000)
    assert len(costs._factor) <= 1024


def test_refused_ops_are_counted_and_logged_at_a_bounded_rate(block: QuotaBlock,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A capped tenant with no GPU time before its deadline: refused at once (no wait, no spin), every
    later op of the run too; one log line, not one per op."""
    board = GpuTimeBoard.create(0)
    try:
        slot = board.add_tenant(1.0, cap=0.01)
        worker = GpuTimeBoard.attach(board.name, tenant_slot=slot)
        be = StubBackend()
        gate = DeviceGate(block, be, worker)
        x = put(be, np.ones(1 << 16))
        worker.acquire()
        worker.finish(10**9)  # a second of device time: the 1 % cap has nothing left for ~100 s
        # the deadline is far (30 s) but still before the cap's next turn (~100 s): an op that waited for
        # it would take the whole 30 s, so the bound below tells "refused at once" from "waited" on any
        # host, however slowly it runs the 500 refusals
        deadline_s = 30.0
        deadline = time.monotonic_ns() + int(deadline_s * 1e9)
        caplog.set_level("WARNING", logger="twt.worker.device_time")
        t0 = time.monotonic()
        for _ in range(500):
            with pytest.raises(KernelTimeout):
                gate.op("scale_f32", be.scale_f32, (x, 1.0, 1 << 16), deadline)
        assert time.monotonic() - t0 < deadline_s  # none of them waited for the deadline
        assert gate.refused == 500
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
        gate.take_run_totals()
        gate.release()  # the next run is judged afresh
        board.set_policy(slot, cap=None)
        gate.op("scale_f32", be.scale_f32, (x, 1.0, 1 << 16), deadline)
        gate.close()
    finally:
        board.unlink()
        board.close()


def test_ops_are_charged_to_the_tenant_block(backend: Backend, block: QuotaBlock) -> None:
    gate = DeviceGate(block, backend)
    x = put(backend, np.ones(1 << 16))
    before = block.snapshot()
    total = gate.op("sum_f32", backend.sum_f32, (x, 1 << 16))
    assert total == float(1 << 16)
    for _ in range(3):
        gate.op("scale_f32", backend.scale_f32, (x, 1.0, 1 << 16))
    after = block.snapshot()
    assert after.gpu_time_ns > before.gpu_time_ns
    assert after.gpu_ops - before.gpu_ops >= 4
    assert after.gpu_waits - before.gpu_waits == 4  # one wait observed per op (zero: nobody else)
    assert sum(after.gpu_wait_bins) == after.gpu_waits
    busy, wait = gate.take_run_totals()
    assert busy == after.gpu_time_ns - before.gpu_time_ns and wait >= 0
    assert gate.take_run_totals() == (0, 0)
    gate.close()


@pytest.mark.parametrize(("name", "queued"), [("fill_f32", False), ("fill_f32", True), ("scale_f32", False),
                                             ("scale_f32", True), ("gemm_f32", False)])
def test_a_cuda_ops_first_use_loads_before_the_device_lease(block: QuotaBlock, name: str, queued: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's first op of a kind compiles its kernels (NVRTC) or loads cuBLAS: that happens before the
    gate takes the device lease for it, not under it (a compile held every other tenant's device work up)."""
    fake = FakeDriver(memory_bytes=1 << 30)
    blas = FakeCublas(fake)
    be = CudaBackend(driver=fake, nvrtc=fake, cublas=blas)
    board = GpuTimeBoard.create(0)
    try:
        worker = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        gate = DeviceGate(block, be, worker)
        order: list[str] = []
        acquire = gate._acquire

        def lease(*args: Any) -> int:
            order.append("lease")
            return acquire(*args)

        monkeypatch.setattr(gate, "_acquire", lease)
        monkeypatch.setattr(fake, "cuModuleLoadData", _recording(fake.cuModuleLoadData, order, "module"))
        monkeypatch.setattr(blas, "create", _recording(blas.create, order, "cublas"))
        x, y, out = put(be, np.ones(64)), put(be, np.ones(64)), put(be, np.zeros(64))
        ops: dict[str, tuple[Any, tuple[Any, ...]]] = {
            "fill_f32": (be.fill_f32, (x, 2.0, 64)),
            "scale_f32": (be.scale_f32, (x, 2.0, 64)),
            "gemm_f32": (be.gemm_f32, (0, 0, 8, 8, 8, 1.0, x, y, 0.0, out)),
        }
        fn, args = ops[name]
        if queued:
            gate.submit(name, fn, args)  # the device thread takes the lease: the load is the guest thread's
            gate.sync()
        else:
            gate.op(name, fn, args)
        assert "lease" in order and "module" in order, order
        loads = [i for i, what in enumerate(order) if what in ("module", "cublas")]
        assert max(loads) < order.index("lease"), f"a load ran under the lease: {order}"
        if name == "gemm_f32":
            assert "cublas" in order
        gate.op(name, fn, args)  # loaded once: the second op loads nothing
        assert order.count("module") == len([i for i in loads if order[i] == "module"])
        gate.release()
        gate.close()
        worker.close()
    finally:
        be.close()
        board.unlink()
        board.close()


def _recording(fn: Callable[..., Any], order: list[str], what: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        order.append(what)
        return fn(*args, **kwargs)
    return call


def test_cuda_ops_are_timed_with_events_on_the_stream(block: QuotaBlock) -> None:
    fake = FakeDriver(memory_bytes=1 << 30)
    be = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
    try:
        gate = DeviceGate(block, be)
        x = put(be, np.ones(1024))
        gate.op("scale_f32", be.scale_f32, (x, 2.0, 1024))
        assert fake.calls.count("cuEventCreate") == 2
        assert fake.calls.count("cuEventRecord") == 3 and "cuEventElapsedTime" in fake.calls  # start moved once
        assert block.gpu_time_ns > 0
        gate.close()
        assert fake.calls.count("cuEventDestroy") == 2 and not fake.events
    finally:
        be.close()


def test_a_gate_with_a_board_takes_and_gives_back_the_device(block: QuotaBlock) -> None:
    board = GpuTimeBoard.create(0)
    try:
        slot = board.add_tenant(2.0)
        worker = GpuTimeBoard.attach(board.name, tenant_slot=slot)
        be = StubBackend()
        gate = DeviceGate(block, be, worker)
        x = put(be, np.ones(4096))
        gate.op("scale_f32", be.scale_f32, (x, 1.0, 4096))
        assert board.snapshot().holder == worker.worker_slot  # kept between ops of a run
        assert board.used_ns(slot) == block.gpu_time_ns > 0
        gate.release()  # the run ended
        assert board.snapshot().holder is None
        gate.close()
        assert board.snapshot().grants == 1
    finally:
        board.unlink()
        board.close()


def test_a_gate_on_a_host_cpu_device_never_spins_for_the_device(block: QuotaBlock, backend: Backend) -> None:
    """The stub's device is this host's CPU: its workers wait for the lease asleep (a spinning waiter
    would take its CPU share from the holder's device work); a GPU's waiters may spin."""
    board = GpuTimeBoard.create(0)
    try:
        worker = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        gate = DeviceGate(block, backend, worker)
        assert worker.spin is (not isinstance(backend, StubBackend))
        gate.close()
    finally:
        board.unlink()
        board.close()


def test_a_run_whose_deadline_passes_waiting_for_the_device_is_a_timeout() -> None:
    """The lease's holder (another tenant) keeps the device past this run's deadline: the op the
    guest waited in returns an error code (long_job turns it into NaN), but the run is over - the
    client gets ``KernelTimeout``, never the NaN as if it were the run's answer (a chaos campaign on
    a loaded host once reported a healthy tenant's ``long_job`` returning NaN exactly so)."""
    board = GpuTimeBoard.create(0)
    try:
        holder = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        waiter = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant(1.0))
        holder.acquire()  # and never finishes its chunk while the run lasts
        spec = TenantSpec.from_dict({"tenant_id": "waiter", "memory_quota_bytes": 64 << 20,
                                     "gpu_memory_bytes_cap": 64 << 20})
        with QuotaBlock.create("waiter", memory_quota_bytes=64 << 20, gpu_memory_bytes_cap=64 << 20) as owner:
            ctx = TenantContext(spec, 0, 0, QuotaBlock.attach(owner.name, instance=0), StubBackend(), board=waiter)
            host = WasmHost(ctx)
            ctx.extensions[WasmHost.EXTENSION] = host
            try:
                host.compile(guest_source("long_job"))  # no deadline: the run's 0.3 s go to its wait for the device
                compiles = host.stats["compiles"]
                with pytest.raises(KernelTimeout):
                    host.run(guest_source("long_job"), "run", [256, 2], fuel=10**9, timeout_s=0.3)
                assert host.stats["compiles"] == compiles  # (a compile past the deadline is a KernelTimeout too)
                assert owner.gpu_bytes_in_use == 0  # its buffers went with the run
                assert board.snapshot().holder == holder.worker_slot  # the holder kept the device
            finally:
                ctx.close()
        holder.release()
        holder.close()
        waiter.close()
    finally:
        board.unlink()
        board.close()


def test_a_run_refused_device_time_stops_instead_of_spinning(caplog: pytest.LogCaptureFixture) -> None:
    """A capped tenant with no GPU time left before its run's deadline: its first op is refused at
    once, the guest (a GEMM loop that goes on after errors) is stopped at its next loop or call, and
    the run is a timeout."""
    board = GpuTimeBoard.create(0)
    try:
        slot = board.add_tenant(1.0, cap=0.01)
        waiter = GpuTimeBoard.attach(board.name, tenant_slot=slot)
        waiter.acquire()
        waiter.finish(10**9)  # its bucket is ~100 s in debt: nothing before a 30 s deadline
        spec = TenantSpec.from_dict({"tenant_id": "capped", "memory_quota_bytes": 64 << 20,
                                     "gpu_memory_bytes_cap": 64 << 20})
        with QuotaBlock.create("capped", memory_quota_bytes=64 << 20, gpu_memory_bytes_cap=64 << 20) as owner:
            ctx = TenantContext(spec, 0, 0, QuotaBlock.attach(owner.name, instance=0), StubBackend(), board=waiter)
            host = WasmHost(ctx)
            ctx.extensions[WasmHost.EXTENSION] = host
            caplog.set_level("WARNING")
            try:
                with pytest.raises(KernelTimeout):
                    host.run(guest_source("share"), "gemm_loop", [8, 10**7], fuel=10**12, timeout_s=30.0)
                # stopped at its next loop or function entry: the two fills before its loop, no GEMM
                assert ctx.gate.refused == 2
                failed = [r for r in caplog.records if "op_failed" in r.getMessage() or "refused" in r.getMessage()]
                assert len(failed) <= 3  # the gate's one line and the two ops', not one per op
            finally:
                ctx.close()
    finally:
        board.unlink()
        board.close()


def charged_intervals(calls: list[str]) -> list[list[str]]:
    """The driver calls of each chunk, cut after each chunk's ``cuEventElapsedTime`` (the timer reads
    every chunk's pair of events on its own, so a chunk is everything up to and including its read)."""
    chunks: list[list[str]] = [[]]
    for c in calls:
        chunks[-1].append(c)
        if c == "cuEventElapsedTime":
            chunks.append([])
    assert chunks[-1] == [], calls  # nothing after the last chunk's read
    return chunks[:-1]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("name", ["fill_f32", "sum_f32", "max_f32", "argmax_rows_f32", "matmul_f32", "scale_f32"])
def test_cuda_events_are_recorded_right_around_the_device_work(block: QuotaBlock, name: str, split: bool) -> None:
    """The charged interval of every chunk is its launch only: the start event is (re-)recorded right
    before the chunk's first launch (after the launch preparation), the end event right after its
    last, and the chunk's own synchronize or copy of its result to the host comes after the end
    event, not inside. However many chunks an op is cut into (the chunk size follows the measured
    time, so a loaded host cuts an op the quiet one runs whole; ``split`` forces many), each chunk
    holds this on its own."""
    fake = FakeDriver(memory_bytes=1 << 30)
    be = CudaBackend(driver=fake, nvrtc=fake, cublas=FakeCublas(fake))
    try:
        gate = DeviceGate(block, be, chunk_s=1e-9) if split else DeviceGate(block, be)
        x = put(be, np.arange(64, dtype=np.float32))
        y = put(be, np.zeros(64))
        out = memoryview(bytearray(4 * 8))
        args: dict[str, tuple[Any, ...]] = {
            "fill_f32": (x, 1.0, 64), "sum_f32": (x, 64), "max_f32": (x, 64, out[:4]),
            "argmax_rows_f32": (x, 8, 8, out), "matmul_f32": (x, x, y, 8, 8, 8), "scale_f32": (x, 2.0, 64)}
        gate.op(name, getattr(be, name), args[name])  # warm: kernels compiled, cuBLAS loaded
        fake.calls.clear()
        before = gate.chunks
        gate.op(name, getattr(be, name), args[name])
        calls = list(fake.calls)
        chunks = charged_intervals(calls)
        assert len(chunks) == gate.chunks - before, calls  # one pair of events read per chunk
        if split:
            assert len(chunks) > 3, calls
        for chunk in chunks:
            records = [i for i, c in enumerate(chunk) if c == "cuEventRecord"]
            if name == "matmul_f32":  # cuBLAS's own calls are not the driver's: between the start's re-record and the end
                assert chunk == ["cuEventRecord"] * 3 + ["cuEventSynchronize", "cuEventElapsedTime"], calls
                continue
            launches = [i for i, c in enumerate(chunk) if c == "cuLaunchKernel"]
            assert launches and len(records) >= 2, calls
            first, last = launches[0], launches[-1]
            assert chunk[first - 1] == "cuEventRecord" or chunk[first - 1].startswith("cublasSet"), calls
            start = max(i for i in records if i < first)  # the re-record that counts
            end = last + 1  # launched(): the end event is recorded right after the last launch
            assert chunk[end] == "cuEventRecord", calls  # (a later record: the backend's untimed queue mark)
            syncs = [i for i, c in enumerate(chunk) if c in ("cuStreamSynchronize", "cuMemcpyDtoHAsync")]
            assert all(i > end or i < start for i in syncs), calls  # no host sync inside the charged interval
            assert chunk.index("cuEventSynchronize") > end, calls  # the end event is read after it is recorded
        assert block.gpu_time_ns > 0
        gate.close()
    finally:
        be.close()
