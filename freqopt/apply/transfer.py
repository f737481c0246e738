"""Apply a clock table found on one workload or layout to another (kernel classes matched by
portable signatures).

A kernel-level table holds one setting per kernel class. On another layout the same class may have other shapes
(tensor parallelism splits the projections; another micro-batch changes every activation), so each of the
target's kernel classes takes, in order of preference:

1. the entry of the same class: same pass and exact signature (kind, operator, dtype, shapes, and for
   collectives the group);
2. else the entry of the same kind (in the same pass if the table has one there) whose arithmetic intensity
   (FLOPs per byte of device memory) is nearest on a log scale: kernels of one kind and intensity sit at the
   same place on the roofline, so the same clocks suit them;
3. else the default setting (a kind the source never ran, such as the collectives of a parallel layout when the
   table was searched on one GPU).

Pass-level tables match by pass name, iteration-level and power-cap tables apply their one setting everywhere.
A phase-level table is a schedule of requests at named phases (module boundaries and the optimizer step); every
layout and micro-batch of the same model has the same phases, so it is laid onto the target as it stands, each
entry requesting its setting at its phase there (freqopt.apply.runtime.plan_phases, as the runtime applies it), and it
is validated as requested. It carries no fronts, so its budget is re-allocated along the one line from its clocks
to the defaults (freqopt.apply.reallocate.reallocate_requests: its requests' SM clocks backed off by one fraction,
bisected on validations of the whole target iteration), never worse than the target's own iteration and phase
schedules. The transfer writes the result for the target workload (TransferReport.table), since a table applies
only to the workload it names (freqopt.tables.ClockTable.check_workload).

Reusing the clocks as they were ignores that on another layout the same clocks cost another slowdown (an
all-reduce on the critical path, a GEMM of another shape). A table written by this freqopt also carries each
unit's measured default and (time, energy) front, so the budget is re-allocated on the target instead
(reallocate): each target unit's default is measured there, its matched entry's front is scaled to it (the
ratios of time and energy to the default carry over; the absolute figures do not), units the source never ran
(the collectives of a parallel layout) get a study of their own, as a native search runs it, and the MILP's
budget is calibrated by validating the whole target iteration, as the search itself does
(freqopt.search.allocation). A table without fronts (one setting for the iteration, a finer level its source
realized as one clock, or an older freqopt's: no_fronts_reason) cannot be re-allocated; the transfer writes it as
transferred, one entry per target unit with its figures as validated on the target, where it meets the budget
there, and says why it was not re-allocated. No table out of the budget is ever written: where nothing holds, the
report says so and the CLI names the native search that finds a table which does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from freqopt.budget import DEFAULT_CONFIDENCE
from freqopt.gpu.backends.base import Backend, switch_latency
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Trace
from freqopt.apply.transfer_checks import TransferArguments, check_transfer_arguments
from freqopt.apply.reallocate import has_fronts, no_fronts_reason, reallocate, reallocate_requests
from freqopt.apply.transfer_match import BY_KIND, EXACT, UNMATCHED, Match, TransferredSchedule, transfer_table
from freqopt.apply.transfer_report import TransferReport, target_table_path
from freqopt.search.config import SearchConfig
from freqopt.search.runner import levels_to_run, run_search
from freqopt.search.storage import open_storage, study_prefix, validation_log
from freqopt.search.validate import Validator
from freqopt.tables import ClockTable

# Matching (transfer_match), re-allocation (reallocate) and the report (transfer_report) live in their own modules;
# their names are importable from here as before.
__all__ = ["Match", "TransferredSchedule", "TransferReport", "transfer_table", "reallocate", "evaluate_transfer",
           "transfer", "EXACT", "BY_KIND", "UNMATCHED", "has_fronts", "no_fronts_reason", "target_table_path",
           "native_granularities"]


def native_granularities(granularity: str, switching: bool = True) -> tuple[str, ...]:
    """What a native search of ``granularity`` runs, as ``freqopt search`` does (levels_to_run): the granularity
    and the coarser levels it chooses among (the kernel level: iteration, pass and, when ``switching`` has a cost,
    phase; pass and phase: the iteration level), or the power cap alone; in the order they are searched."""
    return levels_to_run((granularity,), switching)


def evaluate_transfer(table: ClockTable, trace: Trace, backend: Backend, config: SearchConfig, on_unit=None, *,
                      native: bool = True) -> TransferReport:  # fmt: skip
    """Transfer ``table`` to ``trace``; validate the settings as transferred by measuring the whole iteration
    (``config.validation_repeats`` times; as a runtime realizes it, with switching costs, when
    ``config.switching``); with ``native``, search the target natively with ``config`` (its granularities
    replaced by native_granularities of the table's), else only the clock granularities coarser than the table's;
    and re-allocate the budget on the target from the table's fronts, starting from the coarser level's result
    (reallocate), or, for a phase schedule, by backing its requests' clocks off toward the defaults
    (reallocate_requests); other tables without fronts are not re-allocated. All against one shared baseline
    measurement.

    Args:
        on_unit: called as on_unit(granularity, units_done, units_total): during the searched granularities, then
            "transfer" while the target's units are measured for the re-allocation.

    Raises:
        StorageError: the storage URL in ``config`` cannot be opened.
    """
    schedule = transfer_table(table, trace)
    storage = open_storage(config.storage)
    log = validation_log(storage, study_prefix(trace, backend.spec, config.seed))
    validator = Validator.for_search(trace, backend, config, log=log)
    baseline = validator.baseline()
    # A phase-level table is realizable as it stands (its requests are look-ahead already), others as a runtime
    # realizes them.
    measure = validator.requests if schedule.granularity == "phase" else validator
    # Held to the budget as the search's schedules are: its readings paired with the defaults', judged on the upper
    # confidence bound of its time (Validator.requests).
    transferred = measure(schedule.per_kernel(), key="transferred",
                          limit_s=(1.0 + config.max_slowdown) * baseline.time_s)
    # The native search of the table's own level (a kernel-level table that ended on phase blocks: the kernel level,
    # whose phase level is then among the coarser ones).
    levels = native_granularities(table.granularity, config.switching)
    # The whole native search, whose coarser levels are the re-allocation's too; without it the coarser levels
    # only (cheap: one and three units), which a table without fronts does not need.
    searching = levels if native else levels[:-1] if has_fronts(table) or table.is_phase_schedule else ()
    searched = run_search(trace, backend, dataclasses.replace(config, granularities=searching), on_unit=on_unit,
                          validator=validator) if searching else None  # fmt: skip
    coarse = searched.results if searched else {}
    reallocated = None
    coarser = [coarse[g] for g in levels[:-1] if g in coarse]
    if has_fronts(table):
        reallocated = reallocate(schedule, table, backend, config, validator, baseline, coarser=coarser,
                                 storage=storage, on_unit=on_unit)  # fmt: skip
    elif table.is_phase_schedule:
        reallocated = reallocate_requests(schedule, table, backend, config, validator, baseline, coarser=coarser)
    return TransferReport(schedule, baseline, transferred, reallocated, searched if native else None,
                          config.max_slowdown, table, backend.spec, backend.name, config.seed,
                          config.storage, confidence=config.confidence)  # fmt: skip


def _check_target(out: Path, table: ClockTable, trace: Trace, spec: GPUSpec, slowdown: float, seed: int,
                  backend_name: str) -> None:
    """Refuse, before any measurement, a transfer whose table would replace another search's or transfer's
    (freqopt.tables.check_table_target)."""
    from freqopt.tables import check_table_target, table_identity, workload_doc

    source = table.data
    budget = slowdown  # every table a transfer writes holds the transfer's budget on the target
    path = target_table_path(out, trace, spec.name, budget, seed, table.granularity)
    check_table_target(path, table_identity({
        "gpu": {"name": spec.name}, "workload": workload_doc(trace.workload), "granularity": table.granularity,
        "max_slowdown": budget, "provenance": {"backend": backend_name, "seed": seed, "transferred_from": {
            "workload": source["workload"], "granularity": source["granularity"],
            "max_slowdown": source["max_slowdown"]}}}))  # fmt: skip


def transfer(table, model, *, gpu=None, max_slowdown: float | str | None = None, backend="sim",
             storage: str | None = None, out=None, seed: int = 0, n_trials: int | None = None,
             micro_batch_size: int | None = None, seq_len: int | None = None, n_heads: int | None = None,
             vocab_multiple: int | None = None, layout=None, native: bool = True,
             switch_latency_ms: float | None = None, confidence: float = DEFAULT_CONFIDENCE, on_start=None,
             on_unit=None, verbose: bool = False) -> TransferReport:  # fmt: skip
    """Apply clock table ``table`` to ``model`` (another model, size or layout): validate it as transferred,
    re-allocate the budget on the target from the fronts it carries, and search the target natively under the same
    budget (evaluate_transfer). With ``out``, the target's table (the re-allocated one where it saves energy within
    the budget; else a table without fronts as transferred, where that does on the target) is written
    there for the target workload (TransferReport.write_table), and its absolute path is the report's
    ``table_path`` (None where nothing was written: the summary's not_reallocated says why).

    Args:
        table: a ClockTable or the path of one (freqopt.tables.load_table).
        model: the target: a model name (with the get_workload overrides below) or a Workload.
        gpu: GPU type name or GPUSpec; must be the table's (default: the table's).
        max_slowdown: budget of the native search, a fraction or "1%" (default: the table's).
        backend: "sim" or "nvml" (freqopt.gpu.backends.get_backend); closed when done.
        storage: Optuna storage URL of the native search; default journal:OUT/freqopt.journal with ``out``, else
            in memory.
        out: folder of the default storage and of the re-allocated table (created); None: no folder.
        seed: seeds the samplers and the simulated GPU's noise.
        n_trials: trials per tuning unit of the native search (default SearchConfig's).
        micro_batch_size, seq_len, n_heads, vocab_multiple, layout: get_workload overrides of ``model``.
        on_start: called as on_start(table, trace, spec) once the target is traced, before any measurement.
        native: also search the target natively, for comparison (the costly part).
        switch_latency_ms: the GPU's clock-switch latency, ms, in place of its file's (GPUSpec.with_switch_latency).
        confidence: the one-sided confidence, in [0.5, 1), at which every schedule's slowdown is held to the budget,
            as transferred, re-allocated and searched natively (freqopt.search as search takes it; default 0.95).
        on_unit: called as on_unit(granularity, units_done, units_total) during the target-side measurements
            ("transfer") and the native search.
        verbose: let Optuna log at INFO (a line per study it creates); by default WARNING, and the caller's
            Optuna verbosity is restored on return (freqopt.search.study.optuna_logging).

    Returns:
        TransferReport; ``.schedule.trace.workload`` is the target, ``.spec`` the GPU type and ``.max_slowdown``
        the budget used.

    Raises:
        UnknownNameError: unknown model, GPU type or backend.
        ClockTableError: the table cannot be read, was searched on another GPU type than ``gpu``, or is a
            phase-level table of another model (it requests a setting at a phase the target does not have).
        InvalidSettingError: a bad slowdown, confidence, override, layout, n_trials or switch_latency_ms.
        OutputError: ``out`` is a file or cannot be written, or holds another search's table under the name the
            target's table takes (refused before any measurement).
        StorageError: ``storage`` cannot be opened.
    """
    from freqopt.gpu.backends import get_backend
    from freqopt.resolve import resolve_workload

    # Every check before any work: those that need no model built first, in the order the command line always had
    # (check_transfer_arguments, which the command line runs before it imports PyTorch), then the model's.
    checked = check_transfer_arguments(table, model, gpu=gpu, max_slowdown=max_slowdown, backend=backend,
                                       n_trials=n_trials, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                       n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout,
                                       switch_latency_ms=switch_latency_ms, confidence=confidence,
                                       storage=storage)  # fmt: skip
    workload = resolve_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    backend = checked.backend
    measuring = get_backend(backend, checked.spec, seed=seed) if isinstance(backend, str) else backend
    try:
        with switch_latency(measuring, checked.switch_s):  # a Backend the caller gave keeps its own GPU type
            return _transfer_on(measuring, checked, workload, out=out, storage=storage, seed=seed, n_trials=n_trials,
                                native=native, on_start=on_start, on_unit=on_unit, verbose=verbose)  # fmt: skip
    finally:
        if isinstance(backend, str):
            measuring.close()  # a real GPU goes back to what it was found with


def _transfer_on(measuring: Backend, checked: TransferArguments, workload, *, out, storage: str | None, seed: int,
                 n_trials: int | None, native: bool, on_start, on_unit, verbose: bool) -> TransferReport:  # fmt: skip
    """transfer's work on the opened backend: trace the target, refuse what needs the trace (a phase-level table of
    another model's phases) or the output (a bad storage URL, a table that would replace another's) before any
    measurement, evaluate the transfer (evaluate_transfer) and write the target's table where there is one."""
    from freqopt.api import open_output
    from freqopt.search.study import optuna_logging
    from freqopt.workload.trace import trace_training_iteration

    table, spec, slowdown = checked.table, checked.spec, checked.max_slowdown
    trace = trace_training_iteration(workload)
    if table.is_phase_schedule:  # a table of another model's phases fails here, before any file is written
        transfer_table(table, trace)
    out, storage = open_output(out, storage)  # a bad URL fails here, before any work or folder is made
    if out is not None:  # a table may be written: over no other search's
        _check_target(out, table, trace, spec, slowdown, seed, measuring.name)
    counts = {"n_trials_1d": n_trials, "n_trials_2d": n_trials} if n_trials else {}
    config = SearchConfig(max_slowdown=slowdown, seed=seed, storage=storage, confidence=checked.confidence, **counts)
    if on_start is not None:
        on_start(table, trace, spec)
    with optuna_logging(verbose):
        report = evaluate_transfer(table, trace, measuring, config, on_unit=on_unit, native=native)
    written = report.writes_table()
    if out is not None and written:
        report = dataclasses.replace(report, table_path=report.write_table(out))
    return report
