"""The WASM tenant host: untrusted modules that reach the GPU only through metered imports.

:mod:`worker.wasm.host` runs modules (engine, epoch ticker, module cache,
armed stores), :mod:`worker.wasm.abi` is the ``tensorwasm`` import ABI with
its error codes, :mod:`worker.wasm.tensor_abi` its tensor ops as one table
(GEMM, elementwise, softmax, reductions), :mod:`worker.wasm.wasi` the WASI
preview-1 subset libc needs (stdout into the run's logs, nothing of the
host reachable), :mod:`worker.wasm.ops` is the worker's ``run_wasm`` op.
``docs/WASM-ABI.md`` is the guest author's reference; bundled guests live in
``worker/guests/*.wat`` (see :func:`guest_source`); tenants in C or Zig
are built with the SDK in ``sdk/`` (``docs/GUESTS.md``).
"""

from __future__ import annotations

from pathlib import Path

from worker.wasm.abi import IMPORT_MODULE, IMPORTS, ErrorCode, GuestRun
from worker.wasm.host import CompiledModule, EpochTicker, WasmHost, WasmSession
from worker.wasm.tensor_abi import TENSOR_OPS, UNARY_OPS, OpRun, TensorOp

__all__ = [
    "GUEST_DIR",
    "IMPORTS",
    "IMPORT_MODULE",
    "TENSOR_OPS",
    "UNARY_OPS",
    "CompiledModule",
    "EpochTicker",
    "ErrorCode",
    "GuestRun",
    "OpRun",
    "TensorOp",
    "WasmHost",
    "WasmSession",
    "guest_source",
]

#: the bundled WAT guests (package data of ``worker``)
GUEST_DIR = Path(__file__).resolve().parent.parent / "guests"


def guest_source(name: str) -> bytes:
    """The text of bundled guest ``name`` (``"axpy_sum"`` or ``"axpy_sum.wat"``)."""
    path = GUEST_DIR / (name if name.endswith(".wat") else f"{name}.wat")
    if path.parent != GUEST_DIR:
        raise ValueError(f"not a bundled guest name: {name!r}")
    return path.read_bytes()
