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

from collections.abc import Sequence

import numpy as np

from freqopt.pipeline.dag import PipelineDAG
from freqopt.pipeline.plan import PipelinePlan
from freqopt.pipeline.profile import StageProfile

__all__ = ["realize_requests", "realize_plan"]


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
