"""The calibration of a pipeline plan's budget on the validated iteration (freqopt.pipeline.search's module
docstring): the planner's deadline moved by the validated slowdown until the realized plan uses the budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from freqopt.budget import first_confirmed
from freqopt.errors import FreqoptError
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.validate import PipelineValidator, Validated

__all__ = ["Candidate", "Calibrated", "calibrated"]


class Candidate(NamedTuple):
    """A schedule already validated that a calibration keeps where it wins (another level's result).

    Attributes:
        planned: per instruction, the SM clock (MHz; None: the default) it was planned to run at.
        requests: per instruction, the SM clock (MHz; None: the default) the runtime asks for at its start.
        validated: its Validated measurement.
        plan: its PipelinePlan, where it has one (the stage level's), else None.
    """

    planned: tuple[int | None, ...]
    requests: tuple[int | None, ...]
    validated: Validated
    plan: PipelinePlan | None = None


class Calibrated(NamedTuple):
    """A calibration's outcome: the plan (None where a candidate without one or the defaults won), the requests
    that were validated, their Validated figures (from the confirmation's fresh readings; the baseline where nothing
    beat it) and the planned clocks, per instruction."""

    plan: PipelinePlan | None
    requests: tuple[int | None, ...]
    validated: Validated
    planned: tuple[int | None, ...]


class _Accepted(NamedTuple):
    """A schedule whose upper confidence bound met the limit, with the switching it was measured with."""

    plan: PipelinePlan | None
    requests: tuple[int | None, ...]
    validated: Validated
    planned: tuple[int | None, ...]
    switching: bool


def calibrated(planner: PipelinePlanner, realize: Callable, validator: PipelineValidator, baseline: Validated,
               max_slowdown: float, rounds: int, candidates: Sequence[Candidate], *, key: str, switching: bool = True,
               plan_with: Callable | None = None) -> Calibrated:
    """The planner's plan whose realized schedule has the least validated energy within ``max_slowdown`` (the upper
    confidence bound of its time, confirmed on fresh readings: PipelineValidator.confirm) and whose busiest GPU's
    clock switches one runtime thread can issue (GPUSpec.max_switches_per_s), its
    budget (relative to the planner's fastest plan) moved by the validated slowdown: a secant step, kept inside the
    bracket of budgets known to meet and to break the limit, else their geometric mean (as
    freqopt.search.allocation.allocate_validated). ``candidates``: schedules already measured, kept when they win
    (a candidate's plan, where it carries one, is returned as the plan). ``plan_with(max_slowdown=...)`` plans
    (default planner.plan; the stage level's planner.plan_stage_clocks).

    Returns:
        A Calibrated: its plan None where a candidate without one or the defaults won.
    """
    b = max_slowdown
    fastest = planner.fastest()
    limit_s = baseline.time_s * (1.0 + b)
    accepted: list[_Accepted] = []  # every schedule whose bound met the limit

    spec = validator.pipeline.spec

    def consider(plan, requests, v, planned, switched) -> None:
        deliverable = not spec.over_switch_limit(v.switches_per_s)  # one runtime thread per GPU can issue them
        if v.time_bound_s <= limit_s and v.energy_j < baseline.energy_j and deliverable:
            accepted.append(_Accepted(plan, requests, v, planned, switched))

    for c in candidates:  # a candidate may carry its plan (the stage level's)
        consider(c.plan, c.requests, c.validated, c.planned, True)
    target = b * baseline.time_s / fastest.time_s  # the same seconds of slack on the planner's own (shorter) time
    meets, breaks = None, None
    for _ in range(rounds):
        try:
            plan = (plan_with or planner.plan)(max_slowdown=min(max(target, 0.0), 0.999))
        except FreqoptError:  # no plan at this budget (a solve stopped at a limit without one): nothing is learnt
            # about the limit here, so the bracket stays as it is (it is not a budget met), and
            # a looser budget is tried next, toward the one known to break the limit where there is one
            target = target * 1.5 + 1e-4 if breaks is None else math.sqrt((1.0 + target) * (1.0 + breaks)) - 1.0
            continue
        requests = realize(plan)
        v = validator(requests, switching=switching, key=key, limit_s=limit_s)
        consider(plan, requests, v, tuple(int(c) for c in plan.sm_clock_mhz), switching)
        slowdown = v.time_bound_s / baseline.time_s - 1.0  # its upper confidence bound
        if b - 0.1 * max(b, 0.001) <= slowdown <= b and v.energy_j < baseline.energy_j:  # near the edge: its fresh
            fresh = validator.confirm(requests, switching=switching, key=key)  # readings' bound too
            slowdown = max(slowdown, fresh.time_bound_s / baseline.time_s - 1.0)
        if b - 0.1 * max(b, 0.001) <= slowdown <= b:
            break  # uses the budget to within a tenth
        if slowdown <= b:
            meets = target if meets is None else max(meets, target)
        else:
            breaks = target if breaks is None else min(breaks, target)
        step = (1.0 + target) * (1.0 + b) / (1.0 + slowdown) - 1.0
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4:
                break
            if not meets < step < breaks:
                step = math.sqrt((1.0 + meets) * (1.0 + breaks)) - 1.0
        target = max(step, 0.0)
    # The least energy among them chosen on its own readings is partly luck (the winner's curse): confirmed on fresh
    # readings, least energy first, as the one-GPU levels are (freqopt.search.allocation.confirmed).
    unique = sorted({(a.requests, a.switching): a for a in accepted}.values(), key=lambda a: a.validated.energy_j)
    hit = first_confirmed(unique, lambda a: validator.confirm(a.requests, switching=a.switching, key=key),
                          lambda m: m.time_bound_s <= limit_s and m.energy_j < baseline.energy_j)
    if hit is None:
        return Calibrated(None, (None,) * planner.dag.n, baseline, (None,) * planner.dag.n)
    chosen, fresh = hit
    return Calibrated(chosen.plan, chosen.requests, fresh, chosen.planned)
