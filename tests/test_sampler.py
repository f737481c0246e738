"""GridGPSampler: the acquisition maximized by scoring every grid point (freqopt.search.study)."""

import itertools

import numpy as np
import optuna
import pytest
from optuna._gp.search_space import SearchSpace
from optuna.distributions import FloatDistribution, IntDistribution

from freqopt.search.study import GridGPSampler


class _Acquisition:
    """A stand-in acquisition function: a fixed function of the normalized point, and the calls it got."""

    def __init__(self, space: SearchSpace, f):
        self.search_space, self.f, self.calls = space, f, []

    def eval_acqf_no_grad(self, x: np.ndarray) -> np.ndarray:
        self.calls.append(x.copy())
        return self.f(x)


def test_the_acquisition_is_maximized_over_the_whole_grid():
    distributions = {"sm_clock_mhz": IntDistribution(345, 1980, step=15), "mem_clock_index": IntDistribution(0, 1)}
    space = SearchSpace(distributions)
    # A bumpy function whose maximum is a single grid point away from the middle.
    target = space.get_normalized_params([None], [{"sm_clock_mhz": 1215, "mem_clock_index": 0}])[0]
    acqf = _Acquisition(space, lambda x: -np.abs(x - target).sum(axis=1) + 0.01 * np.sin(40 * x[:, 0]))
    best = GridGPSampler()._optimize_acqf(acqf, None)
    grid = [{"sm_clock_mhz": sm, "mem_clock_index": m} for sm, m in itertools.product(range(345, 1981, 15), (0, 1))]
    points = space.get_normalized_params([None] * len(grid), grid)
    assert len(acqf.calls) == 1 and len(acqf.calls[0]) == len(grid) == 220  # every point, one batch
    assert np.allclose(np.sort(acqf.calls[0], axis=0), np.sort(points, axis=0))
    assert np.allclose(best, points[np.argmax(acqf.f(points))])
    assert space.get_unnormalized_param(best) == {"sm_clock_mhz": 1215, "mem_clock_index": 0}


@pytest.mark.parametrize("distributions", [
    {"x": FloatDistribution(0.0, 1.0)},  # a continuous dimension
    {"a": IntDistribution(0, 999), "b": IntDistribution(0, 99)},  # 100,000 points: above max_grid_points
])  # fmt: skip
def test_other_spaces_keep_optunas_optimizer(monkeypatch, distributions):
    called = []
    monkeypatch.setattr(optuna.samplers.GPSampler, "_optimize_acqf", lambda self, acqf, best: called.append(acqf))
    acqf = _Acquisition(SearchSpace(distributions), lambda x: np.zeros(len(x)))
    GridGPSampler()._optimize_acqf(acqf, None)
    assert called == [acqf] and acqf.calls == []


def test_a_study_finds_the_grid_minimum():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=GridGPSampler(seed=0, n_startup_trials=4))

    def objective(trial):
        sm = trial.suggest_int("sm_clock_mhz", 345, 1980, step=15)
        return ((sm - 1500) / 100.0) ** 2

    study.optimize(objective, n_trials=14)
    assert study.best_params["sm_clock_mhz"] == 1500


@pytest.mark.slow
def test_suggestions_without_torch_function_handling_are_optunas():
    """GridGPSampler.sample_relative turns PyTorch's __torch_function__ handling off around Optuna's GP (for speed);
    its suggestions are those of the same sampler run through Optuna's own torch.device("cpu") context, also
    where a caller has set another default device."""
    import torch

    class WithOptunasContext(GridGPSampler):
        def sample_relative(self, study, trial, search_space):
            return optuna.samplers.GPSampler.sample_relative(self, study, trial, search_space)

    def suggestions(sampler_type):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler_type(seed=3, n_startup_trials=3))

        def objective(trial):
            sm = trial.suggest_int("sm_clock_mhz", 345, 1980, step=15)
            mem = trial.suggest_int("mem_clock_mhz", 0, 3)
            trial.set_constraint("within_limit", (1980 - sm) / 1000 - 0.6)
            return (1980 - sm) / 100 + mem, ((sm - 1200) / 300) ** 2 - mem

        with torch.device("meta"):  # a default device other than the CPU, as Optuna issue 6113 had "cuda"
            study.optimize(objective, n_trials=9)
        return [t.params for t in study.trials]

    ours = suggestions(GridGPSampler)
    assert ours == suggestions(WithOptunasContext)
    assert len({tuple(p.values()) for p in ours}) > 3  # the GP suggested, not only the startup trials


def test_sampling_runs_on_one_torch_thread_and_gives_back_the_callers(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(optuna.samplers.GPSampler, "sample_relative",
                        lambda self, study, trial, space: seen.append(torch.get_num_threads()) or {"x": 1})  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert GridGPSampler().sample_relative(None, None, {"x": None}) == {"x": 1}
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(optuna.samplers.GPSampler, "sample_relative", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            GridGPSampler().sample_relative(None, None, {"x": None})
        assert torch.get_num_threads() == 2  # restored on an exception too
    finally:
        torch.set_num_threads(before)
