"""Zeus's power-limit sweeps on the simulated GPU and the A40's joint fit (issue 56; experiments/fit_a40_power.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.calibration import zeus as cz
from freqopt.gpu.specs import get_gpu

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
DATA = EXPERIMENTS / "data" / "zeus" / "nsdi23" / "summary_power_a40_shared.csv"
FIT = json.loads((EXPERIMENTS / "a40_power_fit.json").read_text())
# The two sweeps of the examples (the others are in the report; tracing each costs seconds).
GUARDED = {"shufflenetv2": (1024,), "bert_base_uncased": (128,), "deepspeech2": (64,)}


@pytest.fixture(scope="module")
def sweeps():
    return {s.name: s for s in cz.load_sweeps(DATA, tuple(GUARDED), GUARDED)}


def test_load_sweeps_reads_one_sweep_per_network_and_batch_size(sweeps):
    s = sweeps["shufflenetv2@1024"]
    assert s.gpu == "a40" and s.dataset == "cifar100"
    assert list(s.power_limit_w) == [100, 125, 150, 175, 200, 225, 250, 275, 300]
    assert s.average_power_w[0] == pytest.approx(106.888812, rel=1e-6)
    assert s.energy_j[-1] == pytest.approx(s.time_per_epoch_s[-1] * s.average_power_w[-1])
    assert list(sweeps["bert_base_uncased@128"].power_limit_w) == [100, 150, 200, 250, 300]


def test_load_sweeps_refuses_a_file_without_the_networks(tmp_path):
    path = tmp_path / "summary_power_x.csv"
    path.write_text("dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
                    "d,net,8,sgd,100,1.0,90\nd,net,8,sgd,100,1.1,91\n")
    with pytest.raises(ValueError, match="holds no row"):
        cz.load_sweeps(path, ("other",))
    with pytest.raises(ValueError, match="repeats a power limit"):
        cz.load_sweeps(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shufflenetv2@1024", "bert_base_uncased@128", "deepspeech2@64"])
def test_the_committed_a40_reproduces_the_reported_fitted_on_errors(sweeps, name):
    network = name.split("@")[0]
    got = cz.summarize(cz.sweep_errors(get_gpu("a40"), sweeps[name]))
    reported = FIT["fitted_on"][network][name]
    for key in ("max_abs_time_rel_error_pp", "max_abs_energy_rel_error_pp", "max_abs_avg_power_error_w"):
        assert got[key] == pytest.approx(reported[key], abs=0.05), key
    assert got["energy_optimal_error_w"] == reported["energy_optimal_error_w"]


def test_deepspeech2_is_traced_in_cudnns_kernel_structure():
    """Per layer, direction and time step: one recurrent GEMM and one fused cell kernel forward, the cell's backward
    and one GEMM for the hidden state's gradient backward; the recurrent weights' gradient is ONE GEMM per layer and
    direction over every step (an unrolled loop's autograd would run one per step, and an add of its 16 MB)."""
    batch, steps, layers, hidden = 8, cz.DEEPSPEECH2_FRAMES // 2, 5, 1024
    kernels = cz.network_trace("deepspeech2", batch, "librispeech").kernels
    cells = [k for k in kernels if k.name == "aten._thnn_fused_lstm_cell"]
    cells_backward = [k for k in kernels if k.name == "aten._thnn_fused_lstm_cell_backward_impl"]
    assert len(cells) == len(cells_backward) == layers * 2 * steps
    recurrent = [k for k in kernels if k.kind == "gemm" and k.flops == 2 * batch * hidden * 4 * hidden]
    assert len(recurrent) == 2 * layers * 2 * steps  # forward's h W_hh^T and backward's dgates W_hh
    # A (4H, H) weight gradient over every step: one per recurrent matrix (a layer's two directions) and one per
    # input matrix of the layers after the first (theirs is H wide; the first layer's is the convolutions' 1312).
    weight_grads = [k for k in kernels if k.kind == "gemm" and k.shapes == ((4 * hidden, steps * batch),
                                                                              (steps * batch, hidden))]
    assert len(weight_grads) == layers * 2 + (layers - 1) * 2
    assert not [k for k in kernels if k.name == "aten.add" and k.mem_bytes >= 4 * hidden * hidden * 4]


def test_the_a40s_175_w_cliff_is_gone(sweeps):
    """Issue 56: every limit at or below 175 W fell to the lowest clock (ShuffleNetV2 at batch 1024: 1.93x the 300 W
    time at 175 W, measured 1.08x). The refit runs it above the lowest clock and within 8 pp of the measurement."""
    spec = get_gpu("a40")
    trace = cz.network_trace("shufflenetv2", 1024, "cifar100")
    m = SimulatedGPU(spec, noise=False).true_measure(trace.kernels, ClockSetting(power_limit_w=175.0))
    assert m.sm_clock_mhz > min(spec.sm_clocks_mhz) + 300
    point = {p["power_limit_w"]: p for p in cz.sweep_errors(spec, sweeps["shufflenetv2@1024"])["points"]}[175.0]
    assert abs(point["time_rel_error_pp"]) <= 8


def test_sweep_errors_flags_averages_above_the_limit(sweeps):
    """Zeus's A40 averaged 107 W under a 100 W limit; the comparison says so rather than clipping the average, and
    flags the simulated average by the same rule (the refit holds it at 100.4 W there: its lowest
    clock's floor, 6.5 W under the measured one, is a miss of the power model that the flag shows)."""
    r = cz.sweep_errors(get_gpu("a40"), sweeps["shufflenetv2@1024"])
    first = r["points"][0]
    assert first["power_limit_w"] == 100 and not first["limit_met_measured"]
    assert all(p["limit_met_measured"] for p in r["points"][4:])
    for p in r["points"]:
        assert p["limit_met_simulated"] == (p["avg_power_simulated_w"] <= p["power_limit_w"] + 1.0)
        assert p["limit_met_measured"] == (p["avg_power_measured_w"] <= p["power_limit_w"] + 1.0)
    assert all(p["firmware_limit_met_simulated"] for p in r["points"][2:])
    assert r["energy_optimal_measured_w"] == 175.0


def test_the_anchored_host_gap_matches_the_highest_limits_power(sweeps):
    s = sweeps["bert_base_uncased@128"]
    r = cz.sweep_errors(get_gpu("a40"), s)
    assert r["host_gap_s"] > 0
    assert r["points"][-1]["avg_power_simulated_w"] == pytest.approx(s.average_power_w[-1], rel=1e-6)
    fixed = cz.sweep_errors(get_gpu("a40"), s, host_gap_s=0.0)
    assert fixed["host_gap_s"] == 0.0 and fixed["points"][-1]["avg_power_simulated_w"] > s.average_power_w[-1]


def test_every_fold_stores_parameters_within_the_a40s_bounds():
    """The scoreboard re-predicts left-out workloads from the stored fold parameters: each fold has every fitted
    parameter, inside the file's physical range."""
    bounds = dict(get_gpu("a40").power_model_bounds)
    top = get_gpu("a40").max_sm_clock_mhz
    for name, fold in FIT["folds"].items():
        p = fold["parameters"]
        assert set(cz.FIT_PARAMETERS) <= set(p), name
        for key in cz.FIT_PARAMETERS:
            lo, hi = bounds["f_knee_mhz"] if key == "f_knee_rel" else bounds[key]
            value = p[key] * top if key == "f_knee_rel" else p[key]
            assert lo - 1e-6 <= value <= hi + 1e-6, (name, key)
    assert np.isfinite([f["cost"] for f in FIT["folds"].values()]).all()


def test_a_stored_fold_re_predicts_its_left_out_sweep(sweeps):
    """What the fidelity scoreboard does: rebuild the fold fitted without bert-base from its stored parameters and
    predict the sweep it never saw; the figure is the report's left-out one."""
    from freqopt.gpu.calibration import dvfs as cd

    fold = cd.with_values(get_gpu("a40"), FIT["folds"]["bert_base_uncased"]["parameters"])
    got = cz.summarize(cz.sweep_errors(fold, sweeps["bert_base_uncased@128"]))
    reported = FIT["left_out"]["bert_base_uncased"]["bert_base_uncased@128"]
    assert got["max_abs_time_rel_error_pp"] == pytest.approx(reported["max_abs_time_rel_error_pp"], abs=0.05)
    assert got["max_abs_energy_rel_error_pp"] == pytest.approx(reported["max_abs_energy_rel_error_pp"], abs=0.05)


def test_a_network_on_two_datasets_gets_two_sweeps_and_two_traces(tmp_path):
    """The Quadro RTX 6000's file has bert-base on Sentiment140 and on SQuAD at the same batch size: two sweeps, each
    labelled by its dataset, and SQuAD's step is the 384-token one."""
    path = tmp_path / "summary_power_x.csv"
    path.write_text("dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
                    "sentiment140,bert_base_uncased,8,adamw,100,1.0,90\nsquad,bert_base_uncased,8,adamw,100,2.0,95\n")
    sweeps = cz.load_sweeps(path)
    assert [s.label for s in sweeps] == ["sentiment140/bert_base_uncased@8", "squad/bert_base_uncased@8"]
    squad = cz.network_trace("bert_base_uncased", 8, "squad")
    sentiment = cz.network_trace("bert_base_uncased", 8, "sentiment140")
    assert squad.total_flops > 2.5 * sentiment.total_flops
