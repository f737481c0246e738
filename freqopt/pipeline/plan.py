"""What the pipeline planner (freqopt.pipeline.planner) gives: a plan (one SM clock per instruction, its time,
energy and proven bound), and the iteration time-energy frontier, point by point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from freqopt.errors import InvalidSettingError
from freqopt.pipeline.dag import PipelineDAG

__all__ = ["PipelinePlan", "FrontierPoint", "PipelineFrontier", "FrontierSource"]


class FrontierSource(Protocol):
    """What a plan keeps of the planner that made it (freqopt.pipeline.planner.PipelinePlanner): the frontier of the
    same pipeline, for PipelinePlan.frontier."""

    def frontier(self, n_points: int | None = None) -> PipelineFrontier: ...


@dataclass(frozen=True)
class PipelinePlan:
    """A clock per instruction of one pipeline iteration, with its time and energy.

    Attributes:
        dag: the instruction DAG (freqopt.pipeline.dag.PipelineDAG); arrays below follow dag.instructions.
        sm_clock_mhz: the SM clock (MHz) of each instruction, int array of shape (N,).
        time_s: the iteration time (s): the critical path with those clocks.
        energy_j: the iteration's energy (J), Perseus's accounting.
        deadline_s: the deadline it was planned for (s), or None for the fastest plan.
        lower_bound_j: a proven lower bound (J) on the energy of any plan within the deadline (HiGHS's MILP bound,
            or the hull LP's optimum for method "hull"); energy_j itself where the plan is optimal by construction
            (the fastest plan).
        default_time_s, default_energy_j: the fastest plan's (every instruction at its fastest clock).
        solve_s: wall time (s) the solver took.
        milp_stopped_by: "node limit" or "time limit" where that limit, not the gap target, ended the plan's MILP
            (the plan is then the best found by that point, ``gap`` its proven distance from the optimum; a time
            limit makes it depend on the machine's speed and load); None where no MILP ran or it proved its gap.
    """

    dag: PipelineDAG
    sm_clock_mhz: np.ndarray
    time_s: float
    energy_j: float
    deadline_s: float | None
    lower_bound_j: float
    default_time_s: float
    default_energy_j: float
    solve_s: float = 0.0
    planner: FrontierSource | None = field(default=None, repr=False, compare=False)
    milp_stopped_by: str | None = None

    @property
    def gap(self) -> float:
        """The proven relative optimality gap, (energy_j - lower_bound_j) / energy_j (0 when optimal)."""
        return max(0.0, (self.energy_j - self.lower_bound_j) / self.energy_j) if self.energy_j else 0.0

    @property
    def saved(self) -> float:
        """The energy saved against the fastest plan, as a fraction of its energy."""
        return 1.0 - self.energy_j / self.default_energy_j

    def stage_clocks(self) -> list[dict[str, object]]:
        """The plan stage by stage, each stage's instructions in the order it runs them:
        ``[{"stage": s, "instructions": [{"kind", "micro_batch", "sm_clock_mhz"}, ...]}, ...]``."""
        out: list[dict[str, object]] = [{"stage": s, "instructions": []} for s in range(self.dag.stages)]
        for inst, clock in zip(self.dag.instructions, self.sm_clock_mhz):
            out[inst.stage]["instructions"].append(  # type: ignore[union-attr]
                {"kind": inst.kind, "micro_batch": inst.micro_batch, "sm_clock_mhz": int(clock)})
        return out

    def frontier(self, n_points: int | None = None) -> PipelineFrontier:
        """The iteration time-energy frontier of the same pipeline (PipelinePlanner.frontier)."""
        if self.planner is None:
            raise InvalidSettingError("this plan carries no planner; call PipelinePlanner.frontier")
        return self.planner.frontier(n_points)


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the time-energy frontier: the best plan found within ``deadline_s``.

    Attributes:
        time_s: the plan's iteration time (s), at most deadline_s.
        energy_j: its energy (J).
        lower_bound_j: the proven lower bound (J) on any plan's energy within deadline_s (the hull LP's optimum).
        deadline_s: the deadline (s).
        sm_clock_mhz: the plan's SM clock per instruction (MHz), int array of shape (N,) in the DAG's order, or None.
    """

    time_s: float
    energy_j: float
    lower_bound_j: float
    deadline_s: float
    sm_clock_mhz: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def gap(self) -> float:
        """The proven relative gap of this point, (energy_j - lower_bound_j) / energy_j."""
        return max(0.0, (self.energy_j - self.lower_bound_j) / self.energy_j) if self.energy_j else 0.0


@dataclass(frozen=True)
class PipelineFrontier:
    """The iteration time-energy frontier of one pipeline (PipelinePlanner.frontier); iterates over its points.

    Attributes:
        points: FrontierPoint tuple in increasing time.
        proven_gap: an upper bound on how far the staircase through the points (at time t, the least energy of a
            point no slower than t) lies above the least energy of any plan no slower than t, for every t from the
            first point's time to the last's, as a fraction: max over consecutive solved deadlines D_j < D_j+1 of
            staircase(D_j) / LP(D_j+1) - 1 (the hull LP's optimum falls with the deadline, so it bounds every plan
            in between).
        solves: the deadlines solved (each one hot-started hull LP and its roundings).
        solve_s: wall time (s) of the whole frontier.
    """

    points: tuple[FrontierPoint, ...]
    proven_gap: float
    solves: int
    solve_s: float

    def __iter__(self):
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index):
        return self.points[index]
