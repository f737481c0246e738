"""freqopt.workload.step_trace.trace_step: a user's own training step, traced with passes, fused attention and torch.optim's
kernels, searchable, with clear errors for wrong input."""

from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from freqopt.errors import InvalidSettingError
from freqopt.workload.step_trace import trace_step
from freqopt.workload.trace import GPUPathWarning

V, D, N_HEADS, N_KV_HEADS, N_LAYERS, B, T = 512, 128, 4, 2, 2, 2, 64


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = D // N_HEADS
        self.norm_1 = RMSNorm(D)
        self.q = nn.Linear(D, D, bias=False)
        self.kv = nn.Linear(D, 2 * N_KV_HEADS * self.head_dim, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.norm_2 = RMSNorm(D)
        self.gate = nn.Linear(D, 4 * D, bias=False)
        self.up = nn.Linear(D, 4 * D, bias=False)
        self.down = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):  # (B, T, D)
        h = self.norm_1(x)
        q = self.q(h).view(B, T, N_HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2, N_KV_HEADS, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hd)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
        h = self.norm_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # SwiGLU


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def make_step(device="meta", **optimizer_kwargs):
    with torch.device(device):
        model = TinyLM().to(torch.bfloat16)
        idx = torch.zeros(B, T, dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **optimizer_kwargs)

    def step():
        loss = F.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, model


FOREACH_ADAMW = {"aten._foreach_lerp_", "aten._foreach_addcmul_", "aten._foreach_sqrt", "aten._foreach_div_",
                 "aten._foreach_addcdiv_", "aten._foreach_mul_", "aten._foreach_add_"}  # fmt: skip


@pytest.mark.parametrize("optimizer_kwargs, expected_ops", [
    ({"foreach": True}, FOREACH_ADAMW),
    ({}, FOREACH_ADAMW),  # torch.optim's default for CUDA parameters
    ({"fused": True}, {"aten._fused_adamw_"}),
])  # fmt: skip
def test_user_step_traces_with_passes_fused_attention_and_optimizer_kernels(optimizer_kwargs, expected_ops):
    step, model = make_step(**optimizer_kwargs)
    trace = trace_step(step, name="tiny-lm", module=model, micro_batch_size=B, seq_len=T)
    assert {k.pass_name for k in trace.kernels} == {"forward", "backward", "optimizer"}
    attention = [k for k in trace.kernels if k.kind == "attention"]
    assert [k.pass_name for k in attention] == ["forward"] * N_LAYERS + ["backward"] * N_LAYERS
    assert attention[0].causal and attention[0].shapes[1] == (B, N_KV_HEADS, T, D // N_HEADS)
    assert not [k for k in trace.kernels if k.name in ("aten.bmm", "aten._softmax", "aten._safe_softmax")]
    optimizer = [k for k in trace.kernels if k.pass_name == "optimizer"]
    assert expected_ops <= {k.name for k in optimizer}
    # No zeros of lazily made state (the warm-up step is untraced); _foreach_mul_ is elementwise (freqopt.workload.trace.OP_KINDS)
    assert {k.kind for k in optimizer if k.name != "aten._foreach_mul_"} == {"optimizer"}
    n_params = sum(p.numel() for p in model.parameters())
    fused = [k.shapes for k in optimizer if k.name == "aten._fused_adamw_"]
    n_tensors = len(list(model.parameters()))  # params, grads, two moments, and a step counter each
    assert fused in ([], [((5 * n_tensors, 4 * n_params + n_tensors),)])
    assert trace.meta["n_params"] == n_params
    labels = [label for label, _ in trace.meta["marks"]]
    assert "fwd:layers.0.q" in labels and "bwd:layers.1.down" in labels and labels.count("step") == 1
    assert trace.workload.model == "tiny-lm" and trace.workload.config.seq_len == T
    # forward GEMM FLOPs: 2 x tokens x matmul weights
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    forward_gemm = sum(k.flops for k in trace.kernels if k.kind == "gemm" and k.pass_name == "forward")
    assert forward_gemm == 2 * B * T * weights


def test_a_search_runs_on_a_user_trace():
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu
    from freqopt.search.runner import SearchConfig, run_search

    step, model = make_step(fused=True)
    trace = trace_step(step, name="tiny-lm", module=model)
    config = SearchConfig(max_slowdown=0.01, granularities=("pass",), n_trials_1d=4, n_trials_per_mem_clock=1,
                          validation_repeats=1, finalist_repeats=0)  # fmt: skip
    result = run_search(trace, SimulatedGPU(get_gpu("h100-sxm")), config)
    assert result.results["pass"].validated.energy_j < result.baseline.energy_j


def test_a_user_trace_is_profiled_on_the_simulated_gpu_and_refused_elsewhere():
    """Issue 36, item 3: freqopt.profile of a trace_step trace (it failed on the step's config, which has no
    vocabulary to rebuild a model from); its figures are the simulated step's, as the search's baseline is."""
    import freqopt
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu

    step, model = make_step(fused=True)
    trace = trace_step(step, name="tiny-lm", module=model, micro_batch_size=B, seq_len=T)
    report = freqopt.profile(trace, sm_clock_mhz=1410)
    gpu = SimulatedGPU(get_gpu("h100-sxm"))
    from freqopt.gpu.backends.base import ClockSetting

    step_1410 = gpu.step(trace.kernels, [ClockSetting(sm_clock_mhz=1410)] * len(trace))
    assert report.model == "tiny-lm" and report.memory is None
    assert report.time_s == pytest.approx(step_1410.time_s) and report.energy_j == pytest.approx(step_1410.energy_j)
    assert set(report.by_pass) == {"forward", "backward", "optimizer"}
    with pytest.raises(InvalidSettingError, match="seq_len apply to a model name, not to a Trace"):
        freqopt.profile(trace, seq_len=128)
    with pytest.raises(InvalidSettingError, match="backend must be .sim. for a trace, profiled on the simulated GPU only"):
        freqopt.profile(trace, backend="nvml")


def test_real_tensors_are_refused():
    step, model = make_step(device="cpu", foreach=True)
    with pytest.raises(InvalidSettingError, match=r"module has parameters on cpu; build the model .*torch.device\('meta'\)"):
        trace_step(step, name="x", module=model)
    with pytest.raises(InvalidSettingError, match=r"on a cpu tensor of shape .*torch.device\('meta'\)"):
        trace_step(step, name="x")  # no module: found at the first operator


def test_a_step_without_backward_is_refused():
    _, model = make_step()

    def forward_only():
        model(torch.zeros(B, T, dtype=torch.long, device="meta"))

    with pytest.raises(InvalidSettingError, match=r"ran no backward pass; call loss.backward\(\)"):
        trace_step(forward_only, name="x", module=model)


def test_a_step_that_raises_is_wrapped():
    def broken():
        raise ValueError("boom\nsecond line")

    with pytest.raises(InvalidSettingError, match=r"^step_fn raised ValueError: boom$") as info:
        trace_step(broken, name="x")
    assert isinstance(info.value.__cause__, ValueError)


def test_a_step_without_kernels_and_bad_arguments_are_refused():
    with pytest.raises(InvalidSettingError, match="launched no kernel"):
        trace_step(lambda: None, name="x")
    with pytest.raises(InvalidSettingError, match="name must be a non-empty string"):
        trace_step(lambda: None, name="")
    with pytest.raises(InvalidSettingError, match="step_fn must be a zero-argument callable"):
        trace_step(None, name="x")


# nn.MultiheadAttention and nn.TransformerEncoderLayer, against a model of the same sizes that calls SDPA directly.
MHA_D, MHA_HEADS = 128, 4


class DirectSDPA(nn.Module):
    """What nn.MultiheadAttention computes with need_weights=False (packed q/k/v projection, SDPA, output
    projection), with F.scaled_dot_product_attention called from the module's forward."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(MHA_D, 3 * MHA_D)
        self.out_proj = nn.Linear(MHA_D, MHA_D)

    def forward(self, x, is_causal=False):  # (B, T, D)
        q, k, v = self.in_proj(x).view(B, T, 3, MHA_HEADS, MHA_D // MHA_HEADS).permute(2, 0, 3, 1, 4)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, nh, T, hd)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, MHA_D))


class MHA(nn.Module):
    def __init__(self, need_weights: bool):
        super().__init__()
        self.need_weights = need_weights
        self.attn = nn.MultiheadAttention(MHA_D, MHA_HEADS, batch_first=True)

    def forward(self, x):  # (B, T, D)
        y, _ = self.attn(x, x, x, need_weights=self.need_weights)
        return y


def trace_module(model: nn.Module, forward=None):
    """trace_step of one bf16 training step of ``model`` (on meta) on a (B, T, MHA_D) input."""
    with torch.device("meta"):
        model = model.to(torch.bfloat16)
        x = torch.zeros(B, T, MHA_D, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    forward = forward or model

    def step():
        forward(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return trace_step(step, name=type(model).__name__, module=model, micro_batch_size=B, seq_len=T)


def attention(trace):
    return [k for k in trace.kernels if k.kind == "attention"]


def test_multihead_attention_traces_as_the_fused_sdpa_kernels():
    with torch.device("meta"):
        direct, mha = DirectSDPA(), MHA(need_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPUPathWarning)
        expected, trace = trace_module(direct), trace_module(mha)
    fused = attention(trace)
    # Named as PyTorch's SDPA kernel (cuDNN's on Hopper), which a GPU file may rate apart from the FlashAttention-2
    # that freqopt's own models call (issue 49; freqopt.workload.models.sdpa.SDPA_KERNEL_NAMES).
    assert [(k.name, k.pass_name) for k in fused] == [("aten.scaled_dot_product_attention", "forward"),
                                                       ("aten.scaled_dot_product_attention_backward", "backward")]  # fmt: skip
    assert [k.call.op for k in fused] == ["freqopt.flash_attention.default", "freqopt.flash_attention_backward.default"]
    assert all(k.tensor_core and k.dtype == "bfloat16" and not k.causal for k in fused)
    assert fused[0].shapes[0] == (B, MHA_HEADS, T, MHA_D // MHA_HEADS)
    assert [k.flops for k in fused] == [k.flops for k in attention(expected)]
    assert fused[0].flops == 4 * B * MHA_HEADS * T * T * (MHA_D // MHA_HEADS)
    unfused = ("aten.bmm", "aten.baddbmm", "aten._softmax", "aten._safe_softmax")
    assert not [k for k in trace.kernels if k.name in unfused]
    assert trace.total_flops == expected.total_flops  # the projections' GEMMs as well


def test_transformer_encoder_layer_traces_as_the_fused_sdpa_kernels():
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(MHA_D, MHA_HEADS, 4 * MHA_D, batch_first=True)
        direct = DirectSDPA()
        mask = nn.Transformer.generate_square_subsequent_mask(T, device="meta", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPUPathWarning)
        trace = trace_module(layer, lambda x: layer(x, src_mask=mask, is_causal=True))
        expected = trace_module(direct, lambda x: direct(x, is_causal=True))
    fused = attention(trace)
    assert [(k.name, k.pass_name) for k in fused] == [(k.name, k.pass_name) for k in attention(expected)]
    fields = [(k.flops, k.causal, k.shapes) for k in fused]
    assert fields == [(k.flops, k.causal, k.shapes) for k in attention(expected)]
    assert fused[0].causal  # is_causal with its mask: SDPA's causal kernel, as multi_head_attention_forward passes it
    assert not [k for k in trace.kernels if k.name in ("aten.bmm", "aten._softmax", "aten._safe_softmax")]


def test_need_weights_traces_the_explicit_attention_a_gpu_runs():
    with torch.device("meta"):
        direct, mha = DirectSDPA(), MHA(need_weights=True)
    expected = trace_module(direct)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPUPathWarning)  # the GPU materializes the weights too: nothing to warn of
        trace = trace_module(mha)
    assert not attention(trace)
    forward = [k for k in trace.kernels if k.pass_name == "forward"]
    bmm = [k for k in forward if k.name in ("aten.bmm", "aten.baddbmm")]
    assert len(bmm) == 2 and all(k.tensor_core and k.dtype == "bfloat16" for k in bmm)  # q k^T and p v
    assert sum(k.flops for k in bmm) == attention(expected)[0].flops
    assert [k.name for k in forward if k.kind == "softmax"] == ["aten._softmax"]


def test_attention_on_a_path_the_gpu_would_not_take_is_warned_of_by_operator_and_module(monkeypatch):
    import contextlib

    import freqopt.workload.models.sdpa

    # Were nn.MultiheadAttention's SDPA call not routed (as if PyTorch called it another way), its math path is traced.
    monkeypatch.setattr(freqopt.workload.models.sdpa, "_functional_sdpa_fused", contextlib.nullcontext)
    with torch.device("meta"):
        mha = MHA(need_weights=False)
    expected = (r"^aten\._safe_softmax in module attn \(MultiheadAttention\): scaled_dot_product_attention was traced "
                r"through PyTorch's math path")
    with pytest.warns(GPUPathWarning, match=expected) as record:
        trace = trace_module(mha)
    assert len([w for w in record if issubclass(w.category, GPUPathWarning)]) == 1  # once, not for the warm-up step
    assert not attention(trace) and any(k.name == "aten._safe_softmax" for k in trace.kernels)


class ValueHeadDim(nn.Module):
    """Attention whose values have another head dim than queries and keys: memory-efficient attention takes it
    on a GPU, freqopt.flash_attention cannot."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(MHA_D, 2 * MHA_D)
        self.v = nn.Linear(MHA_D, 2 * MHA_D)

    def forward(self, x):
        q, k = self.qk(x).view(B, T, 2, MHA_HEADS, -1).permute(2, 0, 3, 1, 4)  # (B, nh, T, hd)
        v = self.v(x).view(B, T, MHA_HEADS, -1).transpose(1, 2)  # (B, nh, T, 2 hd)
        return F.scaled_dot_product_attention(q, k, v)


def test_an_attention_the_gpu_fuses_but_the_trace_cannot_is_warned_of():
    with torch.device("meta"):
        model = ValueHeadDim()
    with pytest.warns(GPUPathWarning, match=r"^aten\._safe_softmax in the root module \(ValueHeadDim\): "):
        trace = trace_module(model)
    assert not attention(trace)


def test_convolutions_are_traced_as_tensor_core_implicit_gemms():
    """Issue 36, item 3: aten.convolution and its backward were traced as elementwise kernels without tensor cores
    (about 12x too slow); they are GEMMs, FLOPs from the shapes, K the filter's size."""
    from freqopt.gpu.backends.physics import gemm_inner_dim

    n, c_in, c_out, hw, k = 8, 64, 128, 32, 3
    with torch.device("meta"):
        conv = nn.Conv2d(c_in, c_out, k, padding=1, bias=False).to(torch.bfloat16)
        x = torch.randn(n, c_in, hw, hw, dtype=torch.bfloat16, requires_grad=True)  # a layer's input: both gradients

    def step():
        conv(x).float().square().mean().backward()

    trace = trace_step(step, name="conv", module=conv, micro_batch_size=n)
    convs = [kk for kk in trace.kernels if "convolution" in kk.name]
    # The backward is two kernels on a GPU (cuDNN's data and weight gradients), traced as two (issue 49).
    assert [(kk.name, kk.pass_name) for kk in convs] == [("aten.convolution", "forward"),
                                                         ("aten.convolution_backward_input", "backward"),
                                                         ("aten.convolution_backward_weight", "backward")]  # fmt: skip
    assert all(kk.kind == "gemm" and kk.tensor_core for kk in convs)
    forward = 2 * n * c_out * hw * hw * c_in * k * k
    assert [kk.flops for kk in convs] == [forward, forward, forward]
    assert [gemm_inner_dim(kk) for kk in convs] == [c_in * k * k, c_out * k * k, n * hw * hw]
    data, weight = convs[1:]
    assert data.call.args[10] == (True, False, False) and weight.call.args[10] == (False, True, False)
    x, y, w = 2 * n * c_in * hw * hw, 2 * n * c_out * hw * hw, 2 * c_out * c_in * k * k  # bytes of bf16 tensors
    assert data.mem_bytes == y + w + x and weight.mem_bytes == y + x + w  # grad_out, what each reads, what it writes


def test_a_strided_window_reads_only_the_input_it_touches():
    with torch.device("meta"):
        conv = nn.Conv2d(64, 128, 1, stride=2, bias=False).to(torch.bfloat16)
        x = torch.randn(8, 64, 32, 32, dtype=torch.bfloat16)

    def step():
        conv(x).float().square().mean().backward()

    forward = next(kk for kk in trace_step(step, name="s", module=conv).kernels if kk.name == "aten.convolution")
    x_bytes, y_bytes, w_bytes = 2 * 8 * 64 * 32 * 32, 2 * 8 * 128 * 16 * 16, 2 * 128 * 64
    assert forward.mem_bytes == x_bytes / 4 + w_bytes + y_bytes  # a 1 x 1 window every 2 pixels: a quarter


def test_freqopts_own_attention_keeps_its_flashattention2_name_and_a_users_sdpa_is_rated_as_pytorchs():
    """freqopt's GPT modules call freqopt.flash_attention (FlashAttention-2 on a GPU); the same attention written with
    F.scaled_dot_product_attention runs PyTorch's SDPA kernel (cuDNN's on Hopper), which the H200 measured 1.4-1.6x
    faster at gpt3-small's shape (experiments/h200_check.md): the simulated GPU rates the two apart."""
    from freqopt.gpu.backends.physics import KernelPhysics
    from freqopt.gpu.specs import get_gpu
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    own = attention(trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=256)))
    assert {k.name for k in own} == {"freqopt.flash_attention", "freqopt.flash_attention_backward"}
    with torch.device("meta"):
        direct = DirectSDPA()
    users = attention(trace_module(direct))
    spec = get_gpu("h200-sxm")
    times = [KernelPhysics(spec, [k, dataclasses.replace(k, name=n)], np.full(2, float(spec.max_mem_clock_mhz))).time_s[:, -1]
             for k, n in zip(users, ("freqopt.flash_attention", "freqopt.flash_attention_backward"))]  # fmt: skip
    assert all(t[1] > 1.3 * t[0] for t in times)  # FlashAttention-2 slower than PyTorch's SDPA on the H200


class Recurrent(nn.Module):
    """A recurrent layer on a (B, T, MHA_D) input, its output's hidden states projected back to MHA_D."""

    def __init__(self, cls, **kwargs):
        super().__init__()
        self.rnn = cls(MHA_D, MHA_D, batch_first=True, **kwargs)
        self.proj = nn.Linear(MHA_D * (2 if kwargs.get("bidirectional") else 1), MHA_D)

    def forward(self, x):  # (B, T, D)
        y, _ = self.rnn(x)
        return self.proj(y)


@pytest.mark.slow
@pytest.mark.parametrize("cls,kwargs", [(nn.LSTM, {}), (nn.GRU, {"num_layers": 2, "bidirectional": True})],
                         ids=["lstm", "gru-2-layers-bidirectional"])  # fmt: skip
def test_a_recurrent_layer_traced_as_its_per_step_decomposition_is_warned_of(cls, kwargs):
    """Issue 51, item 2: off CUDA nn.LSTM and nn.GRU decompose into every time step's gate GEMMs and elementwise
    kernels, where a GPU runs cuDNN's fused RNN; the trace keeps the decomposition and says so once, naming the
    module and the forward kernels it was traced as (not for the warm-up step, not for the other modules)."""
    with torch.device("meta"):
        model = Recurrent(cls, **kwargs)
    name = cls.__name__
    with pytest.warns(GPUPathWarning, match=rf"^nn\.{name} in module rnn \({name}\): traced as ([\d,]+) forward "
                                            r"kernels, the per-time-step decomposition .* cuDNN's fused RNN") as record:
        trace = trace_module(model)
    warned = [w for w in record if issubclass(w.category, GPUPathWarning)]
    assert len(warned) == 1
    n = int(re.search(r"traced as ([\d,]+) forward", str(warned[0].message)).group(1).replace(",", ""))
    forward = [k for k in trace.kernels if k.pass_name == "forward"]
    # The layer's kernels: the forward's but the projection's GEMM and the loss's few (cast, square, mean).
    assert len(forward) - 8 <= n < len(forward)
    directions = 2 if kwargs.get("bidirectional") else 1
    gemms = [k for k in forward if k.kind == "gemm"]
    # Per time step, layer and direction, at least the hidden state's GEMM: the decomposition the warning names.
    assert len(gemms) >= T * kwargs.get("num_layers", 1) * directions


def test_a_model_without_a_recurrent_layer_is_not_warned_of_one():
    with torch.device("meta"):
        direct = DirectSDPA()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPUPathWarning)
        assert trace_module(direct).kernels
