"""The slowdown budget allocated over all units at once (freqopt.search.allocate's MILP), calibrated by validation.

Units measured alone do not add up exactly to the iteration (the power limit averages power over neighbouring
kernels; measurements are noisy), so the allocator's budget is moved until the validated slowdown meets the limit
(allocate_validated); then the schedule is expressed as a runtime applies it (_as_applied) and the search's own
prediction of it is worked out (predict_schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.budget import first_confirmed
from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Trace
from freqopt.search.allocate import allocate
from freqopt.search.result import GranularityResult
from freqopt.search.study import Option, UnitSearch
from freqopt.search.units import TuningUnit
from freqopt.search.validate import Validator, per_kernel_settings

# Fractions of the slowdown budget the allocator aims at, in turn, where every schedule chosen at the budget's edge
# failed its confirmation (allocate_validated): each costs one validation and one confirmation.
FALLBACK_MARGINS = (0.5, 0.25, 0.0)
# Schedules at most that refine a one-setting level's confirmed setting (refine_one_setting): a bisection over its
# grid between it and the next lower setting its study measured narrows a gap of 31 settings (SM clocks 15 MHz
# apart, whole watts) to one.
REFINE_STEPS = 5

__all__ = ["FALLBACK_MARGINS", "REFINE_STEPS", "Allocation", "allocate_validated", "confirmed", "allocate_applied",
           "candidate_schedules", "coarser_settings", "refine_one_setting", "settings_on"]


@dataclass(frozen=True)
class Allocation:
    """One option per unit and the whole iteration measured with them; ``reason``: why the defaults stand, where
    they do (empty otherwise)."""

    chosen: tuple  # Option per unit
    validated: Measurement
    reason: str = ""


def allocate_validated(
    units: list[TuningUnit], searches: list[UnitSearch], validator: Validator, baseline: Measurement,
    max_slowdown: float, *, rounds: int = 8, candidates: Sequence[Sequence[ClockSetting]] = (), key: str = "schedule",
) -> Allocation:  # fmt: skip
    """The schedule with the least validated energy whose validated slowdown is within ``max_slowdown`` at the
    validator's confidence (the upper confidence bound of its time, Measurement.time_bound_s, within the limit) and
    whose clock switches one runtime thread can issue (Validator.deliverable).

    The allocator's budget starts at (1 + max_slowdown) x the sum of the units' own defaults and is then moved by
    the validated overshoot or slack of that bound (the result's figures are those of fresh readings taken after
    the choice: ``confirmed``): a secant step on validated slowdown, kept inside the bracket of budgets known to
    meet and to break the limit, else bisection. ``candidates``: schedules (one setting per unit, each among its
    unit's options: the coarser granularities' schedules, candidate_schedules) validated before the allocator's,
    so the result is never worse than any of them. Where every choice that met the limit fails its confirmation,
    the allocator aims at FALLBACK_MARGINS of the budget in turn, each choice confirmed once; where none holds, the
    defaults stand and ``reason`` says why. A level of one unit (one setting for the whole step) then refines the
    setting it confirmed (refine_one_setting).
    """
    options = [[(o.time_s, o.energy_j) for o in s.options] for s in searches]
    accepted: list[Allocation] = []  # every allocation whose bound met the limit
    limit_s = (1.0 + max_slowdown) * baseline.time_s

    def evaluate(chosen: tuple) -> float:
        measured = validator.units(units, [o.setting for o in chosen], key, limit_s=limit_s)
        slowdown = measured.time_bound_s / baseline.time_s - 1.0  # its upper confidence bound (Validator)
        if validator.accepts(measured, limit_s, baseline.energy_j):
            accepted.append(Allocation(chosen, measured))
            if slowdown >= max_slowdown - 0.1 * max(max_slowdown, 0.001):  # near the edge: confirm it now, and
                fresh = validator.confirm(measured)  # steer by the fresh readings' bound where they break the limit
                slowdown = max(slowdown, fresh.time_bound_s / baseline.time_s - 1.0)
        return slowdown

    for candidate in candidates:
        evaluate(tuple(next(o for o in s.options if o.setting == setting) for s, setting in zip(searches, candidate)))
    budget = (1.0 + max_slowdown) * sum(s.default.time_s for s in searches)
    meets, breaks = None, None  # largest budget validated within the limit, smallest validated over it
    streak = 0  # rounds in a row on the same side of the limit, before a bracket: each doubles the step
    for _ in range(rounds):
        try:
            picks = allocate(options, budget)
        except InvalidSettingError:  # below the fastest the units can go
            meets = budget
            budget = budget * 1.01 if breaks is None else (budget * breaks) ** 0.5
            continue
        slowdown = evaluate(tuple(s.options[j] for s, j in zip(searches, picks)))
        if max_slowdown - 0.1 * max(max_slowdown, 0.001) <= slowdown <= max_slowdown:
            break  # uses the budget to within a tenth
        if slowdown <= max_slowdown:
            streak = streak + 1 if breaks is None and meets is not None else 1
            meets = budget if meets is None else max(meets, budget)
        else:
            streak = streak + 1 if meets is None and breaks is not None else 1
            breaks = budget if breaks is None else min(breaks, budget)
        # The secant on validated slowdown, taking the whole step's time to move as the units' sum does; where it
        # moves less (a step whose time the units' own measurements over-state), steps double until the limit is
        # bracketed.
        step = budget * ((1.0 + max_slowdown) / (1.0 + slowdown)) ** (2 ** (streak - 1))
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4 * budget:
                break
            if not meets < step < breaks:
                step = (meets * breaks) ** 0.5
        budget = step
    def rebuild(choice: Allocation, confirmation: Measurement) -> Allocation:
        return Allocation(choice.chosen, confirmation)

    # schedule -> (its confirmed slowdown bound, energy_j): each confirmed once (a second chance would spend the
    # confidence)
    tried: dict = {}
    hit = confirmed(accepted, validator, baseline, limit_s, rebuild, tried=tried)
    # Where every choice near the budget's edge failed its confirmation, the allocator is asked again for schedules
    # that aim at a fraction of the budget (FALLBACK_MARGINS), each confirmed in turn: a schedule that saves less
    # but holds the limit on fresh readings beats the defaults.
    base = meets if meets is not None else budget
    for margin in FALLBACK_MARGINS:
        if hit is not None:
            break
        try:
            picks = allocate(options, base * (1.0 + margin * max_slowdown) / (1.0 + max_slowdown))
        except InvalidSettingError:
            continue
        before = len(accepted)
        evaluate(tuple(s.options[j] for s, j in zip(searches, picks)))
        hit = confirmed(accepted[before:], validator, baseline, limit_s, rebuild, tried=tried)
    if hit is not None:
        return refine_one_setting(hit, units, searches, validator, baseline, limit_s, key)
    return Allocation(tuple(s.default for s in searches), baseline,
                      reason=_defaults_reason(tried, validator, baseline, max_slowdown))


def refine_one_setting(hit: Allocation, units: list[TuningUnit], searches: list[UnitSearch], validator: Validator,
                       baseline: Measurement, limit_s: float, key: str) -> Allocation:  # fmt: skip
    """``hit`` refined where the level holds one setting for the whole step (one unit: the iteration level's locked
    SM clock, the power-cap level's power limit): the settings of the level's grid strictly between the one
    confirmed and the next lower one its study measured (supported SM clocks at the same memory clock; whole
    watts), which no measurement has judged, bisected, up to REFINE_STEPS schedules.

    A study measures a dozen or so settings and the allocator picks among them, so the setting confirmed may sit
    several grid steps above the lowest one within the budget, and each step down on a one-setting step saves
    about as much energy as the budget allows (gpt3-small on the simulated H100: 15 MHz near 1900 MHz is 0.2-0.3
    points of energy for 0.1-0.15 % of time). Each setting tried is validated as the allocator's choices are
    (Validator.units, read again where its bound is in doubt) and, where its bound meets ``limit_s`` and it saves
    more than the one it would replace, confirmed once on fresh readings (Validator.confirm): one that holds
    replaces it and the bisection goes lower, one that breaks the limit sends it higher, one that saves no more
    ends it. Returns ``hit`` unchanged where there is nothing to refine.
    """
    if len(units) != 1:
        return hit
    grid = _grid_between(hit.chosen[0].setting, searches[0].options, validator.backend.spec)
    best = hit
    for _ in range(REFINE_STEPS):
        if not grid:
            break
        middle = len(grid) // 2
        measured = validator.units(units, [grid[middle]], key, limit_s=limit_s)
        if measured.energy_j >= best.validated.energy_j:
            break  # lower settings save no more here
        fresh = validator.confirm(measured) if validator.accepts(measured, limit_s, best.validated.energy_j) else None
        if fresh is not None and validator.accepts(fresh, limit_s, best.validated.energy_j, fresh=True):
            best = Allocation((Option(grid[middle], measured.time_s, measured.energy_j, 1),), fresh)
            grid = grid[:middle]
        else:
            grid = grid[middle + 1:]
    return best


def _grid_between(setting: ClockSetting, options, spec) -> list[ClockSetting]:
    """The settings of ``setting``'s grid strictly between the highest of ``options`` below it and it, ascending:
    supported SM clocks at its memory clock for a locked clock, whole watts for a power limit; empty for the
    defaults or where no option is below."""
    if setting.power_limit_w is not None and setting.sm_clock_mhz is None:
        below = [o.setting.power_limit_w for o in options
                 if o.setting.power_limit_w is not None and o.setting.power_limit_w < setting.power_limit_w]
        if not below:
            return []
        return [ClockSetting(power_limit_w=float(w)) for w in range(int(np.floor(max(below))) + 1,
                                                                   int(np.ceil(setting.power_limit_w)))]  # fmt: skip
    if setting.sm_clock_mhz is None or setting.power_limit_w is not None:
        return []
    sm, mem = setting.sm_clock_mhz, setting.mem_clock_mhz
    below = [o.setting.sm_clock_mhz for o in options if o.setting.sm_clock_mhz is not None
             and o.setting.sm_clock_mhz < sm and o.setting.mem_clock_mhz == mem]  # fmt: skip
    if not below:
        return []
    return [ClockSetting(sm_clock_mhz=f, mem_clock_mhz=mem) for f in spec.sm_clocks_mhz
            if max(below) < f < sm and (mem is None or spec.supports(f, mem))]


def _defaults_reason(tried: dict, validator: Validator, baseline: Measurement, max_slowdown: float) -> str:
    """Why a level ends at the defaults, in one sentence for the user."""
    budget = f"{100 * max_slowdown:g} %"
    if not tried:
        return (f"no schedule the studies found saved energy with its slowdown's upper {100 * validator.confidence:g} "
                f"% confidence bound within {budget} (widen the budget, or read the unit studies' fronts)")
    broke = [bound for bound, _ in tried.values() if bound > max_slowdown]
    saved_nothing = sum(1 for bound, energy_j in tried.values() if bound <= max_slowdown
                        and energy_j >= baseline.energy_j)  # fmt: skip
    how = [f"{len(broke)} broke it (slowdown bounds up to {100 * max(broke):+.2f} % at "
           f"{100 * validator.confidence:g} % confidence)"] if broke else []  # fmt: skip
    how += [f"{saved_nothing} saved no energy"] if saved_nothing else []
    return (f"the {len(tried)} schedule(s) that met {budget} on their readings did not hold on fresh confirming "
            f"readings: {' and '.join(how)}; more validation readings (validation_repeats) or a wider budget may "
            f"let one hold")


def confirmed(accepted: Sequence, validator: Validator, baseline: Measurement, limit_s: float, rebuild, *,
              tried: dict | None = None):
    """The accepted choice (each with a ``validated`` Measurement whose bound met ``limit_s``) of least energy
    whose confirmation (Validator.confirm: fresh paired readings, independent of the choice) also meets the limit
    and still saves energy, rebuilt with the confirmation's figures as ``rebuild(choice, confirmation)``; the next
    least where it does not (freqopt.budget.first_confirmed); None where none is confirmed (the defaults then
    stand)."""
    unique: dict = {}  # each schedule once, at its least energy
    for choice in sorted(accepted, key=lambda a: a.validated.energy_j):
        schedule = validator.schedule_of(choice.validated)
        if tried is None or schedule not in tried:
            unique.setdefault(schedule, choice)

    def confirm(choice):
        fresh = validator.confirm(choice.validated)
        if tried is not None:
            schedule = validator.schedule_of(choice.validated)
            tried[schedule] = (fresh.time_bound_s / baseline.time_s - 1.0, fresh.energy_j)
        return fresh

    hit = first_confirmed(unique.values(), confirm,
                          lambda m: validator.accepts(m, limit_s, baseline.energy_j, fresh=True))
    return None if hit is None else rebuild(*hit)


def allocate_applied(
    trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], validator: Validator, baseline: Measurement,
    max_slowdown: float, *, rounds: int, key: str, candidates: Sequence[Sequence[ClockSetting]] = (),
) -> tuple[Allocation, list[ClockSetting], Measurement]:  # fmt: skip
    """allocate_validated, then the schedule as a runtime applies it (_as_applied, validated under KEY-applied).

    Returns:
        The allocation, the per-unit settings for the clock table, and the whole iteration measured with them.
    """
    result = allocate_validated(units, searches, validator, baseline, max_slowdown, rounds=rounds, key=key,
                                candidates=candidates)  # fmt: skip
    settings, validated = _as_applied(trace, units, [o.setting for o in result.chosen], result.validated, validator,
                                      baseline, max_slowdown, key=f"{key}-applied")  # fmt: skip
    return result, settings, validated


def settings_on(trace: Trace, units: list[TuningUnit], settings: Sequence[ClockSetting],
                classes: list[TuningUnit]) -> list[ClockSetting]:  # fmt: skip
    """``settings`` (one per unit of ``units``) laid onto ``classes``, units each inside one of ``units`` (kernel
    classes inside their families): each class takes its unit's setting."""
    if [u.kernel_indices for u in classes] == [u.kernel_indices for u in units]:
        return list(settings)
    per_kernel = per_kernel_settings(trace, zip(units, settings))
    return [per_kernel[u.kernel_indices[0]] for u in classes]


def dominant_settings(per_kernel: Sequence[ClockSetting], units: list[TuningUnit],
                      kernel_time_s: np.ndarray | None = None) -> list[ClockSetting]:  # fmt: skip
    """Per unit, the setting of ``per_kernel`` (one per kernel, shape (K,)) its kernels spend most time in
    (``kernel_time_s``, shape (K,), s; by kernel count without it)."""
    settings = []
    for unit in units:
        weights: dict[ClockSetting, float] = {}
        for i in unit.kernel_indices:
            weights[per_kernel[i]] = weights.get(per_kernel[i], 0.0) + (1.0 if kernel_time_s is None
                                                                         else float(kernel_time_s[i]))  # fmt: skip
        settings.append(max(weights, key=weights.get))
    return settings


def coarser_settings(trace: Trace, coarser: GranularityResult | None, units: list[TuningUnit],
                     kernel_time_s: np.ndarray | None = None) -> list[ClockSetting] | None:  # fmt: skip
    """Per unit, the setting a coarser granularity's schedule (a GranularityResult) gives the unit's kernels: the one
    they spend most time in (dominant_settings). Exact where the coarser units are unions of these (iteration and
    pass under kernel classes); a projection otherwise (phase blocks, whose kernels of one class may sit in blocks
    of different settings). None without a coarser result."""
    if coarser is None:
        return None
    return dominant_settings(per_kernel_settings(trace, coarser.units), units, kernel_time_s)


def candidate_schedules(trace: Trace, coarser: Sequence[GranularityResult], units: list[TuningUnit],
                        baseline: Measurement, kernel_time_s: np.ndarray | None = None) -> list[list[ClockSetting]]:  # fmt: skip
    """The coarser granularities' validated schedules that saved energy, each laid onto ``units``
    (coarser_settings), without repeats: the candidates a finer granularity chooses among beside its allocator's
    schedules, so that it never ends worse than one clock for the iteration, one per pass or one per phase block."""
    out: list[list[ClockSetting]] = []
    for result in coarser:
        if result.validated.energy_j >= baseline.energy_j:
            continue
        settings = [s or DEFAULT_SETTING for s in coarser_settings(trace, result, units, kernel_time_s)]
        if settings not in out:
            out.append(settings)
    return out


def _as_applied(
    trace: Trace, units: list[TuningUnit], settings: list[ClockSetting], validated: Measurement, validator: Validator,
    baseline: Measurement, max_slowdown: float, *, key: str,
) -> tuple[list[ClockSetting], Measurement]:  # fmt: skip
    """The per-unit settings a runtime actually applied, for the clock table.

    With switching costs the runtime realizes a schedule per phase, so some units never run at the setting the
    allocator gave them. The table then holds, per unit, the realized setting its kernels spend most time in, so
    that it says what ran (and transfers what ran); that schedule is validated in turn and kept if it meets the
    budget and still saves energy, else the allocator's settings are kept.
    """
    if not validator.switching:
        return settings, validated
    realized = validator.realize(tuple(per_kernel_settings(trace, zip(units, settings))))
    applied = dominant_settings(realized, units, validator.realize.kernel_time_s)
    if applied == list(settings):
        return settings, validated
    limit_s = (1.0 + max_slowdown) * baseline.time_s
    measured = validator.units(units, applied, key, limit_s=limit_s)
    if validator.accepts(measured, limit_s, baseline.energy_j):
        fresh = validator.confirm(measured)  # its figures from readings taken after it was accepted, as the others'
        if validator.accepts(fresh, limit_s, baseline.energy_j, fresh=True):
            return applied, fresh
    return settings, validated


def predict_schedule(trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], settings: list[ClockSetting],
                chosen: tuple, coarser: Sequence[GranularityResult] = ()) -> tuple[Measurement, Measurement]:  # fmt: skip
    """What the search predicted, before validating it, for the schedule it ends with, and for the default.

    The schedule in the table is not always the allocator's pick: a coarser granularity's schedule may have
    validated better (then its own prediction stands: the same schedule, predicted from coarser units), and the
    runtime realizes settings per phase (then the units' own measurements at the realized settings, where they
    have them, are summed); otherwise the allocator's sum of its picks."""
    baseline = Measurement(sum(s.default.time_s for s in searches), sum(s.default.energy_j for s in searches))
    per_kernel = per_kernel_settings(trace, zip(units, settings))
    for result in coarser:
        if per_kernel == per_kernel_settings(trace, result.units):
            return result.predicted, result.predicted_baseline
    measured = [{o.setting: o for o in s.options} for s in searches]
    if all(setting in options for setting, options in zip(settings, measured)):
        chosen = tuple(options[setting] for setting, options in zip(settings, measured))
    return Measurement(sum(o.time_s for o in chosen), sum(o.energy_j for o in chosen)), baseline
