"""``twt bench registry``: what the capability check adds to a quota call.

In one run, ns per consume+release pair (medians of round-robin samples):

    QuotaBlock pair          ``block.consume_bytes(n); block.release_bytes(n)`` (the floor)
    registry pair            ``consume_bytes_with_capability(cap, n)`` + release: kind, registry id,
                             MAC (remembered after the first check), generation, then the block
    registry pair, strict    the ``*_strict`` variants
    first check of a token   a fresh registry-side MAC (HMAC-SHA256) per call: the cost a
                             token pays once

Target: the capability check adds at most 3 us per call (per consume or release).

And durable admin ops at their floor: a supervisor (stub backend,
forkserver, a warm pool) with its state on the default file system; per
round, interleaved so all three see the same machine:

    ping                     a tenant ping through the client (one round trip)
    fsync                    4 KiB appended to a file in the state directory + fsync
                             (what a WAL commit costs the file system at least)
    warm registration        ``register`` of a new tenant with an idle pool worker
                             (untimed: its eviction, and the pool refilled)

Target: warm registration p50 <= 8 ping p50 + 2 fsync p50 (a registration is two
round trips and one durable commit; the rest is the budget for the work).
``--registrations 0`` skips this part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from itertools import repeat

from shared import capability as _cap
from shared.capability import TenantCapability
from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, at_least, count, format_table, paired_ratio, percentile, time_loops
from supervisor.store.registry import TenantRegistry

__all__ = ["main"]

_N = 64
#: a registry call that takes a capability and a byte count (bound once, outside the timed loop)
_CapOp = Callable[[TenantCapability, int], None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench registry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=count, default=9)
    parser.add_argument("--registrations", type=at_least(0), default=40,
                        help="warm registrations to time (0: skip the durable part)")
    args = parser.parse_args(argv)

    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("bench"))
        block = registry.block(admin, "bench")
        secret = registry._secret
        n = _N

        def empty(k: int) -> None:
            for _ in repeat(None, k):
                pass

        def bare(k: int, c: Callable[[int], None] = block.consume_bytes, r: Callable[[int], None] = block.release_bytes) -> None:
            for _ in repeat(None, k):
                c(n)
                r(n)

        def checked(k: int, c: _CapOp = registry.consume_bytes_with_capability,
                    r: _CapOp = registry.release_bytes_with_capability, t: TenantCapability = cap) -> None:
            for _ in repeat(None, k):
                c(t, n)
                r(t, n)

        def strict(k: int, c: _CapOp = registry.consume_bytes_with_capability_strict,
                   r: _CapOp = registry.release_bytes_with_capability_strict, t: TenantCapability = cap) -> None:
            for _ in repeat(None, k):
                c(t, n)
                r(t, n)

        def first_check(k: int, ok: Callable[[TenantCapability, bytes], bool] = _cap.mac_ok,
                        t: TenantCapability = cap, s: bytes = secret) -> None:
            for _ in repeat(None, k):
                ok(t, s)
                ok(t, s)

        timings = time_loops(
            {
                "empty loop": (empty, 1),
                "QuotaBlock pair": (bare, 1),
                "registry pair": (checked, 1),
                "registry pair, strict": (strict, 1),
                "fresh MAC check x2": (first_check, 1),
            },
            repeat=args.repeat,
        )
    loop = timings["empty loop"]
    rows = [[name, t.ns, t.ns - loop.ns] for name, t in timings.items()]
    added_ns = (timings["registry pair"].ns - timings["QuotaBlock pair"].ns) / 2
    ratio = paired_ratio(timings["registry pair"], timings["QuotaBlock pair"], minus=loop)
    report = Report("registry")
    report.sections.append(("ns per consume+release pair", format_table(["path", "ns", "net of loop"], rows)))
    report.sections.append(("what the check adds", format_table(
        ["figure", "value"],
        [["ns added per call (pair / 2)", added_ns], ["registry pair / QuotaBlock pair (net)", ratio]],
    )))
    report.targets.append(Target("capability check adds per call", added_ns / 1000, 3.0, higher_is_better=False, unit=" us"))
    report.data.update(
        timings={k: v.to_dict() for k, v in timings.items()},
        added_ns_per_call=added_ns,
        ratio_vs_block=ratio,
    )
    if args.registrations > 0:
        _durable_registration(report, args.registrations)
    return report.emit(as_json=args.json)


def _durable_registration(report: Report, rounds: int) -> None:
    """Warm registration against 8 pings + 2 fsyncs, measured round by round in one run."""
    from supervisor.tools.bench.scale import _wait_pool
    from supervisor.client.launch import launch

    pings: list[float] = []
    fsyncs: list[float] = []
    regs: list[float] = []
    with launch({"supervisor": {"pool_size": 2, "log_level": "warning"}, "tenant": []},
                backend="stub", start_method="forkserver") as sup:
        client = sup.client
        cap = client.register(None, TenantSpec("pinger"))
        state_dir = os.path.join(sup.run_dir, "state")
        probe = os.path.join(state_dir, "bench-fsync.tmp")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        block = b"\0" * 4096
        try:
            for i in range(-3, rounds):  # three rounds of warm-up
                _wait_pool(client, 2)
                for _ in range(4):
                    t0 = time.perf_counter()
                    client.ping(cap)
                    if i >= 0:
                        pings.append(time.perf_counter() - t0)
                for _ in range(2):
                    t0 = time.perf_counter()
                    os.write(fd, block)
                    os.fsync(fd)
                    if i >= 0:
                        fsyncs.append(time.perf_counter() - t0)
                tid = f"bench{i + 3}"
                t0 = time.perf_counter()
                client.register(None, TenantSpec(tid))
                if i >= 0:
                    regs.append(time.perf_counter() - t0)
                client.evict(None, tid)
        finally:
            os.close(fd)
            os.unlink(probe)
    ms = 1000.0
    ping, fsync, reg = (statistics.median(v) * ms for v in (pings, fsyncs, regs))
    floor = 8 * ping + 2 * fsync
    report.sections.append(("durable admin ops (ms; one supervisor, state on the default file system)", format_table(
        ["figure", "p50", "p99", "samples"],
        [["ping", f"{ping:.3f}", f"{percentile(pings, 0.99) * ms:.3f}", len(pings)],
         ["fsync of 4 KiB appended in the state dir", f"{fsync:.3f}", f"{percentile(fsyncs, 0.99) * ms:.3f}",
          len(fsyncs)],
         ["warm registration", f"{reg:.3f}", f"{percentile(regs, 0.99) * ms:.3f}", len(regs)],
         ["floor: 8 pings + 2 fsyncs", f"{floor:.3f}", "", ""]],
    )))
    report.targets.append(Target("warm registration p50 / (8 ping + 2 fsync p50)", reg / floor, 1.0,
                                 higher_is_better=False))
    report.data.update(registration_ms={"ping_p50": ping, "fsync_p50": fsync, "warm_registration_p50": reg,
                                        "floor": floor, "ratio": reg / floor, "rounds": len(regs)})
