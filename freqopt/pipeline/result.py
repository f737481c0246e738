"""A pipeline search's outcome (freqopt.pipeline.search): each granularity's validated result, everything a
pipeline clock table holds, and that table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.specs import GPUSpec
from freqopt.pipeline.dag import ALL_KINDS, PipelineDAG, one_f_one_b
from freqopt.pipeline.plan import FrontierPoint, PipelinePlan
from freqopt.pipeline.profile import StageProfile
from freqopt.pipeline.validate import Validated
from freqopt.search.study import UnitSearch

__all__ = ["PipelineLevelResult", "PipelineSearchResult", "result_pipeline_table", "clock_mhz"]


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
        resumed: whether the storage held the instruction studies' job already (a resumed search: what was read
            back is an earlier run's); False: a new one, whose read-back measurements are its workers'
            (freqopt.pipeline.workers); None: nothing shared (in memory, or no instruction studies).
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
    resumed: bool | None = None

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
            front = [{"sm_clock_mhz": clock_mhz(self.spec, o.setting), "time_s": o.time_s, "energy_j": o.energy_j,
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


def clock_mhz(spec: GPUSpec, setting: ClockSetting) -> int:
    """A setting's SM clock (MHz), the default being the highest."""
    return spec.max_sm_clock_mhz if setting.sm_clock_mhz is None else int(setting.sm_clock_mhz)


def result_pipeline_table(result: PipelineSearchResult):
    """The pipeline clock table (freqopt.pipeline.table.pipeline_table) of a search's instruction level: its fronts,
    its plan, the requests that were validated (switches asked for ahead) and the validated figures against the
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
