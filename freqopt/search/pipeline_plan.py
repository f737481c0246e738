"""One SM clock per pipeline instruction, planned exactly: a measured stage profile in, the plan and the frontier out.

A stage profile (``load_stage_profile``) holds, for every pipeline stage and instruction kind (forward, backward),
the time (s) and energy (J) of one instruction at each locked SM clock (MHz), as Perseus (Chung et al., SOSP'24)
and Zeus write them: CSV columns ``stage, instruction, frequency, time, energy``.

The planner (``PipelinePlanner``, ``plan_pipeline``) chooses one clock per instruction of a 1F1B iteration
(freqopt.search.pipeline) to minimize the iteration's energy subject to its time (the DAG's critical path) being at
most a deadline. The energy is Perseus's accounting (freqopt.search.pipeline): the instructions' own energies plus a
constant P2P-blocking power for every GPU-second spent outside an instruction. Written with each option's
*effective* energy e' = energy - blocking_power_w * time, the iteration's energy is sum_i e'_i + S * p * T, so:

Dominated clocks. An option is dropped when another option of the same instruction is no slower and has no higher
effective energy (it can never make the iteration slower nor dearer). With blocking power p > 0 this keeps slow
clocks that the plain (time, energy) Pareto filter drops: running slower instead of waiting at p may cost less.

The exact planner: a mixed-integer linear program, solved by HiGHS through ``scipy.optimize.milp``. Variables: one
binary x[i, k] per instruction i and kept option k (sum_k x[i, k] = 1), a start time s_i >= 0 per instruction, the
iteration time T <= deadline. Constraints: s_j >= s_i + sum_k t[i, k] x[i, k] for every DAG edge i -> j, and
T >= s_i + sum_k t[i, k] x[i, k] for every instruction without successor. Objective: sum_{i,k} e'[i, k] x[i, k]
+ S p T. Every assignment of clocks with critical path <= deadline is feasible for it (start every instruction at
its earliest start), and every feasible point is such an assignment, so the MILP's optimum is the problem's
optimum; T is pushed down to the critical path by its positive cost (p > 0) and is set to it afterwards otherwise.
HiGHS stops when its proven relative gap (incumbent - dual bound) / incumbent is at most ``mip_rel_gap`` (default
1e-5): the plan returned is within that fraction of the optimum, and ``PipelinePlan.lower_bound_j`` holds the proven
bound. The LP relaxation of this multiple-choice formulation is the lower convex hull of each instruction's options,
which is tight on these profiles (dense clocks, convex-ish curves), so HiGHS closes the gap quickly (timings in
experiments/perseus/report.md).

Time quantum. ``time_quantum_s`` floors every instruction's time to a multiple of it before planning, as Perseus's
planner does (``ExecutionOption.quant_time = real_time // unit_time``, lowtime/lowtime/operation.py, branch
``kronos`` of github.com/ml-energy/zeus); it exists to compare with Perseus's frontiers on their own time axis. The
default (None) plans on the measured times.
"""

from __future__ import annotations

import csv
import math
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freqopt.errors import FreqoptError, InvalidSettingError, check_positive_int
from freqopt.search.allocate import quiet_native_stdout
from freqopt.search.pipeline import KINDS, SCHEDULES, PipelineDAG, one_f_one_b

__all__ = ["InstructionOptions", "StageProfile", "load_stage_profile", "stage_profile_from_rows", "PipelinePlan",
           "PipelinePlanner", "FrontierPoint", "plan_pipeline", "PROFILE_COLUMNS"]  # fmt: skip

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
METHODS = ("auto", "exact", "hull")
# "auto" solves the whole MILP ("exact") up to this many option binaries (a few dozen instructions), else "hull".
EXACT_MAX_BINARIES = 1500
# The "hull" method's limit (s) on its MILP over the fractional instructions, unless time_limit_s says otherwise.
HULL_TIME_LIMIT_S = 10.0


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
    ("forward", "backward").

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
        if kind not in KINDS:
            raise _profile_error(source, f"row {line}: instruction {row['instruction']!r} is not forward or backward")
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
        for kind in KINDS:
            entries = grouped.get((stage, kind))
            if not entries:
                raise _profile_error(source, f"stage {stage} has no {kind} rows; profile every stage 0..{stages - 1} "
                                             "forward and backward")  # fmt: skip
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
        dag: the instruction DAG (freqopt.search.pipeline.PipelineDAG); arrays below follow dag.instructions.
        sm_clock_mhz: the SM clock (MHz) of each instruction, int array of shape (N,).
        time_s: the iteration time (s): the critical path with those clocks.
        energy_j: the iteration's energy (J), Perseus's accounting.
        deadline_s: the deadline it was planned for (s), or None for the fastest plan.
        lower_bound_j: HiGHS's proven lower bound (J) on the energy of any plan within the deadline; energy_j
            itself where the plan is optimal by construction (the fastest plan).
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

    def frontier(self, n_points: int = 20) -> list[FrontierPoint]:
        """The iteration time-energy frontier of the same pipeline (PipelinePlanner.frontier)."""
        if self.planner is None:
            raise InvalidSettingError("this plan carries no planner; call PipelinePlanner.frontier")
        return self.planner.frontier(n_points=n_points)


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the time-energy frontier: the best plan found within ``deadline_s``.

    Attributes:
        time_s: the plan's iteration time (s), at most deadline_s.
        energy_j: its energy (J).
        lower_bound_j: the proven lower bound (J) on any plan's energy within deadline_s.
        deadline_s: the deadline (s).
    """

    time_s: float
    energy_j: float
    lower_bound_j: float
    deadline_s: float


class PipelinePlanner:
    """The exact clock planner of one pipeline (module docstring): a stage profile, a schedule, a blocking power.

    Args:
        profile: the measured stage profile (StageProfile or a path to its CSV).
        stages: S, the pipeline's stages; default the profile's; must be the profile's.
        micro_batches: M, micro-batches per iteration (a positive integer).
        blocking_power_w: the power (W) each GPU draws while it waits (Perseus: 83.64 W on an A100 SXM, 70.38 W on
            an A40, measured on P2P-blocked GPUs, lowtime/scripts/perseus.py); 0 counts waiting as free.
        schedule: the pipeline schedule; only "1f1b".
        time_quantum_s: floor every instruction's time to a multiple of this (s) before planning (module
            docstring), or None.
        mip_rel_gap: HiGHS's relative optimality gap at which a solve stops (default 1e-5).
        time_limit_s: wall-clock limit (s) of one MILP solve, or None (no limit for "exact", HULL_TIME_LIMIT_S for
            "hull"); on timeout the best plan found is returned with its proven bound (PipelinePlan.gap).
        method: "exact" (the whole MILP), "hull" (the hull LP's bound, then the MILP on its fractional
            instructions; module docstring) or "auto" ("exact" up to EXACT_MAX_BINARIES option binaries).

    Raises:
        InvalidSettingError: a bad argument (its name first), or a profile whose stage count is not ``stages``.
    """

    def __init__(self, profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                 blocking_power_w: float = 0.0, schedule: str = "1f1b", time_quantum_s: float | None = None,
                 mip_rel_gap: float = 1e-5, time_limit_s: float | None = None, method: str = "auto") -> None:  # fmt: skip
        if method not in METHODS:
            raise InvalidSettingError(f"method {method!r} is unknown; known: {', '.join(METHODS)}", argument="method")
        self.method = method
        if not isinstance(profile, StageProfile):
            profile = load_stage_profile(profile)
        check_positive_int("micro_batches", micro_batches)
        check_positive_int("stages", stages, optional=True)
        if stages is not None and stages != profile.stages:
            raise InvalidSettingError(f"stages {stages} is not the stage profile's {profile.stages} stages; plan the "
                                      "pipeline that was profiled", argument="stages")  # fmt: skip
        if schedule not in SCHEDULES:
            raise InvalidSettingError(f"schedule {schedule!r} is unknown; known: {', '.join(SCHEDULES)}",
                                      argument="schedule")  # fmt: skip
        _check_number("blocking_power_w", blocking_power_w, minimum=0.0)
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
        self.time_limit_s = time_limit_s
        self.dag = one_f_one_b(self.stages, micro_batches)
        # Each (stage, kind)'s kept options, fastest first: clocks, times (quantized if asked), energies.
        self._options: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, opts in profile.options.items():
            times = opts.time_s
            if time_quantum_s is not None:
                times = np.floor(times / time_quantum_s + 1e-9) * time_quantum_s
            quantized = InstructionOptions(opts.sm_clock_mhz, times, opts.energy_j)
            kept = quantized.non_dominated(self.blocking_power_w)
            self._options[key] = (opts.sm_clock_mhz[kept], times[kept], opts.energy_j[kept])
        self._model = None

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

    def plan(self, deadline_s: float | None = None, *, max_slowdown: float | str | None = None) -> PipelinePlan:
        """The least-energy plan whose iteration time is at most the deadline.

        Args:
            deadline_s: the deadline (s); or
            max_slowdown: the deadline as a slowdown of the fastest plan's time (0.01, "1%";
                freqopt.budget.parse_slowdown). Give exactly one of the two; neither plans the fastest plan.

        Returns:
            A PipelinePlan, optimal within mip_rel_gap (its lower_bound_j is HiGHS's proven bound).

        Raises:
            InvalidSettingError: both or a bad value; a deadline below the fastest plan's time (nothing meets it).
            FreqoptError: HiGHS failed (the message says how).
        """
        fastest = self.fastest()
        if deadline_s is not None and max_slowdown is not None:
            raise InvalidSettingError("deadline_s and max_slowdown are both given; give one", argument="deadline_s")
        if max_slowdown is not None:
            from freqopt.budget import parse_slowdown

            deadline_s = fastest.time_s * (1.0 + parse_slowdown(max_slowdown))
        if deadline_s is None:
            return fastest
        _check_number("deadline_s", deadline_s, minimum=0.0, strict=True)
        if deadline_s < fastest.time_s * (1 - 1e-12):
            raise InvalidSettingError(f"deadline_s {deadline_s:.6g} s is below the fastest plan's "
                                      f"{fastest.time_s:.6g} s; no plan meets it", argument="deadline_s")  # fmt: skip
        return self._solve(max(deadline_s, fastest.time_s), fastest)

    def frontier(self, n_points: int = 20, *, deadlines_s: Sequence[float] | None = None) -> list[FrontierPoint]:
        """The iteration time-energy frontier: the least energy at each deadline, fastest first.

        Args:
            n_points: deadlines evenly spaced from the fastest plan's time to slowest_time_s() (ends included).
            deadlines_s: these deadlines (s) instead (each at least the fastest plan's time).

        Returns:
            One FrontierPoint per deadline, in increasing deadline; energies are non-increasing (a plan within a
            deadline is within every later one, so a later point never keeps a dearer plan).
        """
        fastest = self.fastest()
        if deadlines_s is None:
            check_positive_int("n_points", n_points)
            slowest = self.slowest_time_s()
            deadlines_s = [fastest.time_s] if n_points == 1 else list(np.linspace(fastest.time_s, slowest, n_points))
        points: list[FrontierPoint] = []
        best: PipelinePlan | None = None
        for deadline in sorted(deadlines_s):
            plan = self.plan(deadline)
            if best is None or plan.energy_j < best.energy_j:
                best = plan
            points.append(FrontierPoint(best.time_s, best.energy_j, plan.lower_bound_j, float(deadline)))
        return points

    # The MILP (module docstring). Variables: x (one per instruction and kept option), s (N), T.
    def _build(self):
        from scipy.sparse import coo_matrix

        n = self.dag.n
        offsets = np.zeros(n + 1, dtype=int)
        times: list[np.ndarray] = []
        costs: list[np.ndarray] = []
        for i, inst in enumerate(self.dag.instructions):
            _, t, e = self._options[(inst.stage, inst.kind)]
            times.append(t)
            costs.append(e - self.blocking_power_w * t)
            offsets[i + 1] = offsets[i] + len(t)
        n_x = int(offsets[-1])
        s0, t_var = n_x, n_x + n
        n_var = t_var + 1
        has_successor = np.zeros(n, dtype=bool)
        has_successor[self.dag.edges[:, 0]] = True
        sinks = np.flatnonzero(~has_successor)
        rows, cols, vals = [], [], []
        # Assignment rows: sum_k x[i, k] = 1.
        for i in range(n):
            k = np.arange(offsets[i], offsets[i + 1])
            rows.append(np.full(len(k), i)); cols.append(k); vals.append(np.ones(len(k)))  # noqa: E702
        r = n
        # Precedence rows: s_b - s_a - sum_k t[a, k] x[a, k] >= 0 (and T - s_a - ... >= 0 for sinks).
        for a, b in list(map(tuple, self.dag.edges)) + [(int(a), -1) for a in sinks]:
            k = np.arange(offsets[a], offsets[a + 1])
            later = t_var if b == -1 else s0 + b
            rows.append(np.full(len(k) + 2, r))
            cols.append(np.concatenate([k, [later, s0 + a]]))
            vals.append(np.concatenate([-times[a], [1.0, -1.0]]))
            r += 1
        matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(r, n_var)).tocsr()  # fmt: skip
        lower = np.concatenate([np.ones(n), np.zeros(r - n)])
        upper = np.concatenate([np.ones(n), np.full(r - n, np.inf)])
        objective = np.concatenate([np.concatenate(costs), np.zeros(n), [self.stages * self.blocking_power_w]])
        integrality = np.concatenate([np.ones(n_x), np.zeros(n + 1)])
        self._model = (matrix, lower, upper, objective, integrality, offsets, n_var, t_var)

    def _solve(self, deadline_s: float, fastest: PipelinePlan) -> PipelinePlan:
        from scipy.optimize import Bounds, LinearConstraint, milp

        if self._model is None:
            self._build()
        matrix, lower, upper, objective, integrality, offsets, n_var, t_var = self._model
        constraints = LinearConstraint(matrix, lower, upper)
        var_lower = np.zeros(n_var)
        var_upper = np.ones(n_var)
        var_upper[offsets[-1]:] = deadline_s  # start times and T
        method = self.method
        if method == "auto":
            method = "exact" if offsets[-1] <= EXACT_MAX_BINARIES else "hull"
        start = _time.perf_counter()
        if method == "exact":
            options = {"mip_rel_gap": self.mip_rel_gap, "disp": False}
            if self.time_limit_s is not None:
                options["time_limit"] = self.time_limit_s
            with quiet_native_stdout():
                result = milp(objective, constraints=constraints, integrality=integrality,
                              bounds=Bounds(var_lower, var_upper), options=options)  # fmt: skip
            x = _solution(result, deadline_s)
            bound = getattr(result, "mip_dual_bound", None)
            lower_bound = float(bound) if bound is not None and np.isfinite(bound) else float(result.fun)
        else:
            # The hull LP: its optimum bounds every plan's energy from below.
            with quiet_native_stdout():
                relaxed = milp(objective, constraints=constraints, integrality=np.zeros(n_var),
                               bounds=Bounds(var_lower, var_upper), options={"disp": False})  # fmt: skip
            x_lp = _solution(relaxed, deadline_s)
            lower_bound = float(relaxed.fun)
            # The MILP on the instructions the LP left fractional; the others keep the LP's option (freeing their DAG
            # neighbours too was tried: on the Perseus profiles at M = 96 it found worse plans within the time limit).
            share = np.array([np.max(x_lp[offsets[i]:offsets[i + 1]]) for i in range(self.dag.n)])
            options = {"mip_rel_gap": self.mip_rel_gap, "disp": False,
                       "time_limit": self.time_limit_s if self.time_limit_s is not None else HULL_TIME_LIMIT_S}
            x = None
            # Fixing an option the LP took at 1 - 1e-7 can leave no room within the deadline (the LP's tolerance):
            # then free more (share below 1 - 1e-3 and their DAG neighbours), then everything (the whole MILP).
            for attempt in range(3):
                free = share < 1 - (1e-6 if attempt == 0 else 1e-3)
                if attempt == 1:
                    edges = self.dag.edges
                    grown = free.copy()
                    grown[edges[free[edges[:, 0]], 1]] = True
                    grown[edges[free[edges[:, 1]], 0]] = True
                    free = grown
                elif attempt == 2:
                    free[:] = True
                fixed_lower, fixed_upper = var_lower.copy(), var_upper.copy()
                for i in np.flatnonzero(~free):
                    k = offsets[i] + int(np.argmax(x_lp[offsets[i]:offsets[i + 1]]))
                    fixed_upper[offsets[i]:offsets[i + 1]] = 0.0
                    fixed_lower[k] = fixed_upper[k] = 1.0
                with quiet_native_stdout():
                    result = milp(objective, constraints=constraints, integrality=integrality,
                                  bounds=Bounds(fixed_lower, fixed_upper), options=options)  # fmt: skip
                if result.x is not None:
                    x = result.x
                    break
            if x is None:  # no MILP solution within the time limit: the fastest plan meets every deadline
                return PipelinePlan(self.dag, fastest.sm_clock_mhz, fastest.time_s, fastest.energy_j,
                                    float(deadline_s), min(lower_bound, fastest.energy_j), fastest.time_s,
                                    fastest.energy_j, _time.perf_counter() - start, self)  # fmt: skip
        solve_s = _time.perf_counter() - start
        clocks = np.empty(self.dag.n, dtype=int)
        for i, inst in enumerate(self.dag.instructions):
            k = int(np.argmax(x[offsets[i]:offsets[i + 1]]))
            clocks[i] = self._options[(inst.stage, inst.kind)][0][k]
        time_s, energy_j = self.evaluate(clocks)
        return PipelinePlan(self.dag, clocks, time_s, energy_j, float(deadline_s), min(lower_bound, energy_j),
                            fastest.time_s, fastest.energy_j, solve_s, self)  # fmt: skip


def _solution(result, deadline_s: float) -> np.ndarray:
    if result.x is None:
        raise FreqoptError(f"the pipeline planner (HiGHS) found no plan within {deadline_s:.6g} s: {result.message}")
    return result.x


def plan_pipeline(profile: StageProfile | str | Path, micro_batches: int, *, stages: int | None = None,
                  max_slowdown: float | str | None = None, deadline_s: float | None = None,
                  blocking_power_w: float = 0.0, schedule: str = "1f1b", time_quantum_s: float | None = None,
                  mip_rel_gap: float = 1e-5, time_limit_s: float | None = None,
                  method: str = "auto") -> PipelinePlan:  # fmt: skip
    """The least-energy clock per instruction of a pipeline iteration within a deadline (module docstring).

    Args: as PipelinePlanner's, and PipelinePlanner.plan's ``deadline_s`` or ``max_slowdown`` (neither: the fastest
    plan). The result's ``frontier(n_points)`` gives the whole time-energy frontier.

    Raises:
        InvalidSettingError: a bad argument or stage profile (the argument's name first).
        FreqoptError: the solver failed.
    """
    planner = PipelinePlanner(profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w,
                              schedule=schedule, time_quantum_s=time_quantum_s, mip_rel_gap=mip_rel_gap,
                              time_limit_s=time_limit_s, method=method)  # fmt: skip
    return planner.plan(deadline_s, max_slowdown=max_slowdown)


def _check_number(name: str, value, *, minimum: float, strict: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and (value > minimum if strict else value >= minimum):
        return
    relation = ">" if strict else ">="
    raise InvalidSettingError(f"{name} must be a finite number {relation} {minimum:g}, not {value!r}", argument=name)
