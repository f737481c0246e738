"""The search, end to end, for one trace on one backend.

For each granularity: partition the trace into tuning units, run each unit's study (run_unit_studies), allocate
the slowdown budget over all units at once (MILP), and validate by measuring the whole iteration with the chosen
schedule (allocate_validated). Units measured alone do not add up exactly to the iteration (the power limit
averages power over neighbouring kernels; measurements are noisy), so the allocator's budget is calibrated by
validation until the validated slowdown meets the limit (freqopt.search.allocation).

This module drives the search (run_search, one granularity after another, each finer one never ending worse than
the coarser ones it chose among); each granularity's unit studies (freqopt.search.unit_studies), the
free-switching figures (freqopt.search.free_switching), the configuration, the result types, the storage,
validation and allocation live in their own modules of freqopt.search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from freqopt.gpu.backends.base import Backend, DEFAULT_SETTING, Measurement
from freqopt.workload.kernels import Trace
from freqopt.workload.phases import phase_spans
from freqopt.search.allocation import (Allocation, allocate_applied, allocate_validated, candidate_schedules,
                                       coarser_settings, predict_schedule, settings_on)
from freqopt.search.config import SearchConfig
from freqopt.search.free_switching import (FREE_SWITCHING_SEARCHED, at_least_the_coarser_free, free_allocation,
                                           free_switching_as_realized, search_free_switching)
from freqopt.search.result import GranularityResult, SearchResult
from freqopt.search.schedule import phase_blocks, request_schedule, search_phase_schedule
from freqopt.search.storage import open_storage, study_prefix, validation_log
from freqopt.search.unit_studies import (at_job_mem_clock, job_mem_clock_mhz, run_unit_studies, trials_per_unit,
                                         unit_slack, warm_starts)
from freqopt.search.units import GRANULARITIES, partition, search_units
from freqopt.search.validate import Validator, per_kernel_settings
from freqopt.search.workers import finish_job, is_persistent, publish_job

# The names below live in the modules of their jobs (config, result, storage, validate, allocation, unit_studies,
# free_switching); they are re-exported here, where callers have always imported them from (freqopt.apply.transfer
# shares the unit studies' unit_slack).
__all__ = ["SearchConfig", "GranularityResult", "SearchResult", "run_search", "levels_to_run", "study_prefix",
           "open_storage", "run_unit_studies", "Validator", "validation_log", "Allocation", "allocate_validated",
           "job_mem_clock_mhz", "FREE_SWITCHING_SEARCHED", "unit_slack"]


# The coarser schedules each clock granularity chooses among beside its own allocation: one clock
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


def at_least_the_coarser_schedules(trace: Trace, result: GranularityResult,
                                    coarser: list[GranularityResult]) -> GranularityResult:  # fmt: skip
    """``result`` (a finer level's), or the iteration or pass level's schedule where that validated less energy.

    Those schedules are exact on kernel classes (a class lies in one pass), but the kernel level allocates over
    families of classes, which may span passes, so its candidates are their projections onto the
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
                                         requests=(), note=_not_at_the_default(result.note))  # fmt: skip
    return result


def at_least_the_phase_schedule(result: GranularityResult, phase: GranularityResult) -> GranularityResult:
    """``result`` (a finer level's), or the phase level's schedule where that validated less energy: one setting
    per phase block, requested at its phase, is a schedule a per-kernel-class table cannot always express (a class
    may run in blocks of different settings), so the level ends on it as it stands, with the phase level's
    prediction and requests (its table is then a phase schedule: ClockTable.is_phase_schedule). Both met the
    budget when validated; the level keeps its own measurements, studies and free-switching ideal."""
    if phase.validated.energy_j >= result.validated.energy_j:
        return result
    return dataclasses.replace(result, units=phase.units, predicted=phase.predicted,
                               predicted_baseline=phase.predicted_baseline, validated=phase.validated,
                               requests=phase.requests, note=_not_at_the_default(result.note))  # fmt: skip


def _not_at_the_default(note: str) -> str:
    """A level's note once it ends on another level's schedule: its "ended at the default" no longer holds."""
    return "" if note.startswith("ended at the default") else note


def _predicted_as_it_runs(result: GranularityResult, coarser: list[GranularityResult],
                          validator: Validator) -> GranularityResult:  # fmt: skip
    """``result`` with the prediction of the coarser level whose schedule it runs as, where it does.

    With switching costs a runtime realizes a finer level's per-unit settings per phase; the schedule that then
    runs (the validator's realized requests, Validator.schedule_of) may be exactly a coarser level's, as the main
    job's gpt3-xl kernel level on the H100 runs the phase level's two blocks. Its validated figure is then that
    schedule's, and so is the prediction shown beside it (the units' sum of the per-unit settings, 6.92 % there,
    predicted free switching, not what ran), with a note saying so. Where it runs as another
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
    settings = model.settings_of(validator.realize(tuple(per_kernel_settings(validator.trace, result.units))))
    if settings is None or request_schedule(validator.trace, model.blocks, settings) != ran:
        return result
    predicted = model.predict(settings)
    if predicted is None:
        return result
    return dataclasses.replace(result, predicted=predicted, predicted_baseline=phase.predicted_baseline,
                               note="runs as one setting per phase block once a runtime realizes its settings per "
                                    "phase, so the phase level's block model predicts it")  # fmt: skip




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
                  if at_job_mem_clock(c, mem)]  # a coarser schedule at another memory clock: not this level's  # fmt: skip
    warm = warm_starts(trace, coarser, units, candidates, kernel_time_s)
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
        ideal, ideal_units = free_allocation(trace, units, searches, ideal_validator, baseline, config, granularity,
                                              candidates, coarser, mem)  # fmt: skip
    predicted, predicted_baseline = predict_schedule(trace, units, searches, settings, result.chosen, coarser)
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
        note=f"ended at the default: {result.reason}" if result.reason else "",
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
        n_trials=trials_per_unit(config, backend, "clocks", mem is None),
        finalist_repeats=config.phase_finalist_repeats,
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
        note="" if any(s != DEFAULT_SETTING for s in r.settings) else (
            f"ended at the default: no phase schedule held the {100 * config.max_slowdown:g} % budget at "
            f"{100 * validator.confidence:g} % confidence on fresh confirming readings and saved energy"),
    )  # fmt: skip


def one_clock_reason(trace: Trace, backend: Backend, config: SearchConfig, kernel_time_s) -> str:
    """Why no schedule finer than one clock per iteration can be realized, or "" where one can.

    A runtime switching clocks pays the GPU's clock-switch latency for each change; phase_blocks makes a single
    block of an iteration shorter than two latencies, or of one whose passes hold no two runs of phases at least
    one latency long each (freqopt.search.schedule), and then the pass, kernel and phase levels could only ever
    realize the iteration level's one clock: their studies could not move the result, so they are not measured.

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


def one_clock_result(trace: Trace, iteration: GranularityResult, granularity: str, kernel_time_s, switch_s: float,
                     max_blocks: int, reason: str) -> GranularityResult:  # fmt: skip
    """The iteration level's schedule as ``granularity``'s result, unmeasured (one_clock_reason): each of the
    level's units (the phase level's one block, asked for at its phase) at the iteration's setting, noted "held to
    one clock: REASON" (its free-switching figure, where FREE_SWITCHING_SEARCHED, is searched after:
    search_free_switching)."""
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
    ran = _search_levels(trace, backend, config, validator, ideal_validator, baseline, on_unit, storage)
    results = _as_shown(ran, config, validator, baseline_cost)
    if is_persistent(storage):
        finish_job(storage, prefix)
    n_new = validator.log.n_new + sum(u.n_new_measurements for r in ran.values() for u in r.unit_searches)
    n_stored = validator.log.n_stored + sum(u.n_stored_measurements for r in ran.values() for u in r.unit_searches)
    return SearchResult(trace, backend.spec.name, config.max_slowdown, baseline, results, config.storage, n_new,
                        n_stored_measurements=n_stored, spec=backend.spec, backend_name=backend.name, seed=config.seed,
                        host_wait_pct=validator.host_wait_pct(), confidence=validator.confidence,
                        resumed=resumed)  # fmt: skip


def _search_levels(trace: Trace, backend: Backend, config: SearchConfig, validator: Validator,
                   ideal_validator: Validator | None, baseline: Measurement, on_unit,
                   storage) -> dict[str, GranularityResult]:  # fmt: skip
    """Every level the search runs (levels_to_run), coarse to fine: each finer clock level starting from the
    coarser ones it chooses among (CANDIDATES) and never ending worse than them; where one clock is all a runtime
    can realize (one_clock_reason), the finer levels held to the iteration level's clock. With ``ideal_validator``
    (switching costs in the validation), each level's free-switching figure too (freqopt.search.free_switching).

    Returns:
        granularity -> its result, in the order run.
    """
    ran: dict[str, GranularityResult] = {}
    one_clock = one_clock_reason(trace, backend, config, validator.kernel_time_s) if validator.switching else ""
    for g in levels_to_run(config.granularities, validator.switching):
        if one_clock and g in ("pass", "kernel", "phase") and "iteration" in ran:
            ran[g] = one_clock_result(trace, ran["iteration"], g, validator.kernel_time_s,
                                      backend.spec.clock_switch_s, config.max_phase_blocks, one_clock)  # fmt: skip
            if ideal_validator is not None and g in FREE_SWITCHING_SEARCHED:
                coarser = [ran[c] for c in CANDIDATES[g] if c in ran and c != "phase"]
                ran[g] = search_free_switching(trace, backend, config, ran[g], coarser, ideal_validator, baseline,
                                               on_unit, storage)  # fmt: skip
                ran[g] = at_least_the_coarser_free(ran[g], coarser)
        elif g == "phase":
            ran[g] = _search_phase(trace, backend, config, validator, baseline, on_unit, ran.get("iteration"), storage)
        elif g == "power-cap":
            ran[g] = _search_granularity(trace, backend, config, g, validator, baseline, on_unit, [], storage)
        else:
            coarser = [ran[c] for c in CANDIDATES[g] if c in ran and (c != "phase" or validator.switching)]
            ran[g] = _search_granularity(trace, backend, config, g, validator, baseline, on_unit, coarser, storage,
                                         ideal_validator if g in FREE_SWITCHING_SEARCHED else None)  # fmt: skip
            ran[g] = at_least_the_coarser_schedules(trace, ran[g], coarser)
            if "phase" in (r.granularity for r in coarser):
                ran[g] = at_least_the_phase_schedule(ran[g], ran["phase"])
            ran[g] = _predicted_as_it_runs(ran[g], coarser, validator)
            ran[g] = at_least_the_coarser_free(ran[g], coarser)
    if ideal_validator is not None:
        ran = {g: free_switching_as_realized(r, validator, ideal_validator) for g, r in ran.items()}
    return ran


def _as_shown(ran: dict[str, GranularityResult], config: SearchConfig, validator: Validator,
              baseline_cost: tuple[int, float]) -> dict[str, GranularityResult]:  # fmt: skip
    """The results of the levels asked for (_charge_candidates), each with the validator's waiting and switching
    figures; the first shown is charged with the baseline's readings, ``baseline_cost`` (measurements, GPU-s)."""
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
    return results

