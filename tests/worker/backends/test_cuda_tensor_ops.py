"""The WASM ABI's tensor ops on the cuda backend, against the fake driver and the fake cuBLAS.

The same guest calls as test_wasm_tensor_ops (through ``probe.wat`` and a
real WasmHost over a real QuotaBlock), with the cuda backend underneath:
NVRTC-compiled kernels run by the fake driver with numpy, GEMM through the
fake cuBLAS. Checked here: results equal to numpy, the GEMM's workspace comes
from the tenant's metered pool (never cuBLAS's default), a quota with no room
for it still multiplies, a missing cuBLAS is a clear BACKEND failure and
nothing else, cuBLAS errors are typed, and close releases handle, scratch
and module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import BackendUnavailable, CudaError
from shared.log import TextFormatter
from tests.helpers.fake_cublas import FakeCublas, Status
from tests.helpers.fake_cuda import FakeDriver
from tests.helpers.model_ops import ref_unary
from tests.helpers.timeouts import scaled
from tests.helpers.wasm_env import Env, mlp_forward, softmax, tenant_env
from tests.helpers.wasm_env import probe as wasm_probe
from worker.backends._cublas import Cublas
from worker.backends.cuda import CudaBackend
from worker.wasm import WasmSession
from worker.wasm.tensor_abi import UNARY_OPS

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


@dataclass
class CudaEnv(Env):
    fake: FakeDriver
    cublas: FakeCublas


@contextmanager
def cuda_env(*, gpu_cap: int | None = 64 * MiB, cublas: Any = "fake",
             compute_capability: tuple[int, int] = (9, 0)) -> Iterator[CudaEnv]:
    fake = FakeDriver(memory_bytes=1 << 30, compute_capability=compute_capability)
    fake_cublas = FakeCublas(fake)
    backend = CudaBackend(driver=fake, nvrtc=fake, gpu_cap_bytes=gpu_cap,
                          cublas=fake_cublas if cublas == "fake" else cublas)
    with tenant_env("gpu", backend, gpu_cap=gpu_cap) as env:
        yield CudaEnv(env.block, env.ctx, env.host, fake, fake_cublas)


@contextmanager
def probe(env: CudaEnv) -> Iterator[WasmSession]:
    with wasm_probe(env, timeout_s=scaled(30.0)) as s:  # a hang guard, not a bound the ops must meet
        yield s


def call(s: WasmSession, name: str, *args: object) -> Any:
    (result,) = s.call(name, list(args))
    return result


def put(s: WasmSession, values: Any) -> int:
    arr = np.ascontiguousarray(values, dtype=np.float32).ravel()
    h = call(s, "alloc", max(4, arr.nbytes))
    assert h > 0
    if arr.size:
        s.host.ctx.backend.write(s.run.buffers[h][0], 0, memoryview(arr.tobytes()))
    return h


def get(s: WasmSession, h: int, n: int) -> Any:
    buf = s.run.buffers[h][0]
    return np.frombuffer(s.host.ctx.backend.read(buf, 0, 4 * n), dtype=np.float32) if n else np.zeros(0, np.float32)


def close(got: Any, ref: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(got, np.asarray(ref, dtype=np.float32), rtol=rtol, atol=atol, equal_nan=True)


# ------------------------------------------------------------------ every op against numpy


def test_every_op_matches_numpy_on_the_cuda_backend() -> None:
    with cuda_env() as env, probe(env) as s:

        @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(m=st.integers(0, 7), k=st.integers(0, 7), n=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
        def check(m: int, k: int, n: int, seed: int) -> None:
            r = np.random.default_rng(seed)
            a = r.standard_normal((m, k), dtype=np.float32)
            b = r.standard_normal((k, n), dtype=np.float32)
            ha, hb, hc = put(s, a), put(s, b), put(s, np.full(m * n, 9.0))
            assert call(s, "matmul_f32", ha, hb, hc, m, k, n) == 0
            close(get(s, hc, m * n).reshape(m, n), a @ b)
            x = (r.standard_normal((m, n), dtype=np.float32) * 10).astype(np.float32)
            v = r.standard_normal(n, dtype=np.float32)
            hx, hy, ho = put(s, x), put(s, v), put(s, np.zeros(m * n))
            assert call(s, "add_f32", hx, hc, ho, m * n) == 0
            close(get(s, ho, m * n), x.ravel() + get(s, hc, m * n))
            assert call(s, "mul_f32", hx, ho, ho, m * n) == 0  # out aliases y
            close(get(s, ho, m * n), x.ravel() * (x.ravel() + get(s, hc, m * n)))
            for op, name in enumerate(UNARY_OPS):
                assert call(s, "unary_f32", op, hx, ho, m * n) == 0
                close(get(s, ho, m * n), ref_unary(name, x.ravel()))
            assert call(s, "transpose_f32", hx, ho, m, n) == 0
            close(get(s, ho, m * n).reshape(n, m), x.T)
            assert call(s, "add_rows_f32", hx, hy, m, n) == 0
            x = x + v
            close(get(s, hx, m * n).reshape(m, n), x)
            assert call(s, "scale_f32", hx, -0.5, m * n) == 0
            x = x * np.float32(-0.5)
            if m and n:
                assert call(s, "max_f32", hx, m * n, 0) == 0
                assert s.call("load_f32", [0]) == [float(x.max())]
                assert call(s, "argmax_rows_f32", hx, m, n, 16) == 0
                got = np.frombuffer(bytes(s.guest_memory()[16 : 16 + 4 * m]), dtype="<i4")
                np.testing.assert_array_equal(got, x.argmax(axis=1))
            assert call(s, "softmax_rows_f32", hx, m, n) == 0
            if m and n:
                close(get(s, hx, m * n).reshape(m, n), softmax(x))
            for h in (ha, hb, hc, hx, hy, ho):
                assert call(s, "free", h) == 0

        check()
        assert env.cublas.default_workspace_gemms == 0


def test_argmax_of_many_rows_is_chunked_through_the_scratch() -> None:
    from worker.backends.cuda_scratch import OPS_SCRATCH_BYTES

    rows = OPS_SCRATCH_BYTES // 4 + 5  # one full chunk and a bit
    x = np.random.default_rng(5).standard_normal((rows, 2), dtype=np.float32)
    with cuda_env() as env:
        backend = env.ctx.backend
        buf = backend.alloc(x.nbytes)
        try:
            backend.write(buf, 0, memoryview(x.tobytes()))
            out = bytearray(4 * rows)
            backend.argmax_rows_f32(buf, rows, 2, memoryview(out))
            np.testing.assert_array_equal(np.frombuffer(out, dtype="<i4"), x.argmax(axis=1))
            assert [n for n, _, _ in env.fake.launches].count(b"twt_argmax_rows_f32") == 2
        finally:
            backend.free(buf)


# ------------------------------------------------------------------ cuBLAS: workspace, stream, failures


@pytest.mark.parametrize("cc, ws_bytes", [((9, 0), 32 * MiB), ((8, 0), 4 * MiB), ((10, 0), 4 * MiB)])
def test_gemm_runs_on_the_tenant_stream_with_a_metered_workspace(cc: tuple[int, int], ws_bytes: int) -> None:
    """The workspace is cuBLAS's recommendation for the device (32 MiB on Hopper, 4 MiB elsewhere),
    metered like any buffer of the run."""
    with cuda_env(compute_capability=cc) as env:
        with probe(env) as s:
            a = np.arange(6, dtype=np.float32).reshape(2, 3)
            ha, hb, hc = put(s, a), put(s, np.ones((3, 4))), put(s, np.zeros(8))
            used = env.block.gpu_bytes_in_use
            assert call(s, "matmul_f32", ha, hb, hc, 2, 3, 4) == 0
            # the workspace is a metered, run-scoped allocation from the tenant's pool
            assert env.block.gpu_bytes_in_use == used + ws_bytes
            assert s.run.workspace is not None and s.run.gpu_peak_bytes >= ws_bytes
            ws = s.run.workspace
            ((handle, state),) = env.cublas.handles.items()
            assert state["workspace"] == (int(ws.ptr), ws_bytes)  # type: ignore[attr-defined]
            assert env.fake.allocs[int(ws.ptr)].pool is not None  # type: ignore[attr-defined]
            assert state["stream"] == int(env.ctx.backend._stream)  # type: ignore[attr-defined]
            # row-major C = A @ B as column-major C^T = B^T @ A^T: cuBLAS sees (n, m, k)
            assert env.cublas.gemms == [(4, 2, 3)]
            close(get(s, hc, 8).reshape(2, 4), a @ np.ones((3, 4), np.float32))
            assert call(s, "matmul_f32", ha, hb, hc, 2, 3, 4) == 0  # the same workspace, once per run
            assert env.block.gpu_bytes_in_use == used + ws_bytes
            assert env.cublas.default_workspace_gemms == 0
        assert env.block.gpu_bytes_in_use == 0  # the workspace went with the run


def test_gemm_without_room_for_a_workspace_still_multiplies() -> None:
    with cuda_env(gpu_cap=1 * MiB) as env, probe(env) as s:
        a = np.arange(4, dtype=np.float32).reshape(2, 2)
        ha, hc = put(s, a), put(s, np.zeros(4))
        assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0
        assert s.run.workspace is None
        ((_, state),) = env.cublas.handles.items()
        # never cuBLAS's own default, never (NULL, 0): the fixed scratch's >= 16 KiB fallback
        from worker.backends.cuda_scratch import CUBLAS_FALLBACK_WORKSPACE_BYTES

        ws_addr, ws_bytes = state["workspace"]
        assert ws_bytes == CUBLAS_FALLBACK_WORKSPACE_BYTES >= 16 << 10
        assert env.fake.allocs[ws_addr - env.fake._resolve(ws_addr, 1)[1]].pool is None  # the fixed scratch
        assert env.cublas.default_workspace_gemms == 0
        close(get(s, hc, 4).reshape(2, 2), a @ a)


def test_k_zero_zeroes_c_without_cublas() -> None:
    with cuda_env() as env, probe(env) as s:
        ha, hc = put(s, np.ones(4)), put(s, np.full(6, 3.0))
        assert call(s, "matmul_f32", ha, ha, hc, 2, 0, 3) == 0
        assert (get(s, hc, 6) == 0).all()
        assert env.cublas.gemms == []


def test_a_missing_cublas_fails_only_the_gemm_with_a_clear_reason(caplog: pytest.LogCaptureFixture) -> None:
    with cuda_env(cublas="no_such_package.cublas") as env, probe(env) as s:
        ha, hc = put(s, np.ones(4)), put(s, np.zeros(4))
        with caplog.at_level(logging.WARNING, logger="twt.worker.wasm"):
            # queued (it writes device buffers only), as on the stub: the host call returns at once and
            # the queued op's failure is logged by its name at the guest call's end (worker.device_time)
            assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0
        (record,) = [r for r in caplog.records if r.getMessage() == "wasm.op_failed"]
        text = TextFormatter().format(record)
        assert "cuBLAS missing" in text and "tensor-wasm-tenant[cuda]" in text and "op=matmul_f32" in text
        assert (get(s, hc, 4) == 0).all()  # nothing computed on the host instead
        assert call(s, "add_f32", ha, ha, hc, 4) == 0  # the kernels still work
        assert (get(s, hc, 4) == 2).all()


def test_the_missing_cublas_error_names_the_extra() -> None:
    from worker.backends._cublas import load_cublas_module

    with pytest.raises(BackendUnavailable, match=r"cuBLAS missing.*tensor-wasm-tenant\[cuda\]"):
        load_cublas_module("no_such_package.cublas")


def test_cublas_bindings_whose_import_breaks_are_backend_unavailable(tmp_path: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing nvmath.bindings.cublas runs nvmath's whole package (cuda.core & co.): a version mismatch
    there raises what it likes (here AttributeError), never only ImportError. GEMM is then unavailable,
    by name - the worker must not see a raw exception from the first matmul."""
    from worker.backends._cublas import load_cublas_module

    (tmp_path / "broken_cublas_pkg.py").write_text("import types\ntypes.NoSuchThing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendUnavailable, match=r"cuBLAS missing.*AttributeError.*tensor-wasm-tenant\[cuda\]"):
        load_cublas_module("broken_cublas_pkg")


def test_a_cublas_error_is_a_typed_cuda_error(caplog: pytest.LogCaptureFixture) -> None:
    with cuda_env() as env, probe(env) as s:
        ha, hc = put(s, np.ones(4)), put(s, np.zeros(4))
        env.cublas.fail_next("sgemm", Status.EXECUTION_FAILED)
        with caplog.at_level(logging.WARNING, logger="twt.worker.wasm"):
            # queued: the call returns at once, the queued op's typed error is logged at the call's end
            assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0
        (record,) = [r for r in caplog.records if r.getMessage() == "wasm.op_failed"]
        text = TextFormatter().format(record)
        assert "CudaError" in text and "CUBLAS_STATUS_EXECUTION_FAILED" in text and "op=matmul_f32" in text
        assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0  # the next one goes through
    destroyed = Cublas(env.cublas, 0)  # a handle cuBLAS does not know
    with pytest.raises(CudaError, match="CUBLAS_STATUS_NOT_INITIALIZED") as info:
        destroyed.sgemm_row_major(0, 0, 0, 1, 1, 1, (0, 0))
    assert info.value.call == "cublasSetWorkspace" and info.value.result_code == Status.NOT_INITIALIZED


def test_dimensions_beyond_int32_use_the_64_bit_entry_point() -> None:
    fake = FakeDriver(memory_bytes=1 << 30)
    cub = FakeCublas(fake)
    backend = CudaBackend(driver=fake, nvrtc=fake, cublas=cub)
    try:
        buf = backend.alloc(64)
        ops = backend.tensor_ops()
        ops.matmul_f32(int(buf.ptr), int(buf.ptr), int(buf.ptr), 1 << 31, 1, 1, (0, 0))  # queued
        assert "sgemm_64" in cub.calls and "sgemm" not in cub.calls
        # the fake cannot read 8 GiB of A: a fault, which surfaces at the next wait, sticky
        with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
            backend.end_run(None)
        assert backend.context_lost == "CUDA_ERROR_ILLEGAL_ADDRESS"
    finally:
        backend.close()


def test_close_releases_the_handle_the_scratch_and_the_module() -> None:
    fake = FakeDriver(memory_bytes=1 << 30)
    cub = FakeCublas(fake)
    backend = CudaBackend(driver=fake, nvrtc=fake, cublas=cub)
    a = backend.alloc(16)
    backend.matmul_f32(a, a, backend.alloc(16), 2, 2, 2)
    backend.add_f32(a, a, a, 4)
    assert cub.handles and fake.modules and fake.raw_reserved[0] > 0
    backend.close()
    assert not cub.handles and not fake.modules and fake.raw_reserved[0] == 0
    assert fake.ctx_refs == {0: 0}


def test_the_mlp_guest_on_the_cuda_backend() -> None:
    batch, d_in, hidden, d_out = 12, 5, 7, 3
    r = np.random.default_rng(9)
    p = {"x": r.standard_normal((batch, d_in)), "w1": r.standard_normal((d_in, hidden)),
         "b1": r.standard_normal(hidden), "w2": r.standard_normal((hidden, d_out)), "b2": r.standard_normal(d_out)}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    with cuda_env() as env, mlp_forward(env.host, p, batch, d_in, hidden, d_out) as mlp:
        assert mlp.reply["results"] == [0]
        close(mlp.out, softmax(np.maximum(p["x"] @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]))


def test_the_gpu_phase_script_runs_against_the_fakes() -> None:
    """tests/gpu/phase_tensor_ops.py (the hardware check's phase) stays runnable; proves nothing about GPUs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "gpu" / "phase_tensor_ops.py"
    proc = subprocess.run([sys.executable, str(script), "--dry-run-fake", "--quick"], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["gpu_bytes_after"] == 0
    assert len(result["ops"]) == 23 and result["ops"]["model_ops"]["ok"] and result["gemm"][0]["verdict"] in ("PASS", "MISS")


def test_an_unloadable_libcublas_is_backend_unavailable() -> None:
    """nvmath imports fine but its loader finds no libcublas: the first call raises a RuntimeError subclass."""
    fake = FakeDriver(memory_bytes=1 << 30)
    cub = FakeCublas(fake)

    def no_library() -> int:
        raise RuntimeError("libcublas.so.13: cannot open shared object file (fake)")

    cub.create = no_library  # type: ignore[method-assign]
    backend = CudaBackend(driver=fake, nvrtc=fake, cublas=cub)
    try:
        a = backend.alloc(16)
        with pytest.raises(BackendUnavailable, match=r"cuBLAS missing.*libcublas.*tensor-wasm-tenant\[cuda\]"):
            backend.matmul_f32(a, a, backend.alloc(16), 2, 2, 2)
    finally:
        backend.close()


def test_each_run_lends_its_own_workspace_and_cublas_is_told() -> None:
    with cuda_env() as env:
        seen = []
        for _ in range(2):
            with probe(env) as s:
                ha, hc = put(s, np.ones(4)), put(s, np.zeros(4))
                assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0
                assert call(s, "matmul_f32", ha, ha, hc, 2, 2, 2) == 0
                ws = s.run.workspace
                assert ws is not None
                ((_, state),) = env.cublas.handles.items()
                assert state["workspace"] == (int(ws.ptr), ws.nbytes)  # type: ignore[attr-defined]
                seen.append(int(ws.ptr))  # type: ignore[attr-defined]
        assert env.cublas.calls.count("set_workspace") >= 1
        assert env.cublas.default_workspace_gemms == 0
        assert env.block.gpu_bytes_in_use == 0


def test_a_transpose_runs_in_row_chunks_through_the_gate() -> None:
    """The gate cuts a cuda transpose into launches over input rows (``out[:, r0:r1] = x[r0:r1].T``
    on the whole buffers), as on the stub: a huge transpose no longer holds the device in one launch."""
    from worker.device_time import DeviceGate

    rows, cols = 301, 7
    x = np.random.default_rng(7).standard_normal((rows, cols), dtype=np.float32)
    with cuda_env() as env:
        backend = env.ctx.backend
        assert backend.transposes_in_blocks
        gate = DeviceGate(env.block, backend, chunk_s=1e-8)  # a few rows a chunk
        xb, ob = backend.alloc(x.nbytes), backend.alloc(x.nbytes)
        try:
            backend.write(xb, 0, memoryview(x.tobytes()))
            backend.write(ob, 0, memoryview(np.full(rows * cols, np.nan, np.float32).tobytes()))
            before = [n for n, _, _ in env.fake.launches].count(b"twt_transpose_f32")
            gate.op("transpose_f32", backend.transpose_f32, (xb, ob, rows, cols))
            launched = [n for n, _, _ in env.fake.launches].count(b"twt_transpose_f32") - before
            got = np.frombuffer(backend.read(ob, 0, x.nbytes), dtype=np.float32).reshape(cols, rows)
            np.testing.assert_array_equal(got, x.T)
            assert launched >= 3, launched
            with pytest.raises(ValueError, match="outside"):
                backend.tensor_ops().transpose_f32(0, 0, rows, cols, 5, rows + 1)
        finally:
            gate.close()
            backend.free(xb)
            backend.free(ob)
