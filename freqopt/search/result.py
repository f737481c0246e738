"""A search's outcome: the measured baseline and one validated result per granularity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freqopt.gpu.backends.base import ClockSetting, Measurement
from freqopt.workload.kernels import Trace
from freqopt.search.study import UnitSearch
from freqopt.search.units import TuningUnit

if TYPE_CHECKING:  # freqopt.search.schedule's own imports stay free of this module
    from freqopt.search.schedule import BlockModel

__all__ = ["GranularityResult", "SearchResult", "HOST_BOUND_PCT", "setting_text"]

# A step whose GPU waits for the host for at least this share (%) of the time is host-bound enough that the output
# says how much of its saving is the waiting GPU's (SearchResult.waiting_statement): a quarter, where the waiting
# GPU's power is already of the order of the savings a compute-bound step sees.
HOST_BOUND_PCT = 25.0


@dataclass(frozen=True)
class GranularityResult:
    """The validated outcome of one granularity.

    Attributes:
        granularity: one of GRANULARITIES.
        units: per unit, its name, kernel indices and chosen setting.
        predicted: what the search predicted for the schedule in ``units`` before validating it: the sum of the
            units' measured options (time_s and energy_j per iteration), or the coarser granularity's prediction
            when its schedule is kept (predict_schedule).
        predicted_baseline: the same sum at the defaults.
        validated: the whole iteration measured with the schedule, as a runtime realizes it (switching costs
            included when SearchConfig.switching).
        ideal: the free-switching figure: the whole iteration measured with free, instant switching (None if not
            measured), of the level's own free-switching allocation where it has one (``ideal_units``: per searched
            unit, its setting; the pass and kernel levels), else of its schedule as it stands.
        ideal_units: see ``ideal``; () where the figure is the schedule's own.
        n_measurements, search_cost_gpu_s: measurements and GPU-seconds the search spent, validation included.
        unit_searches: each unit's study outcome.
        study_names: the Optuna studies behind the result.
        searched_units: the units the studies ran on, where they differ from ``units`` (kernel level with
            families of classes sharing a study: one per family, in ``unit_searches`` order); () otherwise.
        note: why the level holds the iteration level's one clock, where a runtime can realize no finer schedule
            ("held to one clock: ...": its measurements are then its free-switching figure's only, none for the
            phase level); or that its schedule runs as a coarser
            level's once realized, whose prediction it then carries; "" otherwise.
        requests: a phase schedule only (the phase level's, or a finer level's that ended on it): per unit, the
            label of the phase at whose start the runtime requests its setting (freqopt.search.schedule); () for
            schedules of per-unit settings.
        waiting_saved_pct: the share (%) of the schedule's noiseless saving that is saved while the GPU waits for
            the host (Validator.waiting_saved_pct; simulated GPU only, else None).
        saving_pct_waiting_range: the schedule's noiseless energy saving (%) at the two ends of the waiting GPU's
            power range (freqopt.gpu.specs.WaitingPower): (waiting power flat in the clock, as modelled)
            (Validator.waiting_range_saved_pct; simulated GPU only, else None).
        switches_per_s: clock switches per second the schedule asks the GPU for, as a runtime realizes it
            (Validator.switches_per_s; None where validated without switching), to hold against
            GPUSpec.max_switches_per_s.
        block_model: the phase level only: its prediction of any schedule of one setting per block
            (freqopt.search.schedule.BlockModel), by which a finer level realized as such a schedule is predicted.
    """

    granularity: str
    units: tuple[tuple[TuningUnit, ClockSetting], ...]
    predicted: Measurement
    predicted_baseline: Measurement
    validated: Measurement
    n_measurements: int
    search_cost_gpu_s: float
    unit_searches: tuple[UnitSearch, ...] = field(repr=False, default=())
    ideal: Measurement | None = None
    ideal_units: tuple[tuple[TuningUnit, ClockSetting], ...] = field(repr=False, default=())
    requests: tuple[str, ...] = ()
    searched_units: tuple[TuningUnit, ...] = field(repr=False, default=())
    note: str = ""
    waiting_saved_pct: float | None = None
    saving_pct_waiting_range: tuple[float, float] | None = None
    switches_per_s: float | None = None
    block_model: BlockModel | None = field(repr=False, default=None)

    @property
    def held_to_one_clock(self) -> bool:
        """The level holds the iteration level's one clock because a runtime can realize no finer schedule (its
        note says why: runner.one_clock_reason)."""
        return self.note.startswith("held to one clock")

    @property
    def n_settings(self) -> int:
        """Distinct settings in the schedule."""
        return len({s for _, s in self.units})

    def __repr__(self) -> str:
        """One line: the granularity, its units and settings, the validated iteration, the predicted saving and
        the search's cost (not the units' kernel indices and studies, which run to tens of kilobytes)."""
        v, p, base = self.validated, self.predicted, self.predicted_baseline
        predicted = 100 * (1 - p.energy_j / base.energy_j) if base.energy_j else float("nan")
        return (f"GranularityResult(granularity={self.granularity!r}, {len(self.units)} units, {self.n_settings} "
                f"settings, validated {v.time_s:.6g} s {v.energy_j:.6g} J, predicted {0.0 - predicted:+.2f} % energy, "
                f"{self.n_measurements} measurements, {self.search_cost_gpu_s / 3600:.3g} GPU-h)")  # fmt: skip

    @property
    def study_names(self) -> list[str]:
        return [u.study_name for u in self.unit_searches]

    def clock_summary(self) -> str:
        """The chosen clocks in a few words, for a table's cell: the one setting where the schedule has one
        (``setting_text``: "1410/1593 MHz" for SM/memory, "SM 1410 MHz", "300 W"); else the SM clocks' range, the
        settings and units it spans and the setting most of the step runs at: "SM 1155-1980 MHz, 4 settings over
        12 phases; 62 % of time at SM 1980 MHz". The share is of the units' time at the GPU's defaults where each
        unit's study measured one (UnitSearch.default), else of the kernels ("62 % of kernels at ...").
        """
        settings = [s for _, s in self.units]
        if not settings:
            return "-"
        distinct = list(dict.fromkeys(settings))
        if len(distinct) == 1:
            return setting_text(distinct[0])
        defaults = {u.name: u.default.time_s for u in self.unit_searches}
        timed = all(unit.name in defaults for unit, _ in self.units)
        weight: dict[ClockSetting, float] = {}
        for unit, setting in self.units:
            w = defaults[unit.name] if timed else len(unit.kernel_indices)
            weight[setting] = weight.get(setting, 0.0) + w
        top = max(weight, key=weight.get)
        share = 100 * weight[top] / sum(weight.values())
        sm = sorted({s.sm_clock_mhz for s in distinct if s.sm_clock_mhz is not None})
        span = ""
        if sm:
            span = f"SM {sm[0]}-{sm[-1]} MHz, " if len(sm) > 1 else f"SM {sm[0]} MHz, "
        units = {"pass": "passes", "kernel": "kernel classes", "phase": "phases"}.get(self.granularity, "units")
        return (f"{span}{len(distinct)} settings over {len(self.units)} {units}; {share:.0f} % of "
                f"{'time' if timed else 'kernels'} at {setting_text(top)}")  # fmt: skip


def setting_text(setting: ClockSetting) -> str:
    """A setting in few words: SM and memory clock as "1410/1593 MHz" (SM/memory), one of them as "SM 1410 MHz"
    or "mem 1593 MHz", a power limit as "300 W" ("1410/1593 MHz, 300 W");
    "default" for the GPU's defaults (boost clocks, the highest memory clock, the default power limit)."""
    sm, mem = setting.sm_clock_mhz, setting.mem_clock_mhz
    parts = []
    if sm is not None and mem is not None:
        parts.append(f"{sm}/{mem} MHz")
    elif sm is not None:
        parts.append(f"SM {sm} MHz")
    elif mem is not None:
        parts.append(f"mem {mem} MHz")
    if setting.power_limit_w is not None:
        parts.append(f"{setting.power_limit_w:,.0f} W")
    return ", ".join(parts) or "default"


@dataclass(frozen=True)
class SearchResult:
    """A search's outcome: the measured baseline and one validated result per granularity.

    Attributes:
        trace: the searched iteration.
        gpu: the GPU type's name; spec: the GPU type itself (clock lists as the backend reported them).
        max_slowdown: the budget, a fraction.
        baseline: the whole iteration at default settings (time_s, energy_j per iteration).
        results: granularity -> GranularityResult, coarse to fine.
        storage: the Optuna storage URL (None: in memory).
        n_new_measurements: measurements this process took (the rest were read back, or taken by other workers).
        n_stored_measurements: distinct measurements read back from what the storage held when their study was
            opened: a resumed search's earlier runs' and, in a shared storage, other workers'; 0 for a fresh search
            that no worker joined.
        resumed: whether the storage held this search when it began (an earlier run, stopped or finished), so that
            what was read back is that run's work (with False, other workers').
        backend_name: "sim", "nvml", ... (None: not known); seed: the samplers' seed.
        table_paths: granularity -> clock-table JSON file written by ``freqopt.search(..., out=...)``.
        figure_paths: "energy-time" and "clocks" -> the PNGs written beside them (freqopt.search.plots).
        host_wait_pct: the share (%) of the default step the GPU waits for the host (Validator.host_wait_pct;
            simulated GPU only, else None).
        confidence: the one-sided confidence level at which each level's slowdown was held to the budget
            (SearchConfig.confidence); None where not known.
    """

    trace: Trace
    gpu: str
    max_slowdown: float
    baseline: Measurement
    results: dict[str, GranularityResult]
    storage: str | None
    n_new_measurements: int = 0
    n_stored_measurements: int = 0
    spec: object = field(default=None, repr=False)  # GPUSpec
    backend_name: str | None = None
    seed: int = 0
    table_paths: dict = field(default_factory=dict)
    figure_paths: dict = field(default_factory=dict)
    host_wait_pct: float | None = None
    confidence: float | None = None
    resumed: bool = False

    def __repr__(self) -> str:
        """One line: workload, GPU, budget, baseline and each granularity's validated saving (not the trace and
        the units, which run to hundreds of kilobytes; ``result.results[g]`` and ``result.trace`` hold them)."""
        w = self.trace.workload
        rows = "; ".join(f"{g}: {0.0 - self.energy_saved_pct(g):+.2f} % energy at {self.slowdown_pct(g):+.2f} % time"
                         for g in self.results)  # fmt: skip
        return (f"SearchResult(model={w.model!r}, gpu={self.gpu!r}, {w.layout}, max_slowdown="
                f"{100 * self.max_slowdown:g}%, baseline {self.baseline.time_s:.6g} s {self.baseline.energy_j:.6g} J, "
                f"validated {rows or 'no granularity'}, {self.n_new_measurements} new measurements, "
                f"storage={self.storage!r})")  # fmt: skip

    def switching_statement(self) -> str:
        """One line on the clock switches per second each level's schedule asks for, beside the most one runtime
        thread can issue (GPUSpec.max_switches_per_s), where any level switches at all (else "")."""
        rates = {g: r.switches_per_s for g, r in self.results.items() if r.switches_per_s}
        if not rates:
            return ""
        from freqopt.gpu.specs import OVER_SWITCH_LIMIT

        limit = getattr(self.spec, "max_switches_per_s", None)
        over = limit and self.spec.over_switch_limit  # (no limit: no spec to ask)
        parts = [f"{g} {rate:.1f}" + (f" ({OVER_SWITCH_LIMIT})" if over and over(rate) else "")
                 for g, rate in rates.items()]  # fmt: skip
        line = "clock switches per second: " + ", ".join(parts)
        return line + (f"; {self.spec.switch_limit_text}" if limit else "")

    def waiting_statement(self) -> str:
        """One line on how much of the saving comes from the GPU waiting for the host, where it waits for at least
        HOST_BOUND_PCT of the default step (else ""): there a lower clock saves the waiting GPU's power at no cost
        in time, which is why such steps save far more than compute-bound ones."""
        if self.host_wait_pct is None or self.host_wait_pct < HOST_BOUND_PCT:
            return ""
        shares = {g: r.waiting_saved_pct for g, r in self.results.items() if r.waiting_saved_pct is not None}
        line = f"the GPU waits for the host {self.host_wait_pct:.0f} % of the default step"
        if shares:
            g = max(shares, key=self.energy_saved_pct)
            line += (f": {shares[g]:.0f} % of the {g} level's saving is saved while it waits, at a lower clock (the "
                     "waiting GPU's power, measured at no locked low clock)")  # fmt: skip
            ends = self.results[g].saving_pct_waiting_range
            if ends is not None:
                line += (f"; without noise it saves {ends[1]:.2f} % with the waiting power falling with the clock as "
                         f"modelled and {ends[0]:.2f} % if it does not fall at all (the range's two ends: "
                         "freqopt.gpu.specs.WaitingPower)")  # fmt: skip
        return line

    def summary(self) -> dict:
        """The JSON document ``freqopt search --json`` writes (freqopt.search.summary.summarize)."""
        from freqopt.search.summary import summarize

        return summarize(self, self.table_paths)

    def table(self, granularity: str):
        """The clock table (freqopt.tables.ClockTable) of one searched granularity.

        Raises:
            UnknownNameError: ``granularity`` was not searched.
        """
        from freqopt.tables import result_table

        return result_table(self, granularity)

    def write_tables(self, out) -> dict:
        """Write each granularity's clock table as JSON and CSV into folder ``out``; returns granularity -> JSON
        path (freqopt.tables.write_result_tables)."""
        from freqopt.tables import write_result_tables

        return write_result_tables(self, out)

    def clock_summary(self, g: str) -> str:
        """Level ``g``'s chosen clocks in a few words (GranularityResult.clock_summary): "1410/1593 MHz" for one
        setting, else the range, settings and the setting most of the step runs at.

        Raises:
            KeyError: ``g`` was not searched.
        """
        return self.results[g].clock_summary()

    def energy_saved_pct(self, g: str) -> float:
        return 100.0 * (1.0 - self.results[g].validated.energy_j / self.baseline.energy_j)

    def slowdown_pct(self, g: str) -> float:
        return 100.0 * (self.results[g].validated.time_s / self.baseline.time_s - 1.0)

    def slowdown_bound_pct(self, g: str) -> float | None:
        """The upper confidence bound (%, at ``confidence``) of level ``g``'s slowdown, from its readings paired
        with the defaults' (Measurement.time_upper_s): the figure held to the budget. None where
        no bound was computed (the defaults, a schedule not held to the budget)."""
        upper = self.results[g].validated.time_upper_s
        return None if upper is None else 100.0 * (upper / self.baseline.time_s - 1.0)

    def ideal_energy_saved_pct(self, g: str) -> float | None:
        ideal = self.results[g].ideal
        return None if ideal is None else 100.0 * (1.0 - ideal.energy_j / self.baseline.energy_j)

    def ideal_slowdown_pct(self, g: str) -> float | None:
        ideal = self.results[g].ideal
        return None if ideal is None else 100.0 * (ideal.time_s / self.baseline.time_s - 1.0)

    def predicted_energy_saved_pct(self, g: str) -> float:
        r = self.results[g]
        return 100.0 * (1.0 - r.predicted.energy_j / r.predicted_baseline.energy_j)
