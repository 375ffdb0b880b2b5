"""The C helper ``shared._atomics``: semantics, every bad input, the Counter type,
and atomicity across real processes on real shared memory."""

from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared import _atomics
from shared.quota import QuotaBlock

U64 = (1 << 64) - 1
SPAN = _atomics.COUNTER_SPAN
USED, LIMIT, HW, REF, UND = (
    _atomics.F_USED,
    _atomics.F_LIMIT,
    _atomics.F_HIGH_WATER,
    _atomics.F_REFUSALS,
    _atomics.F_UNDERFLOWS,
)


@pytest.fixture
def buf() -> Iterator[memoryview]:
    """A page-aligned, writable, zeroed 4 KiB buffer."""
    m = mmap.mmap(-1, 4096)
    view = memoryview(m)
    try:
        yield view
    finally:
        view.release()
        m.close()


def line(b: memoryview, off: int = 0) -> tuple[int, int, int, int, int]:
    return tuple(_atomics.load(b, off + f) for f in (USED, LIMIT, HW, REF, UND))  # type: ignore[return-value]


# ---------------------------------------------------------------- semantics


def test_layout_constants() -> None:
    assert (USED, LIMIT, HW, REF, UND) == (0, 8, 16, 24, 32)
    assert SPAN == 40


def test_consume_release_semantics(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, 100)
    assert _atomics.consume(buf, 0, 60) is None
    assert _atomics.consume(buf, 0, 41) == (60, 100)  # refused: nothing added
    assert _atomics.consume(buf, 0, 40) is None  # exactly at the limit
    assert line(buf) == (100, 100, 100, 1, 0)
    assert _atomics.consume(buf, 0, 0) is None  # zero fits while used <= limit
    assert _atomics.release(buf, 0, 30) is None
    assert _atomics.release(buf, 0, 80) == 70  # underflow: clamped, counted, used found returned
    assert line(buf) == (0, 100, 100, 1, 1)
    assert _atomics.release(buf, 0, 0) is None
    assert _atomics.release(buf, 0, 1) == 0


def test_limit_is_read_from_the_line_each_call(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, 10)
    assert _atomics.consume(buf, 0, 10) is None
    _atomics.store(buf, LIMIT, 5)  # lowered below use: nothing taken away, further consumes refused
    assert _atomics.consume(buf, 0, 0) == (10, 5)
    assert _atomics.consume(buf, 0, 1) == (10, 5)
    _atomics.store(buf, LIMIT, U64)
    assert _atomics.consume(buf, 0, 1) is None
    assert line(buf)[:4] == (11, U64, 11, 2)


def test_overflow_is_refused(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, U64)
    big = (1 << 63) - 1
    assert _atomics.consume(buf, 0, big) is None
    assert _atomics.consume(buf, 0, big) is None
    assert _atomics.load(buf, USED) == U64 - 1
    assert _atomics.consume(buf, 0, 2) == (U64 - 1, U64)  # would wrap
    assert _atomics.consume(buf, 0, 1) is None
    assert _atomics.load(buf, USED) == U64
    assert _atomics.consume(buf, 0, 1) == (U64, U64)


def test_high_water_only_rises(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, 1000)
    for n in (10, 500, 100):
        _atomics.consume(buf, 0, n)
        _atomics.release(buf, 0, n)
    assert line(buf)[2] == 500
    _atomics.consume(buf, 0, 400)
    _atomics.consume(buf, 0, 200)
    assert line(buf)[2] == 600


class MyInt(int):
    pass


@pytest.mark.parametrize(
    "n", [0, 1, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, (1 << 31) + 5, 1 << 60, (1 << 63) - 1], ids=hex
)
def test_amounts_exact_across_internal_int_sizes(buf: memoryview, n: int) -> None:
    # Small ints take a fast path in the C parser (one internal digit); the
    # rest the general one. Both must read the same value; int subclasses too.
    _atomics.store(buf, LIMIT, U64)
    assert _atomics.consume(buf, 0, n) is None
    assert _atomics.load(buf, USED) == n
    assert _atomics.consume(buf, 0, MyInt(n)) is None
    assert _atomics.load(buf, USED) == 2 * n
    assert _atomics.release(buf, MyInt(0), MyInt(n)) is None
    assert _atomics.release(buf, 0, n) is None
    assert _atomics.load(buf, MyInt(0)) == 0
    assert _atomics.load(buf, HW) == 2 * n


def test_load_store_fetch_add_exchange(buf: memoryview) -> None:
    _atomics.store(buf, 64, U64)
    assert _atomics.load(buf, 64) == U64
    assert _atomics.fetch_add(buf, 64, 2) == U64  # wraps
    assert _atomics.load(buf, 64) == 1
    assert _atomics.exchange(buf, 64, 7) == 1
    assert _atomics.load(buf, 64) == 7
    assert _atomics.load(buf, 4096 - 8) == 0  # the last word is in bounds
    assert _atomics.load(b"\x05" + b"\0" * 7, 0) == 5  # load needs no writable buffer


def test_counters_are_little_endian_uint64(buf: memoryview) -> None:
    _atomics.store(buf, 0, 0x0102030405060708)
    assert bytes(buf[:8]) == bytes.fromhex("0807060504030201")


def test_noop_accepts_anything() -> None:
    assert _atomics.noop(None, "x", 1.5) is None
    assert _atomics.noop(1, 2, 3) is None


# --------------------------------------------------- bad inputs (raw module)

BAD_AMOUNTS: list[tuple[Any, type[Exception]]] = [
    ("1", TypeError),
    (1.0, TypeError),
    (None, TypeError),
    (True, TypeError),
    (False, TypeError),
    (b"1", TypeError),
    (-1, ValueError),
    (-(1 << 70), ValueError),
    (1 << 63, ValueError),
    (1 << 64, ValueError),
    (1 << 200, ValueError),
]

BAD_OFFSETS: list[tuple[Any, type[Exception]]] = [
    ("0", TypeError),
    (0.0, TypeError),
    (None, TypeError),
    (True, TypeError),
    (-8, ValueError),
    (4, ValueError),  # not 8-aligned
    (4096 - 32, ValueError),  # the 40-byte line would run past the end
    (4096, ValueError),
    (1 << 70, ValueError),
    (-(1 << 70), ValueError),
]


def _unchanged(b: memoryview) -> Callable[[], None]:
    before = bytes(b)

    def check() -> None:
        assert bytes(b) == before, "a refused call must not write"

    return check


@pytest.mark.parametrize("fn", [_atomics.consume, _atomics.release], ids=["consume", "release"])
@pytest.mark.parametrize(("n", "exc"), BAD_AMOUNTS, ids=repr)
def test_bad_amounts(buf: memoryview, fn: Callable[..., Any], n: Any, exc: type[Exception]) -> None:
    _atomics.store(buf, LIMIT, 100)
    _atomics.store(buf, USED, 5)
    check = _unchanged(buf)
    with pytest.raises(exc):
        fn(buf, 0, n)
    check()


RAW_CALLS: dict[str, tuple[Callable[[Any, Any], Any], int]] = {
    # name: (call, bytes the call touches at the offset)
    "consume": (lambda b, off: _atomics.consume(b, off, 1), SPAN),
    "release": (lambda b, off: _atomics.release(b, off, 1), SPAN),
    "store": (lambda b, off: _atomics.store(b, off, 1), 8),
    "fetch_add": (lambda b, off: _atomics.fetch_add(b, off, 1), 8),
    "exchange": (lambda b, off: _atomics.exchange(b, off, 1), 8),
    "load": (lambda b, off: _atomics.load(b, off), 8),
}


@pytest.mark.parametrize("call", sorted(RAW_CALLS))
@pytest.mark.parametrize(("off", "exc"), BAD_OFFSETS, ids=repr)
def test_bad_offsets(buf: memoryview, call: str, off: Any, exc: type[Exception]) -> None:
    fn, span = RAW_CALLS[call]
    _atomics.store(buf, LIMIT, 100)
    check = _unchanged(buf)
    if off == 4096 - 32 and span == 8:
        return  # a valid place for one uint64, only not for a 40-byte line
    with pytest.raises(exc):
        fn(buf, off)
    check()


@pytest.mark.parametrize("value", [-1, 1 << 64, 1.0, True, None, "1"], ids=repr)
@pytest.mark.parametrize("fn", [_atomics.store, _atomics.fetch_add, _atomics.exchange])
def test_bad_values(buf: memoryview, fn: Callable[..., Any], value: Any) -> None:
    check = _unchanged(buf)
    with pytest.raises((TypeError, ValueError)) as info:
        fn(buf, 0, value)
    expected = TypeError if isinstance(value, bool) or not isinstance(value, int) else ValueError
    assert type(info.value) is expected
    check()


def test_readonly_buffers_are_refused(buf: memoryview) -> None:
    for ro in (bytes(64), buf.toreadonly()):
        for fn in (_atomics.consume, _atomics.release, _atomics.store, _atomics.fetch_add, _atomics.exchange):
            with pytest.raises(BufferError):
                fn(ro, 0, 1)
    assert bytes(buf[:64]) == bytes(64)


def test_buffers_that_are_not_usable(buf: memoryview) -> None:
    check = _unchanged(buf)
    with pytest.raises(TypeError):
        _atomics.consume(42, 0, 1)
    with pytest.raises(TypeError):
        _atomics.consume("not a buffer", 0, 1)
    with pytest.raises(TypeError):
        _atomics.load(None, 0)
    with pytest.raises(ValueError, match="8-aligned"):
        _atomics.consume(buf[1:], 0, 1)  # misaligned base address
    with pytest.raises(BufferError):
        _atomics.consume(buf[::2], 0, 1)  # not contiguous
    with pytest.raises(ValueError):
        _atomics.consume(bytearray(32), 0, 1)  # smaller than a line
    with pytest.raises(ValueError):
        _atomics.load(bytearray(4), 0)
    check()


def test_memoryview_fast_path_matches_buffer_protocol(buf: memoryview) -> None:
    # Module functions read a memoryview's buffer in place (no export taken):
    # slices, casts and every refusal behave as through the buffer protocol.
    sub = buf[64:]
    _atomics.store(sub, LIMIT, 10)
    assert _atomics.consume(sub, 0, 4) is None
    assert _atomics.load(buf, 64 + USED) == 4
    q = buf.cast("Q")
    assert _atomics.consume(q, 64, 6) is None
    assert _atomics.load(buf, 64 + USED) == 10
    with pytest.raises(BufferError, match="not writable"):
        _atomics.consume(sub.toreadonly(), 0, 0)
    released = buf[128:]
    released.release()
    check = _unchanged(buf)
    with pytest.raises(ValueError, match="released"):
        _atomics.consume(released, 0, 1)
    with pytest.raises(ValueError, match="released"):
        _atomics.load(released, 0)
    with pytest.raises(BufferError, match="not writable"):
        _atomics.store(sub.toreadonly(), 0, 1)
    assert _atomics.load(sub.toreadonly(), 0) == 4 + 6
    with pytest.raises(BufferError, match="contiguous"):
        _atomics.load(buf[::16], 0)
    with pytest.raises(ValueError, match="8-aligned"):
        _atomics.load(buf[4:], 0)
    with pytest.raises(ValueError, match="out of bounds"):
        _atomics.consume(buf[4096 - 32 :], 0, 1)
    check()
    q.release()
    sub.release()


def test_wrong_argument_counts(buf: memoryview) -> None:
    with pytest.raises(TypeError, match="exactly 3"):
        _atomics.consume(buf, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exactly 3"):
        _atomics.release(buf, 0, 1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exactly 2"):
        _atomics.load(buf)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _atomics.consume(buf, 0, n=1)  # type: ignore[call-arg]


def test_no_buffer_export_is_kept_after_any_call() -> None:
    ba = bytearray(128)
    _atomics.store(ba, 8, 10)
    _atomics.consume(ba, 0, 1)
    _atomics.consume(ba, 0, 100)
    _atomics.release(ba, 0, 5)
    for bad in (lambda: _atomics.consume(ba, 4, 1), lambda: _atomics.consume(ba, 0, -1)):
        with pytest.raises(ValueError):
            bad()
    ba.extend(b"x")  # a bytearray with a live export cannot be resized


# --------------------------------------------------------------- Counter type


class Refused(Exception):
    pass


class Closed(Exception):
    pass


class Recorder:
    def __init__(self) -> None:
        self.underflows: list[tuple[int, int]] = []

    def refuse(self, n: int, used: int, limit: int) -> BaseException:
        return Refused(n, used, limit)

    def underflow(self, n: int, used: int) -> None:
        self.underflows.append((n, used))

    def closed(self) -> BaseException:
        return Closed()


def make_counter(b: Any, off: int = 0, mirror: int | None = None, rec: Recorder | None = None) -> _atomics.Counter:
    rec = rec or Recorder()
    return _atomics.Counter(b, off, rec.refuse, rec.underflow, rec.closed, mirror)


def test_counter_operations(buf: memoryview) -> None:
    rec = Recorder()
    c = make_counter(buf, 64, rec=rec)
    _atomics.store(buf, 64 + LIMIT, 10)
    c.consume(7)
    with pytest.raises(Refused) as info:
        c.consume(4)
    assert info.value.args == (4, 7, 10)
    assert c.load() == 7
    c.release(10)
    assert rec.underflows == [(10, 7)]
    assert line(buf, 64) == (0, 10, 7, 1, 1)
    assert c.closed is False
    c.close()
    c.close()  # idempotent
    assert c.closed is True
    for call in (lambda: c.consume(1), lambda: c.release(1), c.load):
        with pytest.raises(Closed):
            call()


def test_counter_bad_amounts_leave_line_unchanged(buf: memoryview) -> None:
    c = make_counter(buf)
    _atomics.store(buf, LIMIT, 100)
    c.consume(5)
    check = _unchanged(buf)
    for n, exc in BAD_AMOUNTS:
        with pytest.raises(exc):
            c.consume(n)
        with pytest.raises(exc):
            c.release(n)
    with pytest.raises(TypeError):
        c.consume()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        c.load(1)  # type: ignore[call-arg]
    check()
    c.close()


def test_counter_mirror_tracks_one_instance_share(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, 1000)
    a = make_counter(buf, 0, mirror=512)
    b = make_counter(buf, 0, mirror=520)
    a.consume(100)
    b.consume(50)
    a.release(30)
    assert (_atomics.load(buf, 512), _atomics.load(buf, 520)) == (70, 50)
    b.release(80)  # more than b holds: b's share saturates at 0, the line loses 80
    assert (_atomics.load(buf, 512), _atomics.load(buf, 520), _atomics.load(buf, USED)) == (70, 0, 40)
    a.release(100)  # underflow of the line: only 40 were really released
    assert (_atomics.load(buf, 512), _atomics.load(buf, USED)) == (30, 0)
    with pytest.raises(Refused):
        a.consume(2000)
    assert _atomics.load(buf, 512) == 30  # a refusal adds nothing to the share
    a.close()
    b.close()


def test_counter_constructor_errors_keep_no_export() -> None:
    ba = bytearray(256)
    rec = Recorder()
    with pytest.raises(TypeError):
        _atomics.Counter(ba, 0, "not callable", rec.underflow, rec.closed)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _atomics.Counter(ba, 4, rec.refuse, rec.underflow, rec.closed)
    with pytest.raises(ValueError):
        _atomics.Counter(ba, 0, rec.refuse, rec.underflow, rec.closed, 3)  # misaligned mirror
    with pytest.raises(ValueError):
        _atomics.Counter(ba, 0, rec.refuse, rec.underflow, rec.closed, 256)  # mirror out of bounds
    with pytest.raises(TypeError):
        _atomics.Counter(ba, 0, rec.refuse, rec.underflow, rec.closed, "8")  # type: ignore[arg-type]
    with pytest.raises(BufferError):
        _atomics.Counter(bytes(256), 0, rec.refuse, rec.underflow, rec.closed)
    with pytest.raises(TypeError):
        _atomics.Counter(ba, 0)  # type: ignore[call-arg]
    ba.extend(b"x")  # no failed constructor kept the buffer exported


def test_counter_holds_its_export_until_closed() -> None:
    ba = bytearray(128)
    c = make_counter(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")
    c.close()
    ba.extend(b"x")


def test_counter_double_init_refused(buf: memoryview) -> None:
    rec = Recorder()
    c = make_counter(buf, rec=rec)
    with pytest.raises(RuntimeError, match="already initialised"):
        c.__init__(buf, 64, rec.refuse, rec.underflow, rec.closed)  # type: ignore[misc]
    c.close()


def test_uninitialised_counter_is_closed() -> None:
    c = _atomics.Counter.__new__(_atomics.Counter)
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.consume(1)
    c.close()


def test_callback_misbehaviour(buf: memoryview) -> None:
    _atomics.store(buf, LIMIT, 1)

    def returns_not_exception(n: int, used: int, limit: int) -> Any:
        return "oops"

    def raises(n: int, used: int, limit: int) -> BaseException:
        raise KeyError("from callback")

    def underflow_raises(n: int, used: int) -> None:
        raise KeyError("underflow callback")

    rec = Recorder()
    c = _atomics.Counter(buf, 0, returns_not_exception, underflow_raises, rec.closed)
    with pytest.raises(TypeError, match="not an exception"):
        c.consume(5)
    c.close()
    c = _atomics.Counter(buf, 0, raises, underflow_raises, rec.closed)
    with pytest.raises(KeyError, match="from callback"):
        c.consume(5)
    assert line(buf)[3] == 2  # both refusals were counted
    with pytest.raises(KeyError, match="underflow callback"):
        c.release(3)
    assert line(buf)[4] == 1  # the release (clamped) happened before the callback
    c.close()


def test_counter_in_a_reference_cycle_is_collected() -> None:
    ba = bytearray(128)
    holder: dict[str, Any] = {}

    def refuse(n: int, used: int, limit: int) -> BaseException:
        return Refused(holder)  # noqa: F821 - a closure cell, deleted below on purpose: the cycle is the test

    c = _atomics.Counter(ba, 0, refuse, Recorder().underflow, Recorder().closed)
    holder["c"] = c
    del c, holder, refuse
    gc.collect()
    ba.extend(b"x")  # tp_clear released the buffer


# ------------------------------------------------ atomicity across processes


def _add_many(name: str, iterations: int, ready: Any, go: Any) -> None:
    block = QuotaBlock.attach(name)
    try:
        b = block._buf
        consume, release, fetch_add = _atomics.consume, _atomics.release, _atomics.fetch_add
        ready.put(os.getpid())
        if not go.wait(30):
            raise SystemExit(3)
        for _ in range(iterations):
            if consume(b, 128, 1) is not None:
                raise SystemExit(4)
            fetch_add(b, 128 + 40, 1)  # the line's reserved word
        for _ in range(iterations):
            if release(b, 128, 1) is not None:
                raise SystemExit(5)
    finally:
        block.close()


@pytest.mark.timeout(60)
def test_raw_calls_are_atomic_across_processes() -> None:
    from shared import quota

    assert quota._CPU == 128
    iterations = 200_000
    ctx = mp.get_context("spawn")
    with QuotaBlock.create("atomic", memory_quota_bytes=(1 << 63) - 1) as block:
        ready, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_add_many, args=(block.name, iterations, ready, go)) for _ in range(2)]
        try:
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=30)
            go.set()
            for p in procs:
                p.join(timeout=30)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            ready.close()
            ready.join_thread()
        snap = block.snapshot()
        assert snap.bytes_in_use == 0
        assert snap.cpu_high_water <= 2 * iterations
        assert snap.cpu_underflows == 0 and snap.cpu_refusals == 0
        assert _atomics.load(block._buf, 128 + 40) == 2 * iterations  # no lost increment
