"""Liveness and readiness of a supervisor, for ``/healthz`` and ``/readyz`` on the metrics port.

Both are judged from what the loop already publishes for the exporter, so a
probe never touches loop state from the HTTP thread::

    render thread: source() ──► loop rebuilds the MetricsSnapshot (or answers within 1 s with the old one)
                           observe(snapshot) ── a new object? then the loop is ticking: note the time

* **live** (``/healthz``): the loop handed over a new snapshot within
  ``stall_after_s``. A loop stuck in a handler (or a deadlock) stops
  producing them; the probe fails and the kubelet restarts the pod.
* **ready** (``/readyz``): live, start-up complete (:meth:`Health.mark_ready`:
  backend chosen, configured tenants registered, state restored) and the
  warm pool filled once since start (when the snapshot reports the pool).
  Readiness does not flap when registrations drain the pool later: the
  pool being refilled is normal service. From a stop's drain on
  (:meth:`Health.mark_draining`) it is not ready again: new requests are
  refused ``Draining`` while the in-flight ones finish.

The clock is injectable, so the policy is tested without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from supervisor.observe.metrics import MetricsSnapshot, TenantGauges, as_snapshot

__all__ = ["DEFAULT_STALL_AFTER_S", "Health", "Verdict"]

#: a loop that has published nothing new for this long is reported as stalled
DEFAULT_STALL_AFTER_S = 10.0


@dataclass(frozen=True)
class Verdict:
    """One probe's answer: ``ok`` and a one-line reason (the HTTP body)."""

    ok: bool
    reason: str

    @property
    def body(self) -> bytes:
        return (self.reason + "\n").encode()

    @property
    def status(self) -> str:
        return "200 OK" if self.ok else "503 Service Unavailable"


class Health:
    """Thread-safe probe state; ``observe`` is called with every snapshot the exporter reads."""

    def __init__(self, stall_after_s: float = DEFAULT_STALL_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_after_s > 0:
            raise ValueError(f"stall_after_s must be positive, got {stall_after_s!r}")
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_obj: object = None
        self._last_new: float | None = None
        self._ready = False
        self._draining = False
        self._pool_filled = False
        self._pool_text = ""

    def observe(self, value: MetricsSnapshot | Mapping[str, TenantGauges]) -> MetricsSnapshot:
        """Record a snapshot as read from the loop; a new object means the loop ticked."""
        snap = as_snapshot(value)
        with self._lock:
            if value is not self._last_obj:
                self._last_obj = value
                self._last_new = self._clock()
            if snap.pool_size is not None and snap.pool_idle is not None:
                self._pool_text = f"warm pool {snap.pool_idle}/{snap.pool_size} idle"
                if snap.pool_idle >= snap.pool_size:
                    self._pool_filled = True
            else:
                self._pool_filled = True  # this loop does not report its pool: nothing to wait for
        return snap

    def mark_ready(self) -> None:
        with self._lock:
            self._ready = True

    def mark_draining(self) -> None:
        with self._lock:
            self._draining = True

    def live(self) -> Verdict:
        with self._lock:
            last = self._last_new
        if last is None:
            return Verdict(False, "starting: the supervisor loop has not published a snapshot yet")
        age = self._clock() - last
        if age > self.stall_after_s:
            return Verdict(False, f"stalled: the supervisor loop has published nothing for {age:.0f} s "
                                  f"(limit {self.stall_after_s:g} s)")
        return Verdict(True, "ok")

    def ready(self) -> Verdict:
        live = self.live()
        if not live.ok:
            return Verdict(False, f"not ready: {live.reason}")
        with self._lock:
            ready, pool_filled, pool_text = self._ready, self._pool_filled, self._pool_text
            draining = self._draining
        if draining:
            return Verdict(False, "not ready: draining (stopping: new requests are refused, those in flight finish)")
        if not ready:
            return Verdict(False, "not ready: starting (backend and configured tenants not up yet)")
        if not pool_filled:
            return Verdict(False, f"not ready: {pool_text or 'warm pool filling'}")
        return Verdict(True, "ready")
