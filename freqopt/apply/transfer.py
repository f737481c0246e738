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
is validated as requested. It carries no fronts: the target's own phase schedule is its native search. The
transfer writes it for the target workload (TransferReport.table), since a table applies only to the workload it
names (freqopt.tables.ClockTable.check_workload).

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
there, and says why it was not re-allocated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, switch_latency
from freqopt.errors import ClockTableError
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Trace
from freqopt.search.allocation import (_prediction, allocate_applied, candidate_schedules,
                                       settings_on)
from freqopt.search.config import SearchConfig
from freqopt.search.result import GranularityResult, SearchResult
from freqopt.search.runner import (_at_least_the_coarser_schedules, _at_least_the_phase_schedule, _n_trials,
                                   _one_clock, _slack, _warm_starts, levels_to_run, one_clock_reason,
                                   run_search)  # fmt: skip
from freqopt.search.storage import open_storage, study_prefix, validation_log
from freqopt.search.study import Option, UnitSearch
from freqopt.search.units import TuningUnit, family_units, kernel_families, partition
from freqopt.search.validate import Validator
from freqopt.search.workers import UnitWork, run_unit
from freqopt.tables import ClockTable

__all__ = ["Match", "TransferredSchedule", "TransferReport", "transfer_table", "reallocate", "evaluate_transfer",
           "transfer"]

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


def transfer_table(table: ClockTable, trace: Trace) -> TransferredSchedule:
    """Lay ``table``'s settings onto ``trace`` (module docstring).

    Args:
        table: a loaded clock table (tables.load_table, already checked against the target GPU).
        trace: the target workload's trace (any model, micro-batch or layout).

    Returns:
        TransferredSchedule with one Match per tuning unit of the target at the table's granularity; for a
        phase-level table one exact Match per entry, its unit the target's kernels from the entry's request phase
        up to the next entry's (cyclically: the kernels before the first request run the last one's setting).

    Raises:
        ClockTableError: a phase-level table requesting a setting at a phase the target does not have (another
            model).
    """
    granularity = table.granularity
    if table.is_phase_schedule:
        return _transfer_phase_table(table, trace)
    entries = table.entries
    units = partition(trace, granularity)
    matches = []
    if granularity in ("iteration", "power-cap"):
        setting = ClockSetting.of_entry(entries[0])
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
            matches.append(Match(unit, EXACT, entry["unit"], ClockSetting.of_entry(entry)))
            continue
        kernels = unit.kernels(trace)
        candidates = by_kind.get(kernels[0].kind, []) if granularity == "kernel" else []
        if not candidates:
            matches.append(Match(unit, UNMATCHED, None, DEFAULT_SETTING))
            continue
        candidates = [c for c in candidates if c[1] == kernels[0].pass_name] or candidates
        target = math.log10(sum(k.flops for k in kernels) / max(sum(k.mem_bytes for k in kernels), 1.0) + 1e-9)
        _, _, entry = min(candidates, key=lambda c: (abs(c[0] - target), c[2]["unit"]))
        matches.append(Match(unit, BY_KIND, entry["unit"], ClockSetting.of_entry(entry)))
    return TransferredSchedule(trace, granularity, tuple(matches))


def _transfer_phase_table(table: ClockTable, trace: Trace) -> TransferredSchedule:
    from freqopt.workload.phases import phase_spans
    from freqopt.search.schedule import request_phases, settings_per_phase

    spans = phase_spans(trace.meta.get("marks", ()), len(trace))
    requests = request_phases(table, [label for label, _, _ in spans])  # refuses a phase this trace lacks
    # The entry in force in each phase, as the runtime requests them (freqopt.search.schedule.requested_per_phase).
    owner = settings_per_phase(len(spans), list(zip(requests, range(len(table.entries)))))
    matches = []
    for j, entry in enumerate(table.entries):
        kernels = tuple(k for p, (_, first, end) in enumerate(spans) if owner[p] == j for k in range(first, end))
        matches.append(Match(TuningUnit(entry["unit"], kernels), EXACT, entry["unit"], ClockSetting.of_entry(entry)))
    return TransferredSchedule(trace, "phase", tuple(matches))


def has_fronts(table: ClockTable) -> bool:
    """Whether every entry carries its unit's measured default and front (tables written since fronts were
    added; not phase-level tables)."""
    return all("front" in e and "default" in e for e in table.entries)


def no_fronts_reason(table: ClockTable) -> str:
    """Why ``table``'s budget cannot be re-allocated on a target (one clause; "" where it can: has_fronts).

    A phase-level table is a schedule of requests, laid on as it stands; an iteration-level or power-cap table holds
    one setting for the whole iteration, with nothing to share a budget between; a finer level that its search did
    not search (the table's ``note``: a step shorter than two clock switches keeps the iteration level's clock,
    issue 25) carries no units' fronts; otherwise an older freqopt wrote it."""
    if has_fronts(table):
        return ""
    if table.is_phase_schedule:
        return "a phase-level table is a schedule of requests, applied as it stands"
    if table.granularity in ("iteration", "power-cap"):
        return f"an {table.granularity}-level table holds one setting for the whole iteration"
    if table.data.get("note"):
        return f"the source's {table.granularity} level holds a coarser schedule, with no units' fronts ({table.data['note']})"
    return "its entries carry no measured fronts (an older freqopt wrote it; search the source again to re-allocate)"


def _with_front(measured: UnitSearch, entry: dict) -> UnitSearch:
    """A target unit's measured options, and the source unit's front scaled to it: each option of ``entry``'s
    front not measured on the target, its time and energy the same multiple of the target's measured default as
    they were of the source's (the ratios carry across layouts, the absolute figures do not)."""
    source, default = entry["default"], measured.default
    t, e = default.time_s / source["time_s"], default.energy_j / source["energy_j"]
    have = {o.setting for o in measured.options}
    scaled = [Option(ClockSetting.of_entry(o), o["time_s"] * t, o["energy_j"] * e, o["n_samples"]) for o in entry["front"]
              if ClockSetting.of_entry(o) not in have]  # fmt: skip
    others = sorted([o for o in measured.options if o.setting != default.setting] + scaled, key=lambda o: o.time_s)
    return dataclasses.replace(measured, options=(default, *others))


def reallocate(schedule: TransferredSchedule, table: ClockTable, backend: Backend, config: SearchConfig,
               validator: Validator, baseline: Measurement, *, coarser: Sequence[GranularityResult] = (),
               storage=None, on_unit=None) -> GranularityResult:  # fmt: skip
    """Re-allocate the budget on the target from the fronts ``table`` carries (module docstring).

    Each target unit is measured alone at its default (1 + ``config.finalist_repeats`` samples) and at the
    ``coarser`` schedules' settings; a unit matched to a table entry is offered, beside these, that entry's front
    scaled to its default (_with_front); an unmatched unit gets a study of its own (``config``'s trials, as a
    native search runs it). Where the target realizes one clock per iteration only (one_clock_reason: its phases
    make a single block of at least one clock switch) and ``coarser`` holds its iteration level, nothing is
    measured: the result is that level's clock, with a note. At kernel level with ``config.share_classes`` the
    units are the target's families of kernel classes (kernel_families), as a native search's are; a family takes
    its first matched class's front, and a study only when none of its classes matched. The allocator's budget is
    then calibrated by validating the whole target iteration
    (allocate_validated; switching costs included when the validator switches), starting from each ``coarser``
    schedule that saved energy, so the result is never worse than any of them, as at a native search's finer
    levels; the schedule is then expressed as a runtime applies it.

    Args:
        schedule: ``table`` laid onto the target (transfer_table).
        table: a table with fronts (has_fronts).
        backend, config: the target GPU; the budget, trial counts and seed.
        validator, baseline: measures the target's whole iterations; its default-settings measurement.
        coarser: the target's validated results at the coarser levels the table's granularity chooses among
            (native_granularities; none for an iteration-level or power-cap table), coarse to fine. Their
            measurements are counted in the result's.
        storage: Optuna storage of the target-side studies (named "PREFIX-transfer-GRANULARITY-...").
        on_unit: called as on_unit("transfer", units_done, units_total) after each unit is measured.

    Returns:
        GranularityResult of the re-allocated schedule; its unit_searches hold each unit's measured and scaled
        options, and its counts every target-side measurement (coarser levels included).

    Raises:
        ClockTableError: ``table`` carries no fronts (its level was not searched, or an older freqopt wrote it).
    """
    if not has_fronts(table):
        raise ClockTableError("this clock table carries no measured fronts (its level was not searched, as on a step "
                              "shorter than two clock switches, or an older freqopt wrote it), so the budget cannot "
                              "be re-allocated on the target; search a longer source step with this freqopt")  # fmt: skip
    trace, granularity = schedule.trace, schedule.granularity
    iteration = next((r for r in coarser if r.granularity == "iteration"), None)
    reason = one_clock_reason(trace, backend, config, validator.kernel_time_s) if validator.switching else ""
    if reason and iteration is not None and granularity in ("pass", "kernel", "phase"):
        # As a native search does (issue 25): the target realizes one clock only, its iteration level's.
        result = _one_clock(trace, iteration, granularity, validator.kernel_time_s, backend.spec.clock_switch_s,
                            config.max_phase_blocks, reason)  # fmt: skip
        return dataclasses.replace(result, n_measurements=sum(r.n_measurements for r in coarser),
                                   search_cost_gpu_s=sum(r.search_cost_gpu_s for r in coarser))  # fmt: skip
    classes = [m.unit for m in schedule.matches]
    # As a native search does (config.share_classes): one unit per family of kernel classes, measured as one and
    # offered its first matched class's front (a family's classes carry one front in a search's table).
    families = [[i] for i in range(len(classes))]
    if granularity == "kernel" and config.share_classes and len(classes) > 1:
        families = kernel_families(trace, classes)
    units = family_units(trace, classes, families) if len(families) < len(classes) else classes
    matches = [next((schedule.matches[i] for i in f if schedule.matches[i].how != UNMATCHED), schedule.matches[f[0]])
               for f in families]  # fmt: skip
    kernel_time_s = validator.kernel_time_s if any(r.granularity == "phase" for r in coarser) else None
    candidates = candidate_schedules(trace, coarser, units, baseline, kernel_time_s)
    inherited = _warm_starts(trace, list(coarser), units, candidates, kernel_time_s)
    space = "power" if granularity == "power-cap" else "clocks"
    # Matched units: their default and the coarser setting (no trials); unmatched ones: a study, as natively.
    work = UnitWork(prefix=study_prefix(trace, backend.spec, config.seed), granularity=f"transfer-{granularity}",
                    space=space, n_trials=0, finalist_repeats=config.finalist_repeats,
                    finalist_slowdown=_slack(config.max_slowdown, len(units)), seed=config.seed, spread=False,
                    constrained=len(units) == 1, whole_step=len(units) == 1)  # fmt: skip
    study_work = dataclasses.replace(work, n_trials=_n_trials(config, backend, space), spread=True)
    entries = {e["unit"]: e for e in table.entries}
    before = (validator.n_measurements, validator.cost_gpu_s)
    searches = []
    for done, (unit, match, warm) in enumerate(zip(units, matches, inherited), 1):
        warm_start = [w for w in dict.fromkeys(warm) if w not in (None, DEFAULT_SETTING)]
        if match.how == UNMATCHED:
            searches.append(run_unit(trace, backend, study_work, unit, storage, warm_start))
        else:
            measured = run_unit(trace, backend, work, unit, storage, warm_start)
            searches.append(_with_front(measured, entries[match.source_unit]))
        if on_unit is not None:
            on_unit("transfer", done, len(units))
    result, settings, validated = allocate_applied(
        trace, units, searches, validator, baseline, config.max_slowdown, rounds=config.max_validation_rounds,
        key="transfer", candidates=candidates)  # fmt: skip
    predicted, predicted_baseline = _prediction(trace, units, searches, settings, result.chosen, coarser)
    spent = (sum(r.n_measurements for r in coarser), sum(r.search_cost_gpu_s for r in coarser))
    result = GranularityResult(
        granularity=granularity, units=tuple(zip(classes, settings_on(trace, units, settings, classes))),
        searched_units=tuple(units) if units is not classes else (), predicted=predicted,
        predicted_baseline=predicted_baseline, validated=validated,
        n_measurements=spent[0] + sum(s.n_measurements for s in searches) + validator.n_measurements - before[0],
        search_cost_gpu_s=spent[1] + sum(s.cost_gpu_s for s in searches) + validator.cost_gpu_s - before[1],
        unit_searches=tuple(searches),
    )  # fmt: skip
    result = _at_least_the_coarser_schedules(trace, result, list(coarser))  # exact where families span passes
    phase = [r for r in coarser if r.granularity == "phase"]  # never worse than the target's phase schedule either
    return _at_least_the_phase_schedule(result, phase[0]) if phase else result


@dataclass(frozen=True)
class TransferReport:
    """A transferred table on the target: as transferred, re-allocated from its fronts, and beside a native search.

    Attributes:
        schedule: the table's settings laid onto the target (transfer_table).
        baseline: the target iteration at default settings (shared by all three).
        transferred: the target iteration measured with the settings as transferred.
        reallocated: the budget re-allocated on the target from the table's fronts (reallocate); None when the
            table carries no fronts.
        native: a native search of the target (its result at the table's granularity is the comparison); None when
            not asked for.
        max_slowdown: the budget, a fraction.
        source: the table transferred; spec, backend_name, seed, storage: the target's GPU type, backend, seed and
            Optuna storage URL.
        table_path: where freqopt.apply.transfer.transfer wrote the target's table, absolute (None: not written).
    """

    schedule: TransferredSchedule
    baseline: Measurement
    transferred: Measurement
    reallocated: GranularityResult | None
    native: SearchResult | None
    max_slowdown: float
    source: ClockTable
    spec: GPUSpec
    backend_name: str
    seed: int = 0
    storage: str | None = None
    table_path: Path | None = None

    def _figures(self, m: Measurement) -> dict:
        """energy_saved_pct, slowdown_pct and slowdown_bound_pct (the upper confidence bound of the slowdown, None
        where none was computed) of ``m`` against the baseline, and whether it is within the budget (the bound,
        where there is one: Measurement.time_bound_s)."""
        bound = None if m.time_upper_s is None else 100.0 * (m.time_upper_s / self.baseline.time_s - 1.0)
        return {"energy_saved_pct": 100.0 * (1.0 - m.energy_j / self.baseline.energy_j),
                "slowdown_pct": 100.0 * (m.time_s / self.baseline.time_s - 1.0), "slowdown_bound_pct": bound,
                "within_budget": m.time_bound_s <= self.baseline.time_s * (1.0 + self.max_slowdown) * (1 + 1e-11)}  # fmt: skip

    def summary(self) -> dict:
        """{"max_slowdown_pct", "transferred": {energy_saved_pct, slowdown_pct, slowdown_bound_pct, within_budget,
        matched_exact, matched_by_kind, unmatched}, "reallocated": {energy_saved_pct, slowdown_pct,
        slowdown_bound_pct, within_budget, predicted_energy_saved_pct, n_measurements, search_cost_gpu_s} or None,
        "not_reallocated": why not (no_fronts_reason) or None, "native": {energy_saved_pct, slowdown_pct,
        slowdown_bound_pct, n_measurements, search_cost_gpu_s} or None, "table": the written table's absolute path
        or None}; percentages against the default settings (slowdown_bound_pct: the upper confidence bound of the
        slowdown at freqopt.budget.DEFAULT_CONFIDENCE, held to the budget, None where none was computed),
        match counts in target tuning units (kernel classes at kernel level), costs in measurements and GPU-seconds
        (the native search's for its granularities up to the table's, validations included)."""
        doc = {
            "max_slowdown_pct": 100.0 * self.max_slowdown,
            "transferred": {**self._figures(self.transferred), "matched_exact": self.schedule.count(EXACT),
                            "matched_by_kind": self.schedule.count(BY_KIND), "unmatched": self.schedule.count(UNMATCHED)},
            "reallocated": None,
            "not_reallocated": no_fronts_reason(self.source) or None,
            "native": None,
            "table": None if self.table_path is None else str(self.table_path),
        }  # fmt: skip
        if self.reallocated is not None:
            r = self.reallocated
            doc["reallocated"] = {
                **self._figures(r.validated),
                "predicted_energy_saved_pct": 100.0 * (1.0 - r.predicted.energy_j / r.predicted_baseline.energy_j),
                "n_measurements": r.n_measurements, "search_cost_gpu_s": r.search_cost_gpu_s,
            }  # fmt: skip
        if self.native is not None:
            g, n = self.schedule.granularity, self.native
            searched = list(n.results.values())  # the levels it searched (native_granularities)
            doc["native"] = {"energy_saved_pct": n.energy_saved_pct(g), "slowdown_pct": n.slowdown_pct(g),
                             "slowdown_bound_pct": n.slowdown_bound_pct(g),
                             "n_measurements": sum(x.n_measurements for x in searched),
                             "search_cost_gpu_s": sum(x.search_cost_gpu_s for x in searched)}  # fmt: skip
        return doc

    def _result(self, result: GranularityResult) -> SearchResult:
        return SearchResult(self.schedule.trace, self.spec.name, self.max_slowdown, self.baseline,
                            {self.schedule.granularity: result}, self.storage, spec=self.spec,
                            backend_name=self.backend_name, seed=self.seed)  # fmt: skip

    def write_table(self, out) -> Path:
        """Write the target's table (table()) into folder ``out`` as STEM-GRANULARITY-transferred.json and .csv
        (target_table_path), atomically; returns the JSON file's absolute path.

        Raises:
            ClockTableError: a table without fronts that breaks the budget as transferred (table()).
            OutputError: ``out`` cannot be written, or holds another transfer's or search's table under that name
                (freqopt.tables.check_table_target).
        """
        from freqopt.tables import check_table_target, table_identity, write_table, write_table_csv

        table = self.table()
        path = target_table_path(out, self.schedule.trace, self.spec.name, table.data["max_slowdown"], self.seed,
                                 self.schedule.granularity)  # fmt: skip
        check_table_target(path, table_identity(table.data))
        write_table_csv(table, path.with_suffix(".csv"))
        return write_table(table, path)

    def table(self) -> ClockTable:
        """The target's clock table (freqopt.tables), for the target workload, its provenance naming the source
        table ("transferred_from"), so that ``train``, a runtime, or another transfer can use it: the re-allocated
        schedule, its entries carrying the fronts scaled to the target; for a phase-level table, the source's
        entries as they stand (each requested at its phase, which the target has), with the budget they were found
        for and their figures as validated on the target; for any other table without fronts (no_fronts_reason:
        one clock for the iteration, or a finer level its source realized as one clock), the settings as
        transferred, one entry per target unit, with the transfer's budget and their figures as validated on the
        target (predicted is that measurement too), the reason under provenance.transferred_from.not_reallocated.

        Raises:
            ClockTableError: a table without fronts whose settings as transferred break the budget on the target
                (nothing to re-allocate them from: search the target).
        """
        import copy
        from datetime import datetime, timezone

        from freqopt import __version__
        from freqopt.tables import table_from_result, workload_doc

        source = self.source.data
        transferred_from = {"workload": source["workload"], "granularity": source["granularity"],
                            "max_slowdown": source["max_slowdown"],
                            "created_utc": source["provenance"].get("created_utc")}  # fmt: skip
        if self.schedule.granularity == "phase":
            base = self.baseline
            validated = {**self._figures(self.transferred), "time_s": self.transferred.time_s,
                         "energy_j": self.transferred.energy_j}  # fmt: skip
            validated.pop("within_budget")
            data = {**copy.deepcopy(source), "workload": workload_doc(self.schedule.trace.workload),
                    "baseline": {"time_s": base.time_s, "energy_j": base.energy_j},
                    "predicted": {"time_s": self.transferred.time_s, "energy_j": self.transferred.energy_j,
                                  "energy_saved_pct": validated["energy_saved_pct"]},
                    "validated": validated, "ideal": None,
                    "provenance": {"freqopt_version": __version__,
                                   "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "backend": self.backend_name, "seed": self.seed, "storage": self.storage,
                                   "transferred_from": transferred_from}}  # fmt: skip
            return ClockTable(data)
        result = self.reallocated
        if result is None:  # the table as it stands, laid onto the target and validated there
            figures = self._figures(self.transferred)
            if not figures["within_budget"]:
                raise ClockTableError(
                    f"as transferred, the table takes {figures['slowdown_pct']:+.2f} % time on the target, past the "
                    f"{100 * self.max_slowdown:g} % budget, and cannot be re-allocated ({no_fronts_reason(self.source)}); "
                    "search the target instead")  # fmt: skip
            result = GranularityResult(
                granularity=self.schedule.granularity, units=tuple((m.unit, m.setting) for m in self.schedule.matches),
                predicted=self.transferred, predicted_baseline=self.baseline, validated=self.transferred,
                n_measurements=0, search_cost_gpu_s=0.0, note=f"as transferred: {no_fronts_reason(self.source)}")  # fmt: skip
        table = table_from_result(self._result(result), self.schedule.granularity, self.spec,
                                  backend=self.backend_name, seed=self.seed)  # fmt: skip
        table.data["provenance"]["transferred_from"] = transferred_from
        if self.reallocated is None:
            transferred_from["not_reallocated"] = no_fronts_reason(self.source)
        return table


def target_table_path(out, trace: Trace, gpu: str, max_slowdown: float, seed: int, granularity: str) -> Path:
    """Where a transfer writes the target's table: ``out``/STEM-GRANULARITY-transferred.json, STEM the target's
    (freqopt.tables.table_stem: model, GPU, layout, budget, seed), absolute."""
    from freqopt.tables import table_stem

    stem = table_stem(trace.workload, gpu, max_slowdown, seed)
    return (Path(out) / f"{stem}-{granularity}-transferred.json").resolve()


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
    (reallocate; skipped for a table without fronts). All against one shared baseline measurement.

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
    levels = native_granularities(schedule.granularity, config.switching)
    # The whole native search, whose coarser levels are the re-allocation's too; without it the coarser levels
    # only (cheap: one and three units), which a table without fronts does not need.
    searching = levels if native else levels[:-1] if has_fronts(table) else ()
    searched = run_search(trace, backend, dataclasses.replace(config, granularities=searching), on_unit=on_unit,
                          validator=validator) if searching else None  # fmt: skip
    coarse = searched.results if searched else {}
    reallocated = None
    if has_fronts(table):
        reallocated = reallocate(schedule, table, backend, config, validator, baseline,
                                 coarser=[coarse[g] for g in levels[:-1] if g in coarse], storage=storage,
                                 on_unit=on_unit)  # fmt: skip
    return TransferReport(schedule, baseline, transferred, reallocated, searched if native else None,
                          config.max_slowdown, table, backend.spec, backend.name, config.seed,
                          config.storage)  # fmt: skip


def _check_target(out: Path, table: ClockTable, trace: Trace, spec: GPUSpec, slowdown: float, seed: int,
                  backend_name: str) -> None:
    """Refuse, before any measurement, a transfer whose table would replace another search's or transfer's
    (freqopt.tables.check_table_target)."""
    from freqopt.tables import check_table_target, table_identity, workload_doc

    source = table.data
    # A phase-level table keeps the budget it was found for; a re-allocated one is found for the transfer's.
    budget = source["max_slowdown"] if table.is_phase_schedule else slowdown
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
             switch_latency_ms: float | None = None, on_start=None, on_unit=None,
             verbose: bool = False) -> TransferReport:  # fmt: skip
    """Apply clock table ``table`` to ``model`` (another model, size or layout): validate it as transferred,
    re-allocate the budget on the target from the fronts it carries, and search the target natively under the same
    budget (evaluate_transfer). With ``out``, the target's table (the re-allocated one; a phase-level table as it
    stands; another table without fronts as transferred, where that meets the budget on the target) is written
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
        InvalidSettingError: a bad slowdown, override, layout, n_trials or switch_latency_ms.
        OutputError: ``out`` is a file or cannot be written, or holds another search's table under the name the
            target's table takes (refused before any measurement).
        StorageError: ``storage`` cannot be opened.
    """
    from freqopt.api import open_output
    from freqopt.errors import check_positive_int
    from freqopt.gpu.backends import get_backend
    from freqopt.budget import parse_slowdown
    from freqopt.gpu.specs import check_switch_latency_ms, get_gpu
    from freqopt.resolve import resolve_backend, resolve_gpu, resolve_workload
    from freqopt.search.study import optuna_logging
    from freqopt.tables import load_table
    from freqopt.workload.trace import trace_training_iteration

    # Every check before any work, in the order the command line always had.
    workload = resolve_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    requested = resolve_gpu(gpu)  # an unknown name fails as such before the table is read
    switch_s = check_switch_latency_ms(switch_latency_ms)
    source = "clock table" if isinstance(table, ClockTable) else str(table)
    if not isinstance(table, ClockTable):
        table = load_table(table)
    table.refuse_pipeline("freqopt transfer", source=source)  # a plan per stage, not settings per tuning unit
    spec = requested or get_gpu(table.gpu)
    table.check_gpu(spec, source=source)
    slowdown = parse_slowdown(max_slowdown) if max_slowdown is not None else table.data["max_slowdown"]
    check_positive_int("n_trials", n_trials, optional=True)
    backend = resolve_backend(backend)
    measuring = get_backend(backend, spec, seed=seed) if isinstance(backend, str) else backend
    try:
        with switch_latency(measuring, switch_s):  # a Backend the caller gave keeps its own GPU type
            trace = trace_training_iteration(workload)
            if table.is_phase_schedule:  # a table of another model's phases fails here, before any file is written
                transfer_table(table, trace)
            out, storage = open_output(out, storage)  # a bad URL fails here, before any work or folder is made
            if out is not None:  # a table may be written: over no other search's
                _check_target(out, table, trace, spec, slowdown, seed, measuring.name)
            counts = {"n_trials_1d": n_trials, "n_trials_2d": n_trials} if n_trials else {}
            config = SearchConfig(max_slowdown=slowdown, seed=seed, storage=storage, **counts)
            if on_start is not None:
                on_start(table, trace, spec)
            with optuna_logging(verbose):
                report = evaluate_transfer(table, trace, measuring, config, on_unit=on_unit, native=native)
            written = (report.reallocated is not None or table.is_phase_schedule
                       or report._figures(report.transferred)["within_budget"])  # fmt: skip
            if out is not None and written:
                report = dataclasses.replace(report, table_path=report.write_table(out))
            return report
    finally:
        if isinstance(backend, str):
            measuring.close()  # a real GPU goes back to what it was found with
