"""The simulated GPU: a roofline time model and a DVFS power model, calibrated against published measurements.

Time of a kernel at SM clock f and memory clock m (roofline with partial overlap)::

    t_flops = FLOPs / (n_sms * flops_per_clock_per_sm * f * efficiency)    # tensor or CUDA cores
    t_l2    = bytes / (l2_bytes_per_clock * f)                                 # SM-side load/store limit
    t_sm    = (t_flops^p + t_l2^p)^(1/p)
    t_dram  = bytes / (bandwidth(m) * mem_efficiency)
    t       = (t_sm^p + t_dram^p)^(1/p) + t_fixed  (+ gemm_fixed for a GEMM)

where a GEMM's efficiency is ``gemm_efficiency * K / (K + gemm_k_overhead)`` (K its inner dimension), fused
attention's ``attention_efficiency`` on its causal work (its backward runs 1.25x the 2x-forward FLOP count:
FlashAttention-2 recomputes the scores), and the layer-norm forward streams at ``layer_norm_bandwidth_rel`` of a
copy's bandwidth (all fitted on the H100, experiments/calibrate_h100.py). Where the GPU type has them (the H100,
fitted on whole training steps by experiments/fit_whole_steps.py): other memory-bound operators stream at their
``operator_bandwidth_rel`` of a copy's bandwidth (multi-tensor optimizer kernels, casts, reductions, softmax), a
row-wise kernel over rows of C elements at C / (C + c0) of its wide-row rate (``row_overhead_elements``), and fused
attention computes on the head dimension padded to a multiple of 64 at ``d / (d + attention_head_dim_overhead)``
(relative to 64), its backward at ``attention_backward_efficiency_rel`` of the forward's rate
(freqopt.gpu.backends.physics: ``bandwidth_rel``, ``attention_efficiency``).

Power while it runs (PowerModel, CMOS P ~ C V^2 f with activity factors u_sm = t_flops / t for arithmetic, and
u_mem = t_dram / t for memory traffic, whose power sits in the memory term)::

    P = p_const + p_leak V + (p_sm_clock + p_sm_active u_sm + p_sm_stream u_mem + p_op b) V^2 f/f_max
        + (p_mem_clock + p_mem_active u_mem) m/m_max

with u_sm the kernel's FLOP rate over the best GEMM's, u_mem its bytes over what a streaming copy would move in
its time, b its busy share (outside the fixed latency), and p_op the SM power of its operator class:
transcendental (GELU, softmax), layer norm, attention (PowerModel).

Host: a replay loop's host issues each kernel in ``host_issue_s`` (GEMMs: ``host_gemm_issue_s``); a training
step's host also runs the framework around each kernel (autograd, module calls, the optimizer's Python), another
``step_host_s`` of the kernel's pass (``host_issue_s(..., step=True)``). A kernel starts no earlier than it is
issued, and the GPU waits at its waiting power (a GPU with a context open and nothing to run, at that clock:
freqopt.gpu.backends.physics.waiting_power_w, from the GPU file's [waiting_power] measurement where it has one,
else the power model's baseline) meanwhile (``host_gaps``). A training step starts from an idle GPU (training loops read the loss each step): that is the
step every whole-iteration figure measures (``step`` and ``measure_schedule``: the search's baseline and
validation, the runtime's step, ``freqopt profile``), one physics for all of them. A tuning unit's measurement
replays its kernels back to back (``measure``, ``true_measure``) with a replay's host, so only a host slower than
the GPU shows there.

Collectives (all-reduce, ring algorithm) are timed by their bytes on the interconnect (GPUSpec.interconnect)::

    t_link  = 2 (n-1)/n S / (link_bandwidth * link_efficiency) + 2 (n-1) latency    # n ranks, S bytes
    t_l2    = bytes / (l2_bytes_per_clock * f * nccl_sms / n_sms)                # NCCL's few SMs copy and add
    t       = (t_sm^p + t_dram^p + t_link^p)^(1/p) + t_fixed

with the inter-node bandwidth and latency when the group spans nodes. They draw little SM power (u_sm counts
only their additions) and, on top, the link's energy per bit sent and received.

Timeline: kernels on the training stream (stream 0) run in issue order; a kernel on the communication stream
(stream 1: data-parallel gradient buckets) starts when the training-stream kernel issued before it has finished
and the previous communication kernel is done, and runs alongside the training stream; the first kernel of a new
pass on the training stream (the optimizer step) waits for every communication kernel issued before it. While a
communication kernel overlaps compute it adds only its power above the board's baseline (the constant, leakage
and clock-tree power are already being paid); exposed, it draws its full power.

Power limit: over each control window (``power_window_s``) the firmware runs the highest supported SM clock, at
most the requested one, whose average power stays within the limit, and alternates with the next step up for the
share of the window that brings the average to the limit (so the effective clock is continuous); with no locked
clock it requests the highest. Where even the lowest supported clock draws more than the limit, the firmware can go
no lower and runs the window there, above the limit: the measurement says so (``Measurement.power_limit_met``
False), as Zeus's A40 averages 107 W under a 100 W limit (You et al., NSDI'23).

Measurement: the kernels are replayed in a loop; the window is read with the noise of a real reading (0.5 %
run to run in energy and 0.2 % in time: assumed spreads of repeated readings, not yet measured) and an energy counter of 1 mJ resolution.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.gpu.backends.physics import (KernelPhysics, KernelTerms, SetCallQueue, host_gaps, host_issue_s,
                                          overlap_streams)
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel

__all__ = ["SimulatedGPU", "KernelPhysics", "host_gaps"]  # the physics re-exported for its callers

ENERGY_NOISE_REL = 0.005  # run-to-run spread of an energy reading (module docstring)
TIME_NOISE_REL = 0.002  # run-to-run spread of a CUDA-event timing of a replay loop (assumed: timing is steadier than energy)
ENERGY_COUNTER_RESOLUTION_J = 1e-3  # nvmlDeviceGetTotalEnergyConsumption counts mJ
PHYSICS_KEPT = 8  # KernelPhysics kept, of the (kernel list, memory clocks) evaluated last (_kernel_physics)


class _ByKernelList:
    """Values computed from a kernel list (and a hashable ``key``), kept for the ``size`` used last: keyed by the
    list's identity, which is cheap where hashing hundreds of kernels is not. Each entry holds its list, so that its
    id is not reused while it is kept; the oldest entry goes first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict[tuple, tuple] = {}

    def get(self, kernels: Sequence[Kernel], key: tuple = ()):
        """The value kept for ``kernels`` (this very list) and ``key``; None where there is none."""
        hit = self._entries.get((id(kernels), key))
        return hit[1] if hit is not None and hit[0] is kernels else None

    def put(self, kernels: Sequence[Kernel], key: tuple, value):
        """Keep ``value`` for ``kernels`` and ``key``, and return it."""
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[(id(kernels), key)] = (kernels, value)
        return value


class SimulatedGPU(Backend):
    """A GPU of type ``spec`` simulated by the physics of freqopt.gpu.backends.physics (module docstring).

    Args:
        spec: the GPU type.
        seed: seeds the measurement noise; equal seeds and equal calls give equal measurements.
        noise: False for noiseless measurements (the oracle, tests).
        protocol: warm-up and window of each measurement (sets its GPU-second cost).

    Attributes:
        applied: the setting last given to ``apply`` (the default until then); measurements take their settings
            as arguments and do not change it.
    """

    name = "sim"
    simulated = True

    def __init__(self, spec: GPUSpec, *, seed: int = 0, noise: bool = True, protocol: MeasurementProtocol | None = None):
        self.spec = spec
        self.seed = seed
        self.noise = noise
        self.protocol = protocol or MeasurementProtocol()
        self.applied = DEFAULT_SETTING
        self._repeats: dict[tuple, int] = defaultdict(int)
        self._energy_j = 0.0  # the counter: what every measurement's replay loop has drawn
        self._steps = _ByKernelList(64)  # step()'s recent noiseless results (pure functions of their arguments)
        self._terms = _ByKernelList(16)  # recent kernel lists' clock-independent terms (_kernel_terms)
        self._physics_kept = _ByKernelList(PHYSICS_KEPT)  # their physics at recent memory clocks (_kernel_physics)

    def __getstate__(self) -> dict:
        """Pickled (to joblib's processes) without the caches, which hold traces."""
        state = dict(self.__dict__)
        state["_steps"], state["_terms"] = _ByKernelList(self._steps.size), _ByKernelList(self._terms.size)
        return state

    def apply(self, setting: ClockSetting) -> None:
        """Record ``setting`` as the one the GPU holds, after the checks a real GPU's would pass.

        Raises:
            InvalidSettingError: clocks or a power limit this GPU type does not support.
        """
        setting.check_supported(self.spec)
        self.applied = setting

    def energy_j(self) -> float:
        """The simulated energy counter, J, at the real counter's 1 mJ resolution: each measurement adds the
        noiseless energy of its replay loop, its kernels' average power over the protocol's warm-up and window
        (``Measurement.cost_gpu_s``); ``true_measure`` and ``run`` add nothing."""
        return math.floor(self._energy_j / ENERGY_COUNTER_RESOLUTION_J) * ENERGY_COUNTER_RESOLUTION_J

    def _meter(self, time_s: float, energy_j: float) -> None:
        """Advance the counter by one measurement's loop: ``energy_j / time_s`` W for the protocol's GPU-seconds."""
        self._energy_j += energy_j / time_s * self.protocol.cost_gpu_s(self.spec.energy_counter_period_s, time_s)

    # -- physics -------------------------------------------------------------------------------------------
    def _sm_index(self, sm_clock_mhz: int | None) -> int:
        if sm_clock_mhz is None:
            return len(self.spec.sm_clocks_mhz) - 1
        return self.spec.sm_clocks_mhz.index(sm_clock_mhz)

    def run(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, loop: bool,
            switch_latency_s: float = 0.0) -> tuple[np.ndarray, ...]:  # fmt: skip
        """Noiseless per-kernel (time_s, energy_j, sm_clock_mhz) after power-limit throttling, each shape (K,).

        Args:
            kernels: kernels in issue order.
            settings: one setting per kernel.
            loop: the kernels are replayed in a loop (a unit's measurement): a window shorter than the power-limit
                control window sees the loop's average power, and the host shows only where it is the slower side.
                False: one training step issued from an idle GPU (``step``).
            switch_latency_s: a change of setting lands this long after the set call serving it starts, at the
                start of the kernel that asks for it unless the runtime's one thread is still busy with the call
                before (``spec.nvml_call_s`` each: _delayed); until then the GPU runs at the previous setting (in a
                loop, the first kernels inherit the last setting).
        """
        time_s, energy_j, clocks, *_ = self._physics(kernels, settings, loop=loop, switch_latency_s=switch_latency_s)
        return time_s, energy_j, clocks

    def run_with_waiting(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, loop: bool,
                         switch_latency_s: float = 0.0) -> tuple[np.ndarray, ...]:  # fmt: skip
        """``run``'s per-kernel (time_s, energy_j, sm_clock_mhz) and, of each kernel's time and energy, the part
        the GPU spent waiting for the host to issue it (wait_s, s; wait_j, J, at its waiting power: host_gaps and
        waiting_power_w), each shape (K,): ``time_s - wait_s`` is the kernel's busy time. Same arguments as
        ``run``; one physics pass (``waiting`` sums the last two)."""
        return self._physics(kernels, settings, loop=loop, switch_latency_s=switch_latency_s)[:5]

    def _physics(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, loop: bool,
                 switch_latency_s: float = 0.0) -> tuple[np.ndarray, ...]:  # fmt: skip
        """``run``'s (time_s, energy_j, sm_clock_mhz), and of each, the part spent waiting for the host before the
        kernel (host_gaps: time, s, and energy at the GPU's waiting power, J), and whether the kernel ran in a control
        window whose power limit the lowest supported SM clock could not meet (bool: the firmware runs that window at
        the lowest clock, above the limit), each shape (K,)."""
        if switch_latency_s > 0 and len(set(settings)) > 1:
            settings = self._delayed(kernels, settings, switch_latency_s, loop)
        spec = self.spec
        for s in dict.fromkeys(settings):  # each distinct setting once, in order
            s.check_supported(spec)
        mem = np.array([spec.resolve_clocks(None, s.mem_clock_mhz)[1] for s in settings], dtype=float)
        requested = np.array([self._sm_index(s.sm_clock_mhz) for s in settings])  # (K,)
        limit = np.array([spec.power_limit_default_w if s.power_limit_w is None else s.power_limit_w
                          for s in settings])  # (K,)  # fmt: skip
        terms, issue_s, on_stream = self._kernel_terms(kernels, step=not loop)
        phys = self._kernel_physics(kernels, mem, terms)
        k_idx = np.arange(len(kernels))
        # Control windows by time at the requested clocks.
        t_req = phys.time_s[k_idx, requested]
        window_s = spec.power_model.power_window_s
        if loop and t_req.sum() <= window_s:
            window = np.zeros(len(kernels), dtype=int)
        else:
            window = np.floor((np.cumsum(t_req) - t_req) / window_s).astype(int)
        new_window = np.r_[True, window[1:] != window[:-1]]
        starts = np.flatnonzero(new_window)
        window = np.cumsum(new_window) - 1  # (K,) dense window index
        n_clocks = len(spec.sm_clocks_mhz)
        caps = np.arange(n_clocks)  # (F,) candidate highest clock index the firmware allows
        eff = np.minimum(requested[:, None], caps[None, :])  # (K, F)
        t = phys.time_s[k_idx[:, None], eff]  # (K, F)
        e = phys.energy_j[k_idx[:, None], eff]  # (K, F)
        # The GPU waits at its waiting power (physics.waiting_power_w) for the host (host_gaps), before each kernel.
        gaps = host_gaps(t, issue_s, on_stream, loop=loop)  # (K, F)
        gap_e = gaps * phys.wait_power_w[k_idx[:, None], eff]  # (K, F)
        t = t + gaps
        e = e + gap_e
        avg_power = np.add.reduceat(e, starts, axis=0) / np.add.reduceat(t, starts, axis=0)  # (W, F)
        window_limit = limit[starts]  # (W,)
        ok = avg_power <= window_limit[:, None] + 1e-9  # (W, F); power rises with the clock
        # Where even the lowest clock draws more than the limit, the firmware can go no lower: it runs the window
        # there, above the limit (Zeus's A40 averages 107 W under a 100 W limit, shared/calibration/zeus).
        met = ok.any(axis=1)  # (W,)
        best = np.where(met, n_clocks - 1 - np.argmax(ok[:, ::-1], axis=1), 0)  # (W,)
        # Between the highest allowed clock step and the next, the firmware alternates so that the window's
        # average power meets the limit: a fraction alpha of the window's work runs one step higher.
        above = np.minimum(best + 1, n_clocks - 1)  # (W,)
        w_idx = np.arange(len(starts))
        t_sum = np.add.reduceat(t, starts, axis=0)  # (W, F)
        e_sum = np.add.reduceat(e, starts, axis=0)  # (W, F)
        t_lo, t_hi = t_sum[w_idx, best], t_sum[w_idx, above]
        e_lo, e_hi = e_sum[w_idx, best], e_sum[w_idx, above]
        denominator = (e_hi - e_lo) - window_limit * (t_hi - t_lo)
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = np.where(ok[w_idx, best] & (denominator > 0), (window_limit * t_lo - e_lo) / denominator, 0.0)
        alpha = np.clip(alpha, 0.0, 1.0)[window]  # (K,)
        lo, hi = eff[k_idx, best[window]], eff[k_idx, above[window]]  # (K,)
        time_s = (1 - alpha) * t[k_idx, best[window]] + alpha * t[k_idx, above[window]]
        energy_j = (1 - alpha) * e[k_idx, best[window]] + alpha * e[k_idx, above[window]]
        wait_s = (1 - alpha) * gaps[k_idx, best[window]] + alpha * gaps[k_idx, above[window]]
        wait_j = (1 - alpha) * gap_e[k_idx, best[window]] + alpha * gap_e[k_idx, above[window]]
        f = np.asarray(spec.sm_clocks_mhz, dtype=float)
        clocks = (1 - alpha) * f[lo] + alpha * f[hi]
        if not on_stream.all():
            baseline_w = (1 - alpha) * phys.baseline_power_w[k_idx, lo] + alpha * phys.baseline_power_w[k_idx, hi]
            time_s, energy_j = overlap_streams(kernels, time_s, energy_j, baseline_w)
        return time_s, energy_j, clocks, wait_s, wait_j, ~met[window]

    def _kernel_physics(self, kernels: Sequence[Kernel], mem_clock_mhz: np.ndarray,
                        terms: KernelTerms) -> KernelPhysics:  # fmt: skip
        """KernelPhysics of ``kernels`` at per-kernel memory clocks ``mem_clock_mhz`` (shape (K,), MHz), kept for
        the PHYSICS_KEPT (kernel list, memory clocks) pairs evaluated last: a search measures the same unit or step
        at many SM clocks and power limits at one memory clock, and KernelPhysics computes every SM clock's column
        at once (its arrays are read, never written, so a kept one gives the same readings)."""
        key = (np.asarray(mem_clock_mhz, dtype=float).tobytes(),)
        phys = self._physics_kept.get(kernels, key)
        if phys is None:
            phys = self._physics_kept.put(kernels, key, KernelPhysics(self.spec, kernels, mem_clock_mhz, terms=terms))
        return phys

    def _kernel_terms(self, kernels: Sequence[Kernel], *, step: bool) -> tuple[KernelTerms, np.ndarray, np.ndarray]:
        """What ``_physics`` needs of ``kernels`` whatever the settings: their KernelTerms, the host's issue time
        per kernel (host_issue_s, shape (K,), s) and whether each is on the training stream (shape (K,)), kept for
        the 16 kernel lists used last (a search evaluates the same unit or trace at many settings)."""
        hit = self._terms.get(kernels)
        if hit is None:
            on_stream = np.array([k.stream == 0 for k in kernels], dtype=bool)
            hit = self._terms.put(kernels, (), (KernelTerms(self.spec, kernels), {}, on_stream))
        terms, issue, on_stream = hit
        if step not in issue:
            issue[step] = host_issue_s(self.spec, kernels, step=step)
        return terms, issue[step], on_stream

    def _delayed(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], latency_s: float,
                 loop: bool = True) -> list[ClockSetting]:  # fmt: skip
        """The settings in force at each kernel's start when each change is asked for as its kernel starts, served
        by one runtime thread whose set calls take ``spec.nvml_call_s`` each, one at a time (SetCallQueue: a request
        waits while the thread is busy, and one still waiting when a newer one comes is dropped), and lands
        ``latency_s`` after its call starts. Times come from a first pass with the requested settings; steps run one
        after another, so a change asked for near the end of one lands in the next: the requests of enough
        consecutive steps are served for the last one's kernels to see every landing that reaches them."""
        time_s, _, _ = self.run(kernels, settings, loop=loop)
        starts = np.cumsum(time_s) - time_s  # (K,)
        total = float(time_s.sum())
        changes = [i for i in range(len(settings)) if settings[i] != settings[i - 1]]  # i = 0 compares with the last
        if not changes:
            return list(settings)
        queue = SetCallQueue(self.spec.nvml_call_s)
        landing_s, landed = [], []  # landing times, ascending, and the change each lands
        for step in range(2 + int(np.ceil(latency_s / total)) if total > 0 else 2):
            for c in changes:
                start_s, dropped = queue.submit(step * total + starts[c])
                if dropped:
                    landing_s.pop(), landed.pop()
                landing_s.append(start_s + latency_s)
                landed.append(c)
        last = step * total + starts  # the last step's kernel starts, (K,)
        idx = np.searchsorted(np.asarray(landing_s), last, side="right") - 1  # latest landing at or before each
        return [settings[landed[i]] if i >= 0 else settings[changes[-1]] for i in idx]

    def true_measure(self, kernels: Sequence[Kernel], setting: ClockSetting) -> Measurement:
        """The noiseless time and energy of one repetition (the oracle's view; no GPU-seconds charged), with
        ``power_limit_met`` False where the lowest SM clock could not hold the power limit."""
        t, e, clocks, _, _, over = self._physics(kernels, [setting] * len(kernels), loop=True)
        return Measurement(time_s=float(t.sum()), energy_j=float(e.sum()), sm_clock_mhz=float(np.average(clocks, weights=t)),
                           power_limit_met=not bool(over.any()))  # fmt: skip

    def kernel_times_s(self, kernels: Sequence[Kernel], setting: ClockSetting) -> np.ndarray:
        """Each kernel's noiseless time at ``setting``, the kernels replayed in a loop, shape (K,), s: this GPU
        type's physics (``run``, power-limit throttling and host gaps included). No GPU-seconds are charged and
        the energy counter does not move.

        Raises:
            InvalidSettingError: clocks or a power limit this GPU type does not support.
        """
        time_s, _, _ = self.run(kernels, [setting] * len(kernels), loop=True)
        return time_s

    # -- measurement -----------------------------------------------------------------------------------------
    def _noisy(self, time_s: float, energy_j: float, sm_clock_mhz: float, key: tuple, sample: int | None,
               power_limit_met: bool | None = None) -> Measurement:  # fmt: skip
        cost = self.protocol.cost_gpu_s(self.spec.energy_counter_period_s, time_s)  # whole repetitions of time_s
        if not self.noise:
            return Measurement(time_s, energy_j, cost, sm_clock_mhz, power_limit_met=power_limit_met)
        if sample is None:
            sample = self._repeats[key]
        self._repeats[key] = sample + 1
        digest = zlib.crc32(repr((key, sample + 1)).encode())
        rng = np.random.default_rng([self.seed, digest])
        time_meas = time_s * (1.0 + TIME_NOISE_REL * rng.standard_normal())
        reps = max(1.0, self.protocol.window_s(self.spec.energy_counter_period_s) / time_s)
        window_energy = energy_j * reps * (1.0 + ENERGY_NOISE_REL * rng.standard_normal())
        window_energy = np.round(window_energy / ENERGY_COUNTER_RESOLUTION_J) * ENERGY_COUNTER_RESOLUTION_J
        return Measurement(float(time_meas), float(window_energy / reps), cost, sm_clock_mhz,
                           power_limit_met=power_limit_met)

    def measure(self, kernels: Sequence[Kernel], setting: ClockSetting, *, key: str = "",
                sample: int | None = None) -> Measurement:  # fmt: skip
        true = self.true_measure(kernels, setting)
        self._meter(true.time_s, true.energy_j)
        return self._noisy(true.time_s, true.energy_j, true.sm_clock_mhz, (key, setting), sample,
                           true.power_limit_met)

    def step(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting] | None = None, *,
             switching: bool = False) -> Measurement:  # fmt: skip
        """The noiseless time and energy of one training step, issued from an idle GPU as a training loop that
        reads the loss each step issues it (host gaps included), with one setting per kernel (default: the GPU's
        defaults); ``switching`` applies each change of setting one clock-switch latency late. This is the step
        that ``measure_schedule`` measures with noise and ``freqopt profile`` reports: one physics for the search's
        baseline and validation, the runtime and the profile. No GPU-seconds charged."""
        settings = [DEFAULT_SETTING] * len(kernels) if settings is None else settings
        # Validation reads the same schedule many times (the defaults beside every schedule held to a budget, a
        # chosen schedule again afresh): the physics runs once per distinct one, the noise is drawn per reading.
        key = (tuple(settings), switching)
        hit = self._steps.get(kernels, key)
        if hit is not None:
            return hit
        latency = self.spec.clock_switch_s if switching else 0.0
        t, e, clocks, _, _, over = self._physics(kernels, settings, loop=False, switch_latency_s=latency)
        result = Measurement(float(t.sum()), float(e.sum()), sm_clock_mhz=float(np.average(clocks, weights=t)),
                             power_limit_met=not bool(over.any()))
        return self._steps.put(kernels, key, result)

    def waiting(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting] | None = None, *,
                switching: bool = False) -> Measurement:  # fmt: skip
        """The part of one training step (``step``, same arguments) the GPU spends waiting for the host to issue
        its kernels: their time_s and the energy_j the GPU draws meanwhile (its waiting power at the clock it
        holds: freqopt.gpu.backends.physics.host_gaps and waiting_power_w).
        Noiseless; no GPU-seconds charged. Where a step is host-bound this is most of it, and a lower clock saves
        energy there at no cost in time."""
        settings = [DEFAULT_SETTING] * len(kernels) if settings is None else settings
        latency = self.spec.clock_switch_s if switching else 0.0
        *_, wait_s, wait_j, _ = self._physics(kernels, settings, loop=False, switch_latency_s=latency)
        return Measurement(float(wait_s.sum()), float(wait_j.sum()))

    def measure_schedule(
        self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, key: str = "", switching: bool = False,
        sample: int | None = None,
    ) -> Measurement:
        """Measure a whole training step (``step``: issued from an idle GPU, host gaps included) with one setting per
        kernel; ``switching`` applies each change of setting one clock-switch latency (``spec.clock_switch_s``)
        late, as a real GPU does; without it switching is free."""
        true = self.step(kernels, settings, switching=switching)
        self._meter(true.time_s, true.energy_j)
        return self._noisy(true.time_s, true.energy_j, true.sm_clock_mhz, (key, "schedule", switching, tuple(settings)),
                           sample, true.power_limit_met)  # fmt: skip
