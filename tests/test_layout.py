"""Parallel layouts: parsing, per-rank traces (AutoTP and ZeRO-style data parallelism), collectives in the
simulated GPU and the two-stream timeline."""

from collections import Counter

import numpy as np
import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import KernelPhysics, SimulatedGPU
from freqopt.errors import InvalidSettingError
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import Layout, parse_layout
from freqopt.workload.models import count_parameters, get_workload
from freqopt.workload.trace import Kernel, trace_training_iteration

H100 = get_gpu("h100-sxm")
SMALL = {"micro_batch_size": 1, "seq_len": 256}


@pytest.mark.parametrize(
    "text, dp, tp",
    [("dp=8,tp=4", 8, 4), ("tp=2", 1, 2), (" dp = 8 ", 8, 1), ("tp=4,dp=2", 2, 4), ("", 1, 1), (None, 1, 1)],
)
def test_parse_layout(text, dp, tp):
    layout = parse_layout(text)
    assert (layout.dp, layout.tp, layout.world_size) == (dp, tp, dp * tp)


@pytest.mark.parametrize(
    "text, fragment",
    [("abc", "not a layout"), ("dp=0", "positive integer"), ("tp=-2", "positive integer"), ("dp=2.5", "positive"),
     ("dp=2,dp=4", "twice"), ("pp=0", "positive integer"), ("pp=2,pp=2", "twice"), ("dp=8;tp=2", "positive integer"), ("8", "not a layout"), ("dp=", "positive integer")],
)  # fmt: skip
def test_parse_layout_refuses_bad_text(text, fragment):
    with pytest.raises(InvalidSettingError, match=fragment):
        parse_layout(text)


def test_tensor_parallel_must_divide_the_heads():
    with pytest.raises(InvalidSettingError, match="does not divide the 12 attention heads.*1, 2, 3, 4, 6, 12"):
        get_workload("gpt3-small", layout=parse_layout("tp=8"))
    assert get_workload("gpt3-xl", layout=parse_layout("tp=16")).layout.tp == 16


def test_tensor_parallel_shards_what_autotp_shards():
    full = count_parameters(get_workload("gpt3-small").config)
    config = get_workload("gpt3-small").config
    d, n_layers, vocab = config.d_model, config.n_layers, config.vocab_size
    # q, k, v, o, up, down weights (12 d^2 per block) and the column-parallel biases (q, k, v: 3 d; up: 4 d) are split in two.
    sharded = n_layers * (12 * d * d + 7 * d)
    assert count_parameters(config, tp=2) == full - sharded // 2
    assert full == pytest.approx(125e6, rel=0.03) and vocab == 50257


def collectives(trace):
    return [k for k in trace.kernels if k.is_collective]


def test_tensor_parallel_trace_has_autotp_collectives_and_half_width_gemms():
    single = trace_training_iteration(get_workload("gpt3-small", **SMALL))
    tp2 = trace_training_iteration(get_workload("gpt3-small", layout=Layout(tp=2), **SMALL))
    d, layers, tokens = 768, 12, 256
    comm = collectives(tp2)
    activation = [k for k in comm if k.shapes == ((1, tokens, d),)]
    # Forward: after o_proj and down_proj; backward: input gradient of q, k, v and up (one per column layer).
    assert len(activation) == layers * (2 + 4)
    # Issued in their pass: 2 per block in forward, 4 in backward; the clipping norm's in the optimizer step.
    assert Counter(k.pass_name for k in comm) == {"forward": 2 * layers, "backward": 4 * layers, "optimizer": 1}
    assert all(k.group_size == 2 and k.group_stride == 1 and k.stream == 0 for k in comm)
    assert all(k.comm_bytes == tokens * d * 2 for k in activation)  # bf16 activations
    # The clipping norm is summed over the tp group: one scalar all-reduce.
    assert sum(1 for k in comm if k.shapes == ((),)) == 1
    gemm_dims = Counter(k.shapes[-2:] for k in tp2.kernels if k.name in ("aten.mm", "aten.addmm"))
    assert gemm_dims[((tokens, d), (d, d // 2))] == 4 * layers  # q, k, v forward and o_proj dgrad: half width
    assert gemm_dims[((tokens, d), (d, 2 * d))] == 2 * layers  # up_proj forward and down_proj dgrad: 4d / 2
    assert not collectives(single)
    # Per-rank GEMM work halves for everything that tp shards.
    assert tp2.total_flops < 0.75 * single.total_flops


def test_data_parallel_buckets_hold_every_gradient_once():
    workload = get_workload("gpt3-small", layout=Layout(dp=4, bucket_elements=20_000_000), **SMALL)
    trace = trace_training_iteration(workload)
    buckets = [k for k in collectives(trace) if k.stream == 1]
    n_params = trace.meta["n_params"]
    assert sum(k.shapes[0][0] for k in buckets) == n_params
    assert len(buckets) >= n_params // 20_000_000
    # Each bucket stays within the limit unless it holds a single larger gradient (the 38.6 M embedding, its
    # vocabulary padded to 50304 rows).
    assert all(k.shapes[0][0] <= 20_000_000 or k.shapes[0][0] == 50304 * 768 for k in buckets)
    first = trace.kernels.index(buckets[0])
    assert trace.kernels[first - 1].pass_name == "backward"  # issued during backward, not after it
    assert any(k.pass_name == "backward" for k in trace.kernels[first + 1:])
    default = trace_training_iteration(get_workload("gpt3-small", layout=Layout(dp=4), **SMALL))
    assert [k.shapes for k in collectives(default) if k.stream == 1] == [((n_params,),)]


def all_reduce(n_bytes, ranks, stride=1, stream=0):
    return Kernel("freqopt.all_reduce", "all-reduce", "communication", n_bytes / 2 * (ranks - 1) / ranks,
                  5 * (ranks - 1) / ranks * n_bytes, "bfloat16", ((int(n_bytes / 2),),), stream=stream,
                  comm_bytes=n_bytes, group_size=ranks, group_stride=stride)  # fmt: skip


def test_all_reduce_follows_the_ring_algorithm():
    link = H100.interconnect
    big = 2.0**30
    t = {n: KernelPhysics(H100, [all_reduce(big, n)], np.array([2619])).time_s[0, -1] for n in (2, 4, 8)}
    bandwidth = link.link_bandwidth_gbs * 1e9 * link.link_efficiency
    for n, time_s in t.items():
        assert time_s >= 2 * (n - 1) / n * big / bandwidth  # never faster than the ring's bus bytes allow
        assert time_s < 1.25 * 2 * (n - 1) / n * big / bandwidth
    assert t[8] / t[2] == pytest.approx((2 * 7 / 8) / (2 * 1 / 2), rel=0.1)
    # A group wider than a node crosses the slower network.
    across = KernelPhysics(H100, [all_reduce(big, 2, stride=8)], np.array([2619])).time_s[0, -1]
    assert across > 5 * t[2]


def test_all_reduce_draws_little_sm_power_and_is_nearly_clock_independent():
    comm = KernelPhysics(H100, [all_reduce(2.0**28, 8)], np.array([2619]))
    gemm = KernelPhysics(H100, [Kernel("aten.mm", "gemm", "forward", 2.0 * 8192**3, 3.0 * 8192**2 * 2, "bfloat16",
                                       ((8192, 8192), (8192, 8192)), True)], np.array([2619]))  # fmt: skip
    top, mid = -1, H100.sm_clocks_mhz.index(1380)
    assert comm.power_w[0, top] < 0.75 * gemm.power_w[0, top]
    active = comm.power_w[0, top] - comm.baseline_power_w[0, top]
    gemm_active = gemm.power_w[0, top] - gemm.baseline_power_w[0, top]
    # Link and memory traffic only (5 (n-1)/n of the message read and written at the link's pace): a small share
    # of a GEMM's power above the idle-at-clock baseline.
    assert active < 0.2 * gemm_active
    assert comm.time_s[0, mid] / comm.time_s[0, top] < 1.1  # 30 % lower SM clock, under 10 % slower


def test_gradient_buckets_overlap_backward_and_the_step_waits_for_them():
    sim = SimulatedGPU(H100, noise=False)
    trace = trace_training_iteration(get_workload("gpt3-small", layout=Layout(dp=8, bucket_elements=10_000_000),
                                                  **SMALL))  # fmt: skip
    kernels = list(trace.kernels)
    settings = [ClockSetting()] * len(kernels)
    time_s, energy_j, _ = sim.run(kernels, settings, loop=True)
    side = np.array([k.stream == 1 for k in kernels])
    compute_only = [k for k in kernels if k.stream == 0]
    t_compute, e_compute, _ = sim.run(compute_only, [ClockSetting()] * len(compute_only), loop=True)
    serial = sim.run([k for k in kernels if k.stream == 1], [ClockSetting()] * int(side.sum()), loop=True)
    # Overlap: the iteration is longer than its compute but shorter than compute then all buckets in series.
    assert t_compute.sum() < time_s.sum() < t_compute.sum() + serial[0].sum()
    # Only the last bucket's tail is exposed: most communication time is hidden behind backward.
    assert time_s[side].sum() < 0.5 * serial[0].sum()
    # Overlapped communication costs less energy than the same kernels alone, yet more than nothing.
    assert 0 < energy_j[side].sum() < serial[1].sum()
    assert energy_j.sum() > e_compute.sum()
