"""Fit the simulated H100's training step to whole steps measured on a real H100 (experiments/data/h100/whole_steps/).

    python experiments/fit_whole_steps.py                       # fit; write h100-sxm.toml's block, report, residuals
    python experiments/fit_whole_steps.py --check               # only print the committed constants' residuals
    python experiments/fit_whole_steps.py --measure-host-split  # time the passes of a tiny model on this CPU
    python experiments/fit_whole_steps.py --leave-one-out       # each step predicted by the fit on the other three

Writes the ``whole_steps`` block of search_spaces/h100-sxm.toml, experiments/h100_whole_steps_residuals.json
(guarded by tests/test_calibration.py) and experiments/h100_whole_steps.md; ``--leave-one-out`` writes
experiments/h100_whole_steps_loo.json (each step left out of the fit and predicted; no GPU file written), which the
report quotes and docs/gpus.md's real-steps table reads. Method, classes and assumptions:
freqopt/gpu/calibration/h100_steps.py. Each workload is traced once (gpt3-2.7b takes seconds) and its kernels reused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from freqopt.gpu.calibration import h100_steps as cal
from freqopt.gpu.host import get_host, hosts_dir
from freqopt.gpu.specs import get_gpu, replace_toml_block, search_spaces_dir
from freqopt.files import atomic_write_text

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "h100" / "whole_steps"
RESIDUALS = HERE / "h100_whole_steps_residuals.json"
REPORT = HERE / "h100_whole_steps.md"
LOO = HERE / "h100_whole_steps_loo.json"
GPU = "h100-sxm"
MARKER = "whole_steps"
# The simulated steps before this fit (experiments/device/README.md: predictions registered at issue 11, the same
# workloads; the whole steps above measured them), time (ms) and energy (J).
BEFORE = {"gpt3-small-1-2048": (9.10, 4.78), "gpt3-small-8-2048": (38.83, 26.23), "gpt3-xl-4-2048": (147.77, 99.16),
          "gpt3-2.7b-4-2048": (281.74, 188.69)}  # fmt: skip


def write_toml(spec) -> None:
    """Replace the GPU file's whole_steps block and the host file's step block with the fitted values."""
    path = search_spaces_dir() / f"{GPU}.toml"
    v = cal.current_values(spec)
    host = ", ".join(f"{p} {us:g} us" for p, us in cal.HOST_SPLIT_US.items())
    body = [
        "# Fitted to whole training steps measured on a real H100 (experiments/data/h100/whole_steps; method:",
        "# freqopt/gpu/calibration/h100_steps.py; residuals: experiments/h100_whole_steps.md).",
        "[operator_bandwidth_rel]",
        "# Device-memory bandwidth relative to a streaming copy's, at rows of 768 elements (fitted on the kernel",
        "# classes torch.profiler timed in the steps): multi_tensor = PyTorch's _foreach_/_fused_ operators",
        "# (multi_tensor_apply_kernel: fused AdamW, foreach norm/mul_/copy_); aten._to_copy = the bf16 -> fp32",
        "# gradient cast (direct_copy_kernel through unrolled_elementwise_kernel: not vectorized); aten.add above 1:",
        "# the residual stream's adds (operands of 3-42 MB measured) read part of an operand the kernel before left",
        "# in the 50 MB L2 (3.36 TB/s measured, above a copy's 2.99).",
        *(f'"{k.removeprefix("bw/")}" = {v[k]:.4g}' for k in cal.CLASS_PARAMETERS if k.startswith("bw/")),
        "",
        "[row_overhead_elements]",
        "# c0 of a row-wise kernel over rows of C elements: it streams at C / (C + c0), relative to rows of 768",
        "# (fitted: the layer norms and bias-gradient sums of d_model 768, 2048 and 2560).",
        *(f'"{k.removeprefix("row/")}" = {v[k]:.4g}' for k in cal.CLASS_PARAMETERS if k.startswith("row/")),
    ]
    atomic_write_text(path, replace_toml_block(path.read_text(), MARKER, body, writer="experiments/fit_whole_steps.py"))
    host_path = hosts_dir() / f"{spec.host}.toml"
    step = [
        "[step_us]",
        "# Host time per kernel of a training step on top of the replay's (autograd, module calls, the optimizer's Python):",
        f"# {v['host_split_scale']:.4g} x the split measured on a CPU ({host}; h100_steps.HOST_SPLIT_US),",
        "# the factor fitted on the launch-bound gpt3-small step at micro-batch 1.",
        *(f"{p} = {v['host_split_scale'] * us:.4g}" for p, us in cal.HOST_SPLIT_US.items()),
    ]
    atomic_write_text(host_path, replace_toml_block(host_path.read_text(), "step", step,
                                                    writer="experiments/fit_whole_steps.py"))  # fmt: skip


def report(result: dict, summary: dict, spec) -> str:
    lines = ["# The simulated H100's training step against whole steps measured on a real one", "",
             "Produced by `python experiments/fit_whole_steps.py`; data in "
             "[data/h100/whole_steps/](data/h100/whole_steps/README.md) (one H100 80GB HBM3, read-only, default "
             "settings); method, kernel classes and assumptions in `freqopt/gpu/calibration/h100_steps.py`. The simulated "
             "step is `SimulatedGPU.step` at default settings, the step `freqopt profile`, the search and `train` "
             "measure. Errors in % of the measured value.", "",
             "## Whole steps", "",
             "| step | time measured (ms) | simulated (ms) | error (%) | before (ms) | energy measured (J) | "
             "simulated (J) | error (%) | before (J) | power measured (W) | simulated (W) | error (%) | "
             "SM clock measured (MHz) | simulated (MHz) | GPU busy measured (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["steps"]:
        t0, e0 = BEFORE.get(r["step"], (float("nan"),) * 2)
        lines.append(
            f"| {r['step']} | {r['time_measured_s'] * 1e3:.2f} | {r['time_simulated_s'] * 1e3:.2f} | "
            f"{r['time_error_pct']:+.1f} | {t0:.2f} ({100 * (t0 / r['time_measured_s'] / 1e3 - 1):+.0f} %) | "
            f"{r['energy_measured_j']:.2f} | {r['energy_simulated_j']:.2f} | {r['energy_error_pct']:+.1f} | "
            f"{e0:.2f} ({100 * (e0 / r['energy_measured_j'] - 1):+.0f} %) | {r['power_measured_w']:.0f} | "
            f"{r['power_simulated_w']:.0f} | {r['power_error_pct']:+.1f} | {r['clock_measured_mhz']:.0f} | "
            f"{r['clock_simulated_mhz']:.0f} | {r['busy_measured_s'] * 1e3:.2f} |")
    lines += ["", f"Largest |error|: time {summary['time']:.1f} %, energy {summary['energy']:.1f} %, power "
              f"{summary['power']:.1f} %. 'Before': the same workloads as registered in "
              "[device/README.md](device/README.md) at issue 11, before the changes this fit came with.", "",
              "## GPU time by kernel class", "",
              "torch.profiler's kernels of each step, sorted into classes by CUDA kernel name (they sum to the "
              "step's GPU busy time), against the traced kernels of the same class simulated at the step's mean "
              f"measured SM clock (physics only: no host, no power limit). Measured time adds {cal.LAUNCH_GAP_S * 1e6:.1f} "
              "us per launch, the GPU's idle between back-to-back kernels that a simulated kernel's fixed time "
              f"holds. Fitted classes (all steps but {cal.LAUNCH_BOUND}): {', '.join(cal.FITTED_CLASSES)}; the "
              f"largest |error| among them is {summary['class']:.1f} %. GEMMs are fitted elsewhere "
              "(experiments/calibrate_h100.py).", "",
              "| step | class | measured (ms) | launches | measured + gaps (ms) | simulated (ms) | traced kernels | "
              "error (%) |", "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["classes"]:
        err = f"{r['error_pct']:+.1f}" if "error_pct" in r else ""
        lines.append(f"| {r['step']} | {r['class']} | {r['measured_s'] * 1e3:.3f} | {r['launches']} | "
                     f"{r['measured_with_gaps_s'] * 1e3:.3f} | {r['simulated_s'] * 1e3:.3f} | {r['traced_kernels']} | "
                     f"{err} |")  # fmt: skip
    lines += _left_out()
    lines += _left(result)
    values = cal.current_values(spec)
    lines += ["", "## Fitted", "", "| constant | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in values.items()]
    lines += [f"| step host per kernel, {p} (us) | {1e6 * s:.3g} |" for p, s in spec.step_host_s.items()]
    lines += ["", "## Assumed (what the data cannot separate)", "",
              f"- The host's split between the passes: `HOST_SPLIT_US` {cal.HOST_SPLIT_US} us per kernel, measured on "
              "a CPU (`--measure-host-split`); one launch-bound step cannot split it.",
              f"- The GPU's idle per launch, {cal.LAUNCH_GAP_S * 1e6:.1f} us (`LAUNCH_GAP_S`), from the steps that "
              "are not launch-bound.",
              "- A head dimension between tiles is padded to the next multiple of 64 (cuDNN's kernel names: 64x128x128 "
              "for head dimension 80)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _left_out() -> list[str]:
    """The steps left out of the fit one at a time (``--leave-one-out``'s file), where it exists."""
    if not LOO.is_file():
        return []
    doc = json.loads(LOO.read_text())
    lines = ["", "## Each step left out", "",
             "Each step predicted by the fit (kernel classes and host factor) on the other three: the figure to judge "
             "the fit by, where the tables above are in-sample (`python experiments/fit_whole_steps.py "
             f"--leave-one-out`, {doc['date']}). Left out, {cal.LAUNCH_BOUND} has no step to pin the host's "
             "factor.", "",
             "| step | time error (%) | energy error (%) | host factor fitted without it |", "|---|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['time_error_pct']:+.1f} | {r['energy_error_pct']:+.1f} | "
              f"{r['host_split_scale']:.3g} |" for r in doc["steps"]]
    return lines


def _left(result: dict) -> list[str]:
    """What the fit leaves, in numbers from the residuals: the power limit's clock and the GEMMs."""
    steps = [r for r in result["steps"] if r["step"] != cal.LAUNCH_BOUND]
    gemm = {r["step"]: r["error_pct"] for r in result["classes"] if r["class"] == "GEMM"}
    clocks = ", ".join(f"{r['step']} {r['clock_simulated_mhz']:.0f} against {r['clock_measured_mhz']:.0f}" for r in steps)
    gemms = ", ".join(f"{name} {err:+.0f} %" for name, err in gemm.items() if name != cal.LAUNCH_BOUND)
    small = next(r for r in result["steps"] if r["step"] == cal.LAUNCH_BOUND)
    return ["", "## What is left", "",
            f"- The power limit holds the simulated GPU lower than the real one (mean SM clock, MHz: {clocks}): at a "
            "given clock the simulated step draws more than the measured one, whose average power stays at "
            "667-678 W. At the measured mean clock the simulated GEMMs are faster than torch.profiler's "
            f"({gemms}), so the two errors offset in the time of the GPU-bound steps (+1 to +4 %).",
            f"- The launch-bound step's energy is {small['energy_error_pct']:+.1f} % with its time "
            f"{small['time_error_pct']:+.1f} %: its kernels run at 1980 MHz and the simulated ones draw about 10 % "
            "more energy above the idle power than the measured ones did.",
            "- Both point at the power curve between the throttle points (1358-1580 MHz) and the top clock, which "
            "the voltage-frequency refit constrains (experiments/calibrate_h100.py, v_min_rel and f_knee_mhz); the "
            "GEMMs' time at clocks above 1665 MHz has no operator-loop measurement (a sustained GEMM never runs "
            "there at 700 W) and would move with it. tests/test_calibration.py holds these four steps within 5 %.",
            "- Not simulated: the measured steps' memsets and scalar kernels ('other': 98-717 launches, under 1 ms "
            "a step) and the embedding backward's sort (simulated as one gather-like kernel)."]  # fmt: skip


def measure_host_split(repeats: int = 40) -> dict[str, float]:
    """ms per pass (forward, backward, optimizer) of freqopt's 12-layer GPT at d_model 64, sequence 8, bf16, on the
    CPU with one thread, minimum of ``repeats`` steps, and us of one bare operator call (h100_steps.HOST_SPLIT_US
    divides them by gpt3-small's kernels per pass and subtracts the bare call)."""
    import torch

    from freqopt.workload.models import build_model
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.models.ops import MixedPrecisionAdamW
    from freqopt.workload.phases import quiet_backward_hooks

    torch.set_num_threads(1)
    model = build_model(GPTConfig(n_layers=12, d_model=64, n_heads=1, vocab_size=128, seq_len=8), device="cpu")
    optimizer = MixedPrecisionAdamW(model.parameters())
    idx = torch.zeros((1, 8), dtype=torch.long)
    a = torch.zeros(8, dtype=torch.bfloat16)
    best = [float("inf")] * 4
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = model(idx, idx)
        t1 = time.perf_counter()
        with quiet_backward_hooks():
            loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        for _ in range(100):
            torch.add(a, a)
        t4 = time.perf_counter()
        best = [min(b, v) for b, v in zip(best, (t1 - t0, t2 - t1, t3 - t2, (t4 - t3) / 100))]
    return {"forward_ms": best[0] * 1e3, "backward_ms": best[1] * 1e3, "optimizer_ms": best[2] * 1e3,
            "bare_call_us": best[3] * 1e6}  # fmt: skip


def main(argv: list[str] | None = None, *, quiet: bool = False) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the committed constants' residuals only")
    parser.add_argument("--measure-host-split", action="store_true", help="time the passes of a tiny model here")
    parser.add_argument("--leave-one-out", action="store_true",
                        help="predict each step by the fit on the others; write h100_whole_steps_loo.json and the "
                             "report")
    args = parser.parse_args(argv)
    if args.measure_host_split:
        print(json.dumps(measure_host_split(), indent=1))
        return 0
    steps = cal.load_steps(DATA)
    traces = cal.trace_steps(steps)
    spec = get_gpu(GPU)
    if args.leave_one_out:
        started = time.time()
        rows = cal.leave_one_out(spec, steps, traces)
        doc = {"date": time.strftime("%Y-%m-%d"), "elapsed_s": time.time() - started, "steps": rows}
        atomic_write_text(LOO, json.dumps(doc, indent=1) + "\n")
        print(json.dumps({r["step"]: (round(r["time_error_pct"], 1), round(r["energy_error_pct"], 1)) for r in rows}))
        result = cal.residuals(spec, steps, traces)  # the committed constants: the in-sample tables as they are
        REPORT.write_text(report(result, cal.summarize(result), spec))
        return 0
    if not args.check:
        spec = cal.fit(spec, steps, traces)
        write_toml(spec)
        get_gpu.cache_clear()
        get_host.cache_clear()
        spec = get_gpu(GPU)
    result = cal.residuals(spec, steps, traces)
    summary = cal.summarize(result)
    text = report(result, summary, spec)
    if not quiet:
        print(text)
    if not args.check:
        RESIDUALS.write_text(json.dumps({"summary": summary, **result}, indent=1) + "\n")
        REPORT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
