"""Serving workloads (freqopt.workload.serving): a decode step reads every weight once and every cached key and
value once, a prefill's attention is causal FlashAttention, a unified step's GEMMs span every token it carries, and
bad sizes or configs are refused in one line."""

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from freqopt.errors import InvalidSettingError  # noqa: E402
from freqopt.gpu.backends.base import DEFAULT_SETTING  # noqa: E402
from freqopt.gpu.backends.simulated import SimulatedGPU  # noqa: E402
from freqopt.gpu.specs import get_gpu  # noqa: E402
from freqopt.workload.serving import (BYTES, cuda_graph_spec, decode_kernels, prefill_kernels, serving_model,  # noqa: E402
                                      step_kernels)  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = f"hf:{ROOT / 'experiments' / 'data' / 'leaderboard' / 'qwen3-8b'}"
HF = Path(__file__).parent / "data" / "hf"


@pytest.fixture(scope="module")
def qwen3():
    return serving_model(QWEN3_8B)


def test_the_config_gives_the_published_sizes(qwen3):
    m = qwen3
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size) == (
        36, 4096, 32, 8, 128, 12288, 151936)
    assert m.qk_norm and m.n_params == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B: 8.2 B parameters
    assert m.kv_bytes_per_token() == 36 * 2 * 8 * 128 * 2  # 147,456 B: 144 KiB a token


def test_a_decode_step_reads_each_weight_and_cached_token_once(qwen3):
    b, length = 16, 1000
    kernels = decode_kernels(qwen3, b, length)
    gemms = [k for k in kernels if k.kind == "gemm"]
    assert len(gemms) == 4 * 36 + 1  # qkv, o, gate_up, down per layer; the LM head
    weight_bytes = sum(k.shapes[1][0] * k.shapes[1][1] * BYTES for k in gemms)
    assert weight_bytes == pytest.approx(qwen3.n_params * BYTES - qwen3.vocab_size * qwen3.d_model * BYTES)  # no embedding
    assert all(k.shapes[0][0] == b for k in gemms)  # one row per decoding sequence
    attention = [k for k in kernels if k.name == "freqopt.decode_attention"]
    assert len(attention) == 36 and attention[0].kind == "reduction" and not attention[0].tensor_core
    kv = 2 * b * (length + 1) * 8 * 128 * BYTES
    assert sum(k.mem_bytes for k in attention) >= 36 * kv
    assert sum(k.mem_bytes for k in attention) == pytest.approx(36 * kv, rel=0.01)  # the queries are ~0.5 %


def test_a_unified_step_shares_its_gemms_and_a_prefill_is_causal_flash_attention(qwen3):
    mixed = step_kernels(qwen3, 8, 500, prefill_tokens=1024, prompt_len=1024)
    assert {k.shapes[0][0] for k in mixed if k.kind == "gemm" and k.shapes[1][1] != qwen3.vocab_size} == {8 + 1024}
    names = [k.name for k in mixed]
    assert names.count("freqopt.decode_attention") == names.count("freqopt.flash_attention") == 36
    prefill = [k for k in prefill_kernels(qwen3, 2048, batch_size=2) if k.kind == "attention"]
    assert all(k.causal and k.tensor_core and k.shapes[0] == (2, 32, 2048, 128) for k in prefill)


def test_a_mixture_of_experts_step_reads_the_experts_its_tokens_touch():
    moe = serving_model(f"hf:{ROOT / 'experiments' / 'data' / 'leaderboard' / 'qwen3-30b-a3b'}")
    assert (moe.n_experts, moe.experts_per_token, moe.d_ff) == (128, 8, 768) and moe.qk_norm
    assert moe.n_params == pytest.approx(30.5e9, rel=0.02)  # Qwen3-30B-A3B: 30.5 B parameters
    assert moe.experts_touched(1) == pytest.approx(8) and moe.experts_touched(8) == pytest.approx(51.6, abs=0.1)
    assert moe.experts_touched(256) == pytest.approx(128, abs=0.01)

    def expert_bytes(b):
        return sum(k.mem_bytes for k in decode_kernels(moe, b, 1000) if k.name == "vllm.fused_moe")

    per_expert = 3 * 2048 * 768 * BYTES
    assert expert_bytes(8) == pytest.approx(48 * moe.experts_touched(8) * per_expert, rel=0.01)
    assert expert_bytes(256) == pytest.approx(48 * 128 * per_expert, rel=0.05)  # every expert, and the tokens' rows


def test_gemma3s_sliding_window_layers_read_at_most_their_window():
    gemma = serving_model(f"hf:{ROOT / 'experiments' / 'data' / 'leaderboard' / 'gemma-3-12b'}")
    assert gemma.sliding_window == 1024 and sum(gemma.window_layers) == 40 and not gemma.window_layers[5]
    assert gemma.tied_embeddings and gemma.sandwich_norms and gemma.n_params == pytest.approx(11.77e9, rel=0.01)
    attention = [k for k in decode_kernels(gemma, 4, 4000) if k.name == "freqopt.decode_attention"]
    keys = [k.shapes[1][2] for k in attention]
    assert keys.count(1024) == 40 and keys.count(4001) == 8  # 5 of every 6 layers: the window; the rest: all
    norms = [k for k in decode_kernels(gemma, 4, 100) if k.kind == "normalization" and k.shapes[0][1] == 3840]
    assert len(norms) == 4 * 48 + 1  # Gemma's four norms a layer, and the final one


def test_tensor_parallelism_shards_the_weights_and_adds_two_all_reduces_a_layer(qwen3):
    half = qwen3.sharded(2)
    assert (half.n_heads, half.n_kv_heads, half.d_ff, half.tp) == (16, 4, 6144, 2)
    one, two = decode_kernels(qwen3, 16, 1000), decode_kernels(half, 16, 1000)
    weights = [sum(k.shapes[1][0] * k.shapes[1][1] for k in ks if k.kind == "gemm") for ks in (one, two)]
    assert weights[1] == pytest.approx(weights[0] / 2, rel=0.001)  # each GPU reads half the weights
    reduces = [k for k in two if k.kind == "all-reduce"]
    assert len(reduces) == 2 * 36 and all(k.group_size == 2 and k.comm_bytes == 16 * 4096 * BYTES for k in reduces)
    assert not any(k.kind == "all-reduce" for k in one)
    assert qwen3.sharded(16).n_kv_heads == 1  # fewer KV heads than GPUs: each keeps one (vLLM replicates them)
    with pytest.raises(InvalidSettingError, match="^tp 3 does not divide query heads"):
        qwen3.sharded(3)
    with pytest.raises(InvalidSettingError, match="sharded already"):
        half.sharded(2)


def test_decode_time_and_energy_grow_with_the_batch_and_the_cache(qwen3):
    sim = SimulatedGPU(cuda_graph_spec(get_gpu("h100-sxm")), noise=False)

    def at(b, length):
        return sim.true_measure(decode_kernels(qwen3, b, length), DEFAULT_SETTING)

    small, big, long = at(8, 1000), at(64, 1000), at(8, 8000)
    assert small.time_s < big.time_s < 8 * small.time_s  # weights read once for the whole batch
    assert small.time_s < long.time_s
    assert big.energy_j / 64 < small.energy_j / 8  # energy per token falls with the batch
    # The weights alone (16.4 GB) at the H100's 3.35 TB/s bound a step from below.
    assert small.time_s > qwen3.n_params * BYTES / 3352e9


# Qwen1.5-MoE-A2.7B's sizes (its Hugging Face config.json): 60 routed experts of 1408, top 4, and one shared expert
# of 5632 with its gate, in each of 24 layers.
QWEN15_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
              "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
              "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip


def test_a_shared_expert_is_read_by_every_step_and_sharded_with_the_layer(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN15_MOE))
    moe = serving_model(f"hf:{tmp_path}")
    assert (moe.n_experts, moe.experts_per_token, moe.d_ff, moe.shared_d_ff) == (60, 4, 1408, 5632)
    assert moe.n_params == pytest.approx(14.3e9, rel=0.01)  # Qwen1.5-MoE-A2.7B: 14.3 B parameters in all

    def shared_bytes(model, b):  # the dense GEMMs after the routed experts: the shared expert and its gate
        kernels = decode_kernels(model, b, 100)
        ends = [i for i, k in enumerate(kernels) if k.name == "vllm.moe_sum"]
        return sum(k.mem_bytes for i in ends for k in kernels[i + 1:i + 5] if k.name == "aten.mm")

    # Bytes grow by the same activations per sequence at every batch, over the weights read once a step, whatever
    # the routing: gate/up, down and the gate's weights, 24 layers.
    one, per_sequence = shared_bytes(moe, 1), shared_bytes(moe, 2) - shared_bytes(moe, 1)
    assert one - per_sequence == pytest.approx(24 * (3 * 2048 * 5632 + 2048) * BYTES, rel=1e-12)
    assert shared_bytes(moe, 256) == pytest.approx(one + 255 * per_sequence, rel=1e-12)
    half = moe.sharded(2)
    assert half.shared_d_ff == 2816 and half.n_params < moe.n_params
    with pytest.raises(InvalidSettingError, match=r"^tp 3 does not divide query heads"):
        moe.sharded(3)
    odd = dataclasses.replace(moe, shared_d_ff=5633)
    with pytest.raises(InvalidSettingError, match="shared expert's intermediate size"):
        odd.sharded(2)


@pytest.mark.parametrize("call, fragment", [
    (lambda m: decode_kernels(m, 0, 100), "batch_size must be a positive whole number"),
    (lambda m: decode_kernels(m, 8, -1), "kv_len must be a positive whole number"),
    (lambda m: step_kernels(m, 8, 100, prefill_tokens=-3), "prefill_tokens must be a whole number >= 0"),
    (lambda m: prefill_kernels(m, 1.5), "prompt_len must be a positive whole number"),
])
def test_bad_sizes_are_refused(qwen3, call, fragment):
    with pytest.raises(InvalidSettingError, match=fragment):
        call(qwen3)


def test_configs_it_does_not_model_are_refused_in_one_line():
    with pytest.raises(InvalidSettingError, match="is a DeepSeek-style mixture-of-experts model"):
        serving_model(f"hf:{HF / 'deepseek_v3'}")  # latent attention, several shared experts, dense first layers
    with pytest.raises(InvalidSettingError, match="not a decoder-only language model"):
        serving_model(f"hf:{HF / 'bert'}")
    with pytest.raises(InvalidSettingError, match=r"model must be a Hugging Face config \(hf:PATH\) for serving "
                                                  r"workloads, not 'gpt3-small'"):  # fmt: skip
        serving_model("gpt3-small")


@pytest.mark.slow
def test_serve_search_keeps_every_choice_within_its_target_without_noise():
    """Qwen3-8B at batch 8 on the H100: a decode step is memory-bound, so its SM clock drops with ITL within 5 %;
    every choice is checked noiselessly against its own target, and the prefill's TTFT within 10 %."""
    import freqopt

    result = freqopt.serve_search(QWEN3_8B, batch_sizes=[8], prompt_len=2048, output_len=512,
                                  max_itl_slowdown="5%", max_ttft_slowdown="10%", n_trials=8)  # fmt: skip
    (row,) = result.rows
    assert (result.gpu, row.batch_size, row.kv_len) == ("h100-sxm", 8, 2048 + 256)
    assert row.decode.time_rel <= 1.05 and row.prefill.time_rel <= 1.10 and row.one_setting_decode.time_rel <= 1.05
    assert row.decode.setting.sm_clock_mhz is not None and row.decode.setting.sm_clock_mhz < 1980
    assert row.energy_per_token_j("per-phase") < 0.9 * row.energy_per_token_j("default")  # decode's clock pays
    assert row.energy_per_token_j("one-setting") <= row.energy_per_token_j("default-step")
    assert row.default_prefill.time_s > 1.5 * get_gpu("h100-sxm").clock_switch_s
    assert row.per_phase_realizable  # a 2048-token prefill outlasts the H100's 26 ms switch


def test_per_phase_switching_is_not_realizable_where_a_prefill_is_shorter_than_a_switch():
    import freqopt

    (row,) = freqopt.serve_search(QWEN3_8B, batch_sizes=[8], prompt_len=64, output_len=64, n_trials=4).rows
    assert row.default_prefill.time_s < get_gpu("h100-sxm").clock_switch_s
    assert row.per_phase_realizable == (row.decode.setting == row.prefill.setting)


@pytest.mark.parametrize("given, expected", [
    (1024, ((1024, 1.0),)),
    ("1024", ((1024, 1.0),)),
    ({1024: 1, 256: 3}, ((256, 0.75), (1024, 0.25))),
    ("256:3, 1024:1", ((256, 0.75), (1024, 0.25))),
    ("256,1024,256,256", ((256, 0.75), (1024, 0.25))),  # sampled lengths, weight 1 each
    ([212, 1530, 212], ((212, 2 / 3), (1530, 1 / 3))),
])
def test_a_prompt_length_distribution_is_read_from_a_number_weights_samples_or_text(given, expected):
    from freqopt.workload.serving import prompt_length_distribution

    _same_distribution(prompt_length_distribution(given), expected)


def _same_distribution(found, expected):
    assert [tokens for tokens, _ in found] == [tokens for tokens, _ in expected]
    assert [p for _, p in found] == pytest.approx([p for _, p in expected], rel=1e-12)


def test_a_prompt_length_file_holds_one_sampled_length_a_line(tmp_path):
    from freqopt.workload.serving import prompt_length_distribution

    path = tmp_path / "lengths.txt"
    path.write_text("# prompts of a trace\n256\n\n1024  # a long one\n256\n")
    _same_distribution(prompt_length_distribution(f"@{path}"), ((256, 2 / 3), (1024, 1 / 3)))


@pytest.mark.parametrize("given, fragment", [
    ("abc", "has 'abc', not a positive whole number of tokens"),
    ("0:1", "has 0, not a positive whole number"),
    ("256:-1", "has weight '-1'; weights must be positive"),
    ("256:nan", "has weight 'nan'; weights must be positive"),
    ("256:x", "has weight 'x', not a number"),
    ([], "gives no length"),
    (1.5, "has 1.5, not a positive whole number"),
    ("@/no/such/file", "file '/no/such/file' cannot be read"),
])
def test_a_bad_prompt_length_distribution_is_refused_naming_its_argument(given, fragment):
    from freqopt.workload.serving import prompt_length_distribution

    with pytest.raises(InvalidSettingError, match="^prompt_len ") as info:
        prompt_length_distribution(given)
    assert fragment in str(info.value) and info.value.argument == "prompt_len"


def test_one_prompt_length_given_as_a_distribution_searches_what_the_number_does():
    import freqopt

    def figures(prompt_len):
        result = freqopt.serve_search(QWEN3_8B, batch_sizes=[8], prompt_len=prompt_len, output_len=64, n_trials=4)
        (row,) = result.rows
        return (result.prompt_len, result.prompt_lens, row.kv_len, row.decode.setting, row.prefill.setting,
                row.one_setting.setting, [row.energy_per_token_j(w) for w in ("default", "per-phase", "one-setting")])

    assert figures(512) == figures({512: 7}) == figures("512")


@pytest.mark.slow
def test_prompts_of_several_lengths_hold_every_lengths_ttft_and_count_their_mean_energy():
    """Prompts of 256 and 2048 tokens, 3 to 1: the decode cache holds the mean prompt; the prefill's setting keeps
    each length's TTFT within 10 % of its own default (checked here without noise, at each length), and the
    prefill energy in the energy per token is the lengths' mean."""
    import freqopt
    from freqopt.gpu.backends.base import DEFAULT_SETTING
    from freqopt.workload.serving import prefill_kernels

    result = freqopt.serve_search(QWEN3_8B, batch_sizes=[8], prompt_len={256: 3, 2048: 1}, output_len=512,
                                  max_ttft_slowdown="10%", n_trials=8)  # fmt: skip
    (row,) = result.rows
    assert result.prompt_lens == ((256, 0.75), (2048, 0.25)) and result.prompt_len == 704
    assert row.kv_len == 704 + 256
    sim = SimulatedGPU(cuda_graph_spec(get_gpu("h100-sxm")), noise=False)
    served = serving_model(QWEN3_8B)
    at = {p: (sim.true_measure(prefill_kernels(served, p), row.prefill.setting),
              sim.true_measure(prefill_kernels(served, p), DEFAULT_SETTING)) for p in (256, 2048)}  # fmt: skip
    assert all(chosen.time_s <= 1.10 * default.time_s for chosen, default in at.values())
    assert row.prefill.time_rel == pytest.approx(max(c.time_s / d.time_s for c, d in at.values()), rel=1e-9)
    assert row.prefill.energy_j == pytest.approx(0.75 * at[256][0].energy_j + 0.25 * at[2048][0].energy_j, rel=1e-9)
    assert row.default_prefill.time_s == pytest.approx(0.75 * at[256][1].time_s + 0.25 * at[2048][1].time_s,
                                                       rel=1e-9)  # fmt: skip
    assert row.decode.time_rel <= 1.05 and row.one_setting_decode.time_rel <= 1.05


def test_serve_search_on_a_tensor_parallel_group_runs_one_gpus_share_and_counts_every_gpus_energy(qwen3):
    """At tp 2 each GPU runs half the heads and MLP width with two all-reduces a layer: its default decode step is
    shorter than the whole model's on one GPU, and the energy per token is the group's, twice one GPU's."""
    import freqopt

    result = freqopt.serve_search(QWEN3_8B, batch_sizes=[8], prompt_len=64, output_len=64, n_trials=4, tp=2)
    (row,) = result.rows
    assert result.tp == row.tp == 2
    whole = SimulatedGPU(cuda_graph_spec(get_gpu("h100-sxm")), noise=False)
    one_gpu = whole.true_measure(step_kernels(qwen3, 8, row.kv_len), DEFAULT_SETTING)
    assert row.default_decode.time_s < one_gpu.time_s
    assert any(k.kind == "all-reduce" for k in step_kernels(qwen3.sharded(2), 8, row.kv_len))
    per_gpu = row.default_decode.energy_j / 8 + row.default_prefill.energy_j / 64
    assert row.energy_per_token_j("default") == pytest.approx(2 * per_gpu, rel=1e-12)
    assert row.decode.time_rel <= 1.05 and row.prefill.time_rel <= 1.10
    with pytest.raises(InvalidSettingError, match=r"^tp 3 does not divide") as info:
        freqopt.serve_search(QWEN3_8B, batch_sizes=[8], tp=3)
    assert info.value.argument == "tp"


@pytest.mark.parametrize("args, fragment", [
    (["--batch-sizes", "8,x"], "--batch-sizes must be positive whole numbers"),
    (["--max-itl-slowdown", "abc"], "--max-itl-slowdown"),
    (["--prompt-len", "0"], "--prompt-len has 0, not a positive whole number of tokens"),
    (["--prompt-len", "256:x"], "--prompt-len has weight 'x', not a number"),
    (["--tp", "3"], "--tp 3 does not divide query heads"),
])
def test_cli_serve_search_refuses_bad_input_in_one_line(args, fragment, capsys):
    from freqopt.cli import main

    assert main(["serve-search", "--model", QWEN3_8B, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("freqopt: error: ") and fragment in err[0]


def test_cli_serve_search_prints_the_default_and_chosen_rows(tmp_path, capsys):
    import json

    from freqopt.cli import main

    out = tmp_path / "serve.json"
    assert main(["serve-search", "--model", QWEN3_8B, "--batch-sizes", "8", "--trials", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "default, phases apart" in text and "per phase" in text and "one setting, unified batch" in text
    doc = json.loads(out.read_text())
    assert doc["tp"] == 1 and doc["rows"][0]["batch_size"] == 8 and doc["rows"][0]["decode"]["time_rel"] <= 1.05
    assert doc["prompt_len"] == 1024 and doc["prompt_lens"] == [[1024, 1.0]]


def test_cli_serve_search_takes_a_prompt_length_distribution(tmp_path, capsys):
    import json

    from freqopt.cli import main

    out = tmp_path / "serve.json"
    assert main(["serve-search", "--model", QWEN3_8B, "--batch-sizes", "8", "--trials", "4", "--prompt-len",
                 "256:3,1024:1", "--output-len", "64", "--json", str(out)]) == 0  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert "prompts 256-1024 (mean 448)" in text and "Prompts of 2 lengths" in text
    assert json.loads(out.read_text())["prompt_lens"] == [[256, 0.75], [1024, 0.25]]


@pytest.mark.slow
def test_the_leaderboard_sensitivity_at_the_built_bandwidth_and_prompt_length_is_the_reports_own_figure():
    """experiments/leaderboard_check.py's sensitivity table, at the assumed prompt length and decode attention's
    bandwidth as built, gives each model the worst errors its as-built H100 rows give: the table moves only what
    it says it moves."""
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import leaderboard_check as lc

    (cell,) = lc.sensitivity(prompt_lens=(lc.PROMPT_LEN,), attention_rels=(1.0,))
    rows = [r for r in lc.run()["rows"] if r["gpu"] == "h100-sxm" and r["num_gpus"] == 1
            and lc.TARGET_BATCHES[0] <= round(r["batch"]) <= lc.TARGET_BATCHES[1]]  # fmt: skip
    assert set(cell["worst_abs_pct"]) == {r["model"] for r in rows} and len(rows) > 10
    for model, worst in cell["worst_abs_pct"].items():
        mine = [r["error_pct"] for r in rows if r["model"] == model]
        assert worst == pytest.approx([max(abs(e[k]) for e in mine)
                                       for k in ("median_itl_ms", "energy_per_token_joules")], rel=1e-9)  # fmt: skip
    lower = lc.sensitivity(prompt_lens=(lc.PROMPT_LEN,), attention_rels=(0.7,))[0]["worst_abs_pct"]
    assert lower != cell["worst_abs_pct"]  # the bandwidth reaches the simulation
