import warnings
from collections import Counter

import pytest
import torch

from freqopt.workload.models import get_workload
from freqopt.workload.trace import PASSES, trace_training_iteration


def narayanan_training_flops(workload) -> float:
    """FLOPs of one training iteration without activation recomputation (Narayanan et al. 2021, SC'21, section
    5.1): the transformer layers' 72 B s l h^2 (1 + s / 6h) (their 96 with recomputation, times 3/4) plus the
    logit layer's 6 B s V h, V the vocabulary the layer holds (padded, as Megatron-LM pads it)."""
    c = workload.config
    B, s, l, h, V = workload.micro_batch_size, c.seq_len, c.n_layers, c.d_model, c.padded_vocab_size
    return 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * V * h


def test_gemm_flops_are_2mkn():
    from freqopt.workload.trace import KernelRecorder

    recorder = KernelRecorder()
    a = torch.empty(64, 128, device="meta", dtype=torch.bfloat16)
    b = torch.empty(128, 32, device="meta", dtype=torch.bfloat16)
    with recorder:
        a @ b
    (kernel,) = recorder.kernels
    assert kernel.kind == "gemm"
    assert kernel.flops == 2 * 64 * 128 * 32
    assert kernel.mem_bytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)
    assert kernel.tensor_core


def test_bytes_count_what_the_optimizer_and_the_loss_move(gpt3_small_trace):
    """In-place operators that return nothing still write: the fused AdamW reads the FP32 master weights,
    gradients and two moments and writes back the weights and moments (28 bytes a parameter; the gradients only
    when it unscales them), _foreach_mul_ reads and writes each tensor. The loss gathers one log-probability a
    row, and its backward writes the whole gradient without reading the log-probabilities."""
    kernels = {k.name: k for k in gpt3_small_trace.kernels}
    n_params = kernels["aten._foreach_norm"].shapes[0][1]  # (tensors, elements) of the gradients
    assert kernels["aten._fused_adamw_"].mem_bytes == pytest.approx(28 * n_params, rel=1e-4)
    assert kernels["aten._foreach_mul_"].mem_bytes == pytest.approx(2 * 4 * n_params, rel=1e-4)
    tokens, vocab = kernels["aten.nll_loss_forward"].shapes[0]
    assert kernels["aten.nll_loss_forward"].mem_bytes < 0.01 * 2 * tokens * vocab
    assert kernels["aten.nll_loss_backward"].mem_bytes == pytest.approx(2 * tokens * vocab, rel=1e-3)


@pytest.mark.slow
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
    from freqopt.workload.trace import trace_iteration

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


@pytest.mark.slow
def test_175b_traces_quickly_without_memory():
    trace = trace_training_iteration(get_workload("gpt3-175b", micro_batch_size=1))
    assert trace.meta["n_params"] == pytest.approx(175e9, rel=0.01)
    assert len(trace.kernel_classes()) < 100


def _qkv(shape, dtype=torch.bfloat16, v_head_dim=None):
    q, k = (torch.empty(shape, dtype=dtype, device="meta") for _ in range(2))
    v = torch.empty(*shape[:-1], v_head_dim or shape[-1], dtype=dtype, device="meta")
    return q, k, v


@pytest.mark.parametrize("shape, dtype, kwargs, v_head_dim, backend", [
    ((2, 4, 64, 32), torch.bfloat16, {}, None, "flash"),
    ((2, 4, 64, 32), torch.float16, {"is_causal": True}, None, "flash"),
    ((2, 4, 64, 32), torch.bfloat16, {"attn_mask": "mask"}, None, "efficient"),  # flash takes no mask
    ((2, 4, 64, 32), torch.float32, {}, None, "efficient"),  # flash takes 16-bit inputs only
    ((2, 4, 64, 320), torch.bfloat16, {}, None, "efficient"),  # flash: head dim at most 256
    ((2, 4, 64, 32), torch.bfloat16, {}, 64, "efficient"),  # flash: one head dim for q, k and v
    ((2, 4, 64, 30), torch.float32, {}, None, "math"),  # efficient: float32 head dims a multiple of 4
    ((2, 4, 64, 32), torch.float64, {}, None, "math"),
    ((8, 64, 32), torch.bfloat16, {}, None, "math"),  # fused kernels take 4-D inputs only
])  # fmt: skip
def test_cuda_sdpa_backend_follows_pytorchs_selection(shape, dtype, kwargs, v_head_dim, backend):
    from freqopt.workload.models.sdpa import cuda_sdpa_backend

    q, k, v = _qkv(shape, dtype, v_head_dim)
    if kwargs.get("attn_mask") == "mask":
        kwargs = {**kwargs, "attn_mask": torch.empty(shape[-2], shape[-2], dtype=torch.bool, device="meta")}
    assert cuda_sdpa_backend(q, k, v, **kwargs) == backend


def test_cuda_sdpa_backend_reads_the_enabled_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from freqopt.workload.models.sdpa import cuda_sdpa_backend

    q, k, v = _qkv((2, 4, 64, 32))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert cuda_sdpa_backend(q, k, v) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert cuda_sdpa_backend(q, k, v) == "math"


def _record(fn):
    from freqopt.workload.models.sdpa import FusedSDPA
    from freqopt.workload.trace import KernelRecorder

    recorder = KernelRecorder()
    with recorder, FusedSDPA():
        fn()
    return recorder.kernels


def test_sdpa_the_gpu_runs_unfused_keeps_its_math_path_without_a_warning():
    from freqopt.workload.trace import GPUPathWarning

    for shape, dtype in [((8, 64, 32), torch.bfloat16), ((2, 4, 64, 32), torch.float64)]:
        q, k, v = _qkv(shape, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GPUPathWarning)
            kernels = _record(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        assert not [k for k in kernels if k.kind == "attention"]
        assert [k.name for k in kernels if k.kind == "gemm"] == ["aten.bmm", "aten.bmm"]


def test_a_float32_gemm_with_tf32_allowed_is_warned_of():
    from freqopt.workload.trace import GPUPathWarning

    a = torch.empty(64, 128, device="meta")
    b = torch.empty(128, 32, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPUPathWarning)
        (kernel,) = _record(lambda: a @ b)  # TF32 off (PyTorch's default): FP32 is what the GPU runs
    assert kernel.dtype == "float32" and not kernel.tensor_core
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    before = matmul.fp32_precision if new_api else matmul.allow_tf32
    try:
        if new_api:
            matmul.fp32_precision = "tf32"
        else:
            matmul.allow_tf32 = True
        with pytest.warns(GPUPathWarning, match=r"^aten\.mm: a float32 GEMM with TF32 allowed"):
            _record(lambda: a @ b)
    finally:
        if new_api:
            matmul.fp32_precision = before
        else:
            matmul.allow_tf32 = before
