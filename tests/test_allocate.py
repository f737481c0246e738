import itertools

import numpy as np
import pytest

from freqopt.errors import InvalidSettingError
from freqopt.search.allocate import allocate


def brute_force(options, budget):
    best_e = np.inf
    for picks in itertools.product(*(range(len(o)) for o in options)):
        t = sum(options[u][j][0] for u, j in enumerate(picks))
        e = sum(options[u][j][1] for u, j in enumerate(picks))
        if t <= budget + 1e-12 and e < best_e - 1e-12:
            best_e = e
    return best_e


@pytest.mark.parametrize("seed", range(25))
def test_milp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    options = [[(float(rng.uniform(1, 3)), float(rng.uniform(1, 5))) for _ in range(rng.integers(1, 5))]
               for _ in range(rng.integers(1, 6))]
    fastest = sum(min(t for t, _ in o) for o in options)
    budget = fastest * float(rng.uniform(1.0, 1.4))
    picks = allocate(options, budget)
    assert sum(options[u][j][0] for u, j in enumerate(picks)) <= budget + 1e-9
    energy = sum(options[u][j][1] for u, j in enumerate(picks))
    assert energy == pytest.approx(brute_force(options, budget), rel=1e-9)


def test_global_beats_greedy_local():
    # Unit 0 can save a lot for a little time; unit 1 saves little for a lot. Global allocation spends the budget
    # where it saves most.
    options = [[(1.0, 10.0), (1.1, 6.0)], [(1.0, 10.0), (1.1, 9.5)]]
    assert allocate(options, 2.1) == [1, 0]


def test_infeasible_budget_is_a_clear_error():
    with pytest.raises(InvalidSettingError, match="allow more slowdown"):
        allocate([[(2.0, 1.0)], [(1.0, 1.0)]], 2.5)
