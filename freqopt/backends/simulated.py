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
copy's bandwidth (all fitted on the H100, experiments/calibrate_h100.py).

Power while it runs (PowerModel, CMOS P ~ C V^2 f with activity factors u_sm = t_flops / t for arithmetic, and
u_mem = t_dram / t for memory traffic, whose power sits in the memory term)::

    P = p_const + p_leak V + (p_sm_clock + p_sm_active u_sm + p_sm_stream u_mem + p_op b) V^2 f/f_max
        + (p_mem_clock + p_mem_active u_mem) m/m_max

with u_sm the kernel's FLOP rate over the best GEMM's, u_mem its bytes over what a streaming copy would move in
its time, b its busy share (outside the fixed latency), and p_op the SM power of its operator class:
transcendental (GELU, softmax), layer norm, attention (PowerModel).

Host: the host issues each kernel of a step in ``host_issue_s`` (GEMMs: ``host_gemm_issue_s``); a kernel starts
no earlier than it is issued, and the GPU idles at its baseline power (an idle GPU with a context at that clock)
while it waits (``host_gaps``). A step starts from an idle GPU (training loops read the loss each step); a
measurement loop replays back to back, so only a host slower than the GPU shows.

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
clock it requests the highest.

Measurement: the kernels are replayed in a loop; the window is read with the noise of a real reading (0.5 %
run to run in energy and 0.2 % in time: assumed spreads of repeated readings, not yet measured) and an energy counter of 1 mJ resolution.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from freqopt.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.gpus import GPUSpec
from freqopt.kernels import Kernel

__all__ = ["SimulatedGPU", "KernelPhysics"]

ENERGY_NOISE_REL = 0.005  # run-to-run spread of an energy reading (module docstring)
TIME_NOISE_REL = 0.002  # run-to-run spread of a CUDA-event timing of a replay loop (assumed: timing is steadier than energy)
ENERGY_COUNTER_RESOLUTION_J = 1e-3  # nvmlDeviceGetTotalEnergyConsumption counts mJ
CAUSAL_WORK_FRACTION = 0.5  # FlashAttention skips the fully masked key blocks: about half the work (Dao 2022)


# Operators whose SM work besides FLOPs draws power of its own (PowerModel): special-function (transcendental)
# elementwise operators and softmaxes, layer norms, fused attention. Matched on the ATen operator's name.
SFU_OPS = frozenset({
    "aten.gelu", "aten.gelu_backward", "aten.tanh", "aten.tanh_backward", "aten.exp", "aten.sigmoid",
    "aten.sigmoid_backward", "aten.silu", "aten.silu_backward", "aten.erf", "aten.rsqrt", "aten._softmax",
    "aten._softmax_backward_data", "aten._log_softmax", "aten._log_softmax_backward_data",
})  # fmt: skip
# FlashAttention-2's backward recomputes the scores: 5 matmuls against the 4 that the 2x-forward FLOP count
# (torch.utils.flop_counter's convention) holds, i.e. 2.5x the forward's work (Dao 2023, arXiv 2307.08691, sec. 3).
ATTENTION_BACKWARD_WORK = 1.25
_GEMM_INNER_DIM_ARG = {"aten.mm": 0, "aten.bmm": 0, "aten.addmm": 1, "aten.baddbmm": 1}


def gemm_inner_dim(kernel: Kernel) -> int | None:
    """K of a GEMM kernel (the reduced dimension: the last of its first matrix operand), None for other kernels."""
    arg = _GEMM_INNER_DIM_ARG.get(kernel.name)
    if arg is None or len(kernel.shapes) <= arg or not kernel.shapes[arg]:
        return None
    return int(kernel.shapes[arg][-1])


def host_issue_s(spec: GPUSpec, kernels: Sequence[Kernel]) -> np.ndarray:
    """Host time to issue each kernel, s, shape (K,): ``spec.host_gemm_issue_s`` for GEMMs, else
    ``spec.host_issue_s`` (both 0 where the GPU type has no host measurement)."""
    return np.array([spec.host_gemm_issue_s if k.kind == "gemm" else spec.host_issue_s for k in kernels])


def host_gaps(time_s: np.ndarray, issue_s: np.ndarray, on_stream: np.ndarray, *, loop: bool) -> np.ndarray:
    """Idle time the GPU spends before each kernel waiting for the host to issue it, s, shape of ``time_s``.

    The host issues kernel i at H_i = issue_s[0] + ... + issue_s[i]; a training-stream kernel starts at
    max(end of the previous one, H_i), so it ends at e_i = T_i + max(0, max_{j<=i} (H_j - T_{j-1})), T the running
    sum of kernel times, and the gap before it is the rise of that maximum. This is one step issued from an idle
    GPU (a training loop that reads the loss each step). ``loop``: the kernels are replayed back to back with no
    synchronization, so in steady state the host runs ahead unless it is the slower side; the period is
    max(GPU time, host time) and the gaps are scaled to fill the difference.

    Args:
        time_s: kernel times, (K,) or (K, F) (one column per candidate clock).
        issue_s: host issue time per kernel, (K,).
        on_stream: (K,) bool, kernels of the training stream (communication kernels overlap it and get no gap).
        loop: as above.
    """
    if not issue_s.any():
        return np.zeros_like(time_s)
    t = np.where(on_stream.reshape(-1, *[1] * (time_s.ndim - 1)), time_s, 0.0)
    issued = np.cumsum(issue_s).reshape(-1, *[1] * (time_s.ndim - 1))
    done = np.cumsum(t, axis=0)
    slack = np.where(on_stream.reshape(issued.shape), issued - (done - t), -np.inf)
    waited = np.maximum.accumulate(np.maximum(slack, 0.0), axis=0)
    gaps = np.diff(waited, axis=0, prepend=np.zeros((1, *time_s.shape[1:])))
    if loop:
        short = np.maximum(issued[-1] - done[-1], 0.0)  # host time per repetition beyond the GPU's
        total = gaps.sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            gaps = np.where(total > 0, gaps * (short / total), 0.0)
    return gaps


class KernelPhysics:
    """Per-kernel time and power at every supported SM clock, for one list of kernels.

    Arrays are (K, F): K kernels, F supported SM clocks (ascending), at each kernel's memory clock:
    ``time_s``, ``power_w``, ``energy_j``, and ``baseline_power_w`` (the board's power with no activity at that
    clock: constant, leakage and clock-tree terms; what an idle GPU with a context draws).

    A tensor-core kernel's SM activity is its FLOP rate over the rate of the best large GEMM at that clock
    (``gemm_efficiency`` of peak), so a GEMM with a short inner dimension, or attention, draws less per clock and
    throttles less under the power limit, as measured on the H100 (../shared/calibration/h100).
    """

    def __init__(self, spec: GPUSpec, kernels: Sequence[Kernel], mem_clock_mhz: np.ndarray):
        self.spec = spec
        p = spec.overlap_exponent
        f = np.asarray(spec.sm_clocks_mhz, dtype=float)[None, :]  # (1, F)
        m = np.asarray(mem_clock_mhz, dtype=float)[:, None]  # (K, 1)
        attention_eff = spec.attention_efficiency or spec.gemm_efficiency
        work, efficiency = [], []  # FLOPs the GPU runs; fraction of peak it reaches on them
        for k in kernels:
            w = k.flops * (CAUSAL_WORK_FRACTION if k.causal else 1.0)
            if k.kind == "attention":
                w *= ATTENTION_BACKWARD_WORK if k.name.endswith("_backward") else 1.0
                efficiency.append(attention_eff)
            else:
                inner = gemm_inner_dim(k) if k.tensor_core else None
                scale = inner / (inner + spec.gemm_k_overhead) if inner else 1.0
                efficiency.append(spec.gemm_efficiency * scale)
            work.append(w)
        work, efficiency = np.array(work)[:, None], np.array(efficiency)[:, None]  # (K, 1) each
        per_clock = np.array(
            [spec.tensor_flops_per_clock_per_sm if k.tensor_core else spec.cuda_flops_per_clock_per_sm for k in kernels]
        )[:, None]
        nbytes = np.array([k.mem_bytes for k in kernels])[:, None]
        link_s, latency_s, link_j = _link_costs(spec, kernels)  # (K, 1) each
        # A collective's loads and stores go through the few SMs NCCL runs on, not the whole GPU.
        sm_share = np.array([spec.interconnect.nccl_sms / spec.n_sms if k.is_collective else 1.0 for k in kernels])
        peak = spec.n_sms * per_clock * f * 1e6  # (K, F), FLOP/s
        t_ideal = work / (peak * spec.gemm_efficiency)  # (K, F): at the best GEMM's rate
        t_flops = work / (peak * efficiency)  # (K, F)
        t_l2 = nbytes / (spec.l2_bytes_per_clock * sm_share[:, None] * f * 1e6)  # (K, F)
        t_sm = (t_flops**p + t_l2**p) ** (1 / p)  # (K, F)
        bandwidth = spec.mem_bandwidth_gbs * 1e9 * m / spec.max_mem_clock_mhz  # (K, 1), B/s
        t_stream = nbytes / (bandwidth * spec.mem_efficiency)  # (K, 1): at a streaming copy's rate
        slow = np.array([spec.layer_norm_bandwidth_rel if k.name == "aten.native_layer_norm" else 1.0
                         for k in kernels])[:, None]  # fmt: skip
        t_dram = t_stream / slow  # (K, 1)
        t_busy = (t_sm**p + t_dram**p + link_s**p) ** (1 / p)  # (K, F)
        gemm_fixed = np.array([spec.gemm_fixed_s if k.kind == "gemm" else 0.0 for k in kernels])[:, None]
        self.time_s = t_busy + latency_s + spec.kernel_fixed_s + gemm_fixed  # (K, F)
        u_sm = t_ideal / self.time_s
        u_mem = t_stream / self.time_s  # bytes moved over what a copy would move meanwhile
        pm = spec.power_model
        op_w = np.array([pm.p_attention_w if k.kind == "attention" else pm.p_norm_w if k.kind == "normalization"
                         else pm.p_sfu_w if k.name in SFU_OPS else 0.0 for k in kernels])[:, None]  # fmt: skip
        v = voltage_rel(spec, f)  # (1, F)
        f_rel = f / spec.max_sm_clock_mhz
        m_rel = m / spec.max_mem_clock_mhz
        self.baseline_power_w = pm.p_const_w + pm.p_leak_w * v + pm.p_sm_clock_w * v**2 * f_rel + pm.p_mem_clock_w * m_rel
        self.power_w = (
            self.baseline_power_w
            + (pm.p_sm_active_w * u_sm + pm.p_sm_stream_w * u_mem + op_w * t_busy / self.time_s) * v**2 * f_rel
            + pm.p_mem_active_w * u_mem * m_rel
            + link_j / self.time_s
        )  # (K, F)
        self.energy_j = self.power_w * self.time_s  # (K, F)


def _link_costs(spec: GPUSpec, kernels: Sequence[Kernel]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per kernel, shape (K, 1) each: the ring all-reduce's bandwidth time on the link (s), its latency (s), and
    the link energy (J) for the bytes each rank sends and receives; zeros for kernels that are not collectives."""
    link = spec.interconnect
    link_s, latency_s, link_j = (np.zeros((len(kernels), 1)) for _ in range(3))
    for i, k in enumerate(kernels):
        if not k.is_collective:
            continue
        n = k.group_size
        inter = link.spans_nodes(n, k.group_stride)
        bandwidth = (link.inter_node_bandwidth_gbs if inter else link.link_bandwidth_gbs) * 1e9 * link.link_efficiency
        latency = (link.inter_node_latency_us if inter else link.link_latency_us) * 1e-6
        bus_bytes = 2 * (n - 1) / n * k.comm_bytes  # sent (and received) by each rank
        link_s[i] = bus_bytes / bandwidth
        latency_s[i] = 2 * (n - 1) * latency
        link_j[i] = 2 * bus_bytes * 8 * link.link_energy_pj_per_bit * 1e-12
    return link_s, latency_s, link_j


def _overlap_streams(
    kernels: Sequence[Kernel], time_s: np.ndarray, energy_j: np.ndarray, baseline_w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Lay the kernels on a training stream and a communication stream (module docstring) and return, per
    kernel, the wall time it adds (a communication kernel: only its exposed part) and its energy (overlapped:
    only its power above ``baseline_w``). Shapes (K,); the sums are the iteration's wall time and energy."""
    compute_end = 0.0  # when the training stream's last kernel ends
    comm_end = 0.0  # when the communication stream's last kernel ends
    busy: list[list[float]] = []  # the training stream's busy intervals, merged
    spans = {}  # communication kernel -> (start, end)
    last_pass = None
    for i, k in enumerate(kernels):
        if k.stream != 0:
            start = max(comm_end, compute_end)
            comm_end = start + time_s[i]
            spans[i] = (start, comm_end)
            continue
        start = compute_end
        if last_pass is not None and k.pass_name != last_pass:
            start = max(start, comm_end)  # a pass boundary waits for the gradients in flight
        last_pass = k.pass_name
        if busy and busy[-1][1] >= start:
            busy[-1][1] = start + time_s[i]
        else:
            busy.append([start, start + time_s[i]])
        compute_end = start + time_s[i]
    wall_time, wall_energy = time_s.copy(), energy_j.copy()
    for i, (start, end) in spans.items():
        overlapped = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        exposed = (end - start) - overlapped
        power = energy_j[i] / time_s[i]
        wall_time[i] = exposed
        wall_energy[i] = power * exposed + (power - baseline_w[i]) * overlapped
    return wall_time, wall_energy


def voltage_rel(spec: GPUSpec, sm_clock_mhz: np.ndarray | float) -> np.ndarray:
    """V(f) / V_max: flat at v_min_rel up to the knee, then linear to 1 at the highest SM clock."""
    pm = spec.power_model
    f = np.asarray(sm_clock_mhz, dtype=float)
    rise = (f - pm.f_knee_mhz) / (spec.max_sm_clock_mhz - pm.f_knee_mhz)
    return pm.v_min_rel + (1.0 - pm.v_min_rel) * np.clip(rise, 0.0, 1.0)


class SimulatedGPU(Backend):
    """A GPU of type ``spec`` simulated by the physics above.

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

    def apply(self, setting: ClockSetting) -> None:
        """Record ``setting`` as the one the GPU holds, after the checks a real GPU's would pass.

        Raises:
            InvalidSettingError: clocks or a power limit this GPU type does not support.
        """
        spec = self.spec
        if setting.sm_clock_mhz is not None or setting.mem_clock_mhz is not None:
            spec.check_clocks(*spec.resolve_clocks(setting.sm_clock_mhz, setting.mem_clock_mhz))
        if setting.power_limit_w is not None:
            spec.check_power_limit(setting.power_limit_w)
        self.applied = setting

    def energy_j(self) -> float:
        """The simulated energy counter, J, at the real counter's 1 mJ resolution: each measurement adds the
        noiseless energy of its replay loop, its kernels' average power over the protocol's warm-up and window
        (``Measurement.cost_gpu_s``); ``true_measure`` and ``run`` add nothing."""
        return math.floor(self._energy_j / ENERGY_COUNTER_RESOLUTION_J) * ENERGY_COUNTER_RESOLUTION_J

    def _meter(self, time_s: float, energy_j: float) -> None:
        """Advance the counter by one measurement's loop: ``energy_j / time_s`` W for the protocol's GPU-seconds."""
        self._energy_j += energy_j / time_s * self.protocol.cost_gpu_s(self.spec.energy_counter_period_s)

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
            loop: the kernels are replayed in a loop (a measurement): a window shorter than the power-limit
                control window sees the loop's average power.
            switch_latency_s: a change of setting lands this long after the kernel that asks for it starts; until
                then the GPU runs at the previous setting (in a loop, the first kernels inherit the last setting).
        """
        if switch_latency_s > 0 and len(set(settings)) > 1:
            settings = self._delayed(kernels, settings, switch_latency_s)
        spec = self.spec
        for s in settings:
            if s.sm_clock_mhz is not None or s.mem_clock_mhz is not None:
                spec.check_clocks(*spec.resolve_clocks(s.sm_clock_mhz, s.mem_clock_mhz))
            if s.power_limit_w is not None:
                spec.check_power_limit(s.power_limit_w)
        mem = np.array([spec.resolve_clocks(None, s.mem_clock_mhz)[1] for s in settings], dtype=float)
        requested = np.array([self._sm_index(s.sm_clock_mhz) for s in settings])  # (K,)
        limit = np.array([spec.power_limit_default_w if s.power_limit_w is None else s.power_limit_w
                          for s in settings])  # (K,)  # fmt: skip
        phys = KernelPhysics(spec, kernels, mem)
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
        # The GPU idles at its baseline power while it waits for the host (host_gaps), before each kernel.
        on_stream = np.array([k.stream == 0 for k in kernels], dtype=bool)
        gaps = host_gaps(t, host_issue_s(spec, kernels), on_stream, loop=loop)  # (K, F)
        t = t + gaps
        e = e + gaps * phys.baseline_power_w[k_idx[:, None], eff]
        avg_power = np.add.reduceat(e, starts, axis=0) / np.add.reduceat(t, starts, axis=0)  # (W, F)
        window_limit = limit[starts]  # (W,)
        ok = avg_power <= window_limit[:, None] + 1e-9  # (W, F); power rises with the clock
        best = np.where(ok.any(axis=1), n_clocks - 1 - np.argmax(ok[:, ::-1], axis=1), 0)  # (W,)
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
        f = np.asarray(spec.sm_clocks_mhz, dtype=float)
        clocks = (1 - alpha) * f[lo] + alpha * f[hi]
        side = np.array([k.stream != 0 for k in kernels])
        if side.any():
            baseline_w = (1 - alpha) * phys.baseline_power_w[k_idx, lo] + alpha * phys.baseline_power_w[k_idx, hi]
            time_s, energy_j = _overlap_streams(kernels, time_s, energy_j, baseline_w)
        return time_s, energy_j, clocks

    def _delayed(self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], latency_s: float) -> list[ClockSetting]:
        """The settings in force at each kernel's start when each change lands ``latency_s`` after it is asked for
        (times from a first pass with the requested settings)."""
        time_s, _, _ = self.run(kernels, settings, loop=True)
        starts = np.cumsum(time_s) - time_s  # (K,)
        total = float(time_s.sum())
        changes = [i for i in range(len(settings)) if settings[i] != settings[i - 1]]  # i = 0 compares with the last
        effective = []
        for start in starts:
            # The latest change whose landing time (its start + latency, modulo the loop) is at or before this kernel.
            landed = [(start - (starts[c] + latency_s)) % total for c in changes]
            effective.append(settings[changes[int(np.argmin(landed))]] if changes else settings[0])
        return effective

    def true_measure(self, kernels: Sequence[Kernel], setting: ClockSetting) -> Measurement:
        """The noiseless time and energy of one repetition (the oracle's view; no GPU-seconds charged)."""
        t, e, clocks = self.run(kernels, [setting] * len(kernels), loop=True)
        return Measurement(time_s=float(t.sum()), energy_j=float(e.sum()), sm_clock_mhz=float(np.average(clocks, weights=t)))

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
    def _noisy(self, time_s: float, energy_j: float, sm_clock_mhz: float, key: tuple, sample: int | None) -> Measurement:
        cost = self.protocol.cost_gpu_s(self.spec.energy_counter_period_s)
        if not self.noise:
            return Measurement(time_s, energy_j, cost, sm_clock_mhz)
        if sample is None:
            sample = self._repeats[key]
        self._repeats[key] = sample + 1
        digest = zlib.crc32(repr((key, sample + 1)).encode())
        rng = np.random.default_rng([self.seed, digest])
        time_meas = time_s * (1.0 + TIME_NOISE_REL * rng.standard_normal())
        reps = max(1.0, self.protocol.window_s(self.spec.energy_counter_period_s) / time_s)
        window_energy = energy_j * reps * (1.0 + ENERGY_NOISE_REL * rng.standard_normal())
        window_energy = np.round(window_energy / ENERGY_COUNTER_RESOLUTION_J) * ENERGY_COUNTER_RESOLUTION_J
        return Measurement(float(time_meas), float(window_energy / reps), cost, sm_clock_mhz)

    def measure(self, kernels: Sequence[Kernel], setting: ClockSetting, *, key: str = "",
                sample: int | None = None) -> Measurement:  # fmt: skip
        true = self.true_measure(kernels, setting)
        self._meter(true.time_s, true.energy_j)
        return self._noisy(true.time_s, true.energy_j, true.sm_clock_mhz, (key, setting), sample)

    def measure_schedule(
        self, kernels: Sequence[Kernel], settings: Sequence[ClockSetting], *, key: str = "", switching: bool = False,
        sample: int | None = None,
    ) -> Measurement:
        """Measure a whole iteration with one setting per kernel; ``switching`` applies each change of setting one
        clock-switch latency (``spec.clock_switch_s``) late, as a real GPU does; without it switching is free."""
        latency = self.spec.clock_switch_s if switching else 0.0
        t, e, clocks = self.run(kernels, settings, loop=True, switch_latency_s=latency)
        clock = float(np.average(clocks, weights=t))
        self._meter(float(t.sum()), float(e.sum()))
        return self._noisy(float(t.sum()), float(e.sum()), clock, (key, "schedule", switching, tuple(settings)), sample)
