"""TenantContext: one tenant instance's device state, quota block and metered allocator.

The Rust crate's name for the bundle a worker process owns after it is bound
to a tenant: the backend (CUDA context + non-blocking stream + memory pool,
or the stub's simulation), the tenant's shared-memory :class:`QuotaBlock`
(attached, never owned: only the supervisor unlinks it), and the
:class:`MeteredAllocator` on top. Creating and destroying it are logged as
``context.create`` / ``context.destroy`` events with their durations.
"""

from __future__ import annotations

import logging
import time

from shared.gpu_time import GpuTimeBoard
from shared.log import get_logger, log_event
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from worker.allocator import MeteredAllocator
from worker.backends.base import ByteMeter
from worker.backends import Backend, create_backend
from worker.device_time import DeviceGate
from worker.faults import FaultState

__all__ = ["TenantContext"]

_log = get_logger("worker.context")


class TenantContext:
    """Everything one bound worker instance holds for its tenant."""

    def __init__(
        self,
        spec: TenantSpec,
        instance: int,
        incarnation: int,
        block: QuotaBlock,
        backend: Backend,
        *,
        budget: ByteMeter | None = None,
        faults: FaultState | None = None,
        board: GpuTimeBoard | None = None,
    ) -> None:
        self.spec = spec
        self.tenant_id = spec.tenant_id
        self.instance = instance
        self.incarnation = incarnation
        self.block = block
        self.backend = backend
        self.faults = faults or FaultState()
        self.allocator = MeteredAllocator(
            spec.tenant_id,
            block,
            backend,
            instance=instance,
            incarnation=incarnation,
            budget=budget,
            faults=self.faults,
        )
        #: every device op goes through it: timed, charged to the block, scheduled on the board
        self.gate = DeviceGate(block, backend, board)
        self.extensions: dict[str, object] = {}  # e.g. the WASM host, created on first use
        self._closed = False
        if budget is not None:
            # the device memory this worker holds outside any buffer (a CUDA context, scratch,
            # modules, cuBLAS) is charged to the device budget too; refused: the device is full
            backend.attach_overhead_meter(budget)

    @classmethod
    def create(
        cls,
        spec: TenantSpec,
        *,
        instance: int,
        incarnation: int,
        segment: str,
        backend: str,
        backend_options: dict[str, object],
        budget: ByteMeter | None = None,
        faults: FaultState | None = None,
        board: GpuTimeBoard | None = None,
    ) -> TenantContext:
        """Attach the tenant's block and create the backend (logged with its duration)."""
        t0 = time.perf_counter()
        block = QuotaBlock.attach(segment, instance=instance)
        try:
            be = create_backend(backend, backend_options)
        except BaseException:
            block.close()
            raise
        try:
            ctx = cls(spec, instance, incarnation, block, be, budget=budget, faults=faults, board=board)
        except BaseException:  # e.g. the device budget has no room for this worker's fixed overhead
            be.close()
            block.close()
            raise
        log_event(
            _log,
            logging.INFO,
            "context.create",
            tenant=spec.tenant_id,
            instance=instance,
            backend=be.name,
            duration_ms=round((time.perf_counter() - t0) * 1000, 3),
        )
        return ctx

    def info(self) -> dict[str, object]:
        return {
            "tenant": self.tenant_id,
            "instance": self.instance,
            "incarnation": self.incarnation,
            "buffers": len(self.allocator.handles()),
            "buffer_bytes": self.allocator.bytes_held(),
            **self.backend.info(),
        }

    def close(self) -> None:
        """Free every buffer (releasing its bytes), close extensions and the backend, detach."""
        if self._closed:
            return
        self._closed = True
        t0 = time.perf_counter()
        for name, ext in list(self.extensions.items()):
            close = getattr(ext, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - shutdown must go on; logged
                    log_event(_log, logging.WARNING, "context.extension_close_failed", extension=name, error=repr(exc))
        released = self.allocator.free_all()
        try:
            self.gate.close()  # the device lease and the timer's events, before the context goes
        except Exception as exc:  # noqa: BLE001 - logged, never raised from cleanup
            log_event(_log, logging.WARNING, "context.gate_close_failed", error=repr(exc))
        try:
            self.backend.close()
            self.allocator.settle()  # the pool is gone: what its frees still withheld goes back to the budget
        except Exception as exc:  # noqa: BLE001 - logged, never raised from cleanup
            log_event(_log, logging.WARNING, "context.backend_close_failed", error=repr(exc))
        self.block.close()
        log_event(
            _log,
            logging.INFO,
            "context.destroy",
            tenant=self.tenant_id,
            instance=self.instance,
            backend=self.backend.name,
            released_bytes=released,
            duration_ms=round((time.perf_counter() - t0) * 1000, 3),
        )
