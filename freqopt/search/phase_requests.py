"""Phase requests: where a phase-switching runtime asks for each setting so that it lands about where its run of
phases begins (lookahead_requests: one switch latency ahead), and which setting is then in force in each phase and
each kernel (settings_per_phase, requests_per_kernel), a phase-level clock table's included (request_phases,
requested_per_phase). The phase-schedule granularity (freqopt.search.schedule) plans its blocks' requests so, and
a runtime realizing a finer schedule per phase (freqopt.search.realize) asks for its settings so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from freqopt.gpu.backends.base import ClockSetting
from freqopt.errors import ClockTableError

T = TypeVar("T")

__all__ = ["lookahead_requests", "requests_per_kernel", "settings_per_phase", "request_phases",
           "requested_per_phase"]


def lookahead_requests(start_s: np.ndarray, total_s: float, firsts: Sequence[int], switch_s: float) -> list[int]:
    """Where a runtime asks for each of a sequence of settings so that each lands about where its run of phases
    begins (module docstring, "Look-ahead requests"): for the run starting at phase ``firsts[j]``, the last phase
    starting at least ``switch_s`` before it, counted over back-to-back iterations (in the previous iteration for
    the first runs); then strictly increasing and never after the run's own first phase. A single run is asked
    for at its own start (it is set once and never switched).

    Args:
        start_s: each phase's start within the iteration, shape (P,), s (kernel time, Backend.kernel_times_s).
        total_s: the iteration's duration, s.
        firsts: the first phase of each run, ascending, at least one.
        switch_s: the clock-switch latency, s (GPUSpec.clock_switch_s).

    Returns:
        The request phase of each run, in run order, indices into ``start_s``.
    """
    n_phases = len(start_s)
    unrolled = []
    for first in firsts:
        when = start_s[first] - switch_s if len(firsts) > 1 else start_s[first]
        wrap = 0
        while when < 0 and total_s > 0:
            when += total_s
            wrap -= n_phases
        unrolled.append(int(np.searchsorted(start_s, max(when, 0.0), side="right")) - 1 + wrap)
    for j in range(1, len(unrolled)):
        unrolled[j] = min(max(unrolled[j], unrolled[j - 1] + 1), firsts[j])
    return [u % n_phases for u in unrolled]


def requests_per_kernel(spans: Sequence[tuple[str, int, int]], requests: Sequence[tuple[int, ClockSetting]]) -> tuple:
    """The per-kernel schedule of (phase index, setting) ``requests``, each asked for at its phase's start and held
    up to the next (settings_per_phase, cyclically); ``spans`` the trace's phases (freqopt.workload.phases.phase_spans).

    Returns:
        One ClockSetting per kernel, shape (K,), constant within each phase.
    """
    out: list[ClockSetting] = []
    for (_, first, end), setting in zip(spans, settings_per_phase(len(spans), requests)):
        out.extend([setting] * (end - first))
    return tuple(out)


def settings_per_phase(n_phases: int, requests: Sequence[tuple[int, T]]) -> tuple[T, ...]:
    """The setting in force in each phase when each (phase index, setting) of ``requests`` is asked for at that
    phase's start: the latest request at or before the phase, cyclically (the phases before the first request run
    with the last one's setting, left by the previous iteration). Requests at the same phase take effect in the
    order given. Any value may stand for the setting (freqopt.apply.transfer passes the requesting entry's index).

    Returns:
        One setting per phase, shape (n_phases,).
    """
    ordered = sorted(requests, key=lambda r: r[0])
    current = ordered[-1][1]
    out, i = [], 0
    for phase in range(n_phases):
        while i < len(ordered) and ordered[i][0] <= phase:
            current = ordered[i][1]
            i += 1
        out.append(current)
    return tuple(out)


def request_phases(table, labels: Sequence[str]) -> list[int]:
    """Where a phase-level clock table asks for each entry's setting on a trace: the index, in ``labels``, of each
    entry's ``request_phase``, in entry order. Every layout and micro-batch of one model has the same phases.

    Args:
        table: a phase-level freqopt.tables.ClockTable (its entries carry ``request_phase``).
        labels: the trace's phase labels in order (freqopt.workload.phases.phase_spans).

    Raises:
        ClockTableError: an entry's request phase is not a phase of this trace (a table of another model).
    """
    index = {label: i for i, label in enumerate(labels)}
    for entry in table.entries:
        if entry["request_phase"] not in index:
            raise ClockTableError(f"the phase-level table requests a setting at phase {entry['request_phase']!r}, "
                                  "which this model does not have; search this model with granularity 'phase'")  # fmt: skip
    return [index[entry["request_phase"]] for entry in table.entries]


def requested_per_phase(table, labels: Sequence[str]) -> tuple[ClockSetting, ...]:
    """A phase-level clock table's settings per phase of a trace, as it stands (it is realizable already): each
    entry's setting from its request phase (request_phases) up to the next entry's, cyclically over the iteration
    (settings_per_phase). This is what DVFSRuntime applies, on the trace the table was searched on or on any
    other layout or micro-batch of the same model.

    Returns:
        One ClockSetting per phase, shape (len(labels),).

    Raises:
        ClockTableError: an entry's request phase is not a phase of this trace (a table of another model).
    """
    phases = request_phases(table, labels)
    return settings_per_phase(len(labels), [(p, ClockSetting.of_entry(e)) for p, e in zip(phases, table.entries)])
