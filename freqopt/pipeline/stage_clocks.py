"""The stage level of the pipeline planner (PipelinePlanner.plan_stage_clocks; freqopt.pipeline.planner): one SM
clock per stage (per GPU) for all its instructions, no clock switch within an iteration."""

from __future__ import annotations

import time as _time
from typing import NamedTuple

import numpy as np

from freqopt.errors import InvalidSettingError
from freqopt.pipeline.dag import effective_energy_j
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.solver import PipelineModel, precedence_rows


__all__ = ["StageClockModel", "StageClockPlanning"]


class StageClockModel(NamedTuple):
    """PipelinePlanner.plan_stage_clocks's model, built once per planner.

    Attributes:
        clocks: each GPU's clocks (MHz) that every instruction kind of every model stage it runs was profiled at,
            fastest first.
        offsets: the model's columns of GPU g are offsets[g]:offsets[g + 1], int array of shape (GPUs + 1,).
        model: the PipelineModel (one binary per GPU and clock, the start times, T).
    """

    clocks: list[list[int]]
    offsets: np.ndarray
    model: PipelineModel


class StageClockPlanning:
    """The stage level of a planner (module docstring), as PlanHeuristics holds its heuristics: a subclass
    (freqopt.pipeline.planner.PipelinePlanner) sets ``dag``, ``gpus``, ``profile``, ``blocking_power_w``,
    ``time_quantum_s``, ``node_limit``, ``time_limit_s``, ``mip_rel_gap`` and ``_stage_model`` (None until the first
    call), and has ``fastest``, ``evaluate`` and ``_deadline``."""

    _stage_model: StageClockModel | None

    def _plan_stage_clocks(self, deadline_s: float | None = None, *,
                           max_slowdown: float | str | None = None) -> PipelinePlan:  # fmt: skip
        """PipelinePlanner.plan_stage_clocks (its docstring says what it does)."""
        fastest = self.fastest()
        deadline_s = self._deadline(fastest, deadline_s, max_slowdown)
        if deadline_s is None:
            return fastest
        start = _time.perf_counter()
        if self._stage_model is None:
            self._stage_model = self._build_stage_model()
        clocks, offsets, model = self._stage_model
        # No start is given to HiGHS: with one (every GPU at its fastest common clock) HiGHS 1.16 returned that start
        # as "Optimal" after one node, its dual bound a quarter of it (BLOOM/A100, M = 12, 2 %; 7,344 J where the
        # solve from nothing finds 6,856 J in 13 nodes).
        result = model.milp(deadline_s, node_limit=self.node_limit, time_limit_s=self.time_limit_s,
                            mip_rel_gap=self.mip_rel_gap)  # fmt: skip
        if result.x is not None:
            chosen = [clocks[g][int(np.argmax(result.x[offsets[g]:offsets[g + 1]]))] for g in range(self.gpus)]
            per_instruction = np.asarray([chosen[self.dag.gpu_of(inst)] for inst in self.dag.instructions], dtype=int)
            time_s, energy_j = self.evaluate(per_instruction)
        if result.x is None or time_s > deadline_s * (1 + 1e-9):
            # No plan by the solve's limit, or HiGHS's tolerance past the deadline: the fastest plan is the safe answer
            per_instruction = fastest.sm_clock_mhz
            time_s, energy_j = fastest.time_s, fastest.energy_j
        return PipelinePlan(dag=self.dag, sm_clock_mhz=per_instruction, time_s=time_s, energy_j=energy_j,
                            deadline_s=float(deadline_s), lower_bound_j=min(result.dual_bound, energy_j),
                            default_time_s=fastest.time_s, default_energy_j=fastest.energy_j,
                            solve_s=_time.perf_counter() - start, planner=self,
                            milp_stopped_by=result.stopped_by)  # fmt: skip

    def _build_stage_model(self) -> StageClockModel:
        """PipelinePlanner.plan_stage_clocks's model, built once: each GPU's clocks (every instruction kind of every model stage it
        runs profiled at them, fastest first; 1F1B: one stage per GPU), its columns' offsets, and the
        PipelineModel (a StageClockModel)."""
        clocks = []
        for gpu in range(self.gpus):
            keys = sorted({(i.stage, i.kind) for i in self.dag.instructions if self.dag.gpu_of(i) == gpu})
            common = sorted(set.intersection(*(set(self.profile.options[key].sm_clock_mhz.tolist()) for key in keys)),
                            reverse=True)  # fmt: skip
            if not common:
                stages = sorted({stage for stage, _ in keys})
                raise InvalidSettingError(f"stage_profile: stage(s) {stages}'s instructions share no clock; one clock "
                                          "per stage needs all of them profiled at it", argument="stage_profile")  # fmt: skip
            clocks.append(common)
        offsets = np.concatenate([[0], np.cumsum([len(c) for c in clocks])])
        n, n_y = self.dag.n, int(offsets[-1])
        cost = np.zeros(n_y)
        times = []
        owner = [self.dag.gpu_of(inst) for inst in self.dag.instructions]
        for inst, gpu in zip(self.dag.instructions, owner):
            opts = self.profile.options[(inst.stage, inst.kind)]
            index = [int(np.flatnonzero(opts.sm_clock_mhz == c)[0]) for c in clocks[gpu]]
            t = opts.time_s[index]
            if self.time_quantum_s is not None:
                t = np.floor(t / self.time_quantum_s + 1e-9) * self.time_quantum_s
            times.append(t)
            cost[offsets[gpu]:offsets[gpu + 1]] += effective_energy_j(opts.energy_j[index], t, self.blocking_power_w)
        matrix, lower, upper = precedence_rows(self.dag, self.gpus, offsets, owner, times, n_y)
        objective = np.concatenate([cost, np.zeros(n), [self.gpus * self.blocking_power_w]])
        return StageClockModel(clocks, offsets, PipelineModel(matrix, lower, upper, objective, n_y))
