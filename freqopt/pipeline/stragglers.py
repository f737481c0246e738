"""Stragglers: data-parallel pipelines wait for the slowest, so the others can run slower for free.

In data-parallel training every pipeline's iteration ends at the gradient all-reduce, so all of them wait for the
slowest one (a straggler: a throttled or degraded GPU, a slow node). Perseus (Chung et al., "Perseus: Reducing
Energy Bloat in Large Model Training", SOSP 2024) calls the energy the others burn meanwhile extrinsic energy bloat
and removes it by putting every other pipeline on the plan of its time-energy frontier whose iteration time matches
the straggler's: the same throughput, less energy. Here:

- ``straggler_plan``: that plan, from a pipeline's planner (its measured fronts: freqopt.pipeline.planner) and
  the straggler's iteration time, the once-per-iteration tail (the optimizer step) taken off the deadline;
- ``clock_ceiling`` and ``straggler_ceiling``: a straggler to simulate, one GPU held under a clock ceiling (as a
  thermal or power-brake slowdown holds it) until the pipeline's iteration is the slowdown asked for;
- ``run_data_parallel``: dp simulated pipelines of the same stages, each with its own clock requests, the iteration
  ending when the slowest ends and every faster pipeline's GPUs drawing their blocked power until then (the
  all-reduce's own time is not modelled: it is the same with and without a matched plan).

A pipeline learns the straggler's time from an all-reduce of the pipelines' iteration times every N steps, or from
a scheduler that knows it: freqopt.apply.torch_pipeline_runtime.StragglerFollower, over plans from
``matched_requests`` (torch.distributed.pipelining) or freqopt.apply.pipeline_runtime.straggler_schedules
(DeepSpeed); a user who knows a straggler's slowdown plans for it with ``straggler_plan`` (docs/pipelines.md, "Stragglers").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from freqopt.errors import FreqoptError, InvalidSettingError

__all__ = ["straggler_plan", "matched_requests", "clock_ceiling", "straggler_ceiling", "DataParallelRun", "run_data_parallel"]


def straggler_plan(planner, straggler_time_s: float, *, tail_s: float = 0.0):
    """The least-energy plan of ``planner`` (a PipelinePlanner) whose iteration fits the straggler's: its predicted
    critical path at most ``straggler_time_s - tail_s`` (s; ``tail_s`` the once-per-iteration work after the last
    instruction, the optimizer step). The fastest plan where the straggler is no slower than that.

    Raises:
        InvalidSettingError: ``straggler_time_s`` or ``tail_s`` not a finite number >= 0.
    """
    for name, value in (("straggler_time_s", straggler_time_s), ("tail_s", tail_s)):
        if not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
            raise InvalidSettingError(f"{name} must be a finite number of seconds >= 0, not {value!r}", argument=name)
    fastest = planner.fastest()
    deadline_s = straggler_time_s - tail_s
    if deadline_s <= fastest.time_s:
        return fastest
    return planner.plan(deadline_s=deadline_s)


def matched_requests(planner, profile, straggler_time_s: float, measure_s, *, switch_s: float, tail_s: float = 0.0,
                     rounds: int = 8, plan_with=None):  # fmt: skip
    """The clock requests (per instruction, MHz: freqopt.pipeline.realize.realize_plan) of the least-energy
    plan whose iteration, as the switches realize it, still ends within ``straggler_time_s``: the planner's
    prediction assumes clocks land at once, so its deadline is bisected (``rounds`` times, between the fastest
    plan's time and the straggler's less ``tail_s``) on ``measure_s(requests)``, the iteration time (s) a run with
    those requests takes (a simulated pipeline's true_run, or a real pipeline's measurement). ``plan_with``
    plans at a deadline (``deadline_s=``; default planner.plan; planner.plan_stage_clocks for one clock per GPU);
    a deadline it finds no plan for (FreqoptError) counts as one that does not fit. Returns (plan, requests); the
    fastest plan's where nothing slower fits."""
    from freqopt.pipeline.realize import realize_plan

    fastest = planner.fastest()
    best = (fastest, realize_plan(profile, fastest, switch_s, tail_s=tail_s))
    fits, breaks = fastest.time_s, straggler_time_s - tail_s  # deadlines known to fit, and the one to try first
    if breaks <= fits:
        return best
    plan_with = planner.plan if plan_with is None else plan_with
    deadline = breaks
    for _ in range(rounds):
        try:
            plan = plan_with(deadline_s=deadline)
        except FreqoptError:
            plan = None
        requests = None if plan is None else realize_plan(profile, plan, switch_s, tail_s=tail_s)
        if requests is not None and measure_s(requests) <= straggler_time_s:
            fits = deadline
            if plan.energy_j < best[0].energy_j:
                best = (plan, requests)
            if deadline == straggler_time_s - tail_s:
                break  # the whole slack fits
        else:
            breaks = deadline
        deadline = 0.5 * (fits + breaks)
    return best


def clock_ceiling(pipeline, requests: Sequence[int | None] | None, gpu: int, ceiling_mhz: int) -> list[int]:
    """``requests`` (per instruction, SM clock in MHz or None for the default; None: every instruction at the
    default) with GPU ``gpu``'s held at or below ``ceiling_mhz``: what a thermal or power-brake ceiling does to a
    GPU whatever its runtime asks for."""
    top = pipeline.spec.max_sm_clock_mhz
    requests = [None] * pipeline.dag.n if requests is None else list(requests)
    return [min(top if r is None else int(r), ceiling_mhz) if pipeline.dag.gpu_of(inst) == gpu
            else (top if r is None else int(r)) for inst, r in zip(pipeline.dag.instructions, requests)]  # fmt: skip


def straggler_ceiling(pipeline, slowdown: float, *, gpu: int = 0, switching: bool = True) -> tuple[int, float]:
    """The supported SM clock that, as a ceiling on GPU ``gpu`` (clock_ceiling), slows the default iteration (noiseless)
    the closest to ``1 + slowdown`` times, and the slowdown it gives (a fraction).

    Raises:
        InvalidSettingError: ``slowdown`` not a number above 0.
    """
    if not isinstance(slowdown, (int, float)) or not slowdown > 0:
        raise InvalidSettingError(f"slowdown must be a fraction above 0 (0.2 for 1.2x), not {slowdown!r}",
                                  argument="slowdown")  # fmt: skip
    base = pipeline.true_run(None, switching=switching).time_s
    best = None
    for clock in sorted(pipeline.spec.sm_clocks_mhz, reverse=True):
        got = pipeline.true_run(clock_ceiling(pipeline, None, gpu, clock), switching=switching).time_s / base - 1.0
        if best is None or abs(got - slowdown) < abs(best[1] - slowdown):
            best = (clock, got)
        if got >= slowdown:
            break
    return best


@dataclass(frozen=True)
class DataParallelRun:
    """dp pipelines' iteration (run_data_parallel), noiseless.

    Attributes:
        time_s: the iteration (s): the slowest pipeline's.
        energy_j: all pipelines' energy (J), each faster one's GPUs drawing their blocked power until it ends.
        pipeline_time_s, pipeline_energy_j: per pipeline, its own iteration (s) and its energy including the wait
            (J), shape (dp,).
    """

    time_s: float
    energy_j: float
    pipeline_time_s: tuple[float, ...]
    pipeline_energy_j: tuple[float, ...]


def run_data_parallel(pipeline, requests: Sequence[Sequence[int | None] | None], *,
                      switching: bool = True) -> DataParallelRun:  # fmt: skip
    """dp pipelines of ``pipeline``'s stages (a SimulatedPipeline), pipeline i asking for ``requests[i]`` (per
    instruction, SM clock in MHz or None; None: the defaults), noiseless (SimulatedPipeline.true_run): the
    iteration ends when the slowest pipeline ends (the gradient all-reduce waits for all), and each faster
    pipeline's GPUs wait until then at the blocked power of their last instruction's clock."""
    runs = [pipeline.true_run(r, switching=switching) for r in requests]
    total = max(run.time_s for run in runs)
    energies = []
    for r, run in zip(requests, runs):
        settings = pipeline.settings_of(r)
        last = {}
        for inst, setting in zip(pipeline.dag.instructions, settings):
            last[pipeline.dag.gpu_of(inst)] = setting
        wait_w = sum(pipeline.blocked_power_w(last[g]) for g in range(pipeline.gpus))
        energies.append(run.energy_j + wait_w * (total - run.time_s))
    return DataParallelRun(float(total), float(sum(energies)), tuple(float(run.time_s) for run in runs),
                           tuple(float(e) for e in energies))  # fmt: skip
