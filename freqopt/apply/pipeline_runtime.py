"""A pipeline's clock table applied to a running DeepSpeed pipeline: one SM clock per instruction, on every stage.

    engine, *_ = deepspeed.initialize(model=PipelineModule(...), ...)     # one rank: one stage
    with PipelineRuntime(engine, table=table, backend=backend) as runtime:
        for _ in range(steps):
            engine.train_batch(data_iter)          # each forward and backward pass asks for its clock

**The plan per stage.** A pipeline table (freqopt.tables, granularity "instruction") holds per stage the SM clock of
every micro-batch's forward and backward pass. ``stage_schedule`` puts one stage's clocks in the order that stage
runs its instructions, DeepSpeed's 1F1B ``TrainSchedule`` (freqopt.pipeline.dag.stage_order). For another number
of micro-batches than the table was planned for (DeepSpeed's ``gradient_accumulation_steps``), the plan is made
again from the table's fronts (its measured (clock, time, energy) per stage and pass, table_stage_profile) by
freqopt.pipeline.planner.PipelinePlanner with the table's budget (``max_slowdown``, against the fastest plan)
and blocking power: no new measurement. Every rank plans the whole pipeline the same way and keeps its own stage.
HiGHS is deterministic, so the ranks agree wherever the solve finishes; on pipelines so large that the planner's
"hull" method stops at its time limit (hundreds of instructions, see PipelinePlanner), ranks could keep different
plans: plan those once with the planner and write the table for that micro-batch count instead.

**Hooks.** The runtime hooks one engine instance, never DeepSpeed's classes: PipelineEngine._exec_schedule looks up
``self._INSTRUCTION_MAP`` on the instance for each instruction of the schedule (DeepSpeed 0.19,
deepspeed/runtime/pipe/engine.py), so an instance attribute holding a copy of the class's map, with ForwardPass and
BackwardPass wrapped, reaches this engine only; ``train_batch`` is wrapped on the instance too, so that the runtime
counts the instructions of each training iteration (an ``eval_batch``'s forward passes are not counted and request
nothing). Both instance attributes are removed when the runtime exits. At each forward or backward pass the runtime
checks that the pass is the one the 1F1B order expects next (else the engine runs another schedule than the plan:
FreqoptError) and, where the pass's clock differs from the last one asked for, puts the request on the worker's queue
(freqopt.apply.runtime's worker thread): the training thread never calls NVML nor waits for it. On CUDA the
request carries an event recorded at the pass's start, so the worker sets the clock when the GPU reaches the pass,
not when the host issues it. As in Perseus (Chung et al., SOSP'24: its client sets an instruction's frequency when
the instruction begins), the clock lands one switch latency into the pass; an instruction lasts tens of
milliseconds, a switch on an H100 6-26 ms (search_spaces/h100-sxm.toml, [actuation]). The transfers, the gradient
reduction and the optimizer step run at the clock of the pass before them.

**Stragglers.** ``straggler_schedules`` plans, from the table's fronts, the pipeline's plans for a straggler
1.05x to 1.3x as slow (freqopt.pipeline.stragglers says why); a StragglerFollower (freqopt.apply.torch_pipeline_runtime)
over them, fed each iteration's ``compute_time_s`` (this pipeline's time up to its gradient reduction, so the wait
for a straggler at the reduction is not counted), picks one every N iterations, and ``follow`` runs it from the next
iteration on:

    follower = StragglerFollower(straggler_schedules(table), every_n_steps=10)   # all-reduce MAX over dp ranks
    ... engine.train_batch(data_iter)
        chosen = follower.step_done(runtime.compute_time_s)
        if chosen is not None:
            runtime.follow(chosen)

**Exit.** On leaving the ``with`` block, on an exception, or on SIGINT or SIGTERM (the NVML backend's
freqopt.gpu.nvml.GPUStateGuard), the queue is drained, the worker stopped and the backend restores what it found.

**The simulated backend.** There is no GPU to switch: the worker records each setting on the simulated GPU, and
``step_measurement()`` gives the iteration the stages' requested clocks make on the simulated pipeline the search
validates on (freqopt.pipeline.sim.SimulatedPipeline, noiseless): each instruction is its stage's forward or
backward kernels (freqopt.workload.pipeline_trace.trace_pipeline_stages), each request lands one switch latency
after the instruction that asked for it begins, the iteration is the critical path of the 1F1B instruction graph
and each stage's optimizer step, and every GPU draws the physics' blocked power at the clock in force while it
waits. This rank's stage uses the clocks it requested; the other stages the same table's plan.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from freqopt.errors import ClockTableError, FreqoptError, InvalidSettingError, check_positive_int
from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.pipeline.dag import BACKWARD, FORWARD, KINDS, stage_order
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.profile import InstructionOptions, StageProfile
from freqopt.pipeline.realize import realize_plan
from freqopt.tables import INSTRUCTION, ClockTable
from freqopt.apply.runtime import ClockWorker, stop_clock_worker

__all__ = ["table_stage_profile", "pipeline_schedules", "stage_schedule", "straggler_schedules",
           "check_pipeline_table", "PipelineRuntime", "STRAGGLER_SLOWDOWNS"]

# The straggler slowdowns straggler_schedules plans for by default: Perseus's evaluation (Chung et al., SOSP'24, §6)
# slows one pipeline 1.05x to 1.5x; beyond 1.3x the fronts of a 1 % search rarely hold a slower clock to use.
STRAGGLER_SLOWDOWNS = (0.05, 0.1, 0.15, 0.2, 0.3)


def check_pipeline_table(table: ClockTable, stages: int | None = None, *, source: str | None = None) -> None:
    """Refuse a table a pipeline cannot apply: one of another granularity (a single GPU's, a dp/tp layout's), or a
    pipeline table for another number of stages than ``stages`` (None: any).

    Raises:
        ClockTableError: one line naming the table, what it is, and what to do.
    """
    name = source or table.source or "the clock table"
    if not table.is_pipeline:
        raise ClockTableError(f"{name} is a table of granularity {table.granularity!r}; a pipeline (layout pp > 1) "
                              f"applies an {INSTRUCTION}-level table, a clock per instruction: search the pipeline at "
                              f"granularity {INSTRUCTION!r} and apply that table")  # fmt: skip
    found = table.pipeline["stages"]
    if stages is not None and found != stages:
        raise ClockTableError(f"{name} plans a pipeline of {found} stages, not {stages}: its plan is per stage; search "
                              f"the {stages}-stage pipeline (layout pp={stages}) at granularity {INSTRUCTION!r} and "
                              "apply that table")  # fmt: skip


def table_stage_profile(table: ClockTable) -> StageProfile:
    """The stage profile a pipeline table carries: per (stage, pass) its front's SM clocks (MHz), one instruction's
    time (s) and energy (J) at each, as PipelinePlanner takes it.

    Raises:
        ClockTableError: not a pipeline table.
    """
    check_pipeline_table(table)
    options = {}
    for entry in table.entries:
        front = sorted(entry["front"], key=lambda o: o["sm_clock_mhz"])
        options[(entry["stage"], entry["pass"])] = InstructionOptions(
            np.asarray([o["sm_clock_mhz"] for o in front], dtype=int), np.asarray([o["time_s"] for o in front]),
            np.asarray([o["energy_j"] for o in front]))  # fmt: skip
    return StageProfile(table.pipeline["stages"], options, table.source)


def pipeline_schedules(table: ClockTable, micro_batches: int | None = None) -> list[list[ClockSetting]]:
    """Every stage's settings, each stage's in the order it runs its instructions (stage_order): per stage
    2 x micro_batches ClockSettings, the SM clock the runtime asks for at each instruction's start: the table's
    ``requests`` where it has them (the schedule its search validated, switches asked for ahead), else the SM clock
    the plan picked (memory clock and power limit at the default).

    Args:
        table: a pipeline table (freqopt.pipeline.table.pipeline_table, load_table).
        micro_batches: micro-batches per iteration (DeepSpeed's gradient_accumulation_steps); None or the table's
            own: the table's plan. Another count re-plans the whole pipeline from the table's fronts with
            PipelinePlanner at the table's max_slowdown and blocking power (module docstring), without measuring,
            and asks for each clock one switch latency ahead (freqopt.pipeline.realize.realize_plan, with
            the table's switch_s), as the search's validated requests do.

    Raises:
        ClockTableError: not a pipeline table.
        InvalidSettingError: micro_batches not a positive integer.
        FreqoptError: the planner failed.
    """
    check_pipeline_table(table)
    pipeline = table.pipeline
    stages = pipeline["stages"]
    micro_batches = pipeline["micro_batches"] if micro_batches is None else micro_batches
    check_positive_int("micro_batches", micro_batches)
    if micro_batches == pipeline["micro_batches"]:  # the validated requests where the table has them
        plan = {(p["stage"], kind): p[kind] for p in pipeline.get("requests", pipeline["plan"]) for kind in KINDS}
        clock = {(s, kind, m): plan[(s, kind)][m] for (s, kind) in plan for m in range(micro_batches)}
        return _in_stage_order(clock, stages, micro_batches)
    profile = table_stage_profile(table)
    planner = PipelinePlanner(profile, micro_batches, blocking_power_w=pipeline["blocking_power_w"])
    return _asked_settings(profile, planner.plan(max_slowdown=table.data["max_slowdown"]), pipeline["switch_s"])


def _in_stage_order(clock: dict, stages: int, micro_batches: int) -> list[list[ClockSetting]]:
    """(stage, kind, micro-batch) -> SM clock, as every stage's settings in the order it runs its instructions."""
    return [[ClockSetting(clock[(i.stage, i.kind, i.micro_batch)]) for i in stage_order(stages, micro_batches, s)]
            for s in range(stages)]  # fmt: skip


def _asked_settings(profile: StageProfile, plan, switch_s: float) -> list[list[ClockSetting]]:
    """A planner's plan as every stage's settings, each clock asked for one switch latency ahead (realize_plan) as
    the search's validated requests are, so that the switches landing late do not slow the instructions that were
    planned fast."""
    asked = realize_plan(profile, plan, switch_s)
    clock = {(i.stage, i.kind, i.micro_batch): int(c) for i, c in zip(plan.dag.instructions, asked)}
    return _in_stage_order(clock, plan.dag.stages, plan.dag.micro_batches)


def straggler_schedules(table: ClockTable, slowdowns: Sequence[float] = STRAGGLER_SLOWDOWNS,
                        micro_batches: int | None = None) -> list[tuple[float, list[list[ClockSetting]]]]:
    """The plans a pipeline picks among to end with a straggler (a StragglerFollower's ``plans``; module
    docstring): the table's own plan (pipeline_schedules) and, for each slowdown s, the least-energy plan of the
    table's fronts whose iteration fits (1 + s) times the table's plan's time (freqopt.pipeline.stragglers.
    straggler_plan; PipelinePlanner, no new measurement), each asked for one switch latency ahead.

    Args:
        table: a pipeline table (granularity "instruction").
        slowdowns: the straggler slowdowns to plan for, fractions > 0 (default STRAGGLER_SLOWDOWNS).
        micro_batches: micro-batches per iteration; None: the table's.

    Returns:
        [(predicted iteration time s: the planner's critical path, at most the slowdown's deadline; every stage's
        settings in its 1F1B order), ...],
        the table's own plan first, then by slowdown; a follower's ``plans``, or a ``follow`` argument.

    Raises:
        ClockTableError: not a pipeline table. InvalidSettingError: a slowdown that is not a number > 0, or
            micro_batches not a positive integer. FreqoptError: the planner failed.
    """
    from freqopt.pipeline.stragglers import straggler_plan

    check_pipeline_table(table)
    for s in slowdowns:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
            raise InvalidSettingError(f"slowdowns must be fractions > 0 (0.2: a straggler 1.2x as slow), not {s!r}",
                                      argument="slowdowns")  # fmt: skip
    pipeline = table.pipeline
    micro_batches = pipeline["micro_batches"] if micro_batches is None else micro_batches
    check_positive_int("micro_batches", micro_batches)
    profile = table_stage_profile(table)
    planner = PipelinePlanner(profile, micro_batches, blocking_power_w=pipeline["blocking_power_w"])
    own_s = planner.plan(max_slowdown=table.data["max_slowdown"]).time_s
    plans = [(own_s, pipeline_schedules(table, micro_batches))]
    for s in sorted(slowdowns):
        plan = straggler_plan(planner, own_s * (1 + s))
        plans.append((plan.time_s, _asked_settings(profile, plan, pipeline["switch_s"])))
    return plans


def stage_schedule(table: ClockTable, stage: int, micro_batches: int | None = None) -> list[ClockSetting]:
    """One stage's settings in the order it runs its instructions (pipeline_schedules, whose re-planning for
    another ``micro_batches`` this shares): 2 x micro_batches ClockSettings.

    Raises:
        ClockTableError, InvalidSettingError, FreqoptError: as pipeline_schedules; InvalidSettingError also for a
            stage outside the table's pipeline.
    """
    check_pipeline_table(table)
    stages = table.pipeline["stages"]
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise InvalidSettingError(f"stage must be an integer in [0, {stages}), not {stage!r}", argument="stage")
    return pipeline_schedules(table, micro_batches)[stage]


def _pipe_instructions():
    """DeepSpeed's ForwardPass and BackwardPass instruction classes (deepspeed.runtime.pipe.schedule)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    return {FORWARD: ForwardPass, BACKWARD: BackwardPass}


def _pipe_reduce_grads():
    """DeepSpeed's ReduceGrads instruction class: the data-parallel gradient all-reduce, after the last pass."""
    from deepspeed.runtime.pipe.schedule import ReduceGrads

    return ReduceGrads


class PipelineRuntime:
    """Apply a pipeline table to one rank's DeepSpeed PipelineEngine, instruction by instruction (module docstring).

    Args:
        engine: the rank's deepspeed.runtime.pipe.engine.PipelineEngine (deepspeed.initialize of a PipelineModule);
            its ``stage_id``, ``num_stages`` and ``micro_batches`` say which stage and schedule it runs.
        table: a pipeline table (granularity "instruction") for ``engine.num_stages`` stages, or None (default
            clocks throughout, the passes still counted).
        backend: this rank's GPU (NVMLBackend), or a SimulatedGPU; closed (the GPU restored) on exit.
        stage_traces: every stage's StageTrace (trace_pipeline_stages of the workload trained), for
            step_measurement on the simulated backend; None: no step_measurement.

    Attributes:
        stage, stages, micro_batches: the engine's.
        plan: this stage's settings in its 1F1B order (stage_schedule), the table's, or all default without one.
        use_table: whether train_batch applies ``plan`` (True, with a table) or the default settings (False).
        requested: per finished training iteration, the setting each instruction asked for, in order.
        switches: requests put on the worker's queue at a pass (where the setting changes) since entered, the
            first pass's clock, asked for on entering, not counted.
        compute_time_s: the last training iteration's time (s) from its start to its gradient reduction
            (DeepSpeed's ReduceGrads instruction): this pipeline's own pace, without the wait at the data-parallel
            all-reduce for a slower pipeline (a StragglerFollower's step_done). On a GPU, CUDA events (read after
            the iteration, so the training thread never waits inside one); elsewhere the host's clock (on the
            simulated backend the CPU's training time: step_measurement gives the simulated GPU's). None before
            the first iteration.

    Raises:
        InvalidSettingError: ``engine`` is not a PipelineEngine.
        ClockTableError: ``table`` is not a pipeline table, or plans another number of stages.
    """

    def __init__(self, engine, *, table: ClockTable | None, backend: Backend,
                 stage_traces: Sequence | None = None):  # fmt: skip
        needed = ("_INSTRUCTION_MAP", "train_batch", "stage_id", "num_stages", "micro_batches")
        if not all(hasattr(engine, name) for name in needed):
            raise InvalidSettingError(f"engine must be a DeepSpeed PipelineEngine (deepspeed.initialize of a "
                                      f"PipelineModule), not {type(engine).__name__}", argument="engine")  # fmt: skip
        if table is not None:
            check_pipeline_table(table, engine.num_stages)
        self.engine, self.table, self.backend = engine, table, backend
        self.stage, self.stages = int(engine.stage_id), int(engine.num_stages)
        self.simulated = backend.simulated
        self.stage_traces = stage_traces
        self._pipelines: dict = {}  # micro-batches -> the SimulatedPipeline step_measurement runs
        self.use_table = table is not None
        self._plan_for(int(engine.micro_batches))
        self._position: int | None = None  # the instruction of the current training iteration; None outside one
        self._current: ClockSetting | None = None  # the setting last requested
        self._iteration: list[ClockSetting] = []
        self.requested: list[tuple[ClockSetting, ...]] = []
        self.switches = 0
        self._worker = ClockWorker(backend)
        self._thread = threading.Thread(target=self._worker.run, name="freqopt-dvfs-pipeline", daemon=True)
        self._hooked: dict[str, object] = {}
        self._following: list | None = None  # every stage's settings to run from the next iteration (follow)
        self._marks: list = []  # the current iteration's start and gradient-reduction marks (events or times)
        self._last_marks: list = []

    def follow(self, schedules) -> None:
        """Run ``schedules`` (every stage's settings, each in its 1F1B order: one of straggler_schedules' plans, as
        a StragglerFollower returns it, or pipeline_schedules') from the next training iteration on; the table's
        plan again on another micro-batch count.

        Raises:
            InvalidSettingError: not one list of 2 x micro_batches ClockSettings per stage.
        """
        ok = len(schedules) == self.stages and all(
            len(stage) == 2 * self.micro_batches and all(isinstance(x, ClockSetting) for x in stage)
            for stage in schedules)  # fmt: skip
        if not ok:
            raise InvalidSettingError(f"schedules must hold {self.stages} lists (one per stage) of "
                                      f"{2 * self.micro_batches} ClockSettings, as straggler_schedules gives",
                                      argument="schedules")  # fmt: skip
        self._following = [list(stage) for stage in schedules]

    @property
    def compute_time_s(self) -> float | None:
        """The last iteration's time to its gradient reduction (s; class docstring), or None before the first."""
        if len(self._last_marks) < 2:
            return None
        start, reduce = self._last_marks[:2]
        if isinstance(start, float):
            return reduce - start
        reduce.synchronize()  # recorded an iteration ago: long reached
        return start.elapsed_time(reduce) / 1e3

    def _mark(self) -> None:
        if torch.cuda.is_available() and not self.simulated:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            import time

            self._marks.append(time.perf_counter())

    def _plan_for(self, micro_batches: int) -> None:
        """This stage's order and settings for ``micro_batches``, and every stage's (for step_measurement)."""
        self.micro_batches = micro_batches
        self._order = stage_order(self.stages, micro_batches, self.stage)
        default = [[DEFAULT_SETTING] * (2 * micro_batches) for _ in range(self.stages)]
        self._schedules = pipeline_schedules(self.table, micro_batches) if self.table is not None else default
        self._defaults = default
        self.plan = tuple(self._schedules[self.stage])
        self.default_plan = tuple(default[self.stage])

    @property
    def _settings(self) -> tuple[ClockSetting, ...]:
        return self.plan if self.use_table else self.default_plan

    # -- the hooks, on the training thread -----------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        if self._worker.error is not None:
            raise self._worker.error
        if int(self.engine.micro_batches) != self.micro_batches:  # set_train_batch_size changed it: plan again
            self._plan_for(int(self.engine.micro_batches))
            self._following = None
        elif self._following is not None:
            self._schedules, self._following = self._following, None
            self.plan = tuple(self._schedules[self.stage])
        self._position, self._iteration, self._marks = 0, [], []
        self._mark()

    def _end_iteration(self) -> None:
        done, self._position = self._position, None
        if done != len(self._order):
            raise FreqoptError(f"stage {self.stage}: the engine ran {done} forward and backward passes in a training "
                               f"iteration, not the {len(self._order)} of DeepSpeed's 1F1B schedule of {self.stages} "
                               f"stages and {self.micro_batches} micro-batches; the pipeline runtime is out of step "
                               "with the engine")  # fmt: skip
        self.requested.append(tuple(self._iteration))
        self._last_marks = self._marks

    def _on_instruction(self, kind: str) -> None:
        """A forward or backward pass begins: check it is the one the 1F1B order expects, and ask for its setting
        if it differs from the last one asked for. Never waits: no NVML call, no synchronization."""
        if self._position is None:
            return  # an eval_batch's pass: not part of the plan
        if self._worker.error is not None:
            raise self._worker.error
        k = self._position
        if k >= len(self._order) or self._order[k].kind != kind:
            expected = str(self._order[k]) if k < len(self._order) else "no further pass"
            raise FreqoptError(f"stage {self.stage}: the engine ran a {kind} pass as pass {k + 1} of a training "
                               f"iteration where DeepSpeed's 1F1B schedule of {self.stages} stages and "
                               f"{self.micro_batches} micro-batches has {expected}; the pipeline runtime is out of "
                               "step with the engine")  # fmt: skip
        setting = self._settings[k]
        self._iteration.append(setting)
        self._position = k + 1
        if setting != self._current:
            event = None
            if torch.cuda.is_available() and not self.simulated:
                event = torch.cuda.Event()
                event.record()  # on the current stream: the worker waits for the GPU to reach the pass
            self._worker.requests.put((event, setting))
            self._current = setting
            self.switches += 1

    def _hook(self) -> None:
        """Wrap ForwardPass, BackwardPass and train_batch on this engine instance (module docstring)."""
        engine = self.engine
        self._hooked = {name: engine.__dict__[name] for name in ("_INSTRUCTION_MAP", "train_batch")
                        if name in engine.__dict__}  # fmt: skip
        instruction_map = dict(engine._INSTRUCTION_MAP)
        for kind, instruction in _pipe_instructions().items():
            execute = instruction_map[instruction]

            def hooked(engine_self, *args, _kind=kind, _execute=execute, **kwargs):
                self._on_instruction(_kind)
                return _execute(engine_self, *args, **kwargs)

            instruction_map[instruction] = hooked
        reduce_grads = _pipe_reduce_grads()
        reduce = instruction_map[reduce_grads]

        def marked_reduce(engine_self, *args, _execute=reduce, **kwargs):
            if self._position is not None and len(self._marks) == 1:
                self._mark()  # this pipeline's own work ends here; the all-reduce may wait for a straggler
            return _execute(engine_self, *args, **kwargs)

        instruction_map[reduce_grads] = marked_reduce
        train_batch = engine.train_batch

        def counted_train_batch(*args, **kwargs):
            self._begin_iteration()
            try:
                result = train_batch(*args, **kwargs)
            except BaseException:
                self._position = None
                raise
            self._end_iteration()
            return result

        engine._INSTRUCTION_MAP = instruction_map
        engine.train_batch = counted_train_batch

    def _unhook(self) -> None:
        engine = self.engine
        for name in ("_INSTRUCTION_MAP", "train_batch"):
            if name in self._hooked:
                setattr(engine, name, self._hooked[name])
            else:
                engine.__dict__.pop(name, None)

    # -- the simulated iteration ---------------------------------------------------------------------------------
    def step_measurement(self) -> Measurement:
        """The last training iteration on the simulated GPU (module docstring): its time (s, the critical path) and
        the energy of all its stages' GPUs (J), this stage at the settings it requested, the others at the same
        table's (or the defaults, with ``use_table`` False).

        Raises:
            TypeError: on a real GPU (time a real step; its energy is the GPU's counter), or without stage_traces.
            InvalidSettingError: no training iteration has finished yet.
        """
        if not self.simulated or self.stage_traces is None:
            raise TypeError("step_measurement() is for the simulated backend with stage_traces; on a real GPU time "
                            "the step and read the GPU's energy counter")  # fmt: skip
        if not self.requested:
            raise InvalidSettingError("no training iteration has run yet: call engine.train_batch() first")
        from freqopt.pipeline.sim import SimulatedPipeline

        last = self.requested[-1]
        settings = [list(last) if s == self.stage else (self._schedules if self.use_table else self._defaults)[s]
                    for s in range(self.stages)]  # fmt: skip
        micro_batches = len(last) // 2
        pipeline = self._pipelines.get(micro_batches)
        if pipeline is None:
            pipeline = SimulatedPipeline(self.stage_traces, self.backend.spec, micro_batches, noise=False)
            self._pipelines[micro_batches] = pipeline
        # The DAG lists its instructions stage by stage, each stage in its own order (PipelineDAG.instructions):
        # the stages' settings one after the other.
        return pipeline.true_run([setting for stage in settings for setting in stage]).as_measurement()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> PipelineRuntime:
        self._thread.start()
        self._hook()
        # The first pass's clocks, set before the first iteration begins.
        self._current = self._settings[0]
        self._worker.requests.put((None, self._current))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._unhook()
            stop_clock_worker(self._worker, self._thread)
        finally:
            self.backend.close()
