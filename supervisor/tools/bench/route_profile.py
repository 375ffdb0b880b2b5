"""``twt bench route --profile``: where the loop's microseconds go, per pipelined request.

A real supervisor (stub backend, one tenant, real worker processes) runs its
loop on a thread of this process; a client process keeps 64 ``ping`` requests
in flight. Measured, per request:

* the loop thread's CPU time (``time.thread_time``), unprobed;
* the worker processes' CPU time (``/proc``: every process this one started
  but the client; counted in clock ticks, so a figure wants 20,000 requests or more);
* then, in a second pass, the loop's CPU time split by stage: each function of
  the request path listed in :data:`STAGES` is wrapped in a probe that adds its
  *exclusive* thread CPU time (its callees' probed time taken out) to its
  stage. A probe costs time itself: what one costs on an empty function
  (:func:`probe_cost_ns`) is taken out of each stage once per probed call,
  and what remains is scaled to the unprobed pass's total (the ``us est.``
  column): the probed pass runs slower, with smaller batches, so its own
  total is no figure of the unprobed path.

Read the split as shares of the unprobed total, not to the microsecond: the
two passes run one after the other on a host that may be busy.

The probes wrap the classes' functions for the second pass only and put them
back after; nothing of this runs in a supervisor that is not being profiled.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.rundir import temp_parent
from shared.spec import TenantSpec
from supervisor.admission import fairness, frontend, rates
from supervisor.client.api import SupervisorClient
from supervisor.lifecycle import workerset
from supervisor.routing import dispatcher, pending, replies
from supervisor.runtime import loop as loop_mod
from supervisor.supervisor import Supervisor
from supervisor.tools.bench._report import count, format_table

__all__ = ["STAGES", "main", "probe_cost_ns"]

T = TypeVar("T")

#: (owner, attribute, stage): the request path's functions, each probed into its stage
STAGES: tuple[tuple[Any, str, str], ...] = (
    (loop_mod.Loop, "poll", "poll (wait excluded: CPU time)"),
    (frontend.Frontend, "_on_readable", "recv from client, batch loop"),
    (proto, "decode_client_header", "decode: client header (msgpack, checks)"),
    (frontend.Frontend, "decode", "decode: message, verified key"),
    (frontend.Frontend, "verified_key", "capability check (cached, per use)"),
    (frontend.Frontend, "_verify", "capability check (cached, per use)"),
    (frontend.Frontend, "_take", "fairness (fair queue, turns)"),
    (frontend.Frontend, "end_turn", "fairness (fair queue, turns)"),
    (fairness.FairTurn, "add", "fairness (fair queue, turns)"),
    (fairness.FairTurn, "run_turn", "fairness (fair queue, turns)"),
    (rates.Admission, "admit", "admission: rates"),
    (proto, "check_args", "admission: argument check"),
    (frontend.Frontend, "serve", "admission: frontend checks"),
    (frontend.Frontend, "_serve", "admission: frontend checks"),
    (frontend.Frontend, "_tenant_request", "admission: frontend checks"),
    (dispatcher.Dispatcher, "route", "dispatch: instance, deadline"),
    (dispatcher.Dispatcher, "_forward", "dispatch: instance, deadline"),
    (proto, "encode_worker_request", "encode: worker request"),
    (workerset.WorkerSet, "send_request", "send to worker (zmq)"),
    (pending.PendingTable, "add", "pending table"),
    (pending.PendingTable, "on_reply", "pending table"),
    (pending.PendingTable, "finish", "pending table"),
    (workerset.WorkerSet, "_on_backend", "recv from worker, batch loop"),
    (proto, "decode_worker_reply", "decode: worker reply"),
    (proto, "encode_reply", "encode: client reply"),
    (replies.Replies, "ok", "send to client (zmq)"),
)

#: the client process: ``total`` pings with ``depth`` in flight, once per line read on stdin; prints replies/s
_CLIENT = """
import sys, zmq
from supervisor.tools.bench.route import _pipelined
endpoint, header, depth = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(endpoint)
for line in sys.stdin:
    print(_pipelined(sock, header, int(line), depth), flush=True)
"""


class _Probes:
    """Exclusive thread CPU time per stage, on one thread (the loop's)."""

    def __init__(self) -> None:
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.thread: int | None = None
        self._stack: list[int] = []

    def wrap(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        clock, stack, get_ident = time.thread_time_ns, self._stack, threading.get_ident

        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != self.thread:
                return fn(*args, **kwargs)
            t0 = clock()
            stack.append(0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                inner = stack.pop()
                self.ns[stage] += spent - inner
                self.calls[stage] += 1
                if stack:
                    stack[-1] += spent

        return probed

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in STAGES]
        try:
            for owner, name, stage in STAGES:
                setattr(owner, name, self.wrap(getattr(owner, name), stage))
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def probe_cost_ns(n: int = 20000) -> float:
    """What one probed call costs beyond the call itself (ns of thread CPU time), on this thread."""
    probes = _Probes()
    probes.thread = threading.get_ident()

    def nothing() -> None:
        pass

    probed = probes.wrap(nothing, "-")
    clock = time.thread_time_ns
    t0 = clock()
    for _ in range(n):
        nothing()
    bare = clock() - t0
    t0 = clock()
    for _ in range(n):
        probed()
    return max(0.0, (clock() - t0 - bare) / n)


def _descendants_cpu_s(exclude: set[int]) -> float:
    """CPU seconds (user + system) of every live process under this one, but ``exclude``."""
    procs: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    me, ticks = os.getpid(), 0
    for pid, (_, used) in procs.items():
        if pid == me or pid in exclude:
            continue
        parent = pid
        while parent in procs and parent != me:
            parent = procs[parent][0]
        if parent == me:
            ticks += used
    return ticks / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench route --profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=count, default=20000, help="pipelined pings per pass")
    parser.add_argument("--depth", type=count, default=64, help="requests in flight")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="twt-bench-", dir=temp_parent()) as tmp:
        config = SupervisorConfig(run_dir=f"{tmp}/run", backend="stub", pool_size=0, log_level="warning")
        sup = Supervisor(config)
        sup.start()
        parts = sup.parts
        assert parts is not None
        stop = threading.Event()
        probes = _Probes()
        cpu: dict[str, float] = {}

        def turn_until_stopped(label: str | None) -> None:
            probes.thread = threading.get_ident()
            t0 = time.thread_time()
            while not stop.is_set():
                sup.turn(0.05)
            if label is not None:
                cpu[label] = time.thread_time() - t0

        def on_loop(label: str | None, body: Callable[[], T]) -> T:
            stop.clear()
            thread = threading.Thread(target=turn_until_stopped, args=(label,), daemon=True)
            thread.start()
            try:
                return body()
            finally:
                stop.set()
                thread.join()

        client = SupervisorClient(config.run_dir)
        # a rate that never binds: this measures the path (supervisor.tools.bench.flood measures admission)
        cap = on_loop(None, lambda: client.register(None, TenantSpec("bench", requests_per_s=1e9)))
        header = proto.encode_request(1, "ping", cap.to_bytes(), {})
        pinger = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, sup.rundir.endpoint("frontend"), header.hex(), str(args.depth)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert pinger.stdin is not None and pinger.stdout is not None

        def pipelined(n: int) -> float:
            assert pinger.stdin is not None and pinger.stdout is not None
            pinger.stdin.write(f"{n}\n")
            pinger.stdin.flush()
            return float(pinger.stdout.readline())

        try:
            on_loop(None, lambda: pipelined(2000))  # warm up
            w0 = _descendants_cpu_s({pinger.pid})
            rate = on_loop("plain", lambda: pipelined(args.requests))
            worker_us = (_descendants_cpu_s({pinger.pid}) - w0) / args.requests * 1e6
            with probes.installed():
                # the worker set's read handler was registered bound, before the probes: again, probed
                sup.loop.register(parts.workers.backend, parts.workers._on_backend)
                probed_rate = on_loop("probed", lambda: pipelined(args.requests))
            sup.loop.register(parts.workers.backend, parts.workers._on_backend)
        finally:
            pinger.stdin.close()
            pinger.wait(10)
            on_loop(None, lambda: client.evict(None, "bench"))
            client.close()
            sup.request_stop()
            while sup.turn(0.05):
                pass
            sup.close()

    n = args.requests
    plain_us, probed_us = cpu["plain"] / n * 1e6, cpu["probed"] / n * 1e6
    cost = probe_cost_ns()
    own = {stage: max(0.0, ns - probes.calls[stage] * cost) for stage, ns in probes.ns.items()}
    scale = plain_us / (sum(own.values()) / n / 1000) if sum(own.values()) else 0.0
    rows = [[stage, ns / n / 1000, probes.calls[stage] / n, own[stage] / n / 1000 * scale]
            for stage, ns in probes.ns.most_common()]
    if args.json:
        print(json.dumps({
            "bench": "route --profile", "requests": n, "depth": args.depth, "load": os.getloadavg()[0],
            "replies_per_s": {"unprobed": rate, "probed": probed_rate}, "probe_cost_ns": cost,
            "loop_cpu_us": {"unprobed": plain_us, "probed": probed_us}, "worker_cpu_us": worker_us,
            "stages_us": {row[0]: {"probed": row[1], "calls": row[2], "estimate": row[3]} for row in rows},
        }))
        return 0
    print(f"twt bench route --profile: {n} pings, {args.depth} in flight, load {os.getloadavg()[0]:.1f}")
    print(f"replies/s: {rate:,.0f} unprobed, {probed_rate:,.0f} probed; probes' cost {cost:.0f} ns a call")
    print(f"loop thread CPU per request: {plain_us:.1f} us unprobed, {probed_us:.1f} us probed")
    print(f"worker processes' CPU per request: {worker_us:.1f} us")
    print(format_table(["stage (loop thread, exclusive CPU)", "us probed", "calls", "us est."], rows))
    return 0
