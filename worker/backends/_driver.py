"""The one door to the CUDA driver (and NVRTC): load the bindings module, call, check.

Every CUDA call of the cuda backend goes through :meth:`Driver.call` (or, on
the two hot paths, calls the function directly and hands a failed result to
:meth:`Driver.error`). Both end in :func:`_check`, the single place where a
``CUresult`` / ``nvrtcResult`` becomes a :class:`~shared.errors.CudaError`
carrying the driver's own name for it (``cuGetErrorName``), like cuda.core's
``handle_return``.

cuda-python calls return tuples with the result code first:
``(err,)``, ``(err, value)`` or ``(err, v1, v2)``; :func:`_check` returns
``None``, ``value`` or ``(v1, v2)``.

Sticky errors: when a driver call answers one of
:data:`shared.exitcodes.STICKY_CUDA_ERRORS` (an illegal address, a launch
failure ...), the context is gone for the rest of the process - every later
call returns the same error. :class:`Driver` remembers the first such error in
:attr:`Driver.context_lost`, and the :class:`CudaError` it raises says so; the
worker's server reads it after the request and ends the process (see
``shared/exitcodes.py``). A kernel's fault surfaces at whichever call comes next
(usually the synchronize after the launch), and every path goes through here.

Without ``libcuda`` (or ``libnvrtc``) the bindings import fine and the
*first call* raises a ``RuntimeError`` subclass (cuda.pathfinder's
``DynamicLibNotFoundError``); :meth:`Driver.call` turns that into
:class:`~shared.errors.BackendUnavailable` with the reason, never a crash.

The module is named, not imported here: ``cuda.bindings.driver`` by default,
or whatever ``TWT_CUDA_DRIVER_MODULE`` / ``cuda_driver_module`` names (the
test suite's fake driver), passed to the worker in its backend options. A
module object can also be handed in directly (unit tests). The backend never
knows which one it got.

The few calls whose shape differs between cuda-bindings 12.x and 13.x
(``cuCtxCreate``, ``CUmemPoolProps``, the ``MAX_POOL_SIZE`` attribute) are
built by :attr:`Driver.api` (:mod:`shared.cuda_compat`, the one version
switch) and checked here like every other call (:meth:`Driver.check`).

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import importlib
from typing import Any, SupportsInt
from collections.abc import Callable

from shared.cuda_compat import DriverApi, driver_api
from shared.errors import NVRTC_INSTALL_HINT, BackendUnavailable, CudaError
from shared.exitcodes import is_sticky_cuda_error

__all__ = ["DEFAULT_DRIVER_MODULE", "DEFAULT_NVRTC_MODULE", "Driver", "Nvrtc", "import_bindings", "load_module"]

DEFAULT_DRIVER_MODULE = "cuda.bindings.driver"
DEFAULT_NVRTC_MODULE = "cuda.bindings.nvrtc"


def import_bindings(module: object, default: str) -> Any:
    """``module`` itself when it is an object, else import it by name (``default`` when None).

    The one way the cuda backend gets a bindings module (driver, NVRTC,
    cuBLAS); an ``ImportError`` is the caller's to word.
    """
    if module is not None and not isinstance(module, str):
        return module
    return importlib.import_module(module or default)


def load_module(module: object, default: str, what: str) -> Any:
    """:func:`import_bindings`, a module that does not import being :class:`BackendUnavailable`."""
    try:
        return import_bindings(module, default)
    except ImportError as exc:
        raise BackendUnavailable("cuda", f"{what} module {module or default!r} is not importable: {exc}") from None


def _check(call: str, result: tuple[Any, ...], make_error: Callable[[str, SupportsInt], CudaError]) -> Any:
    """The checked-call helper: ``(err, *values)`` -> values, or raise :class:`CudaError`."""
    err = result[0]
    if err:
        raise make_error(call, err)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def _unloadable(what: str, call: str, exc: RuntimeError) -> BackendUnavailable:
    return BackendUnavailable("cuda", f"{what} not loadable ({call}): {type(exc).__name__}: {exc}")


class Driver:
    """A loaded driver module (real or fake) and the checked calls on it."""

    def __init__(self, module: object = None) -> None:
        self.mod = load_module(module, DEFAULT_DRIVER_MODULE, "CUDA driver bindings")
        self.module_name: str = getattr(self.mod, "__name__", type(self.mod).__name__)
        self.CUresult = self.mod.CUresult
        self.OUT_OF_MEMORY = self.mod.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        #: the call shapes of this module's cuda-bindings major (12.x or 13.x): the one version switch
        self.api: DriverApi = driver_api(self.mod)
        #: the first sticky error seen (its driver name): the context is unusable from then on
        self.context_lost: str | None = None

    def call(self, name: str, *args: Any) -> Any:
        """``cuX(*args)`` checked: its value(s), or :class:`CudaError` / :class:`BackendUnavailable`."""
        try:
            result = getattr(self.mod, name)(*args)
        except RuntimeError as exc:  # libcuda missing: raised by the loader on the first call
            raise _unloadable("CUDA driver", name, exc) from None
        except TypeError as exc:  # the binding refused the call's shape: a version this code does not know
            raise self._refused(name, exc) from None
        return _check(name, result, self.error)

    def _refused(self, name: str, exc: TypeError) -> BackendUnavailable:
        return BackendUnavailable("cuda", (
            f"{name}: cuda-bindings {self.api.version} refused the call's arguments ({exc}); the backend "
            "supports cuda-bindings 12.x and 13.x (shared.cuda_compat)"))

    def create_context(self, flags: int, dev: object) -> Any:
        """``cuCtxCreate`` in this binding's shape (:meth:`DriverApi.ctx_create`), checked like :meth:`call`."""
        try:
            result = self.api.ctx_create(self.mod, flags, dev)
        except RuntimeError as exc:  # libcuda missing
            raise _unloadable("CUDA driver", "cuCtxCreate", exc) from None
        except TypeError as exc:
            raise self._refused("cuCtxCreate", exc) from None
        return _check("cuCtxCreate", result, self.error)

    def check(self, name: str, result: tuple[Any, ...]) -> Any:
        """Check the result tuple of a call made directly (the hot paths)."""
        return _check(name, result, self.error)

    def error(self, name: str, err: SupportsInt) -> CudaError:
        """The :class:`CudaError` for a failed ``name`` that returned ``err`` (notes a sticky one)."""
        result_name = self.error_name(err)
        if not is_sticky_cuda_error(result_name):
            return CudaError(name, result_name, int(err))
        if self.context_lost is None:
            self.context_lost = result_name
        return CudaError(name, result_name, int(err), message=(
            f"{name} failed: {result_name} ({int(err)}); this error is sticky: the CUDA context of this "
            "worker is lost, the worker exits and the supervisor restarts it under the tenant's restart policy"))

    def error_name(self, err: SupportsInt) -> str:
        """The driver's name for ``err`` (``cuGetErrorName``), else the enum's, else the number."""
        try:
            res, raw = self.mod.cuGetErrorName(err)
            if not res and raw:
                return raw.decode() if isinstance(raw, bytes) else str(raw)
        except (RuntimeError, TypeError, ValueError, AttributeError):
            pass
        return str(getattr(err, "name", None) or f"CUresult {int(err)}")


class Nvrtc:
    """A loaded NVRTC module (real or fake) and the checked calls on it."""

    def __init__(self, module: object = None) -> None:
        self.mod = load_module(module, DEFAULT_NVRTC_MODULE, "NVRTC bindings")

    def call(self, name: str, *args: Any) -> Any:
        try:
            result = getattr(self.mod, name)(*args)
        except RuntimeError as exc:  # libnvrtc missing
            raise BackendUnavailable("cuda", (
                f"NVRTC not loadable ({name}): {type(exc).__name__}: {exc}; the tensor kernels need it: "
                f"{NVRTC_INSTALL_HINT}")) from None
        return _check(name, result, self.error)

    def error(self, name: str, err: SupportsInt) -> CudaError:
        """The :class:`CudaError` for a failed NVRTC call (NVRTC errors are never sticky)."""
        return CudaError(name, self.error_name(err), int(err))

    def error_name(self, err: SupportsInt) -> str:
        try:
            res, raw = self.mod.nvrtcGetErrorString(err)
            if not res and raw:
                return raw.decode() if isinstance(raw, bytes) else str(raw)
        except (RuntimeError, TypeError, ValueError, AttributeError):
            pass
        return str(getattr(err, "name", None) or f"nvrtcResult {int(err)}")
