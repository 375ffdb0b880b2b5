"""Every request's outcome, as the campaign's clients saw it."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Record", "Recorder", "percentile"]

# --------------------------------------------------------------------------- the recorder


@dataclass(slots=True)
class Record:
    """One request as its caller saw it."""

    tenant: str
    healthy: bool
    op: str
    phase: str  # warmup | baseline | faults | cleanup
    start: float  # time.monotonic() at send
    latency_s: float
    outcome: str  # "ok", an error code, "lost" (no answer), "untyped", "wrong_data"
    deadline_s: float
    detail: str = ""


class Recorder:
    """Every request's outcome, from every thread."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.phase = "warmup"
        self._lock = threading.Lock()

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def tally(self, phase: str) -> tuple[int, int]:
        """(requests, errors) recorded so far in ``phase`` (for the live progress line)."""
        with self._lock:
            records = [r for r in self.records if r.phase == phase]
        return len(records), sum(1 for r in records if r.outcome != "ok")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by the nearest-rank method; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
