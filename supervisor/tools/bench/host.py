"""``twt bench host``: does this host run our code when we ask it to? (the floor under every figure)

Every other bench measures against a baseline taken in the same run, which
cancels a slow host but not an unsteady one: on a VM whose vCPUs the
hypervisor pauses for milliseconds, a request path of ~8 thread wake-ups meets
such a pause in 1-3 % of its round trips, and that is its p99 whatever the
code does (docs/PERFORMANCE.md, "The host"). The guest cannot see
it: ``/proc/stat``'s steal column stayed 0 on the VM where it was measured.

So this bench looks at the clock from busy processes. A probe is a process
that reads ``time.perf_counter_ns()`` in a tight loop for ``--seconds`` and
notes every gap between two reads longer than 0.2 ms - time in which it did
not run, whoever took the CPU: the hypervisor, or another process of this
machine (it cannot tell which; ``top`` can). Two phases:

* **one probe alone** (every other CPU idle): what the host takes from a busy
  CPU when the guest leaves it room;
* **one probe per usable CPU, at once** (the guest's CPUs all busy, as during
  a flood or ``make test``): what it takes then.

Target: with every CPU busy, at most 2 % of the clock lost to pauses longer
than 1 ms - below that, the p99 of a bench run now is the code's; above it,
the host's or another process's (find it, or measure later); docs/PERFORMANCE.md
has this host's figures.
"""

from __future__ import annotations

import argparse
import time
from multiprocessing.queues import Queue
from typing import TypedDict

from shared.config import usable_cpus
from supervisor.tools.bench._report import Report, Target, format_table, seconds
from supervisor.tools.bench._children import forked_context

__all__ = ["main", "probe"]

#: the helpers are forks of a preloaded fork server (supervisor.tools.bench._children)
_CTX = forked_context(__name__)
#: a gap between two clock reads longer than this is time the probe did not run (a read is ~0.1 us)
_GAP_NS = 200_000
#: pauses counted, and the clock lost, are those longer than this
_PAUSE_NS = 1_000_000
_LONG_NS = 3_000_000


class ProbeResult(TypedDict):
    """What one probe saw over ``seconds``: pauses over 1 ms and over 3 ms, the longest, their sum."""

    seconds: float
    pauses: int
    long_pauses: int
    longest_ms: float
    lost_ms: float


def probe(start_at: float, duration_s: float) -> ProbeResult:
    """Spin from ``start_at`` (``time.time()``) for ``duration_s``, counting the clock's gaps."""
    while time.time() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.time())))
    clock = time.perf_counter_ns
    t0 = last = clock()
    end = t0 + int(duration_s * 1e9)
    gaps: list[int] = []
    while last < end:
        now = clock()
        if now - last > _GAP_NS:
            gaps.append(now - last)
        last = now
    pauses = [g for g in gaps if g > _PAUSE_NS]
    return {"seconds": (last - t0) / 1e9, "pauses": len(pauses),
            "long_pauses": sum(g > _LONG_NS for g in pauses),
            "longest_ms": max(gaps, default=0) / 1e6, "lost_ms": sum(pauses) / 1e6}


def _probe_into(out: Queue[ProbeResult], start_at: float, duration_s: float) -> None:
    out.put(probe(start_at, duration_s))


def _phase(n: int, duration_s: float) -> list[ProbeResult]:
    """``n`` probe processes at once (they start together, once every one is up)."""
    out: Queue[ProbeResult] = _CTX.Queue()
    start_at = time.time() + 1.0 + 0.1 * n  # past every probe's interpreter start-up
    procs = [_CTX.Process(target=_probe_into, args=(out, start_at, duration_s), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=duration_s + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()


def _row(name: str, results: list[ProbeResult]) -> tuple[list[object], float]:
    total_s = sum(r["seconds"] for r in results)
    lost = sum(r["lost_ms"] for r in results) / 1e3 / total_s if total_s else 0.0
    return [name, len(results), sum(r["pauses"] for r in results) / total_s,
            sum(r["long_pauses"] for r in results) / total_s, max(r["longest_ms"] for r in results),
            f"{lost:.1%}"], lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=seconds, default=3.0, help="how long each phase's probes spin")
    args = parser.parse_args(argv)
    cpus = usable_cpus()
    alone = _phase(1, args.seconds)
    busy = _phase(cpus, args.seconds)
    row_alone, lost_alone = _row("one probe, the other CPUs idle", alone)
    row_busy, lost_busy = _row(f"a probe on each of the {cpus} CPUs", busy)
    report = Report("host")
    report.sections.append((
        f"busy probes reading the clock for {args.seconds:g} s: pauses (the probe did not run) per second "
        "of probe time, and the share of the clock lost to pauses over 1 ms",
        format_table(["phase", "probes", "pauses > 1 ms /s", "pauses > 3 ms /s", "longest (ms)", "clock lost"],
                     [row_alone, row_busy]),
    ))
    report.targets.append(Target("clock lost to pauses > 1 ms, every CPU busy (a p99 measured now is the "
                                 "code's, not the host's)", lost_busy * 100, 2.0, higher_is_better=False,
                                 unit=" %"))
    report.data.update(cpus=cpus, alone=alone, busy=busy, lost_alone=lost_alone, lost_busy=lost_busy)
    return report.emit(as_json=args.json)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
