"""A phase block's changes fitted along the SM clock (freqopt.search.smooth): exact on lines, unbiased where the
curve is smooth, honest standard errors, no extrapolation, and the window that drops far-off readings."""

import numpy as np
import pytest

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.search.smooth import choose_bandwidth, local_linear_weights, smoothed_changes
from freqopt.search.study import Option

CLOCKS = list(range(900, 1981, 15))  # an H100-like ladder, MHz
MEM = 2619


def _readings(clocks, time_of, energy_of, n, rng, sd_t=0.0, sd_e=0.0):
    out = []
    for c, k in zip(clocks, n):
        t = time_of(c) + sd_t * rng.standard_normal(k)
        e = energy_of(c) + sd_e * rng.standard_normal(k)
        out.append(Option(ClockSetting(c, MEM), float(t.mean()), float(e.mean()), k,
                          float(t.std(ddof=1)) if k > 1 else 0.0, float(e.std(ddof=1)) if k > 1 else 0.0))
    return out


def test_weights_reproduce_constants_and_lines_exactly():
    x = np.array([900.0, 1020.0, 1320.0, 1575.0, 1815.0, 1980.0])
    n = np.array([1, 1, 2, 5, 5, 1], dtype=float)
    at = np.array([950.0, 1440.0, 1575.0, 1900.0])
    for bandwidth in (30.0, 120.0, 960.0):
        w = local_linear_weights(x, n, at, bandwidth)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-9)
        np.testing.assert_allclose(w @ (3.0 - 0.002 * x), 3.0 - 0.002 * at, atol=1e-9)


def test_an_undetermined_line_is_nan_not_a_guess():
    w = local_linear_weights(np.array([1000.0, 1600.0]), np.ones(2), np.array([1300.0]), 1.0)  # no weight on either
    assert np.isnan(w).all()


def test_cross_validation_narrows_for_a_kink_and_widens_for_a_line():
    x = np.arange(900.0, 1981.0, 60.0)
    n = np.ones_like(x)
    line = 0.2 - 5e-5 * x
    kinked = np.where(x < 1590, 0.2 - 1e-4 * (x - 1590), 0.2)  # time flat above a power-capped clock
    assert choose_bandwidth(x, n, line, 15.0) == 64 * 15.0
    assert choose_bandwidth(x, n, kinked, 15.0) < 16 * 15.0
    assert choose_bandwidth(x[:2], n[:2], line[:2], 15.0) is None


def test_changes_interpolate_a_smooth_block_and_are_zero_at_the_reference():
    def time_of(c):
        return 0.159 + 0.004 * (1575.0 / c - 1.0)

    def energy_of(c):
        return 99.4 + 2e-6 * (c - 1575.0) ** 2 + 3e-3 * (c - 1575.0)

    measured = [1200, 1320, 1575, 1815, 1920, 1980]
    readings = _readings(measured, time_of, energy_of, [1] * 6, np.random.default_rng(0))
    changes = {c.setting.sm_clock_mhz: c for c in smoothed_changes(readings, ClockSetting(1575, MEM), CLOCKS,
                                                                        1e-4, 0.5)}  # fmt: skip
    assert min(changes) == 1200 and max(changes) == 1980  # within the measured clocks only, every supported one
    assert len(changes) == (1980 - 1200) // 15 + 1
    ref = changes[1575]
    assert ref.time_s == pytest.approx(0.0, abs=1e-12) and ref.energy_j == pytest.approx(0.0, abs=1e-12)
    assert ref.time_se_s == pytest.approx(0.0, abs=1e-12)
    for c in (1410, 1455, 1500, 1680):  # never measured
        assert changes[c].time_s == pytest.approx(time_of(c) - time_of(1575), abs=2.5e-4)
        assert changes[c].energy_j == pytest.approx(energy_of(c) - energy_of(1575), abs=0.25)


def test_standard_errors_cover_the_truth_at_their_stated_rate():
    """Over 400 noisy studies of a block whose change is a straight line (where the local linear fit has no bias),
    the change at an unmeasured clock lies within 1.96 standard errors of the truth about 95 % of the time, and the
    standard error is well below one reading's: the fit pools the block's readings."""
    rng = np.random.default_rng(7)
    measured, n = [1200, 1320, 1575, 1815, 1920, 1980], [1, 1, 5, 5, 1, 1]
    hits, ses = 0, []
    for _ in range(400):
        readings = _readings(measured, lambda c: 0.16 - 2e-6 * c, lambda c: 95.0 + 3e-3 * c, n, rng, 3e-4, 0.5)
        sd_e = float(np.sqrt(sum((o.n_samples - 1) * o.energy_sd_j**2 for o in readings)
                             / sum(o.n_samples - 1 for o in readings)))  # fmt: skip
        change = next(c for c in smoothed_changes(readings, ClockSetting(1575, MEM), CLOCKS, 3e-4, sd_e)
                      if c.setting.sm_clock_mhz == 1440)  # fmt: skip
        hits += abs(change.energy_j - 3e-3 * (1440 - 1575)) <= 1.96 * change.energy_se_j
        ses.append(change.energy_se_j)
    assert 0.90 <= hits / 400 <= 0.99
    assert np.median(ses) < 0.5 * np.sqrt(1 / 1 + 1 / 5)  # one setting's mean against the reference's


def test_a_reference_off_the_clock_ladder_is_subtracted_as_measured():
    readings = _readings([1200, 1575, 1980], lambda c: 0.16, lambda c: 99.0, [1, 1, 1], np.random.default_rng(1))
    readings.append(Option(DEFAULT_SETTING, 0.158, 101.0, 4, 1e-4, 0.4))
    changes = smoothed_changes(readings, DEFAULT_SETTING, CLOCKS, 1e-4, 0.5)
    assert changes and all(c.energy_j == pytest.approx(-2.0) and c.time_s == pytest.approx(0.002) for c in changes)
    assert all(c.energy_se_j >= 0.5 / 2 for c in changes)  # the reference's own mean's error is in every change


def test_the_window_keeps_one_setting_beyond_it_and_drops_the_rest():
    time_of = {600: 0.30, 900: 0.20, 1200: 0.170, 1320: 0.165, 1575: 0.160, 1980: 0.159}
    readings = _readings(list(time_of), time_of.get, lambda c: 99.0, [1] * 6, np.random.default_rng(2))
    changes = smoothed_changes(readings, ClockSetting(1575, MEM), CLOCKS, 1e-4, 0.5, max_time_s=0.168)
    assert min(c.setting.sm_clock_mhz for c in changes) == 1200
    assert smoothed_changes(readings[:2] + readings[-1:], ClockSetting(1980, MEM), CLOCKS, 1e-4, 0.5,
                            max_time_s=0.168) == []  # 900 (the one beyond) and 1980 left: too few to fit  # fmt: skip


def test_a_reference_outside_the_window_is_not_extrapolated_to():
    time_of = {900: 0.20, 1200: 0.170, 1320: 0.165, 1575: 0.160, 1980: 0.159}
    readings = _readings(list(time_of), time_of.get, lambda c: 99.0, [1] * 5, np.random.default_rng(3))
    assert smoothed_changes(readings, ClockSetting(900, MEM), CLOCKS, 1e-4, 0.5, max_time_s=0.168) == []
