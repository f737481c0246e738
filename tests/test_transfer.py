"""Transferring clock tables between layouts and micro-batches (freqopt transfer)."""

import json

import pytest

from freqopt.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.backends.simulated import SimulatedGPU
from freqopt.cli import main
from freqopt.gpus import get_gpu
from freqopt.layout import Layout
from freqopt.models import get_workload
from freqopt.search import SearchConfig, run_search
from freqopt.tables import ClockTable, load_table, table_from_result, write_table
from freqopt.trace import trace_training_iteration
from freqopt.transfer import BY_KIND, EXACT, UNMATCHED, evaluate_transfer, transfer_table

H100 = get_gpu("h100-sxm")
SMALL = {"micro_batch_size": 1, "seq_len": 256}


@pytest.fixture(scope="module")
def kernel_table(small_trace):
    # Free switching: these tests are about matching, so the table keeps its per-class settings as found.
    config = SearchConfig(max_slowdown=0.01, granularities=("kernel",), n_trials_1d=4, finalist_repeats=1,
                          switching=False)  # fmt: skip
    result = run_search(small_trace, SimulatedGPU(H100, seed=1), config)
    return table_from_result(result, "kernel", H100, backend="sim", seed=1)


def test_same_workload_matches_every_class_exactly(kernel_table, small_trace):
    schedule = transfer_table(kernel_table, small_trace)
    assert schedule.count(EXACT) == len(small_trace.kernel_classes())
    assert schedule.count(BY_KIND) == schedule.count(UNMATCHED) == 0
    by_class = {e["unit"]: ClockSetting(e["sm_clock_mhz"], e["mem_clock_mhz"], e["power_limit_w"])
                for e in kernel_table.entries}  # fmt: skip
    assert schedule.per_kernel() == tuple(by_class[k.class_key] for k in small_trace.kernels)


def test_tensor_parallel_target_matches_by_kind_and_leaves_collectives_at_default(kernel_table):
    target = trace_training_iteration(get_workload("gpt3-small", layout=Layout(tp=2), **SMALL))
    schedule = transfer_table(kernel_table, target)
    assert schedule.count(EXACT) > 0 and schedule.count(BY_KIND) > 0
    for m in schedule.matches:
        kind = m.unit.kernels(target)[0].kind
        if kind == "all-reduce":  # the single-GPU table never saw a collective
            assert m.how == UNMATCHED and m.setting == DEFAULT_SETTING
        if m.how == BY_KIND:
            source = next(e for e in kernel_table.entries if e["unit"] == m.source_unit)
            assert source["kind"] == kind
    assert len(schedule.matches) == len(target.kernel_classes())


def test_by_kind_picks_the_nearest_arithmetic_intensity(small_trace):
    gemm = next(k for k in small_trace.kernels if k.kind == "gemm")
    entries = [
        {"unit": "low", "kind": "gemm", "signature": "x", "arithmetic_intensity": gemm.arithmetic_intensity / 30,
         "sm_clock_mhz": 990, "mem_clock_mhz": None, "power_limit_w": None},
        {"unit": "near", "kind": "gemm", "signature": "y", "arithmetic_intensity": gemm.arithmetic_intensity * 1.5,
         "sm_clock_mhz": 1500, "mem_clock_mhz": None, "power_limit_w": None},
    ]  # fmt: skip
    table = ClockTable({"granularity": "kernel", "entries": entries})
    schedule = transfer_table(table, small_trace)
    match = next(m for m in schedule.matches if m.unit.name == gemm.class_key)
    assert (match.how, match.source_unit, match.setting.sm_clock_mhz) == (BY_KIND, "near", 1500)
    softmax = next(m for m in schedule.matches if m.unit.kernels(small_trace)[0].kind == "softmax")
    assert softmax.how == UNMATCHED


def test_pass_table_carries_over_with_collectives_in_their_passes():
    entries = [{"unit": p, "sm_clock_mhz": c, "mem_clock_mhz": None, "power_limit_w": None}
               for p, c in (("forward", 1500), ("backward", 1600))]  # fmt: skip
    table = ClockTable({"granularity": "pass", "entries": entries})
    target = trace_training_iteration(get_workload("gpt3-small", layout=Layout(dp=2, tp=2), **SMALL))
    schedule = transfer_table(table, target)
    how = {m.unit.name: m.how for m in schedule.matches}
    assert how == {"forward": EXACT, "backward": EXACT, "optimizer": UNMATCHED}
    per_kernel = schedule.per_kernel()
    for k, s in zip(target.kernels, per_kernel):  # a collective runs at its pass's clocks
        assert s.sm_clock_mhz == {"forward": 1500, "backward": 1600, "optimizer": None}[k.pass_name]
    assert any(k.is_collective for k in target.kernels)


def test_evaluate_transfer_shares_one_baseline_with_the_native_search(kernel_table):
    target = trace_training_iteration(get_workload("gpt3-small", layout=Layout(dp=4), **SMALL))
    config = SearchConfig(max_slowdown=0.01, n_trials_1d=4, finalist_repeats=1, switching=False)
    report = evaluate_transfer(kernel_table, target, SimulatedGPU(H100, seed=2), config)
    assert report.native.baseline == report.baseline
    assert set(report.native.results) == {"iteration", "pass", "kernel"}
    summary = report.summary()
    assert set(summary) == {"transferred", "native"}
    assert set(summary["transferred"]) == {"energy_saved_pct", "slowdown_pct", "matched_exact", "matched_by_kind",
                                           "unmatched"}  # fmt: skip
    assert summary["native"]["slowdown_pct"] <= 1.0 + 1e-9
    assert summary["transferred"]["energy_saved_pct"] > 0  # the dp table's compute settings carry over


def test_cli_transfer_writes_the_comparison(kernel_table, tmp_path, capsys):
    table_path = write_table(kernel_table, tmp_path / "t.json")
    out = tmp_path / "cmp.json"
    assert main(["transfer", "--table", str(table_path), "--model", "gpt3-small", "--layout", "dp=2",
                 "--micro-batch-size", "2", "--seq-len", "256", "--trials", "3", "--out", str(tmp_path / "o"),
                 "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["transferred"]["matched_exact"] + doc["transferred"]["matched_by_kind"] > 0
    assert "transferred table" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, fragment",
    [(["--gpu", "a100-sxm4-80gb"], "searched on h100-sxm, not a100-sxm4-80gb"),
     (["--gpu", "b300"], "unknown GPU 'b300'"),
     (["--layout", "tp=5"], "does not divide the 12 attention heads"),
     (["--max-slowdown", "abc"], "is not a slowdown")],
)  # fmt: skip
def test_cli_transfer_refuses_bad_input_in_one_line(kernel_table, tmp_path, capsys, args, fragment):
    table_path = write_table(kernel_table, tmp_path / "t.json")
    code = main(["transfer", "--table", str(table_path), "--model", "gpt3-small", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written


def test_cli_transfer_refuses_a_corrupt_table(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "freqopt.clock-table", "schema_version": 1, "gpu": ')
    assert main(["transfer", "--table", str(bad), "--model", "gpt3-small"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(Exception, match="not valid JSON"):
        load_table(bad)
