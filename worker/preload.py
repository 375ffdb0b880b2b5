"""Imported once by the forkserver (``--start-method forkserver``) so forked workers start warm.

Only what starts no thread: zmq, msgpack, psutil, wasmtime, the worker's own
modules (the lazy ops' too, resolved), the logging set-up, the C library's symbols, and a pool host's engine
and linker with the warm-up module compiled serially (its epoch thread and
wasmtime's compiler threads start later, in each worker). numpy is left out on
purpose: its BLAS may start a thread pool at import, and threads do not survive
a fork. Whatever is made here is shared by every tenant's worker: nothing of a
tenant ever is (the fork server never binds). Last, everything made here is
frozen out of the collector's walks (``gc.freeze``) and the heap's holes are
filled (``worker.fork_heap``), so it must stay the fork server's last preload module.
"""

from __future__ import annotations

import gc
import sys

import msgpack  # noqa: F401
import psutil  # noqa: F401
import zmq  # noqa: F401

import shared.frames
import shared.log
import shared.prctl
import shared.quota
import shared.spec
import worker.context
import worker.control
import worker.fork_child
import worker.main
import worker.server

# The modules of the ops an activation sends (worker.server's lazy ops: regions, parking): a pool
# worker's warm-up imported them one a step, ~2 ms of CPU in every forked worker.
import worker.parking
import worker.regions

try:
    import wasmtime  # noqa: F401

    import worker.wasm.artifacts  # export/import/load_modules
    import worker.wasm.ops  # (the host and the ABI; no engine or thread until a run)
    from worker.wasm.host import engine_fingerprint, preload_pool_host

    # Found once here (cached), not in each pool worker's warm-up: the wasmtime version's lookup
    # reads the installed packages' metadata, ~3 ms of CPU a worker, and an activation's
    # import_modules asks for it. It reads only the environment the forked workers inherit.
    engine_fingerprint()
    # The pool host (engine, linker, host functions) and the warm-up module's artifact, made once
    # here: a forked pool worker's warm-up then only loads that artifact and runs it (~6 ms less of
    # each worker's start; no thread is started here - see preload_pool_host). An optimisation
    # only: should it fail, the fork server still serves, and each worker makes its own.
    try:
        preload_pool_host()
    except Exception as exc:  # noqa: BLE001 - a fork server that died here would start no worker at all
        sys.stderr.write(f"twt fork server: the pool's WASM host was not preloaded ({exc!r}); "
                         "each worker makes its own\n")
except ImportError:  # pragma: no cover - wasmtime is a dependency; stay startable without it
    pass

# The wire decoders a bind runs (shared.wire compiles one per record class on first use): compiled
# here once, every forked worker inherits them. Measured on a forked child's first bind: 5-7 ms
# before, 1.7-3.4 ms after (the rest: copy-on-write faults on the pages the bind touches).
from shared.worker_link import BindMessage, WorkerHello
from shared.spec import TenantSpec

BindMessage.from_wire(BindMessage(spec=TenantSpec("preload"), instance=0, incarnation=0, segment="-",
                                  backend="stub", backend_options={}).to_wire())
# ... and the hello's encoder every worker's start runs twice (both sockets): compiled in each
# forked worker it was ~2 ms of CPU and ~250 copy-on-write faults of its start (the control
# thread's hello), 0.04 ms here.
WorkerHello("preload", 0).to_wire()

# The ops an activation sends, resolved (their handlers in worker.server's op table): a forked
# pool worker's warm-up then finds each resolved instead of resolving it in a step of its own
# (11 steps, each a turn of its loop; ~0.3 ms of each forked worker's start).
for _op in worker.server._LAZY_OPS:
    try:
        worker.server._resolve(_op)
    except ImportError:  # pragma: no cover - wasmtime missing: the worker resolves it (and fails) itself
        pass

# The worker's logging as a supervisor's defaults configure it (text to stderr, INFO): a forked
# worker's configure_logging then keeps this handler and level instead of making its own and
# clearing every logger's cache (~0.5 ms and ~90 copy-on-write faults of each forked worker's start).
shared.log.configure_logging()

# The C library's symbols (ctypes.CDLL, cached): every worker's start sets its parent-death
# signal and its name through them, ~0.4 ms of each forked worker's CPU to load.
# The two functions the worker calls from it (prctl: the parent-death signal and the name
# at its start; syscall: the device thread's time slice): each is resolved on first use (dlsym and
# a function object, in ctypes' Python), ~60 copy-on-write faults of a forked worker's start
_libc = shared.prctl._libc()
if _libc is not None:
    _libc.prctl, _libc.syscall  # noqa: B018 - looked up to be cached on the CDLL

# The fork server's child path to a worker's entry without multiprocessing's preparation
# (worker.fork_child: with ForkedStart's own cuts ~0.3 ms of CPU and ~50 copy-on-write faults of every
# worker's start).
worker.fork_child.install()

# Last (worker.preload is the fork server's last preload module): every object made above goes to
# the collector's permanent generation. A forked worker's collections then never walk them: a
# walk writes each object's GC header, and on memory shared with the fork server that write is a
# copy-on-write fault per page - a full collection in a worker over the preload's ~35,000 objects
# took 17-19 ms, on whichever request set it off, and made ~9 MiB of the fork server's pages the
# worker's own (0.04 ms and 0.2 MiB frozen); the fork server's own collections no longer write
# them after each fork either. The collect first keeps the preload's garbage out of what is
# frozen. Nothing frozen is a tenant's.
gc.collect()
gc.freeze()

# After it (the collect frees what the preload dropped, leaving holes): the heap's holes filled for
# good, so that a forked worker's allocations come from memory no other process shares
# (worker.fork_heap: ~150 fewer copy-on-write faults of a pool worker's warm-up alone).
import worker.fork_heap  # noqa: E402 - after the freeze: its own objects are not the preload's

try:
    worker.fork_heap.fill_holes()
except Exception as exc:  # noqa: BLE001 - an optimisation: a fork server that died here would start no worker
    sys.stderr.write(f"twt fork server: the heap's holes were not filled ({exc!r})\n")
