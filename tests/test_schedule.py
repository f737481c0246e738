"""The phase-schedule granularity: blocks, look-ahead requests, the in-situ search, its table and its runtime."""

import dataclasses
import json

import numpy as np
import pytest

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.errors import ClockTableError, InvalidSettingError
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import Workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.workload.phases import phase_spans
from freqopt.apply.runtime import plan_phases
from freqopt.search import SearchConfig, partition, run_search
from freqopt.search.schedule import phase_blocks, request_schedule
from freqopt.tables import load_table, write_table
from freqopt.workload.trace import trace_training_iteration
from freqopt.apply.transfer import transfer_table

H100 = get_gpu("h100-sxm").with_switch_latency(0.006)  # the GH200's 6 ms: several switches fit this 16 ms iteration


@pytest.fixture(scope="module")
def trace():
    """Two GPT-3 XL layers at micro-batch 4: phases of milliseconds, an iteration of about 16 ms (several switch
    latencies), so the blocks and their look-ahead requests are not trivial."""
    return trace_training_iteration(Workload("gpt3-xl-2l", GPTConfig(n_layers=2, d_model=2048, n_heads=16,
                                                                       seq_len=2048), 4))  # fmt: skip


@pytest.fixture(scope="module")
def times(trace):
    return SimulatedGPU(H100, noise=False).kernel_times_s(trace.kernels, DEFAULT_SETTING)


def test_blocks_cover_the_phases_once_and_last_a_switch_latency(trace, times):
    blocks = phase_blocks(trace, times, H100.clock_switch_s, max_blocks=8)
    spans = phase_spans(trace.meta["marks"], len(trace))
    assert len(blocks) > 1
    assert [p for b in blocks for p in b.phases] == list(range(len(spans)))
    assert sorted(k for b in blocks for k in b.kernel_indices) == list(range(len(trace)))
    assert all(b.duration_s >= H100.clock_switch_s for b in blocks)
    assert sum(b.duration_s for b in blocks) == pytest.approx(times.sum())
    # One block at most per max_blocks-th of the iteration: fewer blocks asked, fewer made.
    assert len(phase_blocks(trace, times, H100.clock_switch_s, max_blocks=2)) <= 2
    # An iteration shorter than two latencies is one block.
    assert len(phase_blocks(trace, times, times.sum() / 1.5)) == 1


def test_requests_look_ahead_by_one_latency(trace, times):
    blocks = phase_blocks(trace, times, H100.clock_switch_s)
    spans = phase_spans(trace.meta["marks"], len(trace))
    start = np.array([times[:a].sum() for _, a, _ in spans])
    total = times.sum()
    durations = np.diff(np.r_[start, total])
    for i, b in enumerate(blocks):
        lead = (start[b.phases[0]] - start[b.request]) % total  # how long before its block it is asked for
        # The latest boundary at least one latency ahead, unless pulled later to stay after the previous request.
        latest_ahead = lead >= H100.clock_switch_s - 1e-12 and lead - durations[b.request] < H100.clock_switch_s
        assert latest_ahead or b.request == (blocks[i - 1].request + 1) % len(spans)
    assert sum(b.request not in b.phases for b in blocks) >= len(blocks) - 1  # look-ahead reaches earlier phases
    requests = [b.request for b in blocks]
    assert len(set(requests)) == len(requests)  # distinct boundaries: one request each


def test_request_schedule_is_constant_per_phase_and_cyclic(trace, times):
    blocks = phase_blocks(trace, times, H100.clock_switch_s)
    a, b = ClockSetting(1500, 2619), ClockSetting(1200, 2619)
    settings = [a if i % 2 else b for i in range(len(blocks))]
    schedule = request_schedule(trace, blocks, settings)
    spans = phase_spans(trace.meta["marks"], len(trace))
    for block, setting in zip(blocks, settings):
        first, end = spans[block.request][1:]
        assert set(schedule[first:end]) == {setting}  # the request phase asks for its block's setting
    assert request_schedule(trace, blocks, [a] * len(blocks)) == tuple([a] * len(trace))
    # Measured with switching, each change lands about where its block starts: the request schedule beats the
    # same settings requested at the blocks' own first phases (no look-ahead) in matching the wanted clocks.
    sim = SimulatedGPU(H100, noise=False)
    wanted = [DEFAULT_SETTING] * len(trace)
    for block, setting in zip(blocks, settings):
        for k in block.kernel_indices:
            wanted[k] = setting
    landed = sim._delayed(trace.kernels, list(schedule), H100.clock_switch_s)
    late = sim._delayed(trace.kernels, wanted, H100.clock_switch_s)
    on_time = lambda got: sum(t for t, g, w in zip(times, got, wanted) if g == w)  # noqa: E731
    assert on_time(landed) > on_time(late)


@pytest.fixture(scope="module")
def result(trace):
    config = SearchConfig(max_slowdown=0.02, granularities=("iteration", "phase"), n_trials_1d=6,
                          n_trials_per_mem_clock=2, phase_finalist_repeats=2, max_phase_blocks=4)  # fmt: skip
    return run_search(trace, SimulatedGPU(H100, seed=5), config)


def test_phase_schedule_is_validated_within_budget_and_never_worse_than_the_iteration_level(result):
    r = result.results["phase"]
    assert result.slowdown_pct("phase") <= 2.0 + 1e-9
    assert result.energy_saved_pct("phase") >= result.energy_saved_pct("iteration") - 1e-9
    assert len(r.requests) == len(r.units) > 1
    assert r.n_measurements > 0 and r.search_cost_gpu_s > 0
    # Every block's study measured whole iterations: their options' times are near the iteration's, not a block's.
    for search in r.unit_searches:
        assert search.default.time_s == pytest.approx(result.baseline.time_s, rel=0.05)


def test_phase_table_round_trips_and_the_runtime_applies_it_as_searched(result, trace, tmp_path):
    table = result.table("phase")
    path = write_table(table, tmp_path / "phase.json")
    loaded = load_table(path, spec=H100)
    assert [e["request_phase"] for e in loaded.entries] == list(result.results["phase"].requests)
    sim = SimulatedGPU(H100, noise=False)
    plan = plan_phases(loaded, trace, sim)
    r = result.results["phase"]
    blocks = phase_blocks(trace, sim.kernel_times_s(trace.kernels, DEFAULT_SETTING), H100.clock_switch_s, max_blocks=4)
    searched = request_schedule(trace, blocks, [s for _, s in r.units])
    assert tuple(plan.per_kernel(list(plan.settings), len(trace))) == searched


def _distinct_settings(table):
    """``table`` with a different SM clock in each entry (a searched schedule may be one clock throughout)."""
    data = json.loads(json.dumps(table.data))
    for entry, sm in zip(data["entries"], (1500, 1200, 1710, 1350)):
        entry["sm_clock_mhz"] = sm
    return dataclasses.replace(table, data=data)


@pytest.mark.slow
def test_a_phase_table_transfers_as_the_runtime_applies_it_on_another_layout(result, trace):
    from freqopt.workload.layout import Layout
    from freqopt.apply.transfer import EXACT, evaluate_transfer

    table = _distinct_settings(result.table("phase"))
    sim = SimulatedGPU(H100, noise=False)
    target = trace_training_iteration(dataclasses.replace(trace.workload, micro_batch_size=2, layout=Layout(dp=2)))
    for on in (trace, target):
        schedule = transfer_table(table, on)
        plan = plan_phases(table, on, sim)
        assert schedule.per_kernel() == tuple(plan.per_kernel(list(plan.settings), len(on)))
        assert schedule.count(EXACT) == len(table.entries) == len(schedule.matches)
        assert sorted(k for m in schedule.matches for k in m.unit.kernel_indices) == list(range(len(on)))
    assert len({s.sm_clock_mhz for s in transfer_table(table, target).per_kernel()}) == len(table.entries)
    config = SearchConfig(max_slowdown=0.02, validation_repeats=1)
    report = evaluate_transfer(table, target, SimulatedGPU(H100, seed=5), config, native=False)
    # Validated as requested (look-ahead already); a phase table carries no fronts, so its re-allocation is its
    # requests backed off toward the defaults on the target (reallocate_requests), held to the budget.
    validator_like = SimulatedGPU(H100, seed=5).measure_schedule(target.kernels, transfer_table(table, target).per_kernel(),
                                                                 key="transferred", switching=True, sample=0)  # fmt: skip
    assert report.transferred.time_s == pytest.approx(validator_like.time_s)
    assert report.native is None
    r = report.reallocated
    assert r is not None and r.granularity == "phase"
    assert r.requests == tuple(e["request_phase"] for e in table.entries)
    assert r.validated.time_bound_s <= 1.02 * report.baseline.time_s
    assert report.summary()["transferred"]["matched_exact"] == len(table.entries)


def test_phase_tables_are_refused_where_they_do_not_apply(result, trace, tmp_path):
    table = result.table("phase")
    data = json.loads(json.dumps(table.data))
    data["entries"][0]["request_phase"] = "fwd:no.such.module"
    with pytest.raises(ClockTableError, match="does not have"):
        plan_phases(dataclasses.replace(table, data=data), trace, SimulatedGPU(H100))
    with pytest.raises(ClockTableError, match="does not have"):
        transfer_table(dataclasses.replace(table, data=data), trace)
    del data["entries"][0]["request_phase"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ClockTableError, match="corrupt clock table"):
        load_table(tmp_path / "bad.json")
    with pytest.raises(InvalidSettingError, match="phase_blocks"):
        partition(trace, "phase")


def test_the_block_model_predicts_the_chosen_schedule_and_reads_block_settings_back(result, trace):
    """The phase level's prediction is its block model's (freqopt.search.schedule.BlockModel), by which a finer
    level realized as one setting per block is predicted too; a schedule with two settings in one block has no
    block settings."""
    r = result.results["phase"]
    model = r.block_model
    settings = tuple(s for _, s in r.units)
    assert model is not None and len(model.blocks) == len(settings)
    if settings != (DEFAULT_SETTING,) * len(settings):
        assert model.predict(settings) == r.predicted
    reference = result.results["iteration"].units[0][1]
    same = model.predict([reference] * len(settings))  # no change from the reference
    assert (same.time_s, same.energy_j) == (model.reference.time_s, model.reference.energy_j)
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for block, setting in zip(model.blocks, settings):
        for k in block.kernel_indices:
            per_kernel[k] = setting
    assert model.settings_of(per_kernel) == settings
    first = model.blocks[0].kernel_indices
    per_kernel[first[0]] = ClockSetting(345, per_kernel[first[1]].mem_clock_mhz)  # not the block's other kernels'
    assert model.settings_of(per_kernel) is None
    assert model.predict([ClockSetting(346, None)] * len(settings)) is None  # no such option in any block
    # The fitted options span the clocks between those measured, many more than the studies measured.
    assert all(len(c) > len(s.options) for c, s in zip(model.changes, r.unit_searches))
