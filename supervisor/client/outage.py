"""Riding out a supervisor outage in the commands that follow one (``twt top``, ``twt events``).

    call ──► ok ─────────────────────────────────────────────► result
      └─ SupervisorUnavailable / RequestTimeout
           "twt: supervisor unreachable since 12:01:07 (REASON); retrying (Ctrl-C to quit)"
           every RETRY_S: supervisor.json gone? say "stopped" once; else connect anew and call again
           └─ ok: "twt: supervisor back at 12:01:19 (unreachable for 12 s)" ──► result

The first connection is not retried: a command started against nothing has
nothing to follow (exit 3, as every command). Messages go to stderr, one
line each, so ``twt events --json | jq`` stays clean. A restart of a local
supervisor reuses the same admin capability (durable state) and the event
follower's cursor (the event log reports what was lost across it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from shared.errors import RequestTimeout, SupervisorUnavailable, TensorWasmError
from supervisor.client.api import SupervisorClient
from supervisor.client.cli_args import run_dir_of

__all__ = ["RETRY_S", "Reconnecting"]

#: seconds between reconnection attempts during an outage
RETRY_S = 1.0
T = TypeVar("T")
_OUTAGE = (SupervisorUnavailable, RequestTimeout)


def _clock() -> str:
    return time.strftime("%H:%M:%S")


class Reconnecting:
    """A client that, once connected, survives the supervisor going away and coming back.

    ``connect``: makes a new client (``supervisor.cli.status.connect``); ``deadline_s``: give up
    (:meth:`call` returns ``None``) after an outage this long (``None``: retry until Ctrl-C).
    """

    def __init__(self, args: argparse.Namespace, connect: Callable[[], SupervisorClient], *,
                 deadline_s: float | None = None, retry_s: float = RETRY_S,
                 err: Callable[[str], None] | None = None) -> None:
        self.args = args
        self._connect = connect
        self.client = connect()  # the first connection is not retried (exit 3)
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self.outages = 0
        self._err = err or (lambda line: print(line, file=sys.stderr, flush=True))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Reconnecting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _local_run_dir(self) -> str | None:
        return None if getattr(self.args, "connect", None) else run_dir_of(self.args)

    def _why(self, exc: Exception) -> str:
        """The outage's cause in words: a local supervisor that stopped says so (no supervisor.json)."""
        stopped = self._stopped()
        if stopped is not None:
            return stopped
        if isinstance(exc, SupervisorUnavailable):
            return exc.reason
        return f"no answer within {self.client.timeout_s:g} s"

    def _stopped(self) -> str | None:
        """A local supervisor's clean stop, seen without a request: its supervisor.json is gone."""
        run_dir = self._local_run_dir()
        if run_dir is not None and not os.path.exists(os.path.join(run_dir, "supervisor.json")):
            return f"stopped: {run_dir}/supervisor.json is gone"
        return None

    def call(self, fn: Callable[[SupervisorClient], T]) -> T | None:
        """``fn(client)``; through an outage, again on a new connection once one works. ``None``: gave up."""
        stopped = self._stopped()  # at once, rather than after a request's timeout
        if stopped is not None:
            return self._ride_out(fn, SupervisorUnavailable(run_dir_of(self.args), stopped))
        try:
            return fn(self.client)
        except _OUTAGE as exc:
            return self._ride_out(fn, exc)

    def _ride_out(self, fn: Callable[[SupervisorClient], T], exc: Exception) -> T | None:
        self.outages += 1
        started = time.monotonic()
        said = self._why(exc)
        self._err(f"twt: supervisor unreachable since {_clock()} ({said}); retrying (Ctrl-C to quit)")
        while True:
            if self.deadline_s is not None and time.monotonic() - started >= self.deadline_s:
                self._err(f"twt: gave up at {_clock()}: unreachable for {time.monotonic() - started:.0f} s")
                return None
            time.sleep(self.retry_s)  # the retry interval of an outage, not a wait for an event
            why = self._stopped()
            if why is not None:
                if why != said:
                    said = why
                    self._err(f"twt: supervisor {why} ({_clock()}); waiting for it to start again")
                continue
            try:
                client = self._connect()
            except (TensorWasmError, OSError):  # not there yet, or half started (files appearing): again
                continue
            try:
                result = fn(client)
            except _OUTAGE:
                client.close()
                continue
            except BaseException:
                client.close()
                raise
            self.client.close()
            self.client = client
            self._err(f"twt: supervisor back at {_clock()} (unreachable for {time.monotonic() - started:.0f} s)")
            return result
