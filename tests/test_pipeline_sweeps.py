"""Perseus's Zeus-baseline pipelines under one power limit (freqopt/gpu/calibration/pipeline_sweeps.py)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from freqopt.gpu.calibration import pipeline_sweeps as ps
from freqopt.gpu.specs import get_gpu

SOSP24 = Path(__file__).resolve().parent.parent / "experiments" / "data" / "zeus" / "sosp24"


def test_every_sweep_of_both_testbeds_loads_with_one_limit_per_row():
    sweeps = ps.load_pipeline_sweeps(SOSP24)
    assert {(s.testbed, s.model) for s in sweeps} >= {("a40", "gpt3-2.7b"), ("a100", "gpt3-xl")}
    assert len(sweeps) == 11  # 5 networks on the A100 PCIe, 6 on the A40
    for s in sweeps:
        assert np.all(np.diff(s.power_limit_w) > 0) and s.power_limit_w[-1] == 300
        assert s.stages in (4, 8) and len(s.time_s) == len(s.energy_j) == len(s.power_limit_w)


def test_the_1f1b_accounting_charges_the_fill_and_drain_at_the_blocking_power():
    """T = (M + S - 1) t and E = S (M e + (S - 1) t P_block): a GPU that waited at 0 W would draw only M e."""
    sweep = next(s for s in ps.load_pipeline_sweeps(SOSP24) if s.testbed == "a40" and s.model == "gpt3-2.7b")
    sweep = dataclasses.replace(sweep, power_limit_w=np.array([300.0]), time_s=np.array([1.0]),
                                energy_j=np.array([1.0]))  # fmt: skip
    spec = get_gpu("a40")
    t, e = ps.simulate_sweep(spec, sweep)
    silent = dataclasses.replace(spec, waiting_power=dataclasses.replace(spec.waiting_power, top_clocks_w=0.0,
                                                                         clock_share=0.0))  # fmt: skip
    t0, e0 = ps.simulate_sweep(silent, sweep)
    s, m = sweep.stages, sweep.num_microbatches
    step_s = t[0] / (m + s - 1)
    assert t0[0] == pytest.approx(t[0], rel=1e-3)  # the waiting power moves the throttle a little
    assert e[0] - e0[0] == pytest.approx(s * (s - 1) * step_s * spec.waiting_power.top_clocks_w, rel=0.02)
