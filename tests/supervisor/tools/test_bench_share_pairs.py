"""The ``--mix`` estimate of "heavy vs control": neighbouring blocks paired (one ratio each), and a
distribution-free confidence interval of the pairs' median (supervisor.tools.bench.share)."""

from __future__ import annotations

import math

import pytest

from supervisor.tools.bench.share import median_ci, pair_ratios

pytestmark = pytest.mark.timeout(30)


def _block(device: int, rate: float) -> dict[str, object]:
    return {"device": device, "rate": rate}


def test_neighbouring_blocks_are_paired_in_either_order() -> None:
    blocks = [_block(0, 100.0), _block(1, 90.0), _block(1, 45.0), _block(0, 50.0), _block(0, 200.0), _block(1, 220.0)]
    assert pair_ratios(blocks) == pytest.approx([0.9, 0.9, 1.1])


def test_a_pair_without_both_kinds_or_with_a_zero_control_is_left_out() -> None:
    assert pair_ratios([_block(0, 100.0), _block(0, 90.0), _block(0, 0.0), _block(1, 5.0)]) == []
    assert pair_ratios([_block(0, 100.0), _block(1, 90.0), _block(1, 45.0)]) == pytest.approx([0.9])  # odd one out


def test_the_median_interval_is_the_sign_tests_order_statistics() -> None:
    xs = [float(i) for i in range(1, 26)]  # n = 25: [x_8, x_18] (P(Binomial(25, 1/2) <= 7) = 0.0216)
    assert median_ci(xs) == (8.0, 18.0)
    assert median_ci(list(reversed(xs))) == (8.0, 18.0)  # order does not matter
    n, j = 25, 8
    below = sum(math.comb(n, i) for i in range(j)) / 2 ** n
    assert below <= 0.025 < below + math.comb(n, j) / 2 ** n


def test_few_values_give_their_range_and_none_give_zeros() -> None:
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert median_ci([0.9]) == (0.9, 0.9)
    assert median_ci([]) == (0.0, 0.0)
    assert median_ci([float(i) for i in range(6)]) == (0.0, 5.0)  # n = 6: P(X = 0) = 1/64 <= 0.025: j = 1
