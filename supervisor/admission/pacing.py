"""Pacing: stop reading the TCP frontend while the loop mostly throws its messages away.

Admission (:mod:`supervisor.admission.rates`) decides what a request may cost
once it is read; it cannot make reading it free. A remote client that ignores
its refusals - it keeps sending past its tenant's rate and past the answers
to those refusals, or sends garbage, forged capabilities, a stranger's first
requests past its peer's bucket - has every message decrypted (on the
supervisor's I/O thread), read, decoded and dropped, and the faster the loop
drops, the faster it sends. On a small host that keeps every CPU busy, and
other tenants' round trips wait for a CPU at every hop (a local
victim's ping p99 13-17x its quiet p50 during a CURVE ping flood that the loop
mostly dropped - 50,000 messages a second read, 8,000 of them served).

So the TCP frontend carries a debt of dropped messages: every message read
from it and dropped unanswered adds one, and ``drops_per_s`` are paid back
each second. While it owes more than ``burst``, the loop stops reading the
socket for as long as paying the excess back takes, at most ``max_pause_s``
at a time (owing more than one longest pause's worth is forgiven, so a pause
never grows past it). What waits stays where ZMQ keeps it: the socket's
receive queue up to its high-water mark, then the kernel's buffers, then the
sender's own queue - a flood is held in its sender, which blocks instead of
spinning, and nobody decrypts what nobody will serve. A request that is
answered - served or refused with an answer - never adds to the debt: a
socket whose clients keep to their rates is never paused, however busy.

Why TCP only, and the price: a socket is paced as a whole (the loop cannot
leave one peer of a ZMQ ROUTER unread; libzmq fair-queues them), so a
well-behaved remote client beside a flooder waits for the pauses - it is
read in the first batch after each, its turn among the peers (measured on
2 CPUs: its ping p50 1.7 ms instead of 0.6 ms unpaced; ``tcp_drops_per_s =
0`` turns pacing off where remote neighbours matter more than the host's
CPUs). Pacing the local (ipc) socket too was measured and not kept: a local
victim shares it with a local flooder, and pauses of 1-5 ms put the victim's
ping p50 at 5-6x its quiet p50 - while a local flooder's own CPU is the
host's anyway. Local clients and remote ones are separate sockets, so a remote
flood never pauses a local client.

Pure policy with an injected clock: no sockets, no threads. Loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MAX_PAUSE_S", "PAUSE_BURST", "Pacer"]

#: the longest single pause: what a well-behaved client on the paced socket may wait per read
#: (the loop's poll counts whole milliseconds, so a pause is 1-2 ms in practice). 1 ms, not 5:
#: a remote victim beside a CURVE ping flooder had a ping p99 of 3.0-3.2 ms with 1 ms pauses,
#: 4.2-4.3 ms with 2 ms and 7.9-8.5 ms with 5 ms (2.4 ms unpaced); the local victim's p99 was
#: 1.4-1.9 ms in all three (4-5 ms unpaced)
MAX_PAUSE_S = 0.001
#: dropped messages owed before the first pause (a few read batches: a short burst of
#: garbage, a reconnecting client's stale requests, never pause)
PAUSE_BURST = 64.0


@dataclass
class Pacer:
    """The debt of dropped messages of one socket (see the module docstring)."""

    #: dropped messages paid back per second (0: never pause)
    drops_per_s: float = 1000.0
    burst: float = PAUSE_BURST
    max_pause_s: float = MAX_PAUSE_S
    #: pauses so far, and their planned seconds
    pauses: int = field(default=0, init=False)
    paused_s: float = field(default=0.0, init=False)
    _owed: float = field(default=0.0, init=False)
    _stamp: float = field(default=0.0, init=False)

    def dropped(self, n: int, now: float) -> float:
        """``n`` messages read and dropped unanswered: the seconds to stop reading the socket
        now (0.0: keep reading). The caller stops reading for that long, then reads again."""
        if self.drops_per_s <= 0.0 or n <= 0:
            return 0.0
        rate = self.drops_per_s
        owed = self._owed - (now - self._stamp) * rate
        if owed < 0.0:
            owed = 0.0
        owed += n
        cap = self.burst + rate * self.max_pause_s
        self._owed = owed if owed < cap else cap
        self._stamp = now
        if self._owed <= self.burst:
            return 0.0
        pause = (self._owed - self.burst) / rate
        return pause if pause < self.max_pause_s else self.max_pause_s

    def paused(self, seconds: float) -> None:
        """Count one pause the caller made (drops read while paused add to the debt, not to pauses)."""
        self.pauses += 1
        self.paused_s += seconds
