"""The event log in process: numbering, cursors, gaps, views and bounds (no supervisor needed)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.errors import InvalidArgument
from supervisor.observe.event_log import (
    ADMIN_VIEW,
    ENTRY_OVERHEAD,
    MAX_EVENT_BYTES,
    MAX_PAGE_BYTES,
    MAX_PAGE_EVENTS,
    MAX_TRACKED_WORKERS,
    SCAN_BUDGET,
    EventLog,
    EventView,
)
from supervisor.observe.events import EventBus
from supervisor.routing.replies import TRACK_BYTES


def _log(size: int = 64, generations: dict[str, int] | None = None, **kw: Any) -> tuple[EventLog, EventBus]:
    gens = generations if generations is not None else {}
    log = EventLog(size, gens.get, **kw)
    return log, EventBus(None, log)


def _kinds(page: dict[str, Any]) -> list[str]:
    return [e["event"] for e in page["events"]]


def test_events_are_numbered_and_paged_with_a_cursor() -> None:
    log, bus = _log()
    now = log.page(ADMIN_VIEW, {"after": None})
    assert now == {"events": [], "next": 0, "missed": 0, "more": False, "log": log.log_id}
    for i in range(5):
        bus.emit("scale", tenant="acme", instances=i)
    page = log.page(ADMIN_VIEW, {"after": 0, "max": 2})
    assert [e["seq"] for e in page["events"]] == [1, 2] and page["more"] and page["next"] == 2
    page = log.page(ADMIN_VIEW, {"after": page["next"]})
    assert [e["seq"] for e in page["events"]] == [3, 4, 5] and not page["more"] and page["next"] == 5
    assert page["events"][0]["instances"] == 2 and page["missed"] == 0
    # up to date: nothing, the same cursor
    assert log.page(ADMIN_VIEW, {"after": 5}) == {"events": [], "next": 5, "missed": 0, "more": False,
                                                  "log": log.log_id}


def test_kind_filter_is_exact_and_the_cursor_skips_what_it_hides() -> None:
    log, bus = _log()
    bus.emit("exit", tenant="acme", pid=1)
    bus.emit("exit_x", tenant="acme")
    bus.emit("restart", tenant="acme")
    page = log.page(ADMIN_VIEW, {"after": 0, "kinds": ["exit"]})
    assert _kinds(page) == ["exit"] and page["next"] == 3  # past the hidden ones


def test_a_cursor_that_fell_out_of_the_ring_reports_what_it_missed() -> None:
    log, bus = _log(size=16)
    for i in range(100):
        bus.emit("set_quota", tenant="acme", n=i)
    assert len(log) == 16 and log.first == 85 and log.last == 100 and log.dropped == 84
    page = log.page(ADMIN_VIEW, {"after": 10})
    assert page["missed"] == 74 and [e["n"] for e in page["events"]] == list(range(84, 100))
    assert log.page(ADMIN_VIEW, {"after": 0})["missed"] == 84
    assert log.page(ADMIN_VIEW, {"after": 84})["missed"] == 0  # the next one is still held


def test_a_flood_keeps_the_ring_bounded_in_entries_and_bytes() -> None:
    log, bus = _log(size=1000, max_bytes=64 << 10)
    for i in range(5000):
        bus.emit("fault", tenant="acme", params={"blob": "x" * 500, "i": i})
    assert len(log) <= 1000 and log.bytes <= 64 << 10
    assert log.bytes == sum(len(e[3]) + ENTRY_OVERHEAD for e in log._ring if e is not None)
    assert log.last == 5000 and log.first + len(log) - 1 == 5000
    # one oversized record is kept as a stub naming its size, not whole
    bus.emit("fault", tenant="acme", instance=0, params={"blob": "y" * (2 * MAX_EVENT_BYTES)})
    stub = log.page(ADMIN_VIEW, {"after": 5000})["events"][0]
    assert stub["truncated"] is True and stub["bytes"] > 2 * MAX_EVENT_BYTES and "params" not in stub
    assert stub["event"] == "fault" and stub["tenant"] == "acme" and stub["instance"] == 0


def test_a_reply_is_bounded_in_events_bytes_and_work() -> None:
    log, bus = _log(size=20_000)
    for i in range(3000):
        bus.emit("fault", tenant="acme", params={"blob": "z" * 2000, "i": i})
    page = log.page(ADMIN_VIEW, {"after": 0, "max": 10**9})
    assert len(page["events"]) <= MAX_PAGE_EVENTS and page["more"]
    assert sum(len(msgpack.packb(e)) for e in page["events"]) <= MAX_PAGE_BYTES
    assert len(msgpack.packb(page)) < TRACK_BYTES  # a small reply, as the frontend counts them
    small = log.page(ADMIN_VIEW, {"after": 0, "max": 3})
    assert len(small["events"]) == 3 and small["next"] == 3
    # a view that sees nothing still answers after a bounded scan, telling the client to go on
    for i in range(SCAN_BUDGET * 2):
        bus.emit("spawn", pid=i)
    hidden = log.page(EventView("nobody", 1), {"after": 0})
    assert hidden["events"] == [] and hidden["more"] and hidden["next"] == SCAN_BUDGET
    cursor, calls = 0, 0
    while True:
        page = log.page(EventView("nobody", 1), {"after": cursor})
        cursor, calls = page["next"], calls + 1
        if not page["more"]:
            break
    assert cursor == log.last and calls == -(-log.last // SCAN_BUDGET)


def test_a_tenant_sees_only_its_own_events_of_its_registration() -> None:
    gens = {"acme": 1, "beta": 1}
    log, bus = _log(generations=gens)
    bus.emit("register", tenant="acme", instances=1, generation=1)
    bus.emit("spawn", worker="w1", pid=100, method="spawn")
    bus.emit("ready", tenant="acme", instance=0, pid=100)
    bus.emit("ready", tenant="beta", instance=0, pid=200)
    bus.emit("exit", tenant="beta", instance=0, pid=200, reason="killed by signal 9")
    bus.emit("denied", reason="revoked", op="ping", tenant="acme", verified=True, dropped=3)
    bus.emit("reload", path="/etc/twt.toml", registered=["beta"])
    bus.emit("set_quota", tenant="acme", memory_quota_bytes=1 << 20)
    acme = log.page(EventView("acme", 1), {"after": 0})
    assert _kinds(acme) == ["register", "ready", "set_quota"]
    assert "beta" not in repr(acme)
    assert _kinds(log.page(EventView("beta", 1), {"after": 0})) == ["ready", "exit"]
    assert len(log.page(ADMIN_VIEW, {"after": 0})["events"]) == 8
    # acme evicted and the name registered again (for someone else): the old worker exits late
    del gens["acme"]
    bus.emit("evict", tenant="acme", workers=[100])
    gens["acme"] = 2
    bus.emit("register", tenant="acme", instances=1, generation=2)
    bus.emit("exit", tenant="acme", instance=0, pid=100, reason="evicted")
    bus.emit("ready", tenant="acme", instance=0, pid=101)
    new = log.page(EventView("acme", 2), {"after": 0})
    assert _kinds(new) == ["register", "ready"] and new["events"][1]["pid"] == 101
    assert _kinds(log.page(EventView("acme", 1), {"after": 0}))[-1] == "exit"  # the old registration's


def test_tracked_workers_stay_bounded() -> None:
    log, bus = _log(size=16, generations={"acme": 1})
    for pid in range(MAX_TRACKED_WORKERS + 50):
        bus.emit("ready", tenant="acme", pid=pid)
    assert len(log._workers) == MAX_TRACKED_WORKERS
    bus.emit("exit", tenant="acme", pid=MAX_TRACKED_WORKERS + 49)
    assert len(log._workers) == MAX_TRACKED_WORKERS - 1


def test_a_cursor_of_another_supervisor_run_is_served_from_the_start() -> None:
    log, bus = _log()
    for _ in range(3):
        bus.emit("scale", tenant="acme", instances=1)
    page = log.page(ADMIN_VIEW, {"after": 5000, "log": "0123456789abcdef"})
    assert len(page["events"]) == 3 and page["log"] == log.log_id
    with pytest.raises(InvalidArgument, match="ahead of the newest"):
        log.page(ADMIN_VIEW, {"after": 5000})
    with pytest.raises(InvalidArgument, match="ahead of the newest"):
        log.page(ADMIN_VIEW, {"after": 4, "log": log.log_id})


@pytest.mark.parametrize(("args", "message"), [
    ({"after": -1}, "after must be"),
    ({"after": 0, "max": 0}, "max must be at least 1"),
    ({"after": 0, "kinds": ["exit"] * 65}, "kinds must be at most"),
    ({"after": 0, "kinds": [""]}, "kinds must be"),
    ({"after": 0, "kinds": [7]}, "kinds must be"),
    ({"after": 0, "kinds": ["x" * 65]}, "kinds must be"),
    ({"after": 0, "log": "x" * 65}, "log must be"),
])
def test_bad_arguments_are_refused_typed(args: dict[str, Any], message: str) -> None:
    log, _ = _log()
    with pytest.raises(InvalidArgument, match=message):
        log.page(ADMIN_VIEW, args)


def test_a_size_that_is_not_a_positive_int_is_refused() -> None:
    for size in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            EventLog(size)  # type: ignore[arg-type]


class _LogClient:
    """A fake of SupervisorClient.events_page: pages of an in-process log (swappable: a restart)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.calls = 0

    def events_page(self, cap: Any, after: int | None = None, *, kinds: Any = (), max_events: int | None = None,
                    log: str | None = None) -> dict[str, Any]:
        self.calls += 1
        args: dict[str, Any] = {"after": after, "log": log}
        if kinds:
            args["kinds"] = list(kinds)
        return self.log.page(ADMIN_VIEW, args)


def test_a_follower_reports_a_supervisor_restart_and_a_fallen_out_cursor() -> None:
    from supervisor.client.event_follow import MISSED, follow

    log, bus = _log(size=16)
    bus.emit("scale", tenant="acme", instances=1)  # before the follower: not shown
    client = _LogClient(log)
    stream = follow(client, None, ["scale"], timeout_s=5.0, poll_s=0.001)  # type: ignore[arg-type]
    bus.emit("scale", tenant="acme", instances=2)
    assert next(stream)["instances"] == 2
    for i in range(40):  # the follower reads nothing meanwhile: the ring of 16 overflows
        bus.emit("scale", tenant="acme", instances=10 + i)
    gap = next(stream)
    assert gap["event"] == MISSED and gap["missed"] == 24 and "event_log_size" in gap["reason"]
    assert [next(stream)["instances"] for _ in range(16)] == list(range(34, 50))
    # the supervisor restarts: a new log, whose numbers start again
    client.log, bus = _log(size=16)
    bus.emit("scale", tenant="acme", instances=99)
    gap = next(stream)
    assert gap["event"] == MISSED and gap["missed"] is None and "restarted" in gap["reason"]
    assert next(stream)["instances"] == 99
    stream.close()


def test_a_follower_ends_after_its_timeout_of_silence() -> None:
    from supervisor.client.event_follow import follow

    log, _ = _log()
    client = _LogClient(log)
    assert list(follow(client, None, timeout_s=0.05, poll_s=0.01)) == []  # type: ignore[arg-type]
    assert client.calls >= 2
