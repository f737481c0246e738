"""The oracle (exhaustive sweep) and `freqopt benchmark`."""

import json

import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.cli import main
from freqopt.gpu.specs import get_gpu
from freqopt.search import SearchConfig
from freqopt.search.oracle import benchmark, noiseless_figures, oracle_search
from freqopt.search.validate import Validator

H100 = get_gpu("h100-sxm")


@pytest.mark.slow
def test_oracle_measures_every_unit_at_every_pair_and_charges_for_it(small_trace):
    config = SearchConfig(max_slowdown=0.02, switching=False)
    backend = SimulatedGPU(H100, seed=1)
    result = oracle_search(small_trace, backend, config, "pass")
    pairs = len(H100.clock_pairs())
    # The H100 sets its memory clock per job: the three pass units are swept at every SM clock at the highest
    # memory clock (and the default), the whole step at every pair.
    sm_clocks = len([p for p in H100.clock_pairs() if p[1] == max(H100.mem_clocks_mhz)])
    sweep = 3 * (sm_clocks + 1) + pairs
    assert sm_clocks < pairs and result.n_measurements >= sweep
    # Each measurement lasts whole replays of what it measures, over the protocol's warm-up and window: at least
    # their sum, and less than two replays more (the step is the longest thing measured).
    per = backend.protocol.cost_gpu_s(H100.energy_counter_period_s)
    step_s = backend.step(small_trace.kernels).time_s
    assert result.n_measurements * per <= result.search_cost_gpu_s < result.n_measurements * (per + 2 * step_s)
    assert result.slowdown_pct <= 2.0 + 1e-9 and result.energy_saved_pct > 0


@pytest.mark.slow
def test_benchmark_summary_has_the_issue_keys_and_ratios(small_trace):
    result = benchmark(small_trace, SimulatedGPU(H100, seed=2),
                       SearchConfig(max_slowdown=0.02, n_trials_1d=6, switching=False), granularity="pass")
    s = result.summary()
    assert set(s) == {"oracle", "search", "savings_ratio", "measured_savings_ratio", "cost_ratio"}
    assert set(s["oracle"]) == {"energy_saved_pct", "n_measurements", "search_cost_gpu_s", "true_energy_saved_pct",
                                "true_slowdown_pct"}  # fmt: skip
    assert set(s["search"]) == {"energy_saved_pct", "predicted_energy_saved_pct", "n_measurements", "search_cost_gpu_s",
                                "true_energy_saved_pct", "true_slowdown_pct"}  # fmt: skip
    # The noiseless figures are the chosen schedules' own steps: near the validated ones (0.5 % energy noise, 0.2 %
    # time noise), so within a budget validated to hold, give or take that noise.
    for side in ("oracle", "search"):
        assert s[side]["true_energy_saved_pct"] == pytest.approx(s[side]["energy_saved_pct"], abs=1.5)
        assert s[side]["true_slowdown_pct"] <= 2.0 + 0.5
    trace, validator = small_trace, Validator.for_search(small_trace, SimulatedGPU(H100, seed=2),
                                                         SearchConfig(max_slowdown=0.02))  # fmt: skip
    setting = ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=max(H100.mem_clocks_mhz))
    measured = validator(tuple([setting] * len(trace)), key="x")
    step, default = (validator.backend.step(trace.kernels, [setting] * len(trace)),
                     validator.backend.step(trace.kernels))  # fmt: skip
    assert noiseless_figures(validator, measured) == pytest.approx(
        (100 * (1 - step.energy_j / default.energy_j), 100 * (step.time_s / default.time_s - 1)))
    assert s["savings_ratio"] == pytest.approx(s["search"]["true_energy_saved_pct"]
                                                    / s["oracle"]["true_energy_saved_pct"])  # fmt: skip
    assert s["cost_ratio"] == pytest.approx(s["search"]["search_cost_gpu_s"] / s["oracle"]["search_cost_gpu_s"])
    assert 0 < s["cost_ratio"] < 1  # fewer measurements than a sweep of every setting
    assert s["measured_savings_ratio"] == pytest.approx(s["search"]["energy_saved_pct"]
                                                        / s["oracle"]["energy_saved_pct"])  # fmt: skip


@pytest.mark.parametrize("args, fragment", [
    (["--granularity", "power-cap"], "choose iteration, pass or kernel"),
    (["--repeats", "0"], "repeats must be a positive integer"),
    (["--max-slowdown", "-1%"], "negative"),
    (["--gpu", "tpu-v5"], "unknown GPU"),
    (["--confidence", "abc"], "--confidence 'abc' is not a confidence level"),
])  # fmt: skip
def test_cli_benchmark_bad_input(args, fragment, capsys):
    assert main(["benchmark", "--model", "gpt3-small", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_benchmark_writes_json(tmp_path):
    out = tmp_path / "b.json"
    assert main(["benchmark", "--model", "gpt3-small", "--seq-len", "256", "--micro-batch-size", "1", "--granularity",
                 "iteration", "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["oracle"]["n_measurements"] > doc["search"]["n_measurements"]


def _coarse_h100():
    """The H100 with every fourth SM clock (its top and bottom kept) and its top memory clock: the same physics
    over a sweep a quarter as long, so that a kernel-level benchmark with switching costs runs in seconds."""
    import dataclasses

    sm = H100.sm_clocks_mhz
    return dataclasses.replace(H100, sm_clocks_mhz=tuple(sorted({*sm[::4], sm[0], sm[-1]})),
                               mem_clocks_mhz=(max(H100.mem_clocks_mhz),))  # fmt: skip


@pytest.mark.slow
def test_kernel_level_benchmark_with_switching_costs_has_a_savings_ratio_of_at_most_one(small_trace):
    # gpt3-small at kernel level on the H100 with switching costs: its iteration is one phase block, so the search
    # ends on one clock; a sweep without the one-clock schedules kept the defaults (savings ratio None).
    result = benchmark(small_trace, SimulatedGPU(_coarse_h100(), seed=0),
                       SearchConfig(max_slowdown=0.01, n_trials_1d=6), granularity="kernel")  # fmt: skip
    s = result.summary()
    assert s["oracle"]["energy_saved_pct"] > 0 and s["oracle"]["true_energy_saved_pct"] > 0
    assert s["savings_ratio"] is not None and 0 < s["savings_ratio"] <= 1
    assert s["measured_savings_ratio"] is not None and s["measured_savings_ratio"] > 0
    assert s["oracle"]["true_slowdown_pct"] <= 1.0 and result.oracle.level is not None


@pytest.mark.slow
def test_oracle_holds_the_best_one_clock_within_the_budget(small_trace):
    spec = _coarse_h100()
    backend = SimulatedGPU(spec, seed=0)
    config = SearchConfig(max_slowdown=0.01)
    result = oracle_search(small_trace, backend, config, "kernel")
    # The best single clock pair for the whole step, noiseless, well inside the budget (half of it: far enough
    # from the edge that its validation at 95 % cannot reject it), is among what the sweep validates.
    default = backend.step(small_trace.kernels)
    one_clock = []
    for sm, mem in spec.clock_pairs():
        m = backend.step(small_trace.kernels, [ClockSetting(sm, mem)] * len(small_trace))
        if m.time_s <= 1.005 * default.time_s:
            one_clock.append(100 * (1 - m.energy_j / default.energy_j))
    assert max(one_clock) > 0
    assert result.true_energy_saved_pct >= max(one_clock) - 1e-9
    assert result.true_slowdown_pct <= 1.0
