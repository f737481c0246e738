"""The clock search of a pipeline-parallel iteration on the simulated pipeline (freqopt.search.pipeline_sim): one SM
clock for the whole iteration ("iteration"), one per stage that never switches ("stage") and one per instruction
("instruction").

Stage level. One SM clock per stage for all its instructions (PipelinePlanner.plan_stage_clocks on the instruction
level's fronts), validated like the others: what balancing the stages gives without a single clock switch, the
baseline that separates that from what switching per instruction adds (issue 34).

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
measured default) for freqopt.search.pipeline_plan.PipelinePlanner, which minimizes the iteration's energy
(Perseus's accounting, the blocked power at the default clock) subject to its critical path within a deadline:
exact (HiGHS's MILP) where it is small, provably near-exact otherwise; and its whole time-energy frontier.

Switches (``realize_requests``). A runtime asks for a clock at an instruction's start and it lands
``spec.clock_switch_s`` later (170 ms on the A100 as freqopt reads it, the cautious end of 6-170 ms; longer than
the instructions). A plan asked for as it stands would run most instructions at a neighbour's clock. So the plan is
realized before it is measured: at the start of each instruction i the runtime asks for the clock that will be in
force from its landing, start_i + switch_s, until the next request lands, and that clock is the highest the plan
gives any instruction that runs, by the plan's own predicted timeline, during that window (the stage's last clock
for its optimizer step; its lowest where the window holds only waiting). No instruction then runs slower than
planned, so the plan's time holds; a switch costs energy only (a faster clock held over part of a slower
neighbour). With a latency below the gaps between instruction starts this is the plan itself; a latency longer
than the iteration lands at the same point of a later one (iterations repeat), which the realization relies on. The
planner counts blocked time at the constant blocked power of the default clock, the pipeline at the clock in force
(lower where a stage is slowed): one more difference between prediction and validation, which validation settles. The planner's deadline
is then calibrated by validating the realized plan on the noisy pipeline with switch latency (a secant step on the
upper confidence bound of the validated slowdown, from readings paired with the defaults' (PipelineValidator; issue
35, item 1), inside the bracket of deadlines known to meet and to break the budget, as
freqopt.search.allocation does for the other levels), keeping the least validated energy whose bound is within the
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
import hashlib
import math
import time as _time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from freqopt.errors import FreqoptError, InvalidSettingError, UnknownNameError
from freqopt.gpu.backends.base import ClockSetting, Measurement
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.pipeline import ALL_KINDS, PipelineDAG
from freqopt.search.pipeline_plan import (FrontierPoint, InstructionOptions, PipelinePlan, PipelinePlanner,
                                          StageProfile)  # fmt: skip
from freqopt.search.pipeline_sim import SimulatedPipeline, perseus_blocking_power_w
from freqopt.search.study import Option, UnitSearch, search_unit
from freqopt.budget import first_confirmed
from freqopt.search.validate import DEFAULT_CONFIDENCE, PairedReadings, check_confidence

__all__ = ["PIPELINE_GRANULARITIES", "PipelineSearchConfig", "Validated", "PipelineLevelResult",
           "PipelineSearchResult", "run_pipeline_search", "realize_requests", "realize_plan", "pipeline_granularities",
           "pipeline_study_prefix"]  # fmt: skip

PIPELINE_GRANULARITIES = ("iteration", "stage", "instruction")


def pipeline_granularities(granularity: str | Sequence[str]) -> tuple[str, ...]:
    """The granularities of a pipeline search, coarse to fine, from "all", one name or a sequence of names.

    Raises:
        UnknownNameError: a name that is not a pipeline granularity (the message lists them).
        InvalidSettingError: an empty sequence or something that is not a name.
    """
    names = [granularity] if isinstance(granularity, str) else granularity
    if not isinstance(names, Sequence) or not names or not all(isinstance(g, str) for g in names):
        raise InvalidSettingError(f"granularity must be 'all', {' or '.join(PIPELINE_GRANULARITIES)}, or a sequence of "
                                  f"them, not {granularity!r}", argument="granularity")  # fmt: skip
    if "all" in names:
        return PIPELINE_GRANULARITIES
    for g in names:
        if g not in PIPELINE_GRANULARITIES:
            raise UnknownNameError(f"granularity {g!r} is not searched on a pipeline (pp > 1): choose all, "
                                   f"{', '.join(PIPELINE_GRANULARITIES)}", argument="granularity")  # fmt: skip
    return tuple(g for g in PIPELINE_GRANULARITIES if g in names)


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
            level, is within the budget (issue 35, item 1); in [0.5, 1), 0.5 judging on the mean alone.
        max_validation_rounds: plans validated while calibrating the instruction level's deadline.
        frontier_points: deadlines of the time-energy frontier (PipelinePlanner.frontier).
        plan_rel_gap: the planner's proven relative optimality gap at which HiGHS stops (PipelinePlanner's
            mip_rel_gap): 0.1 %, a fifth of one energy reading's noise (SimulatedGPU's ENERGY_NOISE_REL, 0.5 %), so
            a tighter proof would only sort plans the measurements cannot tell apart.
        plan_time_limit_s: the planner's time limit per solve (s); its best plan by then, with its proven gap.
        blocked_power_w: a constant blocked power (W) in place of the physics' (SimulatedPipeline), for a
            sensitivity check against Perseus's measured figure; None: the physics'.
        seed: seeds the samplers and the simulated GPUs' noise.
        storage: Optuna storage URL; None keeps studies in memory.
        schedule, virtual_stages: the pipeline schedule (freqopt.search.pipeline.SCHEDULES: DeepSpeed's "1f1b", or
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
    plan_time_limit_s: float | None = 30.0
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


@dataclass(frozen=True)
class Validated:
    """A schedule's whole iteration measured ``n`` times on the simulated pipeline: means and standard errors.

    Attributes:
        time_s, energy_j: mean iteration time (s) and energy of all stages (J).
        time_se_s, energy_se_j: their standard errors (sample standard deviation / sqrt(n); 0 for one sample).
        n: measurements averaged.
        cost_gpu_s: the GPU-seconds they took.
        n_switches: clock switches the runtime asks for per iteration, all stages together.
        max_stage_switches: the most of them any one stage's GPU is asked for per iteration (each GPU's runtime
            thread issues its own: GPUSpec.max_switches_per_s).
        time_upper_s: for a schedule held to the budget, the upper confidence bound of its time (s), from readings
            paired with the defaults' (PipelineValidator); None otherwise.
    """

    time_s: float
    energy_j: float
    time_se_s: float
    energy_se_j: float
    n: int
    cost_gpu_s: float
    n_switches: int = 0
    max_stage_switches: int = 0
    time_upper_s: float | None = None

    @property
    def time_bound_s(self) -> float:
        """The time the budget holds this schedule to, s: ``time_upper_s`` where computed, else ``time_s``."""
        return self.time_s if self.time_upper_s is None else self.time_upper_s

    @property
    def switches_per_s(self) -> float:
        """The busiest stage's GPU's clock switches per second (max_stage_switches / time_s)."""
        return self.max_stage_switches / self.time_s if self.time_s > 0 else 0.0


class PipelineValidator:
    """Measures whole iterations of the simulated pipeline, ``repeats`` times per distinct schedule, logged in
    ``log`` (read back on resume) and counted. A schedule held to a time limit is held to it at ``confidence`` as
    the one-GPU levels' are (freqopt.search.validate.Validator): each reading paired with one of the defaults taken
    just before it, its ``time_upper_s`` the upper confidence bound of its time (PairedReadings), read again one pair
    at a time while that bound is over the limit and its mean is not clearly over it, up to ``max_repeats``."""

    def __init__(self, pipeline: SimulatedPipeline, repeats: int, log: MeasurementLog, *,
                 confidence: float = DEFAULT_CONFIDENCE, max_repeats: int | None = None):  # fmt: skip
        self.pipeline, self.repeats, self.log = pipeline, repeats, log
        self.max_repeats = max(max_repeats or repeats, repeats)
        self.paired = PairedReadings(confidence)
        self.cache: dict[tuple, Validated] = {}
        self.samples: dict[tuple, list[Measurement]] = {}
        self.pairs: dict[tuple, list[Measurement]] = {}
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    def _take(self, tag: str, r: int, requests: tuple, switching: bool, key: str) -> Measurement:
        m = self.log.measure(tag, r, lambda i: self.pipeline.run(list(requests), switching=switching, key=key,
                                                                 sample=i).as_measurement())  # fmt: skip
        self.n_measurements += 1
        self.cost_gpu_s += m.cost_gpu_s
        return m

    def _read(self, ident: tuple, n: int, key: str, paired: bool) -> None:
        """At least ``n`` readings of ``ident`` ((requests, switching), or ("confirm", requests, switching): the
        confirmation's, under their own log tag and noise key), each after one of the defaults with ``paired``."""
        fresh = ident[0] == "confirm"
        requests, switching = ident[-2:]
        samples = self.samples.setdefault(ident, [])
        pairs = self.pairs.setdefault(ident, [])
        tag = ("confirm-" if fresh else "") + digest(("pipeline", requests, switching))
        key = f"{key}-confirm" if fresh else key
        self.paired.read(ident, samples, pairs, n, paired=paired,
                         take=lambda r: self._take(tag, r, requests, switching, key),
                         take_default=lambda r: self._take(f"paired-{tag}", r, (None,) * len(requests), True,
                                                           f"paired-{tag}"))  # fmt: skip

    def _validated(self, ident: tuple, *, bounded: bool) -> Validated:
        requests, switching = ident[-2:]
        ms = self.samples[ident]
        t = np.array([m.time_s for m in ms])
        e = np.array([m.energy_j for m in ms])
        n = len(ms)
        se = (lambda x: float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0)
        upper = None
        if bounded:
            base = self.cache[((None,) * len(requests), True)]
            upper = self.paired.upper_time_s(ident, float(t.mean()), base.time_s, self._default_times(requests))
        return Validated(float(t.mean()), float(e.mean()), se(t), se(e), n,
                         float(sum(m.cost_gpu_s for m in ms + self.pairs.get(ident, []))),
                         *(_n_switches(self.pipeline.dag, requests) if switching else (0, 0)), time_upper_s=upper)

    def confirm(self, requests: Sequence[int | None], *, switching: bool = True, key: str = "schedule") -> Validated:
        """The schedule read again afresh (freqopt.search.validate.Validator.confirm): ``max_repeats`` new
        readings, each paired with a new one of the defaults; their means, bounded from them alone."""
        requests = tuple(None if r is None else int(r) for r in requests)
        if requests == (None,) * len(requests) and switching:
            return self.cache[(requests, True)]
        ident = ("confirm", requests, switching)
        self._read(ident, self.max_repeats, key, True)
        self.cache[ident] = self._validated(ident, bounded=True)
        return self.cache[ident]

    def _default_times(self, requests: tuple) -> list[float]:
        return [m.time_s for m in self.samples.get(((None,) * len(requests), True), ())]

    def __call__(self, requests: Sequence[int | None], *, switching: bool = True, key: str = "schedule",
                 limit_s: float | None = None) -> Validated:  # fmt: skip
        """The iteration with ``requests`` (per instruction, dag.instructions order: the SM clock in MHz the runtime
        asks for at its start; None: the default) measured ``repeats`` times; with ``limit_s`` (s per iteration,
        the baseline read first), paired and bounded (class docstring)."""
        requests = tuple(None if r is None else int(r) for r in requests)
        ident = (requests, switching)
        paired = limit_s is not None and ident != ((None,) * len(requests), True)
        if ident in self.cache and (not paired or self.cache[ident].time_upper_s is not None):
            return self.cache[ident]
        self._read(ident, self.repeats, key, paired)
        if paired:
            ratio_limit = limit_s / self.cache[((None,) * len(requests), True)].time_s
            times = self._default_times(requests)
            while len(self.samples[ident]) < self.max_repeats and self.paired.undecided(ident, ratio_limit, times):
                self._read(ident, len(self.samples[ident]) + 1, key, paired)
        self.cache[ident] = self._validated(ident, bounded=paired)
        return self.cache[ident]


def _n_switches(dag: PipelineDAG, requests: Sequence) -> tuple[int, int]:
    """Changes of the requested clock per iteration, each GPU's order read cyclically (iterations repeat): all
    GPUs' together, and the most of any one GPU's (1F1B: one stage per GPU)."""
    counts = []
    for g in range(dag.gpus):
        seq = [r for inst, r in zip(dag.instructions, requests) if dag.gpu_of(inst) == g]
        counts.append(sum(1 for a, b in zip(seq, seq[1:] + seq[:1]) if a != b))
    return sum(counts), max(counts, default=0)


@dataclass(frozen=True)
class PipelineLevelResult:
    """The validated outcome of one pipeline granularity.

    Attributes:
        granularity: "iteration", "stage" (one clock per stage, never switching) or "instruction".
        requests: per instruction (dag.instructions order), the SM clock (MHz; None: the default) the runtime asks
            for at the instruction's start: the realized schedule that was validated.
        planned: per instruction, the SM clock (MHz) it was planned to run at (the iteration level: its one clock).
        predicted_time_s, predicted_energy_j: what the search predicted before validating (the iteration level:
            its option's mean; the instruction level: the planner's iteration, Perseus's accounting without the
            optimizer step), and predicted_baseline_time_s, predicted_baseline_energy_j the same at the defaults.
        validated: the realized schedule measured on the noisy pipeline with switch latency.
        ideal: the instruction level searched again with free, instant switching (the plans measured as they
            stand, the budget calibrated the same way), else None.
        n_measurements, search_cost_gpu_s, search_wall_s: what the level's search took (its studies and its
            validations; the instruction level counts the iteration level's clock only where it validated it).
        unit_searches: the studies' outcomes.
        plan: the instruction level's PipelinePlan (its gap, its frontier); None for the iteration level, or where
            a candidate (the iteration level's clock, the defaults) validated better than every plan.
        frontier: the instruction level's predicted time-energy frontier (PipelinePlanner.frontier), else ().
        saving_pct_waiting_range: the level's noiseless energy saving (%) at the two ends of the blocked GPUs'
            power range (freqopt.gpu.specs.WaitingPower): (waiting power flat in the clock, as modelled); None
            where the search was given a constant blocked power.
    """

    granularity: str
    requests: tuple[int | None, ...]
    planned: tuple[int | None, ...]
    predicted_time_s: float
    predicted_energy_j: float
    predicted_baseline_time_s: float
    predicted_baseline_energy_j: float
    validated: Validated
    n_measurements: int
    search_cost_gpu_s: float
    search_wall_s: float
    unit_searches: tuple[UnitSearch, ...] = field(default=(), repr=False)
    ideal: Validated | None = None
    plan: PipelinePlan | None = field(default=None, repr=False)
    frontier: tuple[FrontierPoint, ...] = field(default=(), repr=False)
    saving_pct_waiting_range: tuple[float, float] | None = None

    @property
    def predicted_energy_saved_pct(self) -> float:
        return 100.0 * (1.0 - self.predicted_energy_j / self.predicted_baseline_energy_j)

    @property
    def predicted_slowdown_pct(self) -> float:
        return 100.0 * (self.predicted_time_s / self.predicted_baseline_time_s - 1.0)


def _saving(v: Validated, base: Validated) -> tuple[float, float]:
    """(energy saved %, its standard error %) of ``v`` against ``base``."""
    ratio = v.energy_j / base.energy_j
    se = ratio * math.hypot(v.energy_se_j / v.energy_j, base.energy_se_j / base.energy_j)
    return 100.0 * (1.0 - ratio), 100.0 * se


def _slowdown(v: Validated, base: Validated) -> tuple[float, float]:
    """(slowdown %, its standard error %) of ``v`` against ``base``."""
    ratio = v.time_s / base.time_s
    se = ratio * math.hypot(v.time_se_s / v.time_s, base.time_se_s / base.time_s)
    return 100.0 * (ratio - 1.0), 100.0 * se


@dataclass(frozen=True)
class PipelineSearchResult:
    """A pipeline search's outcome: everything a pipeline clock table holds, and the validated figures per level.

    Attributes:
        workload: the model, micro-batch and layout (pp > 1).
        gpu: the GPU type's name; spec: the GPU type (its switch latency as searched).
        micro_batches: M; partition_method: how the stages were partitioned; schedule: the pipeline schedule
            (SCHEDULES); dag: its instruction DAG (None: 1F1B's).
        max_slowdown: the budget (fraction).
        baseline: the default iteration, validated (every GPU at its defaults).
        profile: the StageProfile built from the fronts ((stage, kind) -> InstructionOptions, the default as the
            highest SM clock); None without the instruction level.
        defaults, fronts: (stage, kind) -> its measured default (Option: time_s, energy_j, n_samples) and its front
            (the options the planner got, the default first, as Options).
        blocking_power_w: the constant blocked power the planner counts (W): the physics' at the default clock.
        perseus_blocking_power_w: Perseus's measured P2P-blocking power for this GPU type (W), or None.
        switch_s: the clock-switch latency searched with (s).
        levels: granularity -> PipelineLevelResult, coarse to fine.
        storage: the Optuna storage URL (None: in memory); seed: the samplers' and noise's seed.
        n_new_measurements, n_stored_measurements: measurements this call took, and those read back from storage.
        wall_s: the whole search's wall time (s).
        table_path: the pipeline clock table written (freqopt.api.search_pipeline with ``out``), else None.
        confidence: the one-sided confidence level at which each level's slowdown was held to the budget.
    """

    workload: object
    gpu: str
    spec: GPUSpec = field(repr=False)
    micro_batches: int
    partition_method: str
    max_slowdown: float
    baseline: Validated
    profile: StageProfile | None
    defaults: dict
    fronts: dict
    blocking_power_w: float
    perseus_blocking_power_w: float | None
    switch_s: float
    levels: dict
    storage: str | None
    seed: int
    n_new_measurements: int = 0
    n_stored_measurements: int = 0
    wall_s: float = 0.0
    schedule: str = "1f1b"
    table_path: object = None
    confidence: float | None = None
    dag: PipelineDAG | None = field(default=None, repr=False)

    @property
    def stages(self) -> int:
        return self.workload.layout.pp

    @property
    def plan(self) -> PipelinePlan | None:
        """The instruction level's PipelinePlan (None without it)."""
        level = self.levels.get("instruction")
        return level.plan if level else None

    def energy_saved_pct(self, g: str) -> float:
        return _saving(self.levels[g].validated, self.baseline)[0]

    def energy_saved_se_pct(self, g: str) -> float:
        return _saving(self.levels[g].validated, self.baseline)[1]

    def slowdown_pct(self, g: str) -> float:
        return _slowdown(self.levels[g].validated, self.baseline)[0]

    def slowdown_se_pct(self, g: str) -> float:
        return _slowdown(self.levels[g].validated, self.baseline)[1]

    def slowdown_bound_pct(self, g: str) -> float | None:
        """The upper confidence bound (%, at ``confidence``) of level ``g``'s slowdown, from readings paired with
        the defaults' (Validated.time_upper_s): the figure held to the budget; None where none was computed."""
        upper = self.levels[g].validated.time_upper_s
        return None if upper is None else 100.0 * (upper / self.baseline.time_s - 1.0)

    def ideal_energy_saved_pct(self, g: str) -> float | None:
        ideal = self.levels[g].ideal
        return None if ideal is None else _saving(ideal, self.baseline)[0]

    def ideal_slowdown_pct(self, g: str) -> float | None:
        ideal = self.levels[g].ideal
        return None if ideal is None else _slowdown(ideal, self.baseline)[0]

    def __repr__(self) -> str:
        w = self.workload
        rows = "; ".join(f"{g}: {-self.energy_saved_pct(g):+.2f} % energy at {self.slowdown_pct(g):+.2f} % time"
                         for g in self.levels)  # fmt: skip
        return (f"PipelineSearchResult(model={w.model!r}, gpu={self.gpu!r}, {w.layout}, micro_batches="
                f"{self.micro_batches}, max_slowdown={100 * self.max_slowdown:g}%, baseline {self.baseline.time_s:.6g} s "
                f"{self.baseline.energy_j:.6g} J, validated {rows or 'no granularity'})")  # fmt: skip

    def stage_requests(self, granularity: str = "instruction") -> list[dict]:
        """The level's realized schedule stage by stage, each stage's instructions in the order it runs them:
        ``[{"stage": s, "instructions": [{"kind", "micro_batch", "sm_clock_mhz"}, ...]}, ...]``, sm_clock_mhz the
        clock (MHz) the runtime asks for at the instruction's start (the default as the highest SM clock)."""
        return self._stages_of(self.levels[granularity].requests)

    def _stages_of(self, clocks: Sequence[int | None]) -> list[dict]:
        """Per GPU ("stage": its pipeline rank), its instructions in the order it runs them; where the schedule
        runs several model stages per GPU, each instruction also names its "model_stage"."""
        from freqopt.search.pipeline import one_f_one_b

        dag = self.dag if self.dag is not None else one_f_one_b(self.stages, self.micro_batches)
        out: list[dict] = [{"stage": s, "instructions": []} for s in range(self.stages)]
        for inst, clock in zip(dag.instructions, clocks):
            entry = {"kind": inst.kind, "micro_batch": inst.micro_batch,
                     "sm_clock_mhz": self.spec.max_sm_clock_mhz if clock is None else int(clock)}
            if dag.gpu_of_stage is not None:
                entry["model_stage"] = inst.stage
            out[dag.gpu_of(inst)]["instructions"].append(entry)  # type: ignore[union-attr]
        return out

    def pipeline_doc(self) -> dict:
        """What a pipeline clock table holds (/work/wt/pipeline_contract.md): ``{"units": [{"unit", "stage",
        "pass", "default": {"time_s", "energy_j", "n_samples"}, "front": [{"sm_clock_mhz", "time_s", "energy_j",
        "n_samples"}, ...]}, ...], "pipeline": {"stages", "micro_batches", "schedule", "partition_method",
        "blocking_power_w", "switch_s", "plan", "requests"}}``. "plan" is the clock each instruction is planned to
        run at, in PipelinePlan.stage_clocks()'s form (the default as the highest SM clock); "requests" the clock
        the runtime asks for at each instruction's start so that the plan lands despite the switch latency
        (stage_requests; what was validated).

        Raises:
            InvalidSettingError: the instruction level was not searched, or the schedule is not 1F1B.
        """
        if "instruction" not in self.levels:
            raise InvalidSettingError("granularity instruction was not searched: a pipeline table needs its fronts",
                                      argument="granularity")  # fmt: skip
        if self.schedule != "1f1b":
            raise InvalidSettingError(f"schedule {self.schedule}: a pipeline clock table holds DeepSpeed's 1F1B only "
                                      "so far; read this schedule's plan from .stage_requests()", argument="schedule")  # fmt: skip
        units = []
        for (stage, kind), default in sorted(self.defaults.items(), key=lambda kv: (kv[0][0], ALL_KINDS.index(kv[0][1]))):
            front = [{"sm_clock_mhz": _clock(self.spec, o.setting), "time_s": o.time_s, "energy_j": o.energy_j,
                      "n_samples": o.n_samples} for o in self.fronts[(stage, kind)]]  # fmt: skip
            units.append({"unit": f"stage{stage}.{kind}", "stage": stage, "pass": kind,
                          "default": {"time_s": default.time_s, "energy_j": default.energy_j,
                                      "n_samples": default.n_samples}, "front": front})  # fmt: skip
        return {"units": units, "pipeline": {
            "stages": self.stages, "micro_batches": self.micro_batches, "schedule": self.schedule,
            "partition_method": self.partition_method, "blocking_power_w": self.blocking_power_w,
            "switch_s": self.switch_s, "plan": self._stages_of(self.levels["instruction"].planned),
            "requests": self.stage_requests()}}

    def summary(self) -> dict:
        """The JSON document ``freqopt search --layout ...,pp=S --json`` writes: ``{"workload", "gpu",
        "micro_batches", "schedule", "max_slowdown_pct", "switch_s", "blocking_power_w", "perseus_blocking_power_w",
        "max_switches_per_s", "confidence", "baseline": {"time_s", "energy_j", "time_se_s", "energy_se_j"}, "results": {GRANULARITY:
        {"energy_saved_pct", "energy_saved_se_pct", "slowdown_pct", "slowdown_se_pct", "slowdown_bound_pct",
        "ideal_energy_saved_pct",
        "ideal_slowdown_pct", "predicted_energy_saved_pct", "predicted_slowdown_pct", "predicted_baseline":
        {"time_s", "energy_j"}, "n_switches", "switches_per_s", "saving_pct_waiting_range",
        "n_measurements", "search_cost_gpu_s", "search_wall_s", "plan_gap", "frontier": [{"time_s", "energy_j",
        "lower_bound_j", "deadline_s"}]}}, "n_new_measurements", "wall_s", "table"}`` ("table": the pipeline clock
        table's path, or null); "slowdown_bound_pct": the upper confidence bound of the slowdown at "confidence",
        held to the budget (None where none was computed); percentages of the validated
        baseline (predicted: of the search's own default prediction); "switches_per_s": the busiest stage's GPU's
        clock switches per second, beside "max_switches_per_s", the most one runtime thread can issue
        (GPUSpec.max_switches_per_s); "saving_pct_waiting_range": [the noiseless saving with a blocked GPU's power
        flat in the clock, as modelled] (PipelineLevelResult.saving_pct_waiting_range), or null."""
        w = self.workload
        doc = {"workload": {"model": w.model, "micro_batch_size": w.micro_batch_size, "seq_len": w.config.seq_len,
                            "layout": w.layout.as_dict(), "partition_method": self.partition_method},
               "gpu": self.gpu, "micro_batches": self.micro_batches, "schedule": self.schedule,
               "max_slowdown_pct": 100 * self.max_slowdown,
               "switch_s": self.switch_s, "blocking_power_w": self.blocking_power_w,
               "perseus_blocking_power_w": self.perseus_blocking_power_w,
               "baseline": {"time_s": self.baseline.time_s, "energy_j": self.baseline.energy_j,
                            "time_se_s": self.baseline.time_se_s, "energy_se_j": self.baseline.energy_se_j},
               "max_switches_per_s": self.spec.max_switches_per_s, "confidence": self.confidence,
               "results": {}, "n_new_measurements": self.n_new_measurements, "wall_s": self.wall_s,
               "table": None if self.table_path is None else str(self.table_path)}  # fmt: skip
        for g, r in self.levels.items():
            doc["results"][g] = {
                "energy_saved_pct": self.energy_saved_pct(g), "energy_saved_se_pct": self.energy_saved_se_pct(g),
                "slowdown_pct": self.slowdown_pct(g), "slowdown_se_pct": self.slowdown_se_pct(g),
                "slowdown_bound_pct": self.slowdown_bound_pct(g),
                "ideal_energy_saved_pct": self.ideal_energy_saved_pct(g),
                "ideal_slowdown_pct": self.ideal_slowdown_pct(g),
                "predicted_energy_saved_pct": r.predicted_energy_saved_pct,
                "predicted_slowdown_pct": r.predicted_slowdown_pct,
                "predicted_baseline": {"time_s": r.predicted_baseline_time_s,
                                       "energy_j": r.predicted_baseline_energy_j},
                "n_switches": r.validated.n_switches, "switches_per_s": r.validated.switches_per_s,
                "saving_pct_waiting_range": (list(r.saving_pct_waiting_range) if r.saving_pct_waiting_range
                                             else None),
                "n_measurements": r.n_measurements, "search_cost_gpu_s": r.search_cost_gpu_s,
                "search_wall_s": r.search_wall_s, "plan_gap": r.plan.gap if r.plan is not None else None,
                "frontier": [{"time_s": p.time_s, "energy_j": p.energy_j, "lower_bound_j": p.lower_bound_j,
                              "deadline_s": p.deadline_s} for p in r.frontier],
            }  # fmt: skip
        return doc


def _clock(spec: GPUSpec, setting: ClockSetting) -> int:
    """A setting's SM clock (MHz), the default being the highest."""
    return spec.max_sm_clock_mhz if setting.sm_clock_mhz is None else int(setting.sm_clock_mhz)


def pipeline_study_prefix(workload, spec: GPUSpec, partition_method: str, seed: int) -> str:
    """A study-name prefix unique to the workload (model, sizes, micro-batch, layout), the stages' partition, the GPU
    type (all its constants, the switch latency included) and the seed; not the micro-batch count, which only the
    iteration level's and the validations' names hold (the instruction fronts do not depend on it)."""
    ident = f"{workload.model}|{workload.config}|{workload.micro_batch_size}|{workload.layout!r}|{partition_method}|{spec!r}|{seed}"
    layout = workload.layout
    return (f"{workload.model}-dp{layout.dp}tp{layout.tp}pp{layout.pp}-{spec.name}-"
            f"{hashlib.sha1(ident.encode()).hexdigest()[:8]}")


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


def realize_requests(dag: PipelineDAG, clocks_mhz: Sequence[int], times_s: Sequence[float], switch_s: float, *,
                     tail_s: float = 0.0) -> list[int]:  # fmt: skip
    """The clocks a runtime asks for at each instruction's start so that a plan lands despite the switch latency
    (module docstring): no instruction runs slower than planned, as predicted.

    Args:
        dag: the pipeline's instruction DAG.
        clocks_mhz: the plan, one SM clock (MHz) per instruction (dag.instructions order), shape (N,).
        times_s: each instruction's predicted time at its planned clock (s), shape (N,): the planned timeline is
            every instruction at its earliest start (PipelineDAG.start_times_s).
        switch_s: the switch latency (s): a request lands this long after the instruction that asks for it starts.
        tail_s: the once-per-iteration work after the last instruction (the optimizer step, s), which each stage
            runs at the clock of its last instruction; iterations repeat with period critical path + tail_s.

    Returns:
        Per instruction (dag.instructions order), the SM clock (MHz) to ask for at its start (ask only where it
        differs from the stage's previous request): the highest planned clock among the instructions running while
        that request is in force, [start + switch_s, next start + switch_s), read cyclically over iterations; the
        stage's lowest planned clock where only waiting falls in that window. With switch_s = 0, the plan itself.
    """
    clocks = np.asarray(clocks_mhz, dtype=int)
    times = np.asarray(times_s, dtype=float)
    starts = dag.start_times_s(times)
    ends = starts + times
    period = float(np.max(ends)) + tail_s
    lead = switch_s % period if period > 0 else 0.0
    eps = 1e-12 * max(period, 1.0)
    requests = np.empty(dag.n, dtype=int)
    for g in range(dag.gpus):
        idx = np.asarray([j for j, inst in enumerate(dag.instructions) if dag.gpu_of(inst) == g])  # the GPU's order
        st, en, c = starts[idx], ends[idx], clocks[idx]
        # The intervals whose clock is required: the instructions, and the optimizer step at the last one's clock.
        iv_s = np.r_[st, float(np.max(ends))] if tail_s > 0 else st
        iv_e = np.r_[en, period] if tail_s > 0 else en
        iv_c = np.r_[c, c[-1]] if tail_s > 0 else c
        nxt = np.r_[st[1:], st[0] + period]
        for q in range(len(idx)):
            lo, hi = st[q] + lead, nxt[q] + lead  # while this request is in force
            need = None
            for k in (-1, 0, 1, 2):  # copies of the iteration before and after
                hit = (iv_s + k * period < hi - eps) & (iv_e + k * period > lo + eps)
                if hit.any():
                    top = int(iv_c[hit].max())
                    need = top if need is None else max(need, top)
            requests[idx[q]] = int(c.min()) if need is None else need
    return [int(r) for r in requests]


def _options_of(search: UnitSearch, spec: GPUSpec) -> tuple[Option, ...]:
    """A study's options for the planner: the default (at the highest SM clock) first, then the others by clock,
    one per SM clock (an explicit highest clock gives way to the default, which holds more samples)."""
    seen = {spec.max_sm_clock_mhz}
    out = [search.default]
    for o in sorted(search.options[1:], key=lambda o: -_clock(spec, o.setting)):
        clock = _clock(spec, o.setting)
        if clock in seen or o.setting.power_limit_w is not None:
            continue
        seen.add(clock)
        out.append(o)
    return tuple(out)


def _profile(fronts: dict, spec: GPUSpec, stages: int) -> StageProfile:
    options = {}
    for key, opts in fronts.items():
        options[key] = InstructionOptions(np.asarray([_clock(spec, o.setting) for o in opts], dtype=int),
                                          np.asarray([o.time_s for o in opts]), np.asarray([o.energy_j for o in opts]))
    return StageProfile(stages, options, "freqopt.search.pipeline_search")


def _planned_times(profile: StageProfile, dag: PipelineDAG, clocks: Sequence[int]) -> np.ndarray:
    """Each instruction's time (s) at its planned clock, from the profile, shape (N,)."""
    out = np.empty(dag.n)
    for i, (inst, clock) in enumerate(zip(dag.instructions, clocks)):
        opts = profile.options[(inst.stage, inst.kind)]
        out[i] = opts.time_s[int(np.flatnonzero(opts.sm_clock_mhz == clock)[0])]
    return out


def realize_plan(profile: StageProfile, plan: PipelinePlan, switch_s: float, *, tail_s: float = 0.0) -> list[int]:
    """The requests (realize_requests) that make ``plan`` land despite a switch latency of ``switch_s`` (s), its
    timeline predicted from ``profile`` (each instruction's time at its planned clock): per instruction
    (plan.dag.instructions order), the SM clock (MHz) to ask for at its start. Used by the search on the plans it
    validates and by freqopt.apply.pipeline_runtime on a plan made again for another micro-batch count."""
    times = _planned_times(profile, plan.dag, plan.sm_clock_mhz)
    return realize_requests(plan.dag, plan.sm_clock_mhz, times, switch_s, tail_s=tail_s)


def _calibrated(planner: PipelinePlanner, realize: Callable, validator: PipelineValidator, baseline: Validated,
                max_slowdown: float, rounds: int, candidates: Sequence, *, key: str, switching: bool = True,
                plan_with: Callable | None = None):
    """The planner's plan whose realized schedule has the least validated energy within ``max_slowdown`` (the upper
    confidence bound of its time, confirmed on fresh readings: PipelineValidator.confirm) and whose busiest GPU's
    clock switches one runtime thread can issue (GPUSpec.max_switches_per_s; issue 35, item 6), its
    budget (relative to the planner's fastest plan) moved by the validated slowdown: a secant step, kept inside the
    bracket of budgets known to meet and to break the limit, else their geometric mean (as
    freqopt.search.allocation.allocate_validated). ``candidates``: (planned, requests, validated) already measured,
    kept when they win (a fourth element, the candidate's PipelinePlan, is returned as the plan). ``plan_with(max_slowdown=...)`` plans (default planner.plan; the stage level's
    planner.plan_stage_clocks).

    Returns:
        (plan or None where a candidate or the defaults won, requests, Validated, planned clocks).
    """
    b = max_slowdown
    fastest = planner.fastest()
    limit_s = baseline.time_s * (1.0 + b)
    accepted = []  # (plan, requests, Validated, planned, switching) of every schedule whose bound met the limit

    spec = validator.pipeline.spec

    def consider(plan, requests, v, planned, switched) -> None:
        deliverable = not spec.over_switch_limit(v.switches_per_s)  # one runtime thread per GPU can issue them
        if v.time_bound_s <= limit_s and v.energy_j < baseline.energy_j and deliverable:
            accepted.append((plan, requests, v, planned, switched))

    for planned, requests, v, *plan in candidates:  # a candidate may carry its plan (the stage level's)
        consider(plan[0] if plan else None, requests, v, planned, True)
    target = b * baseline.time_s / fastest.time_s  # the same seconds of slack on the planner's own (shorter) time
    meets, breaks = None, None
    for _ in range(rounds):
        try:
            plan = (plan_with or planner.plan)(max_slowdown=min(max(target, 0.0), 0.999))
        except FreqoptError:  # HiGHS found no plan within its time limit: a looser budget next
            meets = target
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
    unique = sorted({(a[1], a[4]): a for a in accepted}.values(), key=lambda a: a[2].energy_j)
    hit = first_confirmed(unique, lambda a: validator.confirm(a[1], switching=a[4], key=key),
                          lambda m: m.time_bound_s <= limit_s and m.energy_j < baseline.energy_j)
    if hit is None:
        return None, (None,) * planner.dag.n, baseline, (None,) * planner.dag.n
    (plan, requests, _, planned, _), fresh = hit
    return plan, requests, fresh, planned


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
    import optuna

    started = _time.perf_counter()
    workload = stage_traces[0].workload
    pipeline = SimulatedPipeline(stage_traces, spec, micro_batches, seed=config.seed,
                                 blocked_power_w=config.blocked_power_w, schedule=config.schedule,
                                 virtual_stages=config.virtual_stages)  # fmt: skip
    dag = pipeline.dag
    prefix = pipeline_study_prefix(workload, spec, partition_method, config.seed)
    if pipeline.stages != workload.layout.pp:  # traced as more model stages than GPUs: other instructions
        prefix += f"-x{pipeline.stages}"
    whole = (f"{prefix}-m{micro_batches}" + ("" if config.blocked_power_w is None else f"-p{config.blocked_power_w:g}")
             + ("" if config.schedule == "1f1b" else f"-{config.schedule}"))
    log = MeasurementLog(optuna.create_study(study_name=f"{whole}-validation", storage=storage,
                                             load_if_exists=True))  # fmt: skip
    validator = PipelineValidator(pipeline, config.validation_repeats, log, confidence=config.confidence,
                                  max_repeats=config.validation_max_repeats)  # fmt: skip
    b = config.max_slowdown
    default_requests = (None,) * dag.n
    baseline = validator(default_requests, key="baseline")
    levels: dict[str, PipelineLevelResult] = {}
    searches_all: list[UnitSearch] = []
    defaults, fronts, profile = {}, {}, None
    if "iteration" in config.granularities:
        t0 = _time.perf_counter()
        before = (validator.n_measurements, validator.cost_gpu_s)
        search = search_unit(_WholePipeline(pipeline), stage_traces[0].kernels[:1], name="iteration",
                             study_name=f"{whole}-iteration", storage=storage,
                             n_trials=config.n_trials, finalist_repeats=config.finalist_repeats,
                             finalist_slowdown=1.5 * b + 0.005, seed=config.seed, constrained=True, whole_step=True,
                             mem_clock_mhz=spec.max_mem_clock_mhz)  # fmt: skip
        searches_all.append(search)
        if on_unit:
            on_unit("iteration", 1, 1)
        best = (default_requests, baseline, search.default)
        limit = search.default.time_s * (1.0 + b)
        candidates = sorted((o for o in search.options[1:] if o.time_s <= limit), key=lambda o: o.energy_j)
        for option in candidates[:config.max_validation_rounds]:
            requests = (_clock(spec, option.setting),) * dag.n
            v = validator(requests, key="iteration", limit_s=baseline.time_s * (1.0 + b))
            if v.time_bound_s <= baseline.time_s * (1.0 + b) and v.energy_j < best[1].energy_j:
                v = validator.confirm(requests, key="iteration")  # its figures from readings after the choice
                if v.time_bound_s <= baseline.time_s * (1.0 + b) and v.energy_j < best[1].energy_j:
                    best = (requests, v, option)
                    break
        requests, v, option = best
        levels["iteration"] = PipelineLevelResult(
            "iteration", requests, requests, option.time_s, option.energy_j, search.default.time_s,
            search.default.energy_j, v, search.n_measurements + validator.n_measurements - before[0],
            search.cost_gpu_s + validator.cost_gpu_s - before[1], _time.perf_counter() - t0, (search,))  # fmt: skip
    if {"stage", "instruction"} & set(config.granularities):  # both plan on the instructions' measured fronts
        t0 = _time.perf_counter()
        before = (validator.n_measurements, validator.cost_gpu_s)
        gpu = SimulatedGPU(spec, seed=config.seed)
        searches = []
        keys = sorted({(i.stage, i.kind) for i in dag.instructions}, key=lambda key: (key[0], ALL_KINDS.index(key[1])))
        total = len(keys)
        for s, kind in keys:  # one study per model stage and instruction kind
            unit = f"stage{s}.{kind}"
            search = search_unit(gpu, pipeline.instruction_kernels(s, kind), name=unit,
                                 study_name=f"{prefix}-instruction-{unit}", storage=storage,
                                 n_trials=config.n_trials, finalist_repeats=config.finalist_repeats,
                                 finalist_slowdown=max(0.05, 3 * b), seed=config.seed, whole_step=True,
                                 mem_clock_mhz=spec.max_mem_clock_mhz)  # fmt: skip
            searches.append(search)
            defaults[(s, kind)] = search.default
            fronts[(s, kind)] = _options_of(search, spec)
            if on_unit:
                on_unit("instruction", len(searches), total)
        searches_all.extend(searches)
        profile = _profile(fronts, spec, dag.stages)
        blocking_w = pipeline.blocked_power_w()
        planner = PipelinePlanner(profile, micro_batches, blocking_power_w=blocking_w, mip_rel_gap=config.plan_rel_gap,
                                  time_limit_s=config.plan_time_limit_s, schedule=config.schedule,
                                  virtual_stages=config.virtual_stages)  # fmt: skip
        fastest = planner.fastest()
        # The once-per-iteration tail (optimizer step): the validated default iteration beyond the planned one.
        tail_s = max(0.0, baseline.time_s - fastest.time_s)

        def realize(plan: PipelinePlan) -> tuple[int, ...]:
            return tuple(realize_plan(profile, plan, spec.clock_switch_s, tail_s=tail_s))

        candidates = []
        if "iteration" in levels:  # its one clock, as validated: the finer levels never end worse
            it = levels["iteration"]
            candidates.append((it.planned, it.requests, it.validated))
        fronts_cost = (sum(s.n_measurements for s in searches), sum(s.cost_gpu_s for s in searches))
        fronts_wall = _time.perf_counter() - t0
        if "stage" in config.granularities:
            # One clock per stage, never switching: what balancing the stages alone gives (issue 34). Its requests
            # are its clocks (nothing to ask ahead); it counts the fronts' measurements as its own.
            t1, mid = _time.perf_counter(), (validator.n_measurements, validator.cost_gpu_s)
            stage_plan, stage_requests, stage_v, stage_planned = _calibrated(
                planner, lambda plan: tuple(int(c) for c in plan.sm_clock_mhz), validator, baseline, b,
                config.max_validation_rounds, candidates, key="stage", plan_with=planner.plan_stage_clocks)
            stage_predicted = stage_plan if stage_plan is not None else fastest
            levels["stage"] = PipelineLevelResult(
                "stage", tuple(stage_requests), tuple(int(c) if c is not None else None for c in stage_planned),
                stage_predicted.time_s, stage_predicted.energy_j, fastest.time_s, fastest.energy_j, stage_v,
                fronts_cost[0] + validator.n_measurements - mid[0], fronts_cost[1] + validator.cost_gpu_s - mid[1],
                fronts_wall + _time.perf_counter() - t1, tuple(searches), None, stage_plan)  # fmt: skip
            # The instruction level never ends worse; where the stage plan wins it, its plan is the table's.
            candidates.append((levels["stage"].planned, levels["stage"].requests, stage_v, stage_plan))
    if "instruction" in config.granularities:
        t1, mid = _time.perf_counter(), (validator.n_measurements, validator.cost_gpu_s)
        best_plan, best_requests, best_v, best_planned = _calibrated(planner, realize, validator, baseline, b,
                                                       config.max_validation_rounds, candidates, key="instruction")
        # The same search with free, instant switching: the plans as they stand (the free-switching ideal).
        _, _, ideal, _ = _calibrated(planner, lambda plan: tuple(int(c) for c in plan.sm_clock_mhz), validator,
                                     baseline, b, config.max_validation_rounds, (), key="instruction-ideal",
                                     switching=False)  # fmt: skip
        predicted = best_plan if best_plan is not None else fastest  # a candidate won: the defaults' prediction
        frontier = tuple(planner.frontier(n_points=config.frontier_points)) if config.frontier_points else ()
        levels["instruction"] = PipelineLevelResult(
            "instruction", tuple(best_requests), tuple(int(c) if c is not None else None for c in best_planned),
            predicted.time_s, predicted.energy_j, fastest.time_s, fastest.energy_j, best_v,
            fronts_cost[0] + validator.n_measurements - mid[0], fronts_cost[1] + validator.cost_gpu_s - mid[1],
            fronts_wall + _time.perf_counter() - t1, tuple(searches), ideal, best_plan, frontier)  # fmt: skip
    blocking = blocking_w if profile is not None else pipeline.blocked_power_w()
    if config.blocked_power_w is None:  # the GPU's own waiting power, a range where no measurement pins it
        levels = _with_waiting_range(levels, stage_traces, spec, micro_batches, pipeline)
    n_new = log.n_new + sum(s.n_new_measurements for s in searches_all)
    n_stored = log.n_stored + sum(s.n_stored_measurements for s in searches_all)
    return PipelineSearchResult(workload, spec.name, spec, micro_batches, partition_method, b, baseline, profile,
                                defaults, fronts, blocking, perseus_blocking_power_w(spec), spec.clock_switch_s,
                                levels, config.storage, config.seed, n_new, n_stored,
                                _time.perf_counter() - started, schedule=config.schedule,
                                confidence=config.confidence, dag=dag)  # fmt: skip


def _with_waiting_range(levels: dict, stage_traces: Sequence, spec: GPUSpec, micro_batches: int,
                        pipeline: SimulatedPipeline) -> dict:
    """``levels`` with each level's noiseless saving at the two ends of the blocked GPUs' power range
    (PipelineLevelResult.saving_pct_waiting_range; freqopt.gpu.specs.WaitingPower, issue 36, item 2): the level's
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


def result_pipeline_table(result: PipelineSearchResult):
    """The pipeline clock table (freqopt.tables.pipeline_table) of a search's instruction level: its fronts, its
    plan, the requests that were validated (switches asked for ahead) and the validated figures against the
    validated default iteration.

    Returns:
        A ClockTable, or None where the instruction level was not searched or no plan won its validation (a
        candidate, the iteration level's clock or the defaults, validated better: nothing per instruction to apply).
    """
    from freqopt.pipeline.table import pipeline_table

    level = result.levels.get("instruction")
    if level is None or level.plan is None or result.profile is None or result.schedule != "1f1b":
        return None  # (the table's format and the runtime hold DeepSpeed's 1F1B only, so far)
    top = result.spec.max_sm_clock_mhz
    return pipeline_table(
        result.workload, result.spec, result.profile, level.plan, max_slowdown=result.max_slowdown,
        blocking_power_w=result.blocking_power_w, switch_s=result.switch_s,
        defaults={key: (o.time_s, o.energy_j, o.n_samples) for key, o in result.defaults.items()},
        validated=level.validated, baseline=result.baseline,
        front_samples={key: [o.n_samples for o in opts] for key, opts in result.fronts.items()},
        partition_method=result.partition_method, backend="sim", seed=result.seed,
        provenance={"storage": result.storage, "n_measurements": level.n_measurements,
                    "search_cost_gpu_s": level.search_cost_gpu_s},
        requests=[top if c is None else int(c) for c in level.requests])  # fmt: skip
