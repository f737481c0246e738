"""The simulated GPU's physics: kernel time by a roofline with partial overlap, board power by the DVFS power model,
all-reduce link costs, two streams overlapped, and the host that issues kernels (the formulas and their sources are
in freqopt.gpu.backends.simulated's module docstring; SimulatedGPU there runs the measurement loop on top of them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel

__all__ = ["KernelPhysics", "KernelTerms", "waiting_power_w", "SetCallQueue", "host_gaps", "host_issue_s", "gemm_inner_dim",
           "gemm_shape", "gemm_efficiency", "gemm_work", "gemm_output_bytes", "conv_channels", "voltage_rel", "bandwidth_rel",
           "attention_efficiency", "attention_head_dim", "attention_key_length", "attention_work", "attention_fixed_s",
           "SFU_OPS", "ATTENTION_BACKWARD_WORK", "CAUSAL_WORK_FRACTION", "ATTENTION_HEAD_DIM_TILE", "ATTENTION_SEQ_TILE",
           "CONV_CHANNEL_MULTIPLE", "CONV_DIRECTIONS", "MULTI_TENSOR", "MULTI_TENSOR_PREFIXES",
           "ROW_WIDTH_REF", "conv_is_3x3_stride1"]

CAUSAL_WORK_FRACTION = 0.5  # FlashAttention skips the fully masked key blocks: about half the work (Dao 2022)
# cuDNN's fused attention on sm90 computes on head-dimension tiles of 64 or 128: the kernels of the measured H100
# steps are named ..._64x128x64_... for head dimension 64 and ..._64x128x128_... for 80 and 128
# (experiments/data/h100/whole_steps, top_kernels); a head dimension between is zero-padded to the next tile.
ATTENTION_HEAD_DIM_TILE = 64
# Fused attention walks the sequence in blocks of 128 query and 128 key rows (the same kernel names: 64x128 and
# 128x128 CTA tiles; FlashAttention-2 uses 128-row blocks, Dao 2023, arXiv 2307.08691, sec. 3.3): a sequence is
# padded to the next block (ViT's 197 tokens run as 256).
ATTENTION_SEQ_TILE = 128
# cuDNN runs a 16-bit convolution on tensor cores with channels padded to a multiple of 8 (NHWC; cuDNN's developer
# guide, "Tensor Core operations": channel counts a multiple of 8 for FP16/BF16): ResNet's 3-channel stem computes on 8.
CONV_CHANNEL_MULTIPLE = 8
CONV_FORWARD = ("aten.convolution", "aten._convolution")
CONV_INPUT = "aten.convolution_backward_input"  # freqopt.workload.trace: a convolution's data gradient
CONV_WEIGHT = "aten.convolution_backward_weight"  # and its weight gradient (and bias), a kernel each
# GPUSpec.conv_efficiency_rel's keys: the three convolutions of a layer, by the kernel that runs them.
CONV_DIRECTIONS = {"aten.convolution": "forward", "aten._convolution": "forward", CONV_INPUT: "input",
                   CONV_WEIGHT: "weight"}


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
_GEMM_OPERANDS = {"aten.mm": 0, "aten.bmm": 0, "aten.addmm": 1, "aten.baddbmm": 1}  # index of the first matrix


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def conv_channels(kernel: Kernel) -> tuple[int, int]:
    """(C_in per group, padded to CONV_CHANNEL_MULTIPLE for a 16-bit kernel; C_in per group): the channels a
    convolution kernel computes on and has, from its weight (C_out, C_in / groups, kh, kw)."""
    weight = kernel.shapes[1] if kernel.name in CONV_FORWARD else kernel.shapes[2]
    c = int(weight[1])
    return (_padded(c, CONV_CHANNEL_MULTIPLE) if kernel.tensor_core else c), c


def gemm_shape(kernel: Kernel) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of the matrix multiply a GEMM kernel runs, or None for another kernel (or shapes it cannot
    read). K is the reduced dimension. A convolution is cuDNN's implicit GEMM (Chetlur et al. 2014, "cuDNN",
    arXiv 1410.0759): forward M = N H_out W_out, N = C_out, K = C_in / groups x kh x kw; its data gradient
    M = N H W, N = C_in, K = C_out x kh x kw; its weight gradient M = C_out, N = C_in / groups x kh x kw,
    K = N H_out W_out; C_in padded as ``conv_channels`` says. H_out W_out comes from the FLOPs."""
    shapes = kernel.shapes
    direction = CONV_DIRECTIONS.get(kernel.name)
    if direction is not None:
        try:
            x = shapes[0] if direction == "forward" else shapes[1]
            weight = shapes[1] if direction == "forward" else shapes[2]
            c_out, window = int(weight[0]), int(np.prod(weight[2:]))
            padded, c_in = conv_channels(kernel)
            batch = int(x[0])
            out_hw = kernel.flops / (2.0 * batch * c_out * c_in * window)  # H_out x W_out
            if direction == "forward":
                return 1, round(batch * out_hw), c_out, padded * window
            if direction == "input":
                return 1, int(np.prod(x)) // int(x[1]), padded, c_out * window
            return 1, c_out, padded * window, round(batch * out_hw)
        except (IndexError, ValueError, ZeroDivisionError):
            return None
    first = _GEMM_OPERANDS.get(kernel.name)
    if first is None or len(shapes) <= first + 1 or len(shapes[first]) < 2 or len(shapes[first + 1]) < 2:
        return None
    a, b = shapes[first], shapes[first + 1]
    return int(np.prod(a[:-2])) if len(a) > 2 else 1, int(a[-2]), int(b[-1]), int(a[-1])


def conv_is_3x3_stride1(kernel: Kernel) -> bool:
    """Whether a convolution kernel has a 3x3 window at stride 1: its weight (C_out, C_in / groups, 3, 3) and as many
    output positions per image as input ones (the "same" padding of a 3x3 layer; from its FLOPs, as ``gemm_shape``
    reads them). False for another kernel or shapes it cannot read."""
    direction = CONV_DIRECTIONS.get(kernel.name)
    if direction is None:
        return False
    try:
        x = kernel.shapes[0] if direction == "forward" else kernel.shapes[1]
        weight = kernel.shapes[1] if direction == "forward" else kernel.shapes[2]
        if tuple(int(d) for d in weight[2:]) != (3, 3):
            return False
        out_hw = kernel.flops / (2.0 * int(x[0]) * int(weight[0]) * int(weight[1]) * 9)
        return abs(out_hw - int(np.prod(x[2:]))) <= 0.01 * out_hw
    except (IndexError, ValueError, ZeroDivisionError):
        return False


def gemm_inner_dim(kernel: Kernel) -> int | None:
    """K of a GEMM kernel (``gemm_shape``'s reduced dimension), None for other kernels."""
    shape = gemm_shape(kernel)
    return shape[3] if shape else None


def gemm_efficiency(spec: GPUSpec, kernel: Kernel) -> float:
    """Fraction of tensor (or CUDA-core) peak a GEMM kernel's main loop reaches on its (padded) work:
    ``gemm_efficiency * K / (K + gemm_k_overhead)`` with K its inner dimension (``gemm_shape``), times
    ``conv_efficiency_rel`` of its direction for a convolution (and of ``<direction>_small_channels`` where its input
    channels are padded, ``conv_channels``: ResNet's 3-channel stem). Where the GPU type states
    ``gemm_epilogue_rel``, the store of the output is timed apart (``gemm_output_bytes``) and ``gemm_k_overhead``
    is 0: the K term was a tile's epilogue against its main loop. A convolution on CUDA cores (fp32, no tensor
    cores) runs at ``gemm_efficiency`` times ``conv_efficiency_rel`` of ``<direction>_cuda_cores``; a 3x3 window at
    stride 1 (``conv_is_3x3_stride1``: where cuDNN's heuristics choose Winograd's transforms, fewer multiplies than
    the FLOPs counted) besides at ``<direction>_3x3`` (``<direction>_3x3_cuda_cores`` on CUDA cores). Each factor is
    1 where the GPU type does not state it (fitted on the V100's DeepBench convolutions:
    freqopt.gpu.calibration.deepbench)."""
    eff = spec.gemm_efficiency
    direction = CONV_DIRECTIONS.get(kernel.name)
    if not kernel.tensor_core:
        if direction is None:
            return eff
        eff *= spec.conv_efficiency_rel.get(f"{direction}_cuda_cores", 1.0)
        if conv_is_3x3_stride1(kernel):
            eff *= spec.conv_efficiency_rel.get(f"{direction}_3x3_cuda_cores", 1.0)
        return eff
    shape = gemm_shape(kernel)
    if shape is None:
        return eff
    if spec.gemm_k_overhead > 0:
        eff *= shape[3] / (shape[3] + spec.gemm_k_overhead)
    if direction is not None:
        eff *= spec.conv_efficiency_rel.get(direction, 1.0)
        if conv_is_3x3_stride1(kernel):
            eff *= spec.conv_efficiency_rel.get(f"{direction}_3x3", 1.0)
        padded, c_in = conv_channels(kernel)
        if padded != c_in:  # fewer channels than a tensor-core tile takes: cuDNN's other kernels (ResNet's stem)
            eff *= spec.conv_efficiency_rel.get(f"{direction}_small_channels", 1.0)
    return eff


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def gemm_output_bytes(kernel: Kernel) -> float:
    """Bytes a GEMM kernel writes: its output, batch x M x N elements of its dtype (``gemm_shape``, with a
    convolution's channels unpadded); 0 for another kernel."""
    shape = gemm_shape(kernel)
    if shape is None:
        return 0.0
    batch, m, n, _ = shape
    if CONV_DIRECTIONS.get(kernel.name) in ("input", "weight"):
        padded, c_in = conv_channels(kernel)
        n = n * c_in // padded
    return float(min(batch * m * n * _ITEMSIZE.get(kernel.dtype, 2), kernel.mem_bytes))


def gemm_work(kernel: Kernel) -> float:
    """FLOPs a GEMM kernel computes: its traced FLOPs, with a 16-bit convolution's channels padded (conv_channels)."""
    if kernel.name in CONV_DIRECTIONS and kernel.tensor_core:
        padded, c_in = conv_channels(kernel)
        return kernel.flops * padded / c_in
    return kernel.flops


def host_issue_s(spec: GPUSpec, kernels: Sequence[Kernel], *, step: bool = False) -> np.ndarray:
    """Host time to issue each kernel, s, shape (K,): ``spec.host_gemm_issue_s`` for GEMMs, else
    ``spec.host_issue_s`` (both 0 where the GPU type has no host measurement): what a replay loop's host spends.
    ``step``: the kernels are a training step's, whose host also runs the framework around each kernel (autograd,
    module calls, the optimizer's Python): ``spec.step_host_s`` of the kernel's pass on top."""
    extra = spec.step_host_s if step else {}
    return np.array([(spec.host_gemm_issue_s if k.kind == "gemm" else spec.host_issue_s) + extra.get(k.pass_name, 0.0)
                     for k in kernels])  # fmt: skip


# PyTorch's multi-tensor-apply operators: the foreach ones and the fused optimizers (_fused_adam_, _fused_adamw_,
# _fused_sgd_), not every "_fused_" operator (aten._fused_rms_norm is one row-wise kernel).
MULTI_TENSOR_PREFIXES = ("aten._foreach_", "aten._fused_adam", "aten._fused_sgd")
MULTI_TENSOR = "multi_tensor"  # their key in GPUSpec.operator_bandwidth_rel
# Rows of GPT-3 Small's width (768): the layer-norm microbenchmark's (8192 x 768, experiments/data/h100) and that of
# the whole steps' smallest model, where the bandwidths relative to a copy's are stated.
ROW_WIDTH_REF = 768


def bandwidth_rel(spec: GPUSpec, kernel: Kernel) -> float:
    """The kernel's device-memory bandwidth relative to a streaming copy's.

    ``spec.layer_norm_bandwidth_rel`` for the layer-norm forward, ``spec.operator_bandwidth_rel`` by operator name
    (multi-tensor operators under MULTI_TENSOR), else 1; both at rows of ROW_WIDTH_REF elements. An operator with
    a row overhead c0 (``spec.row_overhead_elements``: one reduction per row of C elements, its first input's last
    dimension) streams at C / (C + c0) of its rate at wide rows, so at (C / (C + c0)) / (W / (W + c0)) of its rate
    at rows of W = ROW_WIDTH_REF."""
    if kernel.name == "aten.native_layer_norm":
        rel = spec.layer_norm_bandwidth_rel
    else:
        key = MULTI_TENSOR if kernel.name.startswith(MULTI_TENSOR_PREFIXES) else kernel.name
        rel = spec.operator_bandwidth_rel.get(key, 1.0)
    c0 = spec.row_overhead_elements.get(kernel.name, 0.0)
    if c0 > 0 and kernel.shapes and kernel.shapes[0]:
        width = kernel.shapes[0][-1]
        rel *= width / (width + c0) * (ROW_WIDTH_REF + c0) / ROW_WIDTH_REF
    return rel


def attention_head_dim(kernel: Kernel) -> tuple[int, int]:
    """(head dimension, the head dimension the fused kernel computes on): the last dimension of the query, and
    that rounded up to a multiple of ATTENTION_HEAD_DIM_TILE."""
    d = int(kernel.shapes[0][-1])
    return d, _padded(d, ATTENTION_HEAD_DIM_TILE)


def attention_key_length(kernel: Kernel) -> int:
    """Keys each query block of a fused attention kernel walks, on average: the key sequence (the second input's
    second-to-last dimension) padded to ATTENTION_SEQ_TILE, half of it under a causal mask."""
    keys = _padded(int(kernel.shapes[1][-2]), ATTENTION_SEQ_TILE)
    return keys // 2 if kernel.causal else keys


# Where attention_efficiency is stated: head dimension 64, 1024 keys per query block (GPT-3's causal 2048 tokens).
ATTENTION_REF_HEAD_DIM, ATTENTION_REF_KEY_LENGTH = 64, 1024


def attention_work(spec: GPUSpec, kernel: Kernel) -> float:
    """FLOPs a fused attention kernel computes: its traced FLOPs (torch.utils.flop_counter's, causal masking not
    discounted) times CAUSAL_WORK_FRACTION under a causal mask and ATTENTION_BACKWARD_WORK for a backward; where the
    GPU type models the tiles (its ``attention_head_dim_overhead`` or ``attention_key_overhead`` set), with the head
    dimension padded to ATTENTION_HEAD_DIM_TILE and the query and key sequences to ATTENTION_SEQ_TILE."""
    work = kernel.flops * (CAUSAL_WORK_FRACTION if kernel.causal else 1.0)
    if kernel.name.endswith("_backward"):
        work *= ATTENTION_BACKWARD_WORK
    if spec.attention_head_dim_overhead > 0:
        d, padded = attention_head_dim(kernel)
        work *= padded / d
    if spec.attention_key_overhead > 0:
        queries, keys = int(kernel.shapes[0][-2]), int(kernel.shapes[1][-2])
        work *= _padded(queries, ATTENTION_SEQ_TILE) * _padded(keys, ATTENTION_SEQ_TILE) / (queries * keys)
    return work


def attention_efficiency(spec: GPUSpec, kernel: Kernel) -> float:
    """Fraction of tensor peak a fused attention kernel reaches on its (padded, causal) work (``attention_work``).

    ``spec.attention_efficiency`` is the forward's rate at head dimension 64 and 1024 keys per query block
    (ATTENTION_REF_HEAD_DIM, ATTENTION_REF_KEY_LENGTH); at a padded head dimension d it scales as d / (d + d0)
    (d0 = ``spec.attention_head_dim_overhead``: the head dimension is the inner dimension of both of attention's
    matmuls, so the same per-tile overhead as a GEMM's K), and with L keys per query block (attention_key_length)
    as L / (L + L0) (L0 = ``spec.attention_key_overhead``: a query block's load, softmax rescaling and store against
    its walk over the keys), each relative to the reference; a backward kernel runs at
    ``spec.attention_backward_efficiency_rel`` of that, and a kernel of another implementation at its
    ``spec.attention_rate_rel`` (by operator name: FlashAttention-2 against cuDNN's fused attention)."""
    eff = spec.attention_efficiency or spec.gemm_efficiency
    d0, l0 = spec.attention_head_dim_overhead, spec.attention_key_overhead
    if d0 > 0:
        _, padded = attention_head_dim(kernel)
        eff *= padded / (padded + d0) * (ATTENTION_REF_HEAD_DIM + d0) / ATTENTION_REF_HEAD_DIM
    if l0 > 0:
        keys = attention_key_length(kernel)
        eff *= keys / (keys + l0) * (ATTENTION_REF_KEY_LENGTH + l0) / ATTENTION_REF_KEY_LENGTH
    if kernel.name.endswith("_backward"):
        eff *= spec.attention_backward_efficiency_rel
    return eff * spec.attention_rate_rel.get(kernel.name, 1.0)


def attention_fixed_s(spec: GPUSpec, kernel: Kernel) -> float:
    """Time a fused attention kernel spends besides its tiles, s: ``spec.attention_fixed_s`` (forward, backward:
    the backward's pre- and post-passes, dO.O and the dQ conversion, run as kernels of their own: the measured H100
    steps launch three per attention backward), over the kernel's ``attention_rate_rel``."""
    fixed = spec.attention_fixed_s[1 if kernel.name.endswith("_backward") else 0]
    return fixed / spec.attention_rate_rel.get(kernel.name, 1.0)


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


class KernelTerms:
    """The parts of KernelPhysics that depend on the kernels and the GPU type but not on the memory clock, each
    (K, 1) or (K, F) as in KernelPhysics: the compute side's times at every SM clock (``t_ideal_s``: at the best
    GEMM's rate; ``t_sm_s``: FLOPs and L2 traffic overlapped), bytes moved, bandwidth relative to a copy's, the
    all-reduce link costs, fixed GEMM time and operator power. Computed once per kernel list, they are most of
    KernelPhysics's cost (a Python pass over the kernels)."""

    def __init__(self, spec: GPUSpec, kernels: Sequence[Kernel]):
        p = spec.overlap_exponent
        f = np.asarray(spec.sm_clocks_mhz, dtype=float)[None, :]  # (1, F)
        work, efficiency = [], []  # FLOPs the GPU runs; fraction of peak it reaches on them
        fixed = []  # time besides the tiles, s
        for k in kernels:
            if k.kind == "attention":
                work.append(attention_work(spec, k))
                efficiency.append(attention_efficiency(spec, k))
                fixed.append(attention_fixed_s(spec, k))
            elif k.kind == "gemm":
                work.append(gemm_work(k))
                efficiency.append(gemm_efficiency(spec, k))
                fixed.append(spec.gemm_fixed_s)
            else:
                work.append(k.flops)
                efficiency.append(spec.gemm_efficiency)
                fixed.append(0.0)
        work, efficiency = np.array(work)[:, None], np.array(efficiency)[:, None]  # (K, 1) each
        per_clock = np.array(
            [spec.tensor_flops_per_clock_per_sm if k.tensor_core else spec.cuda_flops_per_clock_per_sm for k in kernels]
        )[:, None]
        self.nbytes = np.array([k.mem_bytes for k in kernels])[:, None]
        # A GEMM's output, stored after its main loop where the GPU type says so (gemm_epilogue_rel), else 0.
        self.out_bytes = np.array([gemm_output_bytes(k) if spec.gemm_epilogue_rel > 0 and k.kind == "gemm" else 0.0
                                   for k in kernels])[:, None]  # fmt: skip
        self.link_s, self.latency_s, self.link_j = _link_costs(spec, kernels)  # (K, 1) each
        # A collective's loads and stores go through the few SMs NCCL runs on, not the whole GPU.
        sm_share = np.array([spec.interconnect.nccl_sms / spec.n_sms if k.is_collective else 1.0 for k in kernels])
        peak = spec.n_sms * per_clock * f * 1e6  # (K, F), FLOP/s
        self.t_ideal_s = work / (peak * spec.gemm_efficiency)  # (K, F): at the best GEMM's rate
        t_flops = work / (peak * efficiency)  # (K, F)
        # A GEMM's main loop waits on memory for gemm_unclocked_share of its time at the highest SM clock: that part
        # does not stretch as the clock falls (GPUSpec.gemm_unclocked_share). The best GEMM's time at a clock (t_ideal,
        # against which the SM activity is counted) follows the same law, so that it stays fully active at any clock.
        share = np.array([spec.gemm_unclocked_share if k.kind == "gemm" else 0.0 for k in kernels])[:, None]  # (K, 1)
        if share.any():
            f_max = float(spec.max_sm_clock_mhz)
            stretch = (1.0 - share) + share * f / f_max  # (K, F): 1 at f_max
            t_flops = t_flops * stretch
            self.t_ideal_s = self.t_ideal_s * stretch
        t_l2 = self.nbytes / (spec.l2_bytes_per_clock * sm_share[:, None] * f * 1e6)  # (K, F)
        self.t_sm_s = (t_flops**p + t_l2**p) ** (1 / p)  # (K, F)
        self.bandwidth_rel = np.array([bandwidth_rel(spec, k) for k in kernels])[:, None]
        self.gemm_fixed_s = np.array(fixed)[:, None]  # GEMMs' and attention's time besides their tiles
        pm = spec.power_model
        self.op_w = np.array([pm.p_attention_w if k.kind == "attention" else pm.p_norm_w if k.kind == "normalization"
                              else pm.p_sfu_w if k.name in SFU_OPS else 0.0 for k in kernels])[:, None]  # fmt: skip


class KernelPhysics:
    """Per-kernel time and power at every supported SM clock, for one list of kernels.

    Arrays are (K, F): K kernels, F supported SM clocks (ascending), at each kernel's memory clock:
    ``time_s``, ``power_w``, ``energy_j``, ``baseline_power_w`` (the loaded power model's board power with no
    activity at that clock: constant, leakage and clock-tree terms, on which a kernel's activity adds), and
    ``wait_power_w`` (what the GPU draws waiting at that clock with nothing to run: between host launches and
    blocked in a receive; waiting_power_w).

    A tensor-core kernel's SM activity is its FLOP rate over the rate of the best large GEMM at that clock
    (``gemm_efficiency`` of peak), so a GEMM with a short inner dimension, or attention, draws less per clock and
    throttles less under the power limit, as measured on the H100 (../shared/calibration/h100).
    """

    def __init__(self, spec: GPUSpec, kernels: Sequence[Kernel], mem_clock_mhz: np.ndarray, *,
                 terms: KernelTerms | None = None):  # fmt: skip
        """``terms``: ``KernelTerms(spec, kernels)`` computed earlier, for a caller that evaluates the same kernels
        at many memory clocks (freqopt.gpu.backends.simulated caches them); the results are the same."""
        self.spec = spec
        terms = terms if terms is not None else KernelTerms(spec, kernels)
        p = spec.overlap_exponent
        m = np.asarray(mem_clock_mhz, dtype=float)[:, None]  # (K, 1)
        t_ideal, t_sm, nbytes, slow = terms.t_ideal_s, terms.t_sm_s, terms.nbytes, terms.bandwidth_rel
        link_s, latency_s, link_j, op_w = terms.link_s, terms.latency_s, terms.link_j, terms.op_w
        bandwidth = spec.mem_bandwidth_gbs * 1e9 * m / spec.max_mem_clock_mhz  # (K, 1), B/s
        t_stream = nbytes / (bandwidth * spec.mem_efficiency)  # (K, 1): at a streaming copy's rate
        t_out = terms.out_bytes / (bandwidth * spec.mem_efficiency)  # (K, 1): a GEMM's output store
        t_dram = (t_stream - t_out) / slow  # (K, 1): the rest, overlapped with the SMs' work
        t_busy = (t_sm**p + t_dram**p + link_s**p) ** (1 / p) + spec.gemm_epilogue_rel * t_out  # (K, F)
        self.time_s = t_busy + latency_s + spec.kernel_fixed_s + terms.gemm_fixed_s  # (K, F)
        u_sm = t_ideal / self.time_s
        u_mem = t_stream / self.time_s  # bytes moved over what a copy would move meanwhile
        pm = spec.power_model
        f = np.asarray(spec.sm_clocks_mhz, dtype=float)[None, :]  # (1, F)
        v = voltage_rel(spec, f)  # (1, F)
        f_rel = f / spec.max_sm_clock_mhz
        m_rel = m / spec.max_mem_clock_mhz
        self.baseline_power_w = pm.p_const_w + pm.p_leak_w * v + pm.p_sm_clock_w * v**2 * f_rel + pm.p_mem_clock_w * m_rel
        self.wait_power_w = np.broadcast_to(waiting_power_w(spec, m), self.baseline_power_w.shape)  # (K, F)
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


def overlap_streams(
    kernels: Sequence[Kernel], time_s: np.ndarray, energy_j: np.ndarray, baseline_w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Lay the kernels on a training stream and a communication stream (freqopt.gpu.backends.simulated's module
    docstring) and return, per kernel, the wall time it adds (a communication kernel: only its exposed part) and
    its energy (overlapped: only its power above ``baseline_w``). Shapes (K,); the sums are the iteration's wall time and energy."""
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


def waiting_power_w(spec: GPUSpec, mem_clock_mhz: np.ndarray | float) -> np.ndarray:
    """Board power (W) of a GPU waiting with nothing to run (between host launches, blocked in a receive) at every
    supported SM clock, shape (M, F) for M memory clocks (MHz) and the F SM clocks of ``spec`` (ascending):
    ``spec.waiting_power``'s model (freqopt.gpu.specs.WaitingPower: a measured figure at the highest clocks with a
    share that scales with V^2 f, or the power model's baseline), its clock-dependent part scaled by
    ``WaitingPower.clock_scale`` (0: every clock waits at the highest clock's figure). Never below 0."""
    pm, wp = spec.power_model, spec.waiting_power
    f = np.asarray(spec.sm_clocks_mhz, dtype=float)[None, :]  # (1, F)
    m_rel = np.asarray(mem_clock_mhz, dtype=float).reshape(-1, 1) / spec.max_mem_clock_mhz  # (M, 1)
    v = voltage_rel(spec, f)
    v2f = v**2 * f / spec.max_sm_clock_mhz  # (1, F), 1 at the highest clock
    if wp.top_clocks_w is None:
        fixed_w = pm.p_const_w + pm.p_mem_clock_w * m_rel
        top_w, clock_w = pm.p_leak_w + pm.p_sm_clock_w, pm.p_leak_w * v + pm.p_sm_clock_w * v2f
    else:
        fixed_w = wp.top_clocks_w * (1.0 - wp.clock_share) - pm.p_mem_clock_w * (1.0 - m_rel)
        top_w = wp.top_clocks_w * wp.clock_share
        clock_w = top_w * v2f
    return np.maximum(fixed_w + top_w - wp.clock_scale * (top_w - clock_w), 0.0)


def voltage_rel(spec: GPUSpec, sm_clock_mhz: np.ndarray | float) -> np.ndarray:
    """V(f) / V_max: flat at v_min_rel up to the knee, then linear to 1 at the highest SM clock."""
    pm = spec.power_model
    f = np.asarray(sm_clock_mhz, dtype=float)
    rise = (f - pm.f_knee_mhz) / (spec.max_sm_clock_mhz - pm.f_knee_mhz)
    return pm.v_min_rel + (1.0 - pm.v_min_rel) * np.clip(rise, 0.0, 1.0)


class SetCallQueue:
    """One runtime thread serving clock-set requests one at a time.

    NVML serves set calls one at a time, each blocking its caller ``call_s`` (GPUSpec.nvml_call_s, the slow end of
    the GPU file's [actuation] nvml_call_ms); a request made while the thread is busy waits, and one still waiting
    when a newer request arrives is dropped (freqopt.apply.runtime's worker applies only the latest request the GPU
    has reached). The call serving a request starts at ``submit``'s time; the setting lands one switch latency
    (GPUSpec.clock_switch_s, which includes the call) after that. With ``call_s`` 0 every request is served as it is
    made.

    Requests must be submitted in time order; times in s on any one origin (``shift`` moves it).
    """

    def __init__(self, call_s: float):
        self.call_s = call_s
        self.last_start_s = -np.inf  # when the call serving the latest kept request starts
        self.free_s = -np.inf  # when the thread is free for the next call

    def submit(self, at_s: float) -> tuple[float, bool]:
        """The time the call serving a request made at ``at_s`` starts, and whether that request supersedes the one
        before it (still waiting at ``at_s``, so dropped: the new one takes its place in the queue)."""
        if self.last_start_s > at_s:
            return self.last_start_s, True
        start = max(at_s, self.free_s)
        self.last_start_s, self.free_s = start, start + self.call_s
        return start, False

    def shift(self, by_s: float) -> None:
        """Move the origin: every time decreases by ``by_s``."""
        self.last_start_s -= by_s
        self.free_s -= by_s

