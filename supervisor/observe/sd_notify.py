"""systemd's notification protocol (``Type=notify``), in a few lines: datagrams to ``$NOTIFY_SOCKET``.

    systemd ──NOTIFY_SOCKET, WATCHDOG_USEC──► twt supervise
    twt supervise ──"READY=1\\nSTATUS=..."──► once supervisor.json is written (every configured tenant up)
                  ──"WATCHDOG=1"───────────► from the loop's housekeeping, every WATCHDOG_USEC / 2
                  ──"RELOADING=1" ... "READY=1"  around a SIGHUP / twt reload
                  ──"STOPPING=1"───────────► when a graceful stop begins

The protocol is one ``AF_UNIX`` datagram per message of ``KEY=VALUE`` lines
(sd_notify(3)); ``@name`` is the abstract namespace. No library is needed
for that, so none is used. Outside systemd (no ``NOTIFY_SOCKET``) every call
does nothing. The variables are removed from the environment when read, so
worker processes never inherit them (only the main process may notify:
``NotifyAccess=main``). The watchdog pings come from the supervisor's loop,
so a loop that stops turning (a deadlock, a stall) stops them and systemd
restarts the service after ``WatchdogSec``. A send that fails (systemd gone)
is ignored: notification is advice to the service manager, never a reason
to stop serving tenants.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping

__all__ = ["SystemdNotifier"]


class SystemdNotifier:
    """Sends ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1`` ... to systemd, or nothing outside it."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        """``address``: ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace); None: off.
        ``watchdog_usec``: ``$WATCHDOG_USEC`` (None: no watchdog)."""
        self.address = address
        self.watchdog_interval_s = watchdog_usec / 1e6 / 2 if watchdog_usec else None
        self._last_ping = float("-inf")
        self._sock: socket.socket | None = None
        self.sent = 0
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> SystemdNotifier:
        """From ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` (checked against ``WATCHDOG_PID``), removing them
        so children do not inherit them. Malformed values turn the part they configure off."""
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None) or None
        usec_text = env.pop("WATCHDOG_USEC", None)
        pid_text = env.pop("WATCHDOG_PID", None)
        usec: int | None = None
        if usec_text and usec_text.isdigit() and int(usec_text) > 0:
            usec = int(usec_text)
            if pid_text and (not pid_text.isdigit() or int(pid_text) != os.getpid()):
                usec = None  # meant for another process (sd_watchdog_enabled(3))
        if address is not None and not (address.startswith("/") or address.startswith("@")):
            address = None  # vsock and other forms are not for us
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, fields: Mapping[str, str | int]) -> bool:
        """Send one message; True if it was sent. Never raises."""
        if self._sock is None or self.address is None:
            return False
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto(message, target)
        except OSError:
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"READY": 1, "MAINPID": os.getpid()}
        if status:
            fields["STATUS"] = status
        return self.notify(fields)

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (``Type=notify-reload`` wants it; older systemd ignores it)."""
        return self.notify({"RELOADING": 1, "MONOTONIC_USEC": time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000})

    def stopping(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"STOPPING": 1}
        if status:
            fields["STATUS"] = status
        return self.notify(fields)

    def status(self, text: str) -> bool:
        return self.notify({"STATUS": text})

    def watchdog(self, now: float) -> bool:
        """``WATCHDOG=1`` if half the watchdog interval has passed since the last one (``now``: monotonic)."""
        if self.watchdog_interval_s is None or now - self._last_ping < self.watchdog_interval_s:
            return False
        self._last_ping = now
        return self.notify({"WATCHDOG": 1})

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
