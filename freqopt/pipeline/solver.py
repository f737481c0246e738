"""The pipeline planner's linear programs, solved by HiGHS through its own Python interface (highspy).

One model, built once per planner (freqopt.pipeline.planner): variables x[i, k] (instruction i takes its kept
option k), a start time s_i per instruction and the iteration time T; rows sum_k x[i, k] = 1, one precedence row per
DAG edge and one per sink. A deadline D is the upper bound of every start time and of T, so moving along the
time-energy frontier changes only column bounds:

- ``lp(deadline_s)``: the hull LP (x relaxed to [0, 1]). The model stays in one ``highspy.Highs`` whose simplex basis
  is kept between calls, so a nearby deadline is re-solved from the last optimal basis (a hot start: on Perseus's
  BLOOM A100 profile at M = 96, 1,536 instructions x 29 options, a few to a few hundred dual simplex iterations and
  10-170 ms, where a cold solve takes 19,120 iterations and 1.2 s, on a 2-core CPU machine).
- ``milp(deadline_s, fixed=..., start=...)``: the MILP, optionally with some instructions fixed to one option, a
  feasible start (HiGHS's ``setSolution``), a node limit (HiGHS's ``mip_max_nodes``), a relative gap and, only if
  the caller asks, a time limit; its incumbent, its proven dual bound and why it stopped come back.

Every limit that decides a result is one of work (simplex iterations, branch-and-bound nodes), never of wall time,
so a plan is the same on a loaded machine as on an idle one: HiGHS's simplex and its MIP search are deterministic
for the same model and options (its MIP's parallel tasks are made deterministic by design; checked in
tests/test_pipeline_plan.py). A wall-clock limit runs only where a user sets one, and a result it cut short says so
(``MilpResult.stopped_by``).

Every solve runs in HiGHS's solver thread (``Highs.startSolve``) while this thread waits in short slices, so Ctrl-C
(KeyboardInterrupt) reaches Python within 0.1 s: the solve is cancelled through HiGHS's user-interrupt callback
(``Highs.cancelSolve``), and the KeyboardInterrupt is raised again once HiGHS has stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.errors import FreqoptError
from freqopt.pipeline.dag import PipelineDAG
from freqopt.search.allocate import quiet_native_stdout

__all__ = ["PipelineModel", "MilpResult", "precedence_rows", "DEFAULT_NODE_LIMIT", "LP_ITERATION_LIMIT"]

# How long (s) one wait for the solver thread lasts before Python looks at signals again.
_POLL_S = 0.05
# The hull LP's simplex iteration limit: a cold solve of Perseus's largest case (M = 96, 44,000 columns) takes 19,120
# iterations (about a second; module docstring), so a limit 50 times that reached means something is wrong, and is
# said so rather than waited on. A limit of work, not of time: the same on any machine.
LP_ITERATION_LIMIT = 1_000_000
# The branch-and-bound nodes of one planner MILP solve (the whole MILP for "exact", the fractional instructions' for
# "hull"; freqopt.pipeline.planner) unless its node_limit says otherwise: a limit of work, so a plan does not depend
# on the machine's speed or load. On a 2-core CPU machine beside a test run, the small smooth case of
# tests/test_pipeline_plan.py (smooth_profile: 4 stages, 22 clocks, 2 %) at 6 and 8 micro-batches takes 7 and 13 s
# to 100 nodes (proven gap 0.090 % and 0.135 %, from the heuristic's 0.145 % and 0.191 %) and 10 and 19 s to 1,000
# (0.079 %, 0.134 %); BLOOM/A100 at M = 12 and 2 % takes 25 s to 100 nodes and 42 s to 1,000, for the same plan.
DEFAULT_NODE_LIMIT = 100
# How long (s) a Ctrl-C waits for HiGHS to stop before it reaches the caller anyway.
_CANCEL_WAIT_S = 0.3


# HiGHS's model status when a limit, not the gap, ended a MILP, in words (Highs.modelStatusToString): the node limit
# (mip_max_nodes) reports the solution-limit status, the only solution-type limit freqopt sets.
_STOPPED_BY = {"Solution limit reached": "node limit", "Time limit reached": "time limit"}


@dataclass(frozen=True)
class MilpResult:
    """A MILP solve's outcome: ``x`` the incumbent (None when HiGHS found none), ``dual_bound`` its proven lower
    bound on the objective (J; -inf when none), ``status`` HiGHS's model status in words, ``nodes`` the
    branch-and-bound nodes it searched."""

    x: np.ndarray | None
    dual_bound: float
    status: str
    nodes: int = 0

    @property
    def stopped_by(self) -> str | None:
        """"node limit" or "time limit" where that limit ended the solve before its gap was proven; else None."""
        return _STOPPED_BY.get(self.status)


def _highs():
    import highspy

    with quiet_native_stdout():  # the first Highs() of a process prints HiGHS's banner to fd 1
        h = highspy.Highs()
    h.silent()
    h.setOptionValue("output_flag", False)
    h.HandleUserInterrupt = True  # enables the interrupt callbacks that cancelSolve uses
    return h


def _run(h) -> None:
    """Solve in HiGHS's thread, waking every _POLL_S for signals. On KeyboardInterrupt: cancel (HiGHS's MIP can take
    over a second to notice), wait at most _CANCEL_WAIT_S, and re-raise; a solve still stopping then ends in its
    daemon thread, and the next solve on the same model waits for it. Stray lines HiGHS's MIP solver prints to fd 1
    despite output_flag are silenced (quiet_native_stdout)."""
    while h.is_solver_running():  # a solve cancelled by an earlier Ctrl-C, still stopping
        h.wait(_POLL_S)
    with quiet_native_stdout():
        h.startSolve()
        try:
            while not h.wait(_POLL_S)[0]:
                pass
        except KeyboardInterrupt:
            h.cancelSolve()
            h.wait(_CANCEL_WAIT_S)
            raise


class PipelineModel:
    """The planner's LP/MILP (module docstring) over ``n_x`` option columns, ``n`` start times and T.

    Args:
        matrix: the constraint matrix (scipy sparse, rows x (n_x + n + 1)).
        row_lower, row_upper: its row bounds (np.inf for none).
        cost: the objective per column (J per unit): effective energies, zeros for start times, S * p for T.
        n_x: the number of option columns (they come first and are the integer ones in the MILP).
    """

    def __init__(self, matrix, row_lower: np.ndarray, row_upper: np.ndarray, cost: np.ndarray, n_x: int) -> None:
        import highspy

        self._inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        n_var = matrix.shape[1]
        lp.num_col_, lp.num_row_ = n_var, matrix.shape[0]
        lp.col_cost_ = np.asarray(cost, dtype=float)
        lp.col_lower_ = np.zeros(n_var)
        lp.col_upper_ = np.ones(n_var)
        lp.row_lower_ = np.where(np.isinf(row_lower), -self._inf, row_lower)
        lp.row_upper_ = np.where(np.isinf(row_upper), self._inf, row_upper)
        csc = matrix.tocsc()
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = csc.indptr
        lp.a_matrix_.index_ = csc.indices
        lp.a_matrix_.value_ = csc.data
        self._lp_model = lp
        self.n_x, self.n_var = n_x, n_var
        self._times = np.arange(n_x, n_var, dtype=np.int32)  # the start-time columns and T
        self._lp = None  # made at the first lp() call: a model used only for MILPs (the stage clocks) has none
        self._lp_deadline: float | None = None

    def _set_deadline(self, h, deadline_s: float) -> None:
        k = len(self._times)
        h.changeColsBounds(k, self._times, np.zeros(k), np.full(k, float(deadline_s)))

    def lp(self, deadline_s: float) -> tuple[np.ndarray, float]:
        """The hull LP at this deadline, hot-started from the last call's basis: (x over all columns, optimum J).

        Raises:
            FreqoptError: HiGHS did not reach an optimum within LP_ITERATION_LIMIT (the message gives its status).
            KeyboardInterrupt: Ctrl-C during the solve (HiGHS stopped first).
        """
        if self._lp is None:
            self._lp = _highs()
            self._lp.passModel(self._lp_model)
            self._lp.setOptionValue("simplex_iteration_limit", LP_ITERATION_LIMIT)
        if self._lp_deadline != deadline_s:
            self._set_deadline(self._lp, deadline_s)
            self._lp_deadline = deadline_s
        _run(self._lp)
        status = self._lp.modelStatusToString(self._lp.getModelStatus())
        if status != "Optimal":
            raise FreqoptError(f"the pipeline planner's LP (HiGHS) found no optimum for the deadline {deadline_s:.6g} s "
                               f"(limit {LP_ITERATION_LIMIT:,} simplex iterations): {status}")  # fmt: skip
        return np.asarray(self._lp.getSolution().col_value), float(self._lp.getInfo().objective_function_value)

    def milp(self, deadline_s: float, *, x_lower: np.ndarray | None = None, x_upper: np.ndarray | None = None,
             start: np.ndarray | None = None, node_limit: int, mip_rel_gap: float,
             time_limit_s: float | None = None) -> MilpResult:  # fmt: skip
        """The MILP at this deadline.

        Args:
            deadline_s: the deadline (s).
            x_lower, x_upper: bounds of the option columns (shape (n_x,)), to fix some instructions' options; None:
                [0, 1].
            start: a feasible point (all columns, shape (n_var,)) HiGHS starts from, or None.
            node_limit: HiGHS's branch-and-bound node limit (``mip_max_nodes``); the incumbent at the limit comes
                back. 0 searches no node (HiGHS then returns the start, if any, without solving).
            mip_rel_gap: HiGHS's relative gap at which it stops.
            time_limit_s: HiGHS's wall-clock limit (s), or None for none: the result then depends on the machine's
                speed and load, and ``stopped_by`` says when it cut the solve short.

        Raises:
            KeyboardInterrupt: Ctrl-C during the solve (HiGHS stopped first).
        """
        import highspy

        h = _highs()
        h.passModel(self._lp_model)
        columns = np.arange(self.n_x, dtype=np.int32)
        h.changeColsIntegrality(self.n_x, columns, np.full(self.n_x, highspy.HighsVarType.kInteger))
        self._set_deadline(h, deadline_s)
        if x_lower is not None or x_upper is not None:
            lower = np.zeros(self.n_x) if x_lower is None else np.asarray(x_lower, dtype=float)
            upper = np.ones(self.n_x) if x_upper is None else np.asarray(x_upper, dtype=float)
            h.changeColsBounds(self.n_x, columns, lower, upper)
        h.setOptionValue("mip_max_nodes", int(node_limit))
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(np.asarray(start, dtype=float))
            solution.value_valid = True
            h.setSolution(solution)
        _run(h)
        info = h.getInfo()
        x = np.asarray(h.getSolution().col_value) if info.primal_solution_status == 2 else None  # 2: feasible
        bound = float(info.mip_dual_bound)
        return MilpResult(x, bound if np.isfinite(bound) else -np.inf, h.modelStatusToString(h.getModelStatus()),
                          int(info.mip_node_count))


def precedence_rows(dag: PipelineDAG, n_choices: int, offsets: np.ndarray, owner: Sequence[int],
                    times: Sequence[np.ndarray], n_x: int):  # fmt: skip
    """The model's rows (module docstring) for ``dag`` over n_x choice columns, N start times and T: one assignment row
    per choice group (group c owns columns offsets[c]:offsets[c + 1]); per DAG edge a -> b, s_b - s_a -
    sum_k times[a][k] x[owner[a], k] >= 0; per sink, the same with T. Returns (csr matrix, lower, upper)."""
    from scipy.sparse import coo_matrix

    n = dag.n
    s0, t_var = n_x, n_x + n
    has_successor = np.zeros(n, dtype=bool)
    has_successor[dag.edges[:, 0]] = True
    sinks = np.flatnonzero(~has_successor)
    rows, cols, vals = [], [], []
    for c in range(n_choices):
        k = np.arange(offsets[c], offsets[c + 1])
        rows.append(np.full(len(k), c)); cols.append(k); vals.append(np.ones(len(k)))  # noqa: E702
    r = n_choices
    for a, b in list(map(tuple, dag.edges)) + [(int(a), -1) for a in sinks]:
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
