"""Fit the simulated GPU's power model to the Zeus V100 power-limit sweep and McDonald et al.'s V100 training
figures, and derive the other GPU types.

    python experiments/calibrate.py            # fit, write search_spaces/*.toml, print the residual table
    python experiments/calibrate.py --check    # only print the residuals of the committed constants
    python experiments/calibrate.py --derive-only   # keep the fitted V100, derive the other GPU types again
    python experiments/calibrate.py --record   # keep every constant; record the residuals under today's traces

Writes the [power_model] block of every search_spaces/*.toml but those fitted to measurements of their own
(h100-sxm: experiments/calibrate_h100.py) and those another script writes (experiments/carry_gpus.py),
experiments/calibration_residuals.json (the fitted host gaps of the two workloads and the residuals that
tests/test_calibration.py holds the committed constants to) and experiments/calibration.md.
Method and sources: freqopt/gpu/calibration/v100.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from freqopt.gpu.calibration import v100 as cal
from freqopt.gpu.specs import get_gpu, list_gpus, replace_toml_block, search_spaces_dir
from freqopt.files import atomic_write_text

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "zeus_v100_bert_squad.csv"
MCDONALD = HERE / "data" / "mcdonald_v100_training.csv"
RESIDUALS = HERE / "calibration_residuals.json"
REFERENCE = "v100-pcie"  # the Zeus sweep's GPU: a 250 W V100 (McDonald et al. 2022 also ran 250 W V100s)
# Published anchors of a derived GPU's sustained clock at its limit under dense GEMM, by GPU type (none left: the
# H200's, 1500 MHz (shared/calibration/published.md), now carried from the H100's fit and checked on a real H200).
SUSTAINED_GEMM_CLOCK_MHZ: dict[str, float] = {}
# GPU types fitted to measurements of their own or of their die (experiments/calibrate_h100.py; experiments/fit_dvfs.py
# for the A100 and the A40; experiments/h200_check.py for the H200, carried from the H100): never derived from the V100.
MEASURED = {"h100-sxm", "h200-sxm", "a100-sxm4-80gb", "a40"}


def derived_here(name: str) -> bool:
    """Whether this script writes the GPU type's [power_model] block (not another script: the types whose power
    model experiments/carry_gpus.py carries from a fitted sibling of their own die or family)."""
    text = (search_spaces_dir() / f"{name}.toml").read_text()
    return "# BEGIN power_model (written by experiments/calibrate.py" in text


def write_power_model(name: str, pm, note: str) -> None:
    body = [f"# {note}", "[power_model]", *(f"{k} = {v:.6g}" for k, v in dataclasses.asdict(pm).items())]
    path = search_spaces_dir() / f"{name}.toml"
    atomic_write_text(path, replace_toml_block(path.read_text(), "power_model", body, writer="experiments/calibrate.py"))


def table(rows: list[dict]) -> str:
    out = ["| batch | limit (W) | t rel measured | t rel simulated | error (pp) | P measured (W) | P simulated (W) | error (pp) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['batch_size']} | {r['power_limit_w']:.0f} | {r['time_rel_measured']:.3f} | "
                   f"{r['time_rel_simulated']:.3f} | {r['time_rel_error_pp']:+.2f} | {r['avg_power_measured_w']:.1f} | "
                   f"{r['avg_power_simulated_w']:.1f} | {r['avg_power_error_pp']:+.2f} |")
    return "\n".join(out)


def mcdonald_table(rows: list[dict]) -> str:
    out = ["| figure | limit (W) | published | simulated | error (pp) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['figure']} | {r['power_limit_w']:.0f} | {r['published']:.3f} | {r['simulated']:.3f} | "
                   f"{r['error_pp']:+.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print residuals of the committed constants only")
    parser.add_argument("--derive-only", action="store_true", help="derive the other GPUs from the committed V100 fit")
    parser.add_argument("--record", action="store_true",
                        help="keep the committed constants and host gaps; write their residuals under the current traces")
    args = parser.parse_args()
    args.check = args.check or args.record
    points = cal.load_zeus_points(DATA)
    traces = {b: cal.bert_squad_trace(b) for b in sorted({p.batch_size for p in points})}
    figures = cal.load_mcdonald_figures(MCDONALD)
    figure_traces = cal.mcdonald_traces()
    spec = get_gpu(REFERENCE)
    if not args.check and not args.derive_only:
        spec, gaps = cal.fit_power_model(spec, points, traces, figures, figure_traces)
        write_power_model(REFERENCE, spec.power_model, "Fitted to experiments/data/zeus_v100_bert_squad.csv and "
                          "mcdonald_v100_training.csv (method: freqopt/gpu/calibration/v100.py).")  # fmt: skip
    else:
        gaps = json.loads(RESIDUALS.read_text())["host_gaps_s"]
    if not args.check:
        for name in list_gpus():
            if name == REFERENCE or name in MEASURED or not derived_here(name):
                continue
            target = get_gpu(name)
            anchor = SUSTAINED_GEMM_CLOCK_MHZ.get(name)
            pm = cal.derive_power_model(spec, target, sustained_gemm_clock_mhz=anchor)
            how = (f"SM terms set so dense BF16 GEMM at {anchor} MHz draws the {target.power_limit_default_w:g} W limit"
                   if anchor else "SM terms scaled by power-limit headroom over idle")
            write_power_model(name, pm, f"Derived from the fitted {REFERENCE} constants (no measurements of its own): "
                                        f"idle-scaled floor, {how}, bandwidth-scaled memory terms.")
        get_gpu.cache_clear()
    rows = cal.residuals(get_gpu(REFERENCE), points, traces, gaps["zeus_host_gap_s"])
    mc_rows = cal.mcdonald_residuals(get_gpu(REFERENCE), figures, figure_traces, gaps["mcdonald_host_gap_s"])
    mc_worst = max(abs(r["error_pp"]) for r in mc_rows)
    mc_rms = (sum(r["error_pp"] ** 2 for r in mc_rows) / len(mc_rows)) ** 0.5
    worst = {k: max(abs(r[k]) for r in rows) for k in ("time_rel_error_pp", "avg_power_error_pp")}
    rms = {k: (sum(r[k] ** 2 for r in rows) / len(rows)) ** 0.5 for k in worst}
    summary = (f"Zeus: max |error| time {worst['time_rel_error_pp']:.2f} pp, power {worst['avg_power_error_pp']:.2f} pp; "
               f"rms time {rms['time_rel_error_pp']:.2f} pp, power {rms['avg_power_error_pp']:.2f} pp. McDonald: max "
               f"|error| {mc_worst:.2f} pp, rms {mc_rms:.2f} pp. Host gaps per step: Zeus "
               f"{1e3 * gaps['zeus_host_gap_s']:.1f} ms, McDonald {1e3 * gaps['mcdonald_host_gap_s']:.1f} ms.")
    print(table(rows) + "\n\n" + mcdonald_table(mc_rows) + "\n\n" + summary)
    if args.record or (not args.check and not args.derive_only):
        RESIDUALS.write_text(json.dumps({
            "host_gaps_s": gaps, "max_abs_error_pp": worst, "rms_error_pp": rms, "points": rows,
            "mcdonald": {"max_abs_error_pp": mc_worst, "rms_error_pp": mc_rms, "figures": mc_rows},
        }, indent=1) + "\n")  # fmt: skip
        (HERE / "calibration.md").write_text(
            "# Calibration of the simulated V100\n\n"
            "Produced by `python experiments/calibrate.py`; method and sources in freqopt/gpu/calibration/v100.py. One V100 "
            "power model fitted to both data sets; each workload has its own fitted host gap per step.\n\n"
            + ("The residuals below are those of the committed constants under the current traces "
               "(`python experiments/calibrate.py --record`): the traced optimizer step gained gradient clipping "
               "after the fit, and later (issue 23) the bytes that in-place optimizer kernels write; a refit from the same start moved to another optimum of similar residuals "
               "(Zeus time rms 3.64 pp, McDonald rms 2.29 pp) with a different split between SM and memory "
               "power, so the fitted constants were kept.\n\n" if args.record else "")
            + "## Zeus BERT/SQuAD power-limit sweep\n\n" + table(rows) + "\n\n## McDonald et al. 2022, training "
            "figures\n\n" + mcdonald_table(mc_rows) + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
