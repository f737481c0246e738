"""Exact allocation of a slowdown budget across tuning units: a multiple-choice knapsack solved as a MILP.

Choose one option j per unit u (x_uj binary, sum_j x_uj = 1) minimizing sum e_uj x_uj subject to
sum t_uj x_uj <= time_budget_s; solved by scipy.optimize.milp (HiGHS branch and bound), so the result is the
global optimum over the options given, not a greedy approximation.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

import numpy as np

from freqopt.errors import InvalidSettingError

__all__ = ["allocate", "quiet_native_stdout"]


@contextlib.contextmanager
def quiet_native_stdout():
    """Silence HiGHS, which prints debugging lines from C++ straight to file descriptor 1 even with disp=False
    ("HighsMipSolverData::transformNewIntegerFeasibleSolution ..."), by pointing fd 1 at /dev/null meanwhile.
    Every scipy.optimize.milp call of freqopt runs inside it (this allocation), and every HiGHS solve of the
    pipeline planner (freqopt.pipeline.solver)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real fd 1 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def allocate(options: Sequence[Sequence[tuple[float, float]]], time_budget_s: float) -> list[int]:
    """Pick one option per unit minimizing total energy within a total time budget.

    Args:
        options: per unit, its options as (time_s, energy_j); every unit needs at least one.
        time_budget_s: upper bound on the sum of the chosen times, s.

    Returns:
        The index of the chosen option of each unit.

    Raises:
        InvalidSettingError: no choice meets the budget (it is below the sum of the units' fastest options).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = [len(o) for o in options]
    if min(sizes, default=1) < 1:
        raise ValueError("every unit needs at least one option")
    times = np.array([t for unit in options for t, _ in unit])
    energies = np.array([e for unit in options for _, e in unit])
    fastest = sum(min(t for t, _ in unit) for unit in options)
    if fastest > time_budget_s * (1 + 1e-12):
        raise InvalidSettingError(
            f"no setting meets the time budget ({time_budget_s:.6g} s < fastest {fastest:.6g} s); allow more slowdown"
        )
    n = len(times)
    one_per_unit = np.zeros((len(options), n))
    offsets = np.cumsum([0] + sizes)
    for u in range(len(options)):
        one_per_unit[u, offsets[u] : offsets[u + 1]] = 1.0
    # Scale energies to O(1) for the solver's tolerances.
    scale = energies.max() or 1.0
    with quiet_native_stdout():
        result = milp(
            c=energies / scale,
            constraints=[LinearConstraint(one_per_unit, 1, 1), LinearConstraint(times[None, :], -np.inf, time_budget_s)],
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
        )
    if result.status != 0 or result.x is None:
        raise RuntimeError(f"MILP solver failed: {result.message}")
    x = np.round(result.x).astype(int)
    return [int(np.argmax(x[offsets[u] : offsets[u + 1]])) for u in range(len(options))]
