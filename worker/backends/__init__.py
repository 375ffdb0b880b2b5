"""Compute backends a worker can run a tenant on: ``stub`` (host simulation) and ``cuda``.

:func:`create_backend` builds the one named in the bind message; the cuda
backend is imported only when asked for, so a stub worker never loads the
CUDA bindings.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.backends.base import Backend, DeviceBuffer, DeviceOutOfMemory
from worker.backends.stub import StubBackend

__all__ = ["Backend", "DeviceBuffer", "DeviceOutOfMemory", "StubBackend", "create_backend"]


def create_backend(name: str, options: dict[str, object]) -> Backend:
    """The backend for one tenant process. Raises BackendUnavailable / CudaError for cuda."""
    if name == "stub":
        return StubBackend(
            capacity_bytes=_int_option(options, "capacity_bytes", 16 << 30),
            device_index=_int_option(options, "device_index", 0),
        )
    if name == "cuda":
        from worker.backends.cuda import CudaBackend  # type: ignore[import-not-found,unused-ignore]

        backend: Backend = CudaBackend.from_options(options)
        return backend
    from shared.errors import BackendUnavailable

    raise BackendUnavailable(name, "unknown backend (expected 'stub' or 'cuda')")


def _int_option(options: Mapping[str, object], name: str, default: int) -> int:
    """An int backend option (the supervisor writes them; a wrong type is its bug, said plainly)."""
    value = options.get(name, default)
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"backend option {name} must be an int, not {type(value).__name__}")
    return int(value)
