"""The slowdown budget allocated over all units at once (freqopt.search.allocate's MILP), calibrated by validation.

Units measured alone do not add up exactly to the iteration (the power limit averages power over neighbouring
kernels; measurements are noisy), so the allocator's budget is moved until the validated slowdown meets the limit
(allocate_validated); then the schedule is expressed as a runtime applies it (_as_applied) and the search's own
prediction of it is worked out (_prediction).
"""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.backends.base import DEFAULT_SETTING, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.kernels import Trace
from freqopt.search.allocate import allocate
from freqopt.search.result import GranularityResult
from freqopt.search.study import UnitSearch
from freqopt.search.units import TuningUnit
from freqopt.search.validate import Validator, _per_kernel_settings

__all__ = ["Allocation", "allocate_validated", "allocate_applied"]


@dataclass(frozen=True)
class Allocation:
    """One option per unit and the whole iteration measured with them."""

    chosen: tuple  # Option per unit
    validated: Measurement


def allocate_validated(
    units: list[TuningUnit], searches: list[UnitSearch], validator: Validator, baseline: Measurement,
    max_slowdown: float, *, rounds: int = 8, first: list[ClockSetting] | None = None, key: str = "schedule",
) -> Allocation:  # fmt: skip
    """The schedule with the least validated energy whose validated slowdown is within ``max_slowdown``.

    The allocator's budget starts at (1 + max_slowdown) x the sum of the units' own defaults and is then moved by
    the validated overshoot or slack: a secant step on validated slowdown, kept inside the bracket of budgets known
    to meet and to break the limit, else bisection. ``first``: a schedule (one setting per unit, each among its
    unit's options) validated before the allocator's, so the result is never worse than it.
    """
    options = [[(o.time_s, o.energy_j) for o in s.options] for s in searches]
    best = Allocation(tuple(s.default for s in searches), baseline)  # the defaults meet any budget

    def evaluate(chosen: tuple) -> float:
        nonlocal best
        measured = validator.units(units, [o.setting for o in chosen], key)
        slowdown = measured.time_s / baseline.time_s - 1.0
        if slowdown <= max_slowdown and measured.energy_j < best.validated.energy_j:
            best = Allocation(chosen, measured)
        return slowdown

    if first is not None:
        evaluate(tuple(next(o for o in s.options if o.setting == setting) for s, setting in zip(searches, first)))
    budget = (1.0 + max_slowdown) * sum(s.default.time_s for s in searches)
    meets, breaks = None, None  # largest budget validated within the limit, smallest validated over it
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
            meets = budget if meets is None else max(meets, budget)
        else:
            breaks = budget if breaks is None else min(breaks, budget)
        step = budget * (1.0 + max_slowdown) / (1.0 + slowdown)
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4 * budget:
                break
            if not meets < step < breaks:
                step = (meets * breaks) ** 0.5
        budget = step
    return best


def allocate_applied(
    trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], validator: Validator, baseline: Measurement,
    max_slowdown: float, *, rounds: int, key: str, first: list[ClockSetting] | None,
) -> tuple[Allocation, list[ClockSetting], Measurement]:  # fmt: skip
    """allocate_validated, then the schedule as a runtime applies it (_as_applied, validated under KEY-applied).

    Returns:
        The allocation, the per-unit settings for the clock table, and the whole iteration measured with them.
    """
    result = allocate_validated(units, searches, validator, baseline, max_slowdown, rounds=rounds, key=key,
                                first=first)  # fmt: skip
    settings, validated = _as_applied(trace, units, [o.setting for o in result.chosen], result.validated, validator,
                                      baseline, max_slowdown, key=f"{key}-applied")  # fmt: skip
    return result, settings, validated


def coarser_settings(trace: Trace, coarser, units: list[TuningUnit]) -> list[ClockSetting] | None:
    """Per unit, the setting a coarser granularity's schedule (a GranularityResult) gives the unit's first kernel;
    None without one."""
    if coarser is None:
        return None
    per_kernel = _per_kernel_settings(trace, coarser.units)
    return [per_kernel[u.kernel_indices[0]] for u in units]


def first_candidate(inherited: list[ClockSetting] | None, coarser, baseline: Measurement) -> list[ClockSetting] | None:
    """The coarser schedule (``inherited``, per unit) as the allocator's first candidate, when it saved energy, so a
    finer granularity never ends worse than a coarser one; None otherwise."""
    if coarser is None or coarser.validated.energy_j >= baseline.energy_j:
        return None
    return [s or DEFAULT_SETTING for s in inherited]


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
    realized = validator.realize(tuple(_per_kernel_settings(trace, zip(units, settings))))
    kernel_time_s = validator.realize.kernel_time_s
    applied = []
    for unit in units:
        weights: dict[ClockSetting, float] = {}
        for i in unit.kernel_indices:
            weights[realized[i]] = weights.get(realized[i], 0.0) + float(kernel_time_s[i])
        applied.append(max(weights, key=weights.get))
    if applied == list(settings):
        return settings, validated
    measured = validator.units(units, applied, key)
    if measured.time_s / baseline.time_s - 1.0 <= max_slowdown and measured.energy_j < baseline.energy_j:
        return applied, measured
    return settings, validated


def _prediction(trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], settings: list[ClockSetting],
                chosen: tuple, coarser: GranularityResult | None) -> tuple[Measurement, Measurement]:  # fmt: skip
    """What the search predicted, before validating it, for the schedule it ends with, and for the default.

    The schedule in the table is not always the allocator's pick: the coarser granularity's schedule may have
    validated better (then its own prediction stands: the same schedule, predicted from coarser units), and the
    runtime realizes settings per phase (then the units' own measurements at the realized settings, where they
    have them, are summed); otherwise the allocator's sum of its picks."""
    baseline = Measurement(sum(s.default.time_s for s in searches), sum(s.default.energy_j for s in searches))
    if coarser is not None and (_per_kernel_settings(trace, zip(units, settings))
                                == _per_kernel_settings(trace, coarser.units)):  # fmt: skip
        return coarser.predicted, coarser.predicted_baseline
    measured = [{o.setting: o for o in s.options} for s in searches]
    if all(setting in options for setting, options in zip(settings, measured)):
        chosen = tuple(options[setting] for setting, options in zip(settings, measured))
    return Measurement(sum(o.time_s for o in chosen), sum(o.energy_j for o in chosen)), baseline
