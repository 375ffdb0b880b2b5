"""Model check of the quota algorithm (the crate's loom tests) and a differential
test of the C helper against the model's sequential semantics.

The explorer (``tests/helpers/quota_model.py``) runs every interleaving of
the atomic steps of consume/release as ``shared/_atomics.c`` performs them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import _atomics, quota
from shared.errors import GpuMemoryExhausted, MemoryExhausted
from shared.quota import QuotaBlock
from tests.helpers.quota_model import (
    VARIANTS,
    LineState,
    Op,
    Violation,
    consume,
    explore,
    release,
    run_sequential,
    set_limit,
)

U64 = (1 << 64) - 1

# ----------------------------------------------------------------- explorer

TWO_THREADS: dict[str, tuple[list[list[Op]], int]] = {
    "race-for-last-byte": ([[consume(1)], [consume(1)]], 1),
    "consume-release-consume": (
        [[consume(1), release(1), consume(2)], [consume(2), release(2), consume(1)]],
        3,
    ),
    "tight-limit": ([[consume(2), release(2), consume(2)], [consume(2), consume(1), release(3)]], 3),
    "releases-race-underflow": ([[consume(2), release(2), release(1)], [release(1), consume(1), release(2)]], 4),
    "big-and-small": ([[consume(3), release(1), release(2)], [consume(1), consume(1), release(2)]], 4),
}

THREE_THREADS: dict[str, tuple[list[list[Op]], int]] = {
    "three-consumers": ([[consume(1), release(1)], [consume(2), release(2)], [consume(1), release(1)]], 3),
    "three-with-underflow": (
        [[consume(1), release(1), consume(2)], [consume(2), release(2), consume(1)], [consume(1), release(2), consume(3)]],
        3,
    ),
    "three-race-for-two": ([[consume(1)], [consume(1)], [consume(1)]], 2),
}


@pytest.mark.parametrize("name", sorted(TWO_THREADS))
def test_two_threads_every_interleaving(name: str) -> None:
    program, limit = TWO_THREADS[name]
    result = explore(program, limit=limit)
    assert result.interleavings is not None and result.interleavings > 1
    assert result.states > 10
    # The last-value checks (used == granted - released, counters, high water)
    # ran on every terminal state; here: at least the sequential outcomes exist.
    assert len(result.outcomes) >= 1


@pytest.mark.parametrize("name", sorted(THREE_THREADS))
def test_three_threads_every_interleaving(name: str) -> None:
    program, limit = THREE_THREADS[name]
    result = explore(program, limit=limit)
    assert result.interleavings is not None and result.interleavings > 1000


def test_race_for_the_last_byte_has_exactly_one_winner_each_way() -> None:
    result = explore([[consume(1)], [consume(1)]], limit=1)
    winners = set()
    for shared, results in result.outcomes:
        used, limit, hw, refusals, underflows = shared  # type: ignore[misc]
        assert (used, limit, hw, refusals, underflows) == (1, 1, 1, 1, 0)
        oks = [t for t, rs in enumerate(results) if rs == (("ok",),)]  # type: ignore[arg-type]
        assert len(oks) == 1
        winners.add(oks[0])
    assert winners == {0, 1}, "both threads must win in some interleaving"


def test_three_way_race_for_two_slots() -> None:
    result = explore(THREE_THREADS["three-race-for-two"][0], limit=2)
    for shared, results in result.outcomes:
        assert shared[0] == 2 and shared[3] == 1  # type: ignore[index]
        assert sum(rs[0][0] == "refused" for rs in results) == 1  # type: ignore[index]
    assert len(result.outcomes) == 3  # each thread is the loser in some interleaving


def test_underflow_clamps_and_is_counted_in_every_interleaving() -> None:
    result = explore([[consume(1), release(3)], [consume(1), release(1)]], limit=4)
    assert result.outcomes
    for shared, results in result.outcomes:
        used, _, _, _, underflows = shared  # type: ignore[misc]
        assert used == 0
        assert underflows == sum(r[0] == "underflow" for rs in results for r in rs)  # type: ignore[index]
        assert underflows >= 1


def test_overflow_is_refused_with_a_small_word() -> None:
    # 4-bit words: an unlimited line (limit 15) must refuse a consume that would wrap.
    result = explore([[consume(7), consume(7)], [consume(9), release(20)], [consume(3)]], limit=15, bits=4)
    assert result.interleavings
    for shared, _ in result.outcomes:
        assert shared[0] <= 15  # type: ignore[index]
    assert any(shared[3] for shared, _ in result.outcomes)  # type: ignore[index]


@pytest.mark.parametrize(
    ("program", "limit"),
    [
        ([[consume(2), release(2), consume(2)], [consume(1), release(1)], [set_limit(1), set_limit(4)]], 3),
        ([[consume(2), release(2), consume(1)], [consume(2), release(3)], [set_limit(1), set_limit(4), set_limit(2)]], 3),
        ([[consume(1), consume(1)], [set_limit(0)]], 2),
    ],
    ids=["lower-then-raise", "three-changes", "drop-to-zero"],
)
def test_concurrent_limit_changes(program: list[list[Op]], limit: int) -> None:
    result = explore(program, limit=limit)
    assert result.interleavings is not None and result.interleavings > 10
    # Every final state agrees with the sequential specification (checked by
    # the explorer); a consume that read the old limit may still complete.
    assert len(result.outcomes) > 1


def test_limit_drop_to_zero_refuses_later_consumes() -> None:
    # Once the limit is 0 before a consume starts, that consume is refused.
    result = explore([[set_limit(0), consume(1)]], limit=5)
    ((shared, results),) = result.outcomes
    assert shared[0] == 0 and results[0][1][0] == "refused"  # type: ignore[index]


@pytest.mark.slow  # the largest exploration of this file: make test runs it, make test-fast not
def test_weak_cas_spurious_failures() -> None:
    # The C code uses the weak CAS: it may fail although the value matched.
    program, limit = THREE_THREADS["three-with-underflow"]
    result = explore(program, limit=limit, spurious_cas=True)
    assert result.interleavings is None  # cycles: a retry may return to an earlier state
    assert result.outcomes == explore(program, limit=limit).outcomes


def test_initial_use_is_accounted() -> None:
    result = explore([[release(2)], [consume(1)]], limit=3, used=2)
    for shared, _ in result.outcomes:
        assert shared[0] in (0, 1)  # type: ignore[index]


BROKEN: dict[str, tuple[list[list[Op]], int, str]] = {
    "store_consume": ([[consume(1)], [consume(1)]], 2, "lost update"),
    "wrapping_release": ([[consume(1), release(2)], [consume(1)]], 3, "lost update"),
    "hw_store": ([[consume(2)], [consume(1)]], 3, "high water"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_checker_catches_broken_variants(variant: Any) -> None:
    program, limit, expected = BROKEN[variant]
    with pytest.raises(Violation) as info:
        explore(program, limit=limit, variant=variant)
    assert expected in info.value.message
    assert info.value.trace, "a counterexample comes with its interleaving"
    assert "interleaving:" in str(info.value)


def test_store_consume_grants_above_the_limit() -> None:
    # Without a CAS two consumers can both be granted the last byte.
    with pytest.raises(Violation, match="lost update|above the limit"):
        explore([[consume(1)], [consume(1)]], limit=1, variant="store_consume")


def test_every_broken_variant_has_a_case() -> None:
    assert set(BROKEN) == set(VARIANTS) - {"correct"}


def test_sequential_semantics() -> None:
    line = LineState(limit=10)
    assert run_sequential(line, consume(4)) == ("ok",)
    assert run_sequential(line, consume(7)) == ("refused", 4, 10)
    assert run_sequential(line, release(5)) == ("underflow", 4)
    assert run_sequential(line, set_limit(3)) == ("ok",)
    assert run_sequential(line, consume(3)) == ("ok",)
    assert (line.used, line.limit, line.high_water, line.refusals, line.underflows) == (3, 3, 4, 1, 1)
    line = LineState()
    assert run_sequential(line, consume(U64)) == ("ok",)
    assert run_sequential(line, consume(1)) == ("refused", U64, U64)  # overflow


# ------------------------------------------------ differential test (C vs model)

LINES = ("cpu", "gpu")
_OFF = {"cpu": quota._CPU, "gpu": quota._GPU}

amounts = st.one_of(
    st.integers(0, 64),
    st.integers(0, (1 << 63) - 1),
    st.sampled_from([0, 1, (1 << 62), (1 << 63) - 1]),
)
cpu_limits = st.one_of(st.integers(0, 128), st.integers(0, (1 << 63) - 1))
gpu_limits = st.one_of(cpu_limits, st.none())
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(LINES), st.sampled_from(["consume", "release"]), amounts),
        st.tuples(st.just("cpu"), st.just("set_limit"), cpu_limits),
        st.tuples(st.just("gpu"), st.just("set_limit"), gpu_limits),
    ),
    max_size=40,
)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def quota_warnings() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("twt.quota")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow  # 150 differential runs against the C helper: make test runs it, make test-fast not
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(cpu_limit=cpu_limits, gpu_limit=gpu_limits, ops=ops_strategy)
def test_c_helper_matches_model(
    quota_warnings: _Records, cpu_limit: int, gpu_limit: int | None, ops: list[tuple[str, str, int | None]]
) -> None:
    model = {
        "cpu": LineState(limit=cpu_limit),
        "gpu": LineState(limit=U64 if gpu_limit is None else gpu_limit),
    }
    mirror = {"cpu": 0, "gpu": 0}
    with (
        QuotaBlock.create("diff", memory_quota_bytes=cpu_limit, gpu_memory_bytes_cap=gpu_limit) as raw_block,
        QuotaBlock.create("diff", memory_quota_bytes=cpu_limit, gpu_memory_bytes_cap=gpu_limit) as owner,
    ):
        inst = QuotaBlock.attach(owner.name, instance=3)
        try:
            buf = raw_block._buf
            for line_name, kind, n in ops:
                line = model[line_name]
                off = _OFF[line_name]
                if kind == "set_limit":
                    raw_limit = U64 if n is None else n
                    run_sequential(line, set_limit(raw_limit))
                    _atomics.store(buf, off + _atomics.F_LIMIT, raw_limit)
                    if line_name == "cpu":
                        owner.set_limits(memory_quota_bytes=n)
                    else:
                        owner.set_limits(gpu_memory_bytes_cap=n)
                    continue
                assert n is not None
                quota_warnings.records.clear()
                if kind == "consume":
                    expected = run_sequential(line, consume(n))
                    got_raw = _atomics.consume(buf, off, n)
                    assert (("ok",) if got_raw is None else ("refused", *got_raw)) == expected
                    method = inst.consume_bytes if line_name == "cpu" else inst.consume_gpu_bytes
                    exc_type = MemoryExhausted if line_name == "cpu" else GpuMemoryExhausted
                    try:
                        method(n)
                    except exc_type as exc:
                        assert type(exc) is exc_type
                        assert ("refused", exc.current, exc.limit) == expected
                        assert exc.requested == n and exc.tenant_id == "diff"
                    else:
                        assert expected == ("ok",)
                        mirror[line_name] += n
                else:
                    used_before = line.used
                    expected = run_sequential(line, release(n))
                    got_raw_rel = _atomics.release(buf, off, n)
                    assert (("ok",) if got_raw_rel is None else ("underflow", got_raw_rel)) == expected
                    (inst.release_bytes if line_name == "cpu" else inst.release_gpu_bytes)(n)
                    if expected == ("ok",):
                        assert not quota_warnings.records
                    else:  # one warning with the numbers
                        (rec,) = quota_warnings.records
                        fields = rec.twt_fields  # type: ignore[attr-defined]
                        assert fields["released"] == n and fields["in_use"] == expected[1]
                        assert fields["resource"] == line_name
                    mirror[line_name] = max(mirror[line_name] - min(n, used_before), 0)
                # After every op, all three agree on every counter of the line:
                # the raw line (module functions), and the block whose only
                # holder is instance 3 (its use is the sum of shares).
                raw_got = tuple(
                    _atomics.load(buf, off + f)
                    for f in (_atomics.F_USED, _atomics.F_HIGH_WATER, _atomics.F_REFUSALS, _atomics.F_UNDERFLOWS)
                )
                snap = owner.snapshot()
                got = (
                    snap.bytes_in_use if line_name == "cpu" else snap.gpu_bytes_in_use,
                    getattr(snap, f"{line_name}_high_water"),
                    getattr(snap, f"{line_name}_refusals"),
                    getattr(snap, f"{line_name}_underflows"),
                )
                for found in (raw_got, got):
                    assert found == (line.used, line.high_water, line.refusals, line.underflows), line_name
                assert inst.instance_share(3) == (mirror["cpu"], mirror["gpu"])
            for name, line in model.items():
                off = _OFF[name]
                assert _atomics.load(buf, off + _atomics.F_LIMIT) == line.limit
                assert _atomics.load(owner._buf, off + _atomics.F_LIMIT) == line.limit
        finally:
            inst.close()
