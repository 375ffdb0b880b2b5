"""Code both the supervisor and the workers import: ids, errors, sizes, logging,
the shared-memory quota block and its C atomics helper.

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
    UntrustedRunDir,
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
from shared.ids import InstanceId, TenantId
from shared.log import configure_logging, get_logger, log_event
from shared.quota import (
    DEFAULT_QUOTA_BYTES,
    QuotaBlock,
    QuotaSnapshot,
    cleanup_stale_segments,
)
from shared.sizes import format_size, parse_size

__all__ = [
    "DEFAULT_QUOTA_BYTES",
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
    "UntrustedRunDir",
    "WasmCompile",
    "WasmTrap",
    "WorkerLost",
    "cleanup_stale_segments",
    "configure_logging",
    "error_from_dict",
    "format_size",
    "get_logger",
    "log_event",
    "parse_size",
]
