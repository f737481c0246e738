"""A clock table's settings laid onto a target trace (freqopt.apply.transfer's module docstring, steps 1-3): each
target tuning unit matched to the table's entry of the same class, else of the same kind and nearest arithmetic
intensity, else left at the default; a phase-level table laid on as its schedule of requests stands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.workload.kernels import Trace
from freqopt.search.units import TuningUnit, partition
from freqopt.tables import ClockTable

__all__ = ["EXACT", "BY_KIND", "UNMATCHED", "Match", "TransferredSchedule", "transfer_table"]


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
