"""The metrics page, rendered at a bounded rate: scrapes read the latest render.

Rendering costs the supervisor twice: the loop rebuilds its snapshot
(``Supervisor._refresh_metrics``, every tenant's quota block) and the render
thread turns it into text under the GIL the loop needs. When every scrape
rendered, 93-167 scrapes a second raised a tenant's ping p99 from 1-7 ms to
35-139 ms. So at most ``renders_per_s`` renders start a second, whatever the
number of scrapers::

    HTTP thread: request ── fresh()? ──yes──► answer with the latest render
                               │ no
                               └─ want() ──► render thread: waits for the rate, render(), publish
                                   (parked)  ◄── notify() (the HTTP loop's wake-up) ── answer every parked request

* A render is **fresh** while less than ``1 / renders_per_s`` has passed since
  it started; a request that finds one fresh is answered from it at once.
* Otherwise the request asks for a render and waits for the next one that is
  published (a render already under way counts), so concurrent scrapes share
  one render and a lone scraper slower than the rate always sees a new one.
* While a render runs, the interpreter's switch interval is lowered to
  :data:`RENDER_SWITCH_INTERVAL_S` (and put back after): prometheus_client's
  text formatting is pure Python (~50 ms for 100 tenants, ~13 us a sample),
  and at the default 5 ms the loop thread waited up to 5 ms for the GIL each
  time it gave it up for a system call - a sleeper's p99 wake-up went from
  1 ms to 12 ms beside back-to-back renders, and to 2-5 ms with 0.2-0.5 ms.
  Nothing else in the supervisor sets the switch interval.

Threads: the render thread calls ``render`` and publishes :class:`Rendered`
values whole (one attribute assignment), so the HTTP thread reads
:attr:`ScrapeCache.latest` without a lock. ``want`` and ``close`` take the
condition's lock and may be called from any thread. ``notify`` is called on
the render thread and must not block (the HTTP loop's wake-up socket).

Owns: the render thread.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.log import get_logger, log_event

__all__ = ["RENDER_SWITCH_INTERVAL_S", "Rendered", "ScrapeCache"]

#: the interpreter's switch interval while a render runs (see the module docstring)
RENDER_SWITCH_INTERVAL_S = 0.0005

_log = get_logger("supervisor.observe.metrics")


_switch_lock = threading.Lock()
_switch_renders = 0
_switch_saved = 0.0


def _quick_switches(delta: int) -> None:
    """A render starts (+1) or ends (-1): the first one in lowers the switch interval, the last one
    out restores it (two caches rendering at once must not leave it lowered for good)."""
    global _switch_renders, _switch_saved
    with _switch_lock:
        if delta > 0 and _switch_renders == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, RENDER_SWITCH_INTERVAL_S))
        _switch_renders += delta
        if delta < 0 and _switch_renders == 0:
            sys.setswitchinterval(_switch_saved)


@dataclass(frozen=True, slots=True)
class Rendered:
    """One render: the page's bytes (empty and ``error`` set when the render raised), its number
    (1, 2, ...), when it started (the cache's clock) and how long it took."""

    body: bytes
    number: int
    started: float
    seconds: float
    error: str | None = None


class ScrapeCache:
    """At most ``renders_per_s`` calls of ``render`` a second, on a thread of their own."""

    def __init__(self, render: Callable[[], bytes], renders_per_s: float, notify: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic, name: str = "twt-metrics-render") -> None:
        if not renders_per_s > 0:
            raise ValueError(f"renders_per_s must be positive, got {renders_per_s!r}")
        self.interval_s = 1.0 / renders_per_s
        self._render = render
        self._notify = notify
        self._clock = clock
        self._cond = threading.Condition()
        self._wanted = False
        self._closed = False
        self._last_start: float | None = None
        #: the latest published render (replaced whole; None before the first)
        self.latest: Rendered | None = None
        #: renders started so far (the page of a render counts itself)
        self.renders = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def fresh(self, now: float | None = None) -> Rendered | None:
        """The latest render if it started less than one interval ago, else None."""
        latest = self.latest
        if latest is None:
            return None
        now = self._clock() if now is None else now
        return latest if now - latest.started < self.interval_s else None

    def want(self) -> None:
        """Ask for a render: it starts as soon as the rate allows (at once when it does)."""
        with self._cond:
            self._wanted = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._wanted:
                        last = self._last_start
                        wait = 0.0 if last is None else last + self.interval_s - self._clock()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                self._wanted = False
                self._last_start = started = self._clock()
                self.renders += 1
                number = self.renders
            error: str | None = None
            _quick_switches(+1)
            try:
                body = self._render()
            except Exception as exc:  # noqa: BLE001 - a failed render is an answer (500), never a dead thread
                body, error = b"", repr(exc)
                log_event(_log, logging.WARNING, "metrics.render_failed", error=error)
            finally:
                _quick_switches(-1)
            self.latest = Rendered(body, number, started, self._clock() - started, error)
            self._notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the render thread (a render under way finishes first; it waits at most ``timeout_s``)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
