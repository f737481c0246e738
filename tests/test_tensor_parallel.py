"""Tensor-parallel layouts searched as data-parallel ones are: the search saves what one clock saves."""

import dataclasses

import pytest

import freqopt
from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.resolve import resolve_trace_or_workload
from freqopt.search import SearchConfig
from freqopt.search.allocation import allocate_validated
from freqopt.search.validate import Validator
from freqopt.workload.trace import trace_training_iteration

MAX_SLOWDOWN = 0.01
# The search holds the upper 95 % confidence bound of its slowdown to the budget on readings with 0.2 % time noise
# each, where the noiseless sweep holds the true slowdown: the clock it keeps may sit a step above the sweep's.
TOLERANCE_PP = 0.5


def one_clock_sweep(trace, spec) -> tuple[float, float]:
    """The noiseless sweep of one clock pair for the whole iteration (SimulatedGPU.step): the largest energy saving
    (%) within MAX_SLOWDOWN, and its slowdown (%)."""
    sim = SimulatedGPU(spec, noise=False)
    default = sim.step(trace.kernels)
    best = (0.0, 0.0)
    for mem in spec.mem_clocks_mhz:
        for sm in spec.sm_clocks_mhz:
            m = sim.step(trace.kernels, [ClockSetting(sm_clock_mhz=sm, mem_clock_mhz=mem)] * len(trace))
            if m.time_s <= (1 + MAX_SLOWDOWN) * default.time_s:
                best = max(best, (100 * (1 - m.energy_j / default.energy_j), 100 * (m.time_s / default.time_s - 1)))
    return best


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp=1,tp=2", "dp=1,tp=4", "dp=2,tp=2"])
def test_a_tensor_parallel_search_saves_what_one_clock_saves_in_a_noiseless_sweep(layout, tmp_path):
    _, workload = resolve_trace_or_workload("gpt3-small", micro_batch_size=None, seq_len=None, n_heads=None,
                                            vocab_multiple=None, layout=layout)  # fmt: skip
    trace = trace_training_iteration(workload)
    assert any(k.kind == "all-reduce" for k in trace.kernels), "the tensor-parallel all-reduces are in the step"
    swept_pct, _ = one_clock_sweep(trace, get_gpu("h100-sxm"))
    result = freqopt.search(trace, max_slowdown=MAX_SLOWDOWN, granularity="iteration", out=tmp_path)
    level = result.results["iteration"]
    saved_pct = 100 * (1 - level.validated.energy_j / result.baseline.energy_j)
    assert level.note == ""
    assert swept_pct > 5.0  # the step waits on its all-reduces and its host: one clock saves much
    assert swept_pct - TOLERANCE_PP <= saved_pct <= swept_pct + 0.5
    sim = SimulatedGPU(get_gpu("h100-sxm"), noise=False)
    setting = level.units[0][1]
    true_slowdown = sim.step(trace.kernels, [setting] * len(trace)).time_s / sim.step(trace.kernels).time_s - 1
    assert true_slowdown <= MAX_SLOWDOWN


@pytest.mark.slow
def test_a_level_whose_choices_all_fail_confirmation_falls_back_to_a_safer_one():
    """The allocator's choices near the budget's edge fail their fresh confirming readings: it aims lower, and a
    schedule that holds the limit beats the defaults."""
    from freqopt.search.unit_studies import run_unit_studies

    trace = trace_training_iteration(resolve_trace_or_workload("gpt3-small", micro_batch_size=None, seq_len=None,
                                                               n_heads=None, vocab_multiple=None,
                                                               layout="dp=1,tp=2")[1])  # fmt: skip

    backend = SimulatedGPU(get_gpu("h100-sxm"), seed=0)
    config = SearchConfig(max_slowdown=MAX_SLOWDOWN, granularities=("iteration",))
    validator = Validator.for_search(trace, backend, config)
    baseline = validator.baseline()
    units, searches = run_unit_studies(trace, backend, config, "iteration", storage=None)
    real_confirm = validator.confirm
    failed = []

    def strict_confirm(measurement, key="confirm"):  # the first confirmation breaks the limit, as by bad luck
        fresh = real_confirm(measurement, key)
        if not failed:
            failed.append(validator.schedule_of(measurement))
            return dataclasses.replace(fresh, time_upper_s=2 * baseline.time_s)
        return fresh

    validator.confirm = strict_confirm
    result = allocate_validated(units, searches, validator, baseline, MAX_SLOWDOWN, rounds=config.max_validation_rounds)
    assert failed
    assert result.reason == ""
    assert result.validated.energy_j < baseline.energy_j
    assert validator.schedule_of(result.validated) != failed[0]


def test_a_level_that_ends_at_the_default_says_why(small_trace, tmp_path):
    result = freqopt.search(small_trace, max_slowdown=1e-6, granularity="iteration", out=tmp_path)
    level = result.results["iteration"]
    assert level.validated.energy_j == result.baseline.energy_j
    assert level.note.startswith("ended at the default: ")
    assert "within 0.0001 %" in level.note


def test_a_one_clock_level_refines_its_clock_between_those_its_study_measured():
    """The iteration level's study measures a dozen clocks; the supported clocks it skipped between the clock kept
    and the next lower one it measured are bisected, each validated and confirmed, and one that holds replaces it."""
    from freqopt.search.allocation import REFINE_STEPS, refine_one_setting
    from freqopt.search.unit_studies import run_unit_studies

    trace = trace_training_iteration(resolve_trace_or_workload("gpt3-small", micro_batch_size=None, seq_len=None,
                                                               n_heads=None, vocab_multiple=None, layout=None)[1])
    spec = get_gpu("h100-sxm")
    backend = SimulatedGPU(spec, seed=0)
    config = SearchConfig(max_slowdown=MAX_SLOWDOWN, granularities=("iteration",))
    validator = Validator.for_search(trace, backend, config)
    baseline = validator.baseline()
    limit_s = (1 + MAX_SLOWDOWN) * baseline.time_s
    units, searches = run_unit_studies(trace, backend, config, "iteration", storage=None)
    mem = spec.mem_clocks_mhz[-1]
    # keep the top clock, with the study's lowest measurement 12 supported clocks below it
    top, low = spec.sm_clocks_mhz[-1], spec.sm_clocks_mhz[-13]
    study = dataclasses.replace(searches[0], options=tuple(
        o for o in searches[0].options if o.setting.sm_clock_mhz in (None, top, low)))
    from freqopt.search.study import Option

    kept_setting = ClockSetting(sm_clock_mhz=top, mem_clock_mhz=mem)
    kept = validator.units(units, [kept_setting], "iteration", limit_s=limit_s)
    from freqopt.search.allocation import Allocation

    hit = Allocation((Option(kept_setting, kept.time_s, kept.energy_j, 1),), validator.confirm(kept))
    before = validator.n_measurements
    refined = refine_one_setting(hit, units, [study], validator, baseline, limit_s, "iteration")
    chosen = refined.chosen[0].setting
    assert low < chosen.sm_clock_mhz < top and chosen.mem_clock_mhz == mem
    assert refined.validated.energy_j < hit.validated.energy_j
    assert refined.validated.time_bound_s <= limit_s
    sim = SimulatedGPU(spec, noise=False)
    true = sim.step(trace.kernels, [chosen] * len(trace)).time_s / sim.step(trace.kernels).time_s - 1
    assert true <= MAX_SLOWDOWN
    # a bisection: at most REFINE_STEPS schedules, each read at most max_repeats pairs and confirmed once
    assert 0 < validator.n_measurements - before <= REFINE_STEPS * 2 * (2 * config.validation_max_repeats)


def test_refinement_of_a_power_limit_tries_whole_watts_only_between_measured_limits():
    from freqopt.search.allocation import _grid_between
    from freqopt.search.study import Option

    spec = get_gpu("h100-sxm")
    options = [Option(ClockSetting(power_limit_w=w), 0.03, 16.0, 1) for w in (600.0, 641.5, 700.0)]
    grid = _grid_between(ClockSetting(power_limit_w=650.0), options, spec)
    assert [s.power_limit_w for s in grid] == [float(w) for w in range(642, 650)]
    assert _grid_between(ClockSetting(power_limit_w=600.0), options, spec) == []
    assert _grid_between(ClockSetting(), options, spec) == []  # the defaults: nothing to refine


@pytest.mark.slow
def test_the_train_line_a_tensor_parallel_transfer_prints_runs_to_its_end(iteration_search_cli, tmp_path,
                                                                         monkeypatch, capsys):  # fmt: skip
    """A table transferred to tp=2 comes with a `freqopt train` line; run as printed (two ranks under DeepSpeed
    AutoTP on the CPU, with gloo), it trains to its end and reports the saving it measured. The source table is a
    search's at 2 x 64 tokens (conftest's ITERATION_SEARCH)."""
    import shlex
    import subprocess
    import sys

    pytest.importorskip("transformers", reason="AutoTP imports transformers (the tp extra)")
    from freqopt.cli import main

    monkeypatch.chdir(tmp_path)
    small = iteration_search_cli["args"][:6]  # the model and its micro-batch and sequence length
    assert small == ["--model", "gpt3-small", "--micro-batch-size", "2", "--seq-len", "64"]
    source = next(iteration_search_cli["out"].glob("*-iteration.json"))
    assert main(["transfer", "--table", str(source), *small, "--layout", "tp=2", "--no-native", "--out", "tp2"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "apply it with `" in out, out
    args = shlex.split(out.split("apply it with `", 1)[1].split("`", 1)[0])
    assert args[:2] == ["freqopt", "train"] and args[args.index("--layout") + 1] == "dp=1,tp=2"
    monkeypatch.chdir(tmp_path.parent)  # the line holds absolute paths: it runs from any folder
    done = subprocess.run([sys.executable, "-m", "freqopt", *args[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "with the table:" in done.stdout and "less energy per step" in done.stdout, done.stdout
