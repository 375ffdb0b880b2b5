"""shared.checks: an int is never a bool; a number is an int or a float, never a bool."""

from __future__ import annotations

import enum
import math

from shared.checks import is_int, is_number


class _Flag(enum.IntEnum):
    ON = 1


def test_is_int_refuses_bools_and_non_ints() -> None:
    assert all(is_int(v) for v in (0, -1, 1 << 70, _Flag.ON))
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None, b"1", [1]))


def test_is_number_takes_ints_and_floats_only() -> None:
    assert all(is_number(v) for v in (0, 2.5, -1e300, math.inf, math.nan))
    assert not any(is_number(v) for v in (True, False, "1.5", None, 1j))
