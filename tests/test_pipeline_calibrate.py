"""The pipeline levels' budget calibration (freqopt.pipeline.calibrate) on a made-up planner and validator whose
slowdown is known, so that the budgets it tries can be checked step by step."""

from __future__ import annotations

from types import SimpleNamespace

from freqopt.errors import FreqoptError
from freqopt.pipeline.calibrate import calibrated


def test_a_budget_with_no_plan_is_not_counted_as_one_that_met_the_limit():
    # Issue 50, item 4: a solve that found no plan (its LP stopped at a limit) was counted as a budget that met the
    # limit, and the bracket then held a budget never validated. Here the first budget finds no plan and the next,
    # looser one breaks the limit (validated slowdown twice the planned one): the next budget tried must then be
    # below the first (a secant step from the break alone), not between the two (a bracket that began at a budget
    # that never met the limit).
    tried = []

    def plan_with(*, max_slowdown):
        tried.append(max_slowdown)
        if len(tried) == 1:
            raise FreqoptError("no optimum")
        return SimpleNamespace(slack=max_slowdown, sm_clock_mhz=[1000])

    def measure(requests, **_):
        (slack,) = requests
        return SimpleNamespace(time_s=1.0 + 2 * slack, time_bound_s=1.0 + 2 * slack, energy_j=100.0 - 10 * slack,
                               switches_per_s=0.0)  # fmt: skip

    class Validator:  # PipelineValidator's part that calibrated uses: a call, confirm, and the GPU's switch limit
        pipeline = SimpleNamespace(spec=SimpleNamespace(over_switch_limit=lambda rate: False))
        confirm = staticmethod(measure)

        def __call__(self, requests, **kw):
            return measure(requests, **kw)

    planner = SimpleNamespace(fastest=lambda: SimpleNamespace(time_s=1.0), dag=SimpleNamespace(n=1))
    baseline = SimpleNamespace(time_s=1.0, time_bound_s=1.0, energy_j=100.0)
    result = calibrated(planner, lambda plan: (plan.slack,), Validator(), baseline, 0.01, 6, [], key="test",
                        plan_with=plan_with)  # fmt: skip
    assert tried[0] == 0.01 and tried[1] > tried[0]  # no plan at 1 %: a looser budget next
    assert tried[2] < tried[0]  # the looser one broke the limit: back below, with nothing counted as met
    assert result.validated.time_bound_s <= 1.01  # what it keeps meets the limit
