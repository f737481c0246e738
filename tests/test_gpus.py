import dataclasses

import pytest

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpu.specs import (DEFAULT_GPU, MEM_CLOCK_LOCKS, check_switch_latency_ms, get_gpu, list_gpus,
                          search_spaces_dir)  # fmt: skip

REQUIRED = {"v100-pcie", "v100-sxm2", "a100-sxm4-80gb", "h100-sxm", "h200-sxm", "rtx3080ti",
            # issue 51: the GPUs people own (tests/test_gpu_files.py holds them to their sources)
            "h100-pcie", "a100-sxm4-40gb", "gh200", "a10g", "l40s", "l4", "rtx4090", "b200"}


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


@pytest.mark.parametrize("name", sorted(list_gpus()))
def test_every_gpu_states_its_actuation_with_sources(name):
    """Issue 22: each file gives the NVML call's blocking time, the effective switch latency within its plausible
    range, and how its memory clock can be set, each with a source."""
    g = get_gpu(name)
    low, high = g.clock_switch_range_s
    assert 0 <= low <= g.clock_switch_s <= high
    assert 0 < g.nvml_call_s <= g.clock_switch_s  # the effective latency includes the call
    assert g.mem_clock_lock in MEM_CLOCK_LOCKS
    assert g.mem_clock_runtime == (g.mem_clock_lock == "runtime" and len(g.mem_clocks_mhz) > 1)
    assert g.mem_clock_lock != "none" or len(g.mem_clocks_mhz) == 1  # no lock at all: one clock it runs at
    assert "actuation" in g.sources and "mem_clock_lock" in g.sources


def test_actuation_figures_as_sourced():
    """The values the files state, as their sources give them (search_spaces/*.toml, sources.actuation)."""
    h100 = get_gpu("h100-sxm")
    assert h100.clock_switch_s == pytest.approx(0.026)  # cautious: the call's 20 ms, then the GH200's 6 ms
    assert h100.clock_switch_range_s == pytest.approx((0.006, 0.026)) and h100.nvml_call_s == pytest.approx(0.020)
    assert (h100.mem_clock_lock, h100.mem_clock_runtime) == ("per-job", False)  # Hopper: deferred lock only
    assert get_gpu("rtx3080ti").clock_switch_s == pytest.approx(0.100)  # Spaan et al. 2026, through nvidia-smi
    assert get_gpu("rtx3080ti").mem_clock_runtime and get_gpu("rtx-a4000").mem_clock_runtime
    assert not get_gpu("a100-sxm4-80gb").mem_clock_runtime  # NVML can lock it, but there is one memory clock
    assert get_gpu("v100-pcie").mem_clock_lock == "none"


def test_with_switch_latency_replaces_only_the_latency():
    h100 = get_gpu("h100-sxm")
    fast = h100.with_switch_latency(0.001)
    assert fast.clock_switch_s == 0.001 and fast.name == h100.name
    assert dataclasses.replace(fast, clock_switch_s=h100.clock_switch_s) == h100
    assert h100.with_switch_latency(0).clock_switch_s == 0.0  # free switching
    assert get_gpu("h100-sxm").clock_switch_s == pytest.approx(0.026)  # the cached spec is untouched


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), "6", None, True])
def test_with_switch_latency_refuses_what_is_not_a_latency(bad):
    with pytest.raises(InvalidSettingError, match="switch latency"):
        get_gpu("h100-sxm").with_switch_latency(bad)


def test_switch_latency_ms_argument_is_checked_and_named():
    assert check_switch_latency_ms(None) is None
    assert check_switch_latency_ms(6) == pytest.approx(0.006)
    for bad in (-1, float("nan"), "6 ms", False):
        with pytest.raises(InvalidSettingError, match="^switch_latency_ms must be"):
            check_switch_latency_ms(bad)


def test_a_file_without_actuation_or_with_a_latency_outside_its_range_is_refused(tmp_path):
    text = (search_spaces_dir() / "h100-sxm.toml").read_text()
    no_actuation = tmp_path / "noact.toml"
    no_actuation.write_text(text.replace("[actuation]", "[not_actuation]"))
    with pytest.raises(InvalidSettingError, match=r"no \[actuation\] table"):
        get_gpu(str(no_actuation))
    outside = tmp_path / "outside.toml"
    outside.write_text(text.replace("clock_switch_ms = 26.0", "clock_switch_ms = 500.0"))
    with pytest.raises(InvalidSettingError, match="outside"):
        get_gpu(str(outside))
    bad_lock = tmp_path / "badlock.toml"
    bad_lock.write_text(text.replace('mem_clock_lock = "per-job"', 'mem_clock_lock = "sometimes"'))
    with pytest.raises(InvalidSettingError, match="mem_clock_lock must be one of"):
        get_gpu(str(bad_lock))


def test_replace_toml_block_replaces_one_marked_block_and_refuses_none_or_two():
    from freqopt.gpu.specs import replace_toml_block

    text = "[a]\nx = 1\n# BEGIN fit (written by old.py; edit there)\ny = 2\n# END fit\n[b]\n"
    new = replace_toml_block(text, "fit", ["y = 3"], writer="experiments/new.py")
    assert new == "[a]\nx = 1\n# BEGIN fit (written by experiments/new.py; edit there)\ny = 3\n# END fit\n[b]\n"
    with pytest.raises(ValueError, match="expected one '# BEGIN other' block, found 0"):
        replace_toml_block(text, "other", [], writer="w")
    with pytest.raises(ValueError, match="found 2"):
        replace_toml_block(text + text, "fit", [], writer="w")



@pytest.mark.parametrize("text, says", [
    ('[gpu]\nmarketing_name = "x"\n[clocks\n', "is not valid TOML (Expected ']'"),  # corrupt
    ('[gpu]\nmarketing_name = "x"\n', "lacks 'clocks'"),  # another program's TOML, or a partial copy
    ("HEADER_ONLY", "lacks 'gpu'"),  # no tables at all
    (None, "is not a GPU file freqopt can read (invalid literal for int()"),  # a figure of the wrong kind
])  # fmt: skip
def test_a_corrupt_or_foreign_gpu_file_is_refused_in_one_line_naming_it(tmp_path, text, says):
    path = tmp_path / "mine.toml"
    if text is None:  # a shipped file with one figure made a word
        text = (search_spaces_dir() / "h100-sxm.toml").read_text().replace("n_sms = 132", 'n_sms = "many"', 1)
        assert 'n_sms = "many"' in text
    path.write_text("" if text == "HEADER_ONLY" else text)
    with pytest.raises(InvalidSettingError) as raised:
        get_gpu(str(path))
    message = str(raised.value)
    assert str(path) in message and says in message and "\n" not in message
    assert "copy a GPU file of" in message


def test_every_gpu_file_says_what_each_family_of_its_figures_rests_on():
    """Issue 49: per family, measured, carried from another GPU, or assumed, each with its source."""
    from freqopt.gpu.specs import PROVENANCE_FAMILIES, PROVENANCE_KINDS

    for name in list_gpus():
        provenance = get_gpu(name).provenance
        assert set(provenance) == set(PROVENANCE_FAMILIES), name
        for family, text in provenance.items():
            kind, _, source = text.partition(" ")
            assert kind.rstrip(":") in PROVENANCE_KINDS and len(source.strip()) > 10, (name, family, text)
