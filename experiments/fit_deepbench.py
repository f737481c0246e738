"""Fit the simulated V100's GEMM and convolution families on DeepBench's V100 kernels and judge them leave one shape
out (issue 56, items 3 and 6); the V100 files are written only when asked (``--write``): the committed files keep
their families, because this fit, made on DeepBench's small kernels, moves the V100's whole training steps away from
their measurements (the report's last section).

    python experiments/fit_deepbench.py             # fit, leave one shape out, write the report and JSON
    python experiments/fit_deepbench.py --no-loo    # fit only (the report keeps its last LOO)
    python experiments/fit_deepbench.py --write     # also write the fit into the V100 files
    python experiments/fit_deepbench.py --check     # print the committed V100 files' errors per family

Method and sources: freqopt/gpu/calibration/deepbench.py. Before: the V100 as it stood before this fit (its [model]
gemm_efficiency, no K overhead or fixed GEMM time, the convolutions carried from h200-sxm). Writes the
[kernel_families] block of search_spaces/v100-sxm2.toml (measured: DeepBench's V100 is a DGX-1's, an SXM2 board)
and v100-pcie.toml (carried from v100-sxm2: the same GV100 die), experiments/deepbench_v100.md and
experiments/deepbench_v100.json (per-shape predictions left out, each fold's fitted values: what the fidelity
scoreboard reads; freqopt.gpu.calibration.deepbench.family_errors re-predicts the in-sample figure cheaply).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

from freqopt.files import atomic_write_text
from freqopt.gpu.calibration import deepbench as db
from freqopt.gpu.specs import get_gpu, replace_toml_block, search_spaces_dir

HERE = Path(__file__).resolve().parent
REPORT = HERE / "deepbench_v100.md"
RESULTS = HERE / "deepbench_v100.json"
WRITER = "experiments/fit_deepbench.py"
CARRIED_TO = ("v100-pcie",)  # the same GV100 die on a PCIe board: relative efficiencies and fixed times carry
CARRIED_TABLE = "operator_bandwidth_rel"  # batch norm's, carried from h200-sxm as before (DeepBench has none)
TARGET_PCT = 15.0  # issue 56: each family within 15 % mean absolute error, left out
LOO_MAX_NFEV = 30  # each fold starts from the fit on every shape: a few steps from it


def before_spec():
    """The V100 as it stood before this fit: [model]'s gemm_efficiency, no K overhead, no fixed GEMM time, and the
    convolution factors carried from h200-sxm (what h200_check.py wrote into the V100 files)."""
    spec = get_gpu(db.GPU)
    model = tomllib.loads((search_spaces_dir() / f"{db.GPU}.toml").read_text())["model"]
    conv = {k: v for k, v in get_gpu("h200-sxm").conv_efficiency_rel.items()}
    return dataclasses.replace(spec, gemm_efficiency=float(model["gemm_efficiency"]), gemm_k_overhead=0.0,
                               gemm_fixed_s=0.0, conv_efficiency_rel=conv)  # fmt: skip


def families_block(values: dict[str, float], *, carried: bool) -> list[str]:
    """The [kernel_families] block's lines from the fitted values (deepbench.PARAMS' keys)."""
    h200 = get_gpu("h200-sxm")
    conv = dict(h200.conv_efficiency_rel)  # the H200's, where DeepBench exercises no shape (data-gradient stem)
    conv.update({k.removeprefix("conv/"): v for k, v in values.items() if k.startswith("conv/")})
    origin = ("carried from v100-sxm2 (the same GV100 die), fitted there" if carried else "fitted") + \
        " on DeepBench's V100 GEMMs and convolutions by shape, each family judged leave one shape out " \
        "(experiments/deepbench_v100.md); method: freqopt/gpu/calibration/deepbench.py"
    lines = [f"# The kernel model's GEMM and convolution families, {origin}. input_small_channels: the H200's "
             "(no such shape in DeepBench); batch norm carried from h200-sxm.", "[kernel_families]"]
    lines += [f"{k} = {values[k]:.6g}" for k in ("gemm_efficiency", "gemm_k_overhead", "gemm_fixed_us")]
    lines += ["", "[kernel_families.conv_efficiency_rel]",
              "# cuDNN's convolutions by direction against the GEMM model (tensor cores; _cuda_cores: fp32; _3x3: a "
              "3x3 window at stride 1)", *(f'"{k}" = {v:.6g}' for k, v in sorted(conv.items()))]  # fmt: skip
    lines += ["", f"[kernel_families.{CARRIED_TABLE}]", "# bandwidth relative to a copy's (carried from h200-sxm)",
              *(f'"{k}" = {v:.6g}' for k, v in sorted(h200.operator_bandwidth_rel.items())
                if k.startswith("aten.native_batch_norm"))]  # fmt: skip
    return lines


def write_files(values: dict[str, float], *, check: bool = False) -> list[str]:
    stale = []
    for name, carried in ((db.GPU, False), *((n, True) for n in CARRIED_TO)):
        path = search_spaces_dir() / f"{name}.toml"
        text = path.read_text()
        new = replace_toml_block(text, "kernel_families", families_block(values, carried=carried), writer=WRITER)
        if new != text:
            stale.append(name)
            if not check:
                atomic_write_text(path, new)
    get_gpu.cache_clear()
    return stale


def _table(before: dict, fitted: dict, left_out: dict, counts: dict) -> list[str]:
    rows = ["| family | shapes | before | fitted on all (in sample) | left out (each shape refitted without it) |",
            "|---|---:|---:|---:|---:|"]
    for f in db.FAMILIES:
        lo = f"{left_out[f]:.1f} %" if f in left_out else "not run"
        mark = "" if f not in left_out else (" (met)" if left_out[f] <= TARGET_PCT else " (not met)")
        rows.append(f"| {f} | {counts[f]} | {before[f]:.1f} % | {fitted[f]:.1f} % | {lo}{mark} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-loo", action="store_true", help="skip leave one shape out")
    parser.add_argument("--write", action="store_true", help="write the fit into the V100 files")
    parser.add_argument("--check", action="store_true", help="only print the committed V100 files' errors")
    args = parser.parse_args(argv)
    points = db.load_points()
    if args.check:
        for family, pct in db.family_errors(get_gpu(db.GPU), points).items():
            print(f"{family}: {pct:.1f} %")
        return 0
    start = time.time()
    before = before_spec()
    fitted, values = db.fit(before, points, max_nfev=200)
    counts = {f: sum(p.family == f for p in points) for f in db.FAMILIES}
    err_before, err_fitted = db.family_errors(before, points), db.family_errors(fitted, points)
    print(f"fitted on all {len(points)} kernels in {time.time() - start:.0f} s: "
          + ", ".join(f"{k} {v:.4g}" for k, v in values.items()), flush=True)  # fmt: skip
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.no_loo:
        rows, folds = old.get("left_out", []), old.get("folds", [])
    else:
        rows, folds = [], []
        shapes = list(dict.fromkeys(p.shape for p in points))
        for i, shape in enumerate(shapes):
            r, f = db.leave_one_out(fitted, points, shapes=[shape], max_nfev=LOO_MAX_NFEV)
            rows += r
            folds += f
            if i % 50 == 0:
                print(f"  left out {i + 1}/{len(shapes)} shapes ({time.time() - start:.0f} s)", flush=True)
    left_out = {f: float(np.mean([abs(r["error_pct"]) for r in rows if r["family"] == f])) for f in db.FAMILIES
                if any(r["family"] == f for r in rows)}  # fmt: skip
    if args.write:
        write_files(values)
    RESULTS.write_text(json.dumps({
        "source": "baidu-research/DeepBench da81ba7 results/train/DeepBench_NV_V100.xlsx "
                  "(experiments/data/deepbench_v100)",
        "gpu": db.GPU, "clocks": "highest SM and memory clocks, no power limit (assumed: DeepBench states none)",
        "families": {f: {"shapes": counts[f], "before_pct": err_before[f], "fitted_pct": err_fitted[f],
                         "left_out_pct": left_out.get(f)} for f in db.FAMILIES},
        "fitted": values, "left_out": rows, "folds": folds,
    }, indent=1) + "\n")  # fmt: skip
    lines = [
        "# The simulated V100's GEMMs and convolutions against DeepBench's V100",
        "",
        f"Produced by `python experiments/fit_deepbench.py` ({datetime.date.today()}); method and sources in "
        "freqopt/gpu/calibration/deepbench.py; per-shape predictions left out and each fold's fitted values in "
        "experiments/deepbench_v100.json.",
        "",
        "Baidu's DeepBench timed GEMMs and convolutions (forward, data gradient, weight gradient) by shape on one V100 "
        "of a DGX-1 (CUDA 10.1, cuDNN 7.6), fp32 and with 16-bit inputs and 32-bit accumulation (fp16 rows: tensor "
        "cores). Each timing is one kernel here, simulated on `v100-sxm2` at its highest clocks without a power "
        "limit (the clocks are not stated: assumed). Mean absolute error of the simulated time, in % of the "
        "measured, per family: *before* is the V100 file before this fit (gemm_efficiency 0.75, the convolution "
        "factors carried from the H200); *fitted on all* is in sample; *left out* refits every parameter without "
        "one shape (a convolution's three directions together) and predicts it, once per shape: the model's "
        f"fidelity. Target: {TARGET_PCT:g} % per family, left out.",
        "",
        *_table(err_before, err_fitted, left_out, counts),
        "",
        "Fitted on every shape (not written to the V100 files, which keep the *before* families: see the last "
        "section; `--write` writes them to v100-sxm2.toml and carries them to v100-pcie.toml):",
        "",
        *(f"- `{k}` = {v:.4g}" for k, v in values.items()),
        "",
        "What the model cannot follow: freqopt times a GEMM or convolution from its FLOPs at one efficiency per "
        "family (with a K overhead and a fixed time per GEMM); cuDNN picks other algorithms by shape (FFT, Winograd "
        "for 3x3 windows: the `_3x3` factors; direct kernels for few channels), and cuBLAS other tiles for skinny "
        "GEMMs, so the error left is the spread of DeepBench's kernels about one rate per family. DeepBench's "
        "convolutions run at batch 4-32 (most at 8 and 16), where a kernel is tens of microseconds: the fitted "
        "factors are those of small convolutions, carried to a training step's larger ones by the model's K and "
        "fixed-time terms.",
        "",
        "## Why the fit is not committed",
        "",
        "Judged on every V100 measurement at once, the fit helps the kernels it was fitted on and moves the V100's "
        "whole steps away from theirs. Written into the V100 files (run on 2026-12-01 with `--write`, then "
        "`python experiments/cnn_throughput.py` and `python experiments/calibrate.py --record`): ResNet-50 on the "
        "simulated V100 fell from 927 to 772 img/s against NVIDIA's published 1200 (0.77 to 0.64 of it), and the "
        "Zeus BERT/SQuAD power-limit sweep's worst error rose from 7.74 to 8.48 pp of time and 5.35 to 6.78 pp of "
        "average power (McDonald's training figures' rms 2.33 to 3.05 pp). DeepBench's convolutions run at batch "
        "4-32, where one efficiency per direction is lower than a batch-256 training step's: the model lacks a term "
        "for how a kernel's tiles fill the SMs, which both would need. Until it has one, the committed V100 keeps "
        "the families carried from the H200, and the table's *before* column is what the committed files give.",
        "",
    ]  # fmt: skip
    atomic_write_text(REPORT, "\n".join(lines))
    print("\n".join(_table(err_before, err_fitted, left_out, counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
