"""Zeus's measured power-limit sweeps (NSDI'23) on the simulated GPU, and the A40 power model fitted on them jointly
with Perseus's locked-clock stage sweeps.

Data: You, Chung, Chowdhury, "Zeus: Understanding and Optimizing GPU Energy Consumption of DNN Training", NSDI'23;
``summary_power_{gpu}.csv`` of ml-energy/zeus (commit 75a8b93), copied to shared/calibration/zeus/nsdi23/ (README
there: columns, units). One sweep per (network, batch size): the time per epoch and the average board power at each
power limit, PyTorch FP32 training with a real epoch's data loading.

Each network is traced as a freqopt FP32 training step (``NETWORKS``; what the data does not say is assumed there:
the input sizes, the head, the sequence length) and run on the simulated GPU under each limit (SimulatedGPU, the
firmware's power-limit loop: the highest clock whose control window's average stays under the limit, the lowest
clock where none does, so a simulated average may sit above its limit as Zeus's A40 rows do: 107 W under 100 W).
Each step also has a host gap (data loading, Python, the optimizer's bookkeeping) during which the GPU waits at its
waiting power at the highest clock (physics.waiting_power_w: a waiting GPU is not throttled) and which a power limit
does not slow. The gap is a workload constant, not the GPU's: ``anchored_host_gap_s`` solves it from the sweep's
highest limit alone (the measured average power there, which relative figures are normalised to), so that what is
compared, the curve under lower limits, is predicted, and a left-out sweep needs nothing of its own data but that
point.

Compared (``sweep_errors``): per limit the time and the energy relative to the highest limit (percentage points)
and the average power; the energy-optimal limit (W). Targets (the fidelity scoreboard's, freqopt.gpu.calibration.fidelity.TARGETS): within 8 pp of relative time and of
relative energy at every limit, the energy-optimal limit within 25 W. A fold's stored parameters
(experiments/a40_power_fit.json, ``folds[name]["parameters"]``) rebuild its spec with
``dvfs.with_values(get_gpu("a40"), parameters)``, so a scoreboard can re-predict a left-out sweep with
``sweep_errors`` (a few tenths of a second per sweep once its trace is cached).

The power model (freqopt.gpu.spec_parts.PowerModel) is an AccelWattch/GPUWattch-style component model: a static
floor (``p_const_w``), leakage ~ V, dynamic SM power ~ activity x V^2 f, memory power by clock and traffic. ``fit``
fits it JOINTLY on the GPU's Perseus stage sweeps (freqopt.gpu.calibration.dvfs) and its Zeus sweeps with
scipy.optimize.least_squares, every parameter inside the file's [power_model_bounds] (freqopt.gpu.power_bounds),
from a fixed start (``FIT_START``) and with bounded work (``max_nfev``). A shared prior pulls the normalized
voltage-curve parameters (``v_min_rel``, ``f_knee_mhz`` over the highest clock) toward the family sibling's fitted
values (the A40's: the A100 80GB's, fitted on Perseus's A100 BLOOM sweep), ``PRIOR_WEIGHT`` per ``PRIOR_SCALE``, so
that a GPU whose own data is thin borrows its curve's shape from its family.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.physics import waiting_power_w
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Trace

__all__ = ["ZeusSweep", "NETWORKS", "load_sweeps", "network_trace", "simulate_sweep", "anchored_host_gap_s",
           "sweep_errors", "summarize", "summary_row", "per_limit_tables", "fit", "voltage_prior", "baseline_top_w",
           "FIT_PARAMETERS", "FIT_START", "PRIOR_WEIGHT", "PRIOR_SCALE", "BLOCKING_WEIGHT", "ShuffleNetV2",
           "DeepSpeech2", "waiting_power_top_w"]

# name -> the parameter's role; bounds come from the GPU file's [power_model_bounds] (f_knee_rel: the knee's MHz
# over the highest SM clock, within the supported clocks), the time figures' from dvfs.TIME_PARAMETERS.
FIT_PARAMETERS = ("p_const_w", "p_leak_w", "p_sm_clock_w", "p_sm_active_w", "p_mem_clock_w", "p_mem_active_w",
                  "v_min_rel", "f_knee_rel")
# Where every fit starts (reproducible; not the committed constants): inside every A40 bound, Ampere-scale guesses.
FIT_START: dict[str, float] = {
    "p_const_w": 25.0, "p_leak_w": 40.0, "p_sm_clock_w": 60.0, "p_sm_active_w": 200.0, "p_mem_clock_w": 30.0,
    "p_mem_active_w": 30.0, "v_min_rel": 0.75, "f_knee_rel": 0.75, "gemm_efficiency": 0.63, "link_efficiency": 0.36,
    "l2_bytes_per_clock": 2048.0,
}  # fmt: skip
# The family prior: residual PRIOR_WEIGHT x (value - sibling's) / PRIOR_SCALE beside residuals in fractions of the
# ratios, so a voltage-curve parameter 0.1 from the sibling's costs as much as a 2 pp miss on one ratio (assumed).
PRIOR_WEIGHT = 0.02
PRIOR_SCALE = {"v_min_rel": 0.1, "f_knee_rel": 0.1}
POWER_WEIGHT = 0.5  # weight of the relative average-power residual beside the time and energy ratios (assumed)
# Weight of the relative residual of the power model's baseline at the highest clocks against a measured P2P-blocking
# power (fit's blocking_power_w). A blocked GPU runs NCCL's polling kernel on top of its baseline, so the measurement
# bounds the baseline from above; one figure beside a hundred-odd ratio residuals, it is held at 5 (assumed): on the
# A40, without it the fit puts the baseline at 168 W against the measured 70.38 W, at weight 1 at 93 W, at 5 at 70.8 W.
BLOCKING_WEIGHT = 5.0


@dataclass(frozen=True)
class ZeusSweep:
    """One (network, batch size) power-limit sweep, each array shape (L,), limits ascending.

    Attributes:
        gpu: the file's GPU (``a40``, ``p100``, ``rtx6000``).
        dataset, network, batch_size: as the file names them.
        power_limit_w, time_per_epoch_s, average_power_w: per limit: W, s, W (board power averaged over the epoch).
    """

    gpu: str
    dataset: str
    network: str
    batch_size: int
    power_limit_w: np.ndarray
    time_per_epoch_s: np.ndarray
    average_power_w: np.ndarray

    @property
    def name(self) -> str:
        """``network@batch_size``: unique within a file whose networks each ran on one dataset (the A40's)."""
        return f"{self.network}@{self.batch_size}"

    @property
    def label(self) -> str:
        """``dataset/network@batch_size``: unique in every file (the RTX 6000 ran bert-base on two datasets)."""
        return f"{self.dataset}/{self.network}@{self.batch_size}"

    @property
    def energy_j(self) -> np.ndarray:
        """Energy per epoch, J, shape (L,)."""
        return self.time_per_epoch_s * self.average_power_w


def load_sweeps(path: str | Path, networks: tuple[str, ...] | None = None,
                batch_sizes: dict[str, tuple[int, ...]] | None = None) -> list[ZeusSweep]:  # fmt: skip
    """The sweeps of a Zeus ``summary_power_*.csv`` (``#`` lines are comments), one per (network, batch size),
    sorted by network and batch size; only ``networks`` (default all) and, per network, ``batch_sizes``.

    Raises:
        ValueError: the file holds no row of the networks asked for, or a sweep repeats a limit.
    """
    gpu = Path(path).stem.replace("summary_power_", "").replace("_shared", "")
    rows = list(csv.DictReader(line for line in Path(path).read_text().splitlines() if not line.startswith("#")))
    groups: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    for r in rows:
        net, b = r["network"], int(r["batch_size"])
        if networks is not None and net not in networks:
            continue
        if batch_sizes is not None and net in batch_sizes and b not in batch_sizes[net]:
            continue
        groups.setdefault((r["dataset"], net, b), []).append(
            (float(r["power_limit"]), float(r["time_per_epoch"]), float(r["average_power"])))
    if not groups:
        raise ValueError(f"{path} holds no row of {networks}")
    out = []
    for (dataset, net, b), points in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        points.sort()
        limits = [p[0] for p in points]
        if len(set(limits)) != len(limits):
            raise ValueError(f"{path}: {net} at batch {b} repeats a power limit")
        a = np.array(points)
        out.append(ZeusSweep(gpu, dataset, net, b, a[:, 0], a[:, 1], a[:, 2]))
    return out


# -- the networks --------------------------------------------------------------------------------------------------


def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class _ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit (Ma et al., ECCV 2018, figure 3 c/d): stride 1 splits the channels in two and runs one
    half through 1x1, 3x3 depthwise, 1x1; stride 2 runs both branches on the whole input and doubles the channels."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.stride = stride
        half = c_out // 2
        c_branch = c_in if stride == 2 else c_in // 2
        self.residual = nn.Sequential(
            nn.Conv2d(c_branch, c_branch, 1), nn.BatchNorm2d(c_branch), nn.ReLU(inplace=True),
            nn.Conv2d(c_branch, c_branch, 3, stride=stride, padding=1, groups=c_branch), nn.BatchNorm2d(c_branch),
            nn.Conv2d(c_branch, half, 1), nn.BatchNorm2d(half), nn.ReLU(inplace=True))  # fmt: skip
        self.shortcut = nn.Sequential()
        if stride == 2:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_in, 3, stride=2, padding=1, groups=c_in), nn.BatchNorm2d(c_in),
                nn.Conv2d(c_in, half, 1), nn.BatchNorm2d(half), nn.ReLU(inplace=True))  # fmt: skip

    def forward(self, x):
        if self.stride == 1:
            shortcut, residual = x.chunk(2, dim=1)
            x = torch.cat([self.shortcut(shortcut), self.residual(residual)], dim=1)
        else:
            x = torch.cat([self.shortcut(x), self.residual(x)], dim=1)
        return _channel_shuffle(x, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2 1x for CIFAR-100 as the Zeus CIFAR-100 example runs it (examples/cifar100/models: the
    weiaicunzai/pytorch-cifar100 models): a 3x3 stride-1 stem of 24 channels and no max-pool (32 x 32 images keep
    their size into stage 2), stages of 4, 8 and 4 units to 116, 232, 464 channels, a 1x1 convolution to 1024,
    global average pooling and a 100-way linear layer (Ma et al. 2018, table 5, 1x)."""

    def __init__(self, n_classes: int = 100):
        super().__init__()
        self.pre = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.BatchNorm2d(24))
        stages, c = [], 24
        for c_out, repeat in ((116, 3), (232, 7), (464, 3)):
            stages.append(_ShuffleUnit(c, c_out, 2))
            stages += [_ShuffleUnit(c_out, c_out, 1) for _ in range(repeat)]
            c = c_out
        self.stages = nn.Sequential(*stages)
        self.conv5 = nn.Sequential(nn.Conv2d(c, 1024, 1), nn.BatchNorm2d(1024), nn.ReLU(inplace=True))
        self.fc = nn.Linear(1024, n_classes)

    def forward(self, x):
        x = self.conv5(self.stages(self.pre(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _shufflenet_trace(batch_size: int) -> Trace:
    """One FP32 training step of ShuffleNetV2 on CIFAR-100 (32 x 32 x 3 images, 100 classes), Adadelta as the
    Zeus sweep names it, traced on the meta device."""
    import freqopt

    with torch.device("meta"):
        model = ShuffleNetV2()
        images = torch.randn(batch_size, 3, 32, 32)
        labels = torch.randint(0, 100, (batch_size,))
    optimizer = torch.optim.Adadelta(model.parameters(), foreach=True)

    def step():
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return freqopt.trace_step(step, name="shufflenetv2-cifar100", module=model, micro_batch_size=batch_size)


class _LSTMRecurrence(torch.autograd.Function):
    """One direction of one LSTM layer's recurrence in cuDNN's kernel structure (cuDNN's standard RNN algorithm:
    the input weights' GEMM over every time step runs outside, in the caller's ``nn.Linear``). Forward: per time step
    one GEMM of the recurrent weights and one fused cell kernel (``aten._thnn_fused_lstm_cell``, what PyTorch's
    CUDA LSTM cell runs). Backward: per step the fused cell's backward and one GEMM for the hidden state's
    gradient, then one GEMM for the recurrent weights' gradient over all steps, as cuDNN's backward-weights call
    does. Autograd of an unrolled loop would instead compute and accumulate a weight gradient per step (a 16 MB
    GEMM output and add per step at hidden size 1024), which no GPU library runs. Shapes: ``gates_in`` (T, N, 4H),
    ``w_hh`` (4H, H), biases (4H,); returns (T, N, H)."""

    @staticmethod
    def forward(ctx, gates_in, w_hh, b_ih, b_hh, reverse):
        steps, n, gates = gates_in.shape
        h = gates_in.new_zeros(n, gates // 4)
        c = gates_in.new_zeros(n, gates // 4)
        hs, cs, ws, h_prev, c_prev = ([None] * steps for _ in range(5))
        for t in range(steps - 1, -1, -1) if reverse else range(steps):
            h_prev[t], c_prev[t] = h, c
            h, c, ws[t] = torch.ops.aten._thnn_fused_lstm_cell(gates_in[t], torch.mm(h, w_hh.t()), c, b_ih, b_hh)
            hs[t], cs[t] = h, c
        ctx.reverse, ctx.steps = reverse, steps
        ctx.save_for_backward(w_hh, *h_prev, *c_prev, *cs, *ws)
        return torch.stack(hs)

    @staticmethod
    def backward(ctx, grad_out):
        steps = ctx.steps
        w_hh, *saved = ctx.saved_tensors
        h_prev, c_prev, cs, ws = (saved[i * steps:(i + 1) * steps] for i in range(4))
        grad_h = torch.zeros_like(grad_out[0])
        grad_c = torch.zeros_like(grad_out[0])
        d_gates = [None] * steps
        for t in range(steps) if ctx.reverse else range(steps - 1, -1, -1):
            d_gates[t], grad_c, _ = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
                grad_out[t] + grad_h, grad_c, c_prev[t], cs[t], ws[t], True)
            grad_h = torch.mm(d_gates[t], w_hh)
        flat = torch.stack(d_gates).flatten(0, 1)  # (T N, 4H)
        grad_w = torch.mm(flat.t(), torch.stack(h_prev).flatten(0, 1))
        grad_b = flat.sum(0)
        return flat.view(steps, -1, flat.shape[1]), grad_w, grad_b, grad_b, None


class _BiLSTM(nn.Module):
    """A bidirectional LSTM layer (cuDNN's structure, ``_LSTMRecurrence``) whose two directions' outputs are summed,
    as deepspeech.pytorch's BatchRNN sums them. (T, N, n_in) -> (T, N, hidden)."""

    def __init__(self, n_in: int, hidden: int):
        super().__init__()
        # Each direction's tensors apart: slices of one tensor would add their gradients into it, a kernel cuDNN's
        # single weight buffer does not run.
        self.w_ih = nn.ModuleList(nn.Linear(n_in, 4 * hidden, bias=False) for _ in range(2))
        self.w_hh = nn.ParameterList(torch.zeros(4 * hidden, hidden) for _ in range(2))
        self.b_ih = nn.ParameterList(torch.zeros(4 * hidden) for _ in range(2))
        self.b_hh = nn.ParameterList(torch.zeros(4 * hidden) for _ in range(2))

    def forward(self, x):
        return sum(_LSTMRecurrence.apply(self.w_ih[d](x), self.w_hh[d], self.b_ih[d], self.b_hh[d], d == 1)
                   for d in range(2))


class DeepSpeech2(nn.Module):
    """DeepSpeech2 as deepspeech.pytorch (SeanNaren) builds it, the implementation Zeus's LibriSpeech workload trains
    (Amodei et al., ICML 2016): two 2-D convolutions over the spectrogram (32 channels, 41x11 stride 2x2 and 21x11
    stride 2x1, each with batch norm and a hardtanh), five bidirectional LSTM layers of 1024 units (the
    directions summed, batch norm before each but the first), batch norm and a 29-way linear layer over the
    characters. Input (N, 1, 161, frames): a 161-bin spectrogram (20 ms windows at 16 kHz), 10 ms a frame."""

    def __init__(self, n_freq: int = 161, hidden: int = 1024, layers: int = 5, n_chars: int = 29):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), stride=(2, 2), padding=(20, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
            nn.Conv2d(32, 32, (21, 11), stride=(2, 1), padding=(10, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20))
        n_in = 32 * ((((n_freq + 1) // 2) + 1) // 2)
        self.norms = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(layers - 1))
        self.rnns = nn.ModuleList(_BiLSTM(n_in if i == 0 else hidden, hidden) for i in range(layers))
        self.fc = nn.Sequential(nn.BatchNorm1d(hidden), nn.Linear(hidden, n_chars, bias=False))

    def forward(self, x):
        x = self.conv(x)
        n, c, f, t = x.shape
        x = x.view(n, c * f, t).permute(2, 0, 1).contiguous()  # (T, N, C F)
        for i, rnn in enumerate(self.rnns):
            if i:
                steps, n, h = x.shape
                x = self.norms[i - 1](x.view(steps * n, h)).view(steps, n, h)
            x = rnn(x)
        steps, n, h = x.shape
        return self.fc(x.view(steps * n, h))  # (T N, characters)


# The utterance a DeepSpeech2 step is traced at, in 10 ms frames (assumed: 1 s). LibriSpeech's utterances average
# about 12 s (Panayotov et al., ICASSP 2015: 960 h in 281k utterances), but every kernel of the step but the
# optimizer's scales with the length: on the A40 file fitted on two networks, traced at 1 s and at 3 s, the time
# ratios to 300 W at 100-300 W differed by at most 0.07 (3.57 against 3.50 at 100 W, batch 16; 0.02 elsewhere). The
# trace's length bounds the fit's cost (each time step is 5 kernels per layer and direction).
DEEPSPEECH2_FRAMES = 100


def _deepspeech2_trace(batch_size: int) -> Trace:
    """One FP32 training step of DeepSpeech2 (``DeepSpeech2``) at DEEPSPEECH2_FRAMES frames with AdamW, as Zeus's
    LibriSpeech workload trains it, traced on the meta device. Its CTC loss is stood in for by a cross-entropy over
    the same (T N, 29) outputs (assumed: either is a few small kernels of a step of thousands)."""
    import freqopt

    with torch.device("meta"):
        model = DeepSpeech2()
        spectrogram = torch.randn(batch_size, 1, 161, DEEPSPEECH2_FRAMES)
        labels = torch.randint(0, 29, (batch_size * (DEEPSPEECH2_FRAMES // 2),))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

    def step():
        F.cross_entropy(model(spectrogram), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    return freqopt.trace_step(step, name="deepspeech2-librispeech", module=model, micro_batch_size=batch_size)


SENTIMENT140_SEQ_LEN = 128  # assumed: the tweets are at most 140 characters; 128 tokens is Hugging Face's usual cap


def _bert_trace(batch_size: int) -> Trace:
    """One FP32 training step of a bert-base-shaped encoder (Devlin et al. 2019: 12 layers, 768, 12 heads,
    bidirectional attention) at SENTIMENT140_SEQ_LEN tokens with a 2-way sentiment head standing in for the
    vocabulary head (the embedding lookup's gradient is not modelled), as v100.bert_squad_trace."""
    from freqopt.workload.models import GPTConfig, Workload
    from freqopt.workload.trace import trace_training_iteration

    config = GPTConfig(n_layers=12, d_model=768, n_heads=12, vocab_size=2, seq_len=SENTIMENT140_SEQ_LEN,
                       causal=False, vocab_multiple=1)  # fmt: skip
    return trace_training_iteration(Workload("bert-base-sentiment140", config, batch_size), dtype=torch.float32)


# Zeus network name -> the builder of its traced FP32 training step at a batch size.
NETWORKS = {"shufflenetv2": _shufflenet_trace, "bert_base_uncased": _bert_trace, "deepspeech2": _deepspeech2_trace}


@lru_cache(maxsize=None)
def network_trace(network: str, batch_size: int, dataset: str | None = None) -> Trace:
    """The traced training step of a Zeus network (``NETWORKS``), cached in-process; bert-base on SQuAD is
    v100.bert_squad_trace's (sequence 384, a span head), on any other dataset Sentiment140's shape.

    Raises:
        KeyError: a network with no trace builder here.
    """
    if network == "bert_base_uncased" and dataset == "squad":
        from freqopt.gpu.calibration.v100 import bert_squad_trace

        return bert_squad_trace(batch_size)
    return NETWORKS[network](batch_size)


# -- simulation ----------------------------------------------------------------------------------------------------


def waiting_power_top_w(spec: GPUSpec) -> float:
    """What the GPU draws waiting for the host at its highest clocks, W (physics.waiting_power_w)."""
    return float(waiting_power_w(spec, spec.max_mem_clock_mhz)[0, -1])


def simulate_sweep(spec: GPUSpec, trace: Trace, power_limit_w: np.ndarray) -> tuple[np.ndarray, ...]:
    """(time_s, energy_j, limit_met), each shape (L,): one training step's kernels (the host's launches included)
    under each power limit, noiseless, without the step's host gap; ``limit_met`` False where the firmware found no
    clock that holds the limit and ran the lowest (Measurement.power_limit_met)."""
    sim = SimulatedGPU(spec, noise=False)
    out = [sim.true_measure(trace.kernels, ClockSetting(power_limit_w=float(w))) for w in power_limit_w]
    met = np.array([getattr(m, "power_limit_met", None) is not False for m in out])
    return np.array([m.time_s for m in out]), np.array([m.energy_j for m in out]), met


def anchored_host_gap_s(spec: GPUSpec, sweep: ZeusSweep, gpu_time_s: np.ndarray, gpu_energy_j: np.ndarray) -> float:
    """The host gap per step, s, at which the simulated average power at the sweep's highest limit equals the
    measured one: ``(E - P t) / (P - P_wait)`` with the GPU's waiting power P_wait; 0 where the simulated step
    alone draws no more than measured, at most 20 steps' GPU time where the measured power is at the waiting power."""
    p, e, t = sweep.average_power_w[-1], gpu_energy_j[-1], gpu_time_s[-1]
    p_wait = waiting_power_top_w(spec)
    if p <= p_wait:
        return 20.0 * t
    return float(np.clip((e - p * t) / (p - p_wait), 0.0, 20.0 * t))


def sweep_errors(spec: GPUSpec, sweep: ZeusSweep, host_gap_s: float | None = None, trace: Trace | None = None) -> dict:
    """Measured against simulated for one Zeus sweep on ``spec``.

    Args:
        spec: the GPU type.
        sweep: one (network, batch size) sweep.
        host_gap_s: the host gap per step, s; None: ``anchored_host_gap_s`` (from the highest limit's power).
        trace: the step's trace; default ``network_trace(sweep.network, sweep.batch_size, sweep.dataset)``
            (cached).

    Returns:
        dict with ``sweep``, ``host_gap_s``, ``points`` (per limit: power_limit_w, time_rel and energy_rel
        measured / simulated / error_pp, avg_power measured / simulated (W), ``limit_met_measured`` /
        ``limit_met_simulated``: the average at most the limit + 1 W; ``firmware_limit_met_simulated``: False where
        the lowest clock could not hold the limit), ``energy_optimal_measured_w``,
        ``energy_optimal_simulated_w`` and ``energy_optimal_error_w``; relative figures are to the highest limit.

    Raises:
        KeyError: a network with no trace builder (NETWORKS).
    """
    trace = trace if trace is not None else network_trace(sweep.network, sweep.batch_size, sweep.dataset)
    t_gpu, e_gpu, firmware_met = simulate_sweep(spec, trace, sweep.power_limit_w)
    gap = anchored_host_gap_s(spec, sweep, t_gpu, e_gpu) if host_gap_s is None else float(host_gap_s)
    t_sim = t_gpu + gap
    e_sim = e_gpu + gap * waiting_power_top_w(spec)
    p_sim = e_sim / t_sim
    tr_m, er_m = sweep.time_per_epoch_s / sweep.time_per_epoch_s[-1], sweep.energy_j / sweep.energy_j[-1]
    tr_s, er_s = t_sim / t_sim[-1], e_sim / e_sim[-1]
    points = [{"power_limit_w": float(w), "time_rel_measured": float(a), "time_rel_simulated": float(b),
               "time_rel_error_pp": float(100 * (b - a)), "energy_rel_measured": float(c),
               "energy_rel_simulated": float(d), "energy_rel_error_pp": float(100 * (d - c)),
               "avg_power_measured_w": float(pm), "avg_power_simulated_w": float(ps),
               "limit_met_measured": bool(pm <= w + 1.0), "limit_met_simulated": bool(ps <= w + 1.0),
               "firmware_limit_met_simulated": bool(ok)}
              for w, a, b, c, d, pm, ps, ok in zip(sweep.power_limit_w, tr_m, tr_s, er_m, er_s, sweep.average_power_w,
                                                    p_sim, firmware_met)]  # fmt: skip
    opt_m = float(sweep.power_limit_w[np.argmin(sweep.energy_j)])
    opt_s = float(sweep.power_limit_w[np.argmin(e_sim)])
    return {"sweep": sweep.name, "gpu": spec.name, "host_gap_s": gap, "gpu_step_s": float(t_gpu[-1]),
            "points": points, "energy_optimal_measured_w": opt_m, "energy_optimal_simulated_w": opt_s,
            "energy_optimal_error_w": opt_s - opt_m}  # fmt: skip


def summarize(result: dict) -> dict:
    """The worst absolute time and energy ratio errors (pp), the worst average-power error (W) and the optimum's
    miss (W) of a ``sweep_errors`` result."""
    pts = result["points"]
    return {
        "max_abs_time_rel_error_pp": max(abs(p["time_rel_error_pp"]) for p in pts),
        "max_abs_energy_rel_error_pp": max(abs(p["energy_rel_error_pp"]) for p in pts),
        "max_abs_avg_power_error_w": max(abs(p["avg_power_simulated_w"] - p["avg_power_measured_w"]) for p in pts),
        "energy_optimal_error_w": result["energy_optimal_error_w"],
    }


def summary_row(label: str, summary: dict) -> str:
    """One Markdown row of a ``summarize`` result: label, worst time and energy (pp), optimum miss and worst average
    power (W), the columns of the fit reports (experiments/fit_a40_power.py, fit_zeus_power.py)."""
    s = summary
    return (f"| {label} | {s['max_abs_time_rel_error_pp']:.2f} | {s['max_abs_energy_rel_error_pp']:.2f} | "
            f"{s['energy_optimal_error_w']:+.0f} | {s['max_abs_avg_power_error_w']:.1f} |")


def per_limit_tables(results: dict[str, dict]) -> list[str]:
    """Markdown lines: per sweep (name -> ``sweep_errors`` result) a heading with its host gap and GPU step and a
    table of each limit's measured and simulated ratios and average power."""
    out = []
    for name, rows in results.items():
        out += [f"### {name} (host gap {1e3 * rows['host_gap_s']:.1f} ms per step, simulated GPU step "
                f"{1e3 * rows['gpu_step_s']:.1f} ms)", "",
                "| limit (W) | t rel measured | simulated | energy rel measured | simulated | P measured (W) | "
                "simulated (W) |", "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for p in rows["points"]:
            out.append(f"| {p['power_limit_w']:.0f} | {p['time_rel_measured']:.3f} | {p['time_rel_simulated']:.3f} | "
                       f"{p['energy_rel_measured']:.3f} | {p['energy_rel_simulated']:.3f} | "
                       f"{p['avg_power_measured_w']:.1f} | {p['avg_power_simulated_w']:.1f} |")
        out.append("")
    return out


# -- the joint fit -------------------------------------------------------------------------------------------------


def _bounds(spec: GPUSpec, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from freqopt.gpu.calibration.dvfs import TIME_PARAMETERS

    b = dict(spec.power_model_bounds)
    lo_f, hi_f = b["f_knee_mhz"]
    b["f_knee_rel"] = (lo_f / spec.max_sm_clock_mhz, hi_f / spec.max_sm_clock_mhz)
    b.update(TIME_PARAMETERS)
    return np.array([b[n][0] for n in names], dtype=float), np.array([b[n][1] for n in names], dtype=float)


def baseline_top_w(spec: GPUSpec) -> float:
    """The power model's board power with nothing running at the highest SM and memory clocks, W: its static floor,
    leakage and clock-tree power at the top voltage and its memory clock's power. A GPU blocked in a P2P receive
    draws this (Perseus measured it: 83.64 W on the A100 SXM, 70.38 W on the A40, the files' [waiting_power]
    top_clocks_w)."""
    pm = spec.power_model
    return pm.p_const_w + pm.p_leak_w + pm.p_sm_clock_w + pm.p_mem_clock_w


def voltage_prior(sibling: GPUSpec) -> dict[str, float]:
    """The family prior ``fit`` takes from a fitted sibling: its voltage curve's ``v_min_rel`` and its knee relative
    to its highest SM clock (``f_knee_rel``)."""
    pm = sibling.power_model
    return {"v_min_rel": pm.v_min_rel, "f_knee_rel": pm.f_knee_mhz / sibling.max_sm_clock_mhz}


def fit(spec: GPUSpec, stages: list, sweeps: list[ZeusSweep], *, prior: dict[str, float] | None = None,
        time_parameters: tuple[str, ...] = ("gemm_efficiency", "link_efficiency", "l2_bytes_per_clock"),
        max_nfev: int = 60,
        start: dict[str, float] | None = None, stage_clock_stride: int = 3,
        top_power_weight: float = 0.5, blocking_power_w: float | None = None) -> tuple[GPUSpec, object]:  # fmt: skip
    """Least-squares fit of FIT_PARAMETERS and ``time_parameters`` to ``stages`` (Perseus: (dvfs.Stage,
    dvfs.Sweep) pairs; time and energy ratios to the top clock at every ``stage_clock_stride``-th clock counted down
    from the top, and the top clock's power, relative, at ``top_power_weight``) and
    ``sweeps`` (Zeus: time and energy ratios to the highest limit, and the average power at POWER_WEIGHT, relative;
    host gaps anchored), all in fractions, plus the family ``prior`` (name -> sibling's value, PRIOR_WEIGHT /
    PRIOR_SCALE), plus, with ``blocking_power_w`` (a measured P2P-blocking power at the highest clocks, W), the
    relative miss of ``baseline_top_w`` from it at BLOCKING_WEIGHT. Every parameter is bounded by
    ``spec.power_model_bounds``; the start is ``start`` (default FIT_START) clipped into them.

    Returns:
        (the fitted spec, scipy's OptimizeResult).
    """
    from scipy.optimize import least_squares

    from freqopt.gpu.calibration import dvfs as cd

    names = list(FIT_PARAMETERS) + list(time_parameters)
    lower, upper = _bounds(spec, names)
    start = {**FIT_START, **(start or {})}
    x0 = np.clip([start[n] for n in names], lower + 1e-6 * (upper - lower), upper - 1e-6 * (upper - lower))
    prior = prior or {}
    stages = [(stage, cd.Sweep(sw.sm_clock_mhz[::-stage_clock_stride][::-1], sw.time_s[::-stage_clock_stride][::-1],
                               sw.energy_j[::-stage_clock_stride][::-1])) for stage, sw in stages]  # fmt: skip
    traces = {s.label: network_trace(s.network, s.batch_size, s.dataset) for s in sweeps}

    def fun(x):
        cand = cd.with_values(spec, dict(zip(names, x)))
        out = []
        for stage, sw in stages:
            t, e, _ = cd.simulate_stage(cand, stage, sw)
            out.append(t / t[-1] - sw.time_s / sw.time_s[-1])
            out.append(e / e[-1] - sw.energy_j / sw.energy_j[-1])
            out.append([top_power_weight * ((e[-1] / t[-1]) / (sw.energy_j[-1] / sw.time_s[-1]) - 1)])
        for sw in sweeps:
            r = sweep_errors(cand, sw, trace=traces[sw.label])["points"]
            out.append([p["time_rel_error_pp"] / 100 for p in r[:-1]])
            out.append([p["energy_rel_error_pp"] / 100 for p in r[:-1]])
            out.append([POWER_WEIGHT * (p["avg_power_simulated_w"] / p["avg_power_measured_w"] - 1) for p in r])
        values = dict(zip(names, x))
        out.append([PRIOR_WEIGHT * (values[k] - v) / PRIOR_SCALE[k] for k, v in prior.items()])
        if blocking_power_w is not None:
            out.append([BLOCKING_WEIGHT * (baseline_top_w(cand) / blocking_power_w - 1)])
        return np.concatenate(out)

    # 2 % finite-difference steps: the firmware's window boundaries move in steps that tiny steps do not see.
    result = least_squares(fun, x0, bounds=(lower, upper), x_scale=(upper - lower) / 10, diff_step=0.02,
                           max_nfev=max_nfev)  # fmt: skip
    return cd.with_values(spec, dict(zip(names, result.x))), result
