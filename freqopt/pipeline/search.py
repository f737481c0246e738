"""The clock search of a pipeline-parallel iteration on the simulated pipeline (freqopt.pipeline.sim): one SM
clock for the whole iteration ("iteration"), one per stage that never switches ("stage") and one per instruction
("instruction").

Stage level. One SM clock per stage for all its instructions (PipelinePlanner.plan_stage_clocks on the instruction
level's fronts), validated like the others: what balancing the stages gives without a single clock switch, the
baseline that separates that from what switching per instruction adds.

Iteration level. One SM clock for every GPU of the pipeline for the whole iteration: a Bayesian study
(freqopt.search.study.search_unit, Optuna's GPSampler, constrained to the budget's neighbourhood) whose every
measurement is the whole simulated pipeline's iteration at that clock; the option of least mean energy within the
budget is validated, and the next one tried while validation breaks the budget.

Instruction level. For each (stage, kind) the front of one instruction (time and energy per SM clock) is found by
its own Bayesian study (search_unit), each measurement the instruction's kernels issued as the pipeline issues them
(SimulatedGPU.measure_schedule: from an idle GPU, P2P transfers included). Each stage is its own GPU and the clocks
are locked, so an instruction's time and energy do not depend on its neighbours' clocks: the studies do not couple
(the power limit is per GPU, and a locked clock below it leaves the firmware nothing to shift between stages), and
the stages' studies could run on their S GPUs at once. The fronts make a StageProfile (with each (stage, kind)'s
measured default) for freqopt.pipeline.planner.PipelinePlanner, which minimizes the iteration's energy
(Perseus's accounting, the blocked power at the default clock) subject to its critical path within a deadline:
exact (HiGHS's MILP) where it is small, provably near-exact otherwise; and its whole time-energy frontier.

Switches. A runtime asks for a clock at an instruction's start and it lands ``spec.clock_switch_s`` later, so each
plan is realized before it is measured: asked for one switch latency ahead, the faster clock held over its
neighbours, so that no instruction runs slower than planned (freqopt.pipeline.realize). The planner's deadline
is then calibrated by validating the realized plan on the noisy pipeline with switch latency (a secant step on the
upper confidence bound of the validated slowdown, from readings paired with the defaults' (PipelineValidator),
inside the bracket of deadlines known to meet and to break the budget, as
freqopt.search.allocation does for the other levels; freqopt.pipeline.calibrate), keeping the least validated energy whose bound is within the
budget; the
iteration level's clock (validated) and the defaults are candidates, so the instruction level never ends worse.
The same calibration with the plans measured as they stand and free, instant switching gives the free-switching
ideal reported beside it.

Every measurement is logged in the Optuna storage (freqopt.search.journal), so a search killed at any point resumes
where it stopped. The instruction studies' names do not hold the micro-batch count, so another count re-plans from
the same fronts without measuring them again.
"""

from __future__ import annotations

import dataclasses
import time as _time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.gpu.backends.base import ClockSetting, Measurement
from freqopt.gpu.specs import GPUSpec
from freqopt.pipeline.calibrate import Calibrated, Candidate, calibrated
from freqopt.pipeline.config import PipelineSearchConfig
from freqopt.pipeline.dag import PipelineDAG
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.profile import InstructionOptions, StageProfile
from freqopt.pipeline.realize import realize_plan
from freqopt.pipeline.result import PipelineLevelResult, PipelineSearchResult, clock_mhz
from freqopt.pipeline.sim import SimulatedPipeline, perseus_blocking_power_w
from freqopt.pipeline.validate import PipelineValidator, Validated
from freqopt.pipeline.workers import (SharedStudies, fronts_prefix, instruction_keys, instruction_studies,
                                      pipeline_study_prefix, share_instruction_studies)  # fmt: skip
from freqopt.search.journal import MeasurementLog
from freqopt.search.study import Option, UnitSearch, search_unit

__all__ = ["run_pipeline_search", "pipeline_study_prefix", "fronts_prefix"]


class _WholePipeline:
    """search_unit's backend for the iteration level: measuring a setting is measuring the whole simulated pipeline
    with every instruction at it (the kernels search_unit passes are ignored)."""

    name = "sim"
    simulated = True

    def __init__(self, pipeline: SimulatedPipeline):
        self.pipeline = pipeline
        self.spec = pipeline.spec

    def measure_schedule(self, kernels, settings, *, key: str = "", switching: bool = False,
                         sample: int | None = None) -> Measurement:  # fmt: skip
        setting = _sm_only(settings[0])
        return self.pipeline.run(setting, key=key, sample=sample).as_measurement()


def _sm_only(setting: ClockSetting) -> ClockSetting:
    """The SM clock of a setting alone (memory clock and power limit at the default, as the pipeline's levels keep
    them)."""
    return ClockSetting(sm_clock_mhz=setting.sm_clock_mhz)


def _options_of(search: UnitSearch, spec: GPUSpec) -> tuple[Option, ...]:
    """A study's options for the planner: the default (at the highest SM clock) first, then the others by clock,
    one per SM clock (an explicit highest clock gives way to the default, which holds more samples)."""
    seen = {spec.max_sm_clock_mhz}
    out = [search.default]
    for o in sorted(search.options[1:], key=lambda o: -clock_mhz(spec, o.setting)):
        clock = clock_mhz(spec, o.setting)
        if clock in seen or o.setting.power_limit_w is not None:
            continue
        seen.add(clock)
        out.append(o)
    return tuple(out)


def _profile(fronts: dict, spec: GPUSpec, stages: int) -> StageProfile:
    options = {}
    for key, opts in fronts.items():
        options[key] = InstructionOptions(np.asarray([clock_mhz(spec, o.setting) for o in opts], dtype=int),
                                          np.asarray([o.time_s for o in opts]), np.asarray([o.energy_j for o in opts]))
    return StageProfile(stages, options, "freqopt.pipeline.search")


@dataclass(frozen=True)
class _Search:
    """What every level of one pipeline search shares: its inputs, the simulated pipeline, the studies' name
    prefixes (``prefix``: the instruction fronts'; ``whole``: the whole iteration's, with the micro-batch count), the
    validator, the validated default iteration, and the instruction studies as shared with workers (``shared``: None
    where nothing is shared, freqopt.pipeline.workers)."""

    stage_traces: Sequence
    spec: GPUSpec
    micro_batches: int
    config: PipelineSearchConfig
    storage: object
    on_unit: Callable[[str, int, int], None] | None
    pipeline: SimulatedPipeline
    prefix: str
    whole: str
    log: MeasurementLog
    validator: PipelineValidator
    baseline: Validated
    shared: SharedStudies | None

    @property
    def dag(self) -> PipelineDAG:
        return self.pipeline.dag

    @property
    def max_slowdown(self) -> float:
        return self.config.max_slowdown


@dataclass(frozen=True)
class _Fronts:
    """The instruction studies' outcome, which the stage and instruction levels plan on.

    Attributes:
        searches: the studies, one per (model stage, kind).
        resumed: whether the storage held these studies' job already (a resumed search); None where the storage
            is not shared (freqopt.pipeline.workers.instruction_studies).
        defaults, fronts: (stage, kind) -> its measured default (Option) and its front (Options, the default first).
        profile: the StageProfile made of the fronts.
        blocking_power_w: the constant blocked power the planner counts (W): the physics' at the default clock.
        planner: the PipelinePlanner on that profile; fastest: its fastest plan.
        tail_s: the once-per-iteration tail (the optimizer step, s): the validated default iteration beyond the
            planned one.
        n_measurements, cost_gpu_s, wall_s: what the studies took (the wall time up to the planner's fastest plan).
    """

    searches: tuple[UnitSearch, ...]
    resumed: bool | None
    defaults: dict
    fronts: dict
    profile: StageProfile
    blocking_power_w: float
    planner: PipelinePlanner
    fastest: PipelinePlan
    tail_s: float
    n_measurements: int
    cost_gpu_s: float
    wall_s: float


def _start(stage_traces: Sequence, spec: GPUSpec, micro_batches: int, config: PipelineSearchConfig, storage,
           on_unit, partition_method: str) -> _Search:  # fmt: skip
    """The simulated pipeline, the studies' names, the instruction studies shared with workers (a persistent
    storage), the validator and the validated default iteration."""
    import optuna

    workload = stage_traces[0].workload
    pipeline = SimulatedPipeline(stage_traces, spec, micro_batches, seed=config.seed,
                                 blocked_power_w=config.blocked_power_w, schedule=config.schedule,
                                 virtual_stages=config.virtual_stages)  # fmt: skip
    prefix = fronts_prefix(workload, spec, partition_method, config.seed, pipeline.stages)
    whole = (f"{prefix}-m{micro_batches}" + ("" if config.blocked_power_w is None else f"-p{config.blocked_power_w:g}")
             + ("" if config.schedule == "1f1b" else f"-{config.schedule}"))
    log = MeasurementLog(optuna.create_study(study_name=f"{whole}-validation", storage=storage,
                                             load_if_exists=True))  # fmt: skip
    validator = PipelineValidator(pipeline, config.validation_repeats, log, confidence=config.confidence,
                                  max_repeats=config.validation_max_repeats)  # fmt: skip
    shared = None
    if {"stage", "instruction"} & set(config.granularities):  # workers take instruction studies from the start
        shared = share_instruction_studies(pipeline, spec, config, prefix, storage, partition_method=partition_method)
    baseline = validator((None,) * pipeline.dag.n, key="baseline")
    return _Search(stage_traces=stage_traces, spec=spec, micro_batches=micro_batches, config=config, storage=storage,
                   on_unit=on_unit, pipeline=pipeline, prefix=prefix, whole=whole, log=log, validator=validator,
                   baseline=baseline, shared=shared)  # fmt: skip


def _iteration_level(run: _Search) -> PipelineLevelResult:
    """One SM clock for every GPU of the pipeline for the whole iteration (module docstring): its study, then its
    options of least mean energy within the budget validated in turn until one holds."""
    config, spec, validator, baseline, b = run.config, run.spec, run.validator, run.baseline, run.max_slowdown
    t0 = _time.perf_counter()
    before = (validator.n_measurements, validator.cost_gpu_s)
    search = search_unit(_WholePipeline(run.pipeline), run.stage_traces[0].kernels[:1], name="iteration",
                         study_name=f"{run.whole}-iteration", storage=run.storage,
                         n_trials=config.n_trials, finalist_repeats=config.finalist_repeats,
                         finalist_slowdown=1.5 * b + 0.005, seed=config.seed, constrained=True, whole_step=True,
                         mem_clock_mhz=spec.max_mem_clock_mhz)  # fmt: skip
    if run.on_unit:
        run.on_unit("iteration", 1, 1)
    best = ((None,) * run.dag.n, baseline, search.default)
    limit = search.default.time_s * (1.0 + b)
    candidates = sorted((o for o in search.options[1:] if o.time_s <= limit), key=lambda o: o.energy_j)
    for option in candidates[:config.max_validation_rounds]:
        requests = (clock_mhz(spec, option.setting),) * run.dag.n
        v = validator(requests, key="iteration", limit_s=baseline.time_s * (1.0 + b))
        if v.time_bound_s <= baseline.time_s * (1.0 + b) and v.energy_j < best[1].energy_j:
            v = validator.confirm(requests, key="iteration")  # its figures from readings after the choice
            if v.time_bound_s <= baseline.time_s * (1.0 + b) and v.energy_j < best[1].energy_j:
                best = (requests, v, option)
                break
    requests, v, option = best
    return PipelineLevelResult(
        granularity="iteration", requests=requests, planned=requests, predicted_time_s=option.time_s,
        predicted_energy_j=option.energy_j, predicted_baseline_time_s=search.default.time_s,
        predicted_baseline_energy_j=search.default.energy_j, validated=v,
        n_measurements=search.n_measurements + validator.n_measurements - before[0],
        search_cost_gpu_s=search.cost_gpu_s + validator.cost_gpu_s - before[1],
        search_wall_s=_time.perf_counter() - t0, unit_searches=(search,))  # fmt: skip


def _instruction_fronts(run: _Search) -> _Fronts:
    """One study per model stage and instruction kind (module docstring, "Instruction level"), the StageProfile
    they make and the planner on it."""
    config, spec = run.config, run.spec
    t0 = _time.perf_counter()
    on_study = (lambda done, total: run.on_unit("instruction", done, total)) if run.on_unit else None
    searches = instruction_studies(run.pipeline, spec, config, run.prefix, run.storage, run.shared,
                                   on_study=on_study)  # fmt: skip
    keys = instruction_keys(run.dag)
    defaults = {key: search.default for key, search in zip(keys, searches)}
    fronts = {key: _options_of(search, spec) for key, search in zip(keys, searches)}
    profile = _profile(fronts, spec, run.dag.stages)
    blocking_w = run.pipeline.blocked_power_w()
    planner = PipelinePlanner(profile, run.micro_batches, blocking_power_w=blocking_w,
                              mip_rel_gap=config.plan_rel_gap, node_limit=config.plan_node_limit,
                              time_limit_s=config.plan_time_limit_s,
                              schedule=config.schedule, virtual_stages=config.virtual_stages)  # fmt: skip
    fastest = planner.fastest()
    # The once-per-iteration tail (optimizer step): the validated default iteration beyond the planned one.
    tail_s = max(0.0, run.baseline.time_s - fastest.time_s)
    return _Fronts(searches=tuple(searches), resumed=run.shared.resumed if run.shared is not None else None, defaults=defaults, fronts=fronts, profile=profile,
                   blocking_power_w=blocking_w, planner=planner, fastest=fastest, tail_s=tail_s,
                   n_measurements=sum(s.n_measurements for s in searches),
                   cost_gpu_s=sum(s.cost_gpu_s for s in searches), wall_s=_time.perf_counter() - t0)  # fmt: skip


def _planned(clocks) -> tuple[int | None, ...]:
    return tuple(int(c) if c is not None else None for c in clocks)


def _as_planned(plan: PipelinePlan) -> tuple[int, ...]:
    """A plan's clocks as they stand: the requests of free, instant switching (and of one clock per stage)."""
    return tuple(int(c) for c in plan.sm_clock_mhz)


def _level_on_fronts(granularity: str, run: _Search, fronts: _Fronts, chosen: Calibrated,
                     since: tuple[float, int, float], **extra) -> PipelineLevelResult:  # fmt: skip
    """A level planned on the instruction fronts (stage, instruction): its calibration's outcome, the planner's
    prediction of it (the fastest plan's where a candidate without a plan won) and what it cost, the fronts' studies
    and the validations since ``since`` ((perf_counter, validator.n_measurements, validator.cost_gpu_s) at the
    level's start); ``extra``: the instruction level's ideal and frontier."""
    validator, fastest = run.validator, fronts.fastest
    t1, n_before, cost_before = since
    predicted = chosen.plan if chosen.plan is not None else fastest
    return PipelineLevelResult(
        granularity=granularity, requests=tuple(chosen.requests), planned=_planned(chosen.planned),
        predicted_time_s=predicted.time_s, predicted_energy_j=predicted.energy_j,
        predicted_baseline_time_s=fastest.time_s, predicted_baseline_energy_j=fastest.energy_j,
        validated=chosen.validated, n_measurements=fronts.n_measurements + validator.n_measurements - n_before,
        search_cost_gpu_s=fronts.cost_gpu_s + validator.cost_gpu_s - cost_before,
        search_wall_s=fronts.wall_s + _time.perf_counter() - t1, unit_searches=fronts.searches, plan=chosen.plan,
        **extra)  # fmt: skip


def _since(validator: PipelineValidator) -> tuple[float, int, float]:
    """A level's start: the time, and the validator's measurements and cost so far (_level_on_fronts)."""
    return _time.perf_counter(), validator.n_measurements, validator.cost_gpu_s


def _stage_level(run: _Search, fronts: _Fronts, candidates: list[Candidate]) -> PipelineLevelResult:
    """One clock per stage, never switching: what balancing the stages alone gives. Its requests are its
    clocks (nothing to ask ahead); it counts the fronts' measurements as its own."""
    since = _since(run.validator)
    stage = calibrated(fronts.planner, _as_planned, run.validator, run.baseline, run.max_slowdown,
                       run.config.max_validation_rounds, candidates, key="stage",
                       plan_with=fronts.planner.plan_stage_clocks)  # fmt: skip
    return _level_on_fronts("stage", run, fronts, stage, since)


def _instruction_level(run: _Search, fronts: _Fronts, candidates: list[Candidate]) -> PipelineLevelResult:
    """One SM clock per instruction (module docstring): the planner's plan realized and calibrated on the
    validated iteration, the free-switching ideal beside it, and the predicted frontier."""
    config, validator, planner = run.config, run.validator, fronts.planner
    profile, switch_s, tail_s = fronts.profile, run.spec.clock_switch_s, fronts.tail_s

    def realize(plan: PipelinePlan) -> tuple[int, ...]:
        return tuple(realize_plan(profile, plan, switch_s, tail_s=tail_s))

    since = _since(validator)
    best = calibrated(planner, realize, validator, run.baseline, run.max_slowdown, config.max_validation_rounds,
                      candidates, key="instruction")  # fmt: skip
    # The same search with free, instant switching: the plans as they stand (the free-switching ideal).
    ideal = calibrated(planner, _as_planned, validator, run.baseline, run.max_slowdown,
                       config.max_validation_rounds, (), key="instruction-ideal", switching=False)  # fmt: skip
    frontier = tuple(planner.frontier(n_points=config.frontier_points)) if config.frontier_points else ()
    return _level_on_fronts("instruction", run, fronts, best, since, ideal=ideal.validated, frontier=frontier)


def run_pipeline_search(stage_traces: Sequence, spec: GPUSpec, micro_batches: int, config: PipelineSearchConfig, *,
                        storage=None, on_unit: Callable[[str, int, int], None] | None = None,
                        partition_method: str = "parameters") -> PipelineSearchResult:  # fmt: skip
    """Search each granularity of ``config`` on the simulated pipeline of ``stage_traces`` and validate it (module
    docstring).

    Args:
        stage_traces: one StageTrace per stage (freqopt.workload.pipeline_trace.trace_pipeline_stages).
        spec: the GPU type of every stage (its clock_switch_s the switch latency).
        micro_batches: M.
        config: budget, granularities, trials, repeats, seed.
        storage: the opened Optuna storage (freqopt.search.storage.open_storage), None for in memory.
        on_unit: called as on_unit(granularity, done, total) after each study.
        partition_method: how the stages were partitioned (recorded, and part of the studies' names).

    Returns:
        PipelineSearchResult.
    """
    started = _time.perf_counter()
    run = _start(stage_traces, spec, micro_batches, config, storage, on_unit, partition_method)
    levels: dict[str, PipelineLevelResult] = {}
    searches_all: list[UnitSearch] = []
    fronts = None
    if "iteration" in config.granularities:
        levels["iteration"] = _iteration_level(run)
        searches_all.extend(levels["iteration"].unit_searches)
    candidates: list[Candidate] = []
    if {"stage", "instruction"} & set(config.granularities):  # both plan on the instructions' measured fronts
        fronts = _instruction_fronts(run)
        searches_all.extend(fronts.searches)
        if "iteration" in levels:  # its one clock, as validated: the finer levels never end worse
            it = levels["iteration"]
            candidates.append(Candidate(it.planned, it.requests, it.validated))
        if "stage" in config.granularities:
            levels["stage"] = _stage_level(run, fronts, candidates)
            # The instruction level never ends worse; where the stage plan wins it, its plan is the table's.
            stage = levels["stage"]
            candidates.append(Candidate(stage.planned, stage.requests, stage.validated, stage.plan))
    if "instruction" in config.granularities:
        levels["instruction"] = _instruction_level(run, fronts, candidates)
    blocking = fronts.blocking_power_w if fronts is not None else run.pipeline.blocked_power_w()
    if config.blocked_power_w is None:  # the GPU's own waiting power, a range where no measurement pins it
        levels = _with_waiting_range(levels, stage_traces, spec, micro_batches, run.pipeline)
    n_new = run.log.n_new + sum(s.n_new_measurements for s in searches_all)
    n_stored = run.log.n_stored + sum(s.n_stored_measurements for s in searches_all)
    return PipelineSearchResult(
        workload=stage_traces[0].workload, gpu=spec.name, spec=spec, micro_batches=micro_batches,
        partition_method=partition_method, max_slowdown=config.max_slowdown, baseline=run.baseline,
        profile=fronts.profile if fronts is not None else None, defaults=fronts.defaults if fronts is not None else {},
        fronts=fronts.fronts if fronts is not None else {}, blocking_power_w=blocking,
        perseus_blocking_power_w=perseus_blocking_power_w(spec), switch_s=spec.clock_switch_s, levels=levels,
        storage=config.storage, seed=config.seed, n_new_measurements=n_new, n_stored_measurements=n_stored,
        wall_s=_time.perf_counter() - started, schedule=config.schedule, confidence=config.confidence,
        dag=run.dag, resumed=fronts.resumed if fronts is not None else None)  # fmt: skip


def _with_waiting_range(levels: dict, stage_traces: Sequence, spec: GPUSpec, micro_batches: int,
                        pipeline: SimulatedPipeline) -> dict:
    """``levels`` with each level's noiseless saving at the two ends of the blocked GPUs' power range
    (PipelineLevelResult.saving_pct_waiting_range; freqopt.gpu.specs.WaitingPower): the level's
    requests as validated (with switch latency) against the defaults, on ``pipeline`` and on the same pipeline
    whose waiting power does not fall with the clock."""
    from freqopt.gpu.specs import WAITING_CLOCK_SCALES

    flat = SimulatedPipeline(stage_traces, spec.with_waiting_clock_scale(WAITING_CLOCK_SCALES["flat"]),
                             micro_batches, noise=False, optimizer_step=pipeline.optimizer_step,
                             schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages)  # fmt: skip
    defaults = {id(p): p.true_run().energy_j for p in (flat, pipeline)}
    out = {}
    for g, level in levels.items():
        ends = tuple(100.0 * (1.0 - p.true_run(level.requests).energy_j / defaults[id(p)]) for p in (flat, pipeline))
        out[g] = dataclasses.replace(level, saving_pct_waiting_range=ends)
    return out
