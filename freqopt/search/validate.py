"""Validation: whole iterations measured with a schedule, once per distinct per-kernel schedule, read as often as a
decision against the slowdown limit needs, each reading of a schedule held to the limit paired with a reading of the
defaults taken just before it."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from freqopt.budget import DEFAULT_CONFIDENCE, check_confidence
from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.workload.kernels import Trace
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.realize import Realizer
from freqopt.search.units import TuningUnit

__all__ = ["DEFAULT_CONFIDENCE", "PairedReadings", "Validator", "check_confidence"]

# How many standard errors above the limit a schedule's mean may lie and still be read again (it may yet come in);
# with its upper bound over the limit and its mean below that, it is read again, one pair at a time, up to
# ``max_repeats`` (a sequential test, Wald 1945: readings are spent only where the answer is still in doubt).
DECISION_Z = 1.0


class PairedReadings:
    """Time readings of schedules, each paired with a reading of the defaults taken just before it, and the upper
    confidence bound of a schedule's slowdown they give.

    Each pair gives d = ln(t_schedule / t_default); drift common to both readings (temperature, a neighbour's load)
    cancels in d. A schedule's slowdown bound at ``confidence`` is exp(mean(d) + q * s / sqrt(n)) - 1, where s is the
    standard deviation of d pooled over every schedule with two pairs or more (the readings' relative spread is
    taken to be the same for every schedule: one GPU, one protocol) and q Student's t quantile at ``confidence`` with
    the pooled degrees of freedom (a one-sided t interval on paired differences: Student 1908; Wilks, Statistical
    Methods in the Atmospheric Sciences, 5.2.3). Before any schedule has two pairs, the spread of the defaults' own
    readings stands in, times sqrt(2) (two independent readings in each d).
    """

    def __init__(self, confidence: float = DEFAULT_CONFIDENCE):
        self.confidence = check_confidence(confidence)
        self.logs: dict[object, list[float]] = {}

    def add(self, key, schedule_time_s: float, default_time_s: float) -> None:
        """One pair: a reading of ``key``'s schedule and the defaults' reading just before it, s."""
        self.logs.setdefault(key, []).append(math.log(schedule_time_s / default_time_s))

    def read(self, key, samples: list, pairs: list, n: int, *, paired: bool, take, take_default) -> None:
        """Extend ``samples`` (readings of ``key``'s schedule) to at least ``n`` and, with ``paired``, ``pairs``
        (readings of the defaults) to as many, each reading of the defaults taken just before the schedule's it
        pairs with, every complete pair added. ``take(r)`` and ``take_default(r)`` take the r-th reading (a
        Measurement) of the schedule and of the defaults."""
        for r in range(max(n, len(samples))):
            if paired and r >= len(pairs):  # the defaults first, then the schedule: each pair back to back
                pairs.append(take_default(r))
                if r < len(samples):
                    self.add(key, samples[r].time_s, pairs[r].time_s)
            if r >= len(samples):
                samples.append(take(r))
                if paired:
                    self.add(key, samples[r].time_s, pairs[r].time_s)

    def upper_time_s(self, key, mean_s: float, baseline_s: float, default_times_s=()) -> float:
        """The upper confidence bound of the time of ``key``'s schedule, s: ``baseline_s`` (the defaults' mean) x the
        bound of its slowdown ratio, never below its own mean ``mean_s`` (the figure its slowdown is reported by)."""
        return max(mean_s, baseline_s * self.bound(key, default_times_s))

    def undecided(self, key, ratio_limit: float, default_times_s=()) -> bool:
        """Whether more pairs may yet bring ``key``'s bound inside ``ratio_limit`` (a limit on t_schedule /
        t_default): its bound is over it while its paired mean is under it plus DECISION_Z standard errors."""
        return (self.bound(key, default_times_s) > ratio_limit
                and self.bound(key, default_times_s, z=-DECISION_Z) < ratio_limit)  # fmt: skip

    def spread(self, default_times_s=()) -> tuple[float, int]:
        """(s, degrees of freedom): the pooled standard deviation of d, or sqrt(2) x that of ln(default_times_s)
        where no schedule has two pairs yet; (0, 0) where neither is known."""
        squares, dof = 0.0, 0
        for d in self.logs.values():
            if len(d) > 1:
                squares += float(np.sum((np.asarray(d) - np.mean(d)) ** 2))
                dof += len(d) - 1
        if dof:
            return math.sqrt(squares / dof), dof
        if len(default_times_s) > 1:
            return math.sqrt(2.0) * float(np.std(np.log(default_times_s), ddof=1)), len(default_times_s) - 1
        return 0.0, 0

    def bound(self, key, default_times_s=(), *, z: float | None = None) -> float:
        """The upper confidence bound of ``key``'s slowdown ratio t_schedule / t_default (at ``confidence``; with
        ``z``, that many standard errors above the mean instead, negative for below); inf where no spread is
        known."""
        from scipy.special import stdtrit  # Student's t quantile: what scipy.stats.t.ppf computes, without the
        # half second of importing scipy.stats

        d = self.logs[key]
        s, dof = self.spread(default_times_s)
        if z is None:
            if self.confidence == 0.5:
                z = 0.0
            elif not dof:
                return math.inf
            else:
                z = float(stdtrit(dof, self.confidence))
        return math.exp(float(np.mean(d)) + z * s / math.sqrt(len(d)))


def per_kernel_settings(trace: Trace, unit_settings) -> list[ClockSetting]:
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for unit, setting in unit_settings:
        for k in unit.kernel_indices:
            per_kernel[k] = setting
    return per_kernel


class Validator:
    """Measures whole iterations, once per distinct per-kernel schedule, and counts what that cost.

    Every schedule is read ``repeats`` times and its mean reported. A schedule held to a slowdown budget (measured
    with ``limit_s``) is held to it at a stated confidence:

    - Each of its readings is paired with a reading of the defaults taken just before it (candidate and default
      alternated, so that drift cancels), and it meets the limit only if the upper confidence bound of its time
      (PairedReadings.bound, at ``confidence``) does: its mean's ``time_upper_s``. Noise is 0.2 % in time and
      0.5 % in energy per reading on the simulated GPU, so a 1 % budget's edge is a few readings' noise wide: judged
      on their means, schedules chosen as the ones nearest the limit ended up to 0.09 points over it.
    - While its bound is over the limit and its mean under the limit plus DECISION_Z standard errors, it is read
      again, one pair at a time, up to ``max_repeats`` readings: a schedule truly inside the limit is less often
      thrown away for want of readings.
    - The baseline, against which every schedule's reported slowdown and saving are taken, is read
      ``baseline_repeats`` times (its error is common to all of those figures and does not average out over them);
      the paired readings of the defaults are kept apart from it and serve the bound alone.

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
        confidence: the one-sided confidence level of the bound, in [0.5, 1) (DEFAULT_CONFIDENCE; 0.5: the paired
            mean alone).
        baseline_from: another validator of the same trace and GPU whose baseline this one's figures and bounds are
            taken against (a free-switching validator beside the search's: one baseline for both), else its own.

    Raises:
        InvalidSettingError: ``confidence`` outside [0.5, 1).
    """

    def __init__(self, trace: Trace, backend: Backend, repeats: int, *, switching: bool = False,
                 log: MeasurementLog | None = None, baseline_repeats: int | None = None,
                 max_repeats: int | None = None, confidence: float = DEFAULT_CONFIDENCE,
                 baseline_from: Validator | None = None):  # fmt: skip
        import optuna

        self.trace, self.backend, self.repeats, self.switching = trace, backend, repeats, switching
        self.baseline_repeats = baseline_repeats or repeats
        self.max_repeats = max(max_repeats or repeats, repeats)
        self.paired = PairedReadings(confidence)
        self.baseline_from = baseline_from
        self.realize = Realizer(trace, backend) if switching else (lambda schedule: schedule)
        self.log = log or MeasurementLog(optuna.create_study())
        self.cache: dict[tuple[ClockSetting, ...], Measurement] = {}
        self.samples: dict[tuple[ClockSetting, ...], list[Measurement]] = {}
        self.pairs: dict[tuple[ClockSetting, ...], list[Measurement]] = {}  # the defaults' readings paired
        self._means: list[tuple[Measurement, tuple[ClockSetting, ...]]] = []  # every mean handed out, and its schedule
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    @property
    def confidence(self) -> float:
        """The one-sided confidence level of every bound this validator gives."""
        return self.paired.confidence

    @classmethod
    def for_search(cls, trace: Trace, backend: Backend, config, *, log: MeasurementLog | None = None,
                   switching: bool | None = None, baseline_from: Validator | None = None) -> Validator:  # fmt: skip
        """The validator a search with ``config`` (a SearchConfig) uses: its validation_repeats,
        baseline_repeats, validation_max_repeats and confidence; its ``switching`` unless given."""
        return cls(trace, backend, config.validation_repeats,
                   switching=config.switching if switching is None else switching, log=log,
                   baseline_repeats=config.baseline_repeats, max_repeats=config.validation_max_repeats,
                   confidence=config.confidence, baseline_from=baseline_from)  # fmt: skip

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
            limit_s: the time (s per iteration) the caller will hold the schedule to: each reading is paired with
                one of the defaults, the mean returned carries the upper confidence bound of its time
                (``time_upper_s``; compare ``time_bound_s`` with the limit), and while the bound is over the limit
                and the mean under it plus DECISION_Z standard errors the schedule is read again, up to
                ``max_repeats`` readings.
        """
        schedule = tuple(schedule)
        if schedule == self._defaults() and self.baseline_from is not None:
            return self.baseline()  # one baseline for both validators
        if limit_s is None or schedule == self._defaults():
            self._read(schedule, key, self.repeats)
            return self.cache[schedule]
        self._read(schedule, key, self.repeats, paired=True)
        while len(self.samples[schedule]) < self.max_repeats and self._undecided(schedule, limit_s):
            self._read(schedule, key, len(self.samples[schedule]) + 1, paired=True)
        return self._bounded(schedule)

    def _read(self, schedule: tuple[ClockSetting, ...], key: str, n: int, *, paired: bool = False,
              fresh: bool = False) -> None:  # fmt: skip
        """Make sure ``schedule`` has at least ``n`` readings (each logged under its index, so a resumed search
        reads the same ones back), with ``paired`` each after a reading of the defaults of its own, and that the
        cache holds their mean. ``fresh``: the confirmation's readings (``confirm``), kept apart under their own
        log tag and noise key."""
        ident = ("confirm", schedule) if fresh else schedule
        samples = self.samples.setdefault(ident, [])
        pairs = self.pairs.setdefault(ident, [])
        if len(samples) >= n and (not paired or len(pairs) >= len(samples)):
            return
        tag = ("confirm-" if fresh else "") + digest((schedule, self.switching))
        key = f"{key}-confirm" if fresh else key
        self.paired.read(ident, samples, pairs, n, paired=paired, take=lambda r: self._take(tag, r, schedule, key),
                         take_default=lambda r: self._take(f"paired-{tag}", r, self._defaults(), f"paired-{tag}"))
        self.cache[ident] = Measurement(
            time_s=float(np.mean([m.time_s for m in samples])),
            energy_j=float(np.mean([m.energy_j for m in samples])),
            cost_gpu_s=float(np.sum([m.cost_gpu_s for m in samples + pairs])),
        )
        self._means.append((self.cache[ident], schedule))

    def _take(self, tag: str, r: int, schedule: tuple[ClockSetting, ...], key: str) -> Measurement:
        """The ``r``-th reading of ``schedule`` under the log's ``tag`` (read back where logged), counted."""
        m = self.log.measure(tag, r, lambda i: self.backend.measure_schedule(
            self.trace.kernels, schedule, key=key, switching=self.switching, sample=i))  # fmt: skip
        self.n_measurements += 1
        self.cost_gpu_s += m.cost_gpu_s
        return m

    def _bounded(self, ident) -> Measurement:
        """The mean of ``ident``'s readings (a schedule, or ("confirm", schedule)) with ``time_upper_s``: the
        baseline's time x the upper bound of its paired slowdown ratio, and never below its mean (the figure its
        slowdown is reported by)."""
        mean = self.cache[ident]
        upper_s = self.paired.upper_time_s(ident, mean.time_s, self.baseline().time_s, self._default_times())
        bounded = dataclasses.replace(mean, time_upper_s=upper_s)
        self.cache[ident] = bounded
        self._means.append((bounded, ident[1] if ident and ident[0] == "confirm" else ident))
        return bounded

    def confirm(self, measurement: Measurement, key: str = "confirm") -> Measurement:
        """The schedule behind ``measurement`` (one of this validator's means: schedule_of) read again afresh:
        ``max_repeats`` new readings (a fixed number: a test that stops when it likes what it sees holds its
        confidence less well), each paired with a new one of the defaults, under their own log tag and noise key;
        their mean, with the upper confidence bound of its time from them alone (``time_upper_s``).

        A schedule chosen as the least energy among several that met the limit on their readings was chosen
        partly for its luck: its readings are the ones that came out fast and frugal (the winner's curse; Smith
        and Winkler 2006, Management Science 52(3)). Readings taken after the choice are independent of it, so
        their bound holds at ``confidence`` for the schedule chosen, and their mean is an unbiased figure of its
        saving.

        Raises:
            ValueError: ``measurement`` is not one of this validator's means.
        """
        schedule = self.schedule_of(measurement)
        if schedule is None:
            raise ValueError("confirm takes a measurement this validator handed out")
        if schedule == self._defaults():
            return self.baseline()
        self._read(schedule, key, self.max_repeats, paired=True, fresh=True)
        return self._bounded(("confirm", schedule))

    def _default_times(self) -> list[float]:
        if self.baseline_from is not None:
            return self.baseline_from._default_times()
        return [m.time_s for m in self.samples.get(self._defaults(), ())]

    def slowdown_bound(self, measurement: Measurement) -> float | None:
        """The upper confidence bound (fraction) of the slowdown of the schedule behind ``measurement`` against the
        baseline, at ``confidence``; None for a mean measured without a limit (no bound computed)."""
        if measurement.time_upper_s is None:
            return None
        return measurement.time_upper_s / self.baseline().time_s - 1.0

    def _undecided(self, schedule: tuple[ClockSetting, ...], limit_s: float) -> bool:
        """Whether more readings may yet bring ``schedule``'s bound inside ``limit_s`` (PairedReadings.undecided)."""
        return self.paired.undecided(schedule, limit_s / self.baseline().time_s, self._default_times())

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

    def accepts(self, measurement: Measurement, limit_s: float, energy_j: float, *, fresh: bool = False) -> bool:
        """The search's acceptance rule, the one the allocator, a one-setting level's refinement, the oracle and a
        transferred table's re-allocation all apply: the upper confidence bound of the time of the schedule behind
        ``measurement`` (Measurement.time_bound_s, s) within ``limit_s`` (s), its energy below ``energy_j`` (J: the
        baseline's, or that of the choice it would replace) and, on its first readings, its clock switches within
        what one runtime thread can issue (deliverable). ``fresh``: the readings are a confirmation's (confirm) of a
        schedule judged deliverable when first read."""
        return (measurement.time_bound_s <= limit_s and measurement.energy_j < energy_j
                and (fresh or self.deliverable(measurement)))  # fmt: skip

    def deliverable(self, measurement: Measurement) -> bool:
        """Whether one runtime thread can issue the clock switches the schedule behind ``measurement`` asks for:
        its switches per second (switches_per_s) at most the GPU's GPUSpec.max_switches_per_s (each NVML set call
        blocks its caller, one at a time). A schedule that asks for more would not run as it was
        measured, so no level keeps one. True where nothing switches, or the GPU states no limit."""
        return not self.backend.spec.over_switch_limit(self.switches_per_s(measurement))

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
        GPU draws less power at no cost in time, which is most of what a host-bound step can save.
        From the simulated GPU's physics (SimulatedGPU.waiting, step); None on a real GPU, for a schedule
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

    @functools.cached_property
    def _flat_waiting_gpu(self):
        """A noiseless simulated GPU of the backend's type whose waiting power does not fall with the clock (the
        range's flat end: GPUSpec.with_waiting_clock_scale(0)); None on a backend that cannot separate waiting."""
        if self._default_step_and_wait is None:
            return None
        from freqopt.gpu.backends.simulated import SimulatedGPU
        from freqopt.gpu.specs import WAITING_CLOCK_SCALES

        return SimulatedGPU(self.backend.spec.with_waiting_clock_scale(WAITING_CLOCK_SCALES["flat"]), noise=False)

    def waiting_range_saved_pct(self, measurement: Measurement) -> tuple[float, float] | None:
        """The noiseless energy saving (%) of the schedule behind ``measurement`` (one of this validator's means:
        schedule_of) against the defaults at the two ends of the waiting GPU's power range
        (freqopt.gpu.specs.WaitingPower): (waiting power flat in the clock, waiting power as modelled: the
        backend's own). A host-bound step's saving is mostly the waiting GPU's power, which no measurement pins
        at a locked low clock. None on a real GPU or for a schedule this validator did not measure."""
        schedule = self.schedule_of(measurement)
        flat = self._flat_waiting_gpu
        if flat is None or schedule is None:
            return None
        kernels, settings = self.trace.kernels, list(schedule)
        ends = []
        for gpu in (flat, self.backend):
            default = gpu.step(kernels).energy_j
            ends.append(100.0 * (1.0 - gpu.step(kernels, settings, switching=self.switching).energy_j / default))
        return ends[0], ends[1]

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
        """The whole iteration at the defaults, read ``baseline_repeats`` times (``baseline_from``'s, where
        given)."""
        if self.baseline_from is not None:
            return self.baseline_from.baseline()
        self._read(self._defaults(), "baseline", self.baseline_repeats)
        return self.cache[self._defaults()]

    def units(self, units: list[TuningUnit], settings: list[ClockSetting], key: str, *,
              limit_s: float | None = None) -> Measurement:  # fmt: skip
        """The iteration with each unit's kernels at its setting (``settings``: one per unit); see ``__call__``."""
        return self(tuple(per_kernel_settings(self.trace, zip(units, settings))), key=key, limit_s=limit_s)
