"""experiments/zeus_side_by_side.py: Zeus's power-limit optimizer run through the stand-in NVML on the simulated GPU,
and the script's noiseless scoring of a power limit."""

import importlib.util
import sys
from pathlib import Path

import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.search.oracle import noiseless_figures
from freqopt.search.validate import Validator
from freqopt.workload.models import get_workload
from freqopt.workload.trace import trace_training_iteration

# Looked up before experiments/ joins the path: its zeus/ folder (the report) would pass for a namespace package.
_ZEUS = importlib.util.find_spec("zeus")
HAS_ZEUS = _ZEUS is not None and _ZEUS.origin is not None
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import zeus_side_by_side as zsbs  # noqa: E402


@pytest.fixture(scope="module")
def v100_trace():
    """gpt3-small, 2 sequences of 512 tokens: on the V100 PCIe its step slows by about 1 % at 150 W and 5.5 % at
    125 W (a step that a cap does not slow would end Zeus at its lowest limit, with no set call for the pick)."""
    return trace_training_iteration(get_workload("gpt3-small", micro_batch_size=2, seq_len=512))


@pytest.mark.skipif(not HAS_ZEUS, reason="zeus is not installed (not in the test extra): pip install zeus==0.16.0")
def test_zeus_profiles_its_grid_then_sets_the_limit_it_picked(v100_trace):
    """Zeus, through its own get_gpus() on the stand-in NVML, steps from the V100 PCIe's 250 W maximum down to its
    100 W minimum 25 W apart, then sets its pick; its exit handler puts the maximum back."""
    spec = get_gpu("v100-pcie")
    kernels = v100_trace.kernels
    got = zsbs.run_zeus(spec, kernels, 5.0, seed=0)
    grid = [225.0, 200.0, 175.0, 150.0, 125.0, 100.0]  # 250 W is already set: Zeus does not set it again
    assert got["set_power_limit_w"][:len(grid)] == grid
    assert got["set_power_limit_w"][len(grid):] == [got["power_limit_w"], 250.0]
    assert got["measurements"] == 7 and [w["power_limit_w"] for w in got["windows"]] == [250, *map(int, grid)]
    # 1 wait step, then 10 warm-up and 40 profiled steps at each of the 7 limits.
    assert got["steps"] == 1 + 7 * 50
    noiseless = SimulatedGPU(spec, noise=False)
    step_s = noiseless.step(kernels).time_s
    for window in got["windows"]:  # each window is 40 steps of the virtual clock, with a reading's noise
        true_s = noiseless.step(kernels, zsbs.cap_schedule(kernels, window["power_limit_w"])).time_s
        assert window["time_s"] == pytest.approx(40 * true_s, rel=0.01)
        assert window["energy_j"] > 0
    assert got["gpu_s"] >= got["steps"] * step_s * 0.99
    # The pick: the lowest limit whose window is within 5 % of the 250 W window's time (MaxSlowdownConstraint).
    fastest = got["windows"][0]["time_s"]
    assert got["power_limit_w"] == min(w["power_limit_w"] for w in got["windows"] if w["time_s"] <= 1.05 * fastest)
    assert 100.0 < got["power_limit_w"] < 250.0
    assert (got["energy_saved_pct"], got["slowdown_pct"]) == zsbs.score(spec, kernels, got["power_limit_w"])


def test_zeus_is_put_back_after_a_run(small_trace):
    """The stand-in and the virtual clock are Zeus's during the run only."""
    if not HAS_ZEUS:
        pytest.skip("zeus is not installed (not in the test extra): pip install zeus==0.16.0")
    import pynvml
    import zeus.monitor.energy as zenergy

    before = (sys.modules["pynvml"], zenergy.time)
    zsbs.run_zeus(get_gpu("v100-pcie"), small_trace.kernels, 5.0, seed=1)
    assert (sys.modules["pynvml"], zenergy.time) == before and sys.modules["pynvml"] is pynvml


@pytest.mark.parametrize("gpu, limit_w", [("h100-sxm", 200.0), ("v100-pcie", 150.0), ("v100-pcie", 125.0)])
def test_the_scripts_score_is_freqopts_noiseless_evaluation(v100_trace, gpu, limit_w):
    spec = get_gpu(gpu)
    validator = Validator(v100_trace, SimulatedGPU(spec, seed=3), 2, switching=True)
    validated = validator(tuple([ClockSetting(power_limit_w=limit_w)] * len(v100_trace)))
    saved, slowdown = zsbs.score(spec, v100_trace.kernels, limit_w)
    assert (saved, slowdown) == pytest.approx(noiseless_figures(validator, validated), rel=1e-12, abs=1e-12)
    assert saved > 1.0  # a cap this low saves: the comparison is not of zeros


def test_the_script_refuses_in_one_line_without_zeus(monkeypatch):
    monkeypatch.setitem(sys.modules, "zeus", None)  # import zeus raises ImportError
    with pytest.raises(SystemExit, match=r"^zeus is not installed: pip install zeus==0\.16\.0$"):
        zsbs.require_zeus()
