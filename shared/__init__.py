"""What the supervisor, its client and the workers share: the wire contract (the ops and their
typed arguments and replies, records, errors, capabilities, the run dir's and keys' client
formats, the config file) and the shared-memory primitives (the quota block and its C atomics
helper, the device budget, the GPU-time board, data regions), with ids, sizes and logging.

Nothing here imports :mod:`supervisor` or :mod:`worker` (tests/test_boundaries.py); a module
only the supervisor uses lives under ``supervisor/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.errors import (
        AdmissionRate, AlreadyRegistered, BackendUnavailable, BufferLost, CapabilityFromForeignRegistry,
        CapabilityRevoked, CapacityExhausted, ClientRepliesQueued, ConfigError, CudaError, Draining,
        FaultInjectionDisabled, GpuMemoryExhausted, HandshakeFailed, HeldBytesLimit, ISOLATION_REASONS,
        InFlightLimit, InvalidArgument, KernelTimeout, MemoryExhausted, NodeLost, OVERLOADED_CAUSES,
        Overloaded, ProtocolError, RegistryError, RequestTimeout, RunDirLocked, SegmentError, StateError,
        SupervisorUnavailable, TenantFailed, TenantIsolationViolation, TenantStopped, TensorWasmError,
        UnknownModule, UnknownTenant, UntrustedRunDir, WasmCompile, WasmTrap, WorkerLost, WorkerQueueFull,
        error_class_for_code, error_from_dict,
    )
    from shared.ids import InstanceId, TenantId
    from shared.log import configure_logging, get_logger, log_event
    from shared.quota import DEFAULT_QUOTA_BYTES, QuotaBlock, QuotaSnapshot, cleanup_stale_segments
    from shared.region import Region
    from shared.sizes import format_size, parse_size

#: one sorted face, the error tree (``shared.errors.__all__``) included; tests/test_exports.py
#: checks that it names every public error and that each name resolves
__all__ = [
    "AdmissionRate",
    "AlreadyRegistered",
    "BackendUnavailable",
    "BufferLost",
    "CapabilityFromForeignRegistry",
    "CapabilityRevoked",
    "CapacityExhausted",
    "ClientRepliesQueued",
    "ConfigError",
    "CudaError",
    "DEFAULT_QUOTA_BYTES",
    "Draining",
    "FaultInjectionDisabled",
    "GpuMemoryExhausted",
    "HandshakeFailed",
    "HeldBytesLimit",
    "ISOLATION_REASONS",
    "InFlightLimit",
    "InstanceId",
    "InvalidArgument",
    "KernelTimeout",
    "MemoryExhausted",
    "NodeLost",
    "OVERLOADED_CAUSES",
    "Overloaded",
    "ProtocolError",
    "QuotaBlock",
    "QuotaSnapshot",
    "Region",
    "RegistryError",
    "RequestTimeout",
    "RunDirLocked",
    "SegmentError",
    "StateError",
    "SupervisorUnavailable",
    "TenantFailed",
    "TenantId",
    "TenantIsolationViolation",
    "TenantStopped",
    "TensorWasmError",
    "UnknownModule",
    "UnknownTenant",
    "UntrustedRunDir",
    "WasmCompile",
    "WasmTrap",
    "WorkerLost",
    "WorkerQueueFull",
    "cleanup_stale_segments",
    "configure_logging",
    "error_class_for_code",
    "error_from_dict",
    "format_size",
    "get_logger",
    "log_event",
    "parse_size",
]

#: where each public name lives. Imported on first use (PEP 562), not with the package: every
#: process that imports any ``shared`` module (a ``twt`` command, a check child, a tool, a worker
#: started afresh) otherwise paid for the quota block's ``multiprocessing.shared_memory``, the
#: error tree's ``inspect``, logging and the region code (~50 ms of CPU a process) whether it
#: used them or not
_HOMES: dict[str, str] = {
    "AdmissionRate": "shared.errors",
    "AlreadyRegistered": "shared.errors",
    "BackendUnavailable": "shared.errors",
    "BufferLost": "shared.errors",
    "CapabilityFromForeignRegistry": "shared.errors",
    "CapabilityRevoked": "shared.errors",
    "CapacityExhausted": "shared.errors",
    "ClientRepliesQueued": "shared.errors",
    "ConfigError": "shared.errors",
    "CudaError": "shared.errors",
    "DEFAULT_QUOTA_BYTES": "shared.quota",
    "Draining": "shared.errors",
    "FaultInjectionDisabled": "shared.errors",
    "GpuMemoryExhausted": "shared.errors",
    "HandshakeFailed": "shared.errors",
    "HeldBytesLimit": "shared.errors",
    "ISOLATION_REASONS": "shared.errors",
    "InFlightLimit": "shared.errors",
    "InstanceId": "shared.ids",
    "InvalidArgument": "shared.errors",
    "KernelTimeout": "shared.errors",
    "MemoryExhausted": "shared.errors",
    "NodeLost": "shared.errors",
    "OVERLOADED_CAUSES": "shared.errors",
    "Overloaded": "shared.errors",
    "ProtocolError": "shared.errors",
    "QuotaBlock": "shared.quota",
    "QuotaSnapshot": "shared.quota",
    "Region": "shared.region",
    "RegistryError": "shared.errors",
    "RequestTimeout": "shared.errors",
    "RunDirLocked": "shared.errors",
    "SegmentError": "shared.errors",
    "StateError": "shared.errors",
    "SupervisorUnavailable": "shared.errors",
    "TenantFailed": "shared.errors",
    "TenantId": "shared.ids",
    "TenantIsolationViolation": "shared.errors",
    "TenantStopped": "shared.errors",
    "TensorWasmError": "shared.errors",
    "UnknownModule": "shared.errors",
    "UnknownTenant": "shared.errors",
    "UntrustedRunDir": "shared.errors",
    "WasmCompile": "shared.errors",
    "WasmTrap": "shared.errors",
    "WorkerLost": "shared.errors",
    "WorkerQueueFull": "shared.errors",
    "cleanup_stale_segments": "shared.quota",
    "configure_logging": "shared.log",
    "error_class_for_code": "shared.errors",
    "error_from_dict": "shared.errors",
    "format_size": "shared.sizes",
    "get_logger": "shared.log",
    "log_event": "shared.log",
    "parse_size": "shared.sizes",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'shared' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
