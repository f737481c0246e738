"""Validation: whole iterations measured with a schedule, once per distinct per-kernel schedule, read as often as a
decision against the slowdown limit needs."""

from __future__ import annotations

import functools
import math

import numpy as np

from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.workload.kernels import Trace
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.realize import Realizer
from freqopt.search.units import TuningUnit

__all__ = ["Validator"]

# How many standard errors a schedule's mean time must lie from the limit before its readings decide which side
# it is on; nearer than that it is read again, up to ``max_repeats`` readings (a sequential test, Wald 1945:
# readings are spent only where the answer is still in doubt).
DECISION_Z = 1.0


def _per_kernel_settings(trace: Trace, unit_settings) -> list[ClockSetting]:
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for unit, setting in unit_settings:
        for k in unit.kernel_indices:
            per_kernel[k] = setting
    return per_kernel


class Validator:
    """Measures whole iterations, once per distinct per-kernel schedule, and counts what that cost.

    Every schedule is read ``repeats`` times and judged on the mean. Two rules make those judgments hold up under
    noise (0.2 % in time and 0.5 % in energy per reading on the simulated GPU: a 1 % budget's edge is a few
    readings' noise wide):

    - The baseline, against which every schedule of every level is judged, is read ``baseline_repeats`` times:
      its error is common to all of those comparisons and does not average out over them.
    - A schedule measured against a time limit (``limit_s``) whose mean lies within DECISION_Z standard errors of
      it is read again, one reading at a time, until it does not or it has ``max_repeats`` readings (the standard
      error from the time readings' spread, pooled over every schedule read more than once). A schedule truly just
      inside the limit is then less often thrown away, and one truly over it less often kept, on one lucky
      reading of three.

    Args:
        trace, backend: the iteration and the GPU.
        repeats: readings averaged per schedule at first.
        switching: measure schedules as a phase-switching runtime realizes and requests them
            (freqopt.search.realize.Realizer, with kernel times from ``backend.kernel_times_s``) and with the GPU's
            clock-switch latency; False: the schedule as given, switching free (the ideal).
        log: where measurements are recorded and read back on resume (freqopt.search.journal); default an
            in-memory one.
        baseline_repeats: readings of the baseline (all defaults); default ``repeats``.
        max_repeats: readings at most of a schedule near a limit; default ``repeats`` (no more readings).
    """

    def __init__(self, trace: Trace, backend: Backend, repeats: int, *, switching: bool = False,
                 log: MeasurementLog | None = None, baseline_repeats: int | None = None,
                 max_repeats: int | None = None):  # fmt: skip
        import optuna

        self.trace, self.backend, self.repeats, self.switching = trace, backend, repeats, switching
        self.baseline_repeats = baseline_repeats or repeats
        self.max_repeats = max(max_repeats or repeats, repeats)
        self.realize = Realizer(trace, backend) if switching else (lambda schedule: schedule)
        self.log = log or MeasurementLog(optuna.create_study())
        self.cache: dict[tuple[ClockSetting, ...], Measurement] = {}
        self.samples: dict[tuple[ClockSetting, ...], list[Measurement]] = {}
        self._means: list[tuple[Measurement, tuple[ClockSetting, ...]]] = []  # every mean handed out, and its schedule
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    @classmethod
    def for_search(cls, trace: Trace, backend: Backend, config, *, log: MeasurementLog | None = None,
                   switching: bool | None = None) -> Validator:  # fmt: skip
        """The validator a search with ``config`` (a SearchConfig) uses: its validation_repeats,
        baseline_repeats and validation_max_repeats; its ``switching`` unless given."""
        return cls(trace, backend, config.validation_repeats,
                   switching=config.switching if switching is None else switching, log=log,
                   baseline_repeats=config.baseline_repeats, max_repeats=config.validation_max_repeats)  # fmt: skip

    def __call__(self, schedule: tuple[ClockSetting, ...], key: str = "schedule", *,
                 limit_s: float | None = None) -> Measurement:  # fmt: skip
        """The whole iteration measured with the per-kernel ``schedule`` (shape (K,)) as DVFSRuntime applies it:
        realized per phase, each switch requested one latency ahead (Realizer.requests), when ``switching``;
        ``limit_s``: see ``requests``."""
        schedule = tuple(schedule)
        return self.requests(self.realize.requests(schedule) if self.switching else schedule, key, limit_s=limit_s)

    def requests(self, schedule: tuple[ClockSetting, ...], key: str = "schedule", *,
                 limit_s: float | None = None) -> Measurement:  # fmt: skip
        """The whole iteration measured with ``schedule`` as the settings a runtime requests, unrealized (a
        schedule that is already realizable, such as freqopt.search.schedule's), switch latency included when
        ``switching``; shape (K,) in, per-iteration time_s and energy_j out (means over its readings).

        Args:
            limit_s: the time (s per iteration) the caller will hold the schedule to: while its mean is within
                DECISION_Z standard errors of it, read it again, up to ``max_repeats`` readings.
        """
        schedule = tuple(schedule)
        self._read(schedule, key, self.repeats)
        if limit_s is not None:
            while len(self.samples[schedule]) < self.max_repeats and self._undecided(schedule, limit_s):
                self._read(schedule, key, len(self.samples[schedule]) + 1)
        return self.cache[schedule]

    def _read(self, schedule: tuple[ClockSetting, ...], key: str, n: int) -> None:
        """Make sure ``schedule`` has at least ``n`` readings (each logged under its index, so a resumed search
        reads the same ones back) and that the cache holds their mean."""
        samples = self.samples.setdefault(schedule, [])
        if len(samples) >= n:
            return
        tag = digest((schedule, self.switching))
        for r in range(len(samples), n):
            samples.append(self.log.measure(tag, r, lambda i: self.backend.measure_schedule(
                self.trace.kernels, schedule, key=key, switching=self.switching, sample=i)))  # fmt: skip
            self.n_measurements += 1
            self.cost_gpu_s += samples[-1].cost_gpu_s
        self.cache[schedule] = Measurement(
            time_s=float(np.mean([m.time_s for m in samples])),
            energy_j=float(np.mean([m.energy_j for m in samples])),
            cost_gpu_s=float(np.sum([m.cost_gpu_s for m in samples])),
        )
        self._means.append((self.cache[schedule], schedule))

    def time_sd_rel(self) -> float:
        """The spread of one time reading, relative to its schedule's mean: the sample standard deviation pooled
        over every schedule read more than once (each weighted by its degrees of freedom); 0 before any was."""
        squares, dof = 0.0, 0
        for samples in self.samples.values():
            if len(samples) > 1:
                t = np.array([m.time_s for m in samples])
                squares += float(np.sum((t / t.mean() - 1.0) ** 2))
                dof += len(t) - 1
        return math.sqrt(squares / dof) if dof else 0.0

    def _undecided(self, schedule: tuple[ClockSetting, ...], limit_s: float) -> bool:
        """Whether ``schedule``'s mean time is within DECISION_Z standard errors of ``limit_s`` (the error of
        the difference: its own mean's and the baseline's, from which the limit was drawn)."""
        n = len(self.samples[schedule])
        n_base = len(self.samples.get(self._defaults(), ())) or self.baseline_repeats
        se_s = self.time_sd_rel() * limit_s * math.sqrt(1.0 / n + 1.0 / n_base)
        return abs(self.cache[schedule].time_s - limit_s) < DECISION_Z * se_s

    def _defaults(self) -> tuple[ClockSetting, ...]:
        return tuple([DEFAULT_SETTING] * len(self.trace))

    def schedule_of(self, measurement: Measurement) -> tuple[ClockSetting, ...] | None:
        """The schedule (as measured: realized, when switching) whose mean ``measurement`` is (the current one, or
        one handed out before the schedule was read again), or None."""
        return next((s for m, s in self._means if m is measurement), None)

    def switches_per_s(self, measurement: Measurement) -> float | None:
        """Clock switches per second a runtime asks the GPU for with the schedule behind ``measurement`` (one of this
        validator's means: schedule_of): its requested settings' changes per iteration (schedule.n_switches, read
        cyclically) over the measured iteration time. None for a schedule this validator did not measure, or one
        measured without switching (no runtime realizes it as given)."""
        schedule = self.schedule_of(measurement)
        if schedule is None or not self.switching or measurement.time_s <= 0:
            return None
        from freqopt.search.schedule import n_switches

        return n_switches(schedule) / measurement.time_s

    @functools.cached_property
    def _default_step_and_wait(self) -> tuple[Measurement, Measurement] | None:
        """The default step's noiseless figures and their waiting part (SimulatedGPU.step, waiting), computed once
        for every schedule they are compared with; None on a backend that cannot separate them (a real GPU)."""
        if getattr(self.backend, "waiting", None) is None:
            return None
        kernels = self.trace.kernels
        return self.backend.step(kernels), self.backend.waiting(kernels)

    def host_wait_pct(self) -> float | None:
        """The share (%) of the default step the GPU spends waiting for the host to issue kernels (noiseless:
        SimulatedGPU.waiting); None on a backend that cannot separate it (a real GPU)."""
        if self._default_step_and_wait is None:
            return None
        step, wait = self._default_step_and_wait
        return 100.0 * wait.time_s / step.time_s

    def waiting_saved_pct(self, measurement: Measurement) -> float | None:
        """The share (%) of the noiseless energy saving of the schedule behind ``measurement`` (one of this
        validator's means: schedule_of) that is saved while the GPU waits for the host: at a lower clock a waiting
        GPU draws less power at no cost in time, which is most of what a host-bound step can save (issue 35,
        item 4). From the simulated GPU's physics (SimulatedGPU.waiting, step); None on a real GPU, for a schedule
        this validator did not measure, or one that saves nothing."""
        schedule = self.schedule_of(measurement)
        if self._default_step_and_wait is None or schedule is None:
            return None
        default, default_wait = self._default_step_and_wait
        kernels, settings = self.trace.kernels, list(schedule)
        saved_j = default.energy_j - self.backend.step(kernels, settings, switching=self.switching).energy_j
        if saved_j <= 0:
            return None
        waiting = self.backend.waiting(kernels, settings, switching=self.switching)
        return 100.0 * (default_wait.energy_j - waiting.energy_j) / saved_j

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
        """The whole iteration at the defaults, read ``baseline_repeats`` times."""
        self._read(self._defaults(), "baseline", self.baseline_repeats)
        return self.cache[self._defaults()]

    def units(self, units: list[TuningUnit], settings: list[ClockSetting], key: str, *,
              limit_s: float | None = None) -> Measurement:  # fmt: skip
        """The iteration with each unit's kernels at its setting (``settings``: one per unit); see ``__call__``."""
        return self(tuple(_per_kernel_settings(self.trace, zip(units, settings))), key=key, limit_s=limit_s)
