"""Fit the simulated GPU's power model to the Zeus V100 power-limit sweep and derive the other GPU types.

    python experiments/calibrate.py            # fit, write search_spaces/*.toml, print the residual table
    python experiments/calibrate.py --check    # only print the residuals of the committed constants
    python experiments/calibrate.py --derive-only   # keep the fitted V100, derive the other GPU types again

Writes the [power_model] block of every search_spaces/*.toml, experiments/calibration_residuals.json (the
residuals that tests/test_calibration.py holds the committed constants to) and experiments/calibration.md.
Method and sources: freqopt/calibration.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from freqopt import calibration as cal
from freqopt.gpus import get_gpu, list_gpus, search_spaces_dir

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "zeus_v100_bert_squad.csv"
REFERENCE = "v100-pcie"  # the Zeus sweep's GPU: a 250 W V100 (McDonald et al. 2022 also ran 250 W V100s)
# Published anchor: an H200 at 700 W sustains about 1500 MHz under full load (shared/calibration/published.md).
SUSTAINED_GEMM_CLOCK_MHZ = {"h100-sxm": 1500, "h200-sxm": 1500}


def write_power_model(name: str, pm, note: str) -> None:
    path = search_spaces_dir() / f"{name}.toml"
    text = path.read_text()
    lines = [f"# BEGIN power_model (written by experiments/calibrate.py; edit there)", f"# {note}", "[power_model]"]
    lines += [f"{k} = {v:.6g}" for k, v in dataclasses.asdict(pm).items()]
    lines.append("# END power_model")
    new = re.sub(r"# BEGIN power_model.*?# END power_model", "\n".join(lines), text, flags=re.S)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(new)
    tmp.replace(path)


def table(rows: list[dict]) -> str:
    out = ["| batch | limit (W) | t rel measured | t rel simulated | error (pp) | P measured (W) | P simulated (W) | error (pp) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['batch_size']} | {r['power_limit_w']:.0f} | {r['time_rel_measured']:.3f} | "
                   f"{r['time_rel_simulated']:.3f} | {r['time_rel_error_pp']:+.2f} | {r['avg_power_measured_w']:.1f} | "
                   f"{r['avg_power_simulated_w']:.1f} | {r['avg_power_error_pp']:+.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print residuals of the committed constants only")
    parser.add_argument("--derive-only", action="store_true", help="derive the other GPUs from the committed V100 fit")
    args = parser.parse_args()
    points = cal.load_zeus_points(DATA)
    traces = {b: cal.bert_squad_trace(b) for b in sorted({p.batch_size for p in points})}
    spec = get_gpu(REFERENCE)
    if not args.check and not args.derive_only:
        spec = cal.fit_power_model(spec, points, traces)
        write_power_model(REFERENCE, spec.power_model,
                          "Fitted to experiments/data/zeus_v100_bert_squad.csv (method: freqopt/calibration.py).")
    if not args.check:
        for name in list_gpus():
            if name == REFERENCE:
                continue
            target = get_gpu(name)
            anchor = SUSTAINED_GEMM_CLOCK_MHZ.get(name)
            pm = cal.derive_power_model(spec, target, sustained_gemm_clock_mhz=anchor)
            how = (f"SM terms set so dense BF16 GEMM at {anchor} MHz draws the {target.power_limit_default_w:g} W limit"
                   if anchor else "SM terms scaled by power-limit headroom over idle")
            write_power_model(name, pm, f"Derived from the fitted {REFERENCE} constants (no measurements of its own): "
                                        f"idle-scaled floor, {how}, bandwidth-scaled memory terms.")
        get_gpu.cache_clear()
    rows = cal.residuals(get_gpu(REFERENCE), points, traces)
    worst = {k: max(abs(r[k]) for r in rows) for k in ("time_rel_error_pp", "avg_power_error_pp")}
    rms = {k: (sum(r[k] ** 2 for r in rows) / len(rows)) ** 0.5 for k in worst}
    print(table(rows))
    print(f"\nmax |error|: time {worst['time_rel_error_pp']:.2f} pp, power {worst['avg_power_error_pp']:.2f} pp; "
          f"rms: time {rms['time_rel_error_pp']:.2f} pp, power {rms['avg_power_error_pp']:.2f} pp")
    if not args.check and not args.derive_only:
        (HERE / "calibration_residuals.json").write_text(json.dumps({"max_abs_error_pp": worst, "rms_error_pp": rms,
                                                                     "points": rows}, indent=1) + "\n")
        (HERE / "calibration.md").write_text(
            "# Calibration of the simulated V100 against the Zeus BERT/SQuAD power-limit sweep\n\n"
            "Produced by `python experiments/calibrate.py`; method and sources in freqopt/calibration.py.\n\n"
            + table(rows) + f"\n\nmax |error|: time {worst['time_rel_error_pp']:.2f} pp, power "
            f"{worst['avg_power_error_pp']:.2f} pp; rms: time {rms['time_rel_error_pp']:.2f} pp, power "
            f"{rms['avg_power_error_pp']:.2f} pp\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
