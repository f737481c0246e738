"""The pipeline planner's iteration time-energy frontier (PipelinePlanner.frontier; freqopt.pipeline.planner).

Every distinct plan from the fastest to the least-energy one: the deadline at
the fastest time, then the slowest plan's time (its plan is the least-energy plan; no deadline past its time is
solved), then, between any two solved deadlines whose best plans' energies, or whose LP bounds, differ by more
than ``energy_step`` (default FRONTIER_ENERGY_STEP, 0.1 %), their midpoint, to a time resolution of
_FRONTIER_TIME_RESOLUTION of the fastest time. The bounds' rule refines where the optimum itself falls steeply
though the plans found there are flat (a stretch of poor plans hides from the energies' rule): on BLOOM/A100 at
M = 96 (`freqopt plan --json`) it took 520 deadlines instead of 483, the proven gap went from 0.51 % to 0.34 %, and
the staircase's worst point against Perseus's plans from +0.24 % to +0.09 % (experiments/perseus/report.md).
Each deadline is one hot-started LP, its round-down, the best plan already found within it and the
next slower plan repaired down to it (steps 1-2, no MILP): the LP moves little between neighbouring deadlines, and
a neighbour's plan is often the best start (on BLOOM/A100 at M = 12 the round-down was best at half the deadlines,
a neighbour's plan at the other half; the error diffusion at 6 %, for most of the time). The points are the
staircase of the plans found: each strictly cheaper than every faster one. Its proven gap bounds how far the
staircase lies above the optimum at every time (PipelineFrontier.proven_gap). Measured beside Perseus itself on
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.pipeline.plan import FrontierPoint, PipelineFrontier, PipelinePlan
from freqopt.pipeline.profile import check_number


class FrontierPlanner(Protocol):
    """What the sweep asks of the planner whose deadlines it sweeps (freqopt.pipeline.planner.PipelinePlanner, which
    hands itself to sweep_frontier): its fastest plan, the deadline past which no plan saves more, and a plan at
    one deadline from the hull LP, warm-started from a plan's option indices (shape (N,)) and the ``extra`` ones."""

    def fastest(self) -> PipelinePlan: ...

    def slowest_time_s(self) -> float: ...

    def solve_deadline(self, deadline_s: float, fastest: PipelinePlan, warm_start: np.ndarray | None = None, *,
                       polish: bool = True, extra: Sequence[np.ndarray] = ()) -> tuple[PipelinePlan, np.ndarray]: ...

__all__ = ["FRONTIER_ENERGY_STEP", "sweep_frontier"]

# The whole frontier's resolution: deadlines between two plans are searched while their energies differ by more
# than this fraction (module docstring).
FRONTIER_ENERGY_STEP = 1e-3
# The whole frontier's time resolution, a fraction of the fastest plan's time: no two deadlines closer than this.
_FRONTIER_TIME_RESOLUTION = 1e-5


def sweep_frontier(planner: FrontierPlanner, n_points: int | None = None, *,
                   deadlines_s: Sequence[float] | None = None,
                   energy_step: float = FRONTIER_ENERGY_STEP) -> PipelineFrontier:  # fmt: skip
    """PipelinePlanner.frontier (its docstring says what the arguments and the result are)."""
    if n_points is not None and deadlines_s is not None:
        raise InvalidSettingError("n_points and deadlines_s are both given; give one", argument="n_points")
    check_number("energy_step", energy_step, minimum=0.0, strict=True)
    started = _time.perf_counter()
    fastest = planner.fastest()
    sweep = _Sweep(planner, fastest)
    if deadlines_s is not None or n_points is not None:
        if deadlines_s is None:
            check_positive_int("n_points", n_points)
            end = sweep.solve(planner.slowest_time_s())
            deadlines_s = [fastest.time_s] if n_points == 1 else \
                list(np.linspace(fastest.time_s, end.time_s, n_points))  # fmt: skip
        points = []
        for deadline in sorted(float(d) for d in deadlines_s):
            if deadline < fastest.time_s * (1 - 1e-12):
                raise InvalidSettingError(f"deadlines_s has {deadline:.6g} s, below the fastest plan's "
                                          f"{fastest.time_s:.6g} s; no plan meets it", argument="deadlines_s")  # fmt: skip
            sweep.solve(max(deadline, fastest.time_s))
            best = sweep.best_within(deadline)
            points.append(FrontierPoint(time_s=best.time_s, energy_j=best.energy_j,
                                        lower_bound_j=sweep.bound_at(deadline), deadline_s=deadline,
                                        sm_clock_mhz=best.sm_clock_mhz))  # fmt: skip
    else:
        sweep.whole(energy_step)
        points = sweep.staircase()
    return PipelineFrontier(points=tuple(points), proven_gap=sweep.proven_gap(), solves=len(sweep.solved),
                            solve_s=_time.perf_counter() - started)  # fmt: skip


class _Found(NamedTuple):
    """A plan the sweep found, with its option indices (shape (N,); freqopt.pipeline.heuristics)."""

    plan: PipelinePlan
    choice: np.ndarray


class _Sweep:
    """The frontier's deadlines and the plans found at them (PipelinePlanner.frontier; module docstring)."""

    def __init__(self, planner: FrontierPlanner, fastest: PipelinePlan) -> None:
        self.planner, self.fastest = planner, fastest
        self.plans: list[_Found] = []  # every plan found, with its option indices
        self.solved: dict[float, float] = {}  # deadline (s) -> the hull LP's optimum there (J)

    def best_within(self, deadline_s: float, *, with_choice: bool = False):
        """The least-energy plan found whose time is at most deadline_s (None if none)."""
        best = None
        for plan, choice in self.plans:
            if plan.time_s <= deadline_s * (1 + 1e-12) and (best is None or plan.energy_j < best.plan.energy_j):
                best = _Found(plan, choice)
        return best if with_choice else (best.plan if best else None)

    def bound_at(self, deadline_s: float) -> float:
        """The best proven lower bound at deadline_s: the LP's optimum at the smallest solved deadline >= it."""
        later = [d for d in self.solved if d >= deadline_s * (1 - 1e-12)]
        return self.solved[min(later)] if later else -math.inf

    def solve(self, deadline_s: float) -> PipelinePlan:
        """Plan at deadline_s from the LP, the best plan already within it, and the next slower plan repaired."""
        found = self.best_within(deadline_s, with_choice=True)
        slower = [(p.time_s, c) for p, c in self.plans if p.time_s > deadline_s]
        extra = [min(slower, key=lambda pc: pc[0])[1]] if slower else []
        plan, choice = self.planner.solve_deadline(deadline_s, self.fastest, None if found is None else found.choice,
                                                   polish=False, extra=extra)  # fmt: skip
        self.plans.append(_Found(plan, choice))
        self.solved[deadline_s] = plan.lower_bound_j
        return plan

    def whole(self, energy_step: float) -> None:
        """Every distinct plan from the fastest to the least-energy one: bisect each pair of solved deadlines whose
        best plans' energies, or whose LP bounds, differ by more than energy_step (relative), down to a time
        resolution of _FRONTIER_TIME_RESOLUTION of the fastest time."""
        t0 = self.fastest.time_s
        self.solve(t0)
        end = self.solve(self.planner.slowest_time_s())
        resolution = _FRONTIER_TIME_RESOLUTION * t0
        if end.time_s > t0 + resolution and end.time_s not in self.solved:
            self.solve(end.time_s)

        def steep(lo: float, hi: float) -> bool:
            low = self.best_within(hi).energy_j
            bound_drop = self.solved[lo] - self.solved[hi]
            return hi - lo > resolution and max(self.best_within(lo).energy_j - low, bound_drop) > energy_step * low

        while True:  # a plan found later can lower an earlier pair's slower end: re-check every pair until none
            deadlines = [d for d in sorted(self.solved) if d <= end.time_s]
            stack = [(lo, hi) for lo, hi in zip(deadlines, deadlines[1:]) if steep(lo, hi)][::-1]
            if not stack:
                return
            while stack:
                lo, hi = stack.pop()
                if not steep(lo, hi):
                    continue
                mid = 0.5 * (lo + hi)
                self.solve(mid)
                stack += [(mid, hi), (lo, mid)]  # the faster half first: its plans warm-start the slower half

    def staircase(self) -> list[FrontierPoint]:
        """The distinct plans of the staircase, fastest first, each strictly cheaper than every faster one."""
        points: list[FrontierPoint] = []
        for plan, _ in sorted(self.plans, key=lambda pc: (pc[0].time_s, pc[0].energy_j)):
            if points and plan.energy_j >= points[-1].energy_j * (1 - 1e-12):
                continue
            if points and plan.time_s <= points[-1].time_s:
                points.pop()
            points.append(FrontierPoint(time_s=plan.time_s, energy_j=plan.energy_j,
                                        lower_bound_j=self.bound_at(plan.time_s), deadline_s=float(plan.deadline_s),
                                        sm_clock_mhz=plan.sm_clock_mhz))  # fmt: skip
        return points

    def proven_gap(self) -> float:
        """PipelineFrontier.proven_gap over the solved deadlines."""
        deadlines = sorted(self.solved)
        gap = 0.0
        for lo, hi in zip(deadlines, deadlines[1:] + [None]):
            best = self.best_within(lo)
            bound = self.solved[hi if hi is not None else lo]
            if best is not None and best.energy_j > 0:
                gap = max(gap, (best.energy_j - bound) / best.energy_j)
        return gap
