"""Stall tolerance of the supervisor loop: its own pauses are not its workers' deaths.

The loop judges workers by time: heartbeats older than ``interval *
liveness`` mean "hung", a request past its deadline means "stuck". Both
judgements assume the loop itself was running. A supervisor stopped with
SIGSTOP for 10 s (or starved on a loaded host) resumes to find every
heartbeat 10 s old and every deadline passed, while the workers were fine
and their beats and replies are waiting, unread, in its sockets.

:class:`StallGuard` notices such a gap between two housekeeping ticks and
then judges by time only what the stall did not distort:

* a worker's silence is counted from the later of its last heartbeat and the
  moment the loop resumed (:meth:`silence`), so the queued heartbeats get read
  before anyone is judged;
* deadline expiries wait a few turns of the loop (:meth:`in_grace`): a reply
  that arrived during the stall is answered, not replaced by a timeout;
* a loop that is only *late* (every tick a few hundred ms behind on a
  loaded host, no single gap a stall) does not see part of its time either:
  each gap's lateness beyond ``slack_s`` is left out of :meth:`silence` too.

The other side of a silence is the worker's: a worker starved of CPU on a
loaded host (its threads runnable but not running) sends nothing either.
:func:`run_delay_ns` reads how long each of a process's threads waited for a
CPU (the kernel's schedstat); the worker set leaves that waiting out of a
silence as well, up to a cap, so a really hung worker (stopped, or alive but
no longer beating) is still killed.

A worker that really died is still seen at once (its sentinel fires), so the
grace delays nothing but the judgements that time made unreliable.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable

__all__ = ["StallGuard", "run_delay_ns"]

#: how long the loop's lateness is remembered (longer than any liveness window)
LATE_HORIZON_S = 120.0


class StallGuard:
    """Detects loop stalls from housekeeping ticks; loop thread only.

    ``threshold_s``: a gap between ticks longer than this is a stall (the
    loop ticks every 50 ms; the default caller passes the heartbeat
    interval). ``grace_s``: how long judgements wait after a stall.
    ``slack_s``: a shorter gap is an ordinary turn; what a gap up to the
    threshold lasts beyond it is lateness, left out of :meth:`silence`
    (default: a quarter of the threshold).
    """

    def __init__(self, threshold_s: float, grace_s: float, *, slack_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_s <= 0 or grace_s < 0:
            raise ValueError("threshold_s must be > 0 and grace_s >= 0")
        slack = threshold_s / 4 if slack_s is None else slack_s
        if not 0 <= slack <= threshold_s:
            raise ValueError("slack_s must be in 0..threshold_s")
        self.threshold_s = threshold_s
        self.grace_s = grace_s
        self.slack_s = slack
        self._clock = clock
        self._last_tick: float | None = None
        self._resumed_at = float("-inf")
        self.stalls = 0
        self.last_stall_s = 0.0
        #: the late ticks: when each ended, its lateness, and the lateness summed up to it
        self._late_at: list[float] = []
        self._late: list[float] = []
        self._late_sum: list[float] = []
        self.late_s = 0.0

    def tick(self, now: float | None = None) -> float | None:
        """Call once per housekeeping pass; returns the stall's length when one just ended."""
        now = self._clock() if now is None else now
        last, self._last_tick = self._last_tick, now
        if last is None:
            return None
        if now - last <= self.threshold_s:
            late = now - last - self.slack_s
            if late > 0:
                self._note_late(now, late)
            return None
        self._resumed_at = now
        self.stalls += 1
        self.last_stall_s = now - last
        return self.last_stall_s

    def in_grace(self, now: float) -> bool:
        """True within ``grace_s`` after a stall: time-based judgements wait."""
        return now - self._resumed_at < self.grace_s

    def silence(self, last_heard: float, now: float) -> float:
        """How long a peer has been silent, not counting time the loop itself was stalled or late
        (a message that came meanwhile may still be unread)."""
        start = max(last_heard, self._resumed_at)
        return max(0.0, now - start - self._late_since(start))

    def _note_late(self, at: float, late: float) -> None:
        self.late_s += late
        if self._late_at and at - self._late_at[0] > 2 * LATE_HORIZON_S:  # trimmed in batches
            keep = bisect.bisect_left(self._late_at, at - LATE_HORIZON_S)
            del self._late_at[:keep], self._late[:keep], self._late_sum[:keep]
        self._late_at.append(at)
        self._late.append(late)
        self._late_sum.append(self.late_s)

    def _late_since(self, start: float) -> float:
        """The lateness of the ticks after ``start``: each gap's late part is its last ``late``
        seconds, so only what of it lies after ``start`` counts."""
        i = bisect.bisect_right(self._late_at, start)
        if i == len(self._late_at):
            return 0.0
        before = self._late_sum[i - 1] if i else self._late_sum[0] - self._late[0]
        total = self.late_s - before
        first_end, first_late = self._late_at[i], self._late[i]
        return total - first_late + min(first_late, first_end - start)


def run_delay_ns(pid: int) -> dict[int, int] | None:
    """How long each thread of process ``pid`` has waited on a run queue, in ns, by thread id
    (``/proc/PID/task/TID/schedstat``, second field); None where that cannot be read (no procfs,
    no schedstats, the process gone). Waiting for a CPU is starvation, never a hang: a stopped
    or sleeping thread does not wait on a run queue."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    delays: dict[int, int] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                delays[int(tid)] = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or no schedstats
    return delays or None


def thread_report(pid: int, base: dict[int, int] | None = None) -> str:
    """One line on what each thread of process ``pid`` is doing now: name, scheduler state (R
    runs or waits for a CPU, S sleeps, D waits on I/O, T stopped), the kernel function it sleeps
    in, and - given ``base`` from :func:`run_delay_ns` - how long it waited for a CPU since:
    ``TID:NAME:STATE:WCHAN[:waited=MSms]``, space-separated.

    Read only when a worker is killed for silence, so that a log shows why it was silent (a
    thread stuck in one syscall, one waiting for the interpreter, a stopped process) instead of
    only that it was; "" where procfs cannot say."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except (OSError, ValueError):
        return ""
    delays = run_delay_ns(pid) if base is not None else None
    parts: list[str] = []
    for tid in tids:
        root = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{root}/stat", "rb") as f:
                stat = f.read()
            name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            name = name.replace(" ", "_").replace(":", "_") or "?"
            state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode()
        except (OSError, ValueError):
            continue  # ended meanwhile
        try:
            with open(f"{root}/wchan", "rb") as f:
                wchan = f.read().decode(errors="replace").strip() or "-"
        except OSError:
            wchan = "?"
        if wchan == "0":
            wchan = "-"
        waited = ""
        if base is not None and delays is not None and (ns := delays.get(int(tid))) is not None:
            waited = f":waited={(ns - base.get(int(tid), ns)) / 1e6:.0f}ms"
        parts.append(f"{tid}:{name}:{state}:{wchan}{waited}")
    return " ".join(parts)
