"""Power-cap study: one iteration measured at each power limit, relative to the GPU's default limit
(the experiment of McDonald et al. 2022, "Great Power, Great Responsibility", arXiv 2205.09646)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.gpu.backends.base import Backend, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Trace
from freqopt.search.validate import Validator

__all__ = ["CapPoint", "default_caps", "sweep_power_caps"]


@dataclass(frozen=True)
class CapPoint:
    """One power limit: the iteration's time and energy (per iteration) and their ratio to the default limit's.

    ``power_limit_met`` is False where the GPU drew more than the limit while it ran (its busy average power, host
    gap excluded, over the limit by more than LIMIT_READING_TOLERANCE): even the lowest SM clock draws more, so
    the firmware runs there above the limit (Zeus's A40 averages 107 W under 100 W: You et al., NSDI'23)."""

    power_limit_w: float
    time_s: float
    energy_j: float
    time_rel: float
    energy_rel: float
    power_limit_met: bool = True

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.time_s


# A reading's average power may sit this far over the limit before the limit counts as not met: the readings' noise
# (0.5 % in energy, 0.2 % in time, freqopt.gpu.backends.simulated; 3 sigma of a mean of 3 is about 1 %), doubled.
LIMIT_READING_TOLERANCE = 0.02


def default_caps(spec) -> list[float]:
    """Four limits from the lowest the GPU accepts to its default, rounded to 5 W (a V100-PCIe: 100-250 W)."""
    return [float(5 * round(w / 5)) for w in np.linspace(spec.power_limit_min_w, spec.power_limit_default_w, 4)]


def sweep_power_caps(
    trace: Trace, backend: Backend, caps_w: Sequence[float], *, repeats: int = 3, host_gap_s: float = 0.0
) -> tuple[Measurement, list[CapPoint]]:
    """Measure the whole iteration at the default limit and at each of ``caps_w``.

    Args:
        trace: the iteration (a training step or an inference batch).
        backend: the GPU.
        caps_w: power limits, W; each within the GPU's limits.
        repeats: measurements averaged per limit.
        host_gap_s: host time per iteration in which the GPU idles at its idle power (data loading, Python): a
            cap does not slow it, so it flattens the time curve (calibration: freqopt/gpu/calibration/v100.py).

    Returns:
        The default-limit measurement and one CapPoint per cap, in the order given. A cap at the GPU's default limit
        is that measurement, not a second one (whose noise would read as a saving or a loss of the default against
        itself): its time_rel and energy_rel are 1.

    Raises:
        InvalidSettingError: a cap outside the GPU's power-limit range.
    """
    for cap in caps_w:
        backend.spec.check_power_limit(cap)
    if host_gap_s < 0:
        raise InvalidSettingError(f"host gap must not be negative, not {host_gap_s:g} s")

    validator = Validator(trace, backend, repeats)

    def measure(setting: ClockSetting) -> tuple[Measurement, float]:
        """The iteration with its host gap, and the GPU's busy average power (W) without it."""
        m = validator(tuple([setting] * len(trace)), key="powercap")
        gap_j = host_gap_s * backend.spec.idle_power_w
        return Measurement(m.time_s + host_gap_s, m.energy_j + gap_j, m.cost_gpu_s), m.avg_power_w

    base, base_busy_w = measure(ClockSetting())
    points = []
    for cap in caps_w:
        if float(cap) == float(backend.spec.power_limit_default_w):
            m, busy_w = base, base_busy_w  # the default limit, measured once
        else:
            m, busy_w = measure(ClockSetting(power_limit_w=float(cap)))
        met = busy_w <= float(cap) * (1 + LIMIT_READING_TOLERANCE)
        points.append(CapPoint(float(cap), m.time_s, m.energy_j, m.time_s / base.time_s, m.energy_j / base.energy_j,
                               met))  # fmt: skip
    return base, points
