"""Reproduce McDonald et al. 2022 with freqopt: energy and time against power cap on a V100, BERT and DistilBERT,
training and inference.

    python experiments/repro_mcdonald.py       # about a minute; writes experiments/mcdonald/

Paper: "Great Power, Great Responsibility: Recommendations for Reducing Energy for Training Language Models"
(arXiv 2205.09646, Findings of NAACL 2022); its figures as quoted in shared/calibration/published.md.
Setup here: the simulated v100-pcie (250 W default, the calibrated GPU), caps 100-250 W, masked-language-model
training (one step) and inference (one batch) of bert-base and distilbert, FP16 on tensor cores (V100 has no
BF16), sequence 128 and 32 sequences per batch (BERT's phase-1 pre-training shape; the paper does not give its
own). The paper's training figures are calibration data (experiments/calibrate.py fits the V100 and this
workload's host gap per step to them, beside the Zeus sweep), so the training rows agree by construction to
within the fit's residuals; inference, which the fit never saw, is the model's prediction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.calibration.h100_steps import HOST_SPLIT_US
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import get_workload
from freqopt.search.powercap import sweep_power_caps
from freqopt.files import atomic_write_text
from freqopt.workload.trace import trace_iteration

OUT = Path(__file__).resolve().parent / "mcdonald"
GPU = "v100-pcie"
CAPS_W = [100.0, 150.0, 200.0, 250.0]
MODELS = ["bert-base", "distilbert"]
MODES = ["train", "inference"]
SEQ_LEN, BATCH = 128, 32

# The paper's figures (published.md), as (time_rel, energy_rel) or single numbers; None where it gives none.
PAPER = {
    "BERT training, 150 W: time": 1.085,
    "BERT training, 150 W: energy": 0.877,
    "training average, 150 W: time": 1.068,
    "training average, 150 W: energy": 0.863,
    "training average, 100 W: time": 1.314,
}


def fitted_host_gap_s() -> float:
    """The host gap per step that experiments/calibrate.py fitted to this paper's training figures."""
    residuals = json.loads((Path(__file__).resolve().parent / "calibration_residuals.json").read_text())
    return residuals["host_gaps_s"]["mcdonald_host_gap_s"]


def host_work_us(trace) -> float:
    """The host's work to issue one step of ``trace``, us, up to one factor: its kernels' host time per kernel by pass
    (freqopt/gpu/calibration/h100_steps.py HOST_SPLIT_US, measured on a CPU)."""
    return sum(HOST_SPLIT_US[k.pass_name] for k in trace.kernels)


def host_gap_s(trace, train_trace) -> float:
    """The host gap of one step of ``trace``, s: the gap fitted to training steps, scaled by ``trace``'s share of the
    training step's host work (an inference batch issues only a forward; an upper bound, since no_grad skips
    autograd's part)."""
    return fitted_host_gap_s() * host_work_us(trace) / host_work_us(train_trace)


def _no_gap_inference_time_rel() -> float:
    """bert-base inference at 100 W relative to 250 W with no host gap: the busy GPU's slowdown."""
    trace = trace_iteration(get_workload("bert-base", seq_len=SEQ_LEN, micro_batch_size=BATCH), "inference",
                            dtype=torch.float16)  # fmt: skip
    _, points = sweep_power_caps(trace, SimulatedGPU(get_gpu(GPU), seed=0), [100.0, 250.0], host_gap_s=0.0)
    return next(p.time_rel for p in points if p.power_limit_w == 100.0)


def run() -> tuple[dict, dict[str, float]]:
    """The curves per "model mode", and per model the host gap of one inference batch (s)."""
    spec = get_gpu(GPU)
    curves, inference_gaps = {}, {}
    for model in MODELS:
        workload = get_workload(model, seq_len=SEQ_LEN, micro_batch_size=BATCH)
        traces = {mode: trace_iteration(workload, mode, dtype=torch.float16) for mode in MODES}
        inference_gaps[model] = host_gap_s(traces["inference"], traces["train"])
        for mode, trace in traces.items():
            _, points = sweep_power_caps(trace, SimulatedGPU(spec, seed=0), CAPS_W,
                                         host_gap_s=host_gap_s(trace, traces["train"]))  # fmt: skip
            curves[f"{model} {mode}"] = [
                {"power_limit_w": p.power_limit_w, "time_rel": p.time_rel, "energy_rel": p.energy_rel,
                 "avg_power_w": p.avg_power_w} for p in points
            ]  # fmt: skip
    return curves, inference_gaps


def at(curve: list[dict], cap: float, key: str) -> float:
    return next(p[key] for p in curve if p["power_limit_w"] == cap)


def ours(curves: dict) -> dict[str, float]:
    train = [curves[f"{m} train"] for m in MODELS]
    return {
        "BERT training, 150 W: time": at(curves["bert-base train"], 150, "time_rel"),
        "BERT training, 150 W: energy": at(curves["bert-base train"], 150, "energy_rel"),
        "training average, 150 W: time": sum(at(c, 150, "time_rel") for c in train) / len(train),
        "training average, 150 W: energy": sum(at(c, 150, "energy_rel") for c in train) / len(train),
        "training average, 100 W: time": sum(at(c, 100, "time_rel") for c in train) / len(train),
    }


def report(curves: dict, inference_gaps: dict[str, float]) -> str:
    mine = ours(curves)
    lines = ["# McDonald et al. 2022 reproduced with freqopt (simulated V100-PCIe, 250 W default)", "",
             "Produced by `python experiments/repro_mcdonald.py`. Relative to the 250 W run; the paper's column is "
             "its published figure (shared/calibration/published.md). The paper averages BERT, DistilBERT and "
             "BigBird; freqopt has no BigBird, so our average is over BERT and DistilBERT. These training figures "
             "are calibration data (see below).", "",
             "| figure | paper | freqopt | difference (pp) |", "|---|---:|---:|---:|"]  # fmt: skip
    for key, paper in PAPER.items():
        lines.append(f"| {key} | {paper:.3f} | {mine[key]:.3f} | {100 * (mine[key] - paper):+.1f} |")
    lines += ["", "Qualitative claim of the paper at 200 W: about the same time as 250 W, a smaller energy saving than "
              "150 W. freqopt, training:", ""]
    for m in MODELS:
        c = curves[f"{m} train"]
        lines.append(f"- {m}: 200 W time {at(c, 200, 'time_rel'):.3f}, energy {at(c, 200, 'energy_rel'):.3f}; "
                     f"150 W energy {at(c, 150, 'energy_rel'):.3f}")
    lines += ["", "## What agrees by construction and what is predicted", "",
              "The training figures above are calibration data: the V100's power model and this workload's host gap "
              f"per step ({1e3 * fitted_host_gap_s():.1f} ms, time the GPU idles between steps) were fitted to them "
              "together with the Zeus sweep, so their agreement measures the fit, not the model. The Zeus runs needed "
              "a shorter gap; their time under a cap is much steeper: "
              + ", ".join(f"{t:.3f} at {cap:.0f} W" for cap, t in sorted(_zeus_rel("time").items()))
              + " relative to 250 W, averaged over batch sizes. The inference curves below were never fitted: they "
              "are freqopt's prediction, for which the paper gives no figures to compare (a held-out check has them). "
              "An inference batch issues only a forward, so its gap is the forward's share of the training step's "
              "host work, by the host's time per kernel in each pass (freqopt/gpu/calibration/h100_steps.py HOST_SPLIT_US): "
              + ", ".join(f"{m} {1e3 * g:.1f} ms" for m, g in inference_gaps.items())
              + ". That is an upper bound (no_grad skips autograd's share), and the prediction hangs on it: with no "
              "gap at all, the same physics slows bert-base inference "
              f"{_no_gap_inference_time_rel():.2f}x at 100 W. Under a cap the busy GPU's slowdown is the Zeus "
              "sweep's, which the calibration reproduces to within a few points at 100 W "
              "(experiments/calibration.md).", ""]  # fmt: skip
    lines += ["", "## All curves", "", "| model, mode | cap (W) | time (rel) | energy (rel) | avg power (W) |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, curve in curves.items():
        for p in curve:
            lines.append(f"| {name} | {p['power_limit_w']:.0f} | {p['time_rel']:.3f} | {p['energy_rel']:.3f} | "
                         f"{p['avg_power_w']:.1f} |")
    return "\n".join(lines) + "\n"


def _zeus_rel(what: str) -> dict[float, float]:
    """Time or energy relative to 250 W in the calibration data (Zeus V100 BERT/SQuAD sweep), averaged over batch
    sizes; energy per epoch = time x average power."""
    from freqopt.gpu.calibration.v100 import load_zeus_points

    points = load_zeus_points(Path(__file__).resolve().parent / "data" / "zeus_v100_bert_squad.csv")

    def value(p):
        return p.time_per_epoch_s * (p.average_power_w if what == "energy" else 1.0)

    base = {p.batch_size: value(p) for p in points if p.power_limit_w == 250}
    out: dict[float, list[float]] = {}
    for p in points:
        if p.power_limit_w in (100, 150, 200):
            out.setdefault(p.power_limit_w, []).append(value(p) / base[p.batch_size])
    return {cap: sum(v) / len(v) for cap, v in out.items()}


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name, curve in curves.items():
        caps = [p["power_limit_w"] for p in curve]
        ax_t.plot(caps, [p["time_rel"] for p in curve], marker="o", label=name)
        ax_e.plot(caps, [p["energy_rel"] for p in curve], marker="o", label=name)
    ax_t.errorbar([150], [PAPER["BERT training, 150 W: time"]], fmt="k*", ms=12, label="paper: BERT training")
    ax_e.errorbar([150], [PAPER["BERT training, 150 W: energy"]], fmt="k*", ms=12, label="paper: BERT training")
    ax_t.plot([100, 150], [PAPER["training average, 100 W: time"], PAPER["training average, 150 W: time"]], "kx",
              ms=10, label="paper: training average")  # fmt: skip
    ax_e.plot([150], [PAPER["training average, 150 W: energy"]], "kx", ms=10, label="paper: training average")
    for ax, what in ((ax_t, "time"), (ax_e, "energy")):
        ax.set_xlabel("power limit (W)")
        ax.set_ylabel(f"{what} relative to 250 W")
        ax.grid(alpha=0.3)
    ax_e.legend(fontsize=7)
    fig.suptitle("Power capping a V100 (simulated), McDonald et al. 2022 setting")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    curves, inference_gaps = run()
    text = report(curves, inference_gaps)
    OUT.mkdir(exist_ok=True)
    atomic_write_text(OUT / "results.json", json.dumps(curves, indent=1) + "\n")
    atomic_write_text(OUT / "report.md", text)
    plot(curves, OUT / "power_cap.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
