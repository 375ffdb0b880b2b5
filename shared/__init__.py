"""Code both the supervisor and the workers import: ids, errors, sizes, logging,
the shared-memory quota block and its C atomics helper, data regions.

Nothing here imports :mod:`supervisor` or :mod:`worker`.
"""

from __future__ import annotations

from shared.errors import (
    AlreadyRegistered,
    BackendUnavailable,
    CapabilityFromForeignRegistry,
    CapabilityRevoked,
    CudaError,
    GpuMemoryExhausted,
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    Overloaded,
    ProtocolError,
    RegistryError,
    RequestTimeout,
    SegmentError,
    SupervisorUnavailable,
    TenantFailed,
    TenantIsolationViolation,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
    WasmCompile,
    WasmTrap,
    WorkerLost,
    error_from_dict,
)
from shared.exits import (
    EXIT_CUDA_CONTEXT_LOST,
    EXIT_PARENT_GONE,
    EXIT_SUPERVISOR_SILENT,
    STICKY_CUDA_ERRORS,
    context_lost_error,
    context_lost_exit_code,
    exit_reason,
    is_sticky_cuda_error,
)
from shared.ids import InstanceId, TenantId
from shared.log import configure_logging, get_logger, log_event
from shared.quota import (
    DEFAULT_QUOTA_BYTES,
    QuotaBlock,
    QuotaSnapshot,
    cleanup_stale_segments,
)
from shared.region import Region
from shared.sizes import format_size, parse_size

__all__ = [
    "DEFAULT_QUOTA_BYTES",
    "EXIT_CUDA_CONTEXT_LOST",
    "EXIT_PARENT_GONE",
    "EXIT_SUPERVISOR_SILENT",
    "STICKY_CUDA_ERRORS",
    "AlreadyRegistered",
    "BackendUnavailable",
    "CapabilityFromForeignRegistry",
    "CapabilityRevoked",
    "CudaError",
    "GpuMemoryExhausted",
    "InstanceId",
    "InvalidArgument",
    "KernelTimeout",
    "MemoryExhausted",
    "Overloaded",
    "ProtocolError",
    "QuotaBlock",
    "QuotaSnapshot",
    "Region",
    "RegistryError",
    "RequestTimeout",
    "SegmentError",
    "SupervisorUnavailable",
    "TenantFailed",
    "TenantId",
    "TenantIsolationViolation",
    "TensorWasmError",
    "UnknownModule",
    "UnknownTenant",
    "WasmCompile",
    "WasmTrap",
    "WorkerLost",
    "cleanup_stale_segments",
    "configure_logging",
    "context_lost_error",
    "context_lost_exit_code",
    "error_from_dict",
    "exit_reason",
    "format_size",
    "get_logger",
    "is_sticky_cuda_error",
    "log_event",
    "parse_size",
]
