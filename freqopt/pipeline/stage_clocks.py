"""The stage level of the pipeline planner (PipelinePlanner.plan_stage_clocks; freqopt.pipeline.planner): one SM
clock per stage (per GPU) for all its instructions, no clock switch within an iteration."""

from __future__ import annotations

import time as _time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from freqopt.errors import FreqoptError, InvalidSettingError
from freqopt.pipeline.dag import effective_energy_j
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.solver import PipelineModel, precedence_rows

if TYPE_CHECKING:  # the planner whose stage level this is, beside this module in the same wing
    from freqopt.pipeline.planner import PipelinePlanner

__all__ = ["StageClockModel", "plan_stage_clocks"]


class StageClockModel(NamedTuple):
    """plan_stage_clocks's model, built once per planner.

    Attributes:
        clocks: each GPU's clocks (MHz) that every instruction kind of every model stage it runs was profiled at,
            fastest first.
        offsets: the model's columns of GPU g are offsets[g]:offsets[g + 1], int array of shape (GPUs + 1,).
        model: the PipelineModel (one binary per GPU and clock, the start times, T).
    """

    clocks: list[list[int]]
    offsets: np.ndarray
    model: PipelineModel


def plan_stage_clocks(planner: PipelinePlanner, deadline_s: float | None = None, *,
                      max_slowdown: float | str | None = None) -> PipelinePlan:  # fmt: skip
    """PipelinePlanner.plan_stage_clocks (its docstring says what it does)."""
    fastest = planner.fastest()
    deadline_s = planner._deadline(fastest, deadline_s, max_slowdown)
    if deadline_s is None:
        return fastest
    start = _time.perf_counter()
    if planner._stage_model is None:
        planner._stage_model = _build_stage_model(planner)
    clocks, offsets, model = planner._stage_model
    result = model.milp(deadline_s, time_limit_s=planner.time_limit_s, mip_rel_gap=planner.mip_rel_gap)
    if result.x is None:
        raise FreqoptError(f"the stage-clock planner (HiGHS) found no plan within {deadline_s:.6g} s in "
                           f"{planner.time_limit_s:g} s: {result.status}")  # fmt: skip
    chosen = [clocks[g][int(np.argmax(result.x[offsets[g]:offsets[g + 1]]))] for g in range(planner.gpus)]
    per_instruction = np.asarray([chosen[planner.dag.gpu_of(inst)] for inst in planner.dag.instructions], dtype=int)
    time_s, energy_j = planner.evaluate(per_instruction)
    if time_s > deadline_s * (1 + 1e-9):  # HiGHS's tolerance: the fastest plan is the safe answer
        per_instruction = fastest.sm_clock_mhz
        time_s, energy_j = fastest.time_s, fastest.energy_j
    return PipelinePlan(dag=planner.dag, sm_clock_mhz=per_instruction, time_s=time_s, energy_j=energy_j,
                        deadline_s=float(deadline_s), lower_bound_j=min(result.dual_bound, energy_j),
                        default_time_s=fastest.time_s, default_energy_j=fastest.energy_j,
                        solve_s=_time.perf_counter() - start, planner=planner)  # fmt: skip


def _build_stage_model(planner: PipelinePlanner) -> StageClockModel:
    """plan_stage_clocks's model, built once: each GPU's clocks (every instruction kind of every model stage it
    runs profiled at them, fastest first; 1F1B: one stage per GPU), its columns' offsets, and the
    PipelineModel (a StageClockModel)."""
    clocks = []
    for gpu in range(planner.gpus):
        keys = sorted({(i.stage, i.kind) for i in planner.dag.instructions if planner.dag.gpu_of(i) == gpu})
        common = sorted(set.intersection(*(set(planner.profile.options[key].sm_clock_mhz.tolist()) for key in keys)),
                        reverse=True)  # fmt: skip
        if not common:
            stages = sorted({stage for stage, _ in keys})
            raise InvalidSettingError(f"stage_profile: stage(s) {stages}'s instructions share no clock; one clock "
                                      "per stage needs all of them profiled at it", argument="stage_profile")  # fmt: skip
        clocks.append(common)
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in clocks])])
    n, n_y = planner.dag.n, int(offsets[-1])
    cost = np.zeros(n_y)
    times = []
    owner = [planner.dag.gpu_of(inst) for inst in planner.dag.instructions]
    for inst, gpu in zip(planner.dag.instructions, owner):
        opts = planner.profile.options[(inst.stage, inst.kind)]
        index = [int(np.flatnonzero(opts.sm_clock_mhz == c)[0]) for c in clocks[gpu]]
        t = opts.time_s[index]
        if planner.time_quantum_s is not None:
            t = np.floor(t / planner.time_quantum_s + 1e-9) * planner.time_quantum_s
        times.append(t)
        cost[offsets[gpu]:offsets[gpu + 1]] += effective_energy_j(opts.energy_j[index], t, planner.blocking_power_w)
    matrix, lower, upper = precedence_rows(planner.dag, planner.gpus, offsets, owner, times, n_y)
    objective = np.concatenate([cost, np.zeros(n), [planner.gpus * planner.blocking_power_w]])
    return StageClockModel(clocks, offsets, PipelineModel(matrix, lower, upper, objective, n_y))
