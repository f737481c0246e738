"""The search, end to end, for one trace on one backend.

For each granularity: partition the trace into tuning units, run each unit's study (run_unit_studies), allocate
the slowdown budget over all units at once (MILP), and validate by measuring the whole iteration with the chosen
schedule (allocate_validated). Units measured alone do not add up exactly to the iteration (the power limit
averages power over neighbouring kernels; measurements are noisy), so the allocator's budget is calibrated by
validation until the validated slowdown meets the limit (freqopt.search.allocation).

This module drives the search (run_search, one granularity after another) and each granularity's unit studies
(run_unit_studies); the configuration, the result types, the storage, validation and allocation live in their
own modules of freqopt.search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.workload.kernels import Trace
from freqopt.workload.phases import phase_spans
from freqopt.search.allocation import (Allocation, _prediction, allocate_applied, allocate_validated,
                                       candidate_schedules, coarser_settings, settings_on)
from freqopt.search.config import SearchConfig
from freqopt.search.realize import phase_leaders
from freqopt.search.result import GranularityResult, SearchResult
from freqopt.search.schedule import phase_blocks, request_schedule, search_phase_schedule
from freqopt.search.storage import _storage_here, open_storage, study_prefix, validation_log
from freqopt.search.study import UnitSearch
from freqopt.search.units import GRANULARITIES, TuningUnit, partition, search_units
from freqopt.search.validate import Validator, _per_kernel_settings
from freqopt.search.workers import UnitQueue, UnitWork, finish_job, is_persistent, publish_job, run_unit

# The names below live in the modules of their jobs (config, result, storage, validate, allocation); they are
# re-exported here, where callers have always imported them from.
__all__ = ["SearchConfig", "GranularityResult", "SearchResult", "run_search", "levels_to_run", "study_prefix",
           "open_storage", "run_unit_studies", "Validator", "validation_log", "Allocation", "allocate_validated"]


def _slack(max_slowdown: float, n_units: int) -> float:
    """How much slower than its default a unit's options may be (the region its study samples, and where its
    finalists are re-measured). A lone unit (the whole iteration) can only ever spend the budget, plus timing
    noise; one of many may spend more where others spend less."""
    return 1.5 * max_slowdown + 0.005 if n_units == 1 else max(0.05, 3 * max_slowdown)


def _unit_task(trace: Trace, backend: Backend, work: UnitWork, i: int, unit: TuningUnit, storage, url: str | None,
               queue_name: str | None, warm: list[ClockSetting], verbosity: int) -> tuple[int, UnitSearch | None]:  # fmt: skip
    """One unit as a joblib task: claimed from the queue first when the storage is shared (None: a worker has it).
    ``verbosity`` is the calling process's Optuna verbosity, which joblib's worker processes do not inherit."""
    import optuna

    optuna.logging.set_verbosity(verbosity)
    if storage is None and url is not None:
        storage = _storage_here(url)
    if queue_name is None:
        return i, run_unit(trace, backend, work, unit, storage, warm)
    queue = UnitQueue(storage, queue_name)
    claimed = queue.claim(i)
    if claimed is None:
        return i, None
    with queue.owning(claimed[1]):
        return i, run_unit(trace, backend, work, unit, storage, warm)


def _run_units(trace: Trace, backend: Backend, config: SearchConfig, work: UnitWork, units: list[TuningUnit],
               which: list[int], warm: list[list[ClockSetting]], storage, progress: Callable[[], None]
               ) -> dict[int, UnitSearch]:  # fmt: skip
    """Run units ``which`` (indices into ``units``) with their warm starts: through a queue that workers share when
    the storage is persistent, in ``config.n_jobs`` joblib processes."""
    import optuna
    from joblib import Parallel, delayed

    queue = UnitQueue.create(storage, work, which, warm) if is_persistent(storage) else None
    parallel = config.n_jobs > 1
    tasks = (delayed(_unit_task)(trace, backend, work, i, units[i], None if parallel else storage,
                                 config.storage if parallel else None, queue.name if queue else None, w,
                                 optuna.logging.get_verbosity())
             for i, w in zip(which, warm))  # fmt: skip
    results: dict[int, UnitSearch] = {}
    for i, result in Parallel(n_jobs=config.n_jobs, return_as="generator_unordered")(tasks):
        if result is not None:
            results[i] = result
            progress()
    if queue is not None:
        queue.settle()  # units other workers hold: wait for them, or take them over if their worker is gone
        for i, w in zip(which, warm):
            if i not in results:
                results[i] = run_unit(trace, backend, work, units[i], storage, w)
                progress()
    return results


def job_mem_clock_mhz(spec, n_units: int) -> int | None:
    """The memory clock the units of a granularity with ``n_units`` units are searched at: None (searched, a
    dimension) where the GPU can change its memory clock while a job runs (GPUSpec.mem_clock_runtime) or the unit
    is the whole iteration (one setting for the job); else the GPU's highest, its default (issue 22, item 2: on
    such a GPU the memory clock is a per-job setting, so a finer schedule may not change it)."""
    if n_units == 1 or len(spec.mem_clocks_mhz) == 1 or spec.mem_clock_runtime:
        return None
    return max(spec.mem_clocks_mhz)


def _at_job_mem_clock(settings, mem_clock_mhz: int | None) -> bool:
    """Every setting keeps the job's memory clock (always, where the memory clock is searched)."""
    return mem_clock_mhz is None or all(s is None or s.mem_clock_mhz in (None, mem_clock_mhz) for s in settings)


def _n_trials(config: SearchConfig, backend: Backend, space: str, mem_searched: bool = True) -> int:
    """Trials per unit: config.n_trials_1d, and more where the memory clock is a second dimension."""
    n_mem = len(backend.spec.mem_clocks_mhz) if space == "clocks" and mem_searched else 1
    if n_mem > 1:
        return config.n_trials_2d or config.n_trials_1d + config.n_trials_per_mem_clock * (n_mem - 1)
    return config.n_trials_1d


def _unsearched(trace: Trace, units: list[TuningUnit], kernel_time_s) -> tuple[str, ...]:
    """The names of the units a phase-switching runtime never gives their own setting (realize.phase_leaders;
    none without ``kernel_time_s``, or for a single unit)."""
    if kernel_time_s is None or len(units) < 2:
        return ()
    leaders = phase_leaders(trace.meta.get("marks", ()), units, kernel_time_s)
    return tuple(u.name for j, u in enumerate(units) if j not in leaders)


def run_unit_studies(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, *, storage=None,
    warm_start: list[ClockSetting | None] | None = None, on_unit: Callable[[str, int, int], None] | None = None,
    kernel_time_s=None,
) -> tuple[list[TuningUnit], list[UnitSearch]]:  # fmt: skip
    """Partition the trace (search_units) and run (or resume) each tuning unit's study.

    Kernel level, with ``config.share_classes``: each family of kernel classes (kernel_families: kind, group
    size and arithmetic intensity) is one unit, with one study and one setting (issue 25: 11 studies in place of
    gpt3-small's 54 classes).

    With a storage other processes can see, the units are a queue that ``freqopt worker`` processes join
    (freqopt.search.workers); units they ran are read back from the storage, units whose worker died are resumed
    here. ``config.n_jobs`` > 1 runs this process's share in that many joblib processes.

    Args:
        warm_start: per unit (of search_units), a setting, or a list of settings, to enqueue first and always
            offer (the coarser granularities' choices).
        kernel_time_s: every kernel's time at the default setting, shape (K,), s, where a phase-switching runtime
            realizes the schedule (Validator.kernel_time_s, with switching costs): units that lead no phase
            (realize.phase_leaders) are then not searched, only measured at their warm starts (issue 25). None:
            every unit is searched.

    Returns:
        The units and, per unit, its study's outcome (in unit order, whoever ran it).
    """
    share = config.share_classes and granularity == "kernel"
    units = search_units(trace, granularity, share)
    space = "power" if granularity == "power-cap" else "clocks"
    mem = job_mem_clock_mhz(backend.spec, len(units)) if space == "clocks" else None
    work = UnitWork(
        prefix=study_prefix(trace, backend.spec, config.seed), granularity=granularity, space=space,
        n_trials=_n_trials(config, backend, space, mem is None), finalist_repeats=config.finalist_repeats,
        finalist_slowdown=_slack(config.max_slowdown, len(units)), seed=config.seed, constrained=len(units) == 1,
        whole_step=len(units) == 1, mem_clock_mhz=mem, share_families=share, patience=config.patience,
        edge_slowdown=config.max_slowdown if len(units) == 1 else None,
        unsearched=_unsearched(trace, units, kernel_time_s),
    )  # fmt: skip
    inherited = []  # per unit: its warm settings, without the default (every study measures it), repeats, or
    for w in warm_start or [None] * len(units):  # another memory clock than the job's where that is fixed
        settings = w if isinstance(w, (list, tuple)) else [w]  # ClockSetting is a dataclass, not a tuple
        inherited.append([x for x in dict.fromkeys(settings)
                          if x not in (None, DEFAULT_SETTING) and _at_job_mem_clock([x], mem)])  # fmt: skip
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        if on_unit:
            on_unit(granularity, done, len(units))

    results = _run_units(trace, backend, config, work, units, list(range(len(units))), inherited, storage, progress)
    return units, [results[i] for i in range(len(units))]


# The coarser schedules each clock granularity chooses among beside its own allocation (issue 22, item 1): one clock
# for the iteration, one per pass, one per phase block (the phase level's blocks only where switching has a cost:
# with free switching the kernel level's own schedule is applied as allocated). A granularity searched without them
# searches them first itself, so that realizable kernel >= phase, pass >= iteration >= 0 by construction.
CANDIDATES = {"power-cap": (), "iteration": (), "pass": ("iteration",), "phase": ("iteration",),
              "kernel": ("iteration", "pass", "phase")}  # fmt: skip
# The order levels are searched in: each after its candidates (GRANULARITIES is the order results are shown in).
SEARCH_ORDER = ("power-cap", "iteration", "pass", "phase", "kernel")


def levels_to_run(granularities, switching: bool = True) -> tuple[str, ...]:
    """The granularities a search of ``granularities`` runs, in SEARCH_ORDER: those asked for and their candidate
    levels (CANDIDATES; phase as the kernel level's candidate only with ``switching``)."""
    needed = set(granularities)
    for g in granularities:
        needed.update(c for c in CANDIDATES[g] if c != "phase" or switching)
    return tuple(g for g in SEARCH_ORDER if g in needed)


def _charge_candidates(ran: dict[str, GranularityResult], asked) -> dict[str, GranularityResult]:
    """The results of the granularities ``asked`` for, in GRANULARITIES order, each charged with the measurements
    of the candidate levels searched only for it (a level searched alone pays for its candidates)."""
    results = {g: ran[g] for g in GRANULARITIES if g in asked and g in ran}
    for hidden in (g for g in SEARCH_ORDER if g in ran and g not in asked):
        payer = next(g for g in SEARCH_ORDER if g in results and hidden in CANDIDATES[g])
        r = results[payer]
        results[payer] = dataclasses.replace(r, n_measurements=r.n_measurements + ran[hidden].n_measurements,
                                             search_cost_gpu_s=r.search_cost_gpu_s + ran[hidden].search_cost_gpu_s)
    return results


def _at_least_the_coarser_schedules(trace: Trace, result: GranularityResult,
                                    coarser: list[GranularityResult]) -> GranularityResult:  # fmt: skip
    """``result`` (a finer level's), or the iteration or pass level's schedule where that validated less energy.

    Those schedules are exact on kernel classes (a class lies in one pass), but the kernel level allocates over
    families of classes (issue 25), which may span passes, so its candidates were their projections onto the
    families (candidate_schedules), not always the schedules themselves. The level then ends on the coarser
    schedule as it stands, each class at its pass's setting, with that level's validated measurement and
    prediction (the same per-kernel schedule, so the same measurement); it keeps its own measurements, studies and
    free-switching ideal."""
    classes = [u for u, _ in result.units]
    for r in coarser:
        if r.granularity in ("iteration", "pass") and r.validated.energy_j < result.validated.energy_j:
            settings = [s or DEFAULT_SETTING for s in coarser_settings(trace, r, classes)]
            result = dataclasses.replace(result, units=tuple(zip(classes, settings)), predicted=r.predicted,
                                         predicted_baseline=r.predicted_baseline, validated=r.validated,
                                         requests=())  # fmt: skip
    return result


def _at_least_the_phase_schedule(result: GranularityResult, phase: GranularityResult) -> GranularityResult:
    """``result`` (a finer level's), or the phase level's schedule where that validated less energy: one setting
    per phase block, requested at its phase, is a schedule a per-kernel-class table cannot always express (a class
    may run in blocks of different settings), so the level ends on it as it stands, with the phase level's
    prediction and requests (its table is then a phase schedule: ClockTable.is_phase_schedule). Both met the
    budget when validated; the level keeps its own measurements, studies and free-switching ideal."""
    if phase.validated.energy_j >= result.validated.energy_j:
        return result
    return dataclasses.replace(result, units=phase.units, predicted=phase.predicted,
                               predicted_baseline=phase.predicted_baseline, validated=phase.validated,
                               requests=phase.requests)  # fmt: skip


def _predicted_as_it_runs(result: GranularityResult, coarser: list[GranularityResult],
                          validator: Validator) -> GranularityResult:  # fmt: skip
    """``result`` with the prediction of the coarser level whose schedule it runs as, where it does.

    With switching costs a runtime realizes a finer level's per-unit settings per phase; the schedule that then
    runs (the validator's realized requests, Validator.schedule_of) may be exactly a coarser level's, as the main
    job's gpt3-xl kernel level on the H100 runs the phase level's two blocks. Its validated figure is then that
    schedule's, and so is the prediction shown beside it (the units' sum of the per-unit settings, 6.92 % there,
    predicted free switching, not what ran: issue 35, item 2), with a note saying so. Where it runs as another
    schedule of one setting per phase block, requested as the phase level requests its own, the phase level's
    block model predicts it (freqopt.search.schedule.BlockModel: the blocks' in-situ changes, where the units' sum,
    measured in replay loops of each unit alone, said 6.31 % for gpt3-xl's two-setting schedule that validated
    3.28 %)."""
    ran = validator.schedule_of(result.validated)
    if ran is None:
        return result
    for other in coarser:
        if validator.schedule_of(other.validated) == ran:
            if (other.predicted, other.predicted_baseline) == (result.predicted, result.predicted_baseline):
                return result
            return dataclasses.replace(result, predicted=other.predicted, predicted_baseline=other.predicted_baseline,
                                       note=f"runs as the {other.granularity} level's schedule once a runtime "
                                            "realizes its settings per phase, so its prediction is that level's")  # fmt: skip
    phase = next((r for r in coarser if r.block_model is not None), None)
    if phase is None or not validator.switching or result.requests:
        return result
    model = phase.block_model
    settings = model.settings_of(validator.realize(tuple(_per_kernel_settings(validator.trace, result.units))))
    if settings is None or request_schedule(validator.trace, model.blocks, settings) != ran:
        return result
    predicted = model.predict(settings)
    if predicted is None:
        return result
    return dataclasses.replace(result, predicted=predicted, predicted_baseline=phase.predicted_baseline,
                               note="runs as one setting per phase block once a runtime realizes its settings per "
                                    "phase, so the phase level's block model predicts it")  # fmt: skip


def _warm_starts(trace: Trace, coarser: list[GranularityResult], units: list[TuningUnit],
                 schedules: list[list[ClockSetting]], kernel_time_s=None) -> list[list[ClockSetting]]:  # fmt: skip
    """Per unit, the settings its study starts from: the nearest coarser level's (even when it saved nothing),
    then each of ``schedules``' (one setting per unit); see run_unit_studies's ``warm_start``."""
    warm = [[c[i] for c in schedules] for i in range(len(units))]
    if coarser:
        warm = [[s, *w] for s, w in zip(coarser_settings(trace, coarser[-1], units, kernel_time_s), warm)]
    return warm


def _search_granularity(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, validator: Validator,
    baseline: Measurement, on_unit, coarser: list[GranularityResult], storage,
    ideal_validator: Validator | None = None,
) -> GranularityResult:  # fmt: skip
    """Search one granularity. ``coarser``: the validated results of the coarser clock granularities (CANDIDATES);
    their settings warm-start each unit's study and their schedules are validated first as candidates, so a finer
    granularity never ends worse than a coarser one (any coarser schedule laid onto finer units is also a finer
    one). ``ideal_validator``: also allocate the budget as if switching were free, and report that schedule's
    validated figure as the ideal."""
    units = search_units(trace, granularity, config.share_classes and granularity == "kernel")
    kernel_time_s = validator.kernel_time_s if any(r.granularity == "phase" for r in coarser) else None
    mem = job_mem_clock_mhz(backend.spec, len(units)) if granularity != "power-cap" else None
    candidates = [c for c in candidate_schedules(trace, coarser, units, baseline, kernel_time_s)
                  if _at_job_mem_clock(c, mem)]  # a coarser schedule at another memory clock: not this level's  # fmt: skip
    warm = _warm_starts(trace, coarser, units, candidates, kernel_time_s)
    measured_before = (validator.n_measurements, validator.cost_gpu_s)
    ideal_before = (ideal_validator.n_measurements, ideal_validator.cost_gpu_s) if ideal_validator else (0, 0.0)
    units, searches = run_unit_studies(trace, backend, config, granularity, storage=storage, warm_start=warm,
                                       on_unit=on_unit, kernel_time_s=validator.kernel_time_s
                                       if validator.switching and backend.spec.clock_switch_s > 0 else None)  # fmt: skip
    result, settings, validated = allocate_applied(trace, units, searches, validator, baseline, config.max_slowdown,
                                                   rounds=config.max_validation_rounds, key=granularity,
                                                   candidates=candidates)  # fmt: skip
    ideal, ideal_units = None, ()
    if ideal_validator is not None:  # the best schedule if switching were free, found the same way
        ideal, ideal_units = _free_allocation(trace, units, searches, ideal_validator, baseline, config, granularity,
                                              candidates, coarser, mem)  # fmt: skip
    predicted, predicted_baseline = _prediction(trace, units, searches, settings, result.chosen, coarser)
    classes = partition(trace, granularity)  # the table's units: each class, at its family's setting
    settings = settings_on(trace, units, settings, classes)
    return GranularityResult(
        granularity=granularity,
        units=tuple(zip(classes, settings)),
        searched_units=tuple(units) if classes != units else (),
        ideal=ideal,
        ideal_units=ideal_units,
        predicted=predicted,
        predicted_baseline=predicted_baseline,
        validated=validated,
        n_measurements=sum(s.n_measurements for s in searches) + validator.n_measurements - measured_before[0]
        + (ideal_validator.n_measurements - ideal_before[0] if ideal_validator else 0),
        search_cost_gpu_s=sum(s.cost_gpu_s for s in searches) + validator.cost_gpu_s - measured_before[1]
        + (ideal_validator.cost_gpu_s - ideal_before[1] if ideal_validator else 0.0),
        unit_searches=tuple(searches),
    )


def _search_phase(trace: Trace, backend: Backend, config: SearchConfig, validator: Validator, baseline: Measurement,
                  on_unit, iteration: GranularityResult | None, storage) -> GranularityResult:  # fmt: skip
    """The realizable phase schedule (freqopt.search.schedule), its in-situ studies changing one block at a time
    from the iteration level's validated clock (the defaults when that saved nothing or was not searched)."""
    reference = DEFAULT_SETTING
    if iteration is not None and iteration.validated.energy_j < baseline.energy_j:
        reference = iteration.units[0][1]
    mem = job_mem_clock_mhz(backend.spec, 2)  # blocks share the job's memory clock where it is set per job: the
    if mem is not None and reference.mem_clock_mhz is not None:  # reference's, which the other blocks run at
        mem = reference.mem_clock_mhz
    measured_before = (validator.n_measurements, validator.cost_gpu_s)
    r = search_phase_schedule(
        trace, backend, measure=validator.requests, baseline=baseline, max_slowdown=config.max_slowdown,
        reference=reference, study_prefix=study_prefix(trace, backend.spec, config.seed), storage=storage,
        n_trials=_n_trials(config, backend, "clocks", mem is None), finalist_repeats=config.phase_finalist_repeats,
        seed=config.seed, max_blocks=config.max_phase_blocks, rounds=config.max_validation_rounds,
        switching=validator.switching, on_block=(lambda done, n: on_unit("phase", done, n)) if on_unit else None,
        mem_clock_mhz=mem, patience=config.phase_patience, confirm=validator.confirm,
        deliverable=validator.deliverable,
    )  # fmt: skip
    labels = [label for label, _, _ in phase_spans(trace.meta.get("marks", ()), len(trace))]
    return GranularityResult(
        granularity="phase", units=tuple((b.unit, s) for b, s in zip(r.blocks, r.settings)), predicted=r.predicted,
        predicted_baseline=baseline, validated=r.validated,
        n_measurements=sum(s.n_measurements for s in r.searches) + validator.n_measurements - measured_before[0],
        search_cost_gpu_s=sum(s.cost_gpu_s for s in r.searches) + validator.cost_gpu_s - measured_before[1],
        unit_searches=r.searches, requests=tuple(labels[b.request] for b in r.blocks), block_model=r.model,
    )  # fmt: skip


def one_clock_reason(trace: Trace, backend: Backend, config: SearchConfig, kernel_time_s) -> str:
    """Why no schedule finer than one clock per iteration can be realized, or "" where one can.

    A runtime switching clocks pays the GPU's clock-switch latency for each change; phase_blocks makes a single
    block of an iteration shorter than two latencies, or of one whose passes hold no two runs of phases at least
    one latency long each (freqopt.search.schedule), and then the pass, kernel and phase levels could only ever
    realize the iteration level's one clock: their studies could not move the result, so they are not measured
    (issue 25).

    Args:
        kernel_time_s: every kernel's time at the default setting, shape (K,), s (Validator.kernel_time_s).
    """
    switch_s = backend.spec.clock_switch_s
    if not config.switching or len(phase_blocks(trace, kernel_time_s, switch_s, max_blocks=config.max_phase_blocks)) > 1:
        return ""
    total_s, finer = float(kernel_time_s.sum()), "so no schedule finer than one clock per iteration can be realized"
    if total_s < 2 * switch_s:
        return f"the iteration's {1e3 * total_s:.1f} ms of kernels are shorter than two {1e3 * switch_s:g} ms clock switches, {finer}"
    return (f"the iteration's {1e3 * total_s:.1f} ms of kernels hold no two runs of phases each as long as a "
            f"{1e3 * switch_s:g} ms clock switch (its passes are cut only into runs that long: phase_blocks), {finer}")


def _one_clock(trace: Trace, iteration: GranularityResult, granularity: str, kernel_time_s, switch_s: float,
               max_blocks: int, reason: str) -> GranularityResult:  # fmt: skip
    """The iteration level's schedule as ``granularity``'s result, unmeasured (one_clock_reason): each of the
    level's units (the phase level's one block, asked for at its phase) at the iteration's setting, noted "held to
    one clock: REASON" (its free-switching figure, where FREE_SWITCHING_SEARCHED, is searched after: _free_switching)."""
    setting = iteration.units[0][1]
    requests: tuple[str, ...] = ()
    if granularity == "phase":
        block = phase_blocks(trace, kernel_time_s, switch_s, max_blocks=max_blocks)[0]
        units = [block.unit]
        requests = (phase_spans(trace.meta.get("marks", ()), len(trace))[block.request][0],)
    else:
        units = partition(trace, granularity)
    return GranularityResult(granularity=granularity, units=tuple((u, setting) for u in units),
                             predicted=iteration.predicted, predicted_baseline=iteration.predicted_baseline,
                             validated=iteration.validated, n_measurements=0, search_cost_gpu_s=0.0,
                             requests=requests, note=f"held to one clock: {reason}")  # fmt: skip


# The levels whose free-switching figure is a search of its own: their units' settings allocated as if switching
# were free and validated so (the papers' figure: Spaan et al. 2026 switch at no cost). The others' is their own
# schedule with free switches (_free_switching_as_realized): one setting (power cap, iteration), or the phase
# level's blocks, each block's setting landing as it is asked for.
FREE_SWITCHING_SEARCHED = ("pass", "kernel")


def _free_switching(trace: Trace, backend: Backend, config: SearchConfig, result: GranularityResult,
                    coarser: list[GranularityResult], ideal_validator: Validator, baseline: Measurement, on_unit,
                    storage) -> GranularityResult:  # fmt: skip
    """``result`` (a level held to one clock: one_clock_reason) with its free-switching figure: the level's units
    searched and their settings allocated as if switching were free, validated so (issue 35, item 3: the main
    job's gpt3-small shows what pass- and kernel-level DVFS would save with free switching beside what a runtime
    can realize). Its measurements are charged to it; its table still holds the iteration level's clock."""
    g = result.granularity
    units = search_units(trace, g, config.share_classes and g == "kernel")
    mem = job_mem_clock_mhz(backend.spec, len(units))
    candidates = [c for c in candidate_schedules(trace, coarser, units, baseline) if _at_job_mem_clock(c, mem)]
    offered = candidates + _free_candidates(trace, coarser, units, baseline, mem)  # each studied, so allocatable
    warm = _warm_starts(trace, coarser, units, offered)
    before = (ideal_validator.n_measurements, ideal_validator.cost_gpu_s)
    units, searches = run_unit_studies(trace, backend, config, g, storage=storage, warm_start=warm, on_unit=on_unit)
    ideal, ideal_units = _free_allocation(trace, units, searches, ideal_validator, baseline, config, g, candidates,
                                          coarser, mem)  # fmt: skip
    return dataclasses.replace(
        result, ideal=ideal, ideal_units=ideal_units, unit_searches=tuple(searches),
        n_measurements=sum(s.n_measurements for s in searches) + ideal_validator.n_measurements - before[0],
        search_cost_gpu_s=sum(s.cost_gpu_s for s in searches) + ideal_validator.cost_gpu_s - before[1],
    )  # fmt: skip


def _free_candidates(trace: Trace, coarser: list[GranularityResult], units: list[TuningUnit], baseline: Measurement,
                     mem: int | None) -> list[list[ClockSetting]]:  # fmt: skip
    """The coarser levels' own free-switching schedules (GranularityResult.ideal_units) laid onto ``units``."""
    free = [dataclasses.replace(r, units=r.ideal_units, validated=r.ideal) for r in coarser if r.ideal_units]
    return [c for c in candidate_schedules(trace, free, units, baseline) if _at_job_mem_clock(c, mem)]


def _free_allocation(trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], ideal_validator: Validator,
                     baseline: Measurement, config: SearchConfig, granularity: str, candidates: list,
                     coarser: list[GranularityResult], mem: int | None) -> tuple[Measurement, tuple]:  # fmt: skip
    """The free-switching schedule of ``units`` (allocate_validated on ``ideal_validator``, which measures without
    switch latency) and its per-unit settings, against the same baseline (the defaults have no switch to realize
    differently). Beside the realizable coarser schedules (``candidates``) it is offered the coarser levels' own
    free-switching schedules, so a finer level's figure is never below a coarser one's."""
    measured = [{o.setting for o in s.options} for s in searches]
    more = [c for c in _free_candidates(trace, coarser, units, baseline, mem)
            if all(x in m for x, m in zip(c, measured))]  # only schedules of measured options can be allocated  # fmt: skip
    allocation = allocate_validated(units, searches, ideal_validator, baseline, config.max_slowdown,
                                    rounds=config.max_validation_rounds, key=f"{granularity}-ideal",
                                    candidates=[*candidates, *(c for c in more if c not in candidates)])  # fmt: skip
    return allocation.validated, tuple(zip(units, (o.setting for o in allocation.chosen)))


def _at_least_the_coarser_free(result: GranularityResult, coarser: list[GranularityResult]) -> GranularityResult:
    """``result`` with a coarser level's free-switching schedule (a one-setting level's validated one) as its own
    where that validated less energy: the kernel level allocates over families of classes that may span passes, so
    the pass level's free-switching schedule is not always among its allocations, though a per-class schedule
    expresses it (as _at_least_the_coarser_schedules does for the realizable figure)."""
    for r in coarser:
        if result.ideal is not None and r.ideal_units and r.ideal.energy_j < result.ideal.energy_j:
            result = dataclasses.replace(result, ideal=r.ideal, ideal_units=r.ideal_units)
        # One setting switches nothing: its free-switching figure is its validated one (_free_switching_as_realized),
        # which the free allocation, measuring the same schedule on its own readings, may have read less well.
        elif result.ideal is not None and r.n_settings == 1 and r.validated.energy_j < result.ideal.energy_j:
            result = dataclasses.replace(result, ideal=r.validated, ideal_units=r.units)
    return result


def _free_switching_as_realized(result: GranularityResult, validator: Validator,
                                ideal_validator: Validator) -> GranularityResult:  # fmt: skip
    """``result`` with a free-switching figure where it has none: its own schedule with every switch landing as it
    is asked for. One setting (power cap, iteration, a level held to one clock) has no switch to be free of, so
    its figure is its validated one; a phase schedule's is each block's setting on the block's own kernels, measured
    without switch latency (its requests, made one latency ahead, would land that much early)."""
    if result.ideal is not None:
        return result
    if result.n_settings == 1:
        return dataclasses.replace(result, ideal=result.validated)
    if result.granularity != "phase":
        return result
    before = (ideal_validator.n_measurements, ideal_validator.cost_gpu_s)
    ideal = ideal_validator.requests(tuple(_per_kernel_settings(validator.trace, result.units)), key="phase-ideal")
    return dataclasses.replace(result, ideal=ideal,
                               n_measurements=result.n_measurements + ideal_validator.n_measurements - before[0],
                               search_cost_gpu_s=result.search_cost_gpu_s + ideal_validator.cost_gpu_s - before[1])  # fmt: skip


def run_search(
    trace: Trace,
    backend: Backend,
    config: SearchConfig,
    *,
    on_unit: Callable[[str, int, int], None] | None = None,
    validator: Validator | None = None,
) -> SearchResult:
    """Search every granularity in ``config`` and validate each result on ``backend``.

    Args:
        trace: the iteration's kernels.
        backend: the GPU to measure on.
        config: budget, granularities, trial counts, storage.
        on_unit: called as on_unit(granularity, units_done, units_total) after each unit's study (progress).
        validator: measures whole iterations (its cache and baseline shared with the caller); default a new one
            for ``config`` (Validator.for_search).

    Returns:
        SearchResult with the measured baseline (all defaults) and one validated result per granularity. Each
        result counts the measurements its level took; the first also counts the baseline's (when this call
        measured it), which every level shares.

    Raises:
        StorageError: the storage URL cannot be opened.
    """
    storage = open_storage(config.storage)
    prefix = study_prefix(trace, backend.spec, config.seed)
    if validator is None:
        log = validation_log(storage, prefix)
        validator = Validator.for_search(trace, backend, config, log=log)
    # With switching costs in the validation, the kernel level's free-switching figure is measured beside it.
    ideal_validator = (Validator.for_search(trace, backend, config, log=validator.log, switching=False,
                                            baseline_from=validator)
                       if validator.switching and config.free_switching else None)  # fmt: skip
    resumed = is_persistent(storage) and publish_job(storage, prefix, trace, backend, config.seed)
    before = (validator.n_measurements, validator.cost_gpu_s)
    baseline = validator.baseline()
    baseline_cost = (validator.n_measurements - before[0], validator.cost_gpu_s - before[1])
    ran: dict[str, GranularityResult] = {}
    one_clock = one_clock_reason(trace, backend, config, validator.kernel_time_s) if validator.switching else ""
    for g in levels_to_run(config.granularities, validator.switching):
        if one_clock and g in ("pass", "kernel", "phase") and "iteration" in ran:
            ran[g] = _one_clock(trace, ran["iteration"], g, validator.kernel_time_s, backend.spec.clock_switch_s,
                                config.max_phase_blocks, one_clock)  # fmt: skip
            if ideal_validator is not None and g in FREE_SWITCHING_SEARCHED:
                coarser = [ran[c] for c in CANDIDATES[g] if c in ran and c != "phase"]
                ran[g] = _free_switching(trace, backend, config, ran[g], coarser, ideal_validator, baseline, on_unit,
                                         storage)  # fmt: skip
                ran[g] = _at_least_the_coarser_free(ran[g], coarser)
        elif g == "phase":
            ran[g] = _search_phase(trace, backend, config, validator, baseline, on_unit, ran.get("iteration"), storage)
        elif g == "power-cap":
            ran[g] = _search_granularity(trace, backend, config, g, validator, baseline, on_unit, [], storage)
        else:
            coarser = [ran[c] for c in CANDIDATES[g] if c in ran and (c != "phase" or validator.switching)]
            ran[g] = _search_granularity(trace, backend, config, g, validator, baseline, on_unit, coarser, storage,
                                         ideal_validator if g in FREE_SWITCHING_SEARCHED else None)  # fmt: skip
            ran[g] = _at_least_the_coarser_schedules(trace, ran[g], coarser)
            if "phase" in (r.granularity for r in coarser):
                ran[g] = _at_least_the_phase_schedule(ran[g], ran["phase"])
            ran[g] = _predicted_as_it_runs(ran[g], coarser, validator)
            ran[g] = _at_least_the_coarser_free(ran[g], coarser)
    if ideal_validator is not None:
        ran = {g: _free_switching_as_realized(r, validator, ideal_validator) for g, r in ran.items()}
    results = _charge_candidates(ran, config.granularities)
    results = {g: dataclasses.replace(r, waiting_saved_pct=validator.waiting_saved_pct(r.validated),
                                      saving_pct_waiting_range=validator.waiting_range_saved_pct(r.validated),
                                      switches_per_s=validator.switches_per_s(r.validated))
               for g, r in results.items()}  # fmt: skip
    if results:  # the baseline's readings, which every level is judged against, are paid by the first level shown
        first = next(iter(results))
        results[first] = dataclasses.replace(results[first],
                                             n_measurements=results[first].n_measurements + baseline_cost[0],
                                             search_cost_gpu_s=results[first].search_cost_gpu_s + baseline_cost[1])
    if is_persistent(storage):
        finish_job(storage, prefix)
    n_new = validator.log.n_new + sum(u.n_new_measurements for r in ran.values() for u in r.unit_searches)
    n_stored = validator.log.n_stored + sum(u.n_stored_measurements for r in ran.values() for u in r.unit_searches)
    return SearchResult(trace, backend.spec.name, config.max_slowdown, baseline, results, config.storage, n_new,
                        n_stored_measurements=n_stored, spec=backend.spec, backend_name=backend.name, seed=config.seed,
                        host_wait_pct=validator.host_wait_pct(), confidence=validator.confidence,
                        resumed=resumed)  # fmt: skip
