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
    """One power limit: the iteration's time and energy (per iteration) and their ratio to the default limit's."""

    power_limit_w: float
    time_s: float
    energy_j: float
    time_rel: float
    energy_rel: float

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.time_s


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
        The default-limit measurement and one CapPoint per cap, in the order given.

    Raises:
        InvalidSettingError: a cap outside the GPU's power-limit range.
    """
    for cap in caps_w:
        backend.spec.check_power_limit(cap)
    if host_gap_s < 0:
        raise InvalidSettingError(f"host gap must not be negative, not {host_gap_s:g} s")

    validator = Validator(trace, backend, repeats)

    def measure(setting: ClockSetting) -> Measurement:
        m = validator(tuple([setting] * len(trace)), key="powercap")
        gap_j = host_gap_s * backend.spec.idle_power_w
        return Measurement(m.time_s + host_gap_s, m.energy_j + gap_j, m.cost_gpu_s)

    base = measure(ClockSetting())
    points = []
    for cap in caps_w:
        m = measure(ClockSetting(power_limit_w=float(cap)))
        points.append(CapPoint(float(cap), m.time_s, m.energy_j, m.time_s / base.time_s, m.energy_j / base.energy_j))
    return base, points
