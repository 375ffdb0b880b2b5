"""The stub backend keeps each buffer's float32 numpy views (worker.backends.stub ``StubBuffer.views``):
a launch reuses them instead of making three arrays a GEMM. What a view is for must not change: an op
sees what was written into its buffers since, a freed buffer keeps no view of its bytes, a buffer
used with ever new shapes keeps a bounded number, and a window on a buffer (a chunk) has its own."""

from __future__ import annotations

import numpy as np
import pytest

from worker.backends.stub import _VIEWS_KEPT, StubBackend, StubBuffer

pytestmark = pytest.mark.timeout(60)

N = 8


def _put(be: StubBackend, buf: StubBuffer, values: np.ndarray) -> None:
    be.write(buf, 0, memoryview(values.astype(np.float32).tobytes()))


def _get(be: StubBackend, buf: StubBuffer, rows: int, cols: int) -> np.ndarray:
    return np.frombuffer(be.read(buf, 0, 4 * rows * cols), dtype=np.float32).reshape(rows, cols)


def test_a_gemm_on_kept_views_sees_what_was_written_since() -> None:
    be = StubBackend()
    a, b, c = be.alloc(4 * N * N), be.alloc(4 * N * N), be.alloc(4 * N * N)
    rng = np.random.default_rng(3)
    for _ in range(3):  # the second and third GEMMs run on the views the first made
        av, bv = rng.standard_normal((N, N)).astype(np.float32), rng.standard_normal((N, N)).astype(np.float32)
        _put(be, a, av)
        _put(be, b, bv)
        be.matmul_f32(a, b, c, N, N, N)
        np.testing.assert_allclose(_get(be, c, N, N), av @ bv, rtol=1e-5, atol=1e-5)
    assert a.views is not None and (N, N) in a.views


def test_a_freed_buffer_keeps_no_view_of_its_bytes() -> None:
    be = StubBackend()
    buf = be.alloc(4 * N)
    be.fill_f32(buf, 2.0, N)
    assert buf.views
    be.free(buf)
    assert buf.views is None and len(buf.data) == 0 and be.in_use == 0


def test_a_buffer_keeps_a_bounded_number_of_views() -> None:
    be = StubBackend()
    buf = be.alloc(4 * 64)
    for count in range(1, 3 * _VIEWS_KEPT):
        be.fill_f32(buf, float(count), count)
        assert buf.views is not None and len(buf.views) <= _VIEWS_KEPT
    assert _get(be, buf, 1, 3 * _VIEWS_KEPT - 1)[0, -1] == 3 * _VIEWS_KEPT - 1


def test_a_window_on_a_buffer_has_views_of_its_own_memory() -> None:
    be = StubBackend()
    whole = be.alloc(4 * 16)
    be.fill_f32(whole, 1.0, 16)
    part = be.view(whole, 4 * 8, 4 * 8)
    assert part.views is None
    be.fill_f32(part, 5.0, 8)
    got = _get(be, whole, 1, 16)[0]
    assert list(got[:8]) == [1.0] * 8 and list(got[8:]) == [5.0] * 8
    be.fill_f32(whole, 0.0, 16)  # the whole buffer's kept view, the window's memory included
    assert list(_get(be, part, 1, 8)[0]) == [0.0] * 8
