"""The checks of the clock planner's arguments, which need neither the solver (HiGHS) nor PyTorch: the stage profile
read, the schedule, the stage count, the blocking power, the solver's limits, and the schedule's DAG built and
matched against the profile. freqopt.pipeline.planner.PipelinePlanner runs them first; ``freqopt plan`` runs them
(with the budget and the frontier's points, check_plan_arguments) before it imports the planner, so that a wrong
argument is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.pipeline.dag import SCHEDULES, PipelineDAG, schedule_dag
from freqopt.pipeline.profile import StageProfile, blocking_power_w_for, check_number, load_stage_profile
from freqopt.pipeline.schedules import stages_per_rank

__all__ = ["PlannerArguments", "check_planner_arguments", "check_plan_arguments", "METHODS"]

METHODS = ("auto", "exact", "hull")


@dataclass(frozen=True)
class PlannerArguments:
    """The planner's arguments, checked (check_planner_arguments).

    Attributes:
        profile: the stage profile, read.
        blocking_power_w: the blocking power to plan with (W): the one given, else the GPU's measured figure.
        dag: the schedule's instruction DAG over the profiled pipeline's GPUs and ``micro_batches``.
    """

    profile: StageProfile
    blocking_power_w: float
    dag: PipelineDAG


def check_planner_arguments(profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                            blocking_power_w: float | None = None, gpu: str | None = None, schedule: str = "1f1b",
                            time_quantum_s: float | None = None, mip_rel_gap: float = 1e-5,
                            node_limit: int | None = None, time_limit_s: float | None = None, method: str = "auto",
                            virtual_stages: int | None = None) -> PlannerArguments:  # fmt: skip
    """Check freqopt.pipeline.planner.PipelinePlanner's arguments (see there), in the order it always made them.

    Raises:
        InvalidSettingError: an unknown method or schedule; a profile that cannot be read; micro_batches, stages or
            virtual_stages not positive integers; profile stages that do not divide among the schedule's GPUs or
            another stage count than ``stages``; no blocking power (nor a gpu with a measured one); a bad
            time_quantum_s, mip_rel_gap, node_limit or time_limit_s; a schedule whose instructions the profile
            does not give.
        UnknownNameError: ``gpu`` is neither a GPU type nor a GPU file (freqopt.gpu.specs.get_gpu).
    """
    if method not in METHODS:
        raise InvalidSettingError(f"method {method!r} is unknown; known: {', '.join(METHODS)}", argument="method")
    if not isinstance(profile, StageProfile):
        profile = load_stage_profile(profile)
    check_positive_int("micro_batches", micro_batches)
    check_positive_int("stages", stages, optional=True)
    if schedule not in SCHEDULES:
        raise InvalidSettingError(f"schedule {schedule!r} is unknown; known: {', '.join(SCHEDULES)}",
                                  argument="schedule")  # fmt: skip
    per_gpu = stages_per_rank(schedule, virtual_stages)
    if profile.stages % per_gpu:
        raise InvalidSettingError(f"schedule {schedule} runs {per_gpu} model stages per GPU; the stage profile's "
                                  f"{profile.stages} stages do not divide among GPUs that way",
                                  argument="schedule")  # fmt: skip
    gpus = profile.stages // per_gpu
    if stages is not None and stages != gpus:
        what = (f"{gpus} stages" if per_gpu == 1 else
                f"{gpus} GPUs ({profile.stages} model stages, {per_gpu} per GPU under {schedule})")  # fmt: skip
        raise InvalidSettingError(f"stages {stages} is not the stage profile's {what}; plan the pipeline that was "
                                  "profiled", argument="stages")  # fmt: skip
    blocking_power_w = blocking_power_w_for(blocking_power_w, gpu)
    if gpu is not None:  # a GPU type or file (realized prices switches with its latency), which blocking_power_w_for
        from freqopt.gpu.specs import get_gpu

        get_gpu(gpu)  # has not read where a blocking power was given
    if time_quantum_s is not None:
        check_number("time_quantum_s", time_quantum_s, minimum=0.0, strict=True)
    check_number("mip_rel_gap", mip_rel_gap, minimum=0.0)
    if node_limit is not None and (isinstance(node_limit, bool) or not isinstance(node_limit, int)
                                   or node_limit < 0):  # fmt: skip
        raise InvalidSettingError(f"node_limit must be an integer >= 0 (branch-and-bound nodes), not "
                                  f"{node_limit!r}", argument="node_limit")  # fmt: skip
    if time_limit_s is not None:
        check_number("time_limit_s", time_limit_s, minimum=0.0, strict=True)
    dag = schedule_dag(schedule, gpus, micro_batches, virtual_stages=virtual_stages)
    missing = sorted({(i.stage, i.kind) for i in dag.instructions} - set(profile.options))
    if missing:
        stage, kind = missing[0]
        raise InvalidSettingError(f"stage_profile: schedule {schedule} runs {kind} instructions, which the profile "
                                  f"does not give (stage {stage}, and {len(missing) - 1} more); profile them, or "
                                  f"plan a schedule whose instructions it has", argument="stage_profile")  # fmt: skip
    return PlannerArguments(profile, float(blocking_power_w), dag)


def check_plan_arguments(profile: StageProfile | str | Path, micro_batches: int, *, max_slowdown=None,
                         n_points: int | None = None, **planner_arguments) -> PlannerArguments:
    """What ``freqopt plan`` asks of the library, checked before the planner (and HiGHS) is imported: the planner's
    arguments (check_planner_arguments, the keyword arguments), then PipelinePlanner.plan's ``max_slowdown``
    (freqopt.budget.parse_slowdown) and PipelinePlanner.frontier's ``n_points`` (a positive integer, or None).

    Raises:
        InvalidSettingError, UnknownNameError: as check_planner_arguments; a bad max_slowdown or n_points.
    """
    checked = check_planner_arguments(profile, micro_batches, **planner_arguments)
    if max_slowdown is not None:
        from freqopt.budget import parse_slowdown

        parse_slowdown(max_slowdown, allow_zero=True)  # slack off the critical path saves at no slowdown
    check_positive_int("n_points", n_points, optional=True)
    return checked
