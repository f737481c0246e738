"""The clock-table format (freqopt.tables): its schema's name and version, the JSON Schema a table file is checked
against, the granularity and passes of a pipeline table, a table's workload and GPU documents, and ClockTable, a
loaded table with the checks that refuse it for another workload or GPU."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freqopt.errors import ClockTableError, TableWorkloadError
from freqopt.gpu.specs import GPUSpec

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "CLOCK_TABLE_SCHEMA", "INSTRUCTION", "PASSES", "ClockTable", "workload_doc",
           "describe_workload", "gpu_doc", "clock_mhz"]

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
_pipeline = {  # a pipeline table's pipeline and plan (freqopt.tables, "Pipelines")
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


def layout_doc(layout: dict[str, Any] | None) -> dict[str, int]:
    """A table's layout completed: {dp, tp} (1 where missing: a table from before layouts), and pp only above 1
    (Layout.as_dict), so that a table without pipeline stages reads and writes as before pp existed."""
    layout = {"dp": 1, "tp": 1, "pp": 1, **(layout or {})}
    return {"dp": layout["dp"], "tp": layout["tp"], **({"pp": layout["pp"]} if layout["pp"] != 1 else {})}


def _layout_text(layout: dict[str, Any] | None) -> str:
    """A table's layout as freqopt writes layouts: "dp=1,tp=1", "dp=1,tp=1,pp=2" (Layout.__str__)."""
    layout = layout_doc(layout)
    return f"dp={layout['dp']},tp={layout['tp']}" + (f",pp={layout['pp']}" if "pp" in layout else "")


def workload_doc(workload) -> dict[str, Any]:
    """A table's ``workload`` for a freqopt.workload.models.Workload (or a table's own ``workload`` document, completed:
    a missing layout is one GPU): model, n_layers, d_model, n_heads, seq_len (tokens), micro_batch_size
    (sequences per model replica), layout {dp, tp, and pp where above 1}; sizes a user's own step does not state are
    None."""
    if isinstance(workload, dict):
        return {**{k: workload.get(k) for k in _WORKLOAD_FIELDS}, "layout": layout_doc(workload.get("layout"))}
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




def _model_argument(model: str) -> str:
    """A --model value for a suggested command that runs from any folder: an ``hf:PATH`` with PATH absolute (not
    resolving links), quoted for a shell where it needs to be; a built-in name as it is."""
    if model.startswith("hf:"):
        model = "hf:" + str(Path(model[3:]).expanduser().absolute())
    return shlex.quote(model)


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

    def check_workload(self, workload, *, source: str | Path | None = None, model: str | None = None) -> None:
        """Refuse to apply the table to another workload than the one it was found for: another model (name,
        layers, width or heads), layout, micro-batch or sequence length.

        Args:
            workload: a freqopt.workload.models.Workload, or a table's ``workload`` document.
            source: how the message names the table (default its file, else "the clock table").
            model: the model as the caller named it, for the suggested command (an ``hf:PATH``, whose workload's
                name is only ``hf:`` and the config's folder: PATH is made absolute, so that the command runs from
                any folder); default the workload's name.

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
        # a file: absolute (the command runs from any folder), quoted for a shell; a table held in memory: its name
        table_arg = shlex.quote(str(Path(name).absolute())) if Path(name).is_file() else str(name)
        command = (f"freqopt transfer --table {table_arg} "
                   f"--model {_model_argument(model or target['model'])} --layout dp={layout['dp']},tp={layout['tp']} "
                   f"--micro-batch-size {target['micro_batch_size']} --seq-len {target['seq_len']}")  # fmt: skip
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
        """A pipeline table's ``pipeline`` object (freqopt.tables, "Pipelines"); None for other tables."""
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


def gpu_doc(spec: GPUSpec) -> dict[str, Any]:
    """A table's "gpu" object: the GPU type's name and marketing name, its clock lists (MHz) and default power
    limit (W)."""
    return {"name": spec.name, "marketing_name": spec.marketing_name,
            "sm_clocks_mhz": [clock_mhz(f) for f in spec.sm_clocks_mhz],
            "mem_clocks_mhz": [clock_mhz(m) for m in spec.mem_clocks_mhz],
            "power_limit_default_w": spec.power_limit_default_w}


def clock_mhz(value) -> int | None:
    """A clock setting as the table holds it: an integer of MHz (NVML takes clocks as unsigned integers of MHz,
    nvmlDeviceSetGpuLockedClocks), so that a clock that went through floating point (885.0 from another tool's
    JSON, a NumPy integer) is written as 885; None (the default) stays None."""
    return None if value is None else round(float(value))

