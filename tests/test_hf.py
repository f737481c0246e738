"""Hugging Face language models as workloads (hf:PATH): traced with fused attention, FLOPs against the analytic count,
parallel layouts, phase marks, a search, and the errors for missing transformers or bad configs."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from freqopt.errors import InvalidSettingError, UnknownNameError  # noqa: E402
from freqopt.workload.layout import Layout  # noqa: E402
from freqopt.workload.models import build_model, config_from_dict, count_parameters, get_workload  # noqa: E402
from freqopt.workload.models.parallel import COMM_STREAM  # noqa: E402
from freqopt.workload.trace import trace_iteration  # noqa: E402

DATA = Path(__file__).parent / "data" / "hf"
CONFIGS = ("llama", "mistral", "qwen2", "gpt2")
B, T = 2, 128


def hf(name: str) -> str:
    return f"hf:{DATA / name}"


_traces: dict = {}


def traced(name: str, layout: Layout | None = None):
    key = (name, layout)
    if key not in _traces:
        _traces[key] = trace_iteration(get_workload(hf(name), micro_batch_size=B, seq_len=T, layout=layout))
    return _traces[key]


def matmul_parameters(model: nn.Module) -> int:
    """Weights of the Linear and GPT-2 Conv1D layers, the output layer included (counted even when tied to the
    embedding: its matmul runs either way); embeddings, norms and biases excluded."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


@pytest.mark.parametrize("name", CONFIGS)
def test_attention_is_one_fused_kernel_each_way(name):
    trace = traced(name)
    c = trace.workload.config
    attention = [k for k in trace.kernels if k.kind == "attention"]
    assert [k.pass_name for k in attention] == ["forward"] * c.n_layers + ["backward"] * c.n_layers
    assert all(k.causal and k.tensor_core for k in attention)
    q, kk, v = attention[0].shapes[:3]
    assert q == (B, c.n_heads, T, c.head_dim) and kk == v == (B, c.n_kv_heads, T, c.head_dim)  # GQA read as is
    assert not [k for k in trace.kernels if k.name in ("aten.bmm", "aten.baddbmm")]
    scores = [k for k in trace.kernels if any(len(s) >= 2 and s[-2:] == (T, T) for s in k.shapes)]
    assert not scores, [k.name for k in scores]  # no (T, T) score or mask tensor anywhere
    assert {k.name for k in trace.kernels if k.kind == "softmax"} <= {"aten._log_softmax",
                                                                       "aten._log_softmax_backward_data"}


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_match_the_analytic_count(name):
    trace = traced(name)
    c = trace.workload.config
    model = build_model(c)
    expected = 6 * B * T * matmul_parameters(model) + 12 * c.n_layers * B * T * T * c.n_heads * c.head_dim
    assert trace.total_flops == pytest.approx(expected, rel=0.05)
    assert trace.meta["n_params"] == count_parameters(c)


@pytest.mark.parametrize("name", CONFIGS)
def test_data_parallel_buckets_gradients(name):
    single, dp = traced(name), traced(name, Layout(dp=2))
    buckets = [k for k in dp.kernels if k.kind == "all-reduce" and k.stream == COMM_STREAM]
    assert buckets and all(k.pass_name == "backward" and k.group_size == 2 for k in buckets)
    # the buckets carry every gradient once, in bf16
    assert sum(k.comm_bytes for k in buckets) == 2 * single.meta["n_params"]


@pytest.mark.parametrize("name", CONFIGS)
def test_tensor_parallel_shards_heads_and_adds_all_reduces(name):
    single, tp = traced(name), traced(name, Layout(tp=2))
    c = tp.workload.config
    forward_reduces = [k for k in tp.kernels if k.kind == "all-reduce" and k.pass_name == "forward"]
    assert len(forward_reduces) == 2 * c.n_layers  # after the attention output and the MLP down projection
    assert all(k.shapes == ((B, T, c.d_model),) for k in forward_reduces)
    assert any(k.kind == "all-reduce" and k.pass_name == "backward" for k in tp.kernels)
    q, kk, _ = next(k for k in tp.kernels if k.kind == "attention").shapes[:3]
    assert q[1] == c.n_heads // 2 and kk[1] == c.n_kv_heads // 2
    assert tp.meta["n_params"] < single.meta["n_params"]
    gemm_flops = sum(k.flops for k in tp.kernels if k.kind == "gemm")
    assert gemm_flops < sum(k.flops for k in single.kernels if k.kind == "gemm")


def test_tensor_parallel_must_divide_the_key_value_heads():
    with pytest.raises(InvalidSettingError, match="key/value heads"):
        get_workload(hf("mistral"), layout=Layout(tp=4))  # 8 heads, 2 key/value heads


def test_phase_marks_are_the_decoder_layers_children():
    trace = traced("llama")
    labels = [label for label, _ in trace.meta["marks"]]
    assert "fwd:model.model.layers.0.self_attn" in labels and "bwd:model.model.layers.1.mlp" in labels
    assert "fwd:model.model.embed_tokens" in labels and "fwd:model.lm_head" in labels
    assert labels.count("step") == 1
    gpt2 = [label for label, _ in traced("gpt2").meta["marks"]]
    assert "fwd:model.transformer.h.1.attn" in gpt2


def test_config_is_hashable_and_rebuilds_from_its_dict():
    w = get_workload(hf("qwen2"), micro_batch_size=B, seq_len=T)
    c = w.config
    assert w.model == "hf:qwen2" and c.seq_len == T and c.tied_embeddings and c.n_kv_heads == 2
    assert get_workload(hf("qwen2")).config.seq_len == 2048  # min(max_position_embeddings 4096, 2048)
    assert get_workload(hf("llama")).config.seq_len == 512  # max_position_embeddings
    again = config_from_dict(w.model, dataclasses.asdict(c))
    assert again == c and hash(again) == hash(c)
    assert len(trace_iteration(dataclasses.replace(w, config=again))) == len(trace_iteration(w))


def test_a_short_search_runs_on_an_hf_trace():
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu
    from freqopt.search.runner import SearchConfig, run_search

    config = SearchConfig(max_slowdown=0.01, granularities=("pass",), n_trials_1d=4, n_trials_per_mem_clock=1,
                          validation_repeats=1, finalist_repeats=0)  # fmt: skip
    result = run_search(traced("llama"), SimulatedGPU(get_gpu("h100-sxm")), config)
    validated = result.results["pass"].validated
    assert validated.time_s <= result.baseline.time_s * 1.02
    assert validated.energy_j < result.baseline.energy_j


def test_missing_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(UnknownNameError, match=r"pip install 'transformers>=4.47' 'accelerate>=1.1' \(or pip install -e "
                                               r"'\.\[hf\]' in the freqopt checkout\)"):
        get_workload(hf("llama"))


def test_bad_configs_name_their_path(tmp_path):
    with pytest.raises(UnknownNameError, match="no Hugging Face config at .*nowhere"):
        get_workload(f"hf:{tmp_path / 'nowhere'}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidSettingError, match=f"cannot read the Hugging Face config .*{tmp_path.name}"):
        get_workload(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(InvalidSettingError, match="names no model_type"):
        get_workload(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(UnknownNameError, match=tmp_path.name):
        get_workload(f"hf:{tmp_path}")
    with pytest.raises(InvalidSettingError, match="exceeds the 512 positions"):
        get_workload(hf("llama"), seq_len=1024)
    with pytest.raises(InvalidSettingError, match="n_heads applies to the built-in models"):
        get_workload(hf("llama"), n_heads=4)


def test_sdpa_on_real_tensors_is_untouched():
    from freqopt.workload.models.sdpa import FusedSDPA

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with FusedSDPA():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, expected)


def test_an_encoder_config_is_traced_as_masked_lm_training():
    """Issue 36, item 3: an hf: BERT config is a BertForMaskedLM trained on every position's logits with
    bidirectional attention (it was BertLMHeadModel, a causal LM, which BERT is not trained as)."""
    trace = traced("bert")
    config = trace.workload.config
    assert config.task == "masked-lm" and not config.causal
    assert type(build_model(config).model).__name__ == "BertForMaskedLM"
    attention = [k for k in trace.kernels if k.kind == "attention"]
    assert len(attention) == 2 * config.n_layers and not any(k.causal for k in attention)
    assert traced("llama").workload.config.task == "causal-lm"


def test_fused_projections_under_tensor_parallelism_are_refused_in_one_line():
    """Issue 36, item 3: Phi-3's fused qkv_proj and gate_up_proj, whose forward splits the fused output by the
    whole model's head counts, traced at tp=1 and refused at tp=2 (it failed inside a matmul)."""
    assert traced("phi3").workload.config.model_type == "phi3"
    with pytest.raises(InvalidSettingError, match=r"^layout tp=2 shards phi3's fused projections \(gate_up_proj, "
                                                  r"qkv_proj\), which freqopt does not model: use tp=1"):
        traced("phi3", Layout(tp=2))


def test_an_architecture_without_sdpa_is_traced_with_its_eager_attention():
    """Issue 36, item 3: transformers has no SDPA attention for Gemma-2 (it soft-caps the attention logits), which
    raised a 60-line ValueError; it now runs, as transformers runs it, with eager attention, and says so."""
    with pytest.warns(UserWarning, match="no SDPA attention for model_type 'gemma2'"):
        trace = trace_iteration(get_workload(hf("gemma2"), micro_batch_size=B, seq_len=T))
    assert not [k for k in trace.kernels if k.kind == "attention"]  # no fused kernel: GEMMs and a softmax
    assert [k for k in trace.kernels if k.kind == "softmax" and k.pass_name == "forward"]


def test_a_config_transformers_cannot_build_is_one_line(tmp_path):
    data = json.loads((DATA / "phi3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "pad_token_id": 32000}))  # outside the vocabulary
    with pytest.raises(InvalidSettingError, match=r"^transformers cannot build hf:\S+ \(model_type 'phi3'\) from "
                                                  "its config: Padding_idx must be within num_embeddings"):
        trace_iteration(get_workload(f"hf:{tmp_path}", micro_batch_size=B, seq_len=T))


def test_the_cli_refuses_an_unbuildable_config_in_one_line_and_writes_nothing(tmp_path, capsys):
    from freqopt.cli import main

    data = json.loads((DATA / "phi3" / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**data, "pad_token_id": 32000}))
    for model, layout in ((f"hf:{tmp_path / 'bad'}", "dp=1"), (hf("phi3"), "tp=2")):
        out = tmp_path / "out"
        assert main(["search", "--model", model, "--layout", layout, "--max-slowdown", "2%", "--seq-len", "128",
                     "--out", str(out)]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("freqopt: error: ") and not out.exists()


# Tiny configs of a sequence-to-sequence LM and an image classifier, which hf: does not build.
T5_CONFIG = {"model_type": "t5", "vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
             "num_heads": 4, "decoder_start_token_id": 0}
VIT_CONFIG = {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "image_size": 32, "patch_size": 8, "num_labels": 10}


@pytest.mark.slow
@pytest.mark.parametrize("config, auto, inputs", [
    (T5_CONFIG, "AutoModelForSeq2SeqLM", lambda: {"input_ids": torch.randint(0, 128, (2, 16)),
                                                 "labels": torch.randint(0, 128, (2, 8))}),
    (VIT_CONFIG, "AutoModelForImageClassification", lambda: {"pixel_values": torch.randn(2, 3, 32, 32),
                                                            "labels": torch.randint(0, 10, (2,))}),
], ids=["t5", "vit"])  # fmt: skip
def test_t5_and_vit_are_refused_as_freqopts_limit_with_the_trace_step_that_traces_them(tmp_path, config, auto,
                                                                                        inputs):  # fmt: skip
    """hf: builds causal and masked LMs only: T5 and ViT are refused in one line saying so (freqopt's limit, not
    transformers') with the trace_step call to use instead, and that call, as the message writes it, traces them."""
    import transformers

    import freqopt

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownNameError) as e:
        get_workload(f"hf:{tmp_path}")
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "freqopt's hf: models are causal and masked language models only" in \
        message and f"{auto}.from_config(config) under torch.device('meta')" in message, message
    assert "transformers has no" not in message
    step = message[message.index("freqopt.trace_step(lambda: ("):]
    forward = step[step.index("m(") + 2:step.index(").loss")]  # the keyword arguments the message passes
    assert sorted(part.split("=")[0] for part in forward.split(", ")) == sorted(inputs())
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        m = getattr(transformers, auto).from_config(hf_config)
        batch = inputs()
    opt = torch.optim.AdamW(m.parameters())
    trace = freqopt.trace_step(lambda: (m(**batch).loss.backward(), opt.step()), name=config["model_type"], module=m)
    assert len(trace.kernels) > 50 and {k.pass_name for k in trace.kernels} >= {"forward", "backward", "optimizer"}
