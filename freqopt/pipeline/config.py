"""How to search a pipeline (freqopt.pipeline.search): the granularities and the search's settings."""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.errors import InvalidSettingError
from freqopt.granularities import PIPELINE_GRANULARITIES, pipeline_granularities
from freqopt.pipeline.solver import DEFAULT_NODE_LIMIT
from freqopt.search.validate import DEFAULT_CONFIDENCE, check_confidence

__all__ = ["PIPELINE_GRANULARITIES", "PipelineSearchConfig", "pipeline_granularities"]

@dataclass(frozen=True)
class PipelineSearchConfig:
    """How to search a pipeline.

    Attributes:
        max_slowdown: allowed fractional slowdown of the iteration, in [0, 1).
        granularities: of PIPELINE_GRANULARITIES.
        n_trials: trials per study (each instruction's, and the iteration level's).
        finalist_repeats: extra measurements of each Pareto point near the default (noise-aware selection).
        validation_repeats: measurements of the whole iteration averaged per schedule (the baseline's too).
        validation_max_repeats: measurements at most of a schedule whose upper confidence bound is over the limit
            while its mean is not clearly over it (PipelineValidator).
        confidence: a schedule is accepted only if the upper one-sided confidence bound of its slowdown, at this
            level, is within the budget; in [0.5, 1), 0.5 judging on the mean alone.
        max_validation_rounds: plans validated while calibrating the instruction level's deadline.
        frontier_points: deadlines of the time-energy frontier (PipelinePlanner.frontier).
        plan_rel_gap: the planner's proven relative optimality gap at which HiGHS stops (PipelinePlanner's
            mip_rel_gap): 0.1 %, a fifth of one energy reading's noise (SimulatedGPU's ENERGY_NOISE_REL, 0.5 %), so
            a tighter proof would only sort plans the measurements cannot tell apart.
        plan_node_limit: the planner's branch-and-bound nodes per MILP solve (PipelinePlanner's node_limit): a
            limit of work, so the search's plans do not depend on the machine's speed or load.
        plan_time_limit_s: a wall-clock limit (s) per solve as well, or None (the default) for none; a plan it cuts
            short depends on the machine's speed and load.
        blocked_power_w: a constant blocked power (W) in place of the physics' (SimulatedPipeline), for a
            sensitivity check against Perseus's measured figure; None: the physics'.
        seed: seeds the samplers and the simulated GPUs' noise.
        storage: Optuna storage URL; None keeps studies in memory.
        schedule, virtual_stages: the pipeline schedule (freqopt.pipeline.dag.SCHEDULES: DeepSpeed's "1f1b", or
            one of torch.distributed.pipelining's) and, for the looped ones, its model stages per GPU; the stage
            traces are then one per model stage (SimulatedPipeline).
    """

    max_slowdown: float
    granularities: tuple[str, ...] = PIPELINE_GRANULARITIES
    n_trials: int = 14
    finalist_repeats: int = 2
    validation_repeats: int = 4
    validation_max_repeats: int = 8
    confidence: float = DEFAULT_CONFIDENCE
    max_validation_rounds: int = 8
    frontier_points: int = 12
    plan_rel_gap: float = 1e-3
    plan_node_limit: int = DEFAULT_NODE_LIMIT
    plan_time_limit_s: float | None = None
    blocked_power_w: float | None = None
    seed: int = 0
    storage: str | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = None

    def __post_init__(self):
        if not 0.0 <= self.max_slowdown < 1.0:
            raise InvalidSettingError(f"max_slowdown must be in [0, 100 %), not {self.max_slowdown:.4g}",
                                      argument="max_slowdown")  # fmt: skip
        pipeline_granularities(self.granularities)
        check_confidence(self.confidence)
