"""Clock tables: the portable result of a search, as versioned JSON (and a CSV view for people).

A table holds the GPU type and its clock lists, the workload it was searched on, the granularity and slowdown
budget, one entry per tuning unit (its kernel-class signature, kind and arithmetic intensity, and the setting; at
phase level, the block of phases and the phase at whose start the runtime requests the setting; at the other
levels also the unit's measured default and (time, energy) front, from which freqopt.apply.transfer re-allocates a
budget on another layout),
predicted and validated time and energy against the default, and provenance (storage, studies, cost).
Files are written atomically (a temporary file renamed over the target), so a reader never sees half a table.

**The workload.** A table is for the workload it was found for: the model (its name, layers, width and heads), the
parallel layout, the micro-batch and the sequence length (``workload``). ``ClockTable.check_workload`` refuses
another (freqopt train and DVFSRuntime call it), naming ``freqopt transfer``, which lays a table onto another
workload. Every table freqopt has written records its model, sizes, micro-batch and sequence length (schema
version 1 from its start), and its layout since parallel layouts exist: a table without ``workload.layout`` was
found on one GPU and is read as dp=1, tp=1. A table that does not record its micro-batch or sequence length (one
written by hand) loads, but is refused for training (search again); one without layers, width or heads is
checked by its model's name and the rest.

**Pipelines.** A table for a pipeline layout (``pp`` > 1, recorded in ``workload.layout``) has granularity
``"instruction"``: one SM clock per instruction, the forward or backward of one micro-batch on one stage
(freqopt.pipeline.dag). Its entries are one per (stage, pass), unit ``"stage1.backward"``, each with ``"stage"``,
``"pass"``, its measured ``"default"`` (time, energy and samples of one instruction at the GPU's default clocks) and
its ``"front"`` (every measured SM clock: time and energy of one instruction), from which freqopt.apply re-plans
(PipelinePlanner) for another micro-batch count without new measurements; they carry no setting of their own. Its
``"pipeline"`` object holds the pipeline and the plan (``pipeline_table``):

    "pipeline": {"stages": 2, "micro_batches": 4, "schedule": "1f1b", "partition_method": "parameters",
                 "blocking_power_w": 71.6, "switch_s": 0.026,
                 "plan": [{"stage": 0, "forward": [1410, ...], "backward": [1980, ...]}, ...]}

``plan[s]["forward"][m]`` is the SM clock (MHz) of micro-batch m's forward on stage s (M clocks per pass). An
optional ``"requests"`` of the same form holds the clock the runtime asks for at each instruction's start, where that
differs from the plan because a switch takes effect one latency later (freqopt.pipeline.realize's realized
schedule: a switch to a faster clock asked for one instruction early, so that no instruction runs slower than
planned); it is what the search validated, any clock the GPU supports, and it is applied only at the plan's own
micro-batch count. The plan
is kept by micro-batch rather than in each stage's 1F1B order: this module sits below the search, whose
freqopt.pipeline.dag.stage_order gives that order (freqopt.apply.pipeline_runtime.stage_schedule puts the clocks
in it), so that the file can be checked clock by clock here without a second copy of the schedule. Memory clocks and
power limits stay at the default (A100 and H100 memory clocks do not change at run time). ``max_slowdown`` is the
budget against the fastest plan (every instruction at its fastest clock), as PipelinePlanner.plan takes it.

**File names.** A search writes ``STEM-GRANULARITY.json`` (and ``.csv``) with STEM = MODEL-GPU, then
``-dpNtpM`` under a parallel layout, then the budget (``-1pct``, ``-0.5pct``) and ``-seedN`` for a seed other
than 0 (table_stem); a transfer writes ``STEM-GRANULARITY-transferred.json`` with the target's STEM. So searches
at two budgets, or with two seeds, keep their own tables in one folder. A file of that name holding the table of
another search (another micro-batch, sequence length, backend or source table) is never replaced:
check_table_target refuses it, before any work where the caller can (freqopt.search, freqopt.apply.transfer).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freqopt import __version__
from freqopt.errors import ClockTableError, OutputError, TableWorkloadError
from freqopt.files import atomic_write_text
from freqopt.gpu.specs import GPUSpec

if TYPE_CHECKING:  # the search's types, above this module: only their attributes are read
    from freqopt.pipeline.plan import PipelinePlan
    from freqopt.pipeline.profile import StageProfile

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "CLOCK_TABLE_SCHEMA", "INSTRUCTION", "PASSES", "ClockTable", "workload_doc",
           "describe_workload", "table_from_result", "result_table", "pipeline_table", "budget_tag", "table_stem",
           "table_identity", "check_table_target", "write_result_tables", "write_table", "write_table_csv",
           "load_table"]

SCHEMA_NAME = "freqopt.clock-table"
SCHEMA_VERSION = 1

_number = {"type": "number"}
_time_energy = {
    "type": "object",
    "required": ["time_s", "energy_j"],
    "properties": {"time_s": _number, "energy_j": _number},
}
_positive = {"type": "number", "exclusiveMinimum": 0}
_measured = {  # a unit's measured option: its setting, mean time and energy per iteration, and samples behind them
    "type": "object",
    "required": ["time_s", "energy_j", "n_samples"],
    "properties": {"sm_clock_mhz": {"type": ["integer", "null"]}, "mem_clock_mhz": {"type": ["integer", "null"]},
                   "power_limit_w": {"type": ["number", "null"]}, "time_s": _positive, "energy_j": _positive,
                   "n_samples": {"type": "integer", "minimum": 1}},
}  # fmt: skip
INSTRUCTION = "instruction"  # the pipeline granularity: one SM clock per (stage, micro-batch, pass)
PASSES = ("forward", "backward")  # freqopt.pipeline.dag.KINDS, the instruction kinds
_clock_list = {"type": "array", "items": {"type": "integer"}}
_pipeline = {  # a pipeline table's pipeline and plan (module docstring, "Pipelines")
    "type": "object",
    "required": ["stages", "micro_batches", "schedule", "blocking_power_w", "switch_s", "plan"],
    "properties": {
        "stages": {"type": "integer", "minimum": 2},
        "micro_batches": {"type": "integer", "minimum": 1},
        "schedule": {"enum": ["1f1b"]},
        "partition_method": {"type": "string"},
        "blocking_power_w": {"type": "number", "minimum": 0},
        "switch_s": {"type": "number", "minimum": 0},
        "plan": {"type": "array", "items": {"type": "object", "required": ["stage", *PASSES],
                                            "properties": {"stage": {"type": "integer", "minimum": 0},
                                                           "forward": _clock_list, "backward": _clock_list}}},
        "requests": {"type": "array", "items": {"type": "object", "required": ["stage", *PASSES],
                                                "properties": {"stage": {"type": "integer", "minimum": 0},
                                                               "forward": _clock_list, "backward": _clock_list}}},
    },
}  # fmt: skip
CLOCK_TABLE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema", "schema_version", "gpu", "workload", "granularity", "max_slowdown", "entries",
                 "baseline", "predicted", "validated", "provenance"],
    "properties": {
        "schema": {"const": SCHEMA_NAME},
        "schema_version": {"type": "integer"},
        "gpu": {
            "type": "object",
            "required": ["name", "sm_clocks_mhz", "mem_clocks_mhz"],
            "properties": {
                "name": {"type": "string"},
                "sm_clocks_mhz": {"type": "array", "items": {"type": "integer"}},
                "mem_clocks_mhz": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "workload": {
            "type": "object",
            # All written by every freqopt since the format's first version, "layout" since parallel layouts
            # (without it: one GPU); ClockTable.check_workload needs micro_batch_size and seq_len.
            "required": ["model"],
            "properties": {
                "model": {"type": "string"},
                "n_layers": {"type": ["integer", "null"]},  # null: a user's own step (freqopt.workload.step_trace)
                "d_model": {"type": ["integer", "null"]},
                "n_heads": {"type": ["integer", "null"]},
                "seq_len": {"type": ["integer", "null"]},
                "micro_batch_size": {"type": "integer", "minimum": 1},
                "layout": {"type": "object", "required": ["dp", "tp"],
                           "properties": {"dp": {"type": "integer", "minimum": 1},
                                          "tp": {"type": "integer", "minimum": 1},
                                          "pp": {"type": "integer", "minimum": 1}}},  # pp: only when above 1
            },
        },
        "granularity": {"enum": ["power-cap", "iteration", "pass", "kernel", "phase", INSTRUCTION]},
        "max_slowdown": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "entries": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["unit"],  # and the setting, or (instruction level) stage, pass, default and front: below
                "properties": {
                    "unit": {"type": "string"},
                    "stage": {"type": "integer", "minimum": 0},
                    "pass": {"enum": list(PASSES)},
                    "kind": {"type": ["string", "null"]},
                    "signature": {"type": ["string", "null"]},
                    "arithmetic_intensity": {"type": ["number", "null"]},
                    "n_kernels": {"type": "integer", "minimum": 1},
                    "sm_clock_mhz": {"type": ["integer", "null"]},
                    "mem_clock_mhz": {"type": ["integer", "null"]},
                    "power_limit_w": {"type": ["number", "null"]},
                    "request_phase": {"type": "string"},
                    "default": _measured,
                    "front": {"type": "array", "items": {**_measured, "required": [
                        "sm_clock_mhz", "mem_clock_mhz", "power_limit_w", "time_s", "energy_j", "n_samples"]}},
                },
            },
        },
        "baseline": _time_energy,
        "predicted": _time_energy,
        "validated": _time_energy,
        "provenance": {"type": "object"},
        "pipeline": _pipeline,
    },
    # A phase-level table says at which phase the runtime asks for each entry's setting.
    "if": {"properties": {"granularity": {"const": "phase"}}},
    "then": {"properties": {"entries": {"items": {"required": ["request_phase"]}}}},
    # An instruction-level (pipeline) table holds its plan in "pipeline" and per (stage, pass) the measurements it
    # was planned from; every other table holds one setting per entry.
    "allOf": [{
        "if": {"properties": {"granularity": {"const": INSTRUCTION}}},
        "then": {"required": ["pipeline"], "properties": {"entries": {"items": {
            "required": ["stage", "pass", "default", "front"]}}}},
        "else": {"properties": {"entries": {"items": {
            "required": ["sm_clock_mhz", "mem_clock_mhz", "power_limit_w"]}}}},
    }],
}  # fmt: skip


_WORKLOAD_FIELDS = ("model", "n_layers", "d_model", "n_heads", "seq_len", "micro_batch_size", "layout")


def _layout_doc(layout: dict[str, Any] | None) -> dict[str, int]:
    """A table's layout completed: {dp, tp} (1 where missing: a table from before layouts), and pp only above 1
    (Layout.as_dict), so that a table without pipeline stages reads and writes as before pp existed."""
    layout = {"dp": 1, "tp": 1, "pp": 1, **(layout or {})}
    return {"dp": layout["dp"], "tp": layout["tp"], **({"pp": layout["pp"]} if layout["pp"] != 1 else {})}


def _layout_text(layout: dict[str, Any] | None) -> str:
    """A table's layout as freqopt writes layouts: "dp=1,tp=1", "dp=1,tp=1,pp=2" (Layout.__str__)."""
    layout = _layout_doc(layout)
    return f"dp={layout['dp']},tp={layout['tp']}" + (f",pp={layout['pp']}" if "pp" in layout else "")


def workload_doc(workload) -> dict[str, Any]:
    """A table's ``workload`` for a freqopt.workload.models.Workload (or a table's own ``workload`` document, completed:
    a missing layout is one GPU): model, n_layers, d_model, n_heads, seq_len (tokens), micro_batch_size
    (sequences per model replica), layout {dp, tp, and pp where above 1}; sizes a user's own step does not state are
    None."""
    if isinstance(workload, dict):
        return {**{k: workload.get(k) for k in _WORKLOAD_FIELDS}, "layout": _layout_doc(workload.get("layout"))}
    config, layout = workload.config, workload.layout
    return {"model": workload.model, "n_layers": getattr(config, "n_layers", None),
            "d_model": getattr(config, "d_model", None), "n_heads": getattr(config, "n_heads", None),
            "seq_len": getattr(config, "seq_len", None), "micro_batch_size": workload.micro_batch_size,
            "layout": layout.as_dict()}  # fmt: skip


def describe_workload(doc: dict[str, Any], *, sizes: bool = False) -> str:
    """One line for a table's workload: "gpt3-small dp=1,tp=1 micro-batch 4 seq 2048" ("dp=1,tp=1,pp=2" for a
    pipeline; and, with ``sizes``, its layers, width and heads)."""
    text = (f"{doc['model']} {_layout_text(doc.get('layout'))} micro-batch {doc['micro_batch_size']} "
            f"seq {doc['seq_len']}")
    if sizes:
        text += f" ({doc['n_layers']} layers, d_model {doc['d_model']}, {doc['n_heads']} heads)"
    return text


@dataclass(frozen=True)
class ClockTable:
    """A loaded, validated clock table; ``data`` is the JSON document, ``source`` the file it was read from
    (absolute; None for a table built in memory)."""

    data: dict[str, Any]
    source: str | None = field(default=None, compare=False)

    @property
    def is_phase_schedule(self) -> bool:
        """Whether the table is a phase schedule, each entry's setting requested at its ``request_phase`` (a
        phase-level table, or a finer level's whose best realizable schedule was the phase level's), applied as it
        stands rather than realized per phase from per-unit settings."""
        return self.granularity == "phase" or any("request_phase" in e for e in self.entries)

    @property
    def workload(self) -> dict[str, Any]:
        """The workload the table was found for (workload_doc): model, n_layers, d_model, n_heads, seq_len,
        micro_batch_size, layout {dp, tp}.

        Raises:
            ClockTableError: the table records no workload.
        """
        if not isinstance(self.data.get("workload"), dict) or "model" not in self.data["workload"]:
            raise ClockTableError(f"{self.source or 'the clock table'} records no workload; search again")
        return workload_doc(self.data["workload"])

    def check_workload(self, workload, *, source: str | Path | None = None) -> None:
        """Refuse to apply the table to another workload than the one it was found for: another model (name,
        layers, width or heads), layout, micro-batch or sequence length.

        Args:
            workload: a freqopt.workload.models.Workload, or a table's ``workload`` document.
            source: how the message names the table (default its file, else "the clock table").

        Raises:
            TableWorkloadError: one line naming both workloads and the ``freqopt transfer`` command that lays the
                table onto ``workload``.
            ClockTableError: the table does not record its micro-batch or sequence length.
        """
        recorded = self.data.get("workload") or {}
        missing = [k for k in ("micro_batch_size", "seq_len") if k not in recorded]
        if missing:
            raise ClockTableError(f"{source or self.source or 'the clock table'} does not record the "
                                  f"{' and '.join(missing)} it was found for (written by hand or edited), so it cannot "
                                  "be checked against the workload trained; search again")  # fmt: skip
        mine, target = self.workload, workload_doc(workload)
        for key in ("n_layers", "d_model", "n_heads"):
            if key not in recorded:  # not recorded: the model's name stands for it
                target[key] = None
        if mine == target:
            return
        # The same model name with other sizes (an n_heads override, another config.json of that name) says so.
        sizes = mine["model"] == target["model"] and any(mine[k] != target[k]
                                                         for k in ("n_layers", "d_model", "n_heads"))
        name = source or self.source or "the clock table"
        layout = target["layout"]
        if "pp" in mine["layout"] or "pp" in layout:  # freqopt transfer does not lay a pipeline's plan onto another
            raise TableWorkloadError(
                f"table {name} was found for {describe_workload(mine, sizes=sizes)}, not "
                f"{describe_workload(target, sizes=sizes)}: a pipeline's table holds a plan per stage of the pipeline "
                f"it was searched on; search this workload (layout {_layout_text(layout)}) at granularity "
                f"{INSTRUCTION!r} and apply that table"
            )
        command = (f"freqopt transfer --table {name} --model {target['model']} --layout dp={layout['dp']},"
                   f"tp={layout['tp']} --micro-batch-size {target['micro_batch_size']} --seq-len {target['seq_len']}")
        if sizes and target["n_heads"] is not None and target["n_heads"] != mine["n_heads"]:
            command += f" --n-heads {target['n_heads']}"
        raise TableWorkloadError(
            f"table {name} was found for {describe_workload(mine, sizes=sizes)}, not "
            f"{describe_workload(target, sizes=sizes)}: lay it onto this workload with `{command}` (freqopt.apply.transfer)"
        )

    @property
    def gpu(self) -> str:
        return self.data["gpu"]["name"]

    @property
    def is_pipeline(self) -> bool:
        """Whether the table is a pipeline's (granularity "instruction": a plan per stage in ``pipeline``)."""
        return self.data.get("granularity") == INSTRUCTION

    @property
    def pipeline(self) -> dict[str, Any] | None:
        """A pipeline table's ``pipeline`` object (module docstring, "Pipelines"); None for other tables."""
        return self.data.get("pipeline") if self.is_pipeline else None

    def refuse_pipeline(self, what: str, *, source: str | Path | None = None) -> None:
        """Refuse a pipeline table where ``what`` (e.g. "freqopt transfer") handles one setting per tuning unit only.

        Raises:
            ClockTableError: one line naming what applies a pipeline table.
        """
        if self.is_pipeline:
            raise ClockTableError(f"{source or self.source or 'the clock table'} is a pipeline's table (granularity "
                                  f"{INSTRUCTION!r}, one clock per instruction); {what} does not take one: train the "
                                  "pipeline with it (freqopt.apply.train, freqopt.apply.pipeline_runtime)")  # fmt: skip

    @property
    def granularity(self) -> str:
        return self.data["granularity"]

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.data["entries"]

    def __repr__(self) -> str:
        """One line: GPU, workload, granularity, budget, entry count and the validated saving (not the JSON
        document, which runs to tens of kilobytes; ``table.data`` holds it)."""
        d = self.data if isinstance(self.data, dict) else {}
        workload, validated, baseline = (d.get(key) if isinstance(d.get(key), dict) else {}
                                         for key in ("workload", "validated", "baseline"))  # fmt: skip
        parts = [f"gpu={(d.get('gpu') or {}).get('name')!r}", f"model={workload.get('model')!r}",
                 f"granularity={d.get('granularity')!r}"]  # fmt: skip
        if isinstance(workload.get("layout"), dict):
            pp = workload["layout"].get("pp")
            parts.append(f"dp={workload['layout'].get('dp')},tp={workload['layout'].get('tp')}"
                         + (f",pp={pp}" if pp not in (None, 1) else ""))  # fmt: skip
        if isinstance(d.get("max_slowdown"), (int, float)):
            parts.append(f"max_slowdown={100 * d['max_slowdown']:g}%")
        n = len(d.get("entries") or ())
        parts.append(f"{n} entr{'y' if n == 1 else 'ies'}")
        saved, slowdown = validated.get("energy_saved_pct"), validated.get("slowdown_pct")
        try:  # a table written before the percentages were kept: from the validated and baseline figures
            if saved is None or slowdown is None:
                saved = 100 * (1 - validated["energy_j"] / baseline["energy_j"])
                slowdown = 100 * (validated["time_s"] / baseline["time_s"] - 1)
            parts.append(f"validated {0.0 - saved:+.2f} % energy at {slowdown:+.2f} % time")
        except (KeyError, TypeError, ZeroDivisionError):
            pass
        return f"ClockTable({', '.join(parts)})"

    def check_gpu(self, spec: GPUSpec, *, source: str | Path = "clock table") -> None:
        """Refuse a table for another GPU type, or with settings ``spec`` does not support.

        Raises:
            ClockTableError: the message names ``source`` (the file) and what to do.
        """
        if self.gpu != spec.name:
            raise ClockTableError(f"{source} was searched on {self.gpu}, not {spec.name}; search again on {spec.name}")
        if self.is_pipeline:
            for stage in [*self.data["pipeline"]["plan"], *self.data["pipeline"].get("requests", ())]:
                for kind in PASSES:
                    for sm in stage[kind]:
                        if not spec.supports(*spec.resolve_clocks(sm, None)):
                            raise ClockTableError(f"{source}: stage {stage['stage']}'s plan sets SM {sm} MHz for a "
                                                  f"{kind} pass, which {spec.name} does not support; search again on "
                                                  f"{spec.name}")  # fmt: skip
            return
        for entry in self.entries:
            sm, mem, power = entry["sm_clock_mhz"], entry["mem_clock_mhz"], entry["power_limit_w"]
            if (sm is not None or mem is not None) and not spec.supports(*spec.resolve_clocks(sm, mem)):
                raise ClockTableError(
                    f"{source}: unit {entry['unit'][:60]!r} sets SM {sm} MHz / memory {mem} MHz, which {spec.name} "
                    "does not support"
                )
            if power is not None and not spec.power_limit_min_w <= power <= spec.power_limit_max_w:
                raise ClockTableError(f"{source}: power limit {power} W is outside {spec.name}'s range")


def table_from_result(result, granularity: str, spec: GPUSpec, *, backend: str, seed: int) -> ClockTable:
    """Build the clock table of one granularity of a SearchResult."""
    r = result.results[granularity]
    trace = result.trace
    w = trace.workload
    entries = []
    # The units' measured fronts, where the options are the unit's own (not at phase level, whose options are
    # changes of the whole iteration) and the table holds what they allocated (not a level held to one clock,
    # whose studies served its free-switching figure only: its table is that clock, transferred as it stands).
    own = not r.requests and not r.held_to_one_clock
    fronts = r.unit_searches if own and len(r.unit_searches) == len(r.units) else None
    if own and r.searched_units and len(r.searched_units) == len(r.unit_searches):
        # Classes that shared their family's study carry the family's front: a transfer uses only its ratios
        # to the default (freqopt.apply.transfer), which the family's classes share.
        owner = {k: s for u, s in zip(r.searched_units, r.unit_searches) for k in u.kernel_indices}
        fronts = [owner[unit.kernel_indices[0]] for unit, _ in r.units]
    for i, (unit, setting) in enumerate(r.units):
        kernels = unit.kernels(trace)
        first = kernels[0]
        per_class = granularity == "kernel" and not r.requests  # a kernel level may end on phase blocks
        flops = sum(k.flops for k in kernels)
        nbytes = sum(k.mem_bytes for k in kernels)
        entries.append({
            "unit": unit.name,
            "kind": first.kind if per_class else None,
            "signature": first.signature if per_class else None,
            "arithmetic_intensity": (flops / nbytes) if nbytes else None,
            "n_kernels": len(kernels),
            "sm_clock_mhz": _clock_mhz(setting.sm_clock_mhz),
            "mem_clock_mhz": _clock_mhz(setting.mem_clock_mhz),
            "power_limit_w": setting.power_limit_w,
            **({"request_phase": r.requests[i]} if r.requests else {}),
            **(_front(fronts[i]) if fronts else {}),
        })  # fmt: skip
    base = result.baseline

    def rel(m) -> dict[str, float]:
        return {"time_s": m.time_s, "energy_j": m.energy_j,
                "energy_saved_pct": 100 * (1 - m.energy_j / base.energy_j),
                "slowdown_pct": 100 * (m.time_s / base.time_s - 1)}  # fmt: skip

    predicted = {"time_s": r.predicted.time_s, "energy_j": r.predicted.energy_j,
                 "energy_saved_pct": result.predicted_energy_saved_pct(granularity),
                 "baseline_time_s": r.predicted_baseline.time_s,
                 "baseline_energy_j": r.predicted_baseline.energy_j}  # fmt: skip
    data = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "gpu": _gpu_doc(spec),
        "workload": workload_doc(w),
        "granularity": granularity,
        "max_slowdown": result.max_slowdown,
        "entries": entries,
        "baseline": {"time_s": base.time_s, "energy_j": base.energy_j},
        "predicted": predicted,
        "validated": rel(r.validated),
        "ideal": rel(r.ideal) if r.ideal is not None else None,
        **({"note": r.note} if r.note else {}),
        "provenance": {
            "freqopt_version": __version__,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "backend": backend,
            "seed": seed,
            "storage": result.storage,
            "studies": r.study_names,
            "n_measurements": r.n_measurements,
            "search_cost_gpu_s": r.search_cost_gpu_s,
        },
    }  # fmt: skip
    return ClockTable(data)


def pipeline_table(workload, spec: GPUSpec, profile: StageProfile, plan: PipelinePlan, *, max_slowdown: float | str,
                   blocking_power_w: float, switch_s: float,
                   defaults: Mapping[tuple[int, str], tuple[float, float, int]], validated,
                   predicted=None, front_samples: Mapping[tuple[int, str], Sequence[int]] | int = 1,
                   partition_method: str = "parameters", backend: str = "sim", seed: int = 0,
                   provenance: Mapping[str, Any] | None = None,
                   requests: Sequence[int] | None = None, baseline=None) -> ClockTable:  # fmt: skip
    """The clock table of a pipeline plan (granularity "instruction"; module docstring, "Pipelines").

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
    from freqopt.budget import parse_slowdown
    from freqopt.errors import InvalidSettingError

    slowdown = parse_slowdown(max_slowdown)
    stages, micro_batches = plan.dag.stages, plan.dag.micro_batches
    if not (workload.layout.pp == profile.stages == stages > 1):
        raise InvalidSettingError(f"plan has {stages} stages, the profile {profile.stages} and the workload's layout "
                                  f"pp={workload.layout.pp}: give the workload, profile and plan of one pipeline of "
                                  "at least 2 stages", argument="plan")  # fmt: skip
    planner = getattr(plan, "planner", None)
    if planner is not None and abs(planner.blocking_power_w - blocking_power_w) > 1e-12 * max(1.0, blocking_power_w):
        raise InvalidSettingError(f"blocking_power_w {blocking_power_w} W is not the {planner.blocking_power_w} W the "
                                  "plan was made with", argument="blocking_power_w")  # fmt: skip
    keys = [(s, kind) for s in range(stages) for kind in PASSES]
    missing = [f"stage{s}.{kind}" for s, kind in keys if (s, kind) not in defaults]
    if missing:
        raise InvalidSettingError(f"defaults lacks {', '.join(missing)}: give each stage and pass its measured default",
                                  argument="defaults")  # fmt: skip
    entries = []
    for s, kind in keys:
        options = profile.options[(s, kind)]
        samples = ([front_samples] * len(options.sm_clock_mhz) if isinstance(front_samples, int)
                   else list(front_samples[(s, kind)]))  # fmt: skip
        time_s, energy_j, n_samples = defaults[(s, kind)]
        front = [{"sm_clock_mhz": _clock_mhz(c), "mem_clock_mhz": None, "power_limit_w": None, "time_s": float(t),
                  "energy_j": float(e), "n_samples": int(n)}
                 for c, t, e, n in zip(options.sm_clock_mhz, options.time_s, options.energy_j, samples)]  # fmt: skip
        front.sort(key=lambda o: (o["time_s"], -o["sm_clock_mhz"]))
        entries.append({"unit": f"stage{s}.{kind}", "stage": s, "pass": kind,
                        "default": {"sm_clock_mhz": None, "mem_clock_mhz": None, "power_limit_w": None,
                                    "time_s": float(time_s), "energy_j": float(energy_j), "n_samples": int(n_samples)},
                        "front": front})  # fmt: skip
    def by_micro_batch(per_instruction) -> list[dict[str, Any]]:
        clocks = {(s, kind): [0] * micro_batches for s, kind in keys}
        for inst, clock in zip(plan.dag.instructions, per_instruction):
            clocks[(inst.stage, inst.kind)][inst.micro_batch] = _clock_mhz(clock)
        return [{"stage": s, **{kind: clocks[(s, kind)] for kind in PASSES}} for s in range(stages)]

    if requests is not None and len(requests) != plan.dag.n:
        raise InvalidSettingError(f"requests has {len(requests)} clocks, not one per instruction ({plan.dag.n})",
                                  argument="requests")  # fmt: skip
    # The default iteration: every instruction at its default, on the plan's schedule and accounting.
    default_times = [defaults[(i.stage, i.kind)][0] for i in plan.dag.instructions]
    default_energies = [defaults[(i.stage, i.kind)][1] for i in plan.dag.instructions]
    base_time = plan.dag.iteration_time_s(default_times)
    base_energy = plan.dag.iteration_energy_j(default_times, default_energies, blocking_power_w)

    def rel(time_s: float, energy_j: float, base=(base_time, base_energy)) -> dict[str, float]:
        return {"time_s": float(time_s), "energy_j": float(energy_j),
                "energy_saved_pct": 100 * (1 - energy_j / base[1]), "slowdown_pct": 100 * (time_s / base[0] - 1)}

    measured_base = (base_time, base_energy) if baseline is None else (float(baseline.time_s), float(baseline.energy_j))

    predicted_time, predicted_energy = ((plan.time_s, plan.energy_j) if predicted is None
                                        else (predicted.time_s, predicted.energy_j))  # fmt: skip
    data = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "gpu": _gpu_doc(spec),
        "workload": workload_doc(workload),
        "granularity": INSTRUCTION,
        "max_slowdown": slowdown,
        "entries": entries,
        "pipeline": {"stages": stages, "micro_batches": micro_batches, "schedule": "1f1b",
                     "partition_method": partition_method, "blocking_power_w": float(blocking_power_w),
                     "switch_s": float(switch_s),
                     "plan": by_micro_batch(plan.sm_clock_mhz),
                     **({"requests": by_micro_batch(requests)} if requests is not None else {})},
        "baseline": {"time_s": measured_base[0], "energy_j": measured_base[1]},
        "predicted": {**rel(predicted_time, predicted_energy), "baseline_time_s": base_time,
                      "baseline_energy_j": base_energy, "fastest_time_s": float(plan.default_time_s),
                      "fastest_energy_j": float(plan.default_energy_j), "lower_bound_j": float(plan.lower_bound_j)},
        "validated": rel(validated.time_s, validated.energy_j, measured_base),
        "provenance": {"freqopt_version": __version__,
                       "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "backend": backend, "seed": seed, **(provenance or {})},
    }  # fmt: skip
    wrong = _pipeline_error(data, "the pipeline table")
    if wrong:
        raise ClockTableError(wrong)
    _check_pipeline(data, "the pipeline table")
    table = ClockTable(data)
    table.check_gpu(spec, source="the pipeline table")
    return table


def _gpu_doc(spec: GPUSpec) -> dict[str, Any]:
    """A table's "gpu" object: the GPU type's name and marketing name, its clock lists (MHz) and default power
    limit (W)."""
    return {"name": spec.name, "marketing_name": spec.marketing_name,
            "sm_clocks_mhz": [_clock_mhz(f) for f in spec.sm_clocks_mhz],
            "mem_clocks_mhz": [_clock_mhz(m) for m in spec.mem_clocks_mhz],
            "power_limit_default_w": spec.power_limit_default_w}


def _clock_mhz(value) -> int | None:
    """A clock setting as the table holds it: an integer of MHz (NVML takes clocks as unsigned integers of MHz,
    nvmlDeviceSetGpuLockedClocks), so that a clock that went through floating point (885.0 from another tool's
    JSON, a NumPy integer) is written as 885; None (the default) stays None."""
    return None if value is None else round(float(value))


def _measured_option(option) -> dict[str, Any]:
    s = option.setting
    return {"sm_clock_mhz": _clock_mhz(s.sm_clock_mhz), "mem_clock_mhz": _clock_mhz(s.mem_clock_mhz),
            "power_limit_w": s.power_limit_w,
            "time_s": option.time_s, "energy_j": option.energy_j, "n_samples": option.n_samples}  # fmt: skip


def _front(search) -> dict[str, Any]:
    """A unit's "default" (its measured default settings) and "front" (its other options, by time: the Pareto
    front its study found, finalists averaged), in seconds and joules per iteration."""
    return {"default": _measured_option(search.default),
            "front": [_measured_option(o) for o in search.options if o.setting != search.default.setting]}


def result_table(result, granularity: str) -> ClockTable:
    """The clock table of one granularity of a SearchResult, for the GPU type, backend and seed it records
    (``result.spec``; the search_spaces/ type of ``result.gpu`` where it has none).

    Raises:
        UnknownNameError: ``granularity`` was not searched; the message lists those that were.
    """
    from freqopt.errors import UnknownNameError
    from freqopt.gpu.specs import get_gpu

    if granularity not in result.results:
        raise UnknownNameError(f"granularity {granularity!r} was not searched; choose from "
                               f"{', '.join(result.results) or 'none (no granularity was searched)'}")  # fmt: skip
    spec = result.spec if result.spec is not None else get_gpu(result.gpu)
    return table_from_result(result, granularity, spec, backend=result.backend_name, seed=result.seed)


def budget_tag(max_slowdown: float) -> str:
    """The budget as a file name takes it: 0.01 -> "1pct", 0.005 -> "0.5pct"."""
    return f"{round(100.0 * max_slowdown, 6):g}pct"


def table_stem(workload, gpu: str, max_slowdown: float, seed: int = 0) -> str:
    """The file-name stem of a search's tables and figures (module docstring, "File names"): MODEL-GPU, then
    -dpNtpM under a parallel layout (-dpNtpMppP with pipeline stages), the budget (budget_tag), and -seedN for a seed other than 0 (the ':' of an
    ``hf:NAME`` model becomes '-', which file systems and shells take without quoting).

    Args:
        workload: the searched freqopt.workload.models.Workload; gpu: the GPU type's name; max_slowdown: the budget, a
            fraction; seed: the samplers' seed.
    """
    layout = "" if workload.layout.is_single_gpu else f"-dp{workload.layout.dp}tp{workload.layout.tp}"
    if workload.layout.is_pipeline:
        layout += f"pp{workload.layout.pp}"
    tag = f"-seed{seed}" if seed else ""
    return f"{workload.model.replace(':', '-')}-{gpu}{layout}-{budget_tag(max_slowdown)}{tag}"


def table_identity(data: dict[str, Any]) -> dict[str, Any]:
    """What makes two tables the outcome of the same search: GPU type, workload, granularity, budget, backend,
    seed, and for a transferred table its source's workload, granularity and budget. A table document (or one
    with only these keys: "gpu": {"name"}, "workload", "granularity", "max_slowdown", "provenance": {"backend",
    "seed", "transferred_from"})."""
    provenance = data.get("provenance") or {}
    source = provenance.get("transferred_from")
    return {
        "gpu": data["gpu"]["name"], "workload": workload_doc(data["workload"]), "granularity": data["granularity"],
        "max_slowdown": data["max_slowdown"], "backend": provenance.get("backend"), "seed": provenance.get("seed"),
        "transferred_from": None if source is None else {
            "workload": workload_doc(source["workload"]), "granularity": source["granularity"],
            "max_slowdown": source["max_slowdown"]},
    }  # fmt: skip


def _differences(there: dict[str, Any], here: dict[str, Any]) -> str:
    def show(key: str, value) -> str:
        if key == "workload":
            return describe_workload(value, sizes=True)
        if key == "transferred_from":
            return "a search" if value is None else f"transferred from {describe_workload(value['workload'])}"
        return f"{key.replace('_', ' ')} {value}"

    return "; ".join(f"{show(k, there[k])}, not {show(k, here[k])}" for k in here if there.get(k) != here[k])


def check_table_target(path: str | Path, identity: dict[str, Any], *, argument: str = "out") -> None:
    """Refuse to write a table over file ``path`` when that holds anything but a table of the same search
    (table_identity ``identity``): another search's table, or a file that is no clock table. A table of the same
    search (a re-run, a resumed search) may be replaced; a missing file may be written.

    Raises:
        OutputError: one line naming the file, what differs, and what to do.
    """
    path = Path(path)
    if not path.exists():
        return
    try:
        there = table_identity(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise OutputError(f"{path} exists and is not a freqopt clock table; choose another {argument} folder or move "
                          "the file away") from None  # fmt: skip
    if there != identity:
        raise OutputError(f"{path} holds the table of another search ({_differences(there, identity)}); choose "
                          f"another {argument} folder or move that table away")  # fmt: skip


def write_result_tables(result, out: str | Path) -> dict[str, Path]:
    """Write each searched granularity's clock table into folder ``out`` as STEM-GRANULARITY.json and .csv
    (table_stem), atomically; none is written if any would replace another search's table (check_table_target).

    Returns:
        granularity -> the JSON file's path.

    Raises:
        OutputError: ``out`` cannot be written, or holds another search's table under one of these names.
    """
    out = Path(out)
    tables = {g: result_table(result, g) for g in result.results}
    stem = table_stem(result.trace.workload, result.gpu, result.max_slowdown, result.seed)
    paths = {g: out / f"{stem}-{g}.json" for g in tables}
    for g, table in tables.items():
        check_table_target(paths[g], table_identity(table.data))
    for g, table in tables.items():
        write_table(table, paths[g])
        write_table_csv(table, paths[g].with_suffix(".csv"))
    return paths


def write_table(table: ClockTable, path: str | Path) -> Path:
    """Write the table as JSON, atomically. Returns the path."""
    text = json.dumps(table.data, indent=1)
    # Keep number lists (clock lists) on one line each, so the file reads entry by entry.
    text = re.sub(r"\[\s*([-0-9.,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    # And each object of numbers only (a front's option) on one line.
    pair = r'"\w+": (?:[-0-9.eE+]+|null|true|false)'
    text = re.sub(rf"\{{\n\s*({pair}(?:,\n\s*{pair})*)\n\s*\}}",
                  lambda m: "{" + re.sub(r",\n\s*", ", ", m.group(1)) + "}", text)
    atomic_write_text(path, text + "\n")
    return Path(path)


def write_table_csv(table: ClockTable, path: str | Path) -> Path:
    """Write the CSV view (one row per tuning unit; a pipeline table's: one row per instruction, columns stage,
    pass, micro_batch, sm_clock_mhz, and requested_sm_clock_mhz where the table has requests), atomically. Returns
    the path."""
    buf = io.StringIO()
    if table.is_pipeline:
        writer = csv.writer(buf)
        pipeline = table.data["pipeline"]
        requests = {r["stage"]: r for r in pipeline.get("requests", ())}
        writer.writerow(["stage", "pass", "micro_batch", "sm_clock_mhz"] + (["requested_sm_clock_mhz"] if requests else []))
        for stage in pipeline["plan"]:
            for kind in PASSES:
                asked = requests[stage["stage"]][kind] if requests else None
                writer.writerows([stage["stage"], kind, m, clock] + ([asked[m]] if asked else [])
                                 for m, clock in enumerate(stage[kind]))  # fmt: skip
        atomic_write_text(path, buf.getvalue())
        return Path(path)
    columns = ["unit", "kind", "n_kernels", "arithmetic_intensity", "sm_clock_mhz", "mem_clock_mhz", "power_limit_w"]
    if table.is_phase_schedule:
        columns.append("request_phase")
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for entry in table.entries:
        writer.writerow(entry)
    atomic_write_text(path, buf.getvalue())
    return Path(path)


def _integer_clocks(data: dict[str, Any]) -> None:
    """Make every clock of a validated table document an int, in place. JSON Schema's "integer" admits 885.0
    (a number with a zero fractional part), which another tool may write; freqopt's settings and files carry
    885."""
    for entry in data["entries"]:
        for item in (entry, entry.get("default") or {}, *entry.get("front", ())):
            for key in ("sm_clock_mhz", "mem_clock_mhz"):
                if item.get(key) is not None:
                    item[key] = int(item[key])
    for key in ("sm_clocks_mhz", "mem_clocks_mhz"):
        data["gpu"][key] = [int(v) for v in data["gpu"][key]]
    for stage in [*(data.get("pipeline") or {}).get("plan", ()), *(data.get("pipeline") or {}).get("requests", ())]:
        for kind in PASSES:
            stage[kind] = [int(v) for v in stage[kind]]


def _pipeline_error(data: dict[str, Any], path) -> str | None:
    """What is wrong with a pipeline table document (module docstring, "Pipelines") that the schema cannot say, or
    with a pipeline layout's table that is no pipeline table; None when nothing is. Run before the schema check,
    whose message for these cases ("'pipeline' is a required property") would not say what to do."""
    workload = data.get("workload") if isinstance(data.get("workload"), dict) else {}
    layout = workload.get("layout") if isinstance(workload.get("layout"), dict) else {}
    pp = layout.get("pp", 1)
    granularity = data.get("granularity")
    if isinstance(pp, int) and pp > 1 and granularity != INSTRUCTION:
        return (f"{path} is a table of granularity {granularity!r} for a pipeline layout (pp={pp}); a pipeline "
                f"takes an {INSTRUCTION}-level table (a clock per instruction): search the pipeline again at "
                f"granularity {INSTRUCTION!r}")  # fmt: skip
    if granularity != INSTRUCTION:
        return None
    if not isinstance(data.get("pipeline"), dict):
        return (f"{path} is an {INSTRUCTION}-level table without its \"pipeline\" object (the stages, micro-batches "
                "and plan per stage); it was written by hand or cut short: re-export it with freqopt")  # fmt: skip
    if pp == 1:
        return (f"{path} is an {INSTRUCTION}-level table, but its workload has no pipeline stages (layout pp=1); a "
                "pipeline table records its layout's pp: re-export it with freqopt")  # fmt: skip
    return None


def _check_pipeline(data: dict[str, Any], path) -> None:
    """A schema-valid pipeline table's consistency: its stage count is its layout's pp, one entry per (stage, pass)
    with a front of distinct SM clocks only (no memory clock or power limit: those stay at the default), and a plan
    of every stage whose clocks are each pass's measured ones, M per pass.

    Raises:
        ClockTableError: one line naming the file, what is wrong and what to do.
    """
    pipeline = data["pipeline"]
    stages, micro_batches = pipeline["stages"], pipeline["micro_batches"]
    pp = _layout_doc(data["workload"].get("layout")).get("pp", 1)
    redo = "re-export it with freqopt"
    if stages != pp:
        raise ClockTableError(f"{path}: its pipeline has {stages} stages, but its workload's layout has pp={pp}; "
                              f"{redo}")  # fmt: skip
    fronts: dict[tuple[int, str], set[int]] = {}
    for entry in data["entries"]:
        key = (entry["stage"], entry["pass"])
        if key[0] >= stages:
            raise ClockTableError(f"{path}: entry {entry['unit']!r} is for stage {key[0]} of a {stages}-stage "
                                  f"pipeline; {redo}")  # fmt: skip
        if key in fronts:
            raise ClockTableError(f"{path}: stage {key[0]}'s {key[1]} pass has two entries; {redo}")
        clocks = [option.get("sm_clock_mhz") for option in entry["front"]]
        if not clocks or None in clocks or len(set(clocks)) != len(clocks):
            raise ClockTableError(f"{path}: entry {entry['unit']!r} needs a front of distinct measured SM clocks "
                                  f"(none may be null or repeated); {redo}")  # fmt: skip
        if any(option.get(k) is not None for option in [entry["default"], *entry["front"]]
               for k in ("mem_clock_mhz", "power_limit_w")):  # fmt: skip
            raise ClockTableError(f"{path}: entry {entry['unit']!r} sets a memory clock or power limit; a pipeline "
                                  f"table's instructions change the SM clock only; {redo}")  # fmt: skip
        fronts[key] = set(clocks)
    missing = [f"stage{s}.{k}" for s in range(stages) for k in PASSES if (s, k) not in fronts]
    if missing:
        raise ClockTableError(f"{path}: no entry for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                              f"(one per stage and pass); {redo}")  # fmt: skip
    plan = pipeline["plan"]
    for what, lists, has, covers in (("plan", plan, "has", "covers"),
                                     ("requests", pipeline.get("requests"), "have", "cover")):
        if lists is None:
            continue
        if sorted(stage["stage"] for stage in lists) != list(range(stages)):
            raise ClockTableError(f"{path}: its {what} {covers} stages {sorted(s['stage'] for s in lists)}, not each "
                                  f"of 0..{stages - 1} once; {redo}")  # fmt: skip
        for stage in lists:
            for kind in PASSES:
                if len(stage[kind]) != micro_batches:
                    raise ClockTableError(f"{path}: stage {stage['stage']}'s {what} {has} {len(stage[kind])} {kind} "
                                          f"clocks, not one per micro-batch ({micro_batches}); {redo}")  # fmt: skip
    for stage in plan:
        for kind in PASSES:
            unmeasured = sorted(set(stage[kind]) - fronts[(stage["stage"], kind)])
            if unmeasured:
                raise ClockTableError(f"{path}: stage {stage['stage']}'s plan runs its {kind} pass at SM "
                                      f"{unmeasured[0]} MHz, which its front does not list (the plan picks measured "
                                      f"clocks); {redo}")  # fmt: skip


def load_table(path: str | Path, *, spec: GPUSpec | None = None) -> ClockTable:
    """Read and validate a clock table.

    Every command and function that reads a table reads it here, so each gets the same checks: the schema, a GPU
    type freqopt knows, and settings that type supports.

    Args:
        path: the JSON file.
        spec: the GPU the table will be applied to (a device's clock lists, as NVML reports them): the table must
            be for this GPU type and all its clocks and power limits supported. None: the table's own GPU type as
            search_spaces/ describes it.

    Raises:
        ClockTableError: unreadable, not JSON, not a freqopt clock table, another schema version, a GPU type
            freqopt does not know, another GPU type than ``spec``, or settings the GPU does not support; for a
            pipeline layout (pp > 1): a table of another granularity than "instruction", no "pipeline" object, a stage
            count other than the layout's pp, entries that do not cover each (stage, pass) once, or a plan that does
            not give each stage M clocks per pass among those measured (module docstring, "Pipelines").
    """
    import jsonschema

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ClockTableError(f"cannot read clock table {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ClockTableError(f"{path} is not a text file, so not a clock table; re-export it with freqopt") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClockTableError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-export it with freqopt") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_NAME:
        raise ClockTableError(f"{path} is not a freqopt clock table (no \"schema\": \"{SCHEMA_NAME}\")")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ClockTableError(
            f"{path} has clock-table schema version {data.get('schema_version')!r}; this freqopt reads version "
            f"{SCHEMA_VERSION}: re-export it with this freqopt version"
        )
    wrong = _pipeline_error(data, path)
    if wrong:
        raise ClockTableError(wrong)
    try:
        jsonschema.validate(data, CLOCK_TABLE_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "top level"
        raise ClockTableError(f"{path} is a corrupt clock table ({where}: {e.message})") from e
    _integer_clocks(data)
    if data["granularity"] == INSTRUCTION:
        _check_pipeline(data, path)
    table = ClockTable(data, source=str(Path(path).resolve()))
    if spec is None:
        from freqopt.errors import UnknownNameError
        from freqopt.gpu.specs import get_gpu

        try:
            spec = get_gpu(table.gpu)
        except UnknownNameError as e:
            raise ClockTableError(f"{path} was searched on GPU type {table.gpu!r}, which no file in search_spaces/ "
                                  "describes; search again on a known GPU type") from e  # fmt: skip
    table.check_gpu(spec, source=path)
    return table
