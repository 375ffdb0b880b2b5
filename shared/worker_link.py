"""Records of the supervisor-worker link: boot, bind, hello, and fault orders and answers.

A worker process imports these and none of :mod:`shared.records` (the client
protocol's replies): building a frozen dataclass costs ~0.6 ms at import, and
a worker is started for every tenant instance and every restart, so the
worker's start-up pays only for the six records it speaks.
Encoding and checked decoding as for every record (:mod:`shared.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from shared.spec import TenantSpec
from shared.wire import Record

__all__ = ["FORKED_START_KEY", "BindMessage", "BootMessage", "FaultAck", "FaultExit", "FaultOrder", "WorkerHello"]

#: the one key of a worker start's preparation data (``{FORKED_START_KEY: 1}``), the first of the
#: two pickles the supervisor writes to a fork server's child: the fork server's child path
#: (worker.fork_child) then runs the start without multiprocessing's preparation; a fork server
#: without it prepares nothing from it (no key it knows)
FORKED_START_KEY: Final = "twt_forked_start"

# ------------------------------------------------------------------ supervisor -> worker


@dataclass(frozen=True, slots=True)
class BootMessage(Record):
    """What a worker process is started with (the argument of ``worker.main.run``)."""

    worker_id: str  # a public label (logs, events)
    token: str  # one-time token the worker's two hellos must carry
    #: the ZeroMQ identity to connect with: 128 random bits, never published (a process that
    #: reaches backend.ipc cannot claim it first and shut the real worker out)
    routing_id: str
    data_endpoint: str
    control_endpoint: str
    heartbeat_interval_s: float
    heartbeat_liveness: int
    log_format: str = "text"
    log_level: str = "info"
    max_message_bytes: int = 256 << 20
    #: spawn: the supervisor's pid; forkserver: None (the worker checks the fork server instead)
    parent_pid: int | None = None
    #: the supervisor's pid and start time (psutil's clock): a silent supervisor is given up on
    #: only when this process is gone (worker.control), never because it is slow
    supervisor_pid: int | None = None
    supervisor_started: float | None = None
    #: nice steps the worker's threads run below the normal priority until it is warmed or bound
    #: (a pool worker's start: worker.priority.lower_start); 0: none
    start_nice: int = 0


@dataclass(frozen=True, slots=True)
class BindMessage(Record):
    """The ``bind`` request's arguments: which tenant instance a worker becomes."""

    spec: TenantSpec
    instance: int
    incarnation: int
    segment: str  # the tenant's quota block
    backend: str
    #: free-form by design: each backend reads its own options (worker.backends)
    backend_options: dict[str, object] = field(default_factory=dict)


# ------------------------------------------------------------------ control channel (both ways)


@dataclass(frozen=True, slots=True)
class WorkerHello(Record):
    """A worker's first message on each of its two sockets: the one-time token from its boot message."""

    token: str
    pid: int
    #: a pool worker that warms up after its hello: it says ``warmed`` once done (WORKER_WARMED),
    #: and counts as ready from then on
    warming: bool = False


#: what a pool worker says on its data socket (request id 0, like its hello) once its warm-up is
#: done: from then on it counts as a ready pool worker
WORKER_WARMED: Final[dict[str, object]] = {"warmed": True}


@dataclass(frozen=True, slots=True)
class FaultOrder(Record):
    """``fault`` (supervisor -> worker): arm or execute one fault (kinds: ``shared.protocol.FAULT_KINDS``)."""

    kind: str
    #: free-form by design: each fault kind reads its own parameters (worker.faults)
    params: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FaultAck(Record):
    """``fault_ack`` (worker -> supervisor): what was armed, or the typed error that refused it."""

    ok: bool
    #: the armed fault's parameters as the worker read them (free-form, like FaultOrder.params)
    armed: dict[str, object] | None = None
    #: TensorWasmError.to_dict() when not ok: a wire error map (shared.errors.error_from_dict reads it)
    error: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class FaultExit(Record):
    """The answer to a fault that ended the worker (crash, segfault, exit): how it ended."""

    exit_code: int | None
    signal: int | None
    exited: bool = True
