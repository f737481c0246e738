"""The real GPU backend: kernels replayed on the GPU (freqopt.gpu.replay), time by CUDA events, energy by the NVML
counter's delta over a window spanning several counter updates, clocks and power limit set through NVML and
restored (freqopt.gpu.nvml.GPUStateGuard).

A measurement: apply the setting (nothing, if it is already applied), replay the kernels in a loop for the
protocol's warm-up, then for a window of at least ``min_counter_updates`` counter periods; time per repetition is
the window's CUDA-event time over the repetitions, energy per repetition the counter's delta over them. The
counter's update period is detected during the first warm-up (freqopt.gpu.replay.detect_counter_period's method),
not assumed. In read-only mode only the GPU's current settings can be measured: any other setting is refused.

Kernels run as themselves (freqopt.gpu.replay); those that cannot (collectives, which need other ranks, or an operator
that fails) run as copies of their bytes, and the backend logs a warning naming them, once per operator.

The memory clock: a GPU that lists more than one is asked, when the backend opens it, to lock its memory clock where
it runs anyway (its highest) and to release it again. A GPU that refuses (NVML_ERROR_NOT_SUPPORTED: before Ampere,
and Hopper, whose memory clock locks only deferred to the GPU's next initialisation) is measured at that one memory
clock, per job: ``spec.mem_clocks_mhz`` is that clock alone and ``spec.mem_clock_runtime`` False, and one warning says
why. Nothing is left changed either way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.errors import GPUPermissionError
from freqopt.workload.kernels import Kernel
from freqopt.gpu.nvml import GPUStateGuard, NVMLDevice, NVMLNotSupportedError
from freqopt.gpu.replay import ReplayPlan, build_replay

__all__ = ["NVMLBackend", "COUNTER_DETECTION_S"]

logger = logging.getLogger(__name__)

COUNTER_DETECTION_S = 1.0  # polling time to find the counter's period: 10 updates at the slowest documented 100 ms
KERNEL_TIMING_REPEATS = 5  # timed replays of each distinct kernel in kernel_times_s, after one untimed warm-up


class NVMLBackend(Backend):
    """One real GPU.

    Args:
        device: the GPU (freqopt.gpu.nvml.open_devices); read-only devices measure at their current settings only.
        torch_device: where kernels are replayed ("cuda:0" is the first visible GPU); "cpu" only in tests.
        protocol: warm-up and window of each measurement.

    Use as a context manager (or call ``close()``): it restores the GPU on exit, exception and signals.

    Attributes:
        spec: the GPU's type with the clock lists the device reports; on a GPU that refuses run-time memory-clock
            locks, one memory clock and ``mem_clock_runtime`` False (per job).
        copied_ops: kernel name -> why the replay ran it as a copy of its bytes, for every such operator so far
            (each logged once, as a warning of the ``freqopt.gpu.backends.nvml`` logger).
        mem_clock_refusal: why the memory clock is per job on this GPU (NVML's refusal), or None.
    """

    name = "nvml"

    def __init__(self, device: NVMLDevice, *, torch_device: str = "cuda:0", protocol: MeasurementProtocol | None = None):
        self.device = device
        self.spec = device.spec()
        self.torch_device = torch_device
        self.protocol = protocol or MeasurementProtocol()
        self.counter_period_s: float | None = None
        self.guard = GPUStateGuard(device)
        self._applied: ClockSetting | None = None
        self.copied_ops: dict[str, str] = {}  # kernel name -> why the replay runs it as a copy of its bytes
        self._kernel_time_s: dict[tuple[str, ClockSetting], float] = {}  # (Kernel.signature, setting) -> s
        self.mem_clock_refusal: str | None = None
        self.guard.__enter__()
        if not device.read_only:
            self._check_permission()
            self._find_memory_clock_mode()

    def _check_permission(self) -> None:
        """Fail now, before any work, if NVML will refuse changes: set the power limit to the value it has (which
        changes nothing; the guard has recorded it first)."""
        try:
            self.guard.before_change()
            self.device.set_power_limit_w(self.device.power_limit_w())
        except GPUPermissionError:
            self.guard.discard()  # refused: nothing changed, and no state file left for freqopt reset to fail on
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _find_memory_clock_mode(self) -> None:
        """Whether this GPU locks its memory clock while a job runs: lock it at the clock it runs at anyway (the
        highest; nothing changes) and release it. A refusal (NVMLNotSupportedError) makes the memory clock one per
        job: ``spec`` keeps that clock alone, with ``mem_clock_runtime`` False, and one warning says why. Acceptance
        makes it a run-time setting even where the GPU's file reads per job (the cautious reading, for when nothing
        is known: here the driver has answered)."""
        spec = self.spec
        if len(spec.mem_clocks_mhz) < 2:
            return  # one memory clock: nothing to lock
        held = spec.max_mem_clock_mhz
        try:
            self.device.lock_mem_clock(held)
        except NVMLNotSupportedError as e:
            self.mem_clock_refusal = str(e)
            self.spec = dataclasses.replace(
                spec, mem_clocks_mhz=(held,), mem_clock_lock="per-job",
                max_sm_clock_for_mem_mhz={m: f for m, f in spec.max_sm_clock_for_mem_mhz.items() if m == held})
            logger.warning("GPU %d (%s) refused a run-time memory-clock lock (%s): its memory clock is one setting per "
                           "job, so it is measured at %d MHz only; another takes nvidia-smi "
                           "--lock-memory-clocks-deferred and a driver reload before the search", self.device.index,
                           self.device.name, e, held)  # fmt: skip
            return
        try:
            self.device.reset_mem_clock()
        except BaseException:
            self.close()  # the guard unlocks what it can and puts the rest back
            raise
        if not spec.mem_clock_runtime:
            logger.info("GPU %d (%s) accepted a run-time memory-clock lock, although search_spaces/%s.toml reads "
                        "%s: the memory clock is searched per phase", self.device.index, self.device.name, spec.name,
                        spec.mem_clock_lock)  # fmt: skip
        self.spec = dataclasses.replace(spec, mem_clock_lock="runtime")

    def close(self) -> None:
        """Restore the GPU's clocks and power limit as the guard found them (freqopt.gpu.nvml.GPUStateGuard)."""
        self.guard.__exit__(None, None, None)

    def energy_j(self) -> float:
        """The GPU's energy counter, J: nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded) / 1000."""
        return self.device.energy_j()

    # -- settings ------------------------------------------------------------------------------------------------
    def apply(self, setting: ClockSetting) -> None:
        """Put the GPU at ``setting`` (None fields: the default: unlocked clocks, the default power limit).

        Raises:
            GPUPermissionError: read-only device and a setting other than the default; or no permission.
            InvalidSettingError: clocks or a power limit the GPU does not support.
        """
        if setting == self._applied:
            return
        if self.device.read_only:
            if setting != DEFAULT_SETTING:
                raise GPUPermissionError(f"read-only: cannot measure at {setting.label()}; only at the GPU's current "
                                         "settings (open the GPU without read-only to search)")  # fmt: skip
            self._applied = setting
            return
        spec = self.spec
        setting.check_supported(spec)
        self.guard.before_change()
        previous = self._applied or ClockSetting(-1, -1, -1.0)  # unknown: apply every field
        if setting.sm_clock_mhz != previous.sm_clock_mhz:
            if setting.sm_clock_mhz is None:
                self.device.reset_sm_clock()
            else:
                self.device.lock_sm_clock(setting.sm_clock_mhz)
        if setting.mem_clock_mhz != previous.mem_clock_mhz and len(spec.mem_clocks_mhz) > 1:
            if setting.mem_clock_mhz is None:
                self.device.reset_mem_clock()
            else:
                self.device.lock_mem_clock(setting.mem_clock_mhz)
        if setting.power_limit_w != previous.power_limit_w:
            self.device.set_power_limit_w(spec.power_limit_default_w if setting.power_limit_w is None
                                          else setting.power_limit_w)  # fmt: skip
        self._applied = setting

    # -- measurement ---------------------------------------------------------------------------------------------
    def _replay(self, kernels: Sequence[Kernel], cache: dict | None = None) -> ReplayPlan:
        """The kernels' replay plan on this backend's device (input tensors shared through ``cache``); warns (once
        per operator, through logging) about the operators it runs as copies of their bytes, not as themselves."""
        plan = build_replay(kernels, self.torch_device, cache=cache)
        new = {name: reason for name, reason in plan.copies().items() if name not in self.copied_ops}
        if new:
            self.copied_ops.update(new)
            logger.warning("replaying %d operator(s) as device-to-device copies of their traced bytes, not as "
                           "themselves: %s", len(new), "; ".join(f"{n} ({r})" for n, r in new.items()))  # fmt: skip
        return plan

    def _sync(self) -> None:
        import torch

        if self.torch_device.startswith("cuda"):
            torch.cuda.synchronize(self.torch_device)

    def _loop(self, plan, seconds: float) -> float:
        """Replay ``plan`` until ``seconds`` have passed; returns the time spent, s."""
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            plan()
            self._sync()
        return time.perf_counter() - start

    def _timed_window(self, plan, seconds: float) -> tuple[int, float, float]:
        """(repetitions, time s by CUDA events, energy J by the counter) over a window of ``seconds``."""
        import torch

        cuda = self.torch_device.startswith("cuda")
        self._sync()
        e0 = self.device.energy_j()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        reps = 0
        while time.perf_counter() - t0 < seconds:
            plan()
            reps += 1
            if reps % 8 == 0:
                self._sync()
        if cuda:
            end.record()
        self._sync()
        wall = time.perf_counter() - t0
        elapsed = start.elapsed_time(end) / 1000.0 if cuda else wall
        return reps, elapsed, self.device.energy_j() - e0

    def _detect_counter_period(self, plan) -> tuple[float, float]:
        """Poll the energy counter from a thread while the GPU replays ``plan`` (it must be busy for the counter to
        move at every update); falls back to the GPU type's documented period if it barely moved.

        Returns:
            (the counter's period, the seconds the replay ran meanwhile), s.
        """
        import threading

        from freqopt.gpu.replay import detect_counter_period

        duration = max(self.protocol.warmup_s, COUNTER_DETECTION_S)
        found: list[float] = []

        def poll() -> None:
            try:
                found.append(detect_counter_period(self.device.energy_j, duration_s=duration))
            except RuntimeError:
                pass

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        spent = self._loop(plan, duration)
        poller.join()
        return (found[0] if found else self.spec.energy_counter_period_s), spent

    def _measure_plan(self, plan) -> Measurement:
        warmup = self.protocol.warmup_s
        if self.counter_period_s is None:  # the first warm-up also finds the counter's period
            self.counter_period_s, warmup = self._detect_counter_period(plan)
        else:
            self._loop(plan, warmup)
        window = self.protocol.window_s(self.counter_period_s)
        reps, time_s, energy_j = self._timed_window(plan, window)
        return Measurement(time_s / reps, energy_j / reps, warmup + time_s, float(self.device.sm_clock_mhz()))

    def _time_replay(self, plan) -> float:
        """Mean time of one replay of ``plan``, s: one untimed warm-up, then KERNEL_TIMING_REPEATS replays between
        two CUDA events (wall-clock time on a CPU device, in tests)."""
        import torch

        cuda = self.torch_device.startswith("cuda")
        plan()
        self._sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(KERNEL_TIMING_REPEATS):
            plan()
        if cuda:
            end.record()
        self._sync()
        elapsed = start.elapsed_time(end) / 1000.0 if cuda else time.perf_counter() - t0
        return elapsed / KERNEL_TIMING_REPEATS

    def kernel_times_s(self, kernels: Sequence[Kernel], setting: ClockSetting) -> np.ndarray:
        """Each kernel's time at ``setting``, shape (K,), s, measured on the device: the setting is applied, each
        distinct kernel (Kernel.signature) is replayed alone (freqopt.gpu.replay.build_replay) once untimed and then
        KERNEL_TIMING_REPEATS times between two CUDA events, and the mean is kept per (signature, setting) for
        this backend's lifetime. A kernel timed alone misses what a loop of all of them shares (caches, the power
        limit's averaging, host gaps), which is enough to weigh the kernels of a phase against each other.

        Raises:
            GPUPermissionError: read-only device and a setting other than the default; or no permission.
            InvalidSettingError: clocks or a power limit the GPU does not support.
        """
        self.apply(setting)
        cache: dict = {}  # kernels of one input spec share their input tensors
        out = np.empty(len(kernels))
        for i, kernel in enumerate(kernels):
            key = (kernel.signature, setting)
            if key not in self._kernel_time_s:
                self._kernel_time_s[key] = self._time_replay(self._replay([kernel], cache))
            out[i] = self._kernel_time_s[key]
        return out

    def measure(self, kernels: Sequence[Kernel], setting: ClockSetting, *, key: str = "",
                sample: int | None = None) -> Measurement:  # fmt: skip
        self.apply(setting)
        return self._measure_plan(self._replay(kernels))

    def measure_schedule(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, key: str = "",
                         switching: bool = True, sample: int | None = None) -> Measurement:  # fmt: skip
        """The kernels replayed in phases of equal settings, each phase's setting applied (synchronously, from this
        thread) before it runs, so that the switching cost is in the measurement."""
        phases: list[tuple[ClockSetting, list[Kernel]]] = []
        for kernel, setting in zip(kernels, settings):
            if phases and phases[-1][0] == setting:
                phases[-1][1].append(kernel)
            else:
                phases.append((setting, [kernel]))
        cache: dict = {}  # the phases share their input tensors: one iteration's worth, however many phases
        plans = [(s, self._replay(ks, cache)) for s, ks in phases]

        def iteration() -> None:
            for setting, plan in plans:
                if len(plans) > 1:
                    self._sync()
                    self.apply(setting)
                plan()

        if len(plans) == 1:
            self.apply(plans[0][0])
        return self._measure_plan(iteration)
