"""What a search measures (issue 25): the levels a runtime cannot realize are not measured, kernel classes of one
family share a study, a study stops when its front stops moving, and the benchmark compares noiseless savings."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.search.config import SearchConfig
from freqopt.search.runner import one_clock_reason, run_search
from freqopt.search.study import _stalled
from freqopt.search.units import family_units, kernel_families, partition, search_units
from freqopt.search.validate import Validator

H100 = get_gpu("h100-sxm")
FAST = dataclasses.replace(H100, clock_switch_s=0.001)  # an H100 whose clock switches land within 1 ms


def test_families_merge_classes_and_cover_every_kernel_once(small_trace):
    classes = partition(small_trace, "kernel")
    families = family_units(small_trace, classes)
    assert len(families) == len(kernel_families(small_trace, classes)) < len(classes)
    kernels = sorted(k for u in families for k in u.kernel_indices)
    assert kernels == list(range(len(small_trace)))
    assert any(u.name.endswith(" classes") for u in families)
    assert search_units(small_trace, "kernel", True) == families
    assert search_units(small_trace, "kernel", False) == classes
    assert search_units(small_trace, "pass", True) == partition(small_trace, "pass")


def test_one_clock_reason_only_where_the_iteration_is_shorter_than_two_switches(small_trace):
    config = SearchConfig(max_slowdown=0.01)
    h100, fast = SimulatedGPU(H100), SimulatedGPU(FAST)
    times = h100.kernel_times_s(small_trace.kernels, DEFAULT_SETTING)
    assert times.sum() < 2 * H100.clock_switch_s  # the premise: a short step
    reason = one_clock_reason(small_trace, h100, config, times)
    assert "26 ms clock switches" in reason and "one clock per iteration" in reason
    assert one_clock_reason(small_trace, fast, config, times) == ""
    assert one_clock_reason(small_trace, h100, dataclasses.replace(config, switching=False), times) == ""


def test_one_clock_reason_for_a_longer_step_whose_passes_are_each_shorter_than_two_switches():
    """gpt3-xl at tp=4, micro-batch 3, on the H100: 69 ms of kernels, but a 20 ms forward and a 39 ms backward, each
    cut only into runs of a 26 ms switch, make one block (phase_blocks), so one clock is all a runtime realizes; the
    reason says so rather than calling the step shorter than two switches."""
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    trace = trace_training_iteration(get_workload("gpt3-xl", micro_batch_size=3, layout=Layout(tp=4)))
    h100 = SimulatedGPU(H100)
    times = h100.kernel_times_s(trace.kernels, DEFAULT_SETTING)
    assert times.sum() > 2 * H100.clock_switch_s  # the premise: longer than two switches
    reason = one_clock_reason(trace, h100, SearchConfig(max_slowdown=0.01), times)
    assert "hold no two runs of phases each as long as a 26 ms clock switch" in reason and "shorter" not in reason


class _CountingGPU(SimulatedGPU):
    """The simulated H100, counting every measurement taken of it (a unit's replay loop or a whole step)."""

    n_taken = 0

    def measure(self, *args, **kwargs):
        self.n_taken += 1
        return super().measure(*args, **kwargs)

    def measure_schedule(self, *args, **kwargs):
        self.n_taken += 1
        return super().measure_schedule(*args, **kwargs)


def test_free_switching_figures_come_from_the_measurements_their_levels_count(small_trace):
    """Where a runtime realizes one clock only, the pass and kernel levels' free-switching figures are allocations
    over the settings their own studies measured, validated once: every measurement the GPU took is
    charged to exactly one level, each free-switching schedule holds only settings some study measured, and the
    kernel level's figure is at least its realizable saving and the pass level's."""
    config = SearchConfig(max_slowdown=0.02, n_trials_1d=5, n_trials_per_mem_clock=1)
    gpu = _CountingGPU(H100, seed=3)
    result = run_search(small_trace, gpu, config)
    assert gpu.n_taken == sum(r.n_measurements for r in result.results.values()) > 0  # nothing measured twice
    measured = {o.setting for r in result.results.values() for u in r.unit_searches for o in u.readings}
    for g in ("pass", "kernel"):
        r = result.results[g]
        assert r.held_to_one_clock and r.unit_searches and r.ideal_units
        assert {s for _, s in r.ideal_units} <= measured | {s for _, s in result.results["iteration"].units}
        assert result.ideal_energy_saved_pct(g) >= result.energy_saved_pct(g)
    assert result.ideal_energy_saved_pct("kernel") >= result.ideal_energy_saved_pct("pass")


@pytest.mark.slow
def test_unrealizable_levels_keep_the_iteration_schedule_and_search_only_their_free_switching_figure(small_trace):
    """Issue 25: where a runtime can realize no schedule finer than one clock, the finer levels keep the iteration
    level's; issue 35, item 3: the pass and kernel levels still search what they would save with free switching
    (the papers' figure), within the budget and at least the iteration level's, and charge it; the phase level
    measures nothing."""
    config = SearchConfig(max_slowdown=0.02, n_trials_1d=5, n_trials_per_mem_clock=1,
                          granularities=("iteration", "pass", "kernel", "phase"))  # fmt: skip
    result = run_search(small_trace, SimulatedGPU(H100, seed=3), config)
    iteration = result.results["iteration"]
    assert iteration.n_measurements > 0 and not iteration.note and iteration.ideal == iteration.validated
    for g in ("pass", "kernel", "phase"):
        r = result.results[g]
        assert r.held_to_one_clock and "shorter than two 26 ms clock switches" in r.note
        assert r.validated == iteration.validated
        assert {s for _, s in r.units} == {iteration.units[0][1]}
        if g == "phase":
            assert r.n_measurements == 0 and r.ideal == iteration.validated
            continue
        assert len(r.units) == len(partition(small_trace, g))
        # Its studies and its validations; the kernel level's allocations may all be schedules the pass level
        # already validated on the same free-switching validator (read once, charged once: to the pass level).
        validations = 3 if g == "pass" else 0
        assert r.n_measurements >= sum(u.n_measurements for u in r.unit_searches) + validations > 3
        assert r.ideal.time_s <= result.baseline.time_s * 1.02 and r.ideal.energy_j <= iteration.validated.energy_j
        assert not result.table(g).data["entries"][0].get("front")  # its table is the one clock, no fronts
    assert result.summary()["results"]["kernel"]["note"].startswith("held to one clock")
    # Without the free-switching figures (freqopt benchmark's search) the held levels measure nothing of their own.
    realizable = run_search(small_trace, SimulatedGPU(H100, seed=3),
                            dataclasses.replace(config, free_switching=False, granularities=("iteration", "kernel")))
    assert realizable.results["kernel"].n_measurements == 0 and realizable.results["kernel"].ideal is None
    assert realizable.results["kernel"].validated == realizable.results["iteration"].validated
    # Where switches are fast, the same levels are searched, the kernel level on families of classes.
    fast = run_search(small_trace, SimulatedGPU(FAST, seed=3), config)
    kernel = fast.results["kernel"]
    assert kernel.n_measurements > 0 and not kernel.note
    assert len(kernel.unit_searches) == len(kernel.searched_units) == len(kernel_families(
        small_trace, partition(small_trace, "kernel")))  # fmt: skip
    assert [u for u, _ in kernel.units] == partition(small_trace, "kernel")
    # Every class holds its family's setting.
    setting = {k: s for u, s in kernel.units for k in u.kernel_indices}
    for family in kernel.searched_units:
        assert len({setting[k] for k in family.kernel_indices}) == 1
    # The table lists every class, each with its family's measured front.
    table = fast.table("kernel")
    assert len(table.entries) == len(kernel.units)
    assert all("front" in e and "default" in e for e in table.entries)


def _trials(points):
    """Complete trials with (time_s, energy_j) ``points``, numbered in order (what _stalled reads of a trial)."""
    return [SimpleNamespace(number=i, state=TrialState.COMPLETE, values=list(p)) for i, p in enumerate(points)]


def test_a_study_stalls_when_its_last_trials_leave_the_front_near_the_default_as_it_was():
    warm = [(1.00, 10.0), (1.02, 9.0)]
    assert not _stalled(_trials(warm), 2, 1.05, 2)  # no trial after the warm starts yet
    # Two trials that are dominated, then two beyond the limit: the front within 1.05 did not move.
    dominated = warm + [(1.03, 9.5), (1.01, 10.5), (1.2, 5.0), (1.3, 4.0)]
    assert _stalled(_trials(dominated), 2, 1.05, 4)
    assert not _stalled(_trials(dominated), 2, 1.05, 5)  # only 4 trials after the warm starts
    # One new front point within the limit among the last four: not stalled.
    improved = warm + [(1.03, 9.5), (1.04, 8.5), (1.2, 5.0), (1.3, 4.0)]
    assert not _stalled(_trials(improved), 2, 1.05, 4)
    # A point that dominates only points beyond the limit does not count, and neither does a failed trial.
    failed = SimpleNamespace(number=6, state=TrialState.FAIL, values=None)
    assert _stalled(_trials(dominated) + [failed], 2, 1.05, 4)


@pytest.mark.slow
def test_a_study_with_patience_stops_early_and_resumes_to_the_same_front(tmp_path, small_trace):
    from freqopt.search.study import search_unit

    backend = SimulatedGPU(H100, seed=5)
    kernels = partition(small_trace, "kernel")[0].kernels(small_trace)
    args = dict(name="u", study_name="u", space="clocks", n_trials=40, finalist_slowdown=0.05, patience=3,
                mem_clock_mhz=max(H100.mem_clocks_mhz))  # fmt: skip
    storage = f"sqlite:///{tmp_path / 's.db'}"
    once = search_unit(backend, kernels, storage=storage, **args)
    trials = optuna.load_study(study_name="u", storage=storage).get_trials()
    assert 5 + 3 <= len(trials) < 40  # the warm starts, at least `patience` more, and far fewer than n_trials
    again = search_unit(backend, kernels, storage=storage, **args)  # a resume of a finished study measures nothing
    assert again.options == once.options and again.n_new_measurements == 0
    full = search_unit(SimulatedGPU(H100, seed=5), kernels, storage=None, **{**args, "patience": None})
    assert full.n_measurements > once.n_measurements


@pytest.mark.slow
def test_the_phase_level_stops_its_block_studies_with_phase_patience_and_rejects_a_bad_one(small_trace, tmp_path):
    """Issue 25: the phase level's block studies (each measurement a whole iteration) stop once phase_patience
    trials in a row leave a block's front near the default unchanged; None runs every trial."""
    from freqopt.errors import InvalidSettingError

    def phase(patience):
        storage = f"sqlite:///{tmp_path / f'{patience}.db'}"
        config = SearchConfig(max_slowdown=0.02, granularities=("phase",), n_trials_1d=12, phase_patience=patience,
                              storage=storage)  # fmt: skip
        result = run_search(small_trace, SimulatedGPU(FAST, seed=4), config)
        trials = [len(optuna.load_study(study_name=s.study_name, storage=storage).trials)
                  for s in result.results["phase"].unit_searches]  # fmt: skip
        return result, trials

    (patient, patient_trials), (full, full_trials) = phase(2), phase(None)
    assert len(full.results["phase"].units) > 1  # the premise: blocks to search
    assert all(n >= 12 for n in full_trials)
    assert sum(patient_trials) < sum(full_trials)  # each finalist's repeats come on top, as many either way
    assert patient.slowdown_pct("phase") <= 2.0 + 1e-9
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidSettingError, match="^phase_patience must be a positive integer or None"):
            SearchConfig(max_slowdown=0.01, phase_patience=bad)
    with pytest.raises(InvalidSettingError, match="^patience must be a positive integer or None"):
        SearchConfig(max_slowdown=0.01, patience=0)


def test_noiseless_saving_is_the_schedules_own_step_and_none_for_a_foreign_measurement(small_trace):
    from freqopt.search.oracle import noiseless_saved_pct

    backend = SimulatedGPU(FAST, seed=2)
    validator = Validator(small_trace, backend, 3, switching=True)
    validator.baseline()
    setting = ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=max(FAST.mem_clocks_mhz))
    measured = validator(tuple([setting] * len(small_trace)), key="x")
    saved = noiseless_saved_pct(validator, measured)
    step = backend.step(small_trace.kernels, [setting] * len(small_trace), switching=True)
    assert saved == pytest.approx(100 * (1 - step.energy_j / backend.step(small_trace.kernels).energy_j))
    assert saved != pytest.approx(100 * (1 - measured.energy_j / validator.baseline().energy_j), abs=1e-9)
    assert noiseless_saved_pct(validator, dataclasses.replace(measured)) is None
