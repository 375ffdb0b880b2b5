"""The host's own scheduling delay during a campaign, per phase: what the latency check allows for.

A chaos campaign compares the healthy tenants' p99 in the fault phase with the fault-free
baseline. On a shared machine (CI beside other jobs, two CPU burners) the fault phase is also
the phase in which workers die and restart - processes that take CPU from everything else on
the host, the healthy tenants' clients and workers included. That is not a failure of
isolation: no supervisor can give a tenant CPU the host does not have. A supervisor loop that
waits on a faulty tenant, on the other hand, delays the healthy tenants and nothing else.

So a separate process (no GIL shared with the campaign's client threads) sleeps 1 ms at a time
and reports how late each wake-up came. Its p99 per phase is the host's own scheduling delay;
the latency check allows the healthy tenants' p99 to grow by ``factor`` times what the host's
grew (never less than ``factor``), and reports both.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

from supervisor.tools.chaos.recorder import percentile

__all__ = ["HostProbe"]

#: the probe: sleep 1 ms, print how late the wake-up was (us), flush every 50 samples
_PROBE = """
import sys, time
out = sys.stdout
n = 0
while True:
    t0 = time.perf_counter()
    time.sleep(0.001)
    out.write("%d\\n" % int((time.perf_counter() - t0 - 0.001) * 1e6))
    n += 1
    if n % 50 == 0:
        out.flush()
"""


class HostProbe:
    """Wake-up lateness samples of a sleeping child process, tagged with the campaign's phase."""

    def __init__(self, phase: Callable[[], str]) -> None:
        self._phase = phase
        self._samples: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="chaos-host-probe", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                lag_s = max(0, int(line)) / 1e6
            except ValueError:
                continue
            phase = self._phase()
            with self._lock:
                self._samples.setdefault(phase, []).append(lag_s)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(30)
        if self._reader is not None:
            self._reader.join(30)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()

    def p99_ms(self, phase: str) -> float | None:
        """The probe's p99 lateness in ``phase`` (ms); None when it has no sample there."""
        with self._lock:
            values = list(self._samples.get(phase, ()))
        p99 = percentile(values, 0.99)
        return None if p99 is None else round(p99 * 1000, 3)

    def __enter__(self) -> HostProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
