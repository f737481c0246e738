import pytest
import torch

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.workload.models import build_model, count_parameters, get_workload, list_models
from freqopt.workload.models.ops import MixedPrecisionAdamW, flash_attention, flash_attention_backward

# Brown et al. 2020, Table 2.1: n_params.
# Devlin et al. 2019 (110M, 340M) and Sanh et al. 2019 (66M).
BERT_PARAMS = {"bert-base": 110e6, "bert-large": 340e6, "distilbert": 66e6}
PAPER_PARAMS = {"gpt3-small": 125e6, "gpt3-medium": 350e6, "gpt3-large": 760e6, "gpt3-xl": 1.3e9,
                "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9}


@pytest.mark.parametrize("name", list(PAPER_PARAMS))
def test_parameter_counts_match_gpt3_paper(name):
    assert count_parameters(get_workload(name).config) == pytest.approx(PAPER_PARAMS[name], rel=0.03)


@pytest.mark.parametrize("name", list(BERT_PARAMS))
def test_bert_parameter_counts_match_papers(name):
    assert count_parameters(get_workload(name).config) == pytest.approx(BERT_PARAMS[name], rel=0.03)


def test_family_is_complete_and_context_is_2048():
    assert list_models() == list(PAPER_PARAMS) + list(BERT_PARAMS)
    assert {get_workload(m).config.seq_len for m in PAPER_PARAMS} == {2048}


def test_overrides_apply_and_are_checked():
    w = get_workload("gpt3-xl", micro_batch_size=40, seq_len=1024, n_heads=16)
    assert (w.micro_batch_size, w.config.seq_len, w.config.n_heads) == (40, 1024, 16)
    with pytest.raises(InvalidSettingError, match="does not divide"):
        get_workload("gpt3-small", n_heads=7)
    with pytest.raises(InvalidSettingError):
        get_workload("gpt3-small", seq_len=0)
    with pytest.raises(UnknownNameError, match="gpt3-small"):
        get_workload("gpt-5")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, {"atol": 1e-5, "rtol": 1e-4}),
                                        (torch.bfloat16, {"atol": 3e-2, "rtol": 3e-2})])  # fmt: skip
def test_flash_attention_matches_sdpa_forward_and_backward(causal, dtype, tol):
    """The fused CPU kernels give PyTorch SDPA's output and gradients, through autograd and called directly."""
    torch.manual_seed(0)
    B, nh, T, hs = 2, 3, 37, 16  # T not a multiple of any tile size
    q, k, v = (torch.randn(B, nh, T, hs, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, nh, T, hs, dtype=dtype)
    out = flash_attention(q, k, v, causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert out.shape == (B, nh, T, hs) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    # The backward op takes a forward call's tensors directly (as the replay harness calls it).
    with torch.no_grad():
        o, lse = torch.ops.freqopt.flash_attention(q, k, v, causal)
        direct = flash_attention_backward(grad, q, k, v, o, lse, causal)
    assert lse.shape == (B, nh, T)
    for g, w in zip(direct, want):
        torch.testing.assert_close(g, w, **tol)


def test_flash_attention_on_cpu_runs_no_t_by_t_intermediate():
    """A real forward and backward runs PyTorch's fused CPU kernels and no softmax or matmul over (T, T) scores."""
    from torch.profiler import ProfilerActivity, profile

    T = 64
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        flash_attention(q, k, v, True).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= names  # fmt: skip
    assert not names & {"aten::_softmax", "aten::softmax", "aten::_softmax_backward_data"}
    square = [e.name for e in prof.events() if any(len(s) >= 2 and s[-2:] == [T, T] for s in e.input_shapes)]
    assert square == []


@pytest.mark.slow
def test_tiny_gpt_trains_on_cpu():
    """The same module the tracer uses runs for real: the loss falls on a repeated batch."""
    torch.manual_seed(0)
    config = get_workload("gpt3-small", seq_len=32).config
    from dataclasses import replace

    config = replace(config, n_layers=2, d_model=64, n_heads=4, vocab_size=97)
    model = build_model(config, device="cpu", dtype=torch.float32)
    opt = MixedPrecisionAdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    idx = torch.randint(0, 97, (4, 32))
    losses = []
    for _ in range(30):
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_gpt3_vocabulary_is_padded_to_a_multiple_of_128_and_bert_is_not():
    c = get_workload("gpt3-small").config
    assert (c.vocab_size, c.vocab_multiple, c.padded_vocab_size) == (50257, 128, 50304)  # nanoGPT's 50304
    model = build_model(c)
    assert tuple(model.wte.weight.shape) == (50304, 768) and model.lm_head.weight is model.wte.weight
    assert get_workload("gpt3-small", vocab_multiple=1).config.padded_vocab_size == 50257
    bert = get_workload("bert-base").config
    assert bert.padded_vocab_size == bert.vocab_size == 30522  # HF bert-base-uncased, as McDonald et al. ran it
    assert get_workload("bert-base", vocab_multiple=128).config.padded_vocab_size == 30592


@pytest.mark.slow
def test_trace_runs_the_logit_gemm_on_the_padded_vocabulary():
    from freqopt.workload.trace import trace_training_iteration

    trace = trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=64))
    widths = {n for k in trace.kernels if k.kind == "gemm" for shape in k.shapes for n in shape}
    assert 50304 in widths and 50257 not in widths


@pytest.mark.parametrize("bad", [0, -128, 2.5])
def test_vocab_multiple_must_be_a_positive_integer(bad):
    with pytest.raises(InvalidSettingError, match=r"^vocab_multiple must be a positive integer, not"):
        get_workload("gpt3-small", vocab_multiple=bad)


@pytest.mark.slow
def test_cli_models_states_the_padded_vocabulary_and_checks_vocab_multiple(capsys):
    from freqopt.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "50304 (50257)" in out and "30522" in out
    assert main(["models", "--vocab-multiple", "1"]) == 0
    assert "50304" not in capsys.readouterr().out
    assert main(["models", "--vocab-multiple", "0"]) == 2
    err = capsys.readouterr().err
    assert "--vocab-multiple must be a positive integer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_loss_takes_targets_sliced_from_a_token_batch(micro_batch):
    """Targets sliced from a (B, T + 1) batch are not contiguous for B > 1; the loss must take them."""
    from dataclasses import replace

    for name in ("gpt3-small", "bert-base"):
        config = replace(get_workload(name, seq_len=16).config, n_layers=1, d_model=32, n_heads=2, vocab_size=97)
        model = build_model(config, device="cpu", dtype=torch.float32)
        tokens = torch.randint(0, 97, (micro_batch, 17))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert torch.isfinite(loss)


def test_the_light_list_of_model_names_is_the_models_own():
    """freqopt.workload.model_names (checked before PyTorch is imported) names exactly the built-in models, in
    their order."""
    from freqopt.workload.model_names import MODEL_NAMES
    from freqopt.workload.models import list_models

    assert list(MODEL_NAMES) == list_models()


def test_attention_sdpa_traces_pytorchs_sdpa_kernels_and_computes_the_same():
    """get_workload(..., attention="sdpa"): the GPT-3 modules call F.scaled_dot_product_attention (the program the
    shared H100 steps ran), traced as SDPA_KERNEL_NAMES, one kernel each way as freqopt's op, with its FLOPs and
    bytes; on real tensors both paths give the same output. Other models and other values are refused."""
    import dataclasses

    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.models.sdpa import SDPA_KERNEL_NAMES
    from freqopt.workload.trace import trace_training_iteration

    flash = trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=128)).kernels
    sdpa = trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=128, attention="sdpa")).kernels
    attention = [k for k in sdpa if k.kind == "attention"]
    assert {k.name for k in attention} == set(SDPA_KERNEL_NAMES) and len(attention) == 24
    assert [(k.flops, k.mem_bytes) for k in attention] == [(k.flops, k.mem_bytes) for k in flash if k.kind == "attention"]
    assert len(sdpa) == len(flash)
    torch.manual_seed(0)
    config = GPTConfig(n_layers=1, d_model=64, n_heads=2, vocab_size=100, seq_len=16)
    a = build_model(config, device="cpu", dtype=torch.float32)
    b = build_model(dataclasses.replace(config, attention="sdpa"), device="cpu", dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 100, (2, 16))
    assert torch.allclose(a(idx), b(idx), atol=1e-5)
    with pytest.raises(InvalidSettingError, match="GPT-3 models only"):
        get_workload("bert-base", attention="sdpa")
    with pytest.raises(InvalidSettingError, match="one of flash, sdpa"):
        get_workload("gpt3-small", attention="math")
