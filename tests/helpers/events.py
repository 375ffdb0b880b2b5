"""Waiting for a supervisor's events: the cursor to read after, and the first event of a kind.

Tests take the cursor *before* the action whose event they mean (an event that came before it is
not the one awaited), then wait for the first event of that kind and tenant after it.
"""

from __future__ import annotations

from typing import Any

from supervisor.client.api import SupervisorClient
from tests.helpers.cluster import wait_for

__all__ = ["event_cursor", "pattern", "wait_event"]


def event_cursor(c: SupervisorClient) -> int:
    """The sequence number the next event will carry."""
    nxt = c.events_page(None)["next"]
    assert isinstance(nxt, int)
    return nxt


def wait_event(c: SupervisorClient, kind: str, tid: str, after: int) -> dict[str, Any]:
    """The first ``kind`` event of tenant ``tid`` after sequence number ``after`` (polls the event log)."""

    def find() -> dict[str, Any] | None:
        events = c.events_page(None, after, kinds=[kind])["events"]
        assert isinstance(events, list)
        return next((e for e in events if isinstance(e, dict) and e.get("tenant") == tid), None)

    found = wait_for(find, what=f"a {kind} event of {tid}")
    assert found is not None
    return found


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ per position and per ``seed`` (a buffer's round trip compares them):
    byte ``i`` is ``(i * 31 + seed) & 0xFF``.

    That repeats every 256 bytes, so one period is built and repeated: a generator over every byte
    took ~0.15 s of CPU per MiB, and test_parking compared some 65 MiB of patterns (~10 s of CPU)."""
    period = bytes((i * 31 + seed) & 0xFF for i in range(256))
    return (period * (n // 256 + 1))[:n]
