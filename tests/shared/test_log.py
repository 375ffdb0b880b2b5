"""Structured logging: ``twt.*`` loggers, text and JSON formatters."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from shared.log import JsonFormatter, TextFormatter, configure_logging, get_logger, log_event


@pytest.fixture
def restore_twt_logger() -> Iterator[logging.Logger]:
    """configure_logging changes the global ``twt`` logger: put it back afterwards."""
    root = logging.getLogger("twt")
    saved = (list(root.handlers), root.level, root.propagate)
    yield root
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def _record(logger: logging.Logger, level: int, event: str, /, **fields: object) -> logging.LogRecord:
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Grab()
    logger.addHandler(handler)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        log_event(logger, level, event, **fields)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
    assert len(records) == 1
    return records[0]


def test_get_logger_names() -> None:
    assert get_logger("supervisor").name == "twt.supervisor"
    assert get_logger("").name == "twt"
    assert get_logger("a.b").parent is not None


def test_json_formatter_one_object_per_line_with_fields() -> None:
    rec = _record(get_logger("test"), logging.WARNING, "quota.underflow", tenant="acme", released=10, in_use=3)
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["event"] == "quota.underflow"
    assert obj["level"] == "warning"
    assert obj["logger"] == "twt.test"
    assert isinstance(obj["ts"], float) and isinstance(obj["pid"], int)
    assert obj["tenant"] == "acme" and obj["released"] == 10 and obj["in_use"] == 3


def test_json_formatter_keeps_fields_that_collide_with_record_keys() -> None:
    rec = _record(get_logger("test"), logging.INFO, "worker.ready", pid=4242, event="x", level="y")
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["event"] == "worker.ready" and obj["level"] == "info"
    assert obj["pid"] == rec.process
    assert obj["field_pid"] == 4242 and obj["field_event"] == "x" and obj["field_level"] == "y"


def test_json_formatter_survives_unencodable_values() -> None:
    rec = _record(
        get_logger("test"), logging.INFO, "odd", obj=object(), nan=float("nan"), weird={(1, 2): "tuple key"}, nl="a\nb"
    )
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)  # strict JSON: no NaN
    assert obj["nan"] == "nan"
    assert obj["nl"] == "a\nb"
    assert "tuple key" in obj["weird"]
    assert obj["obj"].startswith("<object object")


def test_formatters_include_exception() -> None:
    logger = get_logger("test")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        rec = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["event"] == "failed"
    assert "RuntimeError: boom" in obj["exc"]
    text = TextFormatter().format(rec)
    assert text.splitlines()[0].endswith("twt.test failed")
    assert "RuntimeError: boom" in text


def test_text_formatter_key_value() -> None:
    rec = _record(get_logger("supervisor"), logging.INFO, "worker.ready", tenant="acme", instance=0, pid=42)
    line = TextFormatter().format(rec)
    parts = line.split(" ")
    assert parts[0].endswith("Z") and "T" in parts[0]
    assert parts[1:4] == ["INFO", "twt.supervisor", "worker.ready"]
    assert parts[4:] == ["tenant=acme", "instance=0", "pid=42"]


def test_text_formatter_quotes_awkward_values() -> None:
    rec = _record(get_logger("x"), logging.INFO, "e", msg="two words", empty="", eq="a=b", q='say "hi"')
    line = TextFormatter().format(rec)
    assert 'msg="two words"' in line
    assert 'empty=""' in line
    assert 'eq="a=b"' in line
    assert 'q="say \\"hi\\""' in line
    assert "\n" not in line


def test_disabled_level_costs_nothing_and_logs_nothing() -> None:
    logger = get_logger("quiet")
    logger.setLevel(logging.ERROR)
    try:

        class Boom:
            def __str__(self) -> str:
                raise AssertionError("formatted although disabled")

        log_event(logger, logging.DEBUG, "never", value=Boom())
    finally:
        logger.setLevel(logging.NOTSET)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_configure_logging_routes_twt_loggers(fmt: str, restore_twt_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging(fmt, level=logging.INFO, stream=stream)  # type: ignore[arg-type]
    configure_logging(fmt, level=logging.INFO, stream=stream)  # idempotent: one handler
    log_event(get_logger("quota"), logging.WARNING, "quota.underflow", tenant="acme", released=5)
    log_event(get_logger("quota"), logging.DEBUG, "below.level")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    if fmt == "json":
        obj = json.loads(lines[0])
        assert obj["event"] == "quota.underflow" and obj["released"] == 5 and obj["logger"] == "twt.quota"
    else:
        assert "quota.underflow tenant=acme released=5" in lines[0]


def test_configure_logging_rejects_unknown_format(restore_twt_logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")  # type: ignore[arg-type]


def test_configure_logging_keeps_an_equal_handler_and_replaces_another(restore_twt_logger: logging.Logger) -> None:
    """What a forked worker relies on: the fork server's handler is kept when the format and the
    stream are the same, replaced when either differs; the level follows each call."""
    stream = io.StringIO()
    configure_logging("text", level="INFO", stream=stream)
    (kept,) = [h for h in restore_twt_logger.handlers if getattr(h, "_twt_handler", False)]
    configure_logging("text", level="DEBUG", stream=stream)
    assert [h for h in restore_twt_logger.handlers if getattr(h, "_twt_handler", False)] == [kept]
    assert restore_twt_logger.level == logging.DEBUG
    configure_logging("json", level=logging.WARNING, stream=stream)
    (json_handler,) = [h for h in restore_twt_logger.handlers if getattr(h, "_twt_handler", False)]
    assert json_handler is not kept and isinstance(json_handler.formatter, JsonFormatter)
    assert restore_twt_logger.level == logging.WARNING
    other = io.StringIO()
    configure_logging("json", level=logging.WARNING, stream=other)
    (moved,) = [h for h in restore_twt_logger.handlers if getattr(h, "_twt_handler", False)]
    assert moved is not json_handler and isinstance(moved, logging.StreamHandler) and moved.stream is other
