import dataclasses

import pytest

from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpu.specs import get_gpu
from freqopt.search import GRANULARITIES, SearchConfig, partition, run_search, search_unit


def test_partition(small_trace):
    assert [u.name for u in partition(small_trace, "pass")] == ["forward", "backward", "optimizer"]
    assert len(partition(small_trace, "iteration")[0].kernel_indices) == len(small_trace)
    kernel_units = partition(small_trace, "kernel")
    assert len(kernel_units) == len(small_trace.kernel_classes())
    assert sorted(i for u in kernel_units for i in u.kernel_indices) == list(range(len(small_trace)))
    with pytest.raises(UnknownNameError):
        partition(small_trace, "layer")


@pytest.mark.parametrize("bad", [-0.01, 1.0, 2.0])
def test_config_refuses_bad_slowdown(bad):
    with pytest.raises(InvalidSettingError):
        SearchConfig(max_slowdown=bad)


@pytest.fixture(scope="module")
def result(small_trace):
    config = SearchConfig(max_slowdown=0.02, n_trials_1d=8)
    # 1 ms switches: at the H100's 26 ms this short step realizes one clock, and no finer level is searched.
    h100 = get_gpu("h100-sxm").with_switch_latency(0.001)
    return run_search(small_trace, SimulatedGPU(h100, seed=3), config)


@pytest.mark.slow
def test_every_granularity_is_validated_within_budget(result):
    assert list(result.results) == list(GRANULARITIES)
    for g in GRANULARITIES:
        assert result.slowdown_pct(g) <= 2.0 + 1e-9
        assert result.energy_saved_pct(g) >= 0.0
        r = result.results[g]
        assert r.n_measurements > 0 and r.search_cost_gpu_s > 0


@pytest.mark.slow
def test_finer_granularity_never_ends_worse_and_free_switching_kernel_level_saves_most(result):
    saved = {g: result.energy_saved_pct(g) for g in GRANULARITIES}
    assert saved["kernel"] >= saved["pass"] >= saved["iteration"] > 0  # realizable: switching costs included
    # Per-kernel clocks, were switching free, save at least what per-pass ones do (within the 0.5 % energy noise:
    # this small iteration is launch-bound, the host sets its pace, and every pass already runs at a low clock).
    assert result.ideal_energy_saved_pct("kernel") > saved["pass"] - 0.1
    assert result.ideal_slowdown_pct("kernel") <= 2.0 + 1e-9
    # The pass level's free-switching figure is allocated and validated too; one clock's is its own validated one.
    assert result.ideal_slowdown_pct("pass") <= 2.0 + 1e-9 and result.ideal_energy_saved_pct("pass") is not None
    assert result.ideal_energy_saved_pct("iteration") == saved["iteration"]


@pytest.mark.slow
def test_each_level_reports_the_switches_per_second_it_asks_for(result):
    """Issue 35, item 6 (its report): a level's switches per second are its realized requests' changes per
    iteration (read cyclically) over the validated time; one clock asks for none; the statement holds them against
    the most one runtime thread can issue on the GPU (1 / the NVML call's 20 ms on the H100)."""
    from freqopt.search.schedule import n_switches

    assert result.spec.max_switches_per_s == pytest.approx(50.0)
    doc = result.summary()
    assert doc["max_switches_per_s"] == pytest.approx(50.0)
    assert doc["results"]["iteration"]["switches_per_s"] == 0.0
    # Issue 35, item 6: no level keeps a schedule asking for more than the limit (here, with 1 ms switches, the
    # kernel and phase levels' ~74 a second are not kept: tests/test_noisy_decisions.py).
    for g, r in result.results.items():
        assert (r.switches_per_s or 0.0) <= 50.0
    assert result.switching_statement() == "" or "more than a runtime can issue" not in result.switching_statement()
    # The statement, for a level that switches (its figure made up: a rendering test).
    from freqopt.gpu.specs import OVER_SWITCH_LIMIT

    made_up = dataclasses.replace(result, results={
        "iteration": result.results["iteration"],
        "kernel": dataclasses.replace(result.results["kernel"], switches_per_s=73.8)})
    line = made_up.switching_statement()
    assert line.startswith(f"clock switches per second: kernel 73.8 ({OVER_SWITCH_LIMIT})")
    assert line.endswith("one runtime thread issues at most 50 (each NVML set call blocks 20 ms, one at a time)")
    assert n_switches([1, 1, 2, 2, 1]) == 2 and n_switches([1, 2, 2]) == 2 and n_switches([3, 3]) == 0


def test_resumed_study_measures_nothing_again(small_trace, tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    kernels = partition(small_trace, "pass")[0].kernels(small_trace)
    spec = get_gpu("h100-sxm")
    args = dict(name="forward", study_name="fwd", storage=storage, n_trials=8, finalist_repeats=2)
    first = search_unit(SimulatedGPU(spec, seed=0), kernels, **args)
    second = search_unit(SimulatedGPU(spec, seed=0), kernels, **args)
    assert first.n_new_measurements == first.n_measurements >= 8  # trials, the default's and finalists' repeats
    assert second.n_new_measurements == 0  # all read back, the repeats included
    assert second.options == first.options and second.n_measurements == first.n_measurements


def test_validator_measures_each_schedule_once(small_trace):
    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.search.runner import Validator

    validator = Validator(small_trace, SimulatedGPU(get_gpu("h100-sxm"), seed=0), repeats=3)
    base = validator.baseline()
    assert validator.baseline() == base and validator.n_measurements == 3
    low = tuple([ClockSetting(sm_clock_mhz=990, mem_clock_mhz=2619)] * len(small_trace))
    # Launch-bound (micro-batch 1, short sequence): the host sets the pace, so half the clock costs no time here,
    # only energy is saved.
    assert validator(low).energy_j < 0.8 * base.energy_j and validator.n_measurements == 6
    # Each reading is charged the whole steps its warm-up and window ran (MeasurementProtocol.cost_gpu_s).
    gpu = SimulatedGPU(get_gpu("h100-sxm"))
    step_s = [gpu.step(small_trace.kernels, s).time_s for s in (None, low)]
    charged = 3 * sum(gpu.protocol.cost_gpu_s(gpu.spec.energy_counter_period_s, t) for t in step_s)
    assert validator.cost_gpu_s == pytest.approx(charged)


# A recorded figure and a re-run's agree to this relative precision. Another CPU sums in another order (an AMD EPYC
# printed 13.87606831909865 J for the recorded 13.876068319098644: issue 22, item 7), which moves only the last
# digits; the README prints at most 5 significant digits, so 1e-9 still catches any real change of a figure.
FIGURE_REL_TOL = 1e-9


def figure_mismatches(got, recorded, path: str = "") -> list[str]:
    """Where two JSON documents differ: floats beyond FIGURE_REL_TOL (relative), anything else at all."""
    if isinstance(got, dict) and isinstance(recorded, dict):
        if got.keys() != recorded.keys():
            return [f"{path or '/'}: keys {sorted(got)} != {sorted(recorded)}"]
        return [m for k in got for m in figure_mismatches(got[k], recorded[k], f"{path}/{k}")]
    if isinstance(got, list) and isinstance(recorded, list):
        if len(got) != len(recorded):
            return [f"{path}: {len(got)} items != {len(recorded)}"]
        return [m for i, (a, b) in enumerate(zip(got, recorded)) for m in figure_mismatches(a, b, f"{path}/{i}")]
    if isinstance(got, float) and isinstance(recorded, float) and not isinstance(got, bool):
        return [] if got == pytest.approx(recorded, rel=FIGURE_REL_TOL, abs=1e-12) else [f"{path}: {got!r} != {recorded!r}"]
    return [] if got == recorded and type(got) is type(recorded) else [f"{path}: {got!r} != {recorded!r}"]


def test_figures_compare_to_a_relative_1e_9_so_other_cpus_pass_and_real_changes_fail():
    recorded = {"baseline": {"energy_j": 13.876068319098644, "time_s": 0.02110208407663272},
                "results": {"kernel": {"energy_saved_pct": 1.0237407485158, "n_measurements": 1194, "table": "t.json"}}}
    other_cpu = {"baseline": {"energy_j": 13.87606831909865, "time_s": 0.02110208407663272},
                 "results": {"kernel": {"energy_saved_pct": 1.0237407485158334, "n_measurements": 1194,
                                        "table": "t.json"}}}  # fmt: skip
    assert figure_mismatches(other_cpu, recorded) == []  # issue 22's EPYC figures
    moved = {**other_cpu, "baseline": {"energy_j": 13.876068319098644 * (1 + 1e-7), "time_s": 0.02110208407663272}}
    assert figure_mismatches(moved, recorded) == [f"/baseline/energy_j: {moved['baseline']['energy_j']!r} "
                                                  "!= 13.876068319098644"]  # a change in the 8th digit fails
    recount = {**other_cpu, "results": {"kernel": {**other_cpu["results"]["kernel"], "n_measurements": 1195}}}
    assert figure_mismatches(recount, recorded) == ["/results/kernel/n_measurements: 1195 != 1194"]
    assert figure_mismatches({"baseline": {}}, recorded)  # a figure gone is a mismatch too


def readme_main_job_table() -> list[str]:
    """The README's "What the main job prints" block: the lines between its code fences."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("## What the main job prints", 1)[1]
    block = section.split("```", 2)[1]
    return [line.rstrip() for line in block.strip("\n").splitlines()]


@pytest.mark.slow
def test_main_job_reproduces_the_recorded_figures_and_meets_issue_2s_criterion(tmp_path, capsys):
    """The README's main command prints experiments/main_job.json's figures exactly (the same seed gives the same
    result, in another process, through joblib's processes; docs/search.md "The same figures on any machine"), each within
    1 % validated. With the H100's 26 ms switches this 28.6 ms step realizes one clock only, so the pass, kernel and
    phase levels keep the iteration level's clock and say why (issue 25), while the pass and kernel levels search
    their free-switching figures (issue 35, item 3: kernel > pass > iteration there, issue 2's criterion); issue 2's
    criterion for realizable schedules is checked on a step with 1 ms switches (the ``result`` fixture)."""
    import json
    from pathlib import Path

    from freqopt.cli import main

    out = tmp_path / "out.json"
    # --jobs 2: the same result as one process (tests/test_workers.py), in two thirds of the time on two cores.
    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--out", str(tmp_path), "--json",
                 str(out), "--jobs", "2"]) == 0  # fmt: skip
    # The README shows the table the command prints on standard output, line for line (issue 50, item 2).
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    table = printed[:next(i for i, line in enumerate(printed) if line.startswith("└")) + 1]
    assert readme_main_job_table() == table, "re-record the README's main-job table from the command's output"
    got = json.loads(out.read_text())
    recorded = json.loads((Path(__file__).parents[1] / "experiments" / "main_job.json").read_text())
    for doc in (got, recorded):
        for row in doc["results"].values():
            row["table"] = Path(row["table"]).name  # the folder is where each was run
    mismatches = figure_mismatches(got, recorded)
    assert not mismatches, ("the main job's figures moved: with the versions in constraints.txt, re-record "
                            f"experiments/main_job.json and the README's table: {mismatches[:5]}")  # fmt: skip
    res = got["results"]
    assert res["iteration"]["energy_saved_pct"] > 0 and res["iteration"]["n_measurements"] > 0
    for g in ("pass", "kernel", "phase"):  # held to the iteration's clock: 25.7 ms of kernels, 26 ms switches
        assert res[g]["energy_saved_pct"] == res["iteration"]["energy_saved_pct"]
        assert res[g]["note"].startswith("held to one clock: the iteration's 25.7 ms of kernels are shorter than two "
                                         "26 ms")  # fmt: skip
    assert res["phase"]["n_measurements"] == 0
    # Issue 35, item 3: the pass and kernel levels still search what they would save with free switching (the
    # papers' figure); every row shows a free-switching figure, within the budget, at least its realizable one.
    # Issue 35, item 1: held to the budget at 95 % confidence, the pass level's free-switching schedules did not
    # confirm on fresh readings, so its figure is the iteration level's one clock; the kernel level's is above it.
    assert res["kernel"]["ideal_energy_saved_pct"] > res["pass"]["ideal_energy_saved_pct"] >= res["iteration"]["energy_saved_pct"]
    for g in res.values():
        assert g["slowdown_pct"] <= 1.0 and g["ideal_slowdown_pct"] <= 1.0
        assert g["slowdown_bound_pct"] is None or g["slowdown_pct"] <= g["slowdown_bound_pct"] <= 1.0
        assert g["ideal_energy_saved_pct"] >= g["energy_saved_pct"]
    assert got["host_wait_pct"] < 25  # a compute-bound step: no line on the waiting GPU's share


def test_a_pair_the_memory_clock_does_not_allow_is_snapped_to_its_highest_sm_clock():
    import optuna

    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.search.journal import MeasurementLog
    from freqopt.search.study import _Objective

    spec = get_gpu("rtx3080ti")  # 405 MHz memory allows SM clocks up to 420 MHz only
    objective = _Objective(SimulatedGPU(spec), [], "u", "clocks", MeasurementLog(optuna.create_study()))
    trial = optuna.trial.FixedTrial({"sm_clock_mhz": 2100, "mem_clock_index": 0})  # 405 MHz
    assert objective.suggest(trial) == ClockSetting(420, 405)
    assert spec.supports(420, 405) and not spec.supports(2100, 405)


def test_kernel_families_group_each_class_once_led_by_the_largest(gpt3_small_trace):
    from freqopt.search.units import kernel_families

    units = partition(gpt3_small_trace, "kernel")
    families = kernel_families(gpt3_small_trace, units)
    assert sorted(i for f in families for i in f) == list(range(len(units)))
    assert 1 < len(families) < len(units)  # classes do share families (e.g. the forward and backward GEMMs)

    def work(i):
        ks = units[i].kernels(gpt3_small_trace)
        return sum(k.flops for k in ks) / 256 + sum(k.mem_bytes for k in ks)

    for family in families:
        kinds = {units[i].kernels(gpt3_small_trace)[0].kind for i in family}
        assert len(kinds) == 1
        assert work(family[0]) == max(work(i) for i in family)


@pytest.mark.slow
def test_a_level_searched_alone_measures_its_coarser_candidates_and_never_ends_worse_than_one_clock():
    """Issue 22, item 1. On the RTX 3080 Ti a clock switch takes 100 ms, so no per-kernel schedule of these steps
    is realizable: the kernel level searched alone used to realize nothing (0.00 %) while one clock for the
    iteration saved 11 %. It now searches the iteration, pass and phase levels itself, is never worse than their
    schedules, and pays for their measurements. A 69 ms step (shorter than two switches) realizes the iteration's
    clock alone, so its kernel level measures nothing more (issue 25); a 0.49 s step's is searched."""
    import freqopt
    from freqopt.search.units import search_units

    for micro_batch_size in (4, 32):
        kw = dict(gpu="rtx3080ti", max_slowdown="10%", micro_batch_size=micro_batch_size, seq_len=1024, n_trials=6)
        kernel = freqopt.search("gpt3-small", granularity="kernel", **kw)
        iteration = freqopt.search("gpt3-small", granularity="iteration", **kw)
        assert list(kernel.results) == ["kernel"] and list(iteration.results) == ["iteration"]
        assert iteration.energy_saved_pct("iteration") > 5.0
        assert kernel.energy_saved_pct("kernel") >= iteration.energy_saved_pct("iteration") - 1e-9
        assert kernel.slowdown_pct("kernel") <= 10.0
        families = search_units(kernel.trace, "kernel", share_families=True)
        if micro_batch_size == 4:  # held to the iteration's clock; its studies serve the free-switching figure
            # the iteration's schedule, the same seed: the iteration search's readings
            assert kernel.results["kernel"].validated == iteration.results["iteration"].validated
            assert "shorter than two 100 ms clock switches" in kernel.results["kernel"].note
            assert kernel.results["kernel"].held_to_one_clock and kernel.ideal_slowdown_pct("kernel") <= 10.0
        else:  # the iteration's trials, and at least two measurements per family (its default, a trial)
            assert kernel.results["kernel"].n_measurements > (iteration.results["iteration"].n_measurements
                                                              + 2 * len(families))  # fmt: skip
            assert not kernel.results["kernel"].note


def test_levels_to_run_adds_each_levels_candidates_in_search_order():
    from freqopt.search.runner import levels_to_run

    assert levels_to_run(("kernel",)) == ("iteration", "pass", "phase", "kernel")
    assert levels_to_run(("kernel",), switching=False) == ("iteration", "pass", "kernel")  # nothing to realize
    assert levels_to_run(("phase", "power-cap")) == ("power-cap", "iteration", "phase")
    assert levels_to_run(("pass",)) == ("iteration", "pass")
    assert levels_to_run(GRANULARITIES) == ("power-cap", "iteration", "pass", "phase", "kernel")


@pytest.mark.slow
def test_a_gpu_whose_memory_clock_is_set_per_job_searches_it_only_for_the_whole_iteration(small_trace, tmp_path):
    """Issue 22, item 2: Hopper locks its memory clock only per job (deferred), so the pass level's units search
    the SM clock alone at the job's (highest) memory clock, while the iteration level, one setting for the job,
    searches both; a GPU that locks it at run time (the RTX 3080 Ti) searches both at every level."""
    import optuna

    from freqopt.search.runner import job_mem_clock_mhz

    h100 = get_gpu("h100-sxm").with_switch_latency(0.001)  # at 26 ms this short step's pass level is not searched
    assert not h100.mem_clock_runtime and get_gpu("rtx3080ti").mem_clock_runtime
    storage = f"sqlite:///{tmp_path / 's.db'}"
    config = SearchConfig(max_slowdown=0.05, granularities=("iteration", "pass"), n_trials_1d=6, n_trials_2d=10,
                          storage=storage)  # fmt: skip
    result = run_search(small_trace, SimulatedGPU(h100, seed=0), config)

    def sampled(granularity: str) -> set:
        """The memory clocks the level's studies measured (each trial's setting)."""
        names = result.results[granularity].study_names
        return {t.user_attrs["setting"][1] for n in names for t in optuna.load_study(study_name=n, storage=storage)
                .get_trials(states=(optuna.trial.TrialState.COMPLETE,))}  # fmt: skip

    assert sampled("iteration") == {1593, 2619}
    assert sampled("pass") == {2619}
    assert job_mem_clock_mhz(h100, 3) == 2619 and job_mem_clock_mhz(h100, 1) is None
    assert job_mem_clock_mhz(get_gpu("rtx3080ti"), 3) is None


def test_the_kernel_level_ends_on_the_pass_schedule_as_it_stands_where_that_validated_less(small_trace):
    """Issue 25: kernel >= pass with families of classes. A family may span passes, so the allocation over families
    saw the pass schedule only as projected onto them; where the pass schedule itself validated less energy, the
    kernel level ends on it, each class at its pass's setting, with the pass level's measurement."""
    from freqopt.gpu.backends.base import ClockSetting, Measurement
    from freqopt.search.result import GranularityResult
    from freqopt.search.runner import at_least_the_coarser_schedules

    passes = partition(small_trace, "pass")
    per_pass = dict(zip(("forward", "backward", "optimizer"), (ClockSetting(1500, 2619), ClockSetting(1200, 2619),
                                                               ClockSetting(1980, 2619))))  # fmt: skip
    pass_ = GranularityResult("pass", tuple((u, per_pass[u.name]) for u in passes), Measurement(1.0, 8.0),
                              Measurement(1.0, 10.0), Measurement(1.01, 8.5), 30, 30.0)  # fmt: skip
    classes = partition(small_trace, "kernel")
    kernel = GranularityResult("kernel", tuple((c, ClockSetting(1800, 2619)) for c in classes), Measurement(1.0, 9.0),
                               Measurement(1.0, 10.0), Measurement(1.005, 9.2), 500, 500.0,
                               ideal=Measurement(1.0, 7.0))  # fmt: skip
    ended = at_least_the_coarser_schedules(small_trace, kernel, [pass_])
    assert ended.validated == pass_.validated and ended.predicted == pass_.predicted
    assert [u for u, _ in ended.units] == classes  # still one entry per class
    for unit, setting in ended.units:
        assert setting == per_pass[small_trace.kernels[unit.kernel_indices[0]].pass_name]
    assert (ended.granularity, ended.n_measurements, ended.ideal) == ("kernel", 500, kernel.ideal)  # its own
    worse = dataclasses.replace(pass_, validated=Measurement(1.0, 9.3))
    assert at_least_the_coarser_schedules(small_trace, kernel, [worse]) is kernel


def test_a_finer_level_ends_on_the_phase_schedule_where_that_validated_less_energy(small_trace):
    """Issue 22, item 1: realizable kernel >= phase. A phase schedule (one setting per block, requested at its
    phase) is not always a per-kernel-class schedule, so where it validated less energy the kernel level ends on
    it as it stands, and its table is a phase schedule that the runtime applies by its requests."""
    from freqopt.gpu.backends.base import ClockSetting, Measurement
    from freqopt.search.result import GranularityResult, SearchResult
    from freqopt.search.runner import at_least_the_phase_schedule
    from freqopt.search.units import TuningUnit
    from freqopt.tables import table_from_result

    labels = [label for label, _ in small_trace.meta["marks"]]
    half = len(small_trace) // 2
    blocks = (TuningUnit("a", tuple(range(half))), TuningUnit("b", tuple(range(half, len(small_trace)))))
    phase = GranularityResult("phase", tuple(zip(blocks, (ClockSetting(1500, 2619), ClockSetting(1200, 2619)))),
                              Measurement(1.0, 8.0), Measurement(1.0, 10.0), Measurement(1.01, 8.5), 20, 20.0,
                              requests=(labels[0], labels[len(labels) // 2]))  # fmt: skip
    whole = TuningUnit("iteration", tuple(range(len(small_trace))))
    kernel = GranularityResult("kernel", ((whole, ClockSetting(1800, 2619)),), Measurement(1.0, 9.0),
                               Measurement(1.0, 10.0), Measurement(1.005, 9.2), 500, 500.0,
                               ideal=Measurement(1.0, 7.0))  # fmt: skip
    ended = at_least_the_phase_schedule(kernel, phase)
    assert ended.validated == phase.validated and ended.units == phase.units and ended.requests == phase.requests
    assert (ended.granularity, ended.n_measurements, ended.ideal) == ("kernel", 500, kernel.ideal)  # its own
    assert at_least_the_phase_schedule(kernel, dataclasses.replace(phase, validated=Measurement(1.0, 9.3))) is kernel
    result = SearchResult(small_trace, "h100-sxm", 0.02, Measurement(1.0, 10.0), {"kernel": ended}, None)
    table = table_from_result(result, "kernel", get_gpu("h100-sxm"), backend="sim", seed=0)
    assert table.is_phase_schedule and [e["request_phase"] for e in table.entries] == list(phase.requests)
    assert all("front" not in e for e in table.entries)  # blocks' in-situ options are not unit fronts

    from freqopt.apply.runtime import plan_phases

    plan = plan_phases(table, small_trace, SimulatedGPU(get_gpu("h100-sxm")))
    assert [s for _, s in plan.requests] == [ClockSetting(1500, 2619), ClockSetting(1200, 2619)]


def test_a_level_that_runs_as_a_coarser_schedule_carries_that_schedules_prediction(small_trace):
    """Issue 35, item 2: where a finer level's settings, realized per phase, run as exactly a coarser level's
    schedule (one realized schedule: Validator.schedule_of), the row's prediction is that schedule's, with a note;
    a level that runs a schedule of its own keeps its own prediction."""
    from freqopt.gpu.backends.base import ClockSetting, Measurement
    from freqopt.search.result import GranularityResult
    from freqopt.search.runner import _predicted_as_it_runs
    from freqopt.search.validate import Validator

    validator = Validator(small_trace, SimulatedGPU(get_gpu("h100-sxm"), seed=1), 1, switching=True)
    k = len(small_trace)
    fast, slow = (tuple([ClockSetting(sm_clock_mhz=c, mem_clock_mhz=2619)] * k) for c in (1575, 1200))

    def level(name, schedule, saved):
        return GranularityResult(granularity=name, units=(), predicted=Measurement(1.0, 1.0 - saved),
                                 predicted_baseline=Measurement(1.0, 1.0), validated=validator(schedule),
                                 n_measurements=0, search_cost_gpu_s=0.0)  # fmt: skip

    phase, pass_level = level("phase", fast, 0.03), level("pass", slow, 0.05)
    kernel = level("kernel", fast, 0.07)  # the free-switching sum of its units' picks
    shown = _predicted_as_it_runs(kernel, [pass_level, phase], validator)
    assert shown.predicted == phase.predicted and shown.validated is kernel.validated
    assert shown.note.startswith("runs as the phase level's schedule")
    # The slow schedule with its last kernel fast: too short to switch for, realized as the slow one.
    assert _predicted_as_it_runs(level("kernel", slow[:-1] + fast[-1:], 0.07), [pass_level, phase],
                                 validator).predicted == pass_level.predicted  # fmt: skip
    own = level("kernel", slow[: k // 2] + fast[k // 2:], 0.07)
    assert validator.schedule_of(own.validated) not in (validator.schedule_of(phase.validated),
                                                        validator.schedule_of(pass_level.validated))  # fmt: skip
    assert _predicted_as_it_runs(own, [pass_level, phase], validator) == own


@pytest.mark.slow
def test_a_host_bound_search_says_how_much_of_its_saving_is_the_waiting_gpus(tmp_path):
    """Issue 35, item 4: a launch-bound step (micro-batch 1, 128 tokens) is mostly the GPU waiting for the host,
    and most of what a lower clock saves there is the waiting GPU's power; the default gpt3-small step waits
    little, and the search says nothing of it."""
    import freqopt

    kw = dict(max_slowdown="2%", granularity="iteration", n_trials=4, out=None)
    bound = freqopt.search("gpt3-small", micro_batch_size=1, seq_len=128, **kw)
    doc = bound.summary()
    assert doc["host_wait_pct"] > 50
    share = doc["results"]["iteration"]["waiting_saved_pct"]
    assert bound.energy_saved_pct("iteration") > 0 and 0 < share <= 100
    assert bound.waiting_statement().startswith(f"the GPU waits for the host {doc['host_wait_pct']:.0f} % of")
    assert f"{share:.0f} % of the iteration level's saving" in bound.waiting_statement()
    # Issue 36, item 2: the saving at both ends of the waiting-power range, the flat end the smaller.
    flat, modelled = doc["results"]["iteration"]["saving_pct_waiting_range"]
    assert flat < modelled and f"{modelled:.2f} % with the waiting power falling" in bound.waiting_statement()
    assert f"{flat:.2f} % if it does not fall at all" in bound.waiting_statement()
    busy = freqopt.search("gpt3-small", **kw)
    assert busy.summary()["host_wait_pct"] < 25 and busy.waiting_statement() == ""


def test_clock_summary_names_the_one_setting_or_the_range_and_the_setting_most_time_runs_at():
    """Issue 51, item 2: the search's table shows each level's chosen clocks (SearchResult.clock_summary): the one
    setting, or the SM clocks' range, the settings and the setting that holds most of the step's default time
    (each unit's study's default reading), or most kernels where a unit has no study of its own."""
    from freqopt.gpu.backends.base import ClockSetting, Measurement
    from freqopt.search.result import GranularityResult, setting_text
    from freqopt.search.study import Option, UnitSearch
    from freqopt.search.units import TuningUnit

    m = Measurement(1.0, 1.0)
    one = GranularityResult("iteration", ((TuningUnit("iteration", (0, 1, 2)), ClockSetting(1410, 1593)),), m, m, m,
                            1, 1.0)  # fmt: skip
    assert one.clock_summary() == "1410/1593 MHz"
    assert setting_text(ClockSetting(power_limit_w=300.0)) == "300 W"
    assert setting_text(ClockSetting(1980)) == "SM 1980 MHz" and setting_text(ClockSetting()) == "default"
    units = ((TuningUnit("forward", (0, 1)), ClockSetting(1155)), (TuningUnit("backward", (2, 3, 4, 5)),
             ClockSetting(1980)), (TuningUnit("optimizer", (6,)), ClockSetting(1155)))  # fmt: skip
    default_s = {"forward": 0.006, "backward": 0.003, "optimizer": 0.001}
    studies = tuple(UnitSearch(u.name, u.name, Option(ClockSetting(), default_s[u.name], 1.0, 1), (), 1, 1.0)
                    for u, _ in units)  # fmt: skip
    timed = GranularityResult("pass", units, m, m, m, 3, 1.0, unit_searches=studies)
    # forward and optimizer at 1155 MHz: 7 ms of the 10 ms at the defaults, though backward has most kernels
    assert timed.clock_summary() == "SM 1155-1980 MHz, 2 settings over 3 passes; 70 % of time at SM 1155 MHz"
    untimed = dataclasses.replace(timed, unit_searches=studies[:1])
    assert untimed.clock_summary() == "SM 1155-1980 MHz, 2 settings over 3 passes; 57 % of kernels at SM 1980 MHz"
