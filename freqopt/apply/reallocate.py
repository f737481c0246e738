"""A transferred table's budget re-allocated on the target from the (time, energy) fronts it carries
(freqopt.apply.transfer's module docstring): each target unit measured there, its matched entry's front scaled to it,
unmatched units searched as natively, and the allocation validated on the whole target iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import ClockTableError
from freqopt.apply.transfer_match import UNMATCHED, Match, TransferredSchedule
from freqopt.search.allocation import allocate_applied, candidate_schedules, predict_schedule, settings_on
from freqopt.search.config import SearchConfig
from freqopt.search.result import GranularityResult
from freqopt.search.runner import (at_least_the_coarser_schedules, at_least_the_phase_schedule, one_clock_reason,
                                   one_clock_result, trials_per_unit, unit_slack, warm_starts)  # fmt: skip
from freqopt.search.storage import study_prefix
from freqopt.search.study import Option, UnitSearch
from freqopt.search.units import family_units, kernel_families
from freqopt.search.validate import Validator
from freqopt.search.workers import UnitWork, run_unit
from freqopt.tables import ClockTable

__all__ = ["BACKOFF_STEPS", "backed_off", "has_fronts", "no_fronts_reason", "reallocate", "reallocate_requests"]


def has_fronts(table: ClockTable) -> bool:
    """Whether every entry carries its unit's measured default and front (tables written since fronts were
    added; not phase-level tables)."""
    return all("front" in e and "default" in e for e in table.entries)


def no_fronts_reason(table: ClockTable) -> str:
    """Why ``table``'s budget cannot be re-allocated on a target (one clause; "" where it can: has_fronts).

    A phase-level table is a schedule of requests, laid on as it stands; an iteration-level or power-cap table holds
    one setting for the whole iteration, with nothing to share a budget between; a finer level that its search did
    not search (the table's ``note``: a step shorter than two clock switches keeps the iteration level's clock)
    carries no units' fronts; otherwise an older freqopt wrote it."""
    if has_fronts(table):
        return ""
    if table.is_phase_schedule:
        return "a phase-level table is a schedule of requests, applied as it stands"
    if table.granularity in ("iteration", "power-cap"):
        return f"an {table.granularity}-level table holds one setting for the whole iteration"
    if table.data.get("note"):
        return f"the source's {table.granularity} level holds a coarser schedule, with no units' fronts ({table.data['note']})"
    return "its entries carry no measured fronts (an older freqopt wrote it; search the source again to re-allocate)"


def _with_front(measured: UnitSearch, entry: dict) -> UnitSearch:
    """A target unit's measured options, and the source unit's front scaled to it: each option of ``entry``'s
    front not measured on the target, its time and energy the same multiple of the target's measured default as
    they were of the source's (the ratios carry across layouts, the absolute figures do not)."""
    source, default = entry["default"], measured.default
    t, e = default.time_s / source["time_s"], default.energy_j / source["energy_j"]
    have = {o.setting for o in measured.options}
    scaled = [Option(ClockSetting.of_entry(o), o["time_s"] * t, o["energy_j"] * e, o["n_samples"]) for o in entry["front"]
              if ClockSetting.of_entry(o) not in have]  # fmt: skip
    others = sorted([o for o in measured.options if o.setting != default.setting] + scaled, key=lambda o: o.time_s)
    return dataclasses.replace(measured, options=(default, *others))


def reallocate(schedule: TransferredSchedule, table: ClockTable, backend: Backend, config: SearchConfig,
               validator: Validator, baseline: Measurement, *, coarser: Sequence[GranularityResult] = (),
               storage=None, on_unit=None) -> GranularityResult:  # fmt: skip
    """Re-allocate the budget on the target from the fronts ``table`` carries (module docstring).

    Each target unit is measured alone at its default (1 + ``config.finalist_repeats`` samples) and at the
    ``coarser`` schedules' settings; a unit matched to a table entry is offered, beside these, that entry's front
    scaled to its default (_with_front); an unmatched unit gets a study of its own (``config``'s trials, as a
    native search runs it). Where the target realizes one clock per iteration only (one_clock_reason: its phases
    make a single block of at least one clock switch) and ``coarser`` holds its iteration level, nothing is
    measured: the result is that level's clock, with a note. At kernel level with ``config.share_classes`` the
    units are the target's families of kernel classes (kernel_families), as a native search's are; a family takes
    its first matched class's front, and a study only when none of its classes matched. The allocator's budget is
    then calibrated by validating the whole target iteration
    (allocate_validated; switching costs included when the validator switches), starting from each ``coarser``
    schedule that saved energy, so the result is never worse than any of them, as at a native search's finer
    levels; the schedule is then expressed as a runtime applies it.

    Args:
        schedule: ``table`` laid onto the target (transfer_table).
        table: a table with fronts (has_fronts).
        backend, config: the target GPU; the budget, trial counts and seed.
        validator, baseline: measures the target's whole iterations; its default-settings measurement.
        coarser: the target's validated results at the coarser levels the table's granularity chooses among
            (native_granularities; none for an iteration-level or power-cap table), coarse to fine. Their
            measurements are counted in the result's.
        storage: Optuna storage of the target-side studies (named "PREFIX-transfer-GRANULARITY-...").
        on_unit: called as on_unit("transfer", units_done, units_total) after each unit is measured.

    Returns:
        GranularityResult of the re-allocated schedule; its unit_searches hold each unit's measured and scaled
        options, and its counts every target-side measurement (coarser levels included).

    Raises:
        ClockTableError: ``table`` carries no fronts (its level was not searched, or an older freqopt wrote it).
    """
    if not has_fronts(table):
        raise ClockTableError("this clock table carries no measured fronts (its level was not searched, as on a step "
                              "shorter than two clock switches, or an older freqopt wrote it), so the budget cannot "
                              "be re-allocated on the target; search a longer source step with this freqopt")  # fmt: skip
    trace, granularity = schedule.trace, schedule.granularity
    one_clock = _one_clock_result(schedule, backend, config, validator, coarser)
    if one_clock is not None:
        return one_clock
    classes, units, matches = _target_units(schedule, config)
    kernel_time_s = validator.kernel_time_s if any(r.granularity == "phase" for r in coarser) else None
    candidates = candidate_schedules(trace, coarser, units, baseline, kernel_time_s)
    inherited = warm_starts(trace, list(coarser), units, candidates, kernel_time_s)
    before = (validator.n_measurements, validator.cost_gpu_s)
    searches = _measure_units(schedule, table, backend, config, units, matches, inherited, storage, on_unit)
    result, settings, validated = allocate_applied(
        trace, units, searches, validator, baseline, config.max_slowdown, rounds=config.max_validation_rounds,
        key="transfer", candidates=candidates)  # fmt: skip
    predicted, predicted_baseline = predict_schedule(trace, units, searches, settings, result.chosen, coarser)
    spent = (sum(r.n_measurements for r in coarser), sum(r.search_cost_gpu_s for r in coarser))
    result = GranularityResult(
        granularity=granularity, units=tuple(zip(classes, settings_on(trace, units, settings, classes))),
        searched_units=tuple(units) if units is not classes else (), predicted=predicted,
        predicted_baseline=predicted_baseline, validated=validated,
        n_measurements=spent[0] + sum(s.n_measurements for s in searches) + validator.n_measurements - before[0],
        search_cost_gpu_s=spent[1] + sum(s.cost_gpu_s for s in searches) + validator.cost_gpu_s - before[1],
        unit_searches=tuple(searches),
    )  # fmt: skip
    result = at_least_the_coarser_schedules(trace, result, list(coarser))  # exact where families span passes
    phase = [r for r in coarser if r.granularity == "phase"]  # never worse than the target's phase schedule either
    return at_least_the_phase_schedule(result, phase[0]) if phase else result


def _one_clock_result(schedule: TransferredSchedule, backend: Backend, config: SearchConfig, validator: Validator,
                      coarser: Sequence[GranularityResult]) -> GranularityResult | None:  # fmt: skip
    """As a native search does: where the target realizes one clock only (one_clock_reason) and
    ``coarser`` holds its iteration level, that level's clock at the schedule's granularity, costing what the coarser
    levels cost; None otherwise."""
    trace, granularity = schedule.trace, schedule.granularity
    iteration = next((r for r in coarser if r.granularity == "iteration"), None)
    reason = one_clock_reason(trace, backend, config, validator.kernel_time_s) if validator.switching else ""
    if not (reason and iteration is not None and granularity in ("pass", "kernel", "phase")):
        return None
    result = one_clock_result(trace, iteration, granularity, validator.kernel_time_s, backend.spec.clock_switch_s,
                        config.max_phase_blocks, reason)  # fmt: skip
    return dataclasses.replace(result, n_measurements=sum(r.n_measurements for r in coarser),
                               search_cost_gpu_s=sum(r.search_cost_gpu_s for r in coarser))  # fmt: skip


def _target_units(schedule: TransferredSchedule, config: SearchConfig) -> tuple[list, list, list[Match]]:
    """(the target's tuning units at the schedule's granularity, the units measured, the Match each measured unit
    takes its front from). As a native search does (config.share_classes): at kernel level one unit per family of
    kernel classes (kernel_families), measured as one and offered its first matched class's front (a family's
    classes carry one front in a search's table); otherwise the units are the classes themselves (the same list)."""
    trace, classes = schedule.trace, [m.unit for m in schedule.matches]
    families = [[i] for i in range(len(classes))]
    if schedule.granularity == "kernel" and config.share_classes and len(classes) > 1:
        families = kernel_families(trace, classes)
    units = family_units(trace, classes, families) if len(families) < len(classes) else classes
    matches = [next((schedule.matches[i] for i in f if schedule.matches[i].how != UNMATCHED), schedule.matches[f[0]])
               for f in families]  # fmt: skip
    return classes, units, matches


def _measure_units(schedule: TransferredSchedule, table: ClockTable, backend: Backend, config: SearchConfig,
                   units: list, matches: list[Match], inherited: list, storage,
                   on_unit) -> list[UnitSearch]:  # fmt: skip
    """Each target unit measured on the target, warm-started at the ``inherited`` (coarser) settings: a matched unit
    at its default and those settings (no trials), offered its table entry's front scaled to it (_with_front); an
    unmatched one searched in a study of its own, as natively. on_unit("transfer", done, total) after each."""
    trace, granularity = schedule.trace, schedule.granularity
    space = "power" if granularity == "power-cap" else "clocks"
    # Matched units: their default and the coarser setting (no trials); unmatched ones: a study, as natively.
    work = UnitWork(prefix=study_prefix(trace, backend.spec, config.seed), granularity=f"transfer-{granularity}",
                    space=space, n_trials=0, finalist_repeats=config.finalist_repeats,
                    finalist_slowdown=unit_slack(config.max_slowdown, len(units)), seed=config.seed, spread=False,
                    constrained=len(units) == 1, whole_step=len(units) == 1)  # fmt: skip
    study_work = dataclasses.replace(work, n_trials=trials_per_unit(config, backend, space), spread=True)
    entries = {e["unit"]: e for e in table.entries}
    searches = []
    for done, (unit, match, warm) in enumerate(zip(units, matches, inherited), 1):
        warm_start = [w for w in dict.fromkeys(warm) if w not in (None, DEFAULT_SETTING)]
        if match.how == UNMATCHED:
            searches.append(run_unit(trace, backend, study_work, unit, storage, warm_start))
        else:
            measured = run_unit(trace, backend, work, unit, storage, warm_start)
            searches.append(_with_front(measured, entries[match.source_unit]))
        if on_unit is not None:
            on_unit("transfer", done, len(units))
    return searches


# Validations at most of the back-off's bisection (reallocate_requests), after the table's own clocks: each halves the
# interval of back-off fractions known to hold and to break the budget, so six place the edge within 1/64 of the way
# from the table's clocks to the defaults.
BACKOFF_STEPS = 6


def backed_off(setting: ClockSetting, fraction: float, sm_clocks_mhz: Sequence[int]) -> ClockSetting:
    """``setting`` moved toward the defaults: its SM clock ``fraction`` of the way (0: as it is; 1: the GPU's
    highest, its default) snapped up to the nearest supported clock of ``sm_clocks_mhz`` (ascending, MHz); its
    memory clock and power limit kept. The defaults as they are, and the defaults at ``fraction`` 1."""
    if fraction >= 1.0 or setting == DEFAULT_SETTING or setting.sm_clock_mhz is None:
        return DEFAULT_SETTING if fraction >= 1.0 else setting
    top = sm_clocks_mhz[-1]
    target = setting.sm_clock_mhz + fraction * (top - setting.sm_clock_mhz)
    sm = next(c for c in sm_clocks_mhz if c >= target - 1e-9)
    return dataclasses.replace(setting, sm_clock_mhz=int(sm))


def reallocate_requests(schedule: TransferredSchedule, table: ClockTable, backend: Backend, config: SearchConfig,
                        validator: Validator, baseline: Measurement, *,
                        coarser: Sequence[GranularityResult] = ()) -> GranularityResult:  # fmt: skip
    """A phase schedule of requests (a phase-level table, or a finer level's that ended on phase blocks) fitted to
    the target's budget: the requests kept at their phases, their SM clocks backed off toward the defaults by one
    fraction (backed_off: 0 the table's clocks, 1 the defaults). Such a table carries no units' fronts to re-allocate
    from, and its requests' phases are the target's too, so the budget moves along the one line from the table's
    clocks to the defaults: the table's own first, then bisection on the fraction (BACKOFF_STEPS validations of the
    whole target iteration, measured as requested, each held to the budget at the validator's confidence and
    required to save energy and be deliverable), then the least-energy fractions that held confirmed on fresh
    readings (freqopt.search.allocation.confirmed). Where none holds, the defaults stand, with a note. The target's
    iteration level (``coarser``) is kept instead where its one clock validated less energy, laid on as the same
    requests, and its own phase schedule where that validated less still (never worse than the target's coarser
    levels, as reallocate is); the coarser levels' measurements are counted in the result's.

    Args:
        schedule: ``table`` laid onto the target (transfer_table: granularity "phase").
        table: the phase schedule (ClockTable.is_phase_schedule).
        backend, config: the target GPU; the budget.
        validator, baseline: measures the target's whole iterations; its default-settings measurement.
        coarser: the target's validated results at the coarser levels (native_granularities).

    Returns:
        GranularityResult at granularity "phase", one unit per table entry with its ``requests``, its note saying
        the fraction backed off.

    Raises:
        ClockTableError: ``table`` is not a phase schedule.
    """
    from freqopt.search.allocation import Allocation, confirmed

    if not table.is_phase_schedule:
        raise ClockTableError("reallocate_requests takes a phase schedule of requests; re-allocate a table with "
                              "fronts with reallocate")  # fmt: skip
    clocks = sorted(backend.spec.sm_clocks_mhz)
    limit_s = (1.0 + config.max_slowdown) * baseline.time_s
    before = (validator.n_measurements, validator.cost_gpu_s)
    accepted: list[Allocation] = []

    def per_kernel(fraction: float) -> tuple[ClockSetting, ...]:
        settings = [DEFAULT_SETTING] * len(schedule.trace)
        for m in schedule.matches:
            for i in m.unit.kernel_indices:
                settings[i] = backed_off(m.setting, fraction, clocks)
        return tuple(settings)

    def holds(fraction: float) -> bool:
        measured = validator.requests(per_kernel(fraction), key=f"transfer-backoff-{fraction:.4f}", limit_s=limit_s)
        ok = validator.accepts(measured, limit_s, baseline.energy_j)
        if ok:
            accepted.append(Allocation(fraction, measured))
        return ok

    if not holds(0.0):
        holding, breaking = 1.0, 0.0  # backed off this far holds (the defaults, trivially); this far does not
        for _ in range(BACKOFF_STEPS):
            mid = 0.5 * (holding + breaking)
            if holds(mid):
                holding = mid
            else:
                breaking = mid
    hit = confirmed(accepted, validator, baseline, limit_s, lambda a, m: Allocation(a.chosen, m))
    fraction, validated = (hit.chosen, hit.validated) if hit is not None else (1.0, baseline)
    note = (f"the table's requests, their SM clocks backed off {100 * fraction:.1f} % of the way to the defaults"
            if hit is not None else "no backed-off schedule held the budget and saved energy: the defaults stand")
    labels = tuple(e["request_phase"] for e in table.entries)
    # The least validated energy of: the backed-off requests, the target's one clock laid on as the same requests,
    # and the target's own phase schedule (in that order where they tie).
    choices = [GranularityResult(
        granularity="phase", units=tuple((m.unit, backed_off(m.setting, fraction, clocks)) for m in schedule.matches),
        predicted=validated, predicted_baseline=baseline, validated=validated, n_measurements=0, search_cost_gpu_s=0.0,
        requests=labels, note=note)]  # fmt: skip
    for r in coarser:
        if r.granularity == "iteration":
            choices.append(dataclasses.replace(
                choices[0], units=tuple((m.unit, r.units[0][1]) for m in schedule.matches), predicted=r.validated,
                validated=r.validated, note="the target's iteration level's one clock, which validated less energy "
                                            "than the table's requests backed off toward the defaults"))  # fmt: skip
        elif r.granularity == "phase" and r.requests:
            choices.append(dataclasses.replace(
                r, note="the target's own phase schedule, which validated less energy than the table's requests "
                        "backed off toward the defaults"))  # fmt: skip
    best = min(choices, key=lambda r: r.validated.energy_j)
    return dataclasses.replace(
        best, n_measurements=sum(r.n_measurements for r in coarser) + validator.n_measurements - before[0],
        search_cost_gpu_s=sum(r.search_cost_gpu_s for r in coarser) + validator.cost_gpu_s - before[1])  # fmt: skip
