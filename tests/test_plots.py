"""The figures a search saves beside its tables (freqopt.search.plots)."""

import dataclasses

import numpy as np
import pytest

import freqopt
from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.specs import get_gpu
from freqopt.search.plots import clock_series, timeline_ms
from freqopt.search.units import partition

pytest.importorskip("matplotlib")
H100 = get_gpu("h100-sxm")


@pytest.fixture(scope="module")
def searched(small_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    return freqopt.search(small_trace, max_slowdown="2%", granularity=["power-cap", "pass"], n_trials=3, out=out)


@pytest.mark.slow
def test_search_saves_both_figures_beside_its_tables(searched):
    paths = searched.figure_paths
    assert set(paths) == {"energy-time", "clocks"}
    table_dir = next(iter(searched.table_paths.values())).parent
    for path in paths.values():
        assert path.parent == table_dir and path.suffix == ".png"
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000  # a drawn figure, not an empty canvas


@pytest.mark.slow
def test_the_clock_figure_draws_each_kernels_setting(searched):
    # A pass schedule with three different settings: the series must follow each kernel's pass.
    trace = searched.trace
    settings = {"forward": ClockSetting(1200), "backward": DEFAULT_SETTING, "optimizer": ClockSetting(1500, 1593)}
    units = tuple((u, settings[u.name]) for u in partition(trace, "pass"))
    result = dataclasses.replace(searched, results={"pass": dataclasses.replace(searched.results["pass"], units=units)})
    sm, mem, unlocked = clock_series(result, "pass", H100)
    for k, s_mhz, m_mhz, free in zip(trace.kernels, sm, mem, unlocked):
        want = settings[k.pass_name]
        assert s_mhz == (want.sm_clock_mhz or H100.max_sm_clock_mhz)
        assert m_mhz == (want.mem_clock_mhz or max(H100.mem_clocks_mhz))
        assert free == (want.sm_clock_mhz is None)


def test_the_timeline_is_the_iteration_at_default_settings(small_trace):
    edges = timeline_ms(small_trace, H100)
    assert edges.shape == (len(small_trace) + 1,) and edges[0] == 0.0
    assert np.all(np.diff(edges) > 0)
