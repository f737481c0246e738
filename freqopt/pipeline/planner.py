"""One SM clock per pipeline instruction: a measured stage profile in, the plan and the frontier out.

A stage profile (``load_stage_profile``) holds, for every pipeline stage and instruction kind (forward, backward),
the time (s) and energy (J) of one instruction at each locked SM clock (MHz), as Perseus (Chung et al., SOSP'24)
and Zeus write them: CSV columns ``stage, instruction, frequency, time, energy``.

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
and hot-started from its last basis, every MILP has a time limit (``time_limit_s``, default DEFAULT_TIME_LIMIT_S)
and a proven bound, and Ctrl-C stops any solve within a fraction of a second.

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
2. Plans from it, each made to meet the deadline and then improved by the reclaim pass below; the best is kept:
   - Round down: every instruction takes its slowest kept option no slower than its LP time t_lp = sum_k x[i, k]
     t[i, k] (the cheapest such, kept options being non-dominated). Every instruction is then no slower than in
     the LP, so the LP's start times still certify the deadline: feasible by construction.
   - Error diffusion (``plan`` only): where the LP mixes a fast and a slow option lo < hi of an instruction, the
     slow one's share of its time, (t_lp - t[lo]) / (t[hi] - t[lo]), is summed over the micro-batches of its
     (stage, kind) in order, and the instruction takes hi whenever the sum reaches 1/2 (then less 1), else lo: the
     LP's count of slow options, where a slow option is one large step that rounding down gives up everywhere
     (Perseus's GPT-3 175B A40 profile, experiments/data/perseus: stage 0's backward pass from 1170 to 960 MHz adds
     1.6 ms and saves 6.5 J of effective energy at 70.38 W). It may break the deadline; a repair pass then speeds
     up, one option at a time, the instruction on a too-long path whose faster option costs the least effective
     energy per second saved, until the critical path fits (it always ends: the fastest plan meets every deadline).
   - A warm start, when the caller gives a plan within the deadline; in a frontier, also the next slower plan
     found, repaired down to the deadline.
   The reclaim pass: each instruction's total float under the deadline (latest minus earliest start, the critical
   path method's forward and backward passes over the DAG) bounds how much slower it may run. The move (one
   instruction to a slower kept option within its float) that saves the most effective energy per second it adds
   is applied first, the floats updated, and so on to a fixed point; a move that lengthens the critical path
   counts S p per second of it against its saving. It never breaks the deadline nor raises the energy.
3. ``plan`` only, and only if the best plan's proven gap, (energy - bound) / energy, is still above
   ``mip_rel_gap``: the MILP, with ``time_limit_s``. Method "exact" ("auto" up to EXACT_MAX_BINARIES option
   binaries): the whole MILP, started from the heuristic's plan; its dual bound raises lower_bound_j. Method
   "hull" ("auto" above): the MILP over the instructions the LP left fractional, the others fixed at their LP
   option (there HiGHS does not close the whole MILP's gap in useful time: GPT-3 175B on the A40, Perseus's
   profile, 8 stages, 1 % above the fastest time, M = 24: 0.73 % after 30 s, against the heuristic's 0.58 % in
   0.2 s). HiGHS's incumbent may overstep the deadline by its feasibility tolerance (1e-7 of a row: BLOOM on the
   A100 at M = 12 once ended 1.8e-7 s past it), so it is repaired to the deadline, then reclaimed, and replaces
   the plan only if cheaper: never a plan worse than the heuristic's, never one past the deadline.

The whole frontier (``frontier()``). Every distinct plan from the fastest to the least-energy one: the deadline at
the fastest time, then the slowest plan's time (its plan is the least-energy plan; no deadline past its time is
solved), then, between any two solved deadlines whose best plans' energies, or whose LP bounds, differ by more
than ``energy_step`` (default FRONTIER_ENERGY_STEP, 0.1 %), their midpoint, to a time resolution of
_FRONTIER_TIME_RESOLUTION of the fastest time. The bounds' rule refines where the optimum itself falls steeply
though the plans found there are flat (a stretch of poor plans hides from the energies' rule): on BLOOM/A100 at
M = 96 (`freqopt plan --json`) it took 520 deadlines instead of 483, the proven gap went from 0.51 % to 0.34 %, and
the staircase's worst point against Perseus's plans from +0.24 % to +0.09 % (experiments/perseus/report.md).
Each deadline is one hot-started LP, its round-down, the best plan already found within it and the
next slower plan repaired down to it (steps 1-2, no MILP): the LP moves little between neighbouring deadlines, and
a neighbour's plan is often the best start (on BLOOM/A100 at M = 12 the round-down was best at half the deadlines,
a neighbour's plan at the other half; the error diffusion at 6 %, for most of the time). The points are the
staircase of the plans found: each strictly cheaper than every faster one. Its proven gap bounds how far the
staircase lies above the optimum at every time (PipelineFrontier.proven_gap). Measured beside Perseus itself on
its own profiles, both scored on the measured data: experiments/perseus/report.md.

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

import csv
import heapq
import math
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freqopt.errors import FreqoptError, InvalidSettingError, check_positive_int
from freqopt.pipeline.dag import ALL_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SCHEDULES, PipelineDAG, schedule_dag
from freqopt.pipeline.solver import MilpResult, PipelineModel
from freqopt.pipeline.schedules import stages_per_rank

__all__ = ["InstructionOptions", "StageProfile", "load_stage_profile", "stage_profile_from_rows", "PipelinePlan",
           "PipelinePlanner", "FrontierPoint", "PipelineFrontier", "plan_pipeline", "blocking_power_w_for",
           "MEASURED_BLOCKING_POWER_W", "PROFILE_COLUMNS"]  # fmt: skip

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
METHODS = ("auto", "exact", "hull")
# "auto" solves the whole MILP ("exact") up to this many option binaries (a few dozen instructions), else "hull".
EXACT_MAX_BINARIES = 1500
# The limit (s) on one MILP solve (the whole MILP for "exact", the fractional instructions' for "hull"), unless
# time_limit_s says otherwise.
DEFAULT_TIME_LIMIT_S = 2.0
# The whole frontier's resolution: deadlines between two plans are searched while their energies differ by more
# than this fraction (module docstring, "The whole frontier").
FRONTIER_ENERGY_STEP = 1e-3
# The power (W) a GPU draws while blocked on a pipeline P2P transfer, measured by Perseus (Chung et al., SOSP'24;
# lowtime/scripts/perseus.py, branch kronos of github.com/ml-energy/zeus: "Raw P2P blocking power consumption"),
# by freqopt GPU name (search_spaces/). The default blocking_power_w where the caller names one of these GPUs.
MEASURED_BLOCKING_POWER_W = {"a100-sxm4-80gb": 83.64, "a40": 70.38}
# The whole frontier's time resolution, a fraction of the fastest plan's time: no two deadlines closer than this.
_FRONTIER_TIME_RESOLUTION = 1e-5
# Relative slack (of the deadline) the heuristic's passes allow for floating-point sums of instruction times.
_TOLERANCE = 1e-12


@dataclass(frozen=True)
class InstructionOptions:
    """The measured options of one (stage, instruction kind): arrays of shape (K,), one entry per SM clock.

    Attributes:
        sm_clock_mhz: the locked SM clock (MHz), int array.
        time_s: the instruction's time at that clock (s).
        energy_j: its energy at that clock (J).
    """

    sm_clock_mhz: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray

    def non_dominated(self, blocking_power_w: float = 0.0) -> np.ndarray:
        """Indices of the options no other option dominates, fastest first (shape (K',), K' <= K).

        Option a dominates b when time_s[a] <= time_s[b] and the effective energy
        energy_j - blocking_power_w * time_s is no higher at a, one of the two strictly (module docstring). Of equal
        options, the higher clock is kept.
        """
        effective = self.energy_j - blocking_power_w * self.time_s
        order = np.lexsort((-self.sm_clock_mhz, effective, self.time_s))  # by time, then effective energy
        kept: list[int] = []
        best = math.inf
        for k in order:
            if effective[k] < best:
                kept.append(int(k))
                best = effective[k]
        return np.asarray(kept, dtype=int)


@dataclass(frozen=True)
class StageProfile:
    """A pipeline's measured stage profile: ``options[(stage, kind)]`` for stage in 0..stages-1 and kind in
    ("forward", "backward"), or with the backward split ("backward_input", "backward_weight") for the zero-bubble
    schedules (freqopt.pipeline.schedules); with virtual stages, the stages are the model's (several per GPU).

    Attributes:
        stages: the number of stages profiled.
        options: (stage, kind) -> InstructionOptions.
        source: where it was read from (a path), or None.
    """

    stages: int
    options: Mapping[tuple[int, str], InstructionOptions]
    source: str | None = None


def _profile_error(source: str | None, message: str) -> InvalidSettingError:
    where = f" {source}" if source else ""
    return InvalidSettingError(f"stage_profile{where}: {message}", argument="stage_profile")


def stage_profile_from_rows(rows: Iterable[Mapping[str, object]], *, source: str | None = None) -> StageProfile:
    """A StageProfile from rows with the keys stage, instruction, frequency (MHz), time (s), energy (J).

    Args:
        rows: mappings (a csv.DictReader's rows, or dicts of numbers); extra keys are ignored.
        source: the rows' origin, for error messages.

    Raises:
        InvalidSettingError (argument ``stage_profile``): a missing column, a value that is not a number (or not a
            whole number for stage and frequency), an instruction other than forward/backward, a time that is not
            positive or an energy that is negative or not finite, a clock listed twice for one stage and
            instruction, stages that are not 0..S-1, or a stage without forward or backward rows.
    """
    grouped: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    n_rows = 0
    for line, row in enumerate(rows, start=2):
        n_rows += 1
        missing = [c for c in PROFILE_COLUMNS if c not in row or row[c] is None]
        if missing:
            raise _profile_error(source, f"missing column(s) {', '.join(missing)}; a stage profile has the columns "
                                         f"{', '.join(PROFILE_COLUMNS)}")  # fmt: skip
        values = {}
        for column in PROFILE_COLUMNS[2:] + ("stage",):
            raw = row[column]
            try:
                values[column] = float(raw)
            except (TypeError, ValueError):
                raise _profile_error(source, f"row {line}: {column} {raw!r} is not a number") from None
            if not math.isfinite(values[column]):
                raise _profile_error(source, f"row {line}: {column} {raw!r} is not finite")
        for column in ("stage", "frequency"):
            if values[column] != int(values[column]) or values[column] < 0:
                raise _profile_error(source, f"row {line}: {column} {row[column]!r} is not a whole number >= 0")
        kind = str(row["instruction"]).strip().lower()
        if kind not in ALL_KINDS:
            raise _profile_error(source, f"row {line}: instruction {row['instruction']!r} is not one of "
                                         f"{', '.join(ALL_KINDS)}")  # fmt: skip
        if values["time"] <= 0:
            raise _profile_error(source, f"row {line}: time {row['time']!r} is not positive (seconds)")
        if values["energy"] < 0:
            raise _profile_error(source, f"row {line}: energy {row['energy']!r} is negative (joules)")
        grouped.setdefault((int(values["stage"]), kind), []).append(
            (int(values["frequency"]), values["time"], values["energy"]))
    if not n_rows:
        raise _profile_error(source, f"no rows; a stage profile has the columns {', '.join(PROFILE_COLUMNS)}")
    stages = 1 + max(stage for stage, _ in grouped)
    options: dict[tuple[int, str], InstructionOptions] = {}
    for stage in range(stages):
        split = (stage, BACKWARD_INPUT) in grouped or (stage, BACKWARD_WEIGHT) in grouped
        needed = [FORWARD] + ([BACKWARD_INPUT, BACKWARD_WEIGHT] if split else [BACKWARD])
        for kind in [k for k in ALL_KINDS if k in needed or (stage, k) in grouped]:
            entries = grouped.get((stage, kind))
            if not entries:
                raise _profile_error(source, f"stage {stage} has no {kind} rows; profile every stage 0..{stages - 1} "
                                             "forward and backward (or the backward split into backward_input and "
                                             "backward_weight, for the zero-bubble schedules)")  # fmt: skip
            clocks = [c for c, _, _ in entries]
            if len(set(clocks)) != len(clocks):
                twice = sorted({c for c in clocks if clocks.count(c) > 1})
                raise _profile_error(source, f"stage {stage} {kind} lists clock(s) {twice} more than once")
            entries.sort()
            options[(stage, kind)] = InstructionOptions(
                np.asarray([c for c, _, _ in entries], dtype=int), np.asarray([t for _, t, _ in entries]),
                np.asarray([e for _, _, e in entries]))  # fmt: skip
    return StageProfile(stages, options, source)


def load_stage_profile(path: str | Path) -> StageProfile:
    """Read a stage profile CSV (columns stage, instruction, frequency, time, energy; Perseus's and Zeus's format).
    Lines starting with ``#`` are comments (a source line, as experiments/data/perseus's copies carry).

    Raises:
        InvalidSettingError (argument ``stage_profile``): the file cannot be read, or its content is invalid
            (stage_profile_from_rows).
    """
    source = str(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(line for line in f if not line.lstrip().startswith("#"))
            if reader.fieldnames is None:
                raise _profile_error(source, "is empty; a stage profile has the columns " + ", ".join(PROFILE_COLUMNS))
            fieldnames = [name.strip() for name in reader.fieldnames]
            missing = [c for c in PROFILE_COLUMNS if c not in fieldnames]
            if missing:
                raise _profile_error(source, f"missing column(s) {', '.join(missing)}; a stage profile has the "
                                             f"columns {', '.join(PROFILE_COLUMNS)}")  # fmt: skip
            reader.fieldnames = fieldnames
            return stage_profile_from_rows(list(reader), source=source)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _profile_error(source, f"cannot be read ({reason}); give a CSV file") from None


@dataclass(frozen=True)
class PipelinePlan:
    """A clock per instruction of one pipeline iteration, with its time and energy.

    Attributes:
        dag: the instruction DAG (freqopt.pipeline.dag.PipelineDAG); arrays below follow dag.instructions.
        sm_clock_mhz: the SM clock (MHz) of each instruction, int array of shape (N,).
        time_s: the iteration time (s): the critical path with those clocks.
        energy_j: the iteration's energy (J), Perseus's accounting.
        deadline_s: the deadline it was planned for (s), or None for the fastest plan.
        lower_bound_j: a proven lower bound (J) on the energy of any plan within the deadline (HiGHS's MILP bound,
            or the hull LP's optimum for method "hull"); energy_j itself where the plan is optimal by construction
            (the fastest plan).
        default_time_s, default_energy_j: the fastest plan's (every instruction at its fastest clock).
        solve_s: wall time (s) the solver took.
    """

    dag: PipelineDAG
    sm_clock_mhz: np.ndarray
    time_s: float
    energy_j: float
    deadline_s: float | None
    lower_bound_j: float
    default_time_s: float
    default_energy_j: float
    solve_s: float = 0.0
    planner: PipelinePlanner | None = field(default=None, repr=False, compare=False)

    @property
    def gap(self) -> float:
        """The proven relative optimality gap, (energy_j - lower_bound_j) / energy_j (0 when optimal)."""
        return max(0.0, (self.energy_j - self.lower_bound_j) / self.energy_j) if self.energy_j else 0.0

    @property
    def saved(self) -> float:
        """The energy saved against the fastest plan, as a fraction of its energy."""
        return 1.0 - self.energy_j / self.default_energy_j

    def stage_clocks(self) -> list[dict[str, object]]:
        """The plan stage by stage, each stage's instructions in the order it runs them:
        ``[{"stage": s, "instructions": [{"kind", "micro_batch", "sm_clock_mhz"}, ...]}, ...]``."""
        out: list[dict[str, object]] = [{"stage": s, "instructions": []} for s in range(self.dag.stages)]
        for inst, clock in zip(self.dag.instructions, self.sm_clock_mhz):
            out[inst.stage]["instructions"].append(  # type: ignore[union-attr]
                {"kind": inst.kind, "micro_batch": inst.micro_batch, "sm_clock_mhz": int(clock)})
        return out

    def frontier(self, n_points: int | None = None) -> PipelineFrontier:
        """The iteration time-energy frontier of the same pipeline (PipelinePlanner.frontier)."""
        if self.planner is None:
            raise InvalidSettingError("this plan carries no planner; call PipelinePlanner.frontier")
        return self.planner.frontier(n_points)


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the time-energy frontier: the best plan found within ``deadline_s``.

    Attributes:
        time_s: the plan's iteration time (s), at most deadline_s.
        energy_j: its energy (J).
        lower_bound_j: the proven lower bound (J) on any plan's energy within deadline_s (the hull LP's optimum).
        deadline_s: the deadline (s).
        sm_clock_mhz: the plan's SM clock per instruction (MHz), int array of shape (N,) in the DAG's order, or None.
    """

    time_s: float
    energy_j: float
    lower_bound_j: float
    deadline_s: float
    sm_clock_mhz: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def gap(self) -> float:
        """The proven relative gap of this point, (energy_j - lower_bound_j) / energy_j."""
        return max(0.0, (self.energy_j - self.lower_bound_j) / self.energy_j) if self.energy_j else 0.0


@dataclass(frozen=True)
class PipelineFrontier:
    """The iteration time-energy frontier of one pipeline (PipelinePlanner.frontier); iterates over its points.

    Attributes:
        points: FrontierPoint tuple in increasing time.
        proven_gap: an upper bound on how far the staircase through the points (at time t, the least energy of a
            point no slower than t) lies above the least energy of any plan no slower than t, for every t from the
            first point's time to the last's, as a fraction: max over consecutive solved deadlines D_j < D_j+1 of
            staircase(D_j) / LP(D_j+1) - 1 (the hull LP's optimum falls with the deadline, so it bounds every plan
            in between).
        solves: the deadlines solved (each one hot-started hull LP and its roundings).
        solve_s: wall time (s) of the whole frontier.
    """

    points: tuple[FrontierPoint, ...]
    proven_gap: float
    solves: int
    solve_s: float

    def __iter__(self):
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index):
        return self.points[index]


class PipelinePlanner:
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
        time_limit_s: wall-clock limit (s) of one MILP solve, or None for DEFAULT_TIME_LIMIT_S; at the limit the best
            plan found is returned with its proven bound (PipelinePlan.gap).
        method: "exact" (the whole MILP), "hull" (the hull LP's bound, its roundings improved by the reclaim pass,
            then the MILP on its fractional instructions if still needed; module docstring) or "auto" ("exact" up
            to EXACT_MAX_BINARIES option binaries).

    Raises:
        InvalidSettingError: a bad argument (its name first), or a profile whose stage count is not ``stages``.
    """

    def __init__(self, profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                 blocking_power_w: float | None = None, gpu: str | None = None, schedule: str = "1f1b",
                 time_quantum_s: float | None = None, mip_rel_gap: float = 1e-5, time_limit_s: float | None = None,
                 method: str = "auto", virtual_stages: int | None = None) -> None:  # fmt: skip
        if method not in METHODS:
            raise InvalidSettingError(f"method {method!r} is unknown; known: {', '.join(METHODS)}", argument="method")
        self.method = method
        if not isinstance(profile, StageProfile):
            profile = load_stage_profile(profile)
        check_positive_int("micro_batches", micro_batches)
        check_positive_int("stages", stages, optional=True)
        if schedule not in SCHEDULES:
            raise InvalidSettingError(f"schedule {schedule!r} is unknown; known: {', '.join(SCHEDULES)}",
                                      argument="schedule")  # fmt: skip
        per_gpu = stages_per_rank(schedule, virtual_stages)
        if profile.stages % per_gpu:
            raise InvalidSettingError(f"schedule {schedule} runs {per_gpu} model stages per GPU; the stage profile's "
                                      f"{profile.stages} stages do not divide among GPUs that way", argument="schedule")  # fmt: skip
        gpus = profile.stages // per_gpu
        if stages is not None and stages != gpus:
            what = (f"{gpus} stages" if per_gpu == 1 else
                    f"{gpus} GPUs ({profile.stages} model stages, {per_gpu} per GPU under {schedule})")
            raise InvalidSettingError(f"stages {stages} is not the stage profile's {what}; plan the pipeline that was "
                                      "profiled", argument="stages")  # fmt: skip
        blocking_power_w = blocking_power_w_for(blocking_power_w, gpu)
        if time_quantum_s is not None:
            _check_number("time_quantum_s", time_quantum_s, minimum=0.0, strict=True)
        _check_number("mip_rel_gap", mip_rel_gap, minimum=0.0)
        if time_limit_s is not None:
            _check_number("time_limit_s", time_limit_s, minimum=0.0, strict=True)
        self.profile = profile
        self.stages = profile.stages
        self.micro_batches = micro_batches
        self.blocking_power_w = float(blocking_power_w)
        self.time_quantum_s = time_quantum_s
        self.mip_rel_gap = float(mip_rel_gap)
        self.time_limit_s = DEFAULT_TIME_LIMIT_S if time_limit_s is None else float(time_limit_s)
        self.dag = schedule_dag(schedule, gpus, micro_batches, virtual_stages=virtual_stages)
        self.gpus = self.dag.gpus
        self.schedule = schedule
        missing = sorted({(i.stage, i.kind) for i in self.dag.instructions} - set(profile.options))
        if missing:
            stage, kind = missing[0]
            raise InvalidSettingError(f"stage_profile: schedule {schedule} runs {kind} instructions, which the profile "
                                      f"does not give (stage {stage}, and {len(missing) - 1} more); profile them, or "
                                      f"plan a schedule whose instructions it has", argument="stage_profile")  # fmt: skip
        # Each (stage, kind)'s kept options, fastest first: clocks, times (quantized if asked), energies.
        self._options: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, opts in profile.options.items():
            times = opts.time_s
            if time_quantum_s is not None:
                times = np.floor(times / time_quantum_s + 1e-9) * time_quantum_s
            quantized = InstructionOptions(opts.sm_clock_mhz, times, opts.energy_j)
            kept = quantized.non_dominated(self.blocking_power_w)
            self._options[key] = (opts.sm_clock_mhz[kept], times[kept], opts.energy_j[kept])
        self._model: PipelineModel | None = None
        self._stage_model: tuple[list[list[int]], np.ndarray, PipelineModel] | None = None
        self._offsets = np.zeros(1, dtype=int)
        # The heuristic's view (one group per (stage, kind)): each instruction's group, the groups' kept clocks,
        # times and effective energies, and the DAG as adjacency lists.
        keys = sorted(self._options)
        self._group = [keys.index((i.stage, i.kind)) for i in self.dag.instructions]
        self._kept_clocks = [self._options[key][0] for key in keys]
        self._kept_times = [self._options[key][1] for key in keys]
        self._kept_effective = [self._options[key][2] - self.blocking_power_w * self._options[key][1] for key in keys]
        self._graph = _Graph(self.dag)
        self._by_micro_batch = sorted(range(self.dag.n), key=lambda i: (self._group[i], self.dag.instructions[i].micro_batch))

    def kept_clocks_mhz(self, stage: int, kind: str) -> list[int]:
        """The clocks (MHz) the planner may choose for (stage, kind), fastest first: the non-dominated ones."""
        return [int(c) for c in self._options[(stage, kind)][0]]

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
        clocks = np.asarray([self._options[(i.stage, i.kind)][0][0] for i in self.dag.instructions], dtype=int)
        time_s, energy_j = self.evaluate(clocks)
        return PipelinePlan(self.dag, clocks, time_s, energy_j, None, energy_j, time_s, energy_j, 0.0, self)

    def slowest_time_s(self) -> float:
        """The iteration time (s) of the cheapest plan without deadline: every instruction at its option of least
        effective energy (its slowest kept one). No deadline above it saves more."""
        clocks = [self._options[(i.stage, i.kind)][0][-1] for i in self.dag.instructions]
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
        return self._solve(deadline_s, fastest, start)[0]

    def plan_stage_clocks(self, deadline_s: float | None = None, *, max_slowdown: float | str | None = None) -> PipelinePlan:
        """The least-energy plan with one SM clock per stage for all its instructions (no clock switch within an
        iteration): the baseline that tells what per-instruction switching adds beyond balancing the stages. With
        several model stages per GPU, one clock per GPU (no GPU switches).

        The same MILP as the instruction level's (module docstring), with one binary y[s, k] per stage s and clock k
        that both of its instruction kinds were profiled at, shared by all its instructions: S x K binaries, solved
        by HiGHS within time_limit_s and mip_rel_gap; lower_bound_j is HiGHS's dual bound for this restricted
        problem. Args and errors: as ``plan``; neither deadline: the fastest plan.

        Raises:
            InvalidSettingError: as ``plan``; a GPU whose instructions share no profiled clock.
            FreqoptError: HiGHS found no plan within its time limit.
        """
        fastest = self.fastest()
        deadline_s = self._deadline(fastest, deadline_s, max_slowdown)
        if deadline_s is None:
            return fastest
        start = _time.perf_counter()
        if self._stage_model is None:
            self._stage_model = self._build_stage_model()
        clocks, offsets, model = self._stage_model
        result = model.milp(deadline_s, time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)
        if result.x is None:
            raise FreqoptError(f"the stage-clock planner (HiGHS) found no plan within {deadline_s:.6g} s in "
                               f"{self.time_limit_s:g} s: {result.status}")  # fmt: skip
        chosen = [clocks[g][int(np.argmax(result.x[offsets[g]:offsets[g + 1]]))] for g in range(self.gpus)]
        per_instruction = np.asarray([chosen[self.dag.gpu_of(inst)] for inst in self.dag.instructions], dtype=int)
        time_s, energy_j = self.evaluate(per_instruction)
        if time_s > deadline_s * (1 + 1e-9):  # HiGHS's tolerance: the fastest plan is the safe answer
            per_instruction = fastest.sm_clock_mhz
            time_s, energy_j = fastest.time_s, fastest.energy_j
        return PipelinePlan(self.dag, per_instruction, time_s, energy_j, float(deadline_s),
                            min(result.dual_bound, energy_j), fastest.time_s, fastest.energy_j,
                            _time.perf_counter() - start, self)  # fmt: skip

    def _build_stage_model(self) -> tuple[list[list[int]], np.ndarray, PipelineModel]:
        """plan_stage_clocks's model, built once: each GPU's clocks (every instruction kind of every model stage it
        runs profiled at them, fastest first; 1F1B: one stage per GPU), its columns' offsets, and the
        PipelineModel."""
        clocks = []
        for gpu in range(self.gpus):
            keys = sorted({(i.stage, i.kind) for i in self.dag.instructions if self.dag.gpu_of(i) == gpu})
            common = sorted(set.intersection(*(set(self.profile.options[key].sm_clock_mhz.tolist()) for key in keys)),
                            reverse=True)  # fmt: skip
            if not common:
                stages = sorted({stage for stage, _ in keys})
                raise InvalidSettingError(f"stage_profile: stage(s) {stages}'s instructions share no clock; one clock "
                                          "per stage needs all of them profiled at it", argument="stage_profile")  # fmt: skip
            clocks.append(common)
        offsets = np.concatenate([[0], np.cumsum([len(c) for c in clocks])])
        n, n_y = self.dag.n, int(offsets[-1])
        cost = np.zeros(n_y)
        times = []
        owner = [self.dag.gpu_of(inst) for inst in self.dag.instructions]
        for inst, gpu in zip(self.dag.instructions, owner):
            opts = self.profile.options[(inst.stage, inst.kind)]
            index = [int(np.flatnonzero(opts.sm_clock_mhz == c)[0]) for c in clocks[gpu]]
            t = opts.time_s[index]
            if self.time_quantum_s is not None:
                t = np.floor(t / self.time_quantum_s + 1e-9) * self.time_quantum_s
            times.append(t)
            cost[offsets[gpu]:offsets[gpu + 1]] += opts.energy_j[index] - self.blocking_power_w * t
        matrix, lower, upper = self._precedence_rows(self.gpus, offsets, owner, times, n_y)
        objective = np.concatenate([cost, np.zeros(n), [self.gpus * self.blocking_power_w]])
        return clocks, offsets, PipelineModel(matrix, lower, upper, objective, n_y)

    def _deadline(self, fastest: PipelinePlan, deadline_s: float | None, max_slowdown) -> float | None:
        """The deadline (s) of plan()'s arguments, checked; None for the fastest plan."""
        if deadline_s is not None and max_slowdown is not None:
            raise InvalidSettingError("deadline_s and max_slowdown are both given; give one", argument="deadline_s")
        if max_slowdown is not None:
            from freqopt.budget import parse_slowdown

            deadline_s = fastest.time_s * (1.0 + parse_slowdown(max_slowdown))
        if deadline_s is None:
            return None
        _check_number("deadline_s", deadline_s, minimum=0.0, strict=True)
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
        if self.dag.iteration_time_s(self._durations(choice)) > deadline_s * (1 + _TOLERANCE):
            raise InvalidSettingError(f"warm_start's iteration time is above the deadline {deadline_s:.6g} s; give a "
                                      "plan within it", argument="warm_start")  # fmt: skip
        return choice

    def frontier(self, n_points: int | None = None, *, deadlines_s: Sequence[float] | None = None,
                 energy_step: float = FRONTIER_ENERGY_STEP) -> PipelineFrontier:  # fmt: skip
        """The iteration time-energy frontier, fastest first: by default every distinct plan from the fastest to
        the least-energy plan (module docstring, "The whole frontier").

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
        if n_points is not None and deadlines_s is not None:
            raise InvalidSettingError("n_points and deadlines_s are both given; give one", argument="n_points")
        _check_number("energy_step", energy_step, minimum=0.0, strict=True)
        started = _time.perf_counter()
        fastest = self.fastest()
        sweep = _Sweep(self, fastest)
        if deadlines_s is not None or n_points is not None:
            if deadlines_s is None:
                check_positive_int("n_points", n_points)
                end = sweep.solve(self.slowest_time_s())
                deadlines_s = [fastest.time_s] if n_points == 1 else \
                    list(np.linspace(fastest.time_s, end.time_s, n_points))  # fmt: skip
            points = []
            for deadline in sorted(float(d) for d in deadlines_s):
                if deadline < fastest.time_s * (1 - 1e-12):
                    raise InvalidSettingError(f"deadlines_s has {deadline:.6g} s, below the fastest plan's "
                                              f"{fastest.time_s:.6g} s; no plan meets it", argument="deadlines_s")  # fmt: skip
                sweep.solve(max(deadline, fastest.time_s))
                best = sweep.best_within(deadline)
                points.append(FrontierPoint(best.time_s, best.energy_j, sweep.bound_at(deadline), deadline,
                                            best.sm_clock_mhz))  # fmt: skip
        else:
            sweep.whole(energy_step)
            points = sweep.staircase()
        return PipelineFrontier(tuple(points), sweep.proven_gap(), len(sweep.solved),
                                _time.perf_counter() - started)  # fmt: skip

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
        matrix, lower, upper = self._precedence_rows(n, offsets, list(range(n)), times, n_x)
        objective = np.concatenate([np.concatenate(costs), np.zeros(n), [self.gpus * self.blocking_power_w]])
        self._offsets = offsets
        self._model = PipelineModel(matrix, lower, upper, objective, n_x)

    def _precedence_rows(self, n_choices: int, offsets: np.ndarray, owner: Sequence[int], times: Sequence[np.ndarray],
                         n_x: int):  # fmt: skip
        """The model's rows (module docstring) over n_x choice columns, N start times and T: one assignment row
        per choice group (group c owns columns offsets[c]:offsets[c + 1]); per DAG edge a -> b, s_b - s_a -
        sum_k times[a][k] x[owner[a], k] >= 0; per sink, the same with T. Returns (csr matrix, lower, upper)."""
        from scipy.sparse import coo_matrix

        n = self.dag.n
        s0, t_var = n_x, n_x + n
        has_successor = np.zeros(n, dtype=bool)
        has_successor[self.dag.edges[:, 0]] = True
        sinks = np.flatnonzero(~has_successor)
        rows, cols, vals = [], [], []
        for c in range(n_choices):
            k = np.arange(offsets[c], offsets[c + 1])
            rows.append(np.full(len(k), c)); cols.append(k); vals.append(np.ones(len(k)))  # noqa: E702
        r = n_choices
        for a, b in list(map(tuple, self.dag.edges)) + [(int(a), -1) for a in sinks]:
            k = np.arange(offsets[owner[a]], offsets[owner[a] + 1])
            later = t_var if b == -1 else s0 + b
            rows.append(np.full(len(k) + 2, r))
            cols.append(np.concatenate([k, [later, s0 + a]]))
            vals.append(np.concatenate([-times[a], [1.0, -1.0]]))
            r += 1
        matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(r, t_var + 1)).tocsr()  # fmt: skip
        lower = np.concatenate([np.ones(n_choices), np.zeros(r - n_choices)])
        upper = np.concatenate([np.ones(n_choices), np.full(r - n_choices, np.inf)])
        return matrix, lower, upper

    def _solve(self, deadline_s: float, fastest: PipelinePlan, warm_start: np.ndarray | None = None, *,
               polish: bool = True, extra: Sequence[np.ndarray] = ()) -> tuple[PipelinePlan, np.ndarray]:  # fmt: skip
        """The best plan found within the deadline and its option indices (module docstring, steps 1-3; step 3, the
        MILP, only with ``polish``); ``warm_start`` and ``extra`` are further plans (option indices) to start from,
        ``extra`` possibly past the deadline (repaired first)."""
        start = _time.perf_counter()
        x_lp, lower_bound = self._hull_lp(deadline_s)
        candidates = [self._round_down(x_lp, deadline_s)]
        if polish:  # the error diffusion costs the most and rarely wins among a sweep's neighbours (module docstring)
            candidates.append(self._round_dither(x_lp, deadline_s))
        candidates += [self._repair(choice, deadline_s) for choice in extra]
        if warm_start is not None:
            candidates.append(warm_start)
        chosen = min((self._reclaim(c, deadline_s) for c in candidates), key=self._cost)
        if polish and self._cost(chosen) - lower_bound > self.mip_rel_gap * abs(self._cost(chosen)):
            method = self.method
            if method == "auto":
                method = "exact" if self._offsets[-1] <= EXACT_MAX_BINARIES else "hull"
            if method == "exact":
                result = self._model.milp(deadline_s, start=self._point(chosen), time_limit_s=self.time_limit_s,
                                          mip_rel_gap=self.mip_rel_gap)  # fmt: skip
                lower_bound = max(lower_bound, result.dual_bound)
            else:
                result = self._fractional_milp(x_lp, deadline_s)
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
        plan = PipelinePlan(self.dag, clocks, time_s, energy_j, float(deadline_s), min(lower_bound, energy_j),
                            fastest.time_s, fastest.energy_j, solve_s, self)  # fmt: skip
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
        # tried: on the Perseus profiles at M = 96 it found worse plans within the time limit.
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
            result = self._model.milp(deadline_s, x_lower=lower, x_upper=upper, time_limit_s=self.time_limit_s,
                                      mip_rel_gap=self.mip_rel_gap)  # fmt: skip
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

    # The heuristic (module docstring). A plan is an int array of shape (N,): each instruction's index into its
    # (stage, kind)'s kept options, fastest first (times increasing, effective energies decreasing).
    def _choices(self, x: np.ndarray) -> np.ndarray:
        """The option each instruction takes in a MILP solution x."""
        offsets = self._offsets
        return np.asarray([int(np.argmax(x[offsets[i]:offsets[i + 1]])) for i in range(self.dag.n)], dtype=int)

    def _clocks(self, choice: np.ndarray) -> np.ndarray:
        return np.asarray([self._kept_clocks[g][k] for g, k in zip(self._group, choice)], dtype=int)

    def _durations(self, choice) -> list[float]:
        return [float(self._kept_times[g][k]) for g, k in zip(self._group, choice)]

    def _cost(self, choice) -> float:
        """The plan's energy (J) as the MILP counts it: effective energies plus S * p * its critical path."""
        effective = sum(float(self._kept_effective[g][k]) for g, k in zip(self._group, choice))
        return effective + self.gpus * self.blocking_power_w * self._graph.length(self._durations(choice))

    def _round_down(self, x_lp: np.ndarray, deadline_s: float) -> np.ndarray:
        """Each instruction's slowest kept option no slower than the LP's time for it, sum_k x[i, k] t[i, k]: every
        instruction is no slower than in the LP, whose start times then still meet the deadline; a repair pass
        speeds up what the LP's tolerance (1e-7) pushed past it."""
        offsets = self._offsets
        choice = np.empty(self.dag.n, dtype=int)
        for i, g in enumerate(self._group):
            times = self._kept_times[g]
            t_lp = float(x_lp[offsets[i]:offsets[i + 1]] @ times)
            choice[i] = max(0, int(np.searchsorted(times, t_lp * (1 + 1e-7), side="right")) - 1)
        return self._repair(choice, deadline_s)

    def _round_dither(self, x_lp: np.ndarray, deadline_s: float) -> np.ndarray:
        """The LP rounded by error diffusion: where the LP mixes a fast and a slow option of an instruction (x[i, k]
        > 0 on options lo < hi), the share of the slow one's time, a = (t_lp - t[lo]) / (t[hi] - t[lo]), accumulates
        over the micro-batches of its (stage, kind) in order, and the instruction takes hi when the sum reaches 1/2
        (then less 1), else lo: each stage's chain gets about the LP's count of slow options, at the same
        micro-batches on every stage where the LP mixes alike. Not feasible by construction: _repair follows."""
        offsets = self._offsets
        choice = np.empty(self.dag.n, dtype=int)
        carry: dict[int, float] = {}
        for i in self._by_micro_batch:
            g = self._group[i]
            share = x_lp[offsets[i]:offsets[i + 1]]
            support = np.flatnonzero(share > 1e-7)
            lo, hi = (int(support[0]), int(support[-1])) if len(support) else (0, 0)
            if lo == hi:
                choice[i] = lo
                continue
            times = self._kept_times[g]
            carry[g] = carry.get(g, 0.0) + (float(share @ times) - times[lo]) / (times[hi] - times[lo])
            choice[i] = hi if carry[g] >= 0.5 else lo
            carry[g] -= choice[i] == hi
        return self._repair(choice, deadline_s)

    def _repair(self, choice: np.ndarray, deadline_s: float) -> np.ndarray:
        """The plan made to meet the deadline: while some instruction lies on a path longer than it, speed up the
        late instruction whose faster option costs the least effective energy per second saved (a heap; the
        earliest starts and latest finishes updated after each move). Ends: every option at its fastest meets it."""
        graph, group, tol = self._graph, self._group, _TOLERANCE * max(1.0, deadline_s)
        times_of, effective_of = self._kept_times, self._kept_effective
        choice = np.asarray(choice, dtype=int).copy()
        d = self._durations(choice)
        es, lf = graph.earliest(d), graph.latest(d, deadline_s)

        def late(i):
            return es[i] + d[i] > lf[i] + tol

        def speed_up(i):  # (cost per second saved, option) of i's best faster option
            g, k = group[i], choice[i]
            rate = (effective_of[g][:k] - effective_of[g][k]) / (d[i] - times_of[g][:k])
            j = int(np.argmin(rate))
            return float(rate[j]), j

        heap = [(speed_up(i)[0], i) for i in range(self.dag.n) if late(i) and choice[i] > 0]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            if not late(i) or choice[i] == 0:
                continue
            choice[i] = speed_up(i)[1]
            d[i] = float(times_of[group[i]][choice[i]])
            graph.update(i, d, es, lf)
            if late(i) and choice[i] > 0:
                heapq.heappush(heap, (speed_up(i)[0], i))
        return choice

    def _reclaim(self, choice: np.ndarray, deadline_s: float) -> np.ndarray:
        """The plan slowed into its float (module docstring): repeatedly the move (one instruction to a slower kept
        option that fits within its total float under the deadline) that saves the most energy per second it adds,
        to a fixed point. Saving: its effective-energy drop minus S * p times what it adds to the critical path.
        Never slower than the deadline (its critical path stays at most deadline_s), never dearer than ``choice``."""
        graph, group, sp = self._graph, self._group, self.gpus * self.blocking_power_w
        times_of, effective_of = self._kept_times, self._kept_effective
        choice = [int(k) for k in choice]
        d = self._durations(choice)
        horizon, tol = deadline_s, _TOLERANCE * max(1.0, deadline_s)

        def best_move(i, es, lf, length):  # (saving per second added, option) of i's best slower option, or None
            g, k = group[i], choice[i]
            times = times_of[g]
            end = int(np.searchsorted(times, lf[i] - es[i] + tol, side="right"))  # the options within i's float
            if end <= k + 1:
                return None
            delta = times[k + 1:end] - d[i]
            change = effective_of[g][k + 1:end] - effective_of[g][k]
            if sp:  # what the move adds to the critical path: past the longest path through i, es + d + tail
                change = change + sp * np.maximum(0.0, es[i] + d[i] + horizon - lf[i] + delta - length)
            rate = -change / delta
            j = int(np.argmax(rate))
            return (float(rate[j]), k + 1 + j) if change[j] < -1e-12 else None

        while True:
            es, lf = graph.earliest(d), graph.latest(d, horizon)
            length = max(e + t for e, t in zip(es, d))
            heap = []
            for i in range(len(choice)):
                move = best_move(i, es, lf, length)
                if move is not None:
                    heap.append((-move[0], i))
            heapq.heapify(heap)
            applied = 0
            while heap:
                _, i = heapq.heappop(heap)
                move = best_move(i, es, lf, length)
                if move is None:
                    continue
                if heap and move[0] < -heap[0][0]:  # its rate fell since it was pushed: wait its turn
                    heapq.heappush(heap, (-move[0], i))
                    continue
                choice[i], d[i] = move[1], float(times_of[group[i]][move[1]])
                applied += 1
                graph.update(i, d, es, lf)
                length = max(length, es[i] + d[i] + horizon - lf[i])
                move = best_move(i, es, lf, length)
                if move is not None:
                    heapq.heappush(heap, (-move[0], i))
            if not applied:
                return np.asarray(choice, dtype=int)


class _Sweep:
    """The frontier's deadlines and the plans found at them (PipelinePlanner.frontier; module docstring)."""

    def __init__(self, planner: PipelinePlanner, fastest: PipelinePlan) -> None:
        self.planner, self.fastest = planner, fastest
        self.plans: list[tuple[PipelinePlan, np.ndarray]] = []  # every plan found, with its option indices
        self.solved: dict[float, float] = {}  # deadline (s) -> the hull LP's optimum there (J)

    def best_within(self, deadline_s: float, *, with_choice: bool = False):
        """The least-energy plan found whose time is at most deadline_s (None if none)."""
        best = None
        for plan, choice in self.plans:
            if plan.time_s <= deadline_s * (1 + 1e-12) and (best is None or plan.energy_j < best[0].energy_j):
                best = (plan, choice)
        return best if with_choice else (best[0] if best else None)

    def bound_at(self, deadline_s: float) -> float:
        """The best proven lower bound at deadline_s: the LP's optimum at the smallest solved deadline >= it."""
        later = [d for d in self.solved if d >= deadline_s * (1 - 1e-12)]
        return self.solved[min(later)] if later else -math.inf

    def solve(self, deadline_s: float) -> PipelinePlan:
        """Plan at deadline_s from the LP, the best plan already within it, and the next slower plan repaired."""
        found = self.best_within(deadline_s, with_choice=True)
        slower = [(p.time_s, c) for p, c in self.plans if p.time_s > deadline_s]
        extra = [min(slower, key=lambda pc: pc[0])[1]] if slower else []
        plan, choice = self.planner._solve(deadline_s, self.fastest, None if found is None else found[1],
                                           polish=False, extra=extra)  # fmt: skip
        self.plans.append((plan, choice))
        self.solved[deadline_s] = plan.lower_bound_j
        return plan

    def whole(self, energy_step: float) -> None:
        """Every distinct plan from the fastest to the least-energy one: bisect each pair of solved deadlines whose
        best plans' energies, or whose LP bounds, differ by more than energy_step (relative), down to a time
        resolution of _FRONTIER_TIME_RESOLUTION of the fastest time."""
        t0 = self.fastest.time_s
        self.solve(t0)
        end = self.solve(self.planner.slowest_time_s())
        resolution = _FRONTIER_TIME_RESOLUTION * t0
        if end.time_s > t0 + resolution and end.time_s not in self.solved:
            self.solve(end.time_s)

        def steep(lo: float, hi: float) -> bool:
            low = self.best_within(hi).energy_j
            bound_drop = self.solved[lo] - self.solved[hi]
            return hi - lo > resolution and max(self.best_within(lo).energy_j - low, bound_drop) > energy_step * low

        while True:  # a plan found later can lower an earlier pair's slower end: re-check every pair until none
            deadlines = [d for d in sorted(self.solved) if d <= end.time_s]
            stack = [(lo, hi) for lo, hi in zip(deadlines, deadlines[1:]) if steep(lo, hi)][::-1]
            if not stack:
                return
            while stack:
                lo, hi = stack.pop()
                if not steep(lo, hi):
                    continue
                mid = 0.5 * (lo + hi)
                self.solve(mid)
                stack += [(mid, hi), (lo, mid)]  # the faster half first: its plans warm-start the slower half

    def staircase(self) -> list[FrontierPoint]:
        """The distinct plans of the staircase, fastest first, each strictly cheaper than every faster one."""
        points: list[FrontierPoint] = []
        for plan, _ in sorted(self.plans, key=lambda pc: (pc[0].time_s, pc[0].energy_j)):
            if points and plan.energy_j >= points[-1].energy_j * (1 - 1e-12):
                continue
            if points and plan.time_s <= points[-1].time_s:
                points.pop()
            points.append(FrontierPoint(plan.time_s, plan.energy_j, self.bound_at(plan.time_s),
                                        float(plan.deadline_s), plan.sm_clock_mhz))  # fmt: skip
        return points

    def proven_gap(self) -> float:
        """PipelineFrontier.proven_gap over the solved deadlines."""
        deadlines = sorted(self.solved)
        gap = 0.0
        for lo, hi in zip(deadlines, deadlines[1:] + [None]):
            best = self.best_within(lo)
            bound = self.solved[hi if hi is not None else lo]
            if best is not None and best.energy_j > 0:
                gap = max(gap, (best.energy_j - bound) / best.energy_j)
        return gap


class _Graph:
    """The instruction DAG as adjacency lists, with its forward and backward passes (plain Python: at N = 1536 one
    pass takes about a millisecond, less than numpy's per-call overhead on the few predecessors of each node)."""

    def __init__(self, dag: PipelineDAG) -> None:
        self.succ: list[list[int]] = [[] for _ in range(dag.n)]
        self.pred: list[list[int]] = [[] for _ in range(dag.n)]
        for a, b in dag.edges.tolist():
            self.succ[a].append(b)
            self.pred[b].append(a)
        self.order = dag.order.tolist()
        self.rank = [0] * dag.n  # each node's position in the topological order
        for position, node in enumerate(self.order):
            self.rank[node] = position

    def earliest(self, d: Sequence[float]) -> list[float]:
        """Each instruction's earliest start (s) given the durations d (s)."""
        es = [0.0] * len(d)
        for j in self.order:
            for p in self.pred[j]:
                es[j] = max(es[j], es[p] + d[p])
        return es

    def length(self, d: Sequence[float]) -> float:
        """The critical path (s) with durations d (s)."""
        return max(e + t for e, t in zip(self.earliest(d), d))

    def update(self, i: int, d: Sequence[float], es: list[float], lf: list[float]) -> None:
        """Update earliest starts es and latest finishes lf (in place) after instruction i's duration d[i] changed:
        each node after i is recomputed from all its predecessors, at most once and in topological order (its
        predecessors first), and only where a neighbour's value changed; likewise each node before i from its
        successors, in reverse order."""
        rank, pred, succ = self.rank, self.pred, self.succ
        heap = [(rank[v], v) for v in succ[i]]
        queued = set(succ[i])
        heapq.heapify(heap)
        while heap:
            _, v = heapq.heappop(heap)
            start = max(es[p] + d[p] for p in pred[v])
            if start != es[v]:
                es[v] = start
                for w in succ[v]:
                    if w not in queued:
                        queued.add(w)
                        heapq.heappush(heap, (rank[w], w))
        heap = [(-rank[p], p) for p in pred[i]]
        queued = set(pred[i])
        heapq.heapify(heap)
        while heap:
            _, p = heapq.heappop(heap)
            finish = min(lf[s] - d[s] for s in succ[p])
            if finish != lf[p]:
                lf[p] = finish
                for q in pred[p]:
                    if q not in queued:
                        queued.add(q)
                        heapq.heappush(heap, (-rank[q], q))

    def latest(self, d: Sequence[float], horizon_s: float) -> list[float]:
        """Each instruction's latest finish (s) for the iteration to end by horizon_s."""
        lf = [horizon_s] * len(d)
        for i in reversed(self.order):
            for s in self.succ[i]:
                lf[i] = min(lf[i], lf[s] - d[s])
        return lf


def plan_pipeline(profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                  max_slowdown: float | str | None = None, deadline_s: float | None = None,
                  blocking_power_w: float | None = None, gpu: str | None = None, schedule: str = "1f1b",
                  time_quantum_s: float | None = None,
                  mip_rel_gap: float = 1e-5, time_limit_s: float | None = None,
                  method: str = "auto") -> PipelinePlan:  # fmt: skip
    """The least-energy clock per instruction of a pipeline iteration within a deadline (module docstring).

    Args: as PipelinePlanner's, and PipelinePlanner.plan's ``deadline_s`` or ``max_slowdown`` (neither: the fastest
    plan). The result's ``frontier(n_points)`` gives the whole time-energy frontier.

    Raises:
        InvalidSettingError: a bad argument or stage profile (the argument's name first).
        FreqoptError: the solver failed.
    """
    planner = PipelinePlanner(profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w, gpu=gpu,
                              schedule=schedule, time_quantum_s=time_quantum_s, mip_rel_gap=mip_rel_gap,
                              time_limit_s=time_limit_s, method=method)  # fmt: skip
    return planner.plan(deadline_s, max_slowdown=max_slowdown)


def blocking_power_w_for(blocking_power_w: float | None, gpu: str | None) -> float:
    """The blocking power (W) to plan with: ``blocking_power_w`` if given, else the measured figure of ``gpu``
    (MEASURED_BLOCKING_POWER_W).

    Raises:
        InvalidSettingError: gpu is not a known GPU (argument ``gpu``); neither is given, or the GPU has no measured
            figure (argument ``blocking_power_w``): waiting is not free, so the planner does not guess it.
    """
    if blocking_power_w is not None:
        _check_number("blocking_power_w", blocking_power_w, minimum=0.0)
        return float(blocking_power_w)
    if gpu is not None:
        from freqopt.gpu.specs import list_gpus

        if gpu not in list_gpus():
            raise InvalidSettingError(f"gpu {gpu!r} is unknown; known: {', '.join(list_gpus())}", argument="gpu")
        if gpu in MEASURED_BLOCKING_POWER_W:
            return MEASURED_BLOCKING_POWER_W[gpu]
    known = ", ".join(f"{name} {watts} W" for name, watts in MEASURED_BLOCKING_POWER_W.items())
    where = f"no measured figure for {gpu}" if gpu else "no gpu named"
    raise InvalidSettingError(f"blocking_power_w is required ({where}): give the power (W) a GPU draws while it waits "
                              f"on its pipeline neighbours, or a gpu with a measured one ({known})",
                              argument="blocking_power_w")  # fmt: skip


def _check_number(name: str, value, *, minimum: float, strict: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and (value > minimum if strict else value >= minimum):
        return
    relation = ">" if strict else ">="
    raise InvalidSettingError(f"{name} must be a finite number {relation} {minimum:g}, not {value!r}", argument=name)
