"""A pipeline plan as a clock table (granularity "instruction"; freqopt.tables, "Pipelines"): per (stage, pass) the
measured default and front it was planned from, the plan per stage and micro-batch, the clocks the runtime requests,
and the predicted and validated iteration against the default one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from freqopt import __version__
from freqopt.budget import parse_slowdown
from freqopt.errors import ClockTableError, InvalidSettingError
from freqopt.gpu.specs import GPUSpec
from freqopt.tables.format import (INSTRUCTION, PASSES, SCHEMA_NAME, SCHEMA_VERSION, ClockTable, clock_mhz, gpu_doc,
                                   workload_doc)
from freqopt.tables.io import check_pipeline_section, pipeline_table_error

if TYPE_CHECKING:  # annotations only: the planner's types, read by attribute
    from freqopt.pipeline.plan import PipelinePlan
    from freqopt.pipeline.profile import StageProfile

__all__ = ["pipeline_table"]


def pipeline_table(workload, spec: GPUSpec, profile: StageProfile, plan: PipelinePlan, *, max_slowdown: float | str,
                   blocking_power_w: float, switch_s: float,
                   defaults: Mapping[tuple[int, str], tuple[float, float, int]], validated,
                   predicted=None, front_samples: Mapping[tuple[int, str], Sequence[int]] | int = 1,
                   partition_method: str = "parameters", backend: str = "sim", seed: int = 0,
                   provenance: Mapping[str, Any] | None = None,
                   requests: Sequence[int] | None = None, baseline=None) -> ClockTable:  # fmt: skip
    """The clock table of a pipeline plan (granularity "instruction"; freqopt.tables, "Pipelines").

    Args:
        workload: the pipeline's freqopt.workload.models.Workload (layout pp > 1 stages).
        spec: the GPU type every stage runs on; each plan and front clock must be one it supports.
        profile: the freqopt.pipeline.profile.StageProfile the plan was made from: per (stage, pass) the
            measured SM clocks (MHz) with one instruction's time (s) and energy (J) at each; written as the
            entries' fronts (fastest first), from which another micro-batch count is re-planned.
        plan: the freqopt.pipeline.plan.PipelinePlan to apply (its DAG's stages and micro-batches).
        max_slowdown: the budget it was planned for, against the fastest plan (0.01 or "1%").
        blocking_power_w: the power (W) a GPU draws while it waits on its neighbours, as the plan counted it (the
            plan's planner's, where it has one).
        switch_s: the GPU's clock-switch latency the plan was made and validated with, s.
        defaults: per (stage, pass) one instruction's (time_s, energy_j, n_samples) at the GPU's default clocks.
        validated: the plan's iteration as measured (an object with time_s and energy_j, s and J).
        predicted: the plan's iteration as predicted (time_s, energy_j); default the plan's own figures.
        front_samples: samples behind each front option: per (stage, pass) a sequence aligned with the profile's
            options, or one count for all.
        partition_method: DeepSpeed's partition of the layers into stages the profile was measured with.
        backend, seed: where and with which seed the measurements were taken (provenance).
        provenance: more provenance (storage, studies, cost...), merged over freqopt's own.
        requests: per instruction of the plan's DAG (plan.dag.instructions order), the SM clock (MHz) the runtime
            asks for at its start, where the validated schedule requests clocks ahead of the plan (module
            docstring, "Pipelines"); None: the runtime asks for each instruction's planned clock.
        baseline: the default iteration as measured the way ``validated`` was (time_s, energy_j), against which
            the validated saving and slowdown are reported; None: the default iteration the plan's accounting
            gives from ``defaults`` (the predicted one, which a validation on real or simulated GPUs includes more
            than: the optimizer step, switch latency).

    Returns:
        A ClockTable (no source), for write_table and write_table_csv.

    Raises:
        InvalidSettingError: a stage count that differs between workload, profile and plan, a missing default, a
            blocking power other than the plan's, or a bad budget (argument named).
        ClockTableError: the document fails load_table's checks (a clock the plan picked that the profile does not
            list for that pass, one ``spec`` does not support).
    """
    slowdown = parse_slowdown(max_slowdown, allow_zero=True)  # a pipeline's plan saves at no slowdown too
    _check_inputs(workload, profile, plan, blocking_power_w, defaults)
    entries = _stage_entries(profile, plan.dag.stages, defaults, front_samples)
    if requests is not None and len(requests) != plan.dag.n:
        raise InvalidSettingError(f"requests has {len(requests)} clocks, not one per instruction ({plan.dag.n})",
                                  argument="requests")  # fmt: skip
    figures = _figures(plan, defaults, blocking_power_w, validated, predicted, baseline)
    data = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "gpu": gpu_doc(spec),
        "workload": workload_doc(workload),
        "granularity": INSTRUCTION,
        "max_slowdown": slowdown,
        "entries": entries,
        "pipeline": _pipeline_doc(plan, partition_method=partition_method, blocking_power_w=blocking_power_w,
                                  switch_s=switch_s, requests=requests),
        **figures,
        "provenance": {"freqopt_version": __version__,
                       "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "backend": backend, "seed": seed, **(provenance or {})},
    }  # fmt: skip
    return _checked_table(data, spec)


def _check_inputs(workload, profile: StageProfile, plan: PipelinePlan, blocking_power_w: float,
                  defaults: Mapping[tuple[int, str], tuple[float, float, int]]) -> None:
    """Refuse a workload, profile and plan of different pipelines, a blocking power other than the plan's, and
    defaults that lack a (stage, pass).

    Raises:
        InvalidSettingError: the argument named (pipeline_table's).
    """
    stages = plan.dag.stages
    if not (workload.layout.pp == profile.stages == stages > 1):
        raise InvalidSettingError(f"plan has {stages} stages, the profile {profile.stages} and the workload's layout "
                                  f"pp={workload.layout.pp}: give the workload, profile and plan of one pipeline of "
                                  "at least 2 stages", argument="plan")  # fmt: skip
    planner = getattr(plan, "planner", None)
    if planner is not None and abs(planner.blocking_power_w - blocking_power_w) > 1e-12 * max(1.0, blocking_power_w):
        raise InvalidSettingError(f"blocking_power_w {blocking_power_w} W is not the {planner.blocking_power_w} W the "
                                  "plan was made with", argument="blocking_power_w")  # fmt: skip
    missing = [f"stage{s}.{kind}" for s in range(stages) for kind in PASSES if (s, kind) not in defaults]
    if missing:
        raise InvalidSettingError(f"defaults lacks {', '.join(missing)}: give each stage and pass its measured default",
                                  argument="defaults")  # fmt: skip


def _stage_entries(profile: StageProfile, stages: int, defaults: Mapping[tuple[int, str], tuple[float, float, int]],
                   front_samples: Mapping[tuple[int, str], Sequence[int]] | int) -> list[dict[str, Any]]:
    """The table's entries, one per (stage, pass) in stage order, forward first: unit "stage1.backward", its
    measured ``default`` (no setting of its own) and its ``front``, every profiled SM clock with one instruction's
    time (s), energy (J) and samples, fastest first (the faster clock first at equal times)."""
    entries = []
    for s in range(stages):
        for kind in PASSES:
            options = profile.options[(s, kind)]
            samples = ([front_samples] * len(options.sm_clock_mhz) if isinstance(front_samples, int)
                       else list(front_samples[(s, kind)]))  # fmt: skip
            time_s, energy_j, n_samples = defaults[(s, kind)]
            front = [{"sm_clock_mhz": clock_mhz(c), "mem_clock_mhz": None, "power_limit_w": None, "time_s": float(t),
                      "energy_j": float(e), "n_samples": int(n)}
                     for c, t, e, n in zip(options.sm_clock_mhz, options.time_s, options.energy_j, samples)]  # fmt: skip
            front.sort(key=lambda o: (o["time_s"], -o["sm_clock_mhz"]))
            entries.append({"unit": f"stage{s}.{kind}", "stage": s, "pass": kind,
                            "default": {"sm_clock_mhz": None, "mem_clock_mhz": None, "power_limit_w": None,
                                        "time_s": float(time_s), "energy_j": float(energy_j),
                                        "n_samples": int(n_samples)},
                            "front": front})  # fmt: skip
    return entries


def _by_micro_batch(plan: PipelinePlan, per_instruction: Sequence[int]) -> list[dict[str, Any]]:
    """Clocks given per instruction of the plan's DAG (plan.dag.instructions order) as the table keeps them: per
    stage, per pass, one SM clock (MHz) per micro-batch."""
    stages, micro_batches = plan.dag.stages, plan.dag.micro_batches
    clocks = {(s, kind): [0] * micro_batches for s in range(stages) for kind in PASSES}
    for inst, clock in zip(plan.dag.instructions, per_instruction):
        clocks[(inst.stage, inst.kind)][inst.micro_batch] = clock_mhz(clock)
    return [{"stage": s, **{kind: clocks[(s, kind)] for kind in PASSES}} for s in range(stages)]


def _pipeline_doc(plan: PipelinePlan, *, partition_method: str, blocking_power_w: float, switch_s: float,
                  requests: Sequence[int] | None) -> dict[str, Any]:
    """The table's ``pipeline`` object (freqopt.tables, "Pipelines"): stages, micro-batches, schedule, partition,
    blocking power (W), switch latency (s), the plan and, where given, the requests."""
    return {"stages": plan.dag.stages, "micro_batches": plan.dag.micro_batches, "schedule": "1f1b",
            "partition_method": partition_method, "blocking_power_w": float(blocking_power_w),
            "switch_s": float(switch_s),
            "plan": _by_micro_batch(plan, plan.sm_clock_mhz),
            **({"requests": _by_micro_batch(plan, requests)} if requests is not None else {})}  # fmt: skip


def _relative(time_s: float, energy_j: float, base: tuple[float, float]) -> dict[str, float]:
    """An iteration's time (s) and energy (J) with its energy saved and slowdown (%) against ``base`` (time_s,
    energy_j)."""
    return {"time_s": float(time_s), "energy_j": float(energy_j),
            "energy_saved_pct": 100 * (1 - energy_j / base[1]), "slowdown_pct": 100 * (time_s / base[0] - 1)}


def _figures(plan: PipelinePlan, defaults: Mapping[tuple[int, str], tuple[float, float, int]],
             blocking_power_w: float, validated, predicted, baseline) -> dict[str, dict[str, float]]:
    """The table's ``baseline``, ``predicted`` and ``validated`` iterations (pipeline_table's arguments): the
    prediction against the default iteration on the plan's schedule and accounting, the validation against
    ``baseline`` (that default iteration where None)."""
    # The default iteration: every instruction at its default, on the plan's schedule and accounting.
    default_times = [defaults[(i.stage, i.kind)][0] for i in plan.dag.instructions]
    default_energies = [defaults[(i.stage, i.kind)][1] for i in plan.dag.instructions]
    base_time = plan.dag.iteration_time_s(default_times)
    base_energy = plan.dag.iteration_energy_j(default_times, default_energies, blocking_power_w)
    measured_base = (base_time, base_energy) if baseline is None else (float(baseline.time_s), float(baseline.energy_j))
    predicted_time, predicted_energy = ((plan.time_s, plan.energy_j) if predicted is None
                                        else (predicted.time_s, predicted.energy_j))  # fmt: skip
    return {
        "baseline": {"time_s": measured_base[0], "energy_j": measured_base[1]},
        "predicted": {**_relative(predicted_time, predicted_energy, (base_time, base_energy)),
                      "baseline_time_s": base_time, "baseline_energy_j": base_energy,
                      "fastest_time_s": float(plan.default_time_s), "fastest_energy_j": float(plan.default_energy_j),
                      "lower_bound_j": float(plan.lower_bound_j)},
        "validated": _relative(validated.time_s, validated.energy_j, measured_base),
    }  # fmt: skip


def _checked_table(data: dict[str, Any], spec: GPUSpec) -> ClockTable:
    """The pipeline table of document ``data``, after load_table's checks of its pipeline section and clocks.

    Raises:
        ClockTableError: what is wrong, naming "the pipeline table".
    """
    wrong = pipeline_table_error(data, "the pipeline table")
    if wrong:
        raise ClockTableError(wrong)
    check_pipeline_section(data, "the pipeline table")
    table = ClockTable(data)
    table.check_gpu(spec, source="the pipeline table")
    return table
