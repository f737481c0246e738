import pytest

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpus import DEFAULT_GPU, get_gpu, list_gpus

REQUIRED = {"v100-pcie", "v100-sxm2", "a100-sxm4-80gb", "h100-sxm", "h200-sxm", "rtx3080ti"}


def test_required_gpus_present_and_default():
    assert REQUIRED <= set(list_gpus())
    assert DEFAULT_GPU == "h100-sxm"


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_specs_are_consistent(name):
    g = get_gpu(name)
    assert list(g.sm_clocks_mhz) == sorted(set(g.sm_clocks_mhz))
    assert g.power_limit_min_w <= g.power_limit_default_w <= g.power_limit_max_w
    assert g.idle_power_w < g.power_limit_default_w
    assert g.sources, "every GPU file names its sources"
    assert g.supports(g.max_sm_clock_mhz, g.max_mem_clock_mhz)


def test_published_figures():
    """Figures from shared/calibration/published.md and the data sheets."""
    assert get_gpu("a100-sxm4-80gb").tensor_peak_flops == pytest.approx(312e12, rel=0.01)
    assert len(get_gpu("rtx3080ti").sm_clocks_mhz) == 127
    assert get_gpu("rtx3080ti").mem_clocks_mhz == (405, 810, 5001, 9251, 9501)
    assert len(get_gpu("v100-pcie").sm_clocks_mhz) == 167
    assert get_gpu("v100-pcie").sm_clocks_mhz[-3:] == (1365, 1372, 1380)


def test_memory_clock_constraint_rtx3080ti():
    g = get_gpu("rtx3080ti")
    assert g.supports(420, 405) and not g.supports(435, 405)
    assert (435, 405) not in g.clock_pairs()
    with pytest.raises(InvalidSettingError, match="does not support"):
        g.check_clocks(2100, 405)


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(UnknownNameError, match="h100-sxm"):
        get_gpu("rtx9090")
