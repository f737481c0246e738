"""The backend interface: measure a set of kernels at a clock setting, on a simulated or a real GPU."""

from __future__ import annotations

import abc
import math
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from freqopt.gpu.specs import GPUSpec

if TYPE_CHECKING:  # annotations only: the backends' protocol loads no PyTorch (fast errors)
    from freqopt.workload.kernels import Kernel

__all__ = ["ClockSetting", "DEFAULT_SETTING", "Measurement", "MeasurementProtocol", "Backend", "switch_latency"]


@dataclass(frozen=True, order=True)
class ClockSetting:
    """A GPU setting. None means the GPU's default: boost clocks (the firmware picks the SM clock under the power
    limit), the highest memory clock, the default power limit.

    Attributes:
        sm_clock_mhz: locked SM clock (nvmlDeviceSetGpuLockedClocks with min = max), MHz.
        mem_clock_mhz: locked memory clock (nvmlDeviceSetMemoryLockedClocks), MHz.
        power_limit_w: power limit (nvmlDeviceSetPowerManagementLimit), W.
    """

    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    power_limit_w: float | None = None

    @classmethod
    def of_entry(cls, entry: dict) -> ClockSetting:
        """The setting a clock table entry (freqopt.tables), or one option of an entry's front, holds: its
        ``sm_clock_mhz``, ``mem_clock_mhz`` and ``power_limit_w``, each None where the default is kept."""
        return cls(entry["sm_clock_mhz"], entry["mem_clock_mhz"], entry["power_limit_w"])

    def check_supported(self, spec: GPUSpec) -> None:
        """Raise unless GPU type ``spec`` supports this setting: its clock pair (None: the highest clock) and its
        power limit (GPUSpec.check_clocks, check_power_limit).

        Raises:
            InvalidSettingError: the message lists the supported range.
        """
        if self.sm_clock_mhz is not None or self.mem_clock_mhz is not None:
            spec.check_clocks(*spec.resolve_clocks(self.sm_clock_mhz, self.mem_clock_mhz))
        if self.power_limit_w is not None:
            spec.check_power_limit(self.power_limit_w)

    def label(self) -> str:
        parts = []
        if self.sm_clock_mhz is not None:
            parts.append(f"SM {self.sm_clock_mhz} MHz")
        if self.mem_clock_mhz is not None:
            parts.append(f"mem {self.mem_clock_mhz} MHz")
        if self.power_limit_w is not None:
            parts.append(f"{self.power_limit_w:g} W")
        return ", ".join(parts) or "default"


DEFAULT_SETTING = ClockSetting()


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one repetition of the measured kernels (per training iteration).

    Attributes:
        time_s: time of one repetition, s (CUDA events on a real GPU).
        energy_j: energy of one repetition, J (nvmlDeviceGetTotalEnergyConsumption delta, mJ -> J).
        cost_gpu_s: GPU time the measurement took, warm-up included, s.
        sm_clock_mhz: time-weighted mean SM clock the GPU actually ran (nvmlDeviceGetClockInfo during the window;
            below a locked clock when the power limit throttled it), MHz; None if unknown.
        time_upper_s: for a mean of readings judged against a slowdown budget, the upper confidence bound of its
            time (s) at the validator's confidence, from readings paired with the default's
            (freqopt.search.validate.Validator); None where none was computed (a single reading, a sweep).
        power_limit_met: False where the power limit could not be held: even the lowest supported SM clock draws
            more, so the firmware runs there, above the limit, and ``avg_power_w`` exceeds it (Zeus's A40 averages
            107 W under a 100 W limit: You et al., NSDI'23, shared/calibration/zeus); True where the simulated
            firmware held it; None where not known (a reading from NVML: compare ``avg_power_w`` with the limit).
    """

    time_s: float
    energy_j: float
    cost_gpu_s: float = 0.0
    sm_clock_mhz: float | None = None
    time_upper_s: float | None = None
    power_limit_met: bool | None = None

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.time_s

    @property
    def time_bound_s(self) -> float:
        """The time a slowdown budget holds this measurement to, s: ``time_upper_s`` where it was computed, else
        ``time_s`` (no bound known: the mean)."""
        return self.time_s if self.time_upper_s is None else self.time_upper_s

    def __repr__(self) -> str:
        # The mean clock is a time-weighted average (884.9999999999999 for a steady 885 MHz): shown to 0.1 MHz.
        clock = None if self.sm_clock_mhz is None else f"{round(self.sm_clock_mhz, 1):g}"
        upper = "" if self.time_upper_s is None else f", time_upper_s={self.time_upper_s!r}"
        unmet = ", power_limit_met=False" if self.power_limit_met is False else ""
        return (f"Measurement(time_s={self.time_s!r}, energy_j={self.energy_j!r}, cost_gpu_s={self.cost_gpu_s!r}, "
                f"sm_clock_mhz={clock}{upper}{unmet})")  # fmt: skip


@dataclass(frozen=True)
class MeasurementProtocol:
    """How one measurement runs: replay the kernels in a loop, settle, then read a window.

    Spaan et al. 2026 warmed up 25 s and measured 5 s per setting; the GPU is kept warm between settings here, so
    a short settle after each clock change suffices and the window only has to span enough energy-counter updates.

    Attributes:
        warmup_s: replay time after a setting change before the window opens, s.
        min_window_s: shortest measured window, s.
        min_counter_updates: the window spans at least this many energy-counter updates.
    """

    warmup_s: float = 0.5
    min_window_s: float = 0.5
    min_counter_updates: int = 5

    def window_s(self, counter_period_s: float) -> float:
        """The shortest window read, s: ``min_window_s``, or ``min_counter_updates`` counter periods if longer."""
        return max(self.min_window_s, self.min_counter_updates * counter_period_s)

    def cost_gpu_s(self, counter_period_s: float, step_s: float | None = None) -> float:
        """The GPU-seconds one measurement takes, s.

        A measurement replays whole steps (or whole replay loops) of ``step_s`` each: through the warm-up until
        ``warmup_s`` has passed, then through the window until ``window_s`` has (as NVMLBackend._loop and
        _timed_window run them), so each lasts a whole number of steps, at least one. A 508 s step's measurement
        costs two steps, 1,016 s, not the 1 s of a short one. ``step_s`` None or 0: the
        protocol's fixed durations (a step much shorter than them).
        """
        warmup_s, window_s = self.warmup_s, self.window_s(counter_period_s)
        if not step_s or step_s <= 0:
            return warmup_s + window_s
        return step_s * (max(1, math.ceil(warmup_s / step_s - 1e-9)) + max(1, math.ceil(window_s / step_s - 1e-9)))


class Backend(abc.ABC):
    """One GPU: what it supports, measurements of kernels at a setting, the setting it is held at, and its energy
    counter.

    Use as a context manager (or call ``close()``): on exit the GPU is returned to the state it was found in.

    Attributes:
        name: the backend's name, as ``freqopt.gpu.backends.get_backend`` takes it: "sim" or "nvml".
        simulated: True where measurements come from a model of the GPU, not from the GPU running the job (so a
            training job's own steps cannot be timed or metered on it; the runtime asks the model instead).
        spec: the GPU type.
        protocol: warm-up and window of each measurement.
        counter_period_s: the energy counter's update period once detected, s; None until then.
    """

    name: str
    simulated: bool = False
    spec: GPUSpec
    protocol: MeasurementProtocol
    counter_period_s: float | None = None

    @abc.abstractmethod
    def apply(self, setting: ClockSetting) -> None:
        """Put the GPU at ``setting`` and keep it there until the next ``apply`` or ``close`` (None fields: the
        GPU's defaults).

        Raises:
            GPUPermissionError: a real GPU that may not be changed (read-only, or no permission).
            InvalidSettingError: clocks or a power limit the GPU does not support.
        """

    @abc.abstractmethod
    def energy_j(self) -> float:
        """The GPU's cumulative energy counter, J: only differences between two readings mean anything."""

    def close(self) -> None:
        """Return the GPU to the state it was found in (a real GPU); nothing for a simulated one."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abc.abstractmethod
    def measure(self, kernels: Sequence[Kernel], setting: ClockSetting, *, key: str = "",
                sample: int | None = None) -> Measurement:  # fmt: skip
        """Measure ``kernels`` (replayed in order, in a loop) at ``setting``.

        Args:
            kernels: the kernels of one repetition (a tuning unit's share of one iteration).
            setting: clocks and power limit to measure at.
            key: a name for the kernel set (the tuning unit), so that noise is reproducible per unit.
            sample: which measurement of (key, setting) this is, counting from 0. A simulated GPU draws its noise
                from it, so a search resumed from its storage (which skips the samples it already has) draws the
                same noise as an uninterrupted one; None counts this backend's own calls. A real GPU ignores it.

        Returns:
            Time and energy per repetition, and the GPU-seconds spent.
        """

    @abc.abstractmethod
    def kernel_times_s(self, kernels: Sequence[Kernel], setting: ClockSetting) -> np.ndarray:
        """Each kernel's time at ``setting`` when the kernels run in a loop, shape (K,), s: what a runtime weighs
        its kernels by when it picks one setting per phase (freqopt.search.realize). Each backend's docstring says
        where its times come from.

        Raises:
            InvalidSettingError: clocks or a power limit the GPU does not support.
        """

    @abc.abstractmethod
    def measure_schedule(
        self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, key: str = "", switching: bool = False,
        sample: int | None = None,
    ) -> Measurement:
        """Measure a whole iteration with one setting per kernel (clock switches where consecutive settings differ).
        ``sample``: as in measure, counted per (key, schedule, switching).

        ``switching``: include the cost of switching clocks (a real GPU always does; a simulated one only when asked,
        so that the ideal, free-switching figure can be computed too)."""


@contextlib.contextmanager
def switch_latency(backend: Backend, switch_s: float | None) -> Iterator[Backend]:
    """``backend`` with its GPU type's clock-switch latency replaced by ``switch_s`` (s; GPUSpec.with_switch_latency)
    for the block, and its own GPU type given back after it, however the block ends (a Backend a caller passed in
    keeps its own). None changes nothing: the GPU file's latency stands."""
    found = backend.spec
    if switch_s is not None:
        backend.spec = found.with_switch_latency(switch_s)
    try:
        yield backend
    finally:
        backend.spec = found
