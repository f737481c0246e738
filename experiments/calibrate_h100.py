"""Fit the simulated H100 to read-only measurements of a real H100 (experiments/data/h100/).

    python experiments/calibrate_h100.py           # fit, write search_spaces/h100-sxm.toml, the report and residuals
    python experiments/calibrate_h100.py --check   # only print the committed constants' residuals
    python experiments/calibrate_h100.py --carry-knee  # why only the A100's voltage floor is carried (prints)

Writes the fitted block and the [power_model] block of search_spaces/h100-sxm.toml,
experiments/h100_calibration_residuals.json (guarded by tests/test_calibration.py) and
experiments/h100_calibration.md. Method, points and assumptions: freqopt/gpu/calibration/h100.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from freqopt.gpu.calibration import h100 as cal
from freqopt.gpu.host import get_host, hosts_dir
from freqopt.gpu.specs import get_gpu, replace_toml_block, search_spaces_dir
from freqopt.files import atomic_write_text

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "h100"
RESIDUALS = HERE / "h100_calibration_residuals.json"
REPORT = HERE / "h100_calibration.md"
GPU = "h100-sxm"
# The voltage curve's floor is carried from this GPU's fit on a measured sweep (cal.voltage_floor_from says why).
FLOOR_FROM = "a100-sxm4-80gb"



def write_toml(spec) -> None:
    path = search_spaces_dir() / f"{GPU}.toml"
    values = cal.current_values(spec)
    fitted = ["# Fitted to experiments/data/h100 (method: freqopt/gpu/calibration/h100.py; residuals: "
              "experiments/h100_calibration.md)."]
    fitted += [f"{k} = {values[k]:.6g}" for k in ("gemm_efficiency", "gemm_k_overhead", "gemm_fixed_us",
                                                  "mem_efficiency", "layer_norm_bandwidth_rel")]  # fmt: skip
    fitted += [f"kernel_fixed_us = {spec.kernel_fixed_s * 1e6:g}  # {cal.ASSUMED['kernel_fixed_us'][1]}", ""]
    replay = ["# Host time to issue one kernel of a replay loop (fitted: the launch-bound replayed classes of "
              "experiments/data/h100)", f"issue_us = {values['host_issue_us']:.6g}",
              f"gemm_issue_us = {values['host_gemm_issue_us']:.6g}"]  # fmt: skip
    host_path = hosts_dir() / f"{spec.host}.toml"
    atomic_write_text(host_path, replace_toml_block(host_path.read_text(), "replay", replay,
                                                    writer="experiments/calibrate_h100.py"))  # fmt: skip
    pm = ["# Fitted to experiments/data/h100 (method: freqopt/gpu/calibration/h100.py); assumed: "
          + "; ".join(f"{k} ({why})" for k, (_, why) in cal.ASSUMED.items() if k in
                      ("p_mem_clock_w", "p_mem_active_w", "p_leak_w", "power_window_s")),
          "[power_model]"]  # fmt: skip
    pm += [f"{k} = {v:.6g}" for k, v in dataclasses.asdict(spec.power_model).items()]
    text = path.read_text()
    for marker, body in (("fitted", fitted), ("power_model", pm)):
        text = replace_toml_block(text, marker, body, writer="experiments/calibrate_h100.py")
    atomic_write_text(path, text)


def report(rows: list[dict], summary: dict, spec) -> str:
    lines = ["# Calibration of the simulated H100 against a real one", "",
             "Produced by `python experiments/calibrate_h100.py`; data in [data/h100/](data/h100/README.md) "
             "(one H100 80GB HBM3, read-only, default settings, 2026-11-23); method, points and assumptions in "
             "`freqopt/gpu/calibration/h100.py`. Errors are the simulated GPU's, in % of the measured value; clocks "
             "only where the 700 W limit throttled the GPU.", "",
             "| point | time measured (us) | simulated (us) | error (%) | power measured (W) | simulated (W) | "
             "error (%) | clock measured (MHz) | simulated (MHz) | error (%) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def cell(r, key, scale=1.0, fmt="{:.1f}"):
        return fmt.format(r[key] * scale) if key in r else ""

    for r in rows:
        lines.append("| " + " | ".join([
            r["point"].replace("|", "\\|"), cell(r, "time_measured_s", 1e6), cell(r, "time_simulated_s", 1e6),
            cell(r, "time_error_pct", fmt="{:+.1f}"), cell(r, "power_measured_w"), cell(r, "power_simulated_w"),
            cell(r, "power_error_pct", fmt="{:+.1f}"), cell(r, "clock_measured_mhz", fmt="{:.0f}"),
            cell(r, "clock_simulated_mhz", fmt="{:.0f}"), cell(r, "clock_error_pct", fmt="{:+.1f}")]) + " |")  # fmt: skip
    lines += ["", "| error | points | max abs (%) | rms (%) |", "|---|---:|---:|---:|"]
    for key, s in summary.items():
        lines.append(f"| {key.removesuffix('_error_pct')} | {s['n']} | {s['max_abs']:.1f} | {s['rms']:.1f} |")
    replays = [r for r in rows if r["point"].startswith("replay/")]
    worst = max(replays, key=lambda r: r["time_measured_s"] / r["time_simulated_s"])
    lines += ["", "## gpt3-small's kernel classes: replayed against simulated", "",
              f"Of the {len(replays)} replayed classes kept as points, the largest replayed/simulated time ratio is "
              f"{worst['time_measured_s'] / worst['time_simulated_s']:.2f} ({worst['point'].removeprefix('replay/')}); "
              f"none is 2x its simulated time. The classes left out ran other kernels than today's trace has:", ""]
    lines += [f"- {line}" for line in _changed_classes(spec)]
    values = cal.current_values(spec)
    carried = cal.voltage_floor_from(get_gpu(FLOOR_FROM))
    lines += ["", "## Fitted", "", "| constant | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in values.items() if k not in carried]
    lines += ["", f"## Carried from the {FLOOR_FROM} (its fit on Perseus's measured BLOOM sweep, experiments/dvfs_fit.md)",
              "", "The voltage floor, as a fraction of the top clock's voltage. The points above all lie at 1335-1980 "
              "MHz: they pin the voltage curve's slope there (the knee above is where that line meets the floor), not "
              "how far down it goes. The A100's knee (at 79 % of its top clock) does not carry: fitted with it, the "
              "points' clock error grows little but the launch-bound whole step at 1980 MHz (gpt3-small, "
              "micro-batch 1) comes out 12 % high in energy (`python experiments/calibrate_h100.py --carry-knee`; "
              "freqopt/gpu/calibration/h100.py, voltage_floor_from).", "", "| constant | value |", "|---|---:|"]  # fmt: skip
    lines += [f"| {k} | {v:.4g} |" for k, v in carried.items()]
    lines += ["", "## Assumed (what the data cannot separate)", "", "| constant | value | why |", "|---|---:|---|"]
    lines += [f"| {k} | {v:g} | {why} |" for k, (v, why) in cal.ASSUMED.items()]
    return "\n".join(lines) + "\n"


def _changed_classes(spec) -> list[str]:
    """What the simulated GPU predicts for the classes whose replay at d174579 ran another kernel than today's."""
    from freqopt.gpu.backends.base import DEFAULT_SETTING
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    trace = trace_training_iteration(get_workload("gpt3-small", micro_batch_size=4))
    gpu = SimulatedGPU(spec, noise=False)

    def per_kernel_us(match) -> tuple[float, str]:
        kernels = [k for k in trace.kernels if match(k)]
        return 1e6 * gpu.true_measure(kernels, DEFAULT_SETTING).time_s / len(kernels), kernels[0].class_key

    fwd, _ = per_kernel_us(lambda k: k.name == "freqopt.flash_attention")
    bwd, _ = per_kernel_us(lambda k: k.name == "freqopt.flash_attention_backward")
    vocab, key = per_kernel_us(lambda k: k.kind == "gemm" and any(50304 in s for s in k.shapes) and k.pass_name == "forward")
    return [f"the attention backward, replayed through the math path (3942 us a kernel, the (T, T) scores in "
            f"memory), now runs FlashAttention-2's fused backward: simulated {bwd:.0f} us a kernel, {bwd / fwd:.1f}x "
            f"the forward's {fwd:.0f} us (the forward replayed at 78.7 us), since FlashAttention-2's backward does 2.5x "
            "the forward's matmul work (Dao 2023) and is simulated at the forward's rate per FLOP; a replay would "
            "pass 2x only if the backward ran at under half the forward's rate, where Dao 2023 reports backward "
            "utilization at about 0.8x the forward's. Not yet replayed: experiments/device_check.py measures it;",
            f"the logit GEMMs with N = 50257 (4482 and 4986 us replayed, cuBLAS's unaligned path) are now N = 50304: "
            f"simulated {vocab:.0f} us ({key.split('|')[0]}); the aligned third one, 50257x8192 @ 8192x768, "
            "replayed at 955 us, is a point above."]


def carry_knee(spec, points) -> int:
    """The evidence that the A100's knee does not carry: this fit, then the whole-step fit (fit_whole_steps.py's),
    with the floor alone carried and with the knee carried too; summaries printed, nothing written."""
    from freqopt.gpu.calibration import h100_steps as steps_cal
    steps = steps_cal.load_steps(DATA / "whole_steps")
    traces = steps_cal.trace_steps(steps)
    for label, with_knee in (("floor carried", False), ("floor and knee carried", True)):
        fixed = cal.voltage_floor_from(get_gpu(FLOOR_FROM), with_knee=with_knee, target=spec)
        fitted = cal.fit(spec, points, fixed=fixed)
        stepped = steps_cal.fit(fitted, steps, traces)
        print(json.dumps({"carried": label, **fixed, "points": cal.summarize(cal.residuals(fitted, points)),
                          "whole_steps": steps_cal.summarize(steps_cal.residuals(stepped, steps, traces))}))  # fmt: skip
    return 0


def main(argv: list[str] | None = None, *, quiet: bool = False) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the committed constants' residuals only")
    parser.add_argument("--carry-knee", action="store_true",
                        help=f"fit with the {FLOOR_FROM}'s knee carried too; print the points' and the whole steps' "
                             "residual summaries, write nothing")  # fmt: skip
    args = parser.parse_args(argv)
    points = cal.load_points(DATA)
    spec = get_gpu(GPU)
    if args.carry_knee:
        return carry_knee(spec, points)
    if not args.check:
        spec = cal.fit(spec, points, fixed=cal.voltage_floor_from(get_gpu(FLOOR_FROM)))
        write_toml(spec)
        get_gpu.cache_clear()
        get_host.cache_clear()
        spec = get_gpu(GPU)
    rows = cal.residuals(spec, points)
    summary = cal.summarize(rows)
    text = report(rows, summary, spec)
    if not quiet:
        print(text)
    if not args.check:
        RESIDUALS.write_text(json.dumps({"summary": summary, "points": rows}, indent=1) + "\n")
        REPORT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
