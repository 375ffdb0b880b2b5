"""Each vocabulary is one table (shared.kinds, shared.protocol.QUOTA_KEYS): every user reads it, none restates it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.kinds import (
    DISRUPTIVE_FAULTS,
    EVENT_KINDS,
    FAULT_TABLE,
    SIGNAL_FAULT_KINDS,
    TENANT_EVENT_KINDS,
    WORKER_FAULT_KINDS,
)

ROOT = Path(__file__).resolve().parents[2]


def _emitted_kinds() -> set[str]:
    """Every event kind the supervisor's source emits (``.emit("kind"`` and ``self._emit("kind"``)."""
    found: set[str] = set()
    for path in (ROOT / "supervisor").rglob("*.py"):
        found |= set(re.findall(r"\b_?emit\(\s*\"([a-z_]+)\"", path.read_text(encoding="utf-8")))
    return found


def test_every_emitted_event_kind_is_a_row_and_every_row_is_emitted() -> None:
    emitted = _emitted_kinds()
    assert emitted == set(EVENT_KINDS), (sorted(emitted - set(EVENT_KINDS)), sorted(set(EVENT_KINDS) - emitted))


def test_event_users_read_the_table() -> None:
    from supervisor.cli.commands.events import KINDS
    from supervisor.observe.event_log import TENANT_KINDS

    assert KINDS == tuple(EVENT_KINDS)
    assert TENANT_KINDS == TENANT_EVENT_KINDS == {k.name for k in EVENT_KINDS.values() if k.tenant_visible}
    assert "denied" not in TENANT_KINDS and "exit" in TENANT_KINDS  # an audit record is the operator's


def test_the_event_bus_logs_at_the_rows_level(caplog: pytest.LogCaptureFixture) -> None:
    from supervisor.observe.events import EventBus

    bus = EventBus(None)
    with caplog.at_level(logging.DEBUG, logger="twt.supervisor.observe.events"):
        bus.emit("failed", tenant="a")
        bus.emit("exit", tenant="a", expected=False)
        bus.emit("exit", tenant="a", expected=True)  # a stop asked for is not a warning
        bus.emit("ready", tenant="a")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING, logging.INFO, logging.INFO]


def test_fault_kinds_are_one_table() -> None:
    from supervisor.tools.chaos.config import ALL_FAULTS, DEFAULT_FAULTS, SIGNAL_FAULTS

    assert proto.FAULT_KINDS == WORKER_FAULT_KINDS == DEFAULT_FAULTS
    assert SIGNAL_FAULTS == SIGNAL_FAULT_KINDS == ("sigkill", "sigstop")
    assert set(ALL_FAULTS) == set(FAULT_TABLE)
    assert DISRUPTIVE_FAULTS == {"crash", "segfault", "exit", "hang", "corrupt", "drop", "leak", "sigkill", "sigstop"}
    # the worker applies every kind inject_fault accepts, and no other
    source = (ROOT / "worker" / "faults.py").read_text(encoding="utf-8")
    assert set(re.findall(r'kind == "([a-z-]+)"', source)) == set(WORKER_FAULT_KINDS)


def test_set_quota_keys_are_not_restated() -> None:
    from supervisor.lifecycle.reload import LIVE_FIELDS, QUOTA_FIELDS

    assert QUOTA_FIELDS is proto.QUOTA_KEYS and set(QUOTA_FIELDS) <= LIVE_FIELDS
