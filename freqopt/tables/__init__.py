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
``"pipeline"`` object holds the pipeline and the plan (freqopt.pipeline.table.pipeline_table builds it):

    "pipeline": {"stages": 2, "micro_batches": 4, "schedule": "1f1b", "partition_method": "parameters",
                 "blocking_power_w": 71.6, "switch_s": 0.026,
                 "plan": [{"stage": 0, "forward": [1410, ...], "backward": [1980, ...]}, ...]}

``plan[s]["forward"][m]`` is the SM clock (MHz) of micro-batch m's forward on stage s (M clocks per pass). An
optional ``"requests"`` of the same form holds the clock the runtime asks for at each instruction's start, where that
differs from the plan because a switch takes effect one latency later (freqopt.pipeline.realize's realized
schedule: a switch to a faster clock asked for one instruction early, so that no instruction runs slower than
planned); it is what the search validated, any clock the GPU supports, and it is applied only at the plan's own
micro-batch count. The plan
is kept by micro-batch rather than in each stage's 1F1B order: this package sits below the pipeline wing, whose
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

**Modules.** freqopt.tables.format holds the schema, the constants, ClockTable and the workload document;
freqopt.tables.result the table of a one-GPU search (table_from_result, result_table) and the file names
(table_stem); freqopt.tables.io the files (write_table, write_table_csv, write_result_tables, check_table_target,
load_table). Every name is importable from freqopt.tables, which imports neither PyTorch nor the search.
"""

from __future__ import annotations

from freqopt.tables.format import (CLOCK_TABLE_SCHEMA, INSTRUCTION, PASSES, SCHEMA_NAME, SCHEMA_VERSION, ClockTable,
                                   describe_workload, workload_doc)
from freqopt.tables.io import (check_table_target, load_table, table_identity, write_result_tables, write_table,
                               write_table_csv)
from freqopt.tables.result import budget_tag, result_table, table_from_result, table_stem

__all__ = ["SCHEMA_NAME", "SCHEMA_VERSION", "CLOCK_TABLE_SCHEMA", "INSTRUCTION", "PASSES", "ClockTable", "workload_doc",
           "describe_workload", "table_from_result", "result_table", "budget_tag", "table_stem", "table_identity",
           "check_table_target", "write_result_tables", "write_table", "write_table_csv", "load_table"]
