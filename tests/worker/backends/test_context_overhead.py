"""A worker's fixed overhead starts from one context's cost: the supervisor's figure when it gives one
(its probe measured it once), else measured at set-up, and never 0 when it cannot be measured."""

from __future__ import annotations

import logging

import pytest

from shared.cuda_compat import default_context_bytes
from shared.errors import CudaError
from tests.helpers.fake_cuda import CUresult, FakeDriver
from worker.backends.cuda import CudaBackend

pytestmark = pytest.mark.timeout(30)

MiB = 1 << 20


def test_the_supervisors_figure_is_taken_as_given_and_no_context_is_made() -> None:
    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    b = CudaBackend.from_options({"driver_module": f, "nvrtc_module": f, "context_bytes": 300 * MiB})
    try:
        assert "cuCtxCreate" not in f.calls
        assert (b.context_bytes, b.context_bytes_source) == (300 * MiB, "given")
        assert b.overhead_bytes == 300 * MiB + 2 * MiB  # + the fixed scratch
        assert b.info()["context_bytes_source"] == "given"
    finally:
        b.close()


@pytest.mark.parametrize("cc, want", [((9, 0), 768 * MiB), ((8, 6), 512 * MiB), ((7, 5), 384 * MiB)])
def test_a_full_device_gets_the_class_default_not_zero(cc: tuple[int, int], want: int,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The primary context fits, a second does not (OOM): exactly when memory is tight the context
    must still be charged - the device class's conservative figure, with a warning that says so."""
    f = FakeDriver(memory_bytes=80 * MiB, context_bytes=48 * MiB, compute_capability=cc)
    with caplog.at_level(logging.WARNING, logger="twt.worker.cuda"):
        b = CudaBackend(0, driver=f, nvrtc=f)
    try:
        assert f.count("cuCtxCreate") == 1 and default_context_bytes(cc[0]) == want
        assert (b.context_bytes, b.context_bytes_source) == (want, "default")
        assert any("cuda.context_not_measured" in r.getMessage() for r in caplog.records)
        b.alloc(4096)  # and its own context is current again: the backend works
    finally:
        b.close()


def test_a_measured_context_is_what_cumemgetinfo_lost() -> None:
    f = FakeDriver(memory_bytes=1 << 30, context_bytes=48 * MiB)
    b = CudaBackend(0, driver=f, nvrtc=f)
    try:
        assert (b.context_bytes, b.context_bytes_source) == (48 * MiB, "measured")
        assert not f.extra_ctx  # the throw-away context is gone
    finally:
        b.close()


def test_a_sticky_error_while_measuring_is_not_papered_over() -> None:
    """A sticky error means this process's context is gone: set-up fails (the worker exits), it is
    never turned into a default figure."""
    f = FakeDriver(memory_bytes=1 << 30)
    f.fail_next("cuCtxCreate", CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaError, match="sticky"):
        CudaBackend(0, driver=f, nvrtc=f)


class _ForeignFree(FakeDriver):
    """A device on which another process frees 1 GiB while this worker sets up (free memory grows
    between the set-up's two cuMemGetInfo reads)."""

    reads = 0

    def cuMemGetInfo(self) -> tuple[object, ...]:  # noqa: N802 - the driver's name
        err, free, total = super().cuMemGetInfo()
        self.reads += 1
        return (err, free + (1 << 30) if self.reads > 1 and free is not None else free, total)


def test_memory_freed_by_another_process_during_set_up_never_hides_the_scratch() -> None:
    from worker.backends.cuda_scratch import FIXED_SCRATCH_BYTES

    f = _ForeignFree(memory_bytes=4 << 30)
    b = CudaBackend(0, driver=f, nvrtc=f, context_bytes=300 * MiB)
    try:
        assert b.overhead_bytes == 300 * MiB + FIXED_SCRATCH_BYTES  # the delta said less than nothing
    finally:
        b.close()
