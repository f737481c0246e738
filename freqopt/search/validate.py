"""Validation: whole iterations measured with a schedule, once per distinct per-kernel schedule."""

from __future__ import annotations

import numpy as np

from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.workload.kernels import Trace
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.realize import Realizer
from freqopt.search.units import TuningUnit

__all__ = ["Validator"]


def _per_kernel_settings(trace: Trace, unit_settings) -> list[ClockSetting]:
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for unit, setting in unit_settings:
        for k in unit.kernel_indices:
            per_kernel[k] = setting
    return per_kernel


class Validator:
    """Measures whole iterations, once per distinct per-kernel schedule, and counts what that cost.

    Args:
        trace, backend: the iteration and the GPU.
        repeats: measurements averaged per schedule.
        switching: measure schedules as a phase-switching runtime realizes and requests them
            (freqopt.search.realize.Realizer, with kernel times from ``backend.kernel_times_s``) and with the GPU's
            clock-switch latency; False: the schedule as given, switching free (the ideal).
        log: where measurements are recorded and read back on resume (freqopt.search.journal); default an
            in-memory one.
    """

    def __init__(self, trace: Trace, backend: Backend, repeats: int, *, switching: bool = False,
                 log: MeasurementLog | None = None):  # fmt: skip
        import optuna

        self.trace, self.backend, self.repeats, self.switching = trace, backend, repeats, switching
        self.realize = Realizer(trace, backend) if switching else (lambda schedule: schedule)
        self.log = log or MeasurementLog(optuna.create_study())
        self.cache: dict[tuple[ClockSetting, ...], Measurement] = {}
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    def __call__(self, schedule: tuple[ClockSetting, ...], key: str = "schedule") -> Measurement:
        """The whole iteration measured with the per-kernel ``schedule`` (shape (K,)) as DVFSRuntime applies it:
        realized per phase, each switch requested one latency ahead (Realizer.requests), when ``switching``."""
        schedule = tuple(schedule)
        return self.requests(self.realize.requests(schedule) if self.switching else schedule, key)

    def requests(self, schedule: tuple[ClockSetting, ...], key: str = "schedule") -> Measurement:
        """The whole iteration measured with ``schedule`` as the settings a runtime requests, unrealized (a
        schedule that is already realizable, such as freqopt.search.schedule's), switch latency included when
        ``switching``; shape (K,) in, per-iteration time_s and energy_j out."""
        schedule = tuple(schedule)
        if schedule not in self.cache:
            tag = digest((schedule, self.switching))
            ms = [self.log.measure(tag, r, lambda i: self.backend.measure_schedule(
                      self.trace.kernels, schedule, key=key, switching=self.switching, sample=i))
                  for r in range(self.repeats)]  # fmt: skip
            self.cache[schedule] = Measurement(
                time_s=float(np.mean([m.time_s for m in ms])),
                energy_j=float(np.mean([m.energy_j for m in ms])),
                cost_gpu_s=float(np.sum([m.cost_gpu_s for m in ms])),
            )
            self.n_measurements += self.repeats
            self.cost_gpu_s += self.cache[schedule].cost_gpu_s
        return self.cache[schedule]

    @property
    def kernel_time_s(self) -> np.ndarray:
        """Every kernel's time at the default setting, in a loop, shape (K,), s (Backend.kernel_times_s; the
        Realizer's, which weigh its choices, when switching)."""
        if isinstance(self.realize, Realizer):
            return self.realize.kernel_time_s
        if getattr(self, "_kernel_time_s", None) is None:
            self._kernel_time_s = self.backend.kernel_times_s(self.trace.kernels, DEFAULT_SETTING)
        return self._kernel_time_s

    def baseline(self) -> Measurement:
        return self(tuple([DEFAULT_SETTING] * len(self.trace)), key="baseline")

    def units(self, units: list[TuningUnit], settings: list[ClockSetting], key: str) -> Measurement:
        return self(tuple(_per_kernel_settings(self.trace, zip(units, settings))), key=key)
