"""Imported once by the forkserver (``--start-method forkserver``) so forked workers start warm.

Only modules that start no threads at import: zmq, msgpack, psutil, wasmtime
(its engine and compiler threads are created later, in each worker), and
the worker's own modules. numpy is left out on purpose: its BLAS may start a
thread pool at import, and threads do not survive a fork.
"""

from __future__ import annotations

import msgpack  # noqa: F401
import psutil  # noqa: F401
import zmq  # noqa: F401

import shared.frames
import shared.quota
import shared.spec  # noqa: F401
import worker.context
import worker.control
import worker.main
import worker.server

try:
    import wasmtime  # noqa: F401

    import worker.wasm.ops  # noqa: F401  (the host and the ABI; no engine or thread until a run)
    from worker.wasm.host import engine_fingerprint

    # Found once here (cached), not in each pool worker's warm-up: the wasmtime version's lookup
    # reads the installed packages' metadata, ~3 ms of CPU a worker, and an activation's
    # import_modules asks for it. It reads only the environment the forked workers inherit.
    engine_fingerprint()
except ImportError:  # pragma: no cover - wasmtime is a dependency; stay startable without it
    pass

# The wire decoders a bind runs (shared.wire compiles one per record class on first use): compiled
# here once, every forked worker inherits them. Measured on a forked child's first bind: 5-7 ms
# before, 1.7-3.4 ms after (the rest: copy-on-write faults on the pages the bind touches).
from shared.worker_link import BindMessage
from shared.spec import TenantSpec

BindMessage.from_wire(BindMessage(spec=TenantSpec("preload"), instance=0, incarnation=0, segment="-",
                                  backend="stub", backend_options={}).to_wire())
