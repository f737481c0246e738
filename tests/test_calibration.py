"""The committed V100 constants still reproduce the Zeus power-limit sweep as well as the fit reported."""

import importlib.util
import json
from pathlib import Path

import pytest

from freqopt.gpu.calibration import v100 as cal
from freqopt.gpu.specs import get_gpu

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


REPORTED = json.loads((EXPERIMENTS / "calibration_residuals.json").read_text())


@pytest.fixture(scope="module")
def rows():
    points = cal.load_zeus_points(EXPERIMENTS / "data" / "zeus_v100_bert_squad.csv")
    traces = {b: cal.bert_squad_trace(b) for b in sorted({p.batch_size for p in points})}
    return cal.residuals(get_gpu("v100-pcie"), points, traces, REPORTED["host_gaps_s"]["zeus_host_gap_s"])


@pytest.mark.slow
def test_residuals_within_what_the_fit_reported(rows):
    reported = REPORTED
    assert len(rows) == len(reported["points"]) == 21
    for key in ("time_rel_error_pp", "avg_power_error_pp"):
        worst = max(abs(r[key]) for r in rows)
        rms = (sum(r[key] ** 2 for r in rows) / len(rows)) ** 0.5
        assert worst <= reported["max_abs_error_pp"][key] + 0.01
        assert rms <= reported["rms_error_pp"][key] + 0.01


@pytest.mark.slow
def test_mcdonald_figures_within_what_the_fit_reported():
    figures = cal.load_mcdonald_figures(EXPERIMENTS / "data" / "mcdonald_v100_training.csv")
    got = cal.mcdonald_residuals(get_gpu("v100-pcie"), figures, cal.mcdonald_traces(),
                                 REPORTED["host_gaps_s"]["mcdonald_host_gap_s"])  # fmt: skip
    assert len(got) == len(figures) == 5
    worst = max(abs(r["error_pp"]) for r in got)
    rms = (sum(r["error_pp"] ** 2 for r in got) / len(got)) ** 0.5
    assert worst <= REPORTED["mcdonald"]["max_abs_error_pp"] + 0.01
    assert rms <= REPORTED["mcdonald"]["rms_error_pp"] + 0.01


@pytest.mark.slow
def test_power_stays_within_each_limit(rows):
    for r in rows:
        assert r["avg_power_simulated_w"] <= r["power_limit_w"] + 1e-6  # the idle host gap only lowers it


@pytest.mark.slow
def test_capping_trades_time_for_energy_as_measured(rows):
    """The qualitative result of both papers: a 150 W cap costs time and saves energy on a 250 W V100."""
    for r in rows:
        if r["power_limit_w"] == 150:
            energy_rel = r["time_rel_simulated"] * r["avg_power_simulated_w"]
            base = next(b for b in rows if b["batch_size"] == r["batch_size"] and b["power_limit_w"] == 250)
            assert r["time_rel_simulated"] > 1.05
            assert energy_rel / base["avg_power_simulated_w"] < 0.95


# -- the H100, fitted to read-only measurements of a real one (experiments/calibrate_h100.py) ------------------------

H100_REPORTED = json.loads((EXPERIMENTS / "h100_calibration_residuals.json").read_text())


@pytest.fixture(scope="module")
def h100_rows():
    from freqopt.gpu.calibration import h100 as calibration_h100
    points = calibration_h100.load_points(EXPERIMENTS / "data" / "h100")
    return calibration_h100.residuals(get_gpu("h100-sxm"), points)


def test_h100_residuals_within_what_the_fit_reported(h100_rows):
    from freqopt.gpu.calibration.h100 import summarize

    assert len(h100_rows) == len(H100_REPORTED["points"])
    got = summarize(h100_rows)
    for key, reported in H100_REPORTED["summary"].items():
        assert got[key]["n"] == reported["n"]
        assert got[key]["max_abs"] <= reported["max_abs"] + 0.01, key
        assert got[key]["rms"] <= reported["rms"] + 0.01, key


def test_h100_fit_meets_its_aims(h100_rows):
    """Power within 5 % rms and the power limit's throttled GEMM clocks within 3 % rms of the real H100's."""
    from freqopt.gpu.calibration.h100 import summarize

    got = summarize(h100_rows)
    assert got["power_error_pct"]["rms"] < 5.0
    assert got["clock_error_pct"]["rms"] < 3.0
    assert got["time_error_pct"]["rms"] < 10.0


def test_h100_throttles_large_gemms_and_not_launch_bound_ones(h100_rows):
    """The measured behaviour: a sustained 8192^3 GEMM is held near 1358 MHz at the 700 W limit; a launch-bound
    1024^3 GEMM runs at 1980 MHz and draws about 320 W, since the GPU idles between kernels at ~124 W."""
    rows = {r["point"]: r for r in h100_rows}
    big = rows["micro/gemm_bf16_8192"]
    assert 1300 < big["clock_simulated_mhz"] < 1500 and abs(big["power_simulated_w"] - 700) < 1
    small = rows["micro/gemm_bf16_1024"]
    assert 250 < small["power_simulated_w"] < 380
    idle = rows["idle/context at 1980 MHz"]
    assert abs(idle["power_error_pct"]) < 5


# -- the H100's whole training steps (experiments/fit_whole_steps.py) ------------------------------------------------

STEPS_REPORTED = json.loads((EXPERIMENTS / "h100_whole_steps_residuals.json").read_text())
WHOLE_STEPS_AIM_PCT = 5.0  # issue 23: the four shared steps within 5 % in time and in energy


@pytest.fixture(scope="module")
def whole_steps():
    from freqopt.gpu.calibration import h100_steps as calibration_steps
    steps = calibration_steps.load_steps(EXPERIMENTS / "data" / "h100" / "whole_steps")
    return calibration_steps.residuals(get_gpu("h100-sxm"), steps, calibration_steps.trace_steps(steps))


@pytest.mark.slow
def test_whole_h100_steps_within_five_percent(whole_steps):
    """`freqopt profile`'s step (SimulatedGPU.step at default settings) against the four measured H100 steps."""
    assert len(whole_steps["steps"]) == 4
    for r in whole_steps["steps"]:
        assert abs(r["time_error_pct"]) <= WHOLE_STEPS_AIM_PCT, (r["step"], r["time_error_pct"])
        assert abs(r["energy_error_pct"]) <= WHOLE_STEPS_AIM_PCT, (r["step"], r["energy_error_pct"])


@pytest.mark.slow
def test_freqopt_profile_gives_the_calibrations_h100_step(whole_steps, tmp_path, capsys):
    """`freqopt profile --attention sdpa` (the program the measured H100 steps ran: cuDNN's attention) simulates the
    same step the calibration and experiments/h200_check.md's 'Carried to the H100' judge, to the last digit; the
    default (freqopt's FlashAttention-2 op) is another program, slower on Hopper (attention_rate_rel)."""
    from freqopt.cli import main
    from freqopt.measure.profile import profile
    from freqopt.workload.models import get_workload

    row = next(r for r in whole_steps["steps"] if r["step"] == "gpt3-small-1-2048")
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "gpt3-small", "--micro-batch-size", "1", "--seq-len", "2048", "--gpu",
                 "h100-sxm", "--attention", "sdpa", "--json", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["time_s"] == pytest.approx(row["time_simulated_s"], rel=1e-9)
    assert doc["energy_j"] == pytest.approx(row["energy_simulated_j"], rel=1e-9)
    flash = profile(get_workload("gpt3-small", micro_batch_size=1, seq_len=2048), gpu="h100-sxm")
    assert flash.by_kind["attention"].time_s > 1.2 * doc["by_kind"]["attention"]["time_s"]


@pytest.mark.slow
def test_h100_whole_steps_left_out_as_recorded():
    """experiments/h100_whole_steps_loo.json (the left-out figures docs/gpus.md and docs/limits.md quote): each step
    left out of the whole-step fit and predicted again gives the recorded errors."""
    from freqopt.gpu.calibration import h100_steps as calibration_steps

    recorded = {r["step"]: r for r in json.loads((EXPERIMENTS / "h100_whole_steps_loo.json").read_text())["steps"]}
    steps = calibration_steps.load_steps(EXPERIMENTS / "data" / "h100" / "whole_steps")
    got = {r["step"]: r for r in calibration_steps.leave_one_out(get_gpu("h100-sxm"), steps,
                                                                   calibration_steps.trace_steps(steps))}  # fmt: skip
    assert set(got) == set(recorded) == {s.name for s in steps}
    for name, r in recorded.items():
        assert got[name]["time_error_pct"] == pytest.approx(r["time_error_pct"], abs=0.05), name
        assert got[name]["energy_error_pct"] == pytest.approx(r["energy_error_pct"], abs=0.05), name


@pytest.mark.slow
def test_whole_step_residuals_within_what_the_fit_reported(whole_steps):
    from freqopt.gpu.calibration.h100_steps import summarize

    got = summarize(whole_steps)
    for key, reported in STEPS_REPORTED["summary"].items():
        assert got[key] <= reported + 0.01, key
    assert len(whole_steps["classes"]) == len(STEPS_REPORTED["classes"])


@pytest.mark.slow
def test_launch_bound_step_waits_for_the_host(whole_steps):
    """gpt3-small at micro-batch 1: the GPU is busy 10 ms of a 27.6 ms step; the simulated step is the host's,
    at well under the power of the steps the GPU is busy in."""
    rows = {r["step"]: r for r in whole_steps["steps"]}
    small = rows["gpt3-small-1-2048"]
    assert small["time_simulated_s"] > 2.5 * small["busy_measured_s"]
    assert small["power_simulated_w"] < 0.5 * rows["gpt3-small-8-2048"]["power_simulated_w"]


# The DVFS power model fitted on Perseus's measured stage sweeps (experiments/fit_dvfs.py, issue 23 item 2).
DVFS = json.loads((EXPERIMENTS / "dvfs_fit_residuals.json").read_text())


# The A100's BLOOM stage is now fitted with the A100 PCIe pipelines (experiments/fit_a100_power.py, issue 56): its
# guard is below; fit_dvfs.py's figures for it are the pre-issue-56 fit's.
@pytest.mark.parametrize("stage", sorted(s for s in DVFS["summary"] if s != "bloom+a100"))
def test_dvfs_sweeps_within_what_the_fit_reported(stage):
    from freqopt.gpu.calibration import dvfs as cd
    s = cd.STAGES[stage]
    got = cd.summarize(cd.residuals(get_gpu(s.gpu), s, cd.load_sweep(EXPERIMENTS / "data" / "perseus" / s.file)))
    reported = DVFS["summary"][stage]
    for key in ("max_abs_time_rel_error_pp", "max_abs_energy_rel_error_pp"):
        assert got[key] <= reported[key] + 0.01, key
    assert abs(got["energy_optimal_miss_mhz"]) <= abs(reported["energy_optimal_miss_mhz"])


A100_FIT = json.loads((EXPERIMENTS / "a100_power_fit.json").read_text())


@pytest.fixture(scope="module")
def a100_fit():
    spec = importlib.util.spec_from_file_location("fit_a100_power", EXPERIMENTS / "fit_a100_power.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_a100_constants_reproduce_the_joint_fit_and_its_left_out_folds(a100_fit):
    """experiments/fit_a100_power.py (issue 56): the committed A100 files give the fitted-on errors it reported, and
    each fold's stored values, re-run through today's physics, give its left-out errors (a physics change that moves
    them fails here until the script is re-run)."""
    sets = a100_fit.data_sets()
    assert set(sets) == set(A100_FIT["fitted_on"]) == set(A100_FIT["folds"])
    for name, item in sets.items():
        got = a100_fit.errors(None, name, item)
        want = A100_FIT["fitted_on"][name]
        for key in ("max_abs_time_rel_error_pp", "max_abs_energy_rel_error_pp"):
            assert got[key] == pytest.approx(want[key], abs=0.05), (name, key)
        fold = A100_FIT["folds"][name]
        left = a100_fit.errors(fold["values"], name, item)
        for key in ("max_abs_time_rel_error_pp", "max_abs_energy_rel_error_pp"):
            assert left[key] == pytest.approx(fold["left_out"][key], abs=0.05), (name, key)


def test_the_a100_joint_fit_beats_the_bloom_only_fit_on_the_pcie_pipelines():
    """Before issue 56 the BLOOM-only fit missed the PCIe board's pipelines by 31-40 pp of time under a 175 W limit;
    fitted on all, each is within 8 pp, and the BLOOM stage stays within 4 pp (time) and 3 pp (energy)."""
    for name, before in A100_FIT["before"].items():
        after = A100_FIT["fitted_on"][name]
        if before["kind"] == "power-limit sweep":
            assert before["max_abs_time_rel_error_pp"] > 30 and after["max_abs_time_rel_error_pp"] < 8
        else:
            assert after["max_abs_time_rel_error_pp"] < 4 and after["max_abs_energy_rel_error_pp"] < 3


def test_load_sweep_refuses_a_stage_it_lacks(tmp_path):
    from freqopt.gpu.calibration import dvfs as cd
    path = tmp_path / "s.csv"
    path.write_text("# source\nstage,instruction,frequency,time,energy\n0,forward,1410,0.05,24\n")
    with pytest.raises(ValueError, match="lacks its forward or backward"):
        cd.load_sweep(path)
    with pytest.raises(ValueError, match="holds no row of stage 3"):
        cd.load_sweep(path, stage=3)


# -- the H200, checked on a real one (experiments/h200_check.py; issue 49) ------------------------------------------
H200_REPORTED = json.loads((EXPERIMENTS / "h200_check_residuals.json").read_text())
H200_DATA = EXPERIMENTS / "data" / "h200"


@pytest.fixture(scope="module")
def h200_points():
    from freqopt.gpu.calibration import h200

    return (h200.load_atlas(H200_DATA / "kernel_atlas.json") + h200.load_convolutions(H200_DATA / "convolutions.json")
            + h200.load_replayed(H200_DATA / "device_check.json") + h200.load_replayed_gemms(H200_DATA / "device_check.json")
            + [h200.load_sustained_gemm(H200_DATA / "waiting_power.json")])  # fmt: skip


def test_h200_committed_kernel_model_predicts_every_shape_as_reported(h200_points):
    """The committed h200-sxm, with the measuring loops' host times the report states, predicts each shape as the
    report's committed figures: the committed constants and the report agree (a refit that moved them, or a physics
    change, fails here until experiments/h200_check.py is re-run)."""
    from freqopt.gpu.calibration import h200

    spec = get_gpu("h200-sxm")
    harness = H200_REPORTED["harness_us"]
    by_label = {(name, r["label"]): r for name, fam in H200_REPORTED["families"].items() for r in fam["rows"]}
    assert len(by_label) == len(h200_points) == 198  # 183 atlas and convolution timings, 2 FA2, 12 replayed GEMMs, 1 sustained
    for p in h200_points:
        reported = by_label[(p.family, p.label)]
        assert h200.predict(spec, p, harness) == pytest.approx(reported["committed_s"], rel=1e-9), (p.family, p.label)
        assert reported["measured_s"] == p.measured_s


def test_h200_attention_backward_left_out_uses_no_constant_fitted_on_its_shape():
    """Leaving an attention shape out of the backward's fit refits the forward's constants (d and key terms, its loop's
    host time) without that shape too: the left-out prediction moves neither with the constants the spec came with
    nor with that shape's forward timing. (With the forward's constants fitted on every shape, b256 h12 s197 d64 read
    -11.3 %; truly left out it is -21.9 %.) Six of the nine shapes, for a fast fit."""
    import dataclasses

    from freqopt.gpu.calibration import h200

    atlas = json.loads((H200_DATA / "kernel_atlas.json").read_text())["sdpa"]
    points = [p for r in atlas[:5] + [r for r in atlas if r["b"] == 256] for p in h200._sdpa_points(r)]
    label = points[-1].label
    assert label == "b256 h12 s197 d64"
    spec = get_gpu("h200-sxm")

    def left_out(spec, points):
        return h200.leave_one_out(spec, points, "attention backward", labels=[label])[0]["predicted_s"]

    reference = left_out(spec, points)
    other_spec = dataclasses.replace(spec, attention_efficiency=0.6 * spec.attention_efficiency,
                                     attention_key_overhead=3 * spec.attention_key_overhead)  # fmt: skip
    assert left_out(other_spec, points) == pytest.approx(reference, rel=1e-6)
    moved = [dataclasses.replace(p, measured_s=2 * p.measured_s) if p.label == label and p.family == "attention forward"
             else p for p in points]  # fmt: skip
    assert left_out(spec, moved) == pytest.approx(reference, rel=1e-6)


def test_h200_harness_bound_shapes_are_not_counted_as_checks():
    """A shape the measuring loop's host binds (bound "harness") times the loop, not the kernel: each family's judged
    figures leave it out and count it apart."""
    for name, fam in H200_REPORTED["families"].items():
        rows = [r for r in fam["rows"] if not r["alone"]]
        judged = [r for r in rows if r["bound"] != "harness"]
        s = fam["summary"]
        assert s["judged"] == len(judged) and s["harness_bound"] == len(rows) - len(judged), name
        if judged:
            assert s["mean_abs_pct"] == pytest.approx(sum(abs(r["error_pct"]) for r in judged) / len(judged)), name


# Families that miss issue 49's 15 % on the shapes that check their kernel model, held to what the report records
# (mean |error| in %, left out): the memory-bound backward's six kernel-bound shapes (the other 19 time the
# measuring loop) miss by 20.5 % on average (a layer norm's backward at 4096 columns +48 %).
H200_FAMILIES_OVER_TARGET_PCT = {"memory-bound backward": 20.5}


def test_h200_kernel_families_within_15_percent_left_out():
    """Issue 49's target: each family of kernel_atlas.json and convolutions.json predicted within 15 % (mean |error|
    over its shapes, each predicted by a fit on the others), over the shapes that check the kernel model: not those
    bound by the measuring loop's host (bound "harness"). A family recorded over the target is held to its record."""
    families = H200_REPORTED["families"]
    required = {"GEMM", "attention forward", "attention backward", "memory-bound forward", "memory-bound backward",
                "convolution forward", "convolution data gradient", "convolution weight gradient", "batch norm forward",
                "batch norm backward", "cross-entropy forward", "cross-entropy backward"}  # fmt: skip
    assert required <= set(families)
    for name in required:
        rows = [r for r in families[name]["rows"] if not r["alone"] and r["bound"] != "harness"]
        errors = [abs(100 * (r["predicted_s"] / r["measured_s"] - 1)) for r in rows]  # recomputed from the figures
        assert len(rows) >= 4, name
        assert sum(errors) / len(errors) <= H200_FAMILIES_OVER_TARGET_PCT.get(name, 15.0) + 0.05, name


def test_h200_waiting_power_and_steps_as_reported():
    """The H200's whole steps recomputed with the committed files match the report, and the carried prediction of the
    waiting power (before the file took the measurement) is within 10 % of the measured 121.5 W."""
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    wait = H200_REPORTED["power"][0]
    assert wait["check"].startswith("waiting") and abs(wait["simulated_w"] / wait["measured_w"] - 1) < 0.10
    spec = get_gpu("h200-sxm")
    device = json.loads((H200_DATA / "device_check.json").read_text())
    reported = {r["step"]: r for r in H200_REPORTED["steps"]}
    for row in device["training_steps"]:
        if (row["model"], row["micro_batch_size"]) not in (("gpt3-small", 1), ("gpt3-small", 4)):
            continue  # the two that bound the host; the larger ones trace for seconds each
        kernels = list(trace_training_iteration(get_workload(row["model"], micro_batch_size=row["micro_batch_size"],
                                                             seq_len=row["seq_len"])).kernels)  # fmt: skip
        m = SimulatedGPU(spec, noise=False).step(kernels)
        r = reported[f"{row['model']} micro-batch {row['micro_batch_size']}"]
        assert m.time_s == pytest.approx(r["time_simulated_s"], rel=1e-6)
        assert m.energy_j == pytest.approx(r["energy_simulated_j"], rel=1e-6)
        assert r["time_measured_s"] == row["measured"]["time_s"]
