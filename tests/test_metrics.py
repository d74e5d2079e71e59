"""The metrics of METHODS.md against hand-computed values."""

import pytest

from jaxspec import metrics


def test_tau_and_acceptance_by_position():
    accepted = [[0, 2, 3], [1]]  # drafted tokens accepted in each round of two rows
    assert metrics.tau(accepted) == pytest.approx((1 + 3 + 4 + 2) / 4)
    assert metrics.acceptance_by_position(accepted, 3) == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert metrics.accepted_length_histogram(accepted, 3) == [1, 1, 1, 1]


def test_speedup_formulas():
    # chain: alpha 0.8, K 4, c 0.1 -> (1 - 0.8^5) / (0.2 * 1.4)
    assert metrics.chain_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    assert metrics.chain_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert metrics.eagle3_speedup(4.0, 36, 1, 7) == pytest.approx(4.0 * 36 / 43)
    assert metrics.ppsd_speedup(3.0, 32, 1, 8) == pytest.approx(3.0 * 32 / 40)
    assert metrics.spd_speedup(300, 100, 8) == pytest.approx(24.0)
    assert metrics.wall_clock_speedup(10.0, 4.0) == pytest.approx(2.5)
