import pytest
import torch

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.models import build_model, count_parameters, get_workload, list_models
from freqopt.models.ops import MixedPrecisionAdamW, flash_attention

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


def test_flash_attention_matches_sdpa_forward_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (True, False):
        out = flash_attention(q, k, v, causal)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        torch.testing.assert_close(out, ref)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


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
