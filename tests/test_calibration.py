"""The committed V100 constants still reproduce the Zeus power-limit sweep as well as the fit reported."""

import json
from pathlib import Path

import pytest

from freqopt import calibration as cal
from freqopt.gpus import get_gpu

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


REPORTED = json.loads((EXPERIMENTS / "calibration_residuals.json").read_text())


@pytest.fixture(scope="module")
def rows():
    points = cal.load_zeus_points(EXPERIMENTS / "data" / "zeus_v100_bert_squad.csv")
    traces = {b: cal.bert_squad_trace(b) for b in sorted({p.batch_size for p in points})}
    return cal.residuals(get_gpu("v100-pcie"), points, traces, REPORTED["host_gaps_s"]["zeus_host_gap_s"])


def test_residuals_within_what_the_fit_reported(rows):
    reported = REPORTED
    assert len(rows) == len(reported["points"]) == 21
    for key in ("time_rel_error_pp", "avg_power_error_pp"):
        worst = max(abs(r[key]) for r in rows)
        rms = (sum(r[key] ** 2 for r in rows) / len(rows)) ** 0.5
        assert worst <= reported["max_abs_error_pp"][key] + 0.01
        assert rms <= reported["rms_error_pp"][key] + 0.01


def test_mcdonald_figures_within_what_the_fit_reported():
    figures = cal.load_mcdonald_figures(EXPERIMENTS / "data" / "mcdonald_v100_training.csv")
    got = cal.mcdonald_residuals(get_gpu("v100-pcie"), figures, cal.mcdonald_traces(),
                                 REPORTED["host_gaps_s"]["mcdonald_host_gap_s"])  # fmt: skip
    assert len(got) == len(figures) == 5
    worst = max(abs(r["error_pp"]) for r in got)
    rms = (sum(r["error_pp"] ** 2 for r in got) / len(got)) ** 0.5
    assert worst <= REPORTED["mcdonald"]["max_abs_error_pp"] + 0.01
    assert rms <= REPORTED["mcdonald"]["rms_error_pp"] + 0.01


def test_power_stays_within_each_limit(rows):
    for r in rows:
        assert r["avg_power_simulated_w"] <= r["power_limit_w"] + 1e-6  # the idle host gap only lowers it


def test_capping_trades_time_for_energy_as_measured(rows):
    """The qualitative result of both papers: a 150 W cap costs time and saves energy on a 250 W V100."""
    for r in rows:
        if r["power_limit_w"] == 150:
            energy_rel = r["time_rel_simulated"] * r["avg_power_simulated_w"]
            base = next(b for b in rows if b["batch_size"] == r["batch_size"] and b["power_limit_w"] == 250)
            assert r["time_rel_simulated"] > 1.05
            assert energy_rel / base["avg_power_simulated_w"] < 0.95
