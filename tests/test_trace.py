from collections import Counter

import pytest
import torch

from freqopt.models import get_workload
from freqopt.trace import PASSES, trace_training_iteration


def narayanan_training_flops(workload) -> float:
    """FLOPs of one training iteration without activation recomputation (Narayanan et al. 2021, SC'21, section
    5.1): the transformer layers' 72 B s l h^2 (1 + s / 6h) (their 96 with recomputation, times 3/4) plus the
    logit layer's 6 B s V h, V the vocabulary the layer holds (padded, as Megatron-LM pads it)."""
    c = workload.config
    B, s, l, h, V = workload.micro_batch_size, c.seq_len, c.n_layers, c.d_model, c.padded_vocab_size
    return 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * V * h


def test_gemm_flops_are_2mkn():
    from freqopt.trace import _KernelRecorder

    recorder = _KernelRecorder()
    a = torch.empty(64, 128, device="meta", dtype=torch.bfloat16)
    b = torch.empty(128, 32, device="meta", dtype=torch.bfloat16)
    with recorder:
        a @ b
    (kernel,) = recorder.kernels
    assert kernel.kind == "gemm"
    assert kernel.flops == 2 * 64 * 128 * 32
    assert kernel.mem_bytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)
    assert kernel.tensor_core


@pytest.mark.parametrize("model,batch", [("gpt3-small", 4), ("gpt3-xl", 1), ("gpt3-175b", 1)])
def test_iteration_flops_match_narayanan(model, batch):
    w = get_workload(model, micro_batch_size=batch)
    trace = trace_training_iteration(w)
    assert trace.total_flops == pytest.approx(narayanan_training_flops(w), rel=0.03)


def test_trace_structure(gpt3_small_trace):
    trace = gpt3_small_trace
    n_layers = trace.workload.config.n_layers
    kinds = Counter((k.pass_name, k.kind) for k in trace.kernels)
    assert {k.pass_name for k in trace.kernels} == set(PASSES)
    # Attention is one fused kernel per layer and pass.
    assert kinds[("forward", "attention")] == n_layers
    assert kinds[("backward", "attention")] == n_layers
    # q, k, v, o, up, down projections + the logit layer; backward has two GEMMs per forward GEMM.
    assert kinds[("forward", "gemm")] == 6 * n_layers + 1
    assert kinds[("backward", "gemm")] == 2 * kinds[("forward", "gemm")]
    # Shape-only operators are not kernels.
    names = {k.name for k in trace.kernels}
    assert not names & {"aten.view", "aten.transpose", "aten.t", "aten.detach", "aten._unsafe_view", "aten.expand"}
    # One fused AdamW step over all parameters.
    assert sum(k.name == "aten._fused_adamw_" for k in trace.kernels) == 1
    assert all(k.mem_bytes > 0 for k in trace.kernels if k.kind != "elementwise" or k.shapes)


def test_kernel_classes_group_repeated_layers(gpt3_small_trace):
    classes = gpt3_small_trace.kernel_classes()
    assert sum(classes.values()) == len(gpt3_small_trace)
    assert len(classes) < len(gpt3_small_trace) / 10  # 12 identical layers share classes


@pytest.mark.parametrize("model", ["gpt3-small", "bert-base", "distilbert"])
def test_inference_is_the_forward_pass(model):
    from freqopt.trace import trace_iteration

    w = get_workload(model, micro_batch_size=2, seq_len=128)
    train, infer = trace_iteration(w, "train"), trace_iteration(w, "inference")
    assert {k.pass_name for k in infer.kernels} == {"forward"}
    assert not any(k.kind == "optimizer" for k in infer.kernels)
    # Forward FLOPs are a third of forward + backward (backward computes two GEMMs per forward GEMM).
    assert infer.total_flops == pytest.approx(train.total_flops / 3, rel=0.02)


def test_bert_attention_is_bidirectional():
    trace = trace_training_iteration(get_workload("bert-base", micro_batch_size=1, seq_len=128))
    attention = [k for k in trace.kernels if k.kind == "attention"]
    assert len(attention) == 2 * 12 and not any(k.causal for k in attention)


def test_175b_traces_quickly_without_memory():
    trace = trace_training_iteration(get_workload("gpt3-175b", micro_batch_size=1))
    assert trace.meta["n_params"] == pytest.approx(175e9, rel=0.01)
    assert len(trace.kernel_classes()) < 100
