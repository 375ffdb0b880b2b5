"""``twt bench quota``: what one quota check costs, and how it scales across processes.

Single process, ns per consume+release pair (medians, sampled round-robin so
every figure and its baseline share the same machine state):

    empty loop            the harness itself (subtracted for the "net" column)
    empty C call          ``_atomics.noop(buf, off, n)`` twice: the floor of any extension call
    raw extension call    ``_atomics.consume/release(buf, off, n)``: buffer acquire + CAS
    QuotaBlock            ``block.consume_bytes(n); block.release_bytes(n)``: what workers call
    QuotaBlock, bound     the same with the bound methods in locals
    Python wrapper        a ``def`` around the bound method: what the hot path avoids
    multiprocessing.Value ``with v.get_lock(): check; v.value += n`` and ``-= n``

Two processes (forked, each attached with ``QuotaBlock.attach``), ops/s
(one op = one consume or release): one process alone, both on the same
counter line, each on its own line (CPU line vs GPU line, 64 bytes apart).

Targets: the QuotaBlock pair >= 8x faster than the multiprocessing.Value
pair; the raw extension call within 2x of the empty C call (net of the loop).
Exit status 0 when both are met, 4 when one is missed, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from itertools import repeat
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

from shared import _atomics, quota
from shared.quota import QuotaBlock
from supervisor.tools.bench._report import Report, Target, count, format_table, paired_ratio, seconds, time_loops
from supervisor.tools.bench._children import forked_context

__all__ = ["main"]

_N = 64  # bytes per consume/release: the value does not matter to the cost
_CPU_LINE = quota._CPU
#: the helpers are forks of a preloaded fork server (supervisor.tools.bench._children)
_CTX = forked_context(__name__)
#: an atomics call on one counter line: (buffer, offset, bytes), bound once outside the timed loop
_LineOp = Callable[[memoryview, int, int], object]


# ------------------------------------------------------------ single process


def _loops(block: QuotaBlock) -> dict[str, tuple[Callable[[int], object], int]]:
    """Each loop performs a consume and a release per iteration (2 ops)."""
    buf = block._buf
    off = _CPU_LINE
    n = _N

    def empty(k: int) -> None:
        for _ in repeat(None, k):
            pass

    def noop(k: int, f: _LineOp = _atomics.noop, buf: memoryview = buf, off: int = off) -> None:
        for _ in repeat(None, k):
            f(buf, off, n)
            f(buf, off, n)

    def raw(k: int, c: _LineOp = _atomics.consume, r: _LineOp = _atomics.release, buf: memoryview = buf,
            off: int = off) -> None:
        for _ in repeat(None, k):
            c(buf, off, n)
            r(buf, off, n)

    def via_block(k: int, b: QuotaBlock = block) -> None:
        for _ in repeat(None, k):
            b.consume_bytes(n)
            b.release_bytes(n)

    def bound(k: int, c: Callable[[int], None] = block.consume_bytes, r: Callable[[int], None] = block.release_bytes) -> None:
        for _ in repeat(None, k):
            c(n)
            r(n)

    c_bound, r_bound = block.consume_bytes, block.release_bytes

    def py_consume(x: int) -> None:
        c_bound(x)

    def py_release(x: int) -> None:
        r_bound(x)

    def wrapped(k: int, c: Callable[[int], None] = py_consume, r: Callable[[int], None] = py_release) -> None:
        for _ in repeat(None, k):
            c(n)
            r(n)

    value = _CTX.Value("Q", 0)
    limit = block.memory_quota_bytes

    # multiprocessing's synchronized Value and its lock (dynamically typed proxies), bound as fast locals
    def mp_value(k: int, v: Any = value, lock: Any = value.get_lock()) -> None:  # noqa: B008 - fast locals, on purpose
        for _ in repeat(None, k):
            with lock:
                if v.value + n > limit:
                    raise RuntimeError("over the limit")
                v.value += n
            with lock:
                v.value -= n

    return {
        "empty loop": (empty, 1),
        "empty C call (noop x2)": (noop, 1),
        "raw extension call": (raw, 1),
        "QuotaBlock": (via_block, 1),
        "QuotaBlock, bound methods": (bound, 1),
        "Python wrapper around it": (wrapped, 1),
        "multiprocessing.Value + lock": (mp_value, 1),
    }


# ------------------------------------------------------------- two processes


def _hammer(name: str, conn: Connection, barrier: Barrier) -> None:
    """Child: attach; per command ("cpu" | "gpu" | None, seconds) hammer that line, reply (ops, s)."""
    block = QuotaBlock.attach(name)
    try:
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            line, duration = cmd
            barrier.wait(60)
            if line is None:
                conn.send((0, 1.0))
                continue
            c = block.consume_bytes if line == "cpu" else block.consume_gpu_bytes
            r = block.release_bytes if line == "cpu" else block.release_gpu_bytes
            count = 0
            clock = time.perf_counter
            t0 = clock()
            end = t0 + duration
            while True:
                for _ in repeat(None, 1024):
                    c(_N)
                    r(_N)
                count += 2048
                if clock() >= end:
                    break
            conn.send((count, clock() - t0))
    finally:
        block.close()


def _two_process(block: QuotaBlock, duration: float, rounds: int) -> dict[str, float]:
    modes: dict[str, tuple[str | None, str | None]] = {
        "one process alone": ("cpu", None),
        "two processes, same line": ("cpu", "cpu"),
        "two processes, separate lines": ("cpu", "gpu"),
    }
    barrier = _CTX.Barrier(3)
    pipes = [_CTX.Pipe() for _ in range(2)]
    procs = [_CTX.Process(target=_hammer, args=(block.name, child, barrier), daemon=True) for _, child in pipes]
    results: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for p in procs:
            p.start()
        for parent, _ in pipes:
            if not parent.poll(60) or parent.recv() != "ready":
                raise RuntimeError("benchmark child did not start")
        for _ in range(rounds):
            for mode, lines in modes.items():
                for (parent, _), line in zip(pipes, lines):
                    parent.send((line, duration))
                barrier.wait(60)
                total = 0.0
                for parent, _ in pipes:
                    if not parent.poll(duration + 60):
                        raise RuntimeError("benchmark child stopped answering")
                    ops, secs = parent.recv()
                    total += ops / secs
                results[mode].append(total)
        for parent, _ in pipes:
            parent.send(None)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for parent, child in pipes:
            parent.close()
            child.close()
    return {mode: statistics.median(v) for mode, v in results.items()}


# ----------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench quota", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--repeat", type=count, default=15, help="samples per figure (median reported; default 15)")
    parser.add_argument("--duration", type=seconds, default=0.4, help="seconds per two-process sample (default 0.4)")
    parser.add_argument("--rounds", type=count, default=3, help="two-process samples per mode (default 3)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.rounds < 1 or args.duration <= 0:
        parser.error("--repeat and --rounds must be >= 1 and --duration > 0")

    report = Report("quota")
    with QuotaBlock.create("bench", memory_quota_bytes=(1 << 63) - 1) as block:
        timings = time_loops(_loops(block), repeat=args.repeat, target_s=0.02)
        scaling = _two_process(block, args.duration, args.rounds)
        leftover = block.bytes_in_use + block.gpu_bytes_in_use
    if leftover:
        raise RuntimeError(f"benchmark left {leftover} bytes consumed")

    loop_ns = timings["empty loop"].ns
    def net(name: str) -> float:
        """ns of a pair with the harness's loop overhead taken out."""
        return timings[name].ns if name == "empty loop" else max(timings[name].ns - loop_ns, 1e-9)

    rows = [(name, t.ns, net(name), net(name) / 2, f"{t.spread:.0%}") for name, t in timings.items()]
    report.sections.append(
        (
            "single process: ns per consume+release pair (median; net = minus the empty loop)",
            format_table(["path", "pair ns", "net ns", "net ns/call", "spread"], rows),
        )
    )
    alone = scaling["one process alone"]
    report.sections.append(
        (
            "two processes, ops/s (one op = one consume or release; median)",
            format_table(
                ["mode", "ops/s", "vs one process"],
                [(mode, ops, f"{ops / alone:.2f}x") for mode, ops in scaling.items()],
            ),
        )
    )

    # Ratios are medians of per-round ratios (each round samples every loop once).
    report.targets = [
        Target(
            "QuotaBlock pair vs multiprocessing.Value pair (speed-up)",
            paired_ratio(timings["multiprocessing.Value + lock"], timings["QuotaBlock"]),
            8.0,
            higher_is_better=True,
        ),
        Target(
            "raw extension call vs empty C call (cost ratio, net of the loop)",
            paired_ratio(timings["raw extension call"], timings["empty C call (noop x2)"], minus=timings["empty loop"]),
            2.0,
            higher_is_better=False,
        ),
    ]
    report.data = {
        "pair_ns": {name: t.to_dict() for name, t in timings.items()},
        "two_process_ops_per_s": {mode: round(v) for mode, v in scaling.items()},
        "separate_vs_same_line": round(scaling["two processes, separate lines"] / scaling["two processes, same line"], 3),
    }
    return report.emit(as_json=args.json)
