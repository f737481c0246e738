"""Pipeline clock tables for tests, built from a synthetic stage profile (no search): unequal stages whose
instructions slow down and save energy as the SM clock falls, planned by freqopt's PipelinePlanner."""

from __future__ import annotations

import numpy as np

from freqopt.gpu.backends.base import Measurement
from freqopt.gpu.specs import get_gpu
from freqopt.pipeline.dag import KINDS
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.profile import InstructionOptions, StageProfile
from freqopt.pipeline.table import pipeline_table
from freqopt.workload.layout import Layout
from freqopt.workload.models import get_workload

CLOCKS_MHZ = (1005, 1200, 1410, 1605, 1800, 1980)  # on the H100's list (345..1980 MHz in 15 MHz steps)
BLOCKING_POWER_W = 71.6  # the H100's idle power (search_spaces/h100-sxm.toml)


def synthetic_profile(stages: int, *, base_s: float = 0.03) -> StageProfile:
    """Stage s's forward takes base_s x (1 + 0.3 s) at 1980 MHz (the last stages the slowest, so the others have
    slack), its backward twice that; time grows as (1980 / f)^0.8 and power as 150 + 550 (f / 1980)^2.5 W."""
    f = np.asarray(CLOCKS_MHZ, dtype=int)
    options = {}
    for s in range(stages):
        for kind in KINDS:
            t0 = base_s * (1 + 0.3 * s) * (2.0 if kind == "backward" else 1.0)
            time_s = t0 * (1980 / f) ** 0.8
            energy_j = time_s * (150 + 550 * (f / 1980) ** 2.5)
            options[(s, kind)] = InstructionOptions(f, time_s, energy_j)
    return StageProfile(stages, options, "synthetic")


def make_table(*, stages: int = 2, micro_batches: int = 4, max_slowdown: float = 0.05, model: str = "gpt3-small",
               micro_batch_size: int = 1, seq_len: int = 16, profile: StageProfile | None = None, **kwargs):
    """A pipeline table for ``model`` on the simulated H100 with ``stages`` stages (pp), planned at
    ``max_slowdown``; returns (table, plan, profile)."""
    workload = get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, layout=Layout(pp=stages))
    profile = profile or synthetic_profile(stages)
    planner = PipelinePlanner(profile, micro_batches, blocking_power_w=BLOCKING_POWER_W)
    plan = planner.plan(max_slowdown=max_slowdown)
    defaults = {key: (float(o.time_s[-1]), float(o.energy_j[-1]), 3) for key, o in profile.options.items()}
    table = pipeline_table(workload, get_gpu("h100-sxm"), profile, plan, max_slowdown=max_slowdown,
                           blocking_power_w=BLOCKING_POWER_W, switch_s=0.026, defaults=defaults,
                           validated=Measurement(plan.time_s * 1.001, plan.energy_j * 1.002), **kwargs)  # fmt: skip
    return table, plan, profile
