"""The one place that knows how cuda-bindings 12.x and 13.x differ: every other module asks here.

The project drives the CUDA driver through ``cuda.bindings.driver`` (cuda-python), whose call
shapes follow the CUDA toolkit of the same major version. The ``cuda12`` extra installs
cuda-bindings 12.9, the ``cuda`` extra 13.x; a host's driver decides which one it can use (a 13.x
binding needs a 13.x driver). Where the two differ for the calls this project makes:

* ``cuCtxCreate``: 12.9 ``(flags, dev)``; 13.x ``(ctxCreateParams, flags, dev)``;
* ``CUmemPoolProps``: 12.9 has no ``gpuDirectRDMACapable`` (setting it is an AttributeError);
  13.x has it (left 0 here);
* ``CU_MEMPOOL_ATTR_MAX_POOL_SIZE`` (a pool's cap read back, as the driver rounded it): 13.x only.

(``CU_MEM_ALLOCATION_TYPE_MANAGED`` and ``CUmemLocation.localized`` are 13.x only as well; the
project uses neither.) Everything else the worker, the probe and the hardware check call has the
same shape in both, which the test suite checks by replaying every recorded call into both real
binding versions (tests/worker/backends/test_replay_bindings.py).

Which major a module speaks is read, never guessed from behaviour: the real module's package
(``cuda.bindings``) carries ``__version__``; a module-shaped stand-in (the test suite's fake
driver) says ``BINDINGS_VERSION``. A version this module cannot place is
:class:`~shared.errors.BackendUnavailable` with what was found, before any driver call; majors
past 13 use the 13.x shapes (the newest known), a major below 12 is refused (cuda-bindings 12.6
is the oldest the project declares).

Imports nothing but :mod:`shared.errors`: the worker's backend and the supervisor's probe child
(supervisor.lifecycle.backend_select, which never initialises CUDA in the supervisor itself) both
use it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from shared.errors import BackendUnavailable

__all__ = ["CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACE_HOPPER_BYTES", "DEFAULT_CONTEXT_BYTES", "NEWEST_KNOWN_MAJOR",
           "OLDEST_MAJOR", "DriverApi", "bindings_version", "cublas_workspace_bytes", "default_context_bytes",
           "driver_api"]

#: the binding majors whose call shapes this module knows; the replay test checks both
OLDEST_MAJOR = 12
NEWEST_KNOWN_MAJOR = 13


def bindings_version(mod: Any) -> str | None:
    """The cuda-bindings version a driver module speaks (``"12.9.10"``), or None when it does not say.

    ``BINDINGS_VERSION`` on the module (a stand-in's), else ``__version__`` of its package (the
    real ``cuda.bindings.driver`` lives in ``cuda.bindings``).
    """
    explicit = getattr(mod, "BINDINGS_VERSION", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    package = getattr(mod, "__package__", None) or str(getattr(mod, "__name__", "")).rpartition(".")[0]
    parent = sys.modules.get(package) if package else None
    version = getattr(parent, "__version__", None)
    return version if isinstance(version, str) and version else None


def _major(version: str) -> int | None:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class DriverApi:
    """The call shapes of one cuda-bindings major; every version-dependent call goes through it.

    Each method takes the bindings module (real or fake) and returns what the binding returns
    (the raw result tuple for calls), so the caller's checked-call funnel stays the one place
    where a ``CUresult`` becomes an error.
    """

    major: int
    version: str

    def ctx_create(self, mod: Any, flags: int, dev: Any) -> tuple[Any, ...]:
        """``cuCtxCreate``: a regular context on ``dev``, made current. 13.x takes the creation
        parameters first (None: a plain context, as 12.x makes)."""
        if self.major >= 13:
            return tuple(mod.cuCtxCreate(None, flags, dev))
        return tuple(mod.cuCtxCreate(flags, dev))

    def pool_props(self, mod: Any, device_index: int, max_size: int) -> Any:
        """A ``CUmemPoolProps`` for a pinned device pool of at most ``max_size`` bytes (0: no cap).

        Only the fields both majors have are set; 13.x's ``gpuDirectRDMACapable`` keeps its 0.
        """
        props = mod.CUmemPoolProps()
        props.allocType = mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = mod.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device_index
        props.maxSize = max_size
        return props

    def max_pool_size_attribute(self, mod: Any) -> Any | None:
        """``CU_MEMPOOL_ATTR_MAX_POOL_SIZE`` where the binding has it (13.x), else None: a 12.x
        pool's cap cannot be read back, and the size asked for is what it is."""
        if self.major < 13:
            return None
        return getattr(mod.CUmemPool_attribute, "CU_MEMPOOL_ATTR_MAX_POOL_SIZE", None)


def driver_api(mod: Any) -> DriverApi:
    """The :class:`DriverApi` for a loaded driver bindings module; BackendUnavailable if unplaceable."""
    version = bindings_version(mod)
    name = getattr(mod, "__name__", type(mod).__name__)
    if version is None:
        raise BackendUnavailable("cuda", (
            f"cannot tell which cuda-bindings version the driver module {name!r} is (no __version__ on its "
            "package, no BINDINGS_VERSION): install cuda-bindings 12.x or 13.x (the cuda12 or cuda extra)"))
    major = _major(version)
    if major is None or major < OLDEST_MAJOR:
        raise BackendUnavailable("cuda", (
            f"cuda-bindings {version} ({name!r}) is not supported: the cuda backend needs 12.x (the cuda12 "
            "extra, for a 12.x driver) or 13.x (the cuda extra)"))
    return DriverApi(min(major, NEWEST_KNOWN_MAJOR), version)


# ----------------------------------------------------------------------------- device classes
# Per device class (compute capability major), not per binding version; kept here because the
# probe child and the worker both need them and neither may import the other.

#: cuBLAS's recommended workspace (cublasSetWorkspace in the cuBLAS docs): 32 MiB on Hopper
#: (compute capability 9.x), 4 MiB on every other architecture
CUBLAS_WORKSPACE_HOPPER_BYTES = 32 << 20
CUBLAS_WORKSPACE_BYTES = 4 << 20

#: what one CUDA context is taken to cost when it could not be measured (a device that refuses a
#: second context - compute mode EXCLUSIVE_PROCESS, no memory left for one - or a probe that
#: failed): deliberately above the per-process figures nvidia-smi shows with lazy module loading
#: (~300-550 MiB), because an under-count lets the device budget admit a tenant the driver then
#: refuses, while an over-count only admits one tenant fewer. (compute capability major, bytes),
#: the first row whose major is <= the device's applies.
DEFAULT_CONTEXT_BYTES: tuple[tuple[int, int], ...] = (
    (9, 768 << 20),  # Hopper, Blackwell and later
    (8, 512 << 20),  # Ampere, Ada
    (0, 384 << 20),  # Volta, Turing and older
)


def cublas_workspace_bytes(cc_major: int) -> int:
    """The cuBLAS workspace a run lends for GEMMs on a device of compute capability ``cc_major``.x."""
    return CUBLAS_WORKSPACE_HOPPER_BYTES if cc_major == 9 else CUBLAS_WORKSPACE_BYTES


def default_context_bytes(cc_major: int) -> int:
    """The conservative cost of one context on a device of compute capability ``cc_major``.x."""
    return next(n for floor, n in DEFAULT_CONTEXT_BYTES if cc_major >= floor)
