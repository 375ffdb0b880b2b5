"""The ``tensorwasm`` tensor ops (GEMM, elementwise, softmax, reductions) as one declarative table.

Each op is one :class:`TensorOp` entry: its parameters with their roles, the
float32 extent each buffer must have, which buffers must not alias, any
further domain rule, and how many guest bytes it writes. One generic checker
(:meth:`TensorOp.call`) runs every check in the ABI's fixed order and then
calls the backend method of the same name, so adding an op is one entry here
and one method per backend::

    guest call ──► handles       every ``buf`` parameter names a live buffer        else BAD_HANDLE
               ──► domain        dims >= 0, ``valid(...)``, no forbidden aliasing   else INVALID
               ──► buffer range  extent(dims) * 4 <= buffer bytes, per buffer       else BUFFER_BOUNDS
               ──► guest range   [ptr, ptr + out_bytes) inside linear memory        else MEMORY_BOUNDS
               ──► backend.<name>(buffers, dims, scalars, out view)                  CudaError ... -> BACKEND

The rule callables (``extents``, ``valid``, ``out_bytes``) take the ``dim``
and ``op`` parameters positionally, in parameter order (checked when the
table is built). Roles: ``buf`` (i64 handle), ``dim`` (i64 count or size, must be >= 0),
``f32`` (a float32 scalar), ``op`` (an i32 selector checked by ``valid``),
``ptr`` (an i32 guest pointer, u32-masked, replaced by a writable memoryview
of exactly ``out_bytes`` guest bytes). Sizes are Python ints, so
``rows * cols * 4`` cannot wrap: a product of two huge dims is simply larger
than any buffer and fails the range check.

Aliasing is decided on buffer identity, not handle numbers: a client buffer
passed as two arguments has two handles and is still one buffer.

The backends (``worker.backends.stub`` with numpy, ``worker.backends.cuda``
with cuBLAS and NVRTC kernels) receive arguments already known to be in range.

Typing: a tensor import's arguments are WASM values (ints) by position, replaced in place by
buffers and a guest-memory view, and its caller is wasmtime's raw caller pointer on the unchecked
import path: both stay dynamically typed here.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shared.errors import TensorWasmError
from shared.log import get_logger, log_event
from shared.wasm_abi import ErrorCode
from worker.backends.base import Backend, DeviceBuffer

__all__ = ["TENSOR_OPS", "UNARY_OPS", "OpRun", "TensorOp"]

T = TypeVar("T")

_log = get_logger("worker.wasm")

#: ``unary_f32`` selectors, in ABI order (docs/WASM-ABI.md)
UNARY_OPS: tuple[str, ...] = ("relu", "exp", "tanh", "sigmoid", "neg", "sqrt", "abs")

_WASM_TYPE = {"buf": "i64", "dim": "i64", "f32": "f32", "op": "i32", "ptr": "i32"}
_U32 = 0xFFFFFFFF
_OK = int(ErrorCode.OK)
_INVALID = int(ErrorCode.INVALID)
_BAD_HANDLE = int(ErrorCode.BAD_HANDLE)
_BUFFER_BOUNDS = int(ErrorCode.BUFFER_BOUNDS)
_MEMORY_BOUNDS = int(ErrorCode.MEMORY_BOUNDS)
_NO_MEMORY = int(ErrorCode.NO_MEMORY)
_BACKEND = int(ErrorCode.BACKEND)


class OpRun(Protocol):
    """What an op needs of the run that calls it: :class:`worker.wasm.abi.GuestRun` is the one.

    Declared here, below the ABI module, so the op table depends on no
    particular run: the ABI imports the table, never the other way round.
    """

    tenant_id: str
    backend: Backend
    #: guest handle -> (buffer, owned by this run)
    buffers: dict[int, tuple[DeviceBuffer, bool]]

    def guest_range(self, caller: Any, ptr: int, nbytes: int) -> memoryview | int:
        """A writable view of guest bytes ``[ptr, ptr+nbytes)``, or an error code."""
        ...

    def gemm(self, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int) -> None:
        """``matmul_f32`` on the backend with the run's metered workspace."""
        ...

    def device_op(self, name: str, fn: Callable[..., T], args: tuple[object, ...]) -> T | None:
        """``fn(*args)`` under the device lease, timed and charged, in chunks (worker.device_time)."""
        ...


@dataclass(frozen=True)
class TensorOp:
    """One import: ``params`` are ``"name:role"``; the callables take the dims (and op) by name."""

    name: str
    params: tuple[str, ...]
    #: float32 elements each buffer parameter must hold, in parameter order
    extents: Callable[..., tuple[int, ...]]
    #: pairs of buffer parameter names that must be different buffers (else INVALID)
    distinct: tuple[tuple[str, str], ...] = ()
    #: a further domain rule over dims and op selector (False -> INVALID)
    valid: Callable[..., bool] | None = None
    #: bytes written at the ``ptr`` parameter
    out_bytes: Callable[..., int] | None = None
    #: one line for the docs table
    doc: str = ""
    #: a GEMM: runs through :meth:`GuestRun.gemm`, which lends the backend a metered workspace
    gemm: bool = False
    #: (role, name) per parameter, derived
    roles: tuple[tuple[str, str], ...] = field(init=False)
    # argument positions, derived: buffers, dims and op, sizes (>= 0), the pointer (-1: none), distinct pairs
    _bufs: tuple[int, ...] = field(init=False, repr=False)
    _dims: tuple[int, ...] = field(init=False, repr=False)
    _sizes: tuple[int, ...] = field(init=False, repr=False)
    _ptr: int = field(init=False, repr=False)
    _distinct: tuple[tuple[int, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        roles = []
        for p in self.params:
            pname, role = p.split(":")
            if role not in _WASM_TYPE:
                raise ValueError(f"{self.name}: unknown role {role!r}")
            roles.append((role, pname))
        names = [n for _, n in roles]
        dims = [n for r, n in roles if r in ("dim", "op")]
        # the rule callables take the dims (and op) positionally, in parameter order: say so once, here
        for fn in (self.extents, self.valid, self.out_bytes):
            if fn is not None and list(inspect.signature(fn).parameters) != dims:
                raise ValueError(f"{self.name}: a rule takes {list(inspect.signature(fn).parameters)}, not {dims}")
        set_ = object.__setattr__
        set_(self, "roles", tuple(roles))
        set_(self, "_bufs", tuple(i for i, (r, _) in enumerate(roles) if r == "buf"))
        set_(self, "_dims", tuple(i for i, (r, _) in enumerate(roles) if r in ("dim", "op")))
        set_(self, "_sizes", tuple(i for i, (r, _) in enumerate(roles) if r == "dim"))
        set_(self, "_ptr", next((i for i, (r, _) in enumerate(roles) if r == "ptr"), -1))
        set_(self, "_distinct", tuple((names.index(a), names.index(b)) for a, b in self.distinct))

    @property
    def wasm_type(self) -> tuple[tuple[str, ...], str]:
        """(parameter types, result type) as in :data:`worker.wasm.abi.IMPORTS`."""
        return tuple(_WASM_TYPE[role] for role, _ in self.roles), "i32"

    def call(self, run: OpRun, caller: Any, *args: Any) -> int:
        """Check ``args`` in the ABI order, then run the op on the backend; its result code.

        The hot path of every tensor import (a GEMM loop calls it per
        matmul): positions are precomputed, arguments are replaced in place
        (handles by buffers, the pointer by a guest-memory view).
        """
        buffers = run.buffers
        a = list(args)
        for i in self._bufs:
            entry = buffers.get(a[i])
            if entry is None:
                return _BAD_HANDLE
            a[i] = entry[0]
        for i in self._sizes:
            if a[i] < 0:
                return _INVALID
        dims = [a[i] for i in self._dims]
        if self.valid is not None and not self.valid(*dims):
            return _INVALID
        for i, j in self._distinct:
            if a[i] is a[j]:
                return _INVALID
        for i, count in zip(self._bufs, self.extents(*dims)):
            if count * 4 > a[i].nbytes:
                return _BUFFER_BOUNDS
        p = self._ptr
        if p >= 0:
            assert self.out_bytes is not None
            got = run.guest_range(caller, a[p] & _U32, self.out_bytes(*dims))
            if isinstance(got, int):
                return got
            a[p] = got
        try:
            run.device_op(self.name, run.gemm if self.gemm else getattr(run.backend, self.name), tuple(a))
        except TensorWasmError as exc:  # CudaError, BackendUnavailable (cuBLAS missing) ...
            log_event(_log, logging.WARNING, "wasm.op_failed", tenant=run.tenant_id, op=self.name,
                      error=f"{type(exc).__name__}: {exc}")
            return _BACKEND
        return _OK


def _unary_ok(op: int, n: int) -> bool:
    return 0 <= op < len(UNARY_OPS)


def _rows_ok(rows: int, cols: int) -> bool:
    return rows == 0 or cols > 0  # argmax of an empty row has no answer


TENSOR_OPS: tuple[TensorOp, ...] = (
    TensorOp("matmul_f32", ("a:buf", "b:buf", "c:buf", "m:dim", "k:dim", "n:dim"),
             lambda m, k, n: (m * k, k * n, m * n), distinct=(("c", "a"), ("c", "b")), gemm=True,
             doc="`C[m,n] = A[m,k] @ B[k,n]`; `c` aliasing `a` or `b` is `INVALID`; `k = 0` gives zeros"),
    TensorOp("add_f32", ("x:buf", "y:buf", "out:buf", "n:dim"), lambda n: (n, n, n),
             doc="`out[:n] = x[:n] + y[:n]`; `out` may be `x` or `y`"),
    TensorOp("mul_f32", ("x:buf", "y:buf", "out:buf", "n:dim"), lambda n: (n, n, n),
             doc="`out[:n] = x[:n] * y[:n]`; `out` may be `x` or `y`"),
    TensorOp("add_rows_f32", ("m:buf", "v:buf", "rows:dim", "cols:dim"), lambda rows, cols: (rows * cols, cols),
             distinct=(("m", "v"),),
             doc="`m[r, :] += v[:cols]` for every row, in place (a bias); `v` aliasing `m` is `INVALID`"),
    TensorOp("unary_f32", ("op:op", "x:buf", "out:buf", "n:dim"), lambda op, n: (n, n), valid=_unary_ok,
             doc="`out[:n] = f(x[:n])`, `op` 0 relu, 1 exp, 2 tanh, 3 sigmoid, 4 neg, 5 sqrt, 6 abs; "
                 "another `op` is `INVALID`; `out` may be `x`"),
    TensorOp("scale_f32", ("x:buf", "a:f32", "n:dim"), lambda n: (n,),
             doc="`x[:n] *= a`"),
    TensorOp("softmax_rows_f32", ("x:buf", "rows:dim", "cols:dim"), lambda rows, cols: (rows * cols,),
             doc="numerically stable softmax of each row (`exp(x - max) / sum`), in place"),
    TensorOp("max_f32", ("x:buf", "count:dim", "out:ptr"), lambda count: (count,),
             valid=lambda count: count > 0, out_bytes=lambda count: 4,
             doc="the largest of the first `count` (>= 1) floats as an `f32` at `out_ptr` (NaN if any is NaN)"),
    TensorOp("argmax_rows_f32", ("x:buf", "rows:dim", "cols:dim", "out:ptr"), lambda rows, cols: (rows * cols,),
             valid=_rows_ok, out_bytes=lambda rows, cols: 4 * rows,
             doc="the column of each row's largest value (the first one; a NaN counts as largest) "
                 "as `rows` i32 at `out_ptr`; `cols = 0` with `rows > 0` is `INVALID`"),
    TensorOp("transpose_f32", ("x:buf", "out:buf", "rows:dim", "cols:dim"),
             lambda rows, cols: (rows * cols, rows * cols), distinct=(("out", "x"),),
             doc="`out[cols, rows] = x[rows, cols].T`; `out` aliasing `x` is `INVALID`"),
)
