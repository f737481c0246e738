"""A phase block's change of time and energy as a smooth function of its SM clock, fitted on all its readings.

A phase-level study (freqopt.search.schedule) measures the whole iteration with one block's clock changed, so each
reading carries the whole iteration's noise (0.2 % in time, 0.5 % in energy on the simulated GPU) for a change that
is a fraction of it: on gpt3-xl on the H100 the optimizer step at 1440 MHz instead of 1575 MHz saves 0.67 % of the
iteration's energy and costs 0.15 % of its time. Judged one setting at a time, each option's mean taken one
standard error worse so that a lucky reading does not win, such a change drowns, and the settings that carry it may
not be measured at all (the study samples the whole front). Along one memory clock's SM clocks a block's time and
energy change smoothly, though, so every reading of the block informs every clock near it:

* **Local linear regression** (Fan and Gijbels 1996, *Local Polynomial Modelling and Its Applications*, ch. 3): at
  each SM clock x, the straight line through the readings weighted by a Gaussian kernel in their distance from x;
  its value at x is the estimate. It is a linear smoother: every estimate is a weighted sum of the settings' means,
  so its standard error follows from the weights and the readings' spread (the within-setting standard deviation,
  pooled over the settings read more than once), and so does that of a difference of two estimates.
* **Bandwidth by leave-one-setting-out cross-validation**: of a ladder of bandwidths (2 to 64 clock steps), the one
  whose fit predicts each measured setting's mean best from the others' readings. A fidelity judged on readings
  the fit did not use, not on its residuals; a block whose time bends sharply (a power limit that caps the clock)
  gets a narrow bandwidth, a smooth one a wide one that pools more readings.
* **Interpolation only**: estimates are made at the supported SM clocks between the lowest and the highest
  measured on the memory clock, never beyond.

Module functions work on plain arrays: ``local_linear_weights`` (the smoother's matrix), ``choose_bandwidth`` and
``smoothed_changes`` (a block's changes from a reference setting with their standard errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.gpu.backends.base import ClockSetting

__all__ = ["local_linear_weights", "choose_bandwidth", "SmoothedChange", "smoothed_changes", "BANDWIDTH_STEPS"]

BANDWIDTH_STEPS = (2, 4, 8, 16, 32, 64)  # candidate bandwidths, in the GPU's SM clock steps (15 MHz on the H100)


def local_linear_weights(x_obs: np.ndarray, n_obs: np.ndarray, x_eval: np.ndarray, bandwidth: float) -> np.ndarray:
    """The local linear smoother's weights: estimate(x_eval[j]) = weights[j] @ means, where ``means`` are the
    observed settings' mean readings.

    Args:
        x_obs: the measured settings' SM clocks, shape (N,), MHz, distinct.
        n_obs: how many readings each mean is of, shape (N,): each reading weighs the same.
        x_eval: where to estimate, shape (M,), MHz.
        bandwidth: the Gaussian kernel's standard deviation, MHz.

    Returns:
        Shape (M, N); a row is all NaN where the line is undetermined (fewer than two settings carry weight).
    """
    d = x_obs[None, :] - x_eval[:, None]  # (M, N)
    w = n_obs[None, :] * np.exp(-0.5 * (d / bandwidth) ** 2)
    s0, s1, s2 = w.sum(axis=1), (w * d).sum(axis=1), (w * d * d).sum(axis=1)  # (M,)
    det = s0 * s2 - s1 * s1
    ok = det > 1e-9 * np.maximum(s0 * s2, 1e-300)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = w * (s2[:, None] - d * s1[:, None]) / det[:, None]
    out[~ok] = np.nan
    return out


def _loo_error(x: np.ndarray, n: np.ndarray, y: np.ndarray, bandwidth: float) -> float:
    """Mean squared error, weighted by readings, of predicting each interior setting's mean from the others."""
    err, weight = 0.0, 0.0
    for i in range(1, len(x) - 1):  # the ends would be extrapolated, which the smoother is never asked to do
        keep = np.arange(len(x)) != i
        row = local_linear_weights(x[keep], n[keep], x[i : i + 1], bandwidth)[0]
        if np.isnan(row).any():
            return np.inf
        err += n[i] * float(row @ y[keep] - y[i]) ** 2
        weight += n[i]
    return err / weight if weight else np.inf


def choose_bandwidth(x: np.ndarray, n: np.ndarray, y: np.ndarray, step_mhz: float) -> float | None:
    """The bandwidth (MHz) of BANDWIDTH_STEPS x ``step_mhz`` whose fit predicts the interior settings' means best
    from the other settings' readings (leave one setting out); the widest on a tie. None with fewer than three
    settings (nothing to cross-validate on)."""
    if len(x) < 3:
        return None
    errors = {k: _loo_error(x, n, y, k * step_mhz) for k in BANDWIDTH_STEPS}
    best = min(errors.values())
    if not np.isfinite(best):
        return None
    tie = best * (1 + 1e-6) + 1e-12 * float(np.var(y))  # rounding apart
    return max(k for k, err in errors.items() if err <= tie) * step_mhz


@dataclass(frozen=True)
class SmoothedChange:
    """A block's estimated change of the whole iteration's time and energy at ``setting`` from the reference's,
    with the standard errors of those changes (s, J)."""

    setting: ClockSetting
    time_s: float
    energy_j: float
    time_se_s: float
    energy_se_j: float


def smoothed_changes(readings: Sequence, reference: ClockSetting, sm_clocks_mhz: Sequence[int],
                     sd_time_s: float, sd_energy_j: float, max_time_s: float = np.inf
                     ) -> list[SmoothedChange]:  # fmt: skip
    """A block's changes from ``reference`` at every supported SM clock of one memory clock that lies within the
    SM clocks measured on it (module docstring).

    Args:
        readings: the block's measured settings (freqopt.search.study.Option: setting, mean time_s and energy_j
            over n_samples readings of the whole iteration); ``reference`` must be among them.
        reference: the setting the changes are from. With locked clocks, its memory clock's SM clocks are fitted
            and the change is the difference of two estimates; otherwise (the defaults) the memory clock measured
            at the most SM clocks is, and the change is from the reference's own mean.
        sm_clocks_mhz: the GPU's supported SM clocks, ascending, MHz (GPUSpec.sm_clocks_mhz).
        sd_time_s, sd_energy_j: one reading's standard deviation (pooled within settings), s and J.
        max_time_s: the fit uses the settings whose mean time is within this and the next slower one (beyond it
            the budget allows nothing, and a step's time bends steeply there: 1/f where the SM clock bounds it).

    Returns:
        One SmoothedChange per estimated clock, ascending; empty where the memory clock holds fewer than three
        measured SM clocks or the reference was not measured (the caller then judges settings one at a time).
    """
    ref = next((o for o in readings if o.setting == reference), None)
    locked = [o for o in readings if o.setting.power_limit_w is None and o.setting.sm_clock_mhz is not None]
    mems = [o.setting.mem_clock_mhz for o in locked]
    if ref is None or not mems:
        return []
    on_track = reference in [o.setting for o in locked]
    mem = reference.mem_clock_mhz if on_track else max(set(mems), key=mems.count)
    track = sorted((o for o in locked if o.setting.mem_clock_mhz == mem), key=lambda o: o.setting.sm_clock_mhz)
    slow = [i for i, o in enumerate(track) if o.time_s > max_time_s and i < len(track) - 1]
    track = track[max((i for i in slow if track[i + 1].time_s <= max_time_s), default=0):]
    if len(track) < 3 or (on_track and reference not in [o.setting for o in track]):  # no estimate beyond the fit
        return []
    x = np.array([o.setting.sm_clock_mhz for o in track], dtype=float)
    n = np.array([o.n_samples for o in track], dtype=float)
    clocks = np.asarray(sm_clocks_mhz, dtype=float)
    step = float(np.min(np.diff(clocks))) if len(clocks) > 1 else 1.0
    targets = clocks[(clocks >= x[0]) & (clocks <= x[-1])]
    changes = []
    for y, sd, ref_mean in ((np.array([o.time_s for o in track]), sd_time_s, ref.time_s),
                            (np.array([o.energy_j for o in track]), sd_energy_j, ref.energy_j)):  # fmt: skip
        bandwidth = choose_bandwidth(x, n, y, step)
        if bandwidth is None:
            return []
        at = np.append(targets, reference.sm_clock_mhz) if on_track else targets
        rows = local_linear_weights(x, n, at, bandwidth)  # (M [+ 1], N): estimates' weights on the means
        if on_track and np.isnan(rows[-1]).any():
            return []
        if on_track:  # a difference of two estimates of one fit: its weights' difference
            diff = rows[:-1] - rows[-1]
            changes.append((diff @ y, sd * np.sqrt((diff**2 / n).sum(axis=1))))
        else:  # an estimate less the reference's own mean, independent of it
            changes.append((rows @ y - ref_mean, sd * np.sqrt((rows**2 / n).sum(axis=1) + 1.0 / ref.n_samples)))
    (dt, se_t), (de, se_e) = changes
    return [SmoothedChange(ClockSetting(int(c), mem), float(a), float(b), float(p), float(q))
            for c, a, b, p, q in zip(targets, dt, de, se_t, se_e) if np.isfinite([a, b, p, q]).all()]  # fmt: skip
