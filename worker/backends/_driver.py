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

Without ``libcuda`` (or ``libnvrtc``) the bindings import fine and the
*first call* raises a ``RuntimeError`` subclass (cuda.pathfinder's
``DynamicLibNotFoundError``); :meth:`Driver.call` turns that into
:class:`~shared.errors.BackendUnavailable` with the reason, never a crash.

The module is named, not imported here: ``cuda.bindings.driver`` by default,
or whatever ``TWT_CUDA_DRIVER_MODULE`` / ``cuda_driver_module`` names (the
test suite's fake driver), passed to the worker in its backend options. A
module object can also be handed in directly (unit tests). The backend never
knows which one it got.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from shared.errors import BackendUnavailable, CudaError

__all__ = ["DEFAULT_DRIVER_MODULE", "DEFAULT_NVRTC_MODULE", "Driver", "Nvrtc", "load_module"]

DEFAULT_DRIVER_MODULE = "cuda.bindings.driver"
DEFAULT_NVRTC_MODULE = "cuda.bindings.nvrtc"


def load_module(module: str | Any | None, default: str, what: str) -> Any:
    """``module`` itself when it is an object, else import it by name (``default`` when None)."""
    if module is not None and not isinstance(module, str):
        return module
    name = module or default
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailable("cuda", f"{what} module {name!r} is not importable: {exc}") from None


def _check(call: str, result: tuple[Any, ...], namer: Callable[[Any], str]) -> Any:
    """The checked-call helper: ``(err, *values)`` -> values, or raise :class:`CudaError`."""
    err = result[0]
    if err:
        raise CudaError(call, namer(err), int(err))
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def _unloadable(what: str, call: str, exc: RuntimeError) -> BackendUnavailable:
    return BackendUnavailable("cuda", f"{what} not loadable ({call}): {type(exc).__name__}: {exc}")


class Driver:
    """A loaded driver module (real or fake) and the checked calls on it."""

    def __init__(self, module: str | Any | None = None) -> None:
        self.mod = load_module(module, DEFAULT_DRIVER_MODULE, "CUDA driver bindings")
        self.module_name: str = getattr(self.mod, "__name__", type(self.mod).__name__)
        self.CUresult = self.mod.CUresult
        self.OUT_OF_MEMORY = self.mod.CUresult.CUDA_ERROR_OUT_OF_MEMORY

    def call(self, name: str, *args: Any) -> Any:
        """``cuX(*args)`` checked: its value(s), or :class:`CudaError` / :class:`BackendUnavailable`."""
        try:
            result = getattr(self.mod, name)(*args)
        except RuntimeError as exc:  # libcuda missing: raised by the loader on the first call
            raise _unloadable("CUDA driver", name, exc) from None
        return _check(name, result, self.error_name)

    def check(self, name: str, result: tuple[Any, ...]) -> Any:
        """Check the result tuple of a call made directly (the hot paths)."""
        return _check(name, result, self.error_name)

    def error(self, name: str, err: Any) -> CudaError:
        """The :class:`CudaError` for a failed ``name`` that returned ``err``."""
        return CudaError(name, self.error_name(err), int(err))

    def error_name(self, err: Any) -> str:
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

    def __init__(self, module: str | Any | None = None) -> None:
        self.mod = load_module(module, DEFAULT_NVRTC_MODULE, "NVRTC bindings")

    def call(self, name: str, *args: Any) -> Any:
        try:
            result = getattr(self.mod, name)(*args)
        except RuntimeError as exc:  # libnvrtc missing
            raise _unloadable("NVRTC (needed for the fill/axpy/sum kernels)", name, exc) from None
        return _check(name, result, self.error_name)

    def error_name(self, err: Any) -> str:
        try:
            res, raw = self.mod.nvrtcGetErrorString(err)
            if not res and raw:
                return raw.decode() if isinstance(raw, bytes) else str(raw)
        except (RuntimeError, TypeError, ValueError, AttributeError):
            pass
        return str(getattr(err, "name", None) or f"nvrtcResult {int(err)}")
