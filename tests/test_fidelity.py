"""The fidelity scoreboard's guard (issue 56, item 4): the committed constants and today's physics still predict every
cheap data set's left-out points as well as experiments/fidelity.json recorded, so that a fit for one GPU cannot
silently break another. Each fold's recorded constants are re-applied (no refit): python experiments/fidelity.py
re-records them."""

import dataclasses
import importlib.util
import json

import pytest

from freqopt.gpu.calibration import fidelity as fd

RECORDED = json.loads((fd.EXPERIMENTS / "fidelity.json").read_text())


@pytest.fixture(scope="module")
def recomputed() -> dict[str, list[fd.Row]]:
    return {name: ds.rows(fd.recorded_folds(RECORDED, name)) for name, ds in fd.REGISTRY.items() if ds.cheap}


@pytest.mark.slow
def test_no_cheap_row_moved_past_its_tolerance(recomputed):
    """Every cheap row's left-out (and fitted-on) figure within its recorded value plus its tolerance."""
    moved = [m for rows in recomputed.values() for m in fd.regressions(rows, RECORDED["rows"])]
    assert not moved, "\n".join(moved)


def test_the_record_is_of_todays_registry():
    """Every registered data set is recorded with the folds it has today (a new shape or step is a new fold: the
    record is re-made by experiments/fidelity.py), and nothing else is."""
    assert list(RECORDED["entries"]) == list(fd.REGISTRY)
    for name, ds in fd.REGISTRY.items():
        assert list(RECORDED["entries"][name]["folds"]) == list(ds.fold_names()), name
        assert RECORDED["entries"][name]["kind"] == ds.kind


def test_the_table_lists_every_data_set_and_every_measured_gpu():
    """One row at least per registered data set, a placeholder included, in the JSON and in the report; and every
    GPU file fitted to measurements of its own (experiments/calibrate.py's MEASURED and its reference) has a computed
    left-out or fitted-on figure."""
    entries = {r["entry"] for r in RECORDED["rows"]}
    assert entries == set(fd.REGISTRY)
    report = (fd.EXPERIMENTS / "fidelity.md").read_text()
    for row in RECORDED["rows"]:
        assert f"| {row['gpu']} | {row['dataset']} |" in report, row["dataset"]
    spec = importlib.util.spec_from_file_location("_calibrate", fd.EXPERIMENTS / "calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    judged = {r["gpu"] for r in RECORDED["rows"] if r["status"] == "computed" and r["fitted_on"] is not None}
    assert set(calibrate.MEASURED) | {calibrate.REFERENCE} <= judged
    for name, ds in fd.REGISTRY.items():
        if not ds.modelled:
            rows = [r for r in RECORDED["rows"] if r["entry"] == name]
            assert rows and all(r["status"] == "not modelled yet" and r["left_out"] is None for r in rows)


def test_left_out_figures_come_from_refits_that_did_not_see_them():
    """Where a data set leaves points out, its left-out figures are not its fitted-on ones: a fold that saw its
    point, or the committed constants passed off as folds, would reproduce every residual to rounding. (A single row
    may match: a host-bound Zeus sweep's relative time, or an H200 family with nothing fitted on its own shapes, does
    not depend on what a fold refits.)"""
    by_entry: dict[str, list[bool]] = {}
    for row in RECORDED["rows"]:
        entry = RECORDED["entries"][row["entry"]]
        discrete = row["metric"] in ("optimal_limit_w", "optimal_clock_mhz")  # grid points: equal by chance
        if entry["folds"] and row["left_out"] is not None and row["fitted_on"] is not None and not discrete:
            by_entry.setdefault(row["entry"], []).append(row["left_out"] != pytest.approx(row["fitted_on"], rel=1e-6))
    assert by_entry
    for name, differs in by_entry.items():
        assert sum(differs) >= max(1, len(differs) // 2), name


@pytest.mark.parametrize("gpu, entry, field, factor, caught_on", [
    # the V100's leakage tripled, which its folds refit: the committed constants' figure moves
    ("v100-pcie", "zeus-v100-bert-squad", "p_leak_w", 3.0, "fitted_on"),
    # the V100's GEMM model 20 % slower, which nothing of DeepBench's refits (no fit on it is committed): the
    # left-out figure moves
    ("v100-sxm2", "deepbench-v100", "gemm_efficiency", 0.8, "left_out"),
    # the GEMM model 20 % slower, which each GEMM fold refits: the committed constants' figure moves
    ("h200-sxm", "h200-kernel-families", "gemm_efficiency", 0.8, "fitted_on"),
])  # fmt: skip
def test_the_guard_catches_a_perturbed_constant(monkeypatch, gpu, entry, field, factor, caught_on):
    """The guard can fail: a committed constant perturbed (dataclasses.replace on the loaded GPUSpec, nothing written)
    moves a figure past its tolerance. The folds' values are re-applied on top of the perturbed file, so a constant
    no fold refits moves the left-out figures, one the folds refit the fitted-on figure."""
    original = fd._gpu

    def perturbed(name):
        spec = original(name)
        if name != gpu:
            return spec
        if field in spec.power_model.__dataclass_fields__:
            pm = spec.power_model
            pm = dataclasses.replace(pm, **{field: getattr(pm, field) * factor})
            return dataclasses.replace(spec, power_model=pm)
        return dataclasses.replace(spec, **{field: getattr(spec, field) * factor})

    monkeypatch.setattr(fd, "_gpu", perturbed)
    moved = fd.regressions(fd.REGISTRY[entry].rows(fd.recorded_folds(RECORDED, entry)), RECORDED["rows"])
    assert any(f" {caught_on}: " in m for m in moved), moved


def test_a_left_out_figure_moved_past_its_tolerance_is_reported():
    row = next(fd.Row(**{k: v for k, v in r.items() if k != "meets"}) for r in RECORDED["rows"]
               if r["left_out"] is not None and r["status"] == "computed")  # fmt: skip
    assert fd.regressions([row], RECORDED["rows"]) == []
    worse = dataclasses.replace(row, left_out=abs(row.left_out) + 1.01 * fd.tolerance(row.metric, row.left_out))
    assert fd.regressions([worse], RECORDED["rows"])
    within = dataclasses.replace(row, left_out=abs(row.left_out) + 0.9 * fd.tolerance(row.metric, row.left_out))
    assert fd.regressions([within], RECORDED["rows"]) == []
    assert fd.regressions([dataclasses.replace(row, left_out=None)], RECORDED["rows"])


def test_recorded_tolerances_are_the_modules():
    assert RECORDED["tolerances"] == {m: list(t) for m, t in fd.TOLERANCES.items()}
    assert {r["metric"] for r in RECORDED["rows"] if r["status"] == "computed"} <= set(fd.TOLERANCES)


def test_meets_judges_the_left_out_figure_only():
    row = fd.Row("x", "a40", "d", "clock sweep", "time_rel_pp", 1.0, None, 3, 3.0)
    assert row.meets is None  # a residual alone meets nothing
    assert dataclasses.replace(row, left_out=-2.9).meets is True
    assert dataclasses.replace(row, left_out=3.1).meets is False
    assert fd.target("h200-sxm", "whole step", "time_pct") == 10.0
    assert fd.target("h100-sxm", "whole step", "time_pct") == 5.0


def test_a_data_set_of_an_unknown_kind_or_without_its_refit_is_refused():
    with pytest.raises(ValueError, match="kind"):
        fd.DataSet("x", ("a40",), "clock", "-", lambda folds: [])
    with pytest.raises(ValueError, match="fit_fold"):
        fd.DataSet("x", ("a40",), "clock sweep", "-", lambda folds: [], folds=("a",))
