"""Mixture-of-experts models traced as a GPU runs them (freqopt.workload.moe): Mixtral-, Qwen2-MoE- and DeepSeek-V3-style
configs against hand-counted FLOPs, the grouped expert GEMMs and their token split, trace_step, the replay's offsets,
and the warnings and refusals for what the tracer cannot follow."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from freqopt.errors import InvalidSettingError  # noqa: E402
from freqopt.workload.layout import Layout  # noqa: E402
from freqopt.workload.models import get_workload  # noqa: E402
from freqopt.workload.moe import check_routing, expert_rows  # noqa: E402
from freqopt.workload.trace import UntracedWarning, trace_iteration  # noqa: E402

DATA = Path(__file__).parent / "data" / "hf"
B, T = 2, 512  # the sizes of `freqopt profile --micro-batch-size 2 --seq-len 512`
MOE_CONFIGS = ("mixtral", "qwen2_moe", "deepseek_v3")


def hf(name: str) -> str:
    return f"hf:{DATA / name}"


def config(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


_traces: dict = {}


def traced(name: str, routing="balanced", layout: Layout | None = None):
    key = (name, tuple(routing) if not isinstance(routing, str) else routing, layout)
    if key not in _traces:
        _traces[key] = trace_iteration(get_workload(hf(name), micro_batch_size=B, seq_len=T, layout=layout),
                                       routing=routing)  # fmt: skip
    return _traces[key]


# Hand counts from the config alone. A GEMM of an (M, K) input with a (K, N) weight is 2 M K N FLOPs forward and twice
# that backward (input and weight gradients), so a training step costs 6 x tokens x (active matmul weights); the
# fused attention kernel 4 B T^2 H d forward and 8 B T^2 H d backward (causal masking not discounted), as
# tests/test_hf.py counts a dense model. Active weights per token: attention projections, the router (D x E), the
# top_k routed experts' gate, up and down projections (3 D F each), shared experts, and the output layer.
def _attention_weights(c: dict) -> int:
    d, h = c["hidden_size"], c["num_attention_heads"]
    hd = c.get("head_dim") or d // h
    return d * h * hd * 2 + 2 * d * c["num_key_value_heads"] * hd  # q, o; k, v


def hand_count_mixtral(c: dict) -> float:
    d, f, e, k = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"]
    per_layer = _attention_weights(c) + d * e + k * 3 * d * f
    weights = c["num_hidden_layers"] * per_layer + d * c["vocab_size"]
    hd = d // c["num_attention_heads"]
    return 6 * B * T * weights + 12 * c["num_hidden_layers"] * B * T * T * c["num_attention_heads"] * hd


def hand_count_qwen2_moe(c: dict) -> float:
    d, e, k = c["hidden_size"], c["num_experts"], c["num_experts_per_tok"]
    routed = k * 3 * d * c["moe_intermediate_size"]
    shared = 3 * d * c["shared_expert_intermediate_size"] + d  # the shared expert and its sigmoid gate (D x 1)
    per_layer = _attention_weights(c) + d * e + routed + shared
    weights = c["num_hidden_layers"] * per_layer + d * c["vocab_size"]
    hd = d // c["num_attention_heads"]
    return 6 * B * T * weights + 12 * c["num_hidden_layers"] * B * T * T * c["num_attention_heads"] * hd


def hand_count_deepseek_v3(c: dict) -> float:
    """Multi-head latent attention (DeepSeek-V2 section 2.1): q down/up (q_lora_rank), the joint k/v down projection
    with the shared rotary key, k/v up from kv_lora_rank, the output; the first ``first_k_dense_replace`` layers have
    a dense MLP, the rest the router, top_k routed experts and n_shared_experts shared ones."""
    d, h, n_layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (d * c["q_lora_rank"] + c["q_lora_rank"] * h * qk
                 + d * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                 + c["kv_lora_rank"] * h * (c["qk_nope_head_dim"] + c["v_head_dim"]) + h * c["v_head_dim"] * d)
    fm = c["moe_intermediate_size"]
    moe = d * c["n_routed_experts"] + c["num_experts_per_tok"] * 3 * d * fm + 3 * d * fm * c["n_shared_experts"]
    dense = 3 * d * c["intermediate_size"]
    n_dense = c["first_k_dense_replace"]
    weights = n_layers * attention + n_dense * dense + (n_layers - n_dense) * moe + d * c["vocab_size"]
    assert qk == c["v_head_dim"]  # one fused kernel (equal q/k and v head dims): 4 B T^2 H d forward
    return 6 * B * T * weights + 12 * n_layers * B * T * T * h * qk


HAND_COUNTS = {"mixtral": hand_count_mixtral, "qwen2_moe": hand_count_qwen2_moe,
               "deepseek_v3": hand_count_deepseek_v3}  # fmt: skip


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_flops_match_the_hand_count_within_two_percent(name):
    trace = traced(name)
    expected = HAND_COUNTS[name](config(name))
    assert trace.total_flops == pytest.approx(expected, rel=0.02)


def test_without_the_experts_the_hand_count_misses():
    """The count above can fail: the step without its expert GEMMs (what was traced before the grouped GEMM was
    counted) is far outside 2 %."""
    trace = traced("mixtral")
    experts = sum(k.flops for k in trace.kernels if k.name == "aten._grouped_mm")
    assert experts > 0.5 * trace.total_flops
    assert trace.total_flops - experts < 0.5 * hand_count_mixtral(config("mixtral"))


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_each_expert_projection_is_one_grouped_gemm_each_way(name):
    trace, c = traced(name), config(name)
    moe_layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    grouped = [k for k in trace.kernels if k.name == "aten._grouped_mm"]
    assert all(k.kind == "gemm" and k.tensor_core and k.dtype == "bfloat16" for k in grouped)
    passes = [k.pass_name for k in grouped]
    assert passes.count("forward") == 2 * moe_layers  # gate/up and down
    assert passes.count("backward") == 4 * moe_layers  # an input and a weight gradient of each
    n_experts = c.get("num_local_experts") or c.get("num_experts") or c["n_routed_experts"]
    tokens = B * T * c["num_experts_per_tok"]
    f = c.get("moe_intermediate_size") or c["intermediate_size"]
    assert sum(k.flops for k in grouped) == 3 * moe_layers * 2 * tokens * 3 * c["hidden_size"] * f
    gate_up = grouped[0]
    assert gate_up.shapes == ((tokens, c["hidden_size"]), (n_experts, c["hidden_size"], 2 * f), (n_experts,))


def test_the_router_and_shared_expert_are_ordinary_gemms():
    trace, c = traced("qwen2_moe"), config("qwen2_moe")
    d, e = c["hidden_size"], c["num_experts"]
    forward = [k.shapes for k in trace.kernels if k.kind == "gemm" and k.pass_name == "forward"]
    assert forward.count(((B * T, d), (d, e))) == c["num_hidden_layers"]  # the router's logits
    assert forward.count(((B * T, d), (d, 1))) == c["num_hidden_layers"]  # the shared expert's gate
    assert forward.count(((B * T, d), (d, c["shared_expert_intermediate_size"]))) == 2 * c["num_hidden_layers"]


def test_the_split_is_stated_balanced_by_default_or_per_expert_shares():
    assert expert_rows(2048, 8) == (256,) * 8
    assert expert_rows(10, 4) == (3, 3, 2, 2)
    assert expert_rows(2048, 4, check_routing([1, 1, 0, 2])) == (512, 512, 0, 1024)
    assert sum(expert_rows(1000, 3, check_routing([1, 1, 1]))) == 1000
    balanced, skewed = traced("mixtral"), traced("mixtral", routing=[2, 1, 1, 1, 1, 1, 1, 0])
    assert skewed.total_flops == balanced.total_flops  # every routed pair is multiplied once, whoever takes it
    assert skewed.meta["routing"] == pytest.approx((0.25,) + (0.125,) * 6 + (0.0,))
    assert "routing" not in balanced.meta
    before = [k for k in balanced.kernels if k.name == "aten._grouped_mm"]
    after = [k for k in skewed.kernels if k.name == "aten._grouped_mm"]
    assert after[0].shapes[-1] == (512, 256, 256, 256, 256, 256, 256, 0)
    assert after[0].signature != before[0].signature  # kernel classes of two splits differ
    assert after[0].mem_bytes < before[0].mem_bytes  # the expert given no token reads no weight


@pytest.mark.parametrize("routing, match", [("skewed", "'balanced' or a sequence"), ([1, -1] * 4, "non-negative"),
                                            ([0] * 8, "not all zero"), ([1] * 4, "4 expert shares, but the grouped "
                                                                         "GEMM in module model.model.layers.0")])
def test_a_bad_routing_is_refused_in_one_line(routing, match):
    with pytest.raises(InvalidSettingError, match=match):
        trace_iteration(get_workload(hf("mixtral"), micro_batch_size=1, seq_len=64), routing=routing)


def test_tensor_parallelism_on_experts_is_refused_and_data_parallelism_all_reduces_them():
    with pytest.raises(InvalidSettingError, match=r"^layout tp=2 would shard mixtral's mixture-of-experts layers "
                                                  r"\(model.model.layers.0.mlp.experts and 1 more\)"):
        traced("mixtral", layout=Layout(tp=2))
    dp = traced("mixtral", layout=Layout(dp=2))
    buckets = [k for k in dp.kernels if k.kind == "all-reduce" and k.stream == 1]
    assert sum(k.comm_bytes for k in buckets) == 2 * dp.meta["n_params"]  # the experts' gradients included


def _meta_model(name: str, **kwargs):
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config(name))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, **kwargs).train()


def _step(model, tokens: int = 64):
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    idx = torch.zeros(1, tokens, dtype=torch.long, device="meta")

    def step():
        model(input_ids=idx, labels=idx).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def test_trace_step_traces_the_experts_as_the_built_in_path_does():
    from freqopt.workload.step_trace import trace_step

    model = _meta_model("mixtral", attn_implementation="sdpa")
    trace = trace_step(_step(model), name="mixtral", module=model, seq_len=64)
    reference = trace_iteration(get_workload(hf("mixtral"), micro_batch_size=1, seq_len=64))
    grouped = [k for k in trace.kernels if k.name == "aten._grouped_mm"]
    assert len(grouped) == 12 and all(k.kind == "gemm" for k in grouped)
    gemm = sum(k.flops for k in trace.kernels if k.kind == "gemm")
    assert gemm == sum(k.flops for k in reference.kernels if k.kind == "gemm")
    skewed = trace_step(_step(model), name="mixtral", module=model, seq_len=64, routing=[1] * 7 + [0])
    assert skewed.meta["routing"][-1] == 0.0


def test_the_eager_experts_loop_is_refused_naming_the_module_and_what_to_set():
    from freqopt.workload.step_trace import trace_step

    model = _meta_model("mixtral", attn_implementation="sdpa", experts_implementation="eager")
    with pytest.raises(InvalidSettingError, match=r"^the experts in module model.layers.0.mlp.experts "
                                                  r"\(MixtralExperts\) run transformers' 'eager' experts loop.*"
                                                  r"experts_implementation='grouped_mm'"):
        trace_step(_step(model), name="mixtral", module=model, warmup=0)


def test_expert_parallelism_warns_that_its_all_to_all_is_left_out():
    from freqopt.workload.step_trace import trace_step

    model = _meta_model("mixtral", attn_implementation="sdpa")
    for m in model.modules():
        if hasattr(m, "_is_expert_parallel"):
            m._is_expert_parallel = True
    with pytest.warns(UntracedWarning) as record:
        trace_step(_step(model), name="mixtral", module=model, warmup=0)
    messages = [str(w.message) for w in record if w.category is UntracedWarning]
    assert messages == [f"expert parallelism in module model.layers.{i}.mlp.experts (MixtralExperts): the all-to-all "
                        "dispatch and combine of the routed tokens are not traced (freqopt's layouts have no "
                        "expert-parallel degree; every rank is traced holding every expert)" for i in (0, 1)]


@torch.library.custom_op("freqopt_test::opaque_ffn", mutates_args=())
def _opaque_ffn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@_opaque_ffn.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


_opaque_ffn.register_autograd(lambda ctx, grad: (grad @ ctx.w.t(), ctx.x.t() @ grad),
                              setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
                              or setattr(ctx, "w", inputs[1]))  # fmt: skip


class _Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(64, 64))

    def forward(self, x):
        return _opaque_ffn(x, self.w)


def test_an_operator_outside_aten_warns_naming_its_module_and_what_is_left_out():
    from freqopt.workload.step_trace import trace_step

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), _Opaque())
    x = torch.zeros(8, 64, device="meta")
    optimizer = torch.optim.SGD(model.parameters())

    def step():
        model(x).sum().backward()
        optimizer.step()

    with pytest.warns(UntracedWarning, match=r"freqopt_test.opaque_ffn in module 1 \(_Opaque\): an operator from "
                                             r"outside ATen.*compute and memory traffic are left out"):
        trace_step(step, name="opaque", module=model)
    with warnings.catch_warnings():  # a model of ATen operators alone is not warned of
        warnings.simplefilter("error", UntracedWarning)
        traced("qwen2_moe")
        trace_iteration(get_workload(hf("mixtral"), micro_batch_size=1, seq_len=64))


def test_the_replay_runs_grouped_gemms_with_the_traced_split():
    from freqopt.gpu.replay import _grouped_offsets, build_replay

    balanced = trace_iteration(get_workload(hf("mixtral"), micro_batch_size=1, seq_len=64))
    skewed = trace_iteration(get_workload(hf("mixtral"), micro_batch_size=1, seq_len=64), routing=[3, 1] + [0] * 6)
    first = next(k for k in balanced.kernels if k.name == "aten._grouped_mm")
    assert _grouped_offsets(first) == tuple(range(16, 129, 16))
    grouped = [k for k in skewed.kernels if k.name == "aten._grouped_mm"]
    assert all(_grouped_offsets(k) == (96,) + (128,) * 7 for k in grouped)
    cache: dict = {}
    plan = build_replay(grouped[:2], device="cpu", cache=cache)  # a grouped GEMM on the host
    assert plan.modes == ["exact", "exact"], plan.reasons
    out = plan.steps[0]().float()
    x = next(t for t in cache.values() if isinstance(t, torch.Tensor) and t.shape == (128, 256)).float()
    w = next(t for t in cache.values() if isinstance(t, torch.Tensor) and t.dim() == 3).float()
    torch.testing.assert_close(out[:96], x[:96] @ w[0], atol=1e-3, rtol=0.02)  # expert 0 takes the first 96 rows
    torch.testing.assert_close(out[96:], x[96:] @ w[1], atol=1e-3, rtol=0.02)  # expert 1 the other 32


def test_dense_models_are_unchanged_by_routing():
    w = get_workload(hf("llama"), micro_batch_size=1, seq_len=64)
    assert not [k for k in trace_iteration(w).kernels if k.name == "aten._grouped_mm"]
    assert len(trace_iteration(w, routing=[1, 2])) == len(trace_iteration(w))
