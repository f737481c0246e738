"""What a transfer found on the target (TransferReport: as transferred, re-allocated, beside a native search) and
the target's clock table it writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freqopt.budget import DEFAULT_CONFIDENCE
from freqopt.gpu.backends.base import Measurement
from freqopt.errors import ClockTableError
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Trace
from freqopt.apply.reallocate import no_fronts_reason
from freqopt.apply.transfer_match import BY_KIND, EXACT, UNMATCHED, TransferredSchedule
from freqopt.search.result import GranularityResult, SearchResult
from freqopt.tables import ClockTable

__all__ = ["TransferReport", "target_table_path"]


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
        confidence: the one-sided confidence at which each slowdown was held to the budget (slowdown_bound_pct).
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
    confidence: float = DEFAULT_CONFIDENCE

    def _figures(self, m: Measurement) -> dict:
        """energy_saved_pct, slowdown_pct and slowdown_bound_pct (the upper confidence bound of the slowdown, None
        where none was computed) of ``m`` against the baseline, and whether it is within the budget (the bound,
        where there is one: Measurement.time_bound_s)."""
        bound = None if m.time_upper_s is None else 100.0 * (m.time_upper_s / self.baseline.time_s - 1.0)
        return {"energy_saved_pct": 100.0 * (1.0 - m.energy_j / self.baseline.energy_j),
                "slowdown_pct": 100.0 * (m.time_s / self.baseline.time_s - 1.0), "slowdown_bound_pct": bound,
                "within_budget": m.time_bound_s <= self.baseline.time_s * (1.0 + self.max_slowdown) * (1 + 1e-11)}  # fmt: skip

    def _holds(self, m: Measurement) -> bool:
        """Whether ``m`` saves energy within the budget on the target (a table worth writing)."""
        return self._figures(m)["within_budget"] and m.energy_j < self.baseline.energy_j

    def _kept_reallocation(self) -> GranularityResult | None:
        """The re-allocated schedule where it saves energy within the budget on the target, else None."""
        r = self.reallocated
        return r if r is not None and self._holds(r.validated) else None

    def not_reallocated_reason(self) -> str:
        """Why the target's table is not a re-allocated one ("" where it is): the table could not be re-allocated
        (no_fronts_reason), or its re-allocation saved nothing within the budget."""
        if self.reallocated is None:
            return no_fronts_reason(self.source)
        if self._kept_reallocation() is None:
            return f"re-allocated on the target, it saved nothing within the {100 * self.max_slowdown:g} % budget"
        return ""

    def writes_table(self) -> bool:
        """Whether the transfer has a table to write for the target: the re-allocated schedule where it saves
        energy within the budget, else the table as transferred where that does; never one out of budget."""
        return self._kept_reallocation() is not None or self._holds(self.transferred)

    def summary(self) -> dict:
        """{"max_slowdown_pct", "transferred": {energy_saved_pct, slowdown_pct, slowdown_bound_pct, within_budget,
        matched_exact, matched_by_kind, unmatched}, "reallocated": {energy_saved_pct, slowdown_pct,
        slowdown_bound_pct, within_budget, predicted_energy_saved_pct, n_measurements, search_cost_gpu_s} or None,
        "not_reallocated": why not (no_fronts_reason) or None, "native": {energy_saved_pct, slowdown_pct,
        slowdown_bound_pct, n_measurements, search_cost_gpu_s} or None, "table": the written table's absolute path
        or None}; percentages against the default settings (slowdown_bound_pct: the upper confidence bound of the
        slowdown at ``confidence``, held to the budget, None where none was computed),
        match counts in target tuning units (kernel classes at kernel level), costs in measurements and GPU-seconds
        (the native search's for its granularities up to the table's, validations included)."""
        doc = {
            "max_slowdown_pct": 100.0 * self.max_slowdown,
            "confidence": self.confidence,
            "transferred": {**self._figures(self.transferred), "matched_exact": self.schedule.count(EXACT),
                            "matched_by_kind": self.schedule.count(BY_KIND), "unmatched": self.schedule.count(UNMATCHED)},
            "reallocated": None,
            "not_reallocated": self.not_reallocated_reason() or None,
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
            n = self.native
            g = self.source.granularity if self.source.granularity in n.results else self.schedule.granularity
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
        kept = self._kept_reallocation()
        if self.schedule.granularity == "phase" and kept is None:
            figures = self._figures(self.transferred)
            if not figures["within_budget"]:
                raise ClockTableError(
                    f"as transferred, the phase schedule takes {figures['slowdown_pct']:+.2f} % time on the target, "
                    f"past the {100 * self.max_slowdown:g} % budget; search the target instead")  # fmt: skip
            base = self.baseline
            validated = {**figures, "time_s": self.transferred.time_s,
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
        result = kept
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
        if kept is None:
            transferred_from["not_reallocated"] = self.not_reallocated_reason()
        return table


def target_table_path(out, trace: Trace, gpu: str, max_slowdown: float, seed: int, granularity: str) -> Path:
    """Where a transfer writes the target's table: ``out``/STEM-GRANULARITY-transferred.json, STEM the target's
    (freqopt.tables.table_stem: model, GPU, layout, budget, seed), absolute."""
    from freqopt.tables import table_stem

    stem = table_stem(trace.workload, gpu, max_slowdown, seed)
    return (Path(out) / f"{stem}-{granularity}-transferred.json").resolve()
