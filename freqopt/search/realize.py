"""Realization: what a phase-switching runtime applies for a per-kernel schedule, once switching has a cost.

A runtime can switch clocks only at phase boundaries (freqopt.workload.phases: module hooks and the optimizer step), and a
switch takes ``GPUSpec.clock_switch_s`` to land (the NVML call plus the transition: 6-26 ms on Hopper, over 100 ms on consumer parts; Velicka et
al. 2025, Spaan et al. 2026). ``realizable_settings`` turns a per-kernel schedule into what such a runtime applies:
each phase takes the setting its kernels spend most time in, and a switch is made only into a run of consecutive
phases wanting the same setting that lasts at least the switch cost (shorter runs keep the clocks already set).
Since a switch lands one latency after it is asked for, the runtime asks for each run's setting ahead of it
(``requested_settings``): at the last phase boundary at least one switch latency of kernel time before the run,
as the phase-schedule granularity plans its requests (freqopt.search.phase_requests.lookahead_requests). A
backend then measures those requests (the simulated GPU applies each switch one switch latency late), so a search
validates what DVFSRuntime issues.

The kernel times that weigh these choices come from the backend the search or the runtime is given
(``Backend.kernel_times_s`` at the default setting): the simulated GPU's physics on the simulated backend, each
distinct kernel replayed and timed on the device on the NVML backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting
from freqopt.workload.kernels import Trace
from freqopt.workload.phases import phase_spans
from freqopt.search.phase_requests import lookahead_requests, requests_per_kernel

__all__ = ["realizable_settings", "requested_settings", "Realizer", "phase_leaders"]


def realizable_settings(
    marks: Sequence[tuple[str, int]], settings: Sequence[ClockSetting], kernel_time_s: np.ndarray,
    switch_s: float,
) -> list[ClockSetting]:  # fmt: skip
    """The per-kernel settings a phase-switching runtime realizes for the per-kernel ``settings``.

    Args:
        marks: the trace's phase marks (Trace.meta["marks"]).
        settings: the wanted setting of every kernel, shape (K,).
        kernel_time_s: every kernel's time (at the default setting; Backend.kernel_times_s), shape (K,), s.
        switch_s: the GPU type's clock-switch latency, s.

    Returns:
        One setting per kernel, constant within each phase; a uniform schedule stays uniform.
    """
    spans = phase_spans(marks, len(settings))

    wanted = []  # per phase: the setting its kernels spend most time in, and the phase's duration
    for _, first, end in spans:
        weights: dict[ClockSetting, float] = {}
        for i in range(first, end):
            weights[settings[i]] = weights.get(settings[i], 0.0) + float(kernel_time_s[i])
        wanted.append((max(weights, key=weights.get), float(np.sum(kernel_time_s[first:end]))))
    runs: list[list] = []  # consecutive phases wanting the same setting: [setting, duration, phases]
    for setting, duration in wanted:
        if runs and runs[-1][0] == setting:
            runs[-1][1] += duration
            runs[-1][2] += 1
        else:
            runs.append([setting, duration, 1])

    if len(runs) == 1:  # one setting throughout: set once before the loop, never switched
        return [runs[0][0]] * len(settings)
    if runs[0][0] == runs[-1][0]:  # iterations run back to back: the last run continues into the first
        runs[0][1] = runs[-1][1] = runs[0][1] + runs[-1][1]

    def one_pass(current: ClockSetting) -> list[ClockSetting]:
        out: list[ClockSetting] = []
        phase = 0
        for setting, duration, n_phases in runs:
            if setting != current and duration >= switch_s:  # a switch pays only for a run as long as the switch
                current = setting
            for _, first, end in spans[phase : phase + n_phases]:
                out.extend([current] * (end - first))
            phase += n_phases
        return out

    # Iterations run back to back: the first phase starts with the clocks the previous iteration ended with.
    first = one_pass(DEFAULT_SETTING)
    return one_pass(first[-1]) if first else first


def phase_leaders(marks: Sequence[tuple[str, int]], units: Sequence, kernel_time_s: np.ndarray) -> set[int]:
    """The units (indices into ``units``, TuningUnits) whose kernels take the most time in at least one phase.

    realizable_settings gives each phase the setting its kernels spend most time in, so a unit that leads no
    phase never has its own setting applied: it only adds its time to the setting it shares with others. Its study
    cannot move what a phase-switching runtime realizes except through such a coincidence (on gpt3-xl,
    4 of 11 kernel families, flash attention's backward among them, lead no phase).

    Args:
        marks: the trace's phase marks (Trace.meta["marks"]).
        units: the units; each kernel in at most one.
        kernel_time_s: every kernel's time at the default setting, shape (K,), s.
    """
    owner = np.full(len(kernel_time_s), -1)
    for j, unit in enumerate(units):
        owner[list(unit.kernel_indices)] = j
    leaders = set()
    for _, first, end in phase_spans(marks, len(kernel_time_s)):
        mine = owner[first:end]
        times = np.bincount(mine[mine >= 0], weights=kernel_time_s[first:end][mine >= 0], minlength=len(units))
        if times.any():
            leaders.add(int(np.argmax(times)))
    return leaders


def requested_settings(marks: Sequence[tuple[str, int]], realized: Sequence[ClockSetting], kernel_time_s: np.ndarray,
                       switch_s: float) -> list[ClockSetting]:  # fmt: skip
    """The per-kernel settings a runtime requests so that the ``realized`` schedule's switches land where its runs
    begin: each run's setting is asked for at the last phase boundary at least ``switch_s`` of kernel time before
    the run (freqopt.search.phase_requests.lookahead_requests, as the phase-schedule granularity does), and held up
    to the next request, cyclically over back-to-back iterations.

    Args:
        marks: the trace's phase marks (Trace.meta["marks"]).
        realized: one setting per kernel, constant within each phase (realizable_settings), shape (K,).
        kernel_time_s: every kernel's time at the default setting, shape (K,), s.
        switch_s: the GPU type's clock-switch latency, s.

    Returns:
        One setting per kernel, constant within each phase, shape (K,); a uniform schedule is returned unchanged.
    """
    spans = phase_spans(marks, len(realized))
    landing = [realized[first] for _, first, _ in spans]  # (P,)
    changes = [p for p in range(len(spans)) if landing[p] != landing[p - 1]]  # a run starts (cyclically)
    if not changes:
        return list(realized)
    duration = np.array([float(np.sum(kernel_time_s[first:end])) for _, first, end in spans])  # (P,)
    start = np.cumsum(duration) - duration  # (P,)
    requests = lookahead_requests(start, float(duration.sum()), changes, switch_s)
    return list(requests_per_kernel(spans, [(r, landing[p]) for r, p in zip(requests, changes)]))


class Realizer:
    """Maps a per-kernel schedule of one trace to what a phase-switching runtime realizes on ``backend``'s GPU
    (realizable_settings), with the kernels' times at the default setting from ``backend.kernel_times_s``.

    Args:
        trace: the iteration; its phase marks are Trace.meta["marks"].
        backend: the GPU; its type gives the clock-switch latency (GPUSpec.clock_switch_s), and it is asked for
            the kernel times the first time a schedule with more than one setting is realized (a uniform
            schedule needs none: it is set once and never switched).

    Calling it with a schedule (one ClockSetting per kernel, a tuple of length K) returns the realized schedule,
    the settings in force per phase, a tuple of length K; ``requests(schedule)`` returns what the runtime asks for
    at each phase's start to get them (requested_settings). Results are cached per schedule.
    """

    def __init__(self, trace: Trace, backend: Backend):
        self.trace, self.backend = trace, backend
        self.marks = trace.meta.get("marks", ())
        self.switch_s = backend.spec.clock_switch_s
        self._kernel_time_s: np.ndarray | None = None
        self._cache: dict[tuple, tuple] = {}
        self._requests: dict[tuple, tuple] = {}

    @property
    def kernel_time_s(self) -> np.ndarray:
        """Every kernel's time at the default setting, in a loop, shape (K,), s (Backend.kernel_times_s)."""
        if self._kernel_time_s is None:
            self._kernel_time_s = self.backend.kernel_times_s(self.trace.kernels, DEFAULT_SETTING)
        return self._kernel_time_s

    def __call__(self, schedule: tuple) -> tuple:
        if schedule not in self._cache:
            if len(set(schedule)) <= 1:  # uniform: realizable_settings returns it unchanged, whatever the times
                self._cache[schedule] = tuple(schedule)
            else:
                self._cache[schedule] = tuple(
                    realizable_settings(self.marks, schedule, self.kernel_time_s, self.switch_s))
        return self._cache[schedule]

    def requests(self, schedule: tuple) -> tuple:
        """The settings a runtime requests, per kernel (shape (K,)), for the per-kernel ``schedule``: its realization
        with each switch asked for one latency ahead (requested_settings)."""
        if schedule not in self._requests:
            realized = self(schedule)
            self._requests[schedule] = realized if len(set(realized)) <= 1 else tuple(
                requested_settings(self.marks, realized, self.kernel_time_s, self.switch_s))
        return self._requests[schedule]
