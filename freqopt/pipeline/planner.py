"""One SM clock per pipeline instruction: a measured stage profile in, the plan and the frontier out.

A stage profile (freqopt.pipeline.profile.load_stage_profile) holds, for every pipeline stage and instruction kind
(forward, backward), the time (s) and energy (J) of one instruction at each locked SM clock (MHz), as Perseus (Chung
et al., SOSP'24) and Zeus write them: CSV columns ``stage, instruction, frequency, time, energy``.

The planner (``PipelinePlanner``, ``plan_pipeline``) chooses one clock per instruction of a 1F1B iteration
(freqopt.pipeline.dag) to minimize the iteration's energy subject to its time (the DAG's critical path) being at
most a deadline. The energy is Perseus's accounting (freqopt.pipeline.dag): the instructions' own energies plus a
constant P2P-blocking power for every GPU-second spent outside an instruction. Written with each option's
*effective* energy e' = energy - blocking_power_w * time, the iteration's energy is sum_i e'_i + S * p * T, so:

Dominated clocks. An option is dropped when another option of the same instruction is no slower and has no higher
effective energy (it can never make the iteration slower nor dearer). With blocking power p > 0 this keeps slow
clocks that the plain (time, energy) Pareto filter drops: running slower instead of waiting at p may cost less.
The kept options of an instruction, fastest first, have falling effective energies: slower is cheaper.

Every plan starts from the hull LP and heuristics (steps 1 and 2 below); the MILP (step 3) only polishes it. All
solves go through HiGHS's own Python interface (freqopt.pipeline.solver): the LP is kept between deadlines
and hot-started from its last basis, every MILP stops at a node limit (``node_limit``, default DEFAULT_NODE_LIMIT)
with a proven bound, so a plan is the same on any machine under any load (a wall-clock limit, ``time_limit_s``,
runs only where the caller sets one, and a plan it cut short says so: ``PipelinePlan.milp_stopped_by``), and Ctrl-C
stops any solve within a fraction of a second.

The model. Variables: one binary x[i, k] per instruction i and kept option k (sum_k x[i, k] = 1), a start time
s_i >= 0 per instruction, the iteration time T <= deadline. Constraints: s_j >= s_i + sum_k t[i, k] x[i, k] for
every DAG edge i -> j, and T >= s_i + sum_k t[i, k] x[i, k] for every instruction without successor. Objective:
sum_{i,k} e'[i, k] x[i, k] + S p T. Every assignment of clocks with critical path <= deadline is feasible for it
(start every instruction at its earliest start), and every feasible point is such an assignment, so the MILP's
optimum is the problem's optimum; T is pushed down to the critical path by its positive cost (p > 0) and is set to
it afterwards otherwise.

1. The hull LP: the MILP with x relaxed to [0, 1]. It is the multiple-choice relaxation whose optimum prices each
   instruction at the lower convex hull of its options. Its optimum is a proven lower bound on the energy of every
   plan within the deadline (lower_bound_j).
2. Plans from it, each made to meet the deadline and then improved by a reclaim pass into each instruction's float:
   rounded down, by error diffusion (``plan`` only), a warm start, a neighbour's plan in a frontier; the best is
   kept (freqopt.pipeline.heuristics).
3. ``plan`` only, and only if the best plan's proven gap, (energy - bound) / energy, is still above
   ``mip_rel_gap``: the MILP, within ``node_limit``. Method "exact" ("auto" up to EXACT_MAX_BINARIES option
   binaries): the whole MILP, started from the heuristic's plan; its dual bound raises lower_bound_j. Method
   "hull" ("auto" above): the MILP over the instructions the LP left fractional, the others fixed at their LP
   option (there HiGHS does not close the whole MILP's gap in useful time: GPT-3 175B on the A40, Perseus's
   profile, 8 stages, 1 % above the fastest time, M = 24: 0.73 % after 30 s, against the heuristic's 0.58 % in
   0.2 s). On BLOOM/A100 at M = 12 and 2 %, HiGHS's root node alone takes about 20 s of this restricted MILP and
   narrows the heuristic's proven gap from 0.206 % to 0.179 %; 100 nodes take 25 s, 1,000 42 s, for the same plan
   (2-core CPU machine). HiGHS's incumbent may overstep the deadline by its feasibility tolerance (1e-7 of
   a row: BLOOM on the A100 at M = 12 once ended 1.8e-7 s past it), so it is repaired to the deadline, then
   reclaimed, and replaces the plan only if cheaper: never a plan worse than the heuristic's, never one past the deadline.

The whole frontier (``frontier()``): every distinct plan from the fastest to the least-energy one, each deadline
solved by steps 1-2 (freqopt.pipeline.frontier).

Proven vs heuristic: the LP bound is proven, and every plan is feasible (its critical path, recomputed from the
chosen clocks, is checked against the deadline); how far a plan may be from the optimum is its ``gap``, nothing
more. Sources: the
forward and backward passes and total float are the critical path method's (Kelley and Walker, 1959); Perseus
itself solves this problem on an exponential fit of each instruction's effective energy with the Phillips-Dessouky
min-cut crashing algorithm (Phillips and Dessouky, Management Science 24(4), 1977; lowtime/lowtime/solver.py,
branch ``kronos`` of github.com/ml-energy/zeus), from the slowest plan down one time unit per cut; freqopt plans
on the measured options and proves a bound at each deadline instead. The hot-started LP is what makes a dense
frontier cheap: a cold solve at M = 96 (1,536 instructions x 29 options) takes 19,120 simplex iterations, a
neighbouring deadline from the last basis a few to a few hundred.

Time quantum. ``time_quantum_s`` floors every instruction's time to a multiple of it before planning, as Perseus's
planner does (``ExecutionOption.quant_time = real_time // unit_time``, lowtime/lowtime/operation.py, branch
``kronos`` of github.com/ml-energy/zeus); it exists to compare with Perseus's frontiers on their own time axis. The
default (None) plans on the measured times.
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from freqopt.errors import FreqoptError, InvalidSettingError
from freqopt.pipeline.frontier import FRONTIER_ENERGY_STEP, sweep_frontier
from freqopt.pipeline.heuristics import PLAN_TOLERANCE, KeptOptions, PlanHeuristics
from freqopt.pipeline.plan import PipelineFrontier, PipelinePlan
from freqopt.pipeline.plan_checks import check_planner_arguments
from freqopt.pipeline.profile import InstructionOptions, StageProfile, check_number
from freqopt.pipeline.realize import RealizedPlan, price_realized
from freqopt.pipeline.solver import DEFAULT_NODE_LIMIT, MilpResult, PipelineModel, precedence_rows
from freqopt.pipeline.stage_clocks import StageClockModel, StageClockPlanning

__all__ = ["PipelinePlanner", "plan_pipeline", "DEFAULT_NODE_LIMIT"]

# "auto" solves the whole MILP ("exact") up to this many option binaries (a few dozen instructions), else "hull".
EXACT_MAX_BINARIES = 1500


class PipelinePlanner(PlanHeuristics, StageClockPlanning):
    """The clock planner of one pipeline (module docstring): a stage profile, a schedule, a blocking power.

    Args:
        profile: the measured stage profile (StageProfile or a path to its CSV).
        stages: S, the pipeline's GPUs; default the profile's stages over the model stages per GPU; must agree.
        micro_batches: M, micro-batches per iteration (a positive integer).
        blocking_power_w: the power (W) each GPU draws while it waits (0 counts waiting as free); default: the
            measured figure of ``gpu`` (MEASURED_BLOCKING_POWER_W: Perseus's 83.64 W on an A100 SXM, 70.38 W on an
            A40, measured on P2P-blocked GPUs, lowtime/scripts/perseus.py).
        gpu: the GPU's freqopt name (search_spaces/), for its measured blocking power; one of the two is required.
        schedule: the pipeline schedule, one of SCHEDULES: "1f1b" (DeepSpeed's, the default) or one of
            torch.distributed.pipelining's (freqopt.pipeline.schedules), whose per-GPU orders are the classes' own.
            With several model stages per GPU (the interleaved, looped and V-shaped ones) the profile's stages are
            the model's, ``virtual_stages`` (default 2; 2 for the V-shaped) per GPU; the zero-bubble ones need the
            backward profiled split (backward_input, backward_weight rows).
        virtual_stages: model stages per GPU for the looped schedules (default 2).
        time_quantum_s: floor every instruction's time to a multiple of this (s) before planning (module
            docstring), or None.
        mip_rel_gap: the relative optimality gap at which a solve stops (default 1e-5): HiGHS's for "exact"; for
            "hull", the proven gap below which the heuristic's plan is kept without the MILP step.
        node_limit: branch-and-bound nodes of one MILP solve (HiGHS's mip_max_nodes), or None for
            DEFAULT_NODE_LIMIT; 0 keeps the heuristic's plan. At the limit the best plan found is returned with its
            proven bound (PipelinePlan.gap), the same on any machine.
        time_limit_s: a wall-clock limit (s) of one MILP solve as well, or None (the default) for none. A plan it
            cuts short depends on the machine's speed and load; ``PipelinePlan.milp_stopped_by`` says so.
        method: "exact" (the whole MILP), "hull" (the hull LP's bound, its roundings improved by the reclaim pass,
            then the MILP on its fractional instructions if still needed; module docstring) or "auto" ("exact" up
            to EXACT_MAX_BINARIES option binaries).

    Raises:
        InvalidSettingError: a bad argument (its name first), or a profile whose stage count is not ``stages``.
    """

    def __init__(self, profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                 blocking_power_w: float | None = None, gpu: str | None = None, schedule: str = "1f1b",
                 time_quantum_s: float | None = None, mip_rel_gap: float = 1e-5, node_limit: int | None = None,
                 time_limit_s: float | None = None, method: str = "auto",
                 virtual_stages: int | None = None) -> None:  # fmt: skip
        checked = check_planner_arguments(profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w,
                                          gpu=gpu, schedule=schedule, time_quantum_s=time_quantum_s,
                                          mip_rel_gap=mip_rel_gap, node_limit=node_limit, time_limit_s=time_limit_s,
                                          method=method, virtual_stages=virtual_stages)  # fmt: skip
        profile, blocking_power_w = checked.profile, checked.blocking_power_w
        self.method = method
        self.profile = profile
        self.gpu = gpu
        self.stages = profile.stages
        self.micro_batches = micro_batches
        self.blocking_power_w = float(blocking_power_w)
        self.time_quantum_s = time_quantum_s
        self.mip_rel_gap = float(mip_rel_gap)
        self.node_limit = DEFAULT_NODE_LIMIT if node_limit is None else int(node_limit)
        self.time_limit_s = None if time_limit_s is None else float(time_limit_s)
        self.dag = checked.dag
        self.gpus = self.dag.gpus
        self.schedule = schedule
        # Each (stage, kind)'s kept options, fastest first: clocks, times (quantized if asked), energies.
        self._options: dict[tuple[int, str], KeptOptions] = {}
        for key, opts in profile.options.items():
            times = opts.time_s
            if time_quantum_s is not None:
                times = np.floor(times / time_quantum_s + 1e-9) * time_quantum_s
            quantized = InstructionOptions(opts.sm_clock_mhz, times, opts.energy_j)
            kept = quantized.non_dominated(self.blocking_power_w)
            self._options[key] = KeptOptions(opts.sm_clock_mhz[kept], times[kept], opts.energy_j[kept])
        self._model: PipelineModel | None = None
        self._stage_model: StageClockModel | None = None  # plan_stage_clocks's, built at its first call
        self._group_options(self._options)  # the heuristic's view (freqopt.pipeline.heuristics)

    def kept_clocks_mhz(self, stage: int, kind: str) -> list[int]:
        """The clocks (MHz) the planner may choose for (stage, kind), fastest first: the non-dominated ones."""
        return [int(c) for c in self._options[(stage, kind)].sm_clock_mhz]

    def evaluate(self, sm_clock_mhz: Sequence[int]) -> tuple[float, float]:
        """(time_s, energy_j) of the iteration with these clocks (shape (N,), MHz; any profiled clock, kept or not),
        with the planner's time quantum and accounting.

        Raises:
            InvalidSettingError: a length other than N, or a clock the profile does not list for that instruction.
        """
        clocks = list(sm_clock_mhz)
        if len(clocks) != self.dag.n:
            raise InvalidSettingError(f"sm_clock_mhz has {len(clocks)} clocks, not one per instruction "
                                      f"({self.dag.n})", argument="sm_clock_mhz")  # fmt: skip
        times = np.empty(self.dag.n)
        energies = np.empty(self.dag.n)
        for i, (inst, clock) in enumerate(zip(self.dag.instructions, clocks)):
            opts = self.profile.options[(inst.stage, inst.kind)]
            hits = np.flatnonzero(opts.sm_clock_mhz == clock)
            if not len(hits):
                raise InvalidSettingError(f"sm_clock_mhz {clock} was not profiled for stage {inst.stage} {inst.kind}",
                                          argument="sm_clock_mhz")  # fmt: skip
            t = opts.time_s[hits[0]]
            if self.time_quantum_s is not None:
                t = math.floor(t / self.time_quantum_s + 1e-9) * self.time_quantum_s
            times[i], energies[i] = t, opts.energy_j[hits[0]]
        return self.dag.iteration_time_s(times), self.dag.iteration_energy_j(times, energies, self.blocking_power_w)

    def fastest(self) -> PipelinePlan:
        """Every instruction at its fastest kept clock: the default plan (time and energy)."""
        clocks = np.asarray([self._options[(i.stage, i.kind)].sm_clock_mhz[0] for i in self.dag.instructions],
                            dtype=int)  # fmt: skip
        time_s, energy_j = self.evaluate(clocks)
        return PipelinePlan(dag=self.dag, sm_clock_mhz=clocks, time_s=time_s, energy_j=energy_j, deadline_s=None,
                            lower_bound_j=energy_j, default_time_s=time_s, default_energy_j=energy_j, solve_s=0.0,
                            planner=self)  # fmt: skip

    def slowest_time_s(self) -> float:
        """The iteration time (s) of the cheapest plan without deadline: every instruction at its option of least
        effective energy (its slowest kept one). No deadline above it saves more."""
        clocks = [self._options[(i.stage, i.kind)].sm_clock_mhz[-1] for i in self.dag.instructions]
        return self.evaluate(clocks)[0]

    def plan(self, deadline_s: float | None = None, *, max_slowdown: float | str | None = None,
             warm_start: PipelinePlan | None = None) -> PipelinePlan:  # fmt: skip
        """The least-energy plan whose iteration time is at most the deadline.

        Args:
            deadline_s: the deadline (s); or
            max_slowdown: the deadline as a slowdown of the fastest plan's time (0.01, "1%";
                freqopt.budget.parse_slowdown). Give exactly one of the two; neither plans the fastest plan.
            warm_start: a plan of this planner within the deadline (e.g. the plan of a shorter deadline); the "hull"
                method also slows it into the deadline's float and keeps the better plan (frontier() passes each
                point's plan to the next). Ignored by "exact".

        Returns:
            A PipelinePlan: "exact", optimal within mip_rel_gap; "hull", within its reported gap (PipelinePlan.gap,
            against the hull LP's bound). lower_bound_j is the proven bound either way.

        Raises:
            InvalidSettingError: both or a bad value; a deadline below the fastest plan's time (nothing meets it);
                a warm_start of another pipeline, with a clock the planner does not keep, or slower than the
                deadline.
            FreqoptError: HiGHS failed (the message says how).
        """
        fastest = self.fastest()
        deadline_s = self._deadline(fastest, deadline_s, max_slowdown)
        if deadline_s is None:
            return fastest
        start = None if warm_start is None else self._warm_choice(warm_start, deadline_s)
        return self.solve_deadline(deadline_s, fastest, start)[0]

    def realized(self, plan: PipelinePlan, switch_s: float | None = None, *,
                 call_s: float | None = None) -> RealizedPlan:  # fmt: skip
        """``plan`` as a runtime realizes it on this planner's profile, priced at its blocking power
        (freqopt.pipeline.realize.price_realized, which says how): each clock asked for at an instruction's start
        (realize_plan: the highest the plan needs until the next request lands, so that no instruction runs slower
        than planned), served one at a time by an NVML thread whose set calls take ``call_s`` (s) each, landing
        ``switch_s`` (s) after its call starts. The planner itself plans as if switches landed at once, as Perseus
        does; this is what that plan costs on a GPU whose switches do not. A plan with one clock per GPU
        (``plan_stage_clocks``) asks for nothing after its first iteration and realizes as planned.

        Args:
            plan: a plan of this planner (``plan``, ``plan_stage_clocks`` or a frontier point).
            switch_s: the switch latency (s); default the GPU file's clock_switch_ms of the planner's ``gpu``
                (freqopt.gpu.specs.GPUSpec.clock_switch_s: 170 ms on the A100, the cautious end of 6-170 ms).
            call_s: the NVML set call's blocking time (s); default the GPU file's (GPUSpec.nvml_call_s) where the
                planner has a ``gpu``, else 0.

        Raises:
            InvalidSettingError: a plan of another pipeline; switch_s or call_s not a finite number >= 0; switch_s
                not given and the planner has no ``gpu`` to read it from.
        """
        if not isinstance(plan, PipelinePlan) or plan.dag is not self.dag:
            raise InvalidSettingError("plan is not a plan of this planner; give one it made", argument="plan")
        spec = None
        if self.gpu is not None and (switch_s is None or call_s is None):
            from freqopt.gpu.specs import get_gpu

            spec = get_gpu(self.gpu)
        if switch_s is None:
            if spec is None:
                raise InvalidSettingError("switch_s is required: give the GPU's clock-switch latency (s), or make the "
                                          "planner with a gpu whose file has one", argument="switch_s")  # fmt: skip
            switch_s = spec.clock_switch_s
        if call_s is None:
            call_s = spec.nvml_call_s if spec is not None else 0.0
        return price_realized(self.profile, plan, switch_s, call_s=call_s, blocking_power_w=self.blocking_power_w)

    def plan_stage_clocks(self, deadline_s: float | None = None, *, max_slowdown: float | str | None = None) -> PipelinePlan:
        """The least-energy plan with one SM clock per stage for all its instructions (no clock switch within an
        iteration): the baseline that tells what per-instruction switching adds beyond balancing the stages. With
        several model stages per GPU, one clock per GPU (no GPU switches).

        The same MILP as the instruction level's (module docstring), with one binary y[s, k] per stage s and clock k
        that both of its instruction kinds were profiled at, shared by all its instructions: S x K binaries, solved
        by HiGHS within node_limit (and time_limit_s, if set) and mip_rel_gap, from no start (one made HiGHS 1.16 stop
        at it: freqopt.pipeline.stage_clocks); the fastest plan where it finds none by then. lower_bound_j is HiGHS's
        dual bound for this restricted problem. Args and errors: as ``plan``; neither
        deadline: the fastest plan.

        Raises:
            InvalidSettingError: as ``plan``; a GPU whose instructions share no profiled clock.
        """
        return self._plan_stage_clocks(deadline_s, max_slowdown=max_slowdown)

    def _deadline(self, fastest: PipelinePlan, deadline_s: float | None, max_slowdown) -> float | None:
        """The deadline (s) of plan()'s arguments, checked; None for the fastest plan."""
        if deadline_s is not None and max_slowdown is not None:
            raise InvalidSettingError("deadline_s and max_slowdown are both given; give one", argument="deadline_s")
        if max_slowdown is not None:
            from freqopt.budget import parse_slowdown

            deadline_s = fastest.time_s * (1.0 + parse_slowdown(max_slowdown, allow_zero=True))
        if deadline_s is None:
            return None
        check_number("deadline_s", deadline_s, minimum=0.0, strict=True)
        if deadline_s < fastest.time_s * (1 - 1e-12):
            raise InvalidSettingError(f"deadline_s {deadline_s:.6g} s is below the fastest plan's "
                                      f"{fastest.time_s:.6g} s; no plan meets it", argument="deadline_s")  # fmt: skip
        return max(deadline_s, fastest.time_s)

    def _warm_choice(self, warm_start: PipelinePlan, deadline_s: float) -> np.ndarray:
        """A warm start's option index per instruction (plan's docstring for the checks)."""
        if not isinstance(warm_start, PipelinePlan) or len(warm_start.sm_clock_mhz) != self.dag.n or \
                warm_start.dag.stages != self.stages or warm_start.dag.micro_batches != self.micro_batches:
            raise InvalidSettingError("warm_start is not a plan of this pipeline (its stages and micro-batches); "
                                      "give a plan this planner made", argument="warm_start")  # fmt: skip
        choice = np.empty(self.dag.n, dtype=int)
        for i, (g, clock) in enumerate(zip(self._group, warm_start.sm_clock_mhz)):
            hits = np.flatnonzero(self._kept_clocks[g] == clock)
            if not len(hits):
                inst = self.dag.instructions[i]
                raise InvalidSettingError(f"warm_start's clock {int(clock)} MHz for {inst} is not one this planner "
                                          "keeps; give a plan this planner made", argument="warm_start")  # fmt: skip
            choice[i] = hits[0]
        if self.dag.iteration_time_s(self._durations(choice)) > deadline_s * (1 + PLAN_TOLERANCE):
            raise InvalidSettingError(f"warm_start's iteration time is above the deadline {deadline_s:.6g} s; give a "
                                      "plan within it", argument="warm_start")  # fmt: skip
        return choice

    def frontier(self, n_points: int | None = None, *, deadlines_s: Sequence[float] | None = None,
                 energy_step: float = FRONTIER_ENERGY_STEP) -> PipelineFrontier:  # fmt: skip
        """The iteration time-energy frontier, fastest first: by default every distinct plan from the fastest to
        the least-energy plan (freqopt.pipeline.frontier's module docstring).

        Args:
            n_points: instead, this many deadlines evenly spaced from the fastest plan's time to the least-energy
                plan's (ends included), one point each.
            deadlines_s: instead, these deadlines (s), each at least the fastest plan's time, one point each.
            energy_step: for the whole frontier, the largest relative energy step left between consecutive plans
                (a fraction, default FRONTIER_ENERGY_STEP) before the deadlines between them are searched.

        Returns:
            A PipelineFrontier: points in increasing time with strictly falling energy for the whole frontier;
            one point per deadline otherwise (energies non-increasing: a plan within a deadline is within every
            later one). Every point carries its plan's clocks and the proven bound at its deadline.

        Raises:
            InvalidSettingError: n_points or energy_step out of range, both n_points and deadlines_s, a deadline
                below the fastest plan's time.
            KeyboardInterrupt: Ctrl-C (HiGHS is stopped first; nothing is kept).
        """
        return sweep_frontier(self, n_points, deadlines_s=deadlines_s, energy_step=energy_step)

    # The LP/MILP model (module docstring): variables x (one per instruction and kept option), s (N), T.
    def _build(self) -> None:
        n = self.dag.n
        offsets = np.zeros(n + 1, dtype=int)
        times: list[np.ndarray] = []
        costs: list[np.ndarray] = []
        for i, g in enumerate(self._group):
            times.append(self._kept_times[g])
            costs.append(self._kept_effective[g])
            offsets[i + 1] = offsets[i] + len(times[-1])
        n_x = int(offsets[-1])
        matrix, lower, upper = precedence_rows(self.dag, n, offsets, list(range(n)), times, n_x)
        objective = np.concatenate([np.concatenate(costs), np.zeros(n), [self.gpus * self.blocking_power_w]])
        self._offsets = offsets
        self._model = PipelineModel(matrix, lower, upper, objective, n_x)
    def solve_deadline(self, deadline_s: float, fastest: PipelinePlan, warm_start: np.ndarray | None = None, *,
                       polish: bool = True, extra: Sequence[np.ndarray] = ()) -> tuple[PipelinePlan, np.ndarray]:  # fmt: skip
        """The best plan found within ``deadline_s`` (s) and its option indices, shape (N,) (module docstring, steps
        1-3; step 3, the MILP, only with ``polish``); ``warm_start`` and ``extra`` are further plans (option indices)
        to start from, ``extra`` possibly past the deadline (repaired first). The step ``plan`` and the frontier's
        sweep (freqopt.pipeline.frontier.FrontierPlanner) share; the deadline is not checked here (``plan`` does)."""
        start = _time.perf_counter()
        x_lp, lower_bound = self._hull_lp(deadline_s)
        candidates = [self._round_down(x_lp, deadline_s)]
        if polish:  # the error diffusion costs the most and rarely wins in a sweep (freqopt.pipeline.frontier)
            candidates.append(self._round_dither(x_lp, deadline_s))
        candidates += [self._repair(choice, deadline_s) for choice in extra]
        if warm_start is not None:
            candidates.append(warm_start)
        chosen = min((self._reclaim(c, deadline_s) for c in candidates), key=self._cost)
        stopped_by = None
        if polish and self._cost(chosen) - lower_bound > self.mip_rel_gap * abs(self._cost(chosen)):
            method = self.method
            if method == "auto":
                method = "exact" if self._offsets[-1] <= EXACT_MAX_BINARIES else "hull"
            if method == "exact":
                result = self._model.milp(deadline_s, start=self._point(chosen), node_limit=self.node_limit,
                                          time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)  # fmt: skip
                lower_bound = max(lower_bound, result.dual_bound)
            else:
                result = self._fractional_milp(x_lp, deadline_s)
            stopped_by = result.stopped_by
            if result.x is not None:
                # HiGHS's plan may overstep the deadline by its feasibility tolerance (1e-7 of a row): repaired
                # first, then slowed into what float it left.
                improved = self._reclaim(self._repair(self._choices(result.x), deadline_s), deadline_s)
                if self._cost(improved) < self._cost(chosen):
                    chosen = improved
        solve_s = _time.perf_counter() - start
        clocks = self._clocks(chosen)
        time_s, energy_j = self.evaluate(clocks)
        if time_s > deadline_s * (1 + 1e-9):  # the passes above guarantee it; a guard against a bug in them
            raise FreqoptError(f"the pipeline planner's plan lasts {time_s:.9g} s, past the deadline {deadline_s:.9g} "
                               "s; please report this with the stage profile")  # fmt: skip
        plan = PipelinePlan(dag=self.dag, sm_clock_mhz=clocks, time_s=time_s, energy_j=energy_j,
                            deadline_s=float(deadline_s), lower_bound_j=min(lower_bound, energy_j),
                            default_time_s=fastest.time_s, default_energy_j=fastest.energy_j, solve_s=solve_s,
                            planner=self, milp_stopped_by=stopped_by)  # fmt: skip
        return plan, chosen

    def _hull_lp(self, deadline_s: float) -> tuple[np.ndarray, float]:
        """The hull LP's solution (the model's columns: x, then start times, then T) and optimum (J): a proven lower
        bound on the energy of every plan within deadline_s."""
        if self._model is None:
            self._build()
        return self._model.lp(deadline_s)

    def _fractional_milp(self, x_lp: np.ndarray, deadline_s: float) -> MilpResult:
        """The MILP on the instructions the LP left fractional, the others fixed at the LP's option; its dual bound
        holds for that restriction only, so the caller keeps the LP's."""
        offsets = self._offsets
        share = np.maximum.reduceat(x_lp[:offsets[-1]], offsets[:-1])
        # Fixing an option the LP took at 1 - 1e-7 can leave no room within the deadline (the LP's tolerance): then
        # free more (share below 1 - 1e-3 and their DAG neighbours). Freeing the neighbours from the start was
        # tried: on the Perseus profiles at M = 96 it found worse plans within a time limit.
        result = MilpResult(None, -np.inf, "not run")
        for attempt in range(2):
            free = share < 1 - (1e-6 if attempt == 0 else 1e-3)
            if attempt == 1:
                edges = self.dag.edges
                grown = free.copy()
                grown[edges[free[edges[:, 0]], 1]] = True
                grown[edges[free[edges[:, 1]], 0]] = True
                free = grown
            lower, upper = np.zeros(offsets[-1]), np.ones(offsets[-1])
            for i in np.flatnonzero(~free):
                k = offsets[i] + int(np.argmax(x_lp[offsets[i]:offsets[i + 1]]))
                upper[offsets[i]:offsets[i + 1]] = 0.0
                lower[k] = upper[k] = 1.0
            result = self._model.milp(deadline_s, x_lower=lower, x_upper=upper, node_limit=self.node_limit,
                                      time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)  # fmt: skip
            if result.x is not None:
                return result
        return result

    def _point(self, choice: np.ndarray) -> np.ndarray:
        """A plan as a point of the MILP: one-hot options, earliest starts, T its critical path."""
        x = np.zeros(self._model.n_var)
        x[self._offsets[:-1] + choice] = 1.0
        d = self._durations(choice)
        es = self._graph.earliest(d)
        x[self._offsets[-1]:-1] = es
        x[-1] = max(e + t for e, t in zip(es, d))
        return x


def plan_pipeline(profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                  max_slowdown: float | str | None = None, deadline_s: float | None = None,
                  blocking_power_w: float | None = None, gpu: str | None = None, schedule: str = "1f1b",
                  time_quantum_s: float | None = None, mip_rel_gap: float = 1e-5, node_limit: int | None = None,
                  time_limit_s: float | None = None, method: str = "auto") -> PipelinePlan:  # fmt: skip
    """The least-energy clock per instruction of a pipeline iteration within a deadline (module docstring).

    Args: as PipelinePlanner's, and PipelinePlanner.plan's ``deadline_s`` or ``max_slowdown`` (neither: the fastest
    plan). The result's ``frontier(n_points)`` gives the whole time-energy frontier.

    Raises:
        InvalidSettingError: a bad argument or stage profile (the argument's name first).
        FreqoptError: the solver failed.
    """
    planner = PipelinePlanner(profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w, gpu=gpu,
                              schedule=schedule, time_quantum_s=time_quantum_s, mip_rel_gap=mip_rel_gap,
                              node_limit=node_limit, time_limit_s=time_limit_s, method=method)  # fmt: skip
    return planner.plan(deadline_s, max_slowdown=max_slowdown)
