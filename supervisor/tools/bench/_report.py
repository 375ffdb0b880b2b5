"""Shared helpers of the benchmark programs: timing with medians, a table, targets.

Every benchmark measures its figure *and its baseline in the same run*
(interleaved, round by round), and reports medians, so a ratio compares like
with like even on a busy shared machine. A :class:`Target` turns a ratio into
PASS/MISS; a program exits non-zero when any target is missed.

    loops = {"floor": (noop_loop, 1), "ours": (our_loop, 1)}
    timings = time_loops(loops, repeat=9)
    target = Target("ours within 2x of floor", timings["ours"].ns / timings["floor"].ns,
                    2.0, higher_is_better=False)
"""

from __future__ import annotations

import argparse
import gc
import math
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat as _repeat
from typing import TYPE_CHECKING, TextIO

from shared.config import usable_cpus
from shared.device_cpus import parse_device_cpus
from shared.sizes import parse_size

if TYPE_CHECKING:
    import zmq

__all__ = [
    "EXIT_MISS",
    "Report",
    "Target",
    "Timing",
    "at_least",
    "calibrate",
    "count",
    "device_cpus",
    "environment",
    "format_table",
    "paired_ratio",
    "percentile",
    "seconds",
    "time_callable",
    "time_loops",
]

#: Exit status when a target is missed: the CLI's "a check or benchmark target
#: failed" (``supervisor.cli``); 2 stays "bad usage".
EXIT_MISS = 4

#: ``loop(n)`` runs the measured operation ``n`` times in its own tight loop,
#: so no Python call per operation is added by the harness.
Loop = Callable[[int], object]


@dataclass(frozen=True)
class Timing:
    """Nanoseconds per operation: the median over repeats, and every sample."""

    name: str
    ns: float
    samples: tuple[float, ...]
    number: int  # operations per sample

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: how noisy the figure is."""
        return (max(self.samples) - min(self.samples)) / self.ns if self.ns else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"ns": round(self.ns, 2), "best_ns": round(self.best, 2), "samples": len(self.samples), "number": self.number}


def calibrate(loop: Loop, *, target_s: float = 0.03, start: int = 1000, cap: int = 10_000_000) -> int:
    """How many iterations make one sample of ``loop`` last about ``target_s``."""
    n = start
    while True:
        t0 = time.perf_counter()
        loop(n)
        elapsed = time.perf_counter() - t0
        if elapsed >= target_s / 4 or n >= cap:
            return max(1, min(cap, int(n * target_s / max(elapsed, 1e-9))))
        n *= 4


def time_loops(
    loops: Mapping[str, tuple[Loop, int]],
    *,
    repeat: int = 9,
    target_s: float = 0.03,
) -> dict[str, Timing]:
    """Median ns per operation of each loop, sampled round-robin (one sample each per round).

    ``loops`` maps a name to ``(loop, ops_per_iteration)``: a loop whose body
    performs two operations (a consume and a release) passes 2. The garbage
    collector is off while sampling.
    """
    numbers = {name: calibrate(loop, target_s=target_s) for name, (loop, _) in loops.items()}
    samples: dict[str, list[float]] = {name: [] for name in loops}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for name, (loop, ops) in loops.items():
                n = numbers[name]
                t0 = time.perf_counter_ns()
                loop(n)
                samples[name].append((time.perf_counter_ns() - t0) / (n * ops))
    finally:
        if enabled:
            gc.enable()
    return {
        name: Timing(name, statistics.median(s), tuple(s), numbers[name] * loops[name][1])
        for name, s in samples.items()
    }


def socket_rtts_us(sock: zmq.Socket[bytes], header: bytes, n: int) -> list[float]:
    """``n`` request round trips on a connected DEALER socket (send ``header``, read the reply), in us
    each: how every request-path bench measures a ping (names bound outside the loop)."""
    out = []
    send, recv, clock = sock.send, sock.recv_multipart, time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        send(header)
        recv()
        out.append((clock() - t0) / 1000)
    return out


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low``, else a usage error naming the option (a zero
    count used to end a bench in "no median for empty data" after it had run the other parts)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return value

    parse.__name__ = f"count >= {low}"
    return parse


#: the type of every count option of the benches: rounds, samples, pings, kills (>= 1)
count = at_least(1)


def positive(what: str) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > 0; ``what`` names it in the usage error
    ("a number of seconds" -> "must be a number of seconds > 0, got '0'")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text!r}")
        return value

    return parse


#: durations (seconds) and rates (per second) of the benches' options
seconds = positive("a number of seconds")
per_second = positive("a number per second")


def byte_size(text: str) -> int:
    """An argparse ``type``: a size of at least one byte, an int or ``"256MiB"`` (shared.sizes)."""
    try:
        value = parse_size(text, what="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def device_cpus(text: str) -> tuple[int, ...] | str:
    """An argparse ``type``: a ``stub_device_cpus`` value (``last``, CPU numbers, ``none``;
    shared.device_cpus), for the benches that start their supervisors with it."""
    try:
        return parse_device_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank: what the tables call p50 / p99."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def paired_ratio(a: Timing, b: Timing, *, minus: Timing | None = None) -> float:
    """Median over rounds of ``(a - minus) / (b - minus)``, each round's samples paired.

    :func:`time_loops` takes one sample of every loop per round, so samples
    of the same round saw the same machine state: the median of per-round
    ratios is far steadier than the ratio of medians on a busy machine.
    ``minus`` (e.g. the empty loop) is subtracted from both first.
    """
    base = minus.samples if minus is not None else (0.0,) * len(a.samples)
    ratios = [
        max(x - m, 1e-9) / max(y - m, 1e-9) for x, y, m in zip(a.samples, b.samples, base, strict=True)
    ]
    return statistics.median(ratios)


def time_callable(fn: Callable[[], object], *, name: str = "", repeat: int = 9, target_s: float = 0.03) -> Timing:
    """Median ns per call of ``fn()`` (the harness adds one Python call per operation)."""

    def loop(n: int) -> None:
        for _ in _repeat(None, n):
            fn()

    return time_loops({name or getattr(fn, "__name__", "fn"): (loop, 1)}, repeat=repeat, target_s=target_s).popitem()[1]


@dataclass(frozen=True)
class Target:
    """A goal for one measured figure; prints as PASS or MISS."""

    name: str
    measured: float
    limit: float
    higher_is_better: bool = True
    unit: str = "x"

    @property
    def passed(self) -> bool:
        return self.measured >= self.limit if self.higher_is_better else self.measured <= self.limit

    def line(self) -> str:
        op = ">=" if self.higher_is_better else "<="
        verdict = "PASS" if self.passed else "MISS"
        return f"{verdict}  {self.name}: {self.measured:.2f}{self.unit} (target {op} {self.limit:g}{self.unit})"

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "measured": round(self.measured, 3),
            "limit": self.limit,
            "higher_is_better": self.higher_is_better,
            "passed": self.passed,
        }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), rule, *(fmt(r) for r in cells[1:])])


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value >= 1e6:
            return f"{value:,.0f}"
        return f"{value:,.1f}"
    return str(value)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def session_nice() -> int | None:
    """This process's session group's nice value where the kernel shares the CPUs between sessions
    before it looks at nice values (Linux's ``sched_autogroup_enabled``); None where it does not.

    With autogroups on, every busy session (a shell, an ssh login, a CI job) gets an equal share of
    the CPUs whatever its processes' nice values: a benchmark run ``nice -n -20`` still gets only
    half of them beside one other busy session. Its report says so, so that a reader does not take
    figures measured beside other work for a quiet machine's; the group's own priority is set with
    ``echo N > /proc/self/autogroup`` in the session's shell (lowering N needs CAP_SYS_NICE)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled", encoding="ascii") as f:
            if f.read().strip() != "1":
                return None
        with open("/proc/self/autogroup", encoding="ascii") as f:
            return autogroup_nice(f.read())
    except OSError:
        return None


def autogroup_nice(text: str) -> int | None:
    """The nice value in ``/proc/<pid>/autogroup``'s text (``/autogroup-123 nice 0``); None where the
    text is not of that form - some kernels and sandboxes leave the file empty though the sysctl
    says autogroups are on, and a report must still be written there."""
    match = re.fullmatch(r"/autogroup-\d+\s+nice\s+(-?\d+)\s*", text)
    return int(match.group(1)) if match else None


def environment() -> dict[str, object]:
    """Where the figures were measured, and how busy the machine was when the benchmark began."""
    usable = usable_cpus()
    try:
        load: float | None = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
        "cpus": usable,
        "cpu_model": _cpu_model(),
        "load_1m": load,
        "nice": os.nice(0) if hasattr(os, "nice") else None,
        "session_nice": session_nice(),
    }


def _machine_line(env: Mapping[str, object]) -> str:
    """The report's second line: the load at the start, this process's nice, the session group's."""
    parts = []
    if env.get("load_1m") is not None:
        parts.append(f"load {env['load_1m']} at the start")
    if env.get("nice") is not None:
        parts.append(f"nice {env['nice']}")
    if env.get("session_nice") is not None:
        parts.append(f"session group nice {env['session_nice']} (the kernel shares the CPUs between busy sessions "
                     "first: beside other work this benchmark gets its session's share, whatever its nice)")
    return "; ".join(parts)


@dataclass
class Report:
    """What one benchmark program prints: text tables, or one JSON object with ``--json``."""

    bench: str
    sections: list[tuple[str, str]] = field(default_factory=list)  # (title, text)
    data: dict[str, object] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    env: dict[str, object] = field(default_factory=environment)

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.targets)

    def emit(self, *, as_json: bool = False, file: TextIO | None = None) -> int:
        """Print the report; the exit status: 0 when every target passed, else :data:`EXIT_MISS`."""
        out = file if file is not None else sys.stdout
        if as_json:
            obj = {
                "bench": self.bench,
                "env": self.env,
                **self.data,
                "targets": [t.to_dict() for t in self.targets],
                "passed": self.passed,
            }
            print(json.dumps(obj, sort_keys=False), file=out)
        else:
            env = self.env
            print(
                f"twt bench {self.bench} - {env['date']}, Python {env['python']}, "
                f"{env['cpus']} CPUs ({env['cpu_model']})",
                file=out,
            )
            machine = _machine_line(env)
            if machine:
                print(machine, file=out)
            for title, text in self.sections:
                print(f"\n{title}\n{text}", file=out)
            if self.targets:
                print("\ntargets", file=out)
                for t in self.targets:
                    print(f"  {t.line()}", file=out)
        out.flush()
        return 0 if self.passed else EXIT_MISS
