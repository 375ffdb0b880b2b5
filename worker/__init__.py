"""The worker process: one tenant instance's device state, metered allocator, WASM host.

Started by the supervisor (``worker.main.run``), never imported by it.

Public face:

- :class:`TenantContext` - the crate's name for what a bound worker owns
  (backend context/stream/pool, the tenant's quota block, the allocator);
- :class:`MeteredAllocator` - every GPU byte counted in shared memory first;
- :class:`Backend`, :class:`StubBackend`, :class:`DeviceOutOfMemory` - the
  backend interface and the host-memory simulation (the cuda backend lives in
  :mod:`worker.backends.cuda` and is imported only when used);
- :class:`FaultState` - injected faults as the worker executes them.
"""

from __future__ import annotations

from worker.allocator import MeteredAllocator
from worker.backends import Backend, DeviceBuffer, DeviceOutOfMemory, StubBackend, create_backend
from worker.context import TenantContext
from worker.faults import FAULT_KINDS, FaultState

__all__ = [
    "Backend",
    "DeviceBuffer",
    "DeviceOutOfMemory",
    "FAULT_KINDS",
    "FaultState",
    "MeteredAllocator",
    "StubBackend",
    "TenantContext",
    "create_backend",
]
