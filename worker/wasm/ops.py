"""The worker's ``run_wasm`` op (imported on first use through ``worker.server._LAZY_OPS``).

``put_module`` never reaches a worker: the supervisor keeps a tenant's
modules and attaches the stored bytes to a ``run_wasm`` that names only a
digest, so the worker always receives the module bytes (and compiles them
once: its cache is keyed by the sha256 it computes itself).
"""

from __future__ import annotations

import hashlib
import math

import zmq

from shared.checks import is_int, is_number
from shared.errors import InvalidArgument, KernelTimeout, UnknownModule
from shared.exitcodes import WORKER_COMPILE_OVERRUN, WORKER_GPU_QUEUE_OVERRUN
from worker.server import Reply, WorkerServer
from worker.wasm.compiler import CompileOverrun
from worker.wasm.host import MAX_ARGS, WasmHost

__all__ = ["op_run_wasm"]

_MAX_EXPORT_NAME = 256


def _positive(value: object, name: str, default: float, ceiling: float) -> float:
    """``value`` (None: ``default``) as a positive number, never above ``ceiling`` (the spec's)."""
    if value is None:
        return default
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive number, got {value!r}")
    return min(value, ceiling)


def op_run_wasm(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``run_wasm {export, args, fuel, timeout_s, digest}`` + module body -> ``{results, fuel_used, elapsed_s, ...}``.

    The body is the module (binary or WAT text); ``args`` are ints, floats
    or ``{"handle": h}`` client buffers of this instance. ``fuel`` and
    ``timeout_s`` default to the tenant's spec and are capped by it (the
    supervisor caps them too). The reply also carries ``cached`` (compiled
    module reused), ``gpu_peak_bytes`` (run-scoped allocations),
    ``memory_bytes`` (final linear memory) and ``logs`` (the first guest log
    lines). Errors: WasmCompile, WasmTrap (``trap_code``), KernelTimeout,
    MemoryExhausted (no room for linear memory), InvalidArgument.
    """
    ctx = server.require_context()
    if body is None:
        raise UnknownModule(ctx.tenant_id, str(args.get("digest")))
    module = body.buffer
    export = args.get("export")
    if not isinstance(export, str) or not 0 < len(export) <= _MAX_EXPORT_NAME:
        raise InvalidArgument(f"export must be a function name of 1..{_MAX_EXPORT_NAME} characters")
    call_args = args.get("args") or []
    if not isinstance(call_args, list) or len(call_args) > MAX_ARGS:
        raise InvalidArgument(f"args must be a list of at most {MAX_ARGS} values")
    digest = args.get("digest")
    if digest is not None and (not isinstance(digest, str) or digest != hashlib.sha256(module).hexdigest()):
        raise InvalidArgument("digest does not match the module bytes")
    spec = ctx.spec
    raw_fuel = args.get("fuel")
    if raw_fuel is not None and not is_int(raw_fuel):
        raise InvalidArgument(f"fuel must be an int, got {type(raw_fuel).__name__}")
    fuel = int(_positive(raw_fuel, "fuel", spec.wasm_fuel, spec.wasm_fuel))
    timeout_s = float(_positive(args.get("timeout_s"), "timeout_s", spec.wasm_timeout_s, spec.wasm_timeout_s))
    host = WasmHost.for_context(ctx)
    try:
        return host.run(module, export, call_args, fuel=fuel, timeout_s=timeout_s), None
    except CompileOverrun:
        # The compiler thread cannot be stopped; it stops with the process, once this reply is out.
        server.exit_code = WORKER_COMPILE_OVERRUN
        server.stop_event.set()
        raise
    except KernelTimeout:
        if getattr(ctx.backend, "queue_overrun", False) or ctx.gate.queue_overrun:
            # queued GPU work outlived the deadline: only the context's destruction (our exit) cancels it
            server.exit_code = WORKER_GPU_QUEUE_OVERRUN
            server.stop_event.set()
        raise
