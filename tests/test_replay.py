"""Replaying kernels as PyTorch operations (runs on CPU here; the nvml backend runs it on the GPU)."""

import sys
from pathlib import Path

import pytest
import torch

from freqopt.layout import Layout
from freqopt.models import Workload
from freqopt.models.gpt3 import GPTConfig
from freqopt.replay import build_replay, detect_counter_period
from freqopt.trace import trace_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU  # noqa: E402

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2, tp=2)])
def test_a_whole_iteration_replays_with_gemms_and_attention_exact(layout):
    trace = trace_iteration(Workload("tiny", TINY, 2, layout), "train", dtype=torch.float32)
    plan = build_replay(trace.kernels, device="cpu")
    plan()
    for kernel, exact in zip(trace.kernels, plan.exact):
        assert exact == (kernel.kind in ("gemm", "attention"))
    assert sum(plan.exact) >= 2 * TINY.n_layers * 6  # every projection, forward and backward


def test_exact_steps_compute_what_the_traced_operator_computes():
    trace = trace_iteration(Workload("tiny", TINY, 2), "train", dtype=torch.float32)
    plan = build_replay(trace.kernels, device="cpu")
    for kernel, step, exact in zip(trace.kernels, plan.steps, plan.exact):
        if kernel.name == "aten.mm":
            out = step()
            assert out.shape == (kernel.shapes[0][0], kernel.shapes[1][1])
        if kernel.name == "freqopt.flash_attention":
            assert step().shape == kernel.shapes[0]


def test_memory_bound_kernels_move_their_traced_bytes():
    trace = trace_iteration(Workload("tiny", TINY, 2), "train", dtype=torch.float32)
    kernel = next(k for k in trace.kernels if k.kind == "normalization")
    plan = build_replay([kernel], device="cpu")
    out = plan.steps[0]()
    assert not plan.exact[0] and out.numel() * out.element_size() == int(kernel.mem_bytes // 2)


def test_counter_period_is_detected_not_assumed():
    gpu = FakeGPU(counter_period_s=0.04, power_w=300.0)
    now = [0.0]

    def sleep(s):
        now[0] += s
        gpu.advance(s)

    period = detect_counter_period(lambda: gpu.energy_mj / 1000, duration_s=1.0, poll_s=0.001,
                                   clock=lambda: now[0], sleep=sleep)  # fmt: skip
    assert period == pytest.approx(0.04, abs=0.002)
    idle = FakeGPU(power_w=0.0)
    with pytest.raises(RuntimeError, match="changed 0 times"):
        detect_counter_period(lambda: idle.energy_mj, duration_s=0.2, poll_s=0.01, clock=lambda: now[0],
                              sleep=lambda s: now.__setitem__(0, now[0] + s))  # fmt: skip
