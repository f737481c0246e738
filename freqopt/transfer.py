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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from freqopt.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import ClockTableError
from freqopt.search.config import SearchConfig
from freqopt.search.result import SearchResult
from freqopt.search.runner import run_search
from freqopt.search.storage import open_storage, study_prefix, validation_log
from freqopt.search.validate import Validator
from freqopt.kernels import Trace
from freqopt.search.units import GRANULARITIES, TuningUnit, partition
from freqopt.tables import ClockTable

__all__ = ["Match", "TransferredSchedule", "TransferReport", "transfer_table", "evaluate_transfer", "transfer"]

EXACT, BY_KIND, UNMATCHED = "exact", "by-kind", "unmatched"


@dataclass(frozen=True)
class Match:
    """How one target tuning unit got its setting.

    Attributes:
        unit: the target's unit (a kernel class at kernel level).
        how: "exact", "by-kind" or "unmatched".
        source_unit: the table entry used (its unit name), None when unmatched.
        setting: the setting applied.
    """

    unit: TuningUnit
    how: str
    source_unit: str | None
    setting: ClockSetting


@dataclass(frozen=True)
class TransferredSchedule:
    """A table's settings laid onto a target trace: one Match per target tuning unit."""

    trace: Trace
    granularity: str
    matches: tuple[Match, ...]

    def count(self, how: str) -> int:
        """Target tuning units (kernel classes at kernel level) matched in this way."""
        return sum(1 for m in self.matches if m.how == how)

    def per_kernel(self) -> tuple[ClockSetting, ...]:
        """The setting of every kernel of the target trace, in trace order."""
        settings = [DEFAULT_SETTING] * len(self.trace)
        for m in self.matches:
            for i in m.unit.kernel_indices:
                settings[i] = m.setting
        return tuple(settings)


def _setting(entry: dict) -> ClockSetting:
    return ClockSetting(entry["sm_clock_mhz"], entry["mem_clock_mhz"], entry["power_limit_w"])


def transfer_table(table: ClockTable, trace: Trace) -> TransferredSchedule:
    """Lay ``table``'s settings onto ``trace`` (module docstring).

    Args:
        table: a loaded clock table (tables.load_table, already checked against the target GPU).
        trace: the target workload's trace (any model, micro-batch or layout).

    Returns:
        TransferredSchedule with one Match per tuning unit of the target at the table's granularity.

    Raises:
        ClockTableError: a phase-level table (a schedule of its own layout's phases; not transferred yet).
    """
    granularity = table.granularity
    if granularity == "phase":
        raise ClockTableError("a phase-level table is a schedule of one layout's phases and is not transferred yet; "
                              "transfer the kernel-level table, or search the target with granularity 'phase'")
    entries = table.entries
    units = partition(trace, granularity)
    matches = []
    if granularity in ("iteration", "power-cap"):
        setting = _setting(entries[0])
        return TransferredSchedule(trace, granularity, tuple(Match(u, EXACT, entries[0]["unit"], setting) for u in units))
    by_name = {e["unit"]: e for e in entries}
    by_kind: dict[str, list[tuple[float, str, dict]]] = {}
    for e in entries:
        if e.get("kind") and e.get("arithmetic_intensity") is not None:
            intensity = math.log10(max(e["arithmetic_intensity"], 0.0) + 1e-9)
            by_kind.setdefault(e["kind"], []).append((intensity, e["unit"].split("/", 1)[0], e))
    for unit in units:
        if unit.name in by_name:
            entry = by_name[unit.name]
            matches.append(Match(unit, EXACT, entry["unit"], _setting(entry)))
            continue
        kernels = unit.kernels(trace)
        candidates = by_kind.get(kernels[0].kind, []) if granularity == "kernel" else []
        if not candidates:
            matches.append(Match(unit, UNMATCHED, None, DEFAULT_SETTING))
            continue
        candidates = [c for c in candidates if c[1] == kernels[0].pass_name] or candidates
        target = math.log10(sum(k.flops for k in kernels) / max(sum(k.mem_bytes for k in kernels), 1.0) + 1e-9)
        _, _, entry = min(candidates, key=lambda c: (abs(c[0] - target), c[2]["unit"]))
        matches.append(Match(unit, BY_KIND, entry["unit"], _setting(entry)))
    return TransferredSchedule(trace, granularity, tuple(matches))


@dataclass(frozen=True)
class TransferReport:
    """A transferred table validated on the target, beside a search done natively on the target.

    Attributes:
        schedule: the transferred settings.
        baseline: the target iteration at default settings (shared by both).
        transferred: the target iteration measured with the transferred settings.
        native: the native search (its result at the table's granularity is the comparison).
    """

    schedule: TransferredSchedule
    baseline: Measurement
    transferred: Measurement
    native: SearchResult

    def summary(self) -> dict:
        """{"transferred": {energy_saved_pct, slowdown_pct, matched_exact, matched_by_kind, unmatched},
        "native": {energy_saved_pct, slowdown_pct}}; percentages against the default settings, match counts in
        target tuning units (kernel classes at kernel level)."""
        g = self.schedule.granularity
        base = self.baseline
        return {
            "transferred": {
                "energy_saved_pct": 100.0 * (1.0 - self.transferred.energy_j / base.energy_j),
                "slowdown_pct": 100.0 * (self.transferred.time_s / base.time_s - 1.0),
                "matched_exact": self.schedule.count(EXACT),
                "matched_by_kind": self.schedule.count(BY_KIND),
                "unmatched": self.schedule.count(UNMATCHED),
            },
            "native": {"energy_saved_pct": self.native.energy_saved_pct(g), "slowdown_pct": self.native.slowdown_pct(g)},
        }


def native_granularities(granularity: str) -> tuple[str, ...]:
    """What a native search runs to reach ``granularity`` as ``freqopt search`` does: the clock granularities
    from iteration down to it (each finer one starts from the coarser result), or the power cap alone."""
    if granularity == "power-cap":
        return ("power-cap",)
    clocks = [g for g in GRANULARITIES if g != "power-cap"]
    return tuple(clocks[: clocks.index(granularity) + 1])


def evaluate_transfer(table: ClockTable, trace: Trace, backend: Backend, config: SearchConfig,
                      on_unit=None) -> TransferReport:  # fmt: skip
    """Transfer ``table`` to ``trace``, validate it by measuring the whole iteration (``config.validation_repeats``
    times; as a runtime realizes it, with switching costs, when ``config.switching``), and search the target natively with ``config`` (its granularities are replaced by
    native_granularities of the table's), against one shared baseline measurement.

    Raises:
        StorageError: the storage URL in ``config`` cannot be opened.
    """
    import dataclasses

    schedule = transfer_table(table, trace)
    log = validation_log(open_storage(config.storage), study_prefix(trace, backend.spec, config.seed))
    validator = Validator(trace, backend, config.validation_repeats, switching=config.switching, log=log)
    baseline = validator.baseline()
    transferred = validator(schedule.per_kernel(), key="transferred")
    native_config = dataclasses.replace(config, granularities=native_granularities(schedule.granularity))
    native = run_search(trace, backend, native_config, on_unit=on_unit, validator=validator)
    return TransferReport(schedule, baseline, transferred, native)


def transfer(table, model, *, gpu=None, max_slowdown: float | str | None = None, backend="sim",
             storage: str | None = None, out=None, seed: int = 0, n_trials: int | None = None,
             micro_batch_size: int | None = None, seq_len: int | None = None, n_heads: int | None = None,
             vocab_multiple: int | None = None, layout=None, on_start=None, on_unit=None) -> TransferReport:  # fmt: skip
    """Apply clock table ``table`` to ``model`` (another model, size or layout), validate it by measuring the
    target's whole iteration, and search the target natively under the same budget (evaluate_transfer).

    Args:
        table: a ClockTable or the path of one (freqopt.tables.load_table).
        model: the target: a model name (with the get_workload overrides below) or a Workload.
        gpu: GPU type name or GPUSpec; must be the table's (default: the table's).
        max_slowdown: budget of the native search, a fraction or "1%" (default: the table's).
        backend: "sim" or "nvml" (freqopt.backends.get_backend); closed when done.
        storage: Optuna storage URL of the native search; default sqlite:///OUT/freqopt.db with ``out``, else in
            memory.
        out: folder of the default storage (created); None: no folder.
        seed: seeds the samplers and the simulated GPU's noise.
        n_trials: trials per tuning unit of the native search (default SearchConfig's).
        micro_batch_size, seq_len, n_heads, vocab_multiple, layout: get_workload overrides of ``model``.
        on_start: called as on_start(table, trace, spec) once the target is traced, before any measurement.
        on_unit: called as on_unit(granularity, units_done, units_total) during the native search.

    Returns:
        TransferReport; ``.schedule.trace.workload`` is the target, ``.native.spec`` the GPU type and
        ``.native.max_slowdown`` the budget used.

    Raises:
        UnknownNameError: unknown model, GPU type or backend.
        ClockTableError: the table cannot be read, was searched on another GPU type than ``gpu``, or is a
            phase-level table.
        InvalidSettingError: a bad slowdown, override, layout or n_trials.
        OutputError: ``out`` is a file or cannot be written.
        StorageError: ``storage`` cannot be opened.
    """
    import optuna

    from freqopt.api import check_writable_dir
    from freqopt.errors import check_positive_int
    from freqopt.backends import get_backend
    from freqopt.budget import parse_slowdown
    from freqopt.gpus import get_gpu
    from freqopt.resolve import resolve_backend, resolve_gpu, resolve_workload
    from freqopt.tables import load_table
    from freqopt.trace import trace_training_iteration

    # Every check before any work, in the order the command line always had.
    workload = resolve_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    requested = resolve_gpu(gpu)  # an unknown name fails as such before the table is read
    source = "clock table" if isinstance(table, ClockTable) else str(table)
    if not isinstance(table, ClockTable):
        table = load_table(table)
    spec = requested or get_gpu(table.gpu)
    table.check_gpu(spec, source=source)
    slowdown = parse_slowdown(max_slowdown) if max_slowdown is not None else table.data["max_slowdown"]
    check_positive_int("n_trials", n_trials, optional=True)
    backend = resolve_backend(backend)
    measuring = get_backend(backend, spec, seed=seed) if isinstance(backend, str) else backend
    try:
        if out is not None:
            out = check_writable_dir(out)
            storage = storage or f"sqlite:///{(out / 'freqopt.db').resolve()}"
        open_storage(storage)  # a bad URL fails here, before any work
        counts = {"n_trials_1d": n_trials, "n_trials_2d": n_trials} if n_trials else {}
        config = SearchConfig(max_slowdown=slowdown, seed=seed, storage=storage, **counts)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        trace = trace_training_iteration(workload)
        if on_start is not None:
            on_start(table, trace, spec)
        return evaluate_transfer(table, trace, measuring, config, on_unit=on_unit)
    finally:
        if isinstance(backend, str):
            measuring.close()  # a real GPU goes back to what it was found with
