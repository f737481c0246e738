"""The free-switching figures: what each granularity would save were clock switches free (the papers' figure:
Spaan et al. 2026 switch at no cost), beside the schedule a runtime can realize. The pass and kernel levels search
theirs (FREE_SWITCHING_SEARCHED): their units' settings allocated as if switching were free and validated so; the
others' is their own schedule with free switches (free_switching_as_realized).
"""

from __future__ import annotations

import dataclasses

from freqopt.gpu.backends.base import Backend, ClockSetting, Measurement
from freqopt.workload.kernels import Trace
from freqopt.search.allocation import allocate_validated, candidate_schedules
from freqopt.search.config import SearchConfig
from freqopt.search.result import GranularityResult
from freqopt.search.study import UnitSearch
from freqopt.search.unit_studies import at_job_mem_clock, job_mem_clock_mhz, run_unit_studies, warm_starts
from freqopt.search.units import TuningUnit, search_units
from freqopt.search.validate import Validator, per_kernel_settings

__all__ = ["FREE_SWITCHING_SEARCHED"]


# The levels whose free-switching figure is a search of its own: their units' settings allocated as if switching
# were free and validated so (the papers' figure: Spaan et al. 2026 switch at no cost). The others' is their own
# schedule with free switches (free_switching_as_realized): one setting (power cap, iteration), or the phase
# level's blocks, each block's setting landing as it is asked for.
FREE_SWITCHING_SEARCHED = ("pass", "kernel")


def search_free_switching(trace: Trace, backend: Backend, config: SearchConfig, result: GranularityResult,
                    coarser: list[GranularityResult], ideal_validator: Validator, baseline: Measurement, on_unit,
                    storage) -> GranularityResult:  # fmt: skip
    """``result`` (a level held to one clock: one_clock_reason) with its free-switching figure: the level's units
    searched with the realizable levels' sampler (GridGPSampler; Optuna's TPE costs a fraction of its time but on
    the main job found 4.73 % for the kernel level where the GP finds 14.21 %) and their settings allocated as if
    switching were free, validated so (the main
    job's gpt3-small shows what pass- and kernel-level DVFS would save with free switching beside what a runtime
    can realize). Its measurements are charged to it; its table still holds the iteration level's clock."""
    g = result.granularity
    units = search_units(trace, g, config.share_classes and g == "kernel")
    mem = job_mem_clock_mhz(backend.spec, len(units))
    candidates = [c for c in candidate_schedules(trace, coarser, units, baseline) if at_job_mem_clock(c, mem)]
    offered = candidates + _free_candidates(trace, coarser, units, baseline, mem)  # each studied, so allocatable
    warm = warm_starts(trace, coarser, units, offered)
    before = (ideal_validator.n_measurements, ideal_validator.cost_gpu_s)
    units, searches = run_unit_studies(trace, backend, config, g, storage=storage, warm_start=warm, on_unit=on_unit)
    ideal, ideal_units = free_allocation(trace, units, searches, ideal_validator, baseline, config, g, candidates,
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
    return [c for c in candidate_schedules(trace, free, units, baseline) if at_job_mem_clock(c, mem)]


def free_allocation(trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], ideal_validator: Validator,
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


def at_least_the_coarser_free(result: GranularityResult, coarser: list[GranularityResult]) -> GranularityResult:
    """``result`` with a coarser level's free-switching schedule (a one-setting level's validated one) as its own
    where that validated less energy: the kernel level allocates over families of classes that may span passes, so
    the pass level's free-switching schedule is not always among its allocations, though a per-class schedule
    expresses it (as at_least_the_coarser_schedules does for the realizable figure)."""
    for r in coarser:
        if result.ideal is not None and r.ideal_units and r.ideal.energy_j < result.ideal.energy_j:
            result = dataclasses.replace(result, ideal=r.ideal, ideal_units=r.ideal_units)
        # One setting switches nothing: its free-switching figure is its validated one (free_switching_as_realized),
        # which the free allocation, measuring the same schedule on its own readings, may have read less well.
        elif result.ideal is not None and r.n_settings == 1 and r.validated.energy_j < result.ideal.energy_j:
            result = dataclasses.replace(result, ideal=r.validated, ideal_units=r.units)
    return result


def free_switching_as_realized(result: GranularityResult, validator: Validator,
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
    ideal = ideal_validator.requests(tuple(per_kernel_settings(validator.trace, result.units)), key="phase-ideal")
    return dataclasses.replace(result, ideal=ideal,
                               n_measurements=result.n_measurements + ideal_validator.n_measurements - before[0],
                               search_cost_gpu_s=result.search_cost_gpu_s + ideal_validator.cost_gpu_s - before[1])  # fmt: skip
