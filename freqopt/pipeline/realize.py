"""Switches: the clocks a runtime asks for so that a pipeline plan lands despite the switch latency.

A runtime (``realize_requests``) asks for a clock at an instruction's start and it lands
``spec.clock_switch_s`` later (170 ms on the A100 as freqopt reads it, the cautious end of 6-170 ms; longer than
the instructions). A plan asked for as it stands would run most instructions at a neighbour's clock. So the plan is
realized before it is measured: at the start of each instruction i the runtime asks for the clock that will be in
force from its landing, start_i + switch_s, until the next request lands, and that clock is the highest the plan
gives any instruction that runs, by the plan's own predicted timeline, during that window (the stage's last clock
for its optimizer step; its lowest where the window holds only waiting). No instruction then runs slower than
planned, so the plan's time holds; a switch costs energy only (a faster clock held over part of a slower
neighbour). With a latency below the gaps between instruction starts this is the plan itself; a latency longer
than the iteration lands at the same point of a later one (iterations repeat), which the realization relies on. The
planner counts blocked time at the constant blocked power of the default clock, the pipeline at the clock in force
(lower where a stage is slowed): one more difference between prediction and validation,
which validation settles (freqopt.pipeline.search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.pipeline.dag import PipelineDAG
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.profile import StageProfile

__all__ = ["realize_requests", "realize_plan", "RealizedPlan", "price_realized"]


def realize_requests(dag: PipelineDAG, clocks_mhz: Sequence[int], times_s: Sequence[float], switch_s: float, *,
                     tail_s: float = 0.0) -> list[int]:  # fmt: skip
    """The clocks a runtime asks for at each instruction's start so that a plan lands despite the switch latency
    (module docstring): no instruction runs slower than planned, as predicted.

    Args:
        dag: the pipeline's instruction DAG.
        clocks_mhz: the plan, one SM clock (MHz) per instruction (dag.instructions order), shape (N,).
        times_s: each instruction's predicted time at its planned clock (s), shape (N,): the planned timeline is
            every instruction at its earliest start (PipelineDAG.start_times_s).
        switch_s: the switch latency (s): a request lands this long after the instruction that asks for it starts.
        tail_s: the once-per-iteration work after the last instruction (the optimizer step, s), which each stage
            runs at the clock of its last instruction; iterations repeat with period critical path + tail_s.

    Returns:
        Per instruction (dag.instructions order), the SM clock (MHz) to ask for at its start (ask only where it
        differs from the stage's previous request): the highest planned clock among the instructions running while
        that request is in force, [start + switch_s, next start + switch_s), read cyclically over iterations; the
        stage's lowest planned clock where only waiting falls in that window. With switch_s = 0, the plan itself.
    """
    clocks = np.asarray(clocks_mhz, dtype=int)
    times = np.asarray(times_s, dtype=float)
    starts = dag.start_times_s(times)
    ends = starts + times
    period = float(np.max(ends)) + tail_s
    lead = switch_s % period if period > 0 else 0.0
    eps = 1e-12 * max(period, 1.0)
    requests = np.empty(dag.n, dtype=int)
    for g in range(dag.gpus):
        idx = np.asarray([j for j, inst in enumerate(dag.instructions) if dag.gpu_of(inst) == g])  # the GPU's order
        st, en, c = starts[idx], ends[idx], clocks[idx]
        # The intervals whose clock is required: the instructions, and the optimizer step at the last one's clock.
        iv_s = np.r_[st, float(np.max(ends))] if tail_s > 0 else st
        iv_e = np.r_[en, period] if tail_s > 0 else en
        iv_c = np.r_[c, c[-1]] if tail_s > 0 else c
        nxt = np.r_[st[1:], st[0] + period]
        for q in range(len(idx)):
            lo, hi = st[q] + lead, nxt[q] + lead  # while this request is in force
            need = None
            for k in (-1, 0, 1, 2):  # copies of the iteration before and after
                hit = (iv_s + k * period < hi - eps) & (iv_e + k * period > lo + eps)
                if hit.any():
                    top = int(iv_c[hit].max())
                    need = top if need is None else max(need, top)
            requests[idx[q]] = int(c.min()) if need is None else need
    return [int(r) for r in requests]


def _planned_times(profile: StageProfile, dag: PipelineDAG, clocks: Sequence[int]) -> np.ndarray:
    """Each instruction's time (s) at its planned clock, from the profile, shape (N,)."""
    out = np.empty(dag.n)
    for i, (inst, clock) in enumerate(zip(dag.instructions, clocks)):
        opts = profile.options[(inst.stage, inst.kind)]
        out[i] = opts.time_s[int(np.flatnonzero(opts.sm_clock_mhz == clock)[0])]
    return out


def realize_plan(profile: StageProfile, plan: PipelinePlan, switch_s: float, *, tail_s: float = 0.0) -> list[int]:
    """The requests (realize_requests) that make ``plan`` land despite a switch latency of ``switch_s`` (s), its
    timeline predicted from ``profile`` (each instruction's time at its planned clock): per instruction
    (plan.dag.instructions order), the SM clock (MHz) to ask for at its start. Used by the search on the plans it
    validates and by freqopt.apply.pipeline_runtime on a plan made again for another micro-batch count."""
    times = _planned_times(profile, plan.dag, plan.sm_clock_mhz)
    return realize_requests(plan.dag, plan.sm_clock_mhz, times, switch_s, tail_s=tail_s)


@dataclass(frozen=True)
class RealizedPlan:
    """A plan as a runtime realizes it on a measured stage profile (``price_realized``): one iteration in steady
    state.

    Attributes:
        requests_mhz: the clock asked for at each instruction's start (dag.instructions order, MHz): realize_plan's.
        time_s: the iteration's time (s), its critical path with the clocks in force (no optimizer step).
        energy_j: its energy (J), Perseus's accounting: the instructions' energies plus the blocking power for every
            GPU-second outside an instruction.
        switches: set calls per iteration, all GPUs (a request that differs from its GPU's previous one).
        dropped: of those, requests dropped unserved (a newer one came while they waited for the NVML thread).
        max_switches_per_s: set calls per second of the busiest GPU.
        switch_s, call_s: the switch latency and the NVML call time (s) it was realized with.
    """

    requests_mhz: tuple[int, ...]
    time_s: float
    energy_j: float
    switches: int
    dropped: int
    max_switches_per_s: float
    switch_s: float
    call_s: float


def price_realized(profile: StageProfile, plan: PipelinePlan, switch_s: float, *, call_s: float = 0.0,
                   blocking_power_w: float, iterations: int | None = None) -> RealizedPlan:  # fmt: skip
    """``plan`` as a runtime realizes it (realize_plan's requests, each asked at its instruction's start, served one
    at a time by one NVML thread, landing ``switch_s`` after its call starts: freqopt.gpu.backends.physics.
    SetCallQueue), priced on the measured profile: what ``freqopt plan`` reports beside the plan it predicts.

    Each instruction runs at the clocks in force while it runs: at clock c it progresses at 1 / time(c) and draws
    energy(c) / time(c), the profile's figures interpolated linearly in the clock between measured ones (Perseus's
    stage profiles are measured at every clock a plan can ask for, so the interpolation is only between a
    profile's own points). Iterations repeat back to back, every GPU starting the next once all have finished one
    (the gradient synchronization; no optimizer step in a stage profile), each GPU starting in the clock its last
    request of an iteration leaves; the last of ``iterations`` (default: enough that a switch longer than the
    iteration has landed twice, at least 3) is priced. With ``switch_s`` and ``call_s`` 0 this is the plan itself
    (``PipelinePlanner.evaluate`` of its clocks without a time quantum).

    Raises:
        InvalidSettingError: switch_s or call_s not a finite number >= 0, iterations not a positive integer.
    """
    from freqopt.errors import check_positive_int
    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.pipeline.profile import check_number
    from freqopt.pipeline.timeline import ClockTimeline

    check_number("switch_s", switch_s, minimum=0.0)
    check_number("call_s", call_s, minimum=0.0)
    check_positive_int("iterations", iterations, optional=True)
    dag = plan.dag
    planned = _planned_times(profile, dag, plan.sm_clock_mhz)
    requests = realize_requests(dag, plan.sm_clock_mhz, planned, switch_s)
    curves = {}  # (stage, kind) -> its (clocks, times, energies) by ascending clock
    for key, opts in profile.options.items():
        order = np.argsort(opts.sm_clock_mhz)
        curves[key] = (opts.sm_clock_mhz[order].astype(float), opts.time_s[order], opts.energy_j[order])
    planned_period = dag.iteration_time_s(planned)
    if iterations is None:
        iterations = max(3, 2 + math.ceil(2 * switch_s / planned_period)) if planned_period > 0 else 3
    gpu_of = [dag.gpu_of(inst) for inst in dag.instructions]
    # Each GPU's clock over time, as the simulated pipeline keeps it (freqopt.pipeline.sim): the clock its last
    # request of an iteration leaves in force, then each request served by one NVML thread and landing switch_s after
    # its call starts; times from each iteration's start (shifted after each).
    last = {g: requests[j] for j, g in enumerate(gpu_of)}
    lines = [ClockTimeline(ClockSetting(last[g]), call_s) for g in range(dag.gpus)]
    preds = dag.predecessors
    for k in range(iterations):
        start, end, energy = np.zeros(dag.n), np.zeros(dag.n), np.zeros(dag.n)
        switches = np.zeros(dag.gpus, dtype=int)
        for j in dag.order:
            g, p = gpu_of[j], preds[j]
            start[j] = float(np.max(end[p])) if len(p) else 0.0
            setting = ClockSetting(requests[j])
            switches[g] += setting != lines[g].requested  # the runtime asks only for a change
            lines[g].request(start[j], setting, switch_s)
            end[j], energy[j] = _run(curves[(dag.instructions[j].stage, dag.instructions[j].kind)], lines[g], start[j])
        time_s = float(np.max(end))
        if k == iterations - 1:
            total = float(np.sum(energy) + blocking_power_w * (dag.gpus * time_s - np.sum(end - start)))
            return RealizedPlan(tuple(int(r) for r in requests), time_s, total, int(switches.sum()),
                                sum(line.n_dropped for line in lines),
                                float(switches.max() / time_s) if time_s > 0 else 0.0, float(switch_s), float(call_s))
        for line in lines:
            line.shifted(time_s)
    raise AssertionError("unreachable")


def _run(curve, line, start_s: float) -> tuple[float, float]:
    """(end time, energy) of one instruction started at ``start_s`` on a GPU whose SM clock over time is ``line``
    (a ClockTimeline: the setting in force from each landing on); ``curve`` its (clocks, times, energies) by
    ascending clock."""
    grid, times, energies = curve

    def at(clock: float) -> tuple[float, float]:  # (progress per second, watts) at this clock
        t = float(np.interp(clock, grid, times))
        return 1.0 / t, float(np.interp(clock, grid, energies)) / t

    i = line.index_at(start_s)
    now, left, joules = start_s, 1.0, 0.0
    while True:
        rate, watts = at(line.settings[i].sm_clock_mhz)
        nxt = line.times[i + 1] if i + 1 < len(line.times) else math.inf
        if now + left / rate <= nxt:
            joules += watts * left / rate
            return now + left / rate, joules
        joules += watts * (nxt - now)
        left -= rate * (nxt - now)
        now, i = nxt, i + 1
