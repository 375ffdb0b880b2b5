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

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shared.errors import TensorWasmError
from shared.log import get_logger, log_event
from shared.wasm_abi import ErrorCode
from worker.backends.base import Backend, DeviceBuffer

__all__ = ["BINARY_OPS", "DTYPES", "DTYPE_BYTES", "REDUCE_OPS", "TENSOR_OPS", "UNARY_OPS", "OpRun", "TensorOp"]

T = TypeVar("T")

_log = get_logger("worker.wasm")

#: ``unary_f32`` selectors, in ABI order (docs/WASM-ABI.md)
UNARY_OPS: tuple[str, ...] = ("relu", "exp", "tanh", "sigmoid", "neg", "sqrt", "abs",
                              "log", "gelu", "silu", "rsqrt", "recip")
#: ``binary_f32`` / ``binary_rows_f32`` / ``scalar_f32`` selectors (C: ``TWT_BIN_<NAME>``)
BINARY_OPS: tuple[str, ...] = ("add", "sub", "mul", "div", "max", "min")
#: ``reduce_rows_f32`` selectors (C: ``TWT_RED_<NAME>``)
REDUCE_OPS: tuple[str, ...] = ("sum", "max", "mean")
#: element types of ``cast`` and ``gemm_ex`` (C: ``TWT_<NAME>``), and their sizes in bytes
DTYPES: tuple[str, ...] = ("f32", "f16", "bf16")
DTYPE_BYTES: tuple[int, ...] = (4, 2, 2)

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

    def gemm_workspace(self) -> DeviceBuffer | None:
        """The run's metered GEMM workspace (allocated on first use), or None: the backend's fallback."""
        ...

    def device_op(self, name: str, fn: Callable[..., T], args: tuple[object, ...]) -> T | None:
        """``fn(*args)`` under the device lease, timed and charged, in chunks (worker.device_time)."""
        ...

    def device_submit(self, name: str, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """Queue ``fn(*args)`` for the device (as :meth:`device_op`) and return at once."""
        ...


@dataclass(frozen=True)
class TensorOp:
    """One import: ``params`` are ``"name:role"``; the callables take the dims (and op) by name."""

    name: str
    params: tuple[str, ...]
    #: extent units (``unit`` bytes each, float32 elements by default) each buffer parameter must hold
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
    #: bytes per ``extents`` unit: 4 (float32 elements), 1 for ops that count bytes (copy, dtypes)
    unit: int = 4
    #: a last rule over the checked arguments (buffers, dims, the guest view), run just before the
    #: backend: 0, or an error code (a gather's row indices, a copy's overlap); may replace arguments
    check: Callable[[list[Any]], int] | None = None
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
        unit = self.unit
        for i, count in zip(self._bufs, self.extents(*dims)):
            if count * unit > a[i].nbytes:
                return _BUFFER_BOUNDS
        p = self._ptr
        if p >= 0:
            assert self.out_bytes is not None
            got = run.guest_range(caller, a[p] & _U32, self.out_bytes(*dims))
            if isinstance(got, int):
                return got
            a[p] = got
        if self.check is not None:
            code = self.check(a)
            if code:
                return code
        fn: Callable[..., object]
        if not self.gemm:
            fn = getattr(run.backend, self.name)
        elif self.name == "matmul_f32":
            run.gemm_workspace()  # allocated here, on the executor thread, before the op may be queued
            fn = run.gemm
        else:
            fn = functools.partial(getattr(run.backend, self.name), workspace=run.gemm_workspace())
        try:
            if p >= 0:  # the result goes to guest memory: the guest reads it as soon as we return
                run.device_op(self.name, fn, tuple(a))
            else:  # writes device buffers only: queued, the guest goes on (worker.device_time)
                run.device_submit(self.name, fn, tuple(a))
        except TensorWasmError as exc:  # CudaError, BackendUnavailable (cuBLAS missing) ...
            log_event(_log, logging.WARNING, "wasm.op_failed", tenant=run.tenant_id, op=self.name,
                      error=f"{type(exc).__name__}: {exc}")
            return _BACKEND
        return _OK


def _unary_ok(op: int, n: int) -> bool:
    return 0 <= op < len(UNARY_OPS)


def _trans_ok(trans_a: int, trans_b: int) -> bool:
    return trans_a in (0, 1) and trans_b in (0, 1)


def _strided(stride: int, size: int, batch: int) -> int:
    """Elements a strided batch of ``batch`` matrices of ``size`` elements spans (0: none is read)."""
    return 0 if batch == 0 or size == 0 else (batch - 1) * stride + size


def _batched_ok(trans_a: int, trans_b: int, m: int, n: int, k: int, stride_a: int, stride_b: int,
                stride_c: int, batch: int) -> bool:
    # the outputs of a batch must not overlap (their order of writes is not defined); inputs may
    # (a stride of 0 broadcasts one matrix to every batch)
    return _trans_ok(trans_a, trans_b) and (batch <= 1 or stride_c >= m * n)


def _dtype_ok(*dtypes: int) -> bool:
    return all(0 <= d < len(DTYPES) for d in dtypes)


def _gather_check(a: list[Any]) -> int:
    """Every row index inside the table (``table.nbytes // (4 * cols)`` rows), else BUFFER_BOUNDS.

    The indices are copied out of guest memory first, so the backend uses exactly the ones checked.
    """
    import numpy as np

    table, view, n, cols = a[0], a[1], a[2], a[3]
    idx = np.frombuffer(view, dtype="<i4", count=n).copy()
    if n and cols:
        rows = table.nbytes // (4 * cols)
        if int(idx.min()) < 0 or int(idx.max()) >= rows:
            return _BUFFER_BOUNDS
    a[1] = memoryview(idx.tobytes())
    return _OK


def _copy_check(a: list[Any]) -> int:
    """Overlapping ranges of one buffer are INVALID (a device copy of overlapping memory is undefined)."""
    src, src_off, dst, dst_off, nbytes = a
    if src is dst and nbytes and src_off < dst_off + nbytes and dst_off < src_off + nbytes:
        return _INVALID
    return _OK


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
    TensorOp("gemm_f32", ("trans_a:op", "trans_b:op", "m:dim", "n:dim", "k:dim", "alpha:f32", "a:buf", "b:buf",
                          "beta:f32", "c:buf"),
             lambda trans_a, trans_b, m, n, k: (m * k, k * n, m * n), valid=lambda trans_a, trans_b, m, n, k:
             _trans_ok(trans_a, trans_b), distinct=(("c", "a"), ("c", "b")), gemm=True,
             doc="`C[m,n] = alpha * op(A) @ op(B) + beta * C`, row-major; `op(A)` is `A[m,k]`, or `A[k,m]^T` "
                 "when `trans_a` is 1 (`B[k,n]`, or `B[n,k]^T` when `trans_b` is 1); a `trans_*` other than 0 or 1 "
                 "is `INVALID`; `beta = 0` does not read C; `c` aliasing `a` or `b` is `INVALID`"),
    TensorOp("gemm_strided_batched_f32",
             ("trans_a:op", "trans_b:op", "m:dim", "n:dim", "k:dim", "alpha:f32", "a:buf", "stride_a:dim", "b:buf",
              "stride_b:dim", "beta:f32", "c:buf", "stride_c:dim", "batch:dim"),
             lambda trans_a, trans_b, m, n, k, stride_a, stride_b, stride_c, batch: (
                 _strided(stride_a, m * k, batch), _strided(stride_b, k * n, batch), _strided(stride_c, m * n, batch)),
             valid=_batched_ok, distinct=(("c", "a"), ("c", "b")), gemm=True,
             doc="`batch` GEMMs as `gemm_f32`, matrix `i` at element `i * stride_*` of each buffer (strides in "
                 "floats; a stride of 0 uses one matrix for every batch); `stride_c < m * n` with `batch > 1` "
                 "(overlapping outputs) is `INVALID`"),
    TensorOp("binary_f32", ("op:op", "x:buf", "y:buf", "out:buf", "n:dim"), lambda op, n: (n, n, n),
             valid=lambda op, n: 0 <= op < len(BINARY_OPS),
             doc="`out[:n] = x[:n] <op> y[:n]`, `op` a `TWT_BIN_*` (0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min; "
                 "max/min propagate NaN like numpy); another `op` is `INVALID`; `out` may be `x` or `y`"),
    TensorOp("binary_rows_f32", ("op:op", "m:buf", "v:buf", "out:buf", "rows:dim", "cols:dim"),
             lambda op, rows, cols: (rows * cols, cols, rows * cols), valid=lambda op, rows, cols:
             0 <= op < len(BINARY_OPS), distinct=(("out", "v"),),
             doc="`out[r, :] = m[r, :] <op> v[:cols]` for every row (`op` a `TWT_BIN_*`); `out` may be `m`; "
                 "`out` aliasing `v` is `INVALID`"),
    TensorOp("scalar_f32", ("op:op", "x:buf", "a:f32", "out:buf", "n:dim"), lambda op, n: (n, n),
             valid=lambda op, n: 0 <= op < len(BINARY_OPS),
             doc="`out[:n] = x[:n] <op> a` (`op` a `TWT_BIN_*`, e.g. `TWT_BIN_SUB`: `x - a`); `out` may be `x`"),
    TensorOp("reduce_rows_f32", ("op:op", "x:buf", "rows:dim", "cols:dim", "out:buf"),
             lambda op, rows, cols: (rows * cols, rows),
             valid=lambda op, rows, cols: 0 <= op < len(REDUCE_OPS) and _rows_ok(rows, cols),
             distinct=(("out", "x"),),
             doc="`out[r]` = sum, max or mean (`TWT_RED_SUM`, `_MAX`, `_MEAN`) of row `r` of `x[rows, cols]` "
                 "(float32 result; max propagates NaN); `cols = 0` with `rows > 0` is `INVALID`; `out` aliasing "
                 "`x` is `INVALID`"),
    TensorOp("layernorm_rows_f32", ("x:buf", "gamma:buf", "beta:buf", "out:buf", "rows:dim", "cols:dim", "eps:f32"),
             lambda rows, cols: (rows * cols, cols, cols, rows * cols), valid=_rows_ok,
             distinct=(("out", "gamma"), ("out", "beta")),
             doc="per row: `out = (x - mean) / sqrt(var + eps) * gamma + beta` (`var` the biased variance, "
                 "as PyTorch's LayerNorm); `out` may be `x`; `out` aliasing `gamma` or `beta`, or `cols = 0` "
                 "with `rows > 0`, is `INVALID`"),
    TensorOp("gather_rows_f32", ("table:buf", "idx:ptr", "n:dim", "cols:dim", "out:buf"),
             lambda n, cols: (0, n * cols), out_bytes=lambda n, cols: 4 * n, distinct=(("out", "table"),),
             check=_gather_check,
             doc="`out[i, :] = table[idx[i], :]` for `i < n`, rows of `cols` floats; `idx` points at `n` i32 "
                 "row indices in guest memory (`MEMORY_BOUNDS` outside it); an index < 0 or past the table's "
                 "last whole row is `BUFFER_BOUNDS`; `out` aliasing `table` is `INVALID`"),
    TensorOp("copy", ("src:buf", "src_off:dim", "dst:buf", "dst_off:dim", "nbytes:dim"),
             lambda src_off, dst_off, nbytes: (src_off + nbytes, dst_off + nbytes), unit=1, check=_copy_check,
             doc="copies `nbytes` bytes from `src` at byte offset `src_off` to `dst` at `dst_off`, on the device; "
                 "`src` may be `dst` when the ranges do not overlap (overlap is `INVALID`)"),
    TensorOp("causal_mask_f32", ("x:buf", "rows:dim", "cols:dim", "offset:dim"),
             lambda rows, cols, offset: (rows * cols,),
             doc="`x[r, c] = -inf` where `c > r + offset`, in place (attention's causal mask; `offset`: "
                 "positions before row 0, e.g. a KV cache's length)"),
    TensorOp("cast", ("src:buf", "src_dtype:op", "dst:buf", "dst_dtype:op", "n:dim"),
             lambda src_dtype, dst_dtype, n: (n * DTYPE_BYTES[src_dtype], n * DTYPE_BYTES[dst_dtype]), unit=1,
             valid=lambda src_dtype, dst_dtype, n: _dtype_ok(src_dtype, dst_dtype), distinct=(("dst", "src"),),
             doc="converts `n` elements of `src` (dtype `TWT_F32`, `TWT_F16` or `TWT_BF16`) into `dst` of "
                 "another dtype, rounding to nearest even (NaN stays NaN); an unknown dtype or `dst` aliasing "
                 "`src` is `INVALID`"),
    TensorOp("gemm_ex", ("trans_a:op", "trans_b:op", "m:dim", "n:dim", "k:dim", "alpha:f32", "a:buf",
                         "ab_dtype:op", "b:buf", "beta:f32", "c:buf", "c_dtype:op"),
             lambda trans_a, trans_b, m, n, k, ab_dtype, c_dtype: (
                 m * k * DTYPE_BYTES[ab_dtype], k * n * DTYPE_BYTES[ab_dtype], m * n * DTYPE_BYTES[c_dtype]),
             unit=1, valid=lambda trans_a, trans_b, m, n, k, ab_dtype, c_dtype:
             _trans_ok(trans_a, trans_b) and _dtype_ok(ab_dtype, c_dtype) and c_dtype in (0, ab_dtype),
             distinct=(("c", "a"), ("c", "b")), gemm=True,
             doc="`gemm_f32` over `A`, `B` of dtype `ab_dtype` and `C` of `c_dtype` (`TWT_F32`, `TWT_F16`, "
                 "`TWT_BF16`), products accumulated in float32, the result rounded once to `c_dtype`; `c_dtype` "
                 "must be `ab_dtype` or `TWT_F32` (cuBLAS has no other pairs), else `INVALID`"),
)
