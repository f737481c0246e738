"""Fit the A40's power model jointly on Perseus's A40 stage sweeps and Zeus's A40 power-limit sweeps, inside its
[power_model_bounds], and judge it on each workload left out (issue 56, items 1-2).

    python experiments/fit_a40_power.py           # fit, left-out folds, write the A40's [power_model], report, JSON
    python experiments/fit_a40_power.py --check   # only print the committed constants' errors
    python experiments/fit_a40_power.py --report-only   # rewrite the report from a40_power_fit.json, no fit

Method and sources: freqopt/gpu/calibration/zeus.py (the Zeus sweeps, the joint fit, the family prior toward the
A100 80GB's voltage curve) and freqopt/gpu/calibration/dvfs.py (the Perseus stages). Workloads: the Zeus networks
ShuffleNetV2 (CIFAR-100), bert-base (Sentiment140) and DeepSpeech2 (LibriSpeech) at the batch sizes of ``SWEEPS``
(host-bound batches, whose time and power do not move with the limit, are left aside), and Perseus's BLOOM and
GPT-3 175B A40 stages, and Perseus's measured P2P-blocking power of the A40 at the highest clocks (70.38 W, the
file's [waiting_power] top_clocks_w), which the power model's baseline there must equal (zeus.BLOCKING_WEIGHT; without
it the fit puts 168 W there). Each fold refits every constant without one workload, from the same start,
and predicts it.

Writes search_spaces/a40.toml's power_model block and its gemm_efficiency / link_efficiency / l2_bytes_per_clock lines,
experiments/a40_power_fit.md and experiments/a40_power_fit.json (each fold's fitted parameters and errors;
tests/test_zeus.py holds the committed constants to the fitted-on errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import re
import sys
import time
from pathlib import Path

from freqopt.files import atomic_write_text
from freqopt.gpu.calibration import dvfs as cd
from freqopt.gpu.calibration import zeus as cz
from freqopt.gpu.specs import get_gpu, replace_toml_block, search_spaces_dir

HERE = Path(__file__).resolve().parent
ZEUS = HERE / "data" / "zeus" / "nsdi23" / "summary_power_a40_shared.csv"  # README: experiments/data/zeus/nsdi23
PERSEUS = HERE / "data" / "perseus"
REPORT = HERE / "a40_power_fit.md"
RESULTS = HERE / "a40_power_fit.json"
WRITER = "experiments/fit_a40_power.py"
GPU, SIBLING = "a40", "a100-sxm4-80gb"
# Zeus sweeps fitted and judged: batches whose GPU work the limit slows (ShuffleNetV2 below 256 and BERT below 32 are
# host-bound: flat in the limit within their run-to-run noise, so they pin nothing of the power curve; so is NCF at
# every batch size, 8 to 32768: its epoch time moves by no more than its noise from 300 W to 100 W at 80-91 W).
# Three networks, so that leaving one out still fits on two unlike ones (convolutions, FP32 GEMMs, recurrences).
SWEEPS = {"shufflenetv2": (256, 1024, 4096), "bert_base_uncased": (32, 128), "deepspeech2": (16, 64, 192)}
STAGES = ("bloom+a40", "gpt3-175b+a40")
MAX_NFEV = 20
PROVENANCE = ("measured: fitted jointly on Perseus's A40 BLOOM and GPT-3 175B stage sweeps at locked SM clocks and "
              "Zeus's A40 power-limit sweeps (ShuffleNetV2, bert-base, DeepSpeech2), inside [power_model_bounds]; the "
              "voltage "
              "curve's shape pulled toward the A100 80GB's fitted one (a family prior: carried in part); fitted-on "
              "and left-out errors in experiments/a40_power_fit.md")
SOURCE = ("Perseus (Chung et al., SOSP'24) A40 stage profiles, experiments/data/perseus; Zeus (You et al., NSDI'23) "
          "summary_power_a40.csv rows of shufflenetv2, bert_base_uncased and deepspeech2, "
          "experiments/data/zeus/nsdi23; fitted by "
          "experiments/fit_a40_power.py (freqopt/gpu/calibration/zeus.py), p_const_w bounded by the 30.51 W idle "
          "draw, v_min_rel at least 0.5 (freqopt.gpu.power_bounds); before issue 56 the Perseus-only fit held "
          "p_const_w 120.7 W and v_min_rel 0.3, so every limit at or below 175 W fell to the lowest clock")
TARGETS = {"zeus_pp": 8.0, "zeus_optimum_w": 25.0, "perseus_time_pp": 3.0, "perseus_energy_pp": 4.0}


def zeus_path() -> Path:
    """Zeus's A40 rows (experiments/data/zeus/nsdi23)."""
    return ZEUS


def workloads():
    sweeps = cz.load_sweeps(zeus_path(), tuple(SWEEPS), SWEEPS)
    stages = {n: (cd.STAGES[n], cd.load_sweep(PERSEUS / cd.STAGES[n].file)) for n in STAGES}
    return sweeps, stages


def prior() -> dict[str, float]:
    """The family prior: the A100 80GB's fitted voltage curve, normalized (search_spaces/a100-sxm4-80gb.toml)."""
    return cz.voltage_prior(get_gpu(SIBLING))


def values(spec) -> dict[str, float]:
    """What the fit fits, of ``spec``."""
    return cd.values_of(spec, (*cz.FIT_PARAMETERS, "gemm_efficiency", "link_efficiency", "l2_bytes_per_clock"))


def judge(spec, sweeps, stages) -> dict[str, dict]:
    """Every workload's errors on ``spec``: Zeus networks (each of its sweeps), Perseus stages."""
    out: dict[str, dict] = {}
    for s in sweeps:
        out.setdefault(s.network, {})[s.name] = cz.summarize(cz.sweep_errors(spec, s))
    for n, (stage, sw) in stages.items():
        out[n] = cd.summarize(cd.residuals(spec, stage, sw))
    return out


def run_fit(leave_out: str | None) -> dict:
    """The fit on every workload but ``leave_out`` (None: all), from the fixed start: its values() and cost."""
    sweeps, stages = workloads()
    on_sweeps = [s for s in sweeps if s.network != leave_out]
    on_stages = [v for n, v in stages.items() if n != leave_out]
    t0 = time.monotonic()
    spec, result = cz.fit(start_spec(), on_stages, on_sweeps, prior=prior(), max_nfev=MAX_NFEV,
                          blocking_power_w=get_gpu(GPU).waiting_power.top_clocks_w)  # fmt: skip
    print(f"fit without {leave_out}: {time.monotonic() - t0:.0f} s, nfev {result.nfev}, cost {result.cost:.5f}",
          flush=True)
    return {"parameters": values(spec), "cost": float(result.cost), "nfev": int(result.nfev)}


def start_spec():
    """The A40 at the fit's fixed start (zeus.FIT_START), whatever its file holds now."""
    return cd.with_values(get_gpu(GPU), dict(cz.FIT_START))


def write_block(spec) -> None:
    path = search_spaces_dir() / f"{GPU}.toml"
    note = ("# Fitted jointly on Perseus's A40 stage sweeps (locked SM clocks) and Zeus's A40 power-limit sweeps "
            "(ShuffleNetV2, bert-base, DeepSpeech2), inside [power_model_bounds], with a prior toward the A100 80GB's "
            "voltage "
            f"curve ({WRITER}; method: freqopt/gpu/calibration/zeus.py; errors: experiments/a40_power_fit.md); "
            "power_window_s and the per-operator terms kept")  # fmt: skip
    body = [note, "[power_model]", *(f"{k} = {v:.6g}" for k, v in dataclasses.asdict(spec.power_model).items())]
    text = replace_toml_block(path.read_text(), "power_model", body, writer=WRITER)
    figures = {"gemm_efficiency": spec.gemm_efficiency, "link_efficiency": spec.interconnect.link_efficiency,
               "l2_bytes_per_clock": spec.l2_bytes_per_clock}
    for name, value in figures.items():
        text, n = re.subn(rf"^{name} = [^#\n]*#[^\n]*$", f"{name} = {value:.4g}  # fitted to Perseus's and Zeus's A40 "
                          f"sweeps ({WRITER})", text, flags=re.M)  # fmt: skip
        if n != 1:
            raise SystemExit(f"{path}: expected one {name} line")
    text, n = re.subn(r'^power = "[^\n]*"$', f'power = "{PROVENANCE}"', text, flags=re.M)
    if n != 1:
        raise SystemExit(f"{path}: expected one [provenance] power line")
    source = f'power_model = "{SOURCE}"'
    text, n = re.subn(r'^power_model = "[^\n]*"$', source, text, flags=re.M)
    if n == 0:
        text, n = re.subn(r'^(idle_power = "[^\n]*")$', lambda m: m.group(1) + "\n" + source, text, flags=re.M)
    if n != 1:
        raise SystemExit(f"{path}: expected one [sources] idle_power line")
    atomic_write_text(path, text)


def report(doc: dict) -> str:
    out = ["# The A40's power model fitted on Perseus's and Zeus's A40 sweeps (issue 56)", "",
           f"Produced by `python {WRITER}` (method, every assumption and sources: freqopt/gpu/calibration/zeus.py). "
           "One power model fitted jointly on Perseus's BLOOM and GPT-3 175B A40 stage sweeps at locked SM clocks "
           "and Zeus's A40 power-limit sweeps of ShuffleNetV2 (CIFAR-100, batches 256, 1024, 4096), bert-base "
           "(Sentiment140, batches 32, 128) and DeepSpeech2 (LibriSpeech, batches 16, 64, 192), every parameter "
           "inside the file's [power_model_bounds], with a prior "
           f"toward the A100 80GB's voltage curve (weight {cz.PRIOR_WEIGHT} per {cz.PRIOR_SCALE['v_min_rel']} of "
           f"v_min_rel or f_knee_rel; the A100's values when the fit ran: v_min_rel "
           f"{doc['sibling_prior']['v_min_rel']:.4g}, f_knee_rel {doc['sibling_prior']['f_knee_rel']:.4g}; a rerun "
           "takes the A100 file's current ones), from a fixed start, "
           f"at most {MAX_NFEV} least-squares iterations per fit. Zeus "
           "errors: time and energy per epoch relative to the 300 W limit, percentage points; the energy-optimal "
           "limit, W; each step's host gap solved from the 300 W point's measured average power. Perseus errors: "
           "time and energy relative to 1740 MHz, pp. Targets (issue 56): Zeus within "
           f"{TARGETS['zeus_pp']:g} pp at every limit and the optimum within {TARGETS['zeus_optimum_w']:g} W; "
           f"Perseus within {TARGETS['perseus_time_pp']:g} pp (time) and {TARGETS['perseus_energy_pp']:g} pp "
           "(energy).", "", "## Verdict", "", verdict(doc), "", "## Before and after", "", doc["before_after"], "",
           "## Fitted constants", "", "| parameter | before (the file this fit replaced) | all workloads | "
           + " | ".join(f"without {n}" for n in doc["folds"]) + " |", "|---|" + "---:|" * (2 + len(doc["folds"]))]
    for k in doc["fitted"]:
        out.append(f"| {k} | {doc['before']['parameters'][k]:.4g} | {doc['fitted'][k]:.4g} | "
                   + " | ".join(f"{f['parameters'][k]:.4g}" for f in doc["folds"].values()) + " |")
    for title, key in (("fitted on every workload (in-sample: not fidelity)", "fitted_on"),
                       ("each workload left out (its fold's fit, fitted without it)", "left_out"),
                       ("before: the constants this fit replaced", "before_errors")):
        out += ["", f"## Errors, {title}", "",
                "| Zeus sweep | worst time (pp) | worst energy (pp) | optimum miss (W) | worst avg power (W) |",
                "|---|---:|---:|---:|---:|"]  # fmt: skip
        errs = doc[key] if key != "before_errors" else doc["before"]["errors"]
        for n in SWEEPS:
            for name, s in errs[n].items():
                out.append(cz.summary_row(name, s))
        out += ["", "| Perseus stage | worst time (pp) | worst energy (pp) | optimum miss (MHz) | top power (%) |",
                "|---|---:|---:|---:|---:|"]
        for n in STAGES:
            s = errs[n]
            out.append(f"| {n} | {s['max_abs_time_rel_error_pp']:.2f} | {s['max_abs_energy_rel_error_pp']:.2f} | "
                       f"{s['energy_optimal_miss_mhz']:+d} | {s['top_power_error_pct']:+.1f} |")
    out += ["", "## Per limit, fitted on every workload", ""]
    out += cz.per_limit_tables(doc["points"])
    return "\n".join(out)


def _met(name: str, s: dict) -> bool:
    if name in STAGES:
        return (s["max_abs_time_rel_error_pp"] <= TARGETS["perseus_time_pp"]
                and s["max_abs_energy_rel_error_pp"] <= TARGETS["perseus_energy_pp"])
    return (s["max_abs_time_rel_error_pp"] <= TARGETS["zeus_pp"]
            and s["max_abs_energy_rel_error_pp"] <= TARGETS["zeus_pp"]
            and abs(s["energy_optimal_error_w"]) <= TARGETS["zeus_optimum_w"])


def verdict(doc: dict) -> str:
    """Which workloads meet issue 56's targets, fitted on and left out."""
    lines = []
    for key, what in (("fitted_on", "Fitted on every workload"), ("left_out", "Left out")):
        met, missed = [], []
        for n in (*SWEEPS, *STAGES):
            items = doc[key][n].items() if n in SWEEPS else [(n, doc[key][n])]
            for name, s in items:
                (met if _met(n, s) else missed).append(name)
        lines.append(f"{what}: targets met on {', '.join(met) or 'none'}; missed on {', '.join(missed) or 'none'}.")
    gemm = [f["parameters"]["gemm_efficiency"] for f in doc["folds"].values()]
    top = [doc["fitted_on"][n]["top_power_error_pct"] for n in STAGES]
    lines.append("Every parameter is inside its physical range and no limit falls off the cliff of issue 56 (the "
                 "before-and-after table). Where targets are missed, the worst points are the lowest limits (100-125 "
                 "W), where the time is 2-4x and a few watts of power error move it by tens of points, and a network "
                 "left out is predicted worse than fitted: the folds' GEMM efficiency runs "
                 f"{min(gemm):.2f}-{max(gemm):.2f} (all workloads: {doc['fitted']['gemm_efficiency']:.2f}), so the "
                 "other workloads do not pin its power curve. The Perseus stages' top-clock power comes out "
                 f"{min(top):+.0f} to {max(top):+.0f} %: with the static floor bounded by the idle draw, the model's "
                 "all-reduces over PCIe draw little, where the boards averaged 294 W.")
    spec = get_gpu(GPU)

    def _baseline_w(p: dict) -> float:  # of a stored parameter set, W
        return cz.baseline_top_w(cd.with_values(spec, p))

    base = {n: _baseline_w(f["parameters"]) for n, f in doc["folds"].items()}
    lines.append(f"The baseline at the highest clocks (nothing running: static floor, leakage, clock tree, memory "
                 f"clock) is {_baseline_w(doc['fitted']):.1f} W against Perseus's measured P2P-blocking power "
                 f"{spec.waiting_power.top_clocks_w:g} W, held as one residual at weight {cz.BLOCKING_WEIGHT:g} "
                 f"(the folds: {min(base.values()):.1f}-{max(base.values()):.1f} W; the file this fit replaced: "
                 f"{_baseline_w(doc['before']['parameters']):.1f} W).")
    return "\n\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only print the committed constants' errors")
    parser.add_argument("--jobs", type=int, default=2, help="fits run at once (default 2)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the JSON, no fit")
    args = parser.parse_args()
    if args.report_only:
        atomic_write_text(REPORT, report(json.loads(RESULTS.read_text())) + "\n")
        return 0
    sweeps, stages = workloads()
    committed = get_gpu(GPU)
    if args.check:
        print(json.dumps(judge(committed, sweeps, stages), indent=1))
        return 0
    before = {"parameters": values(committed), "errors": judge(committed, sweeps, stages)}
    for sw in sweeps:  # traced once here, before the workers fork
        cz.network_trace(sw.network, sw.batch_size, sw.dataset)
    for n in STAGES:
        cd.stage_kernels(n)
    names = (*SWEEPS, *STAGES)
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        fits = dict(zip((None, *names), pool.map(run_fit, (None, *names))))
    base = start_spec()
    write_block(cd.with_values(base, fits[None]["parameters"]))
    get_gpu.cache_clear()
    spec = get_gpu(GPU)  # the committed (rounded) constants
    folds, left_out = {}, {}
    for name in names:
        fold_spec = cd.with_values(base, fits[name]["parameters"])
        errs = judge(fold_spec, [s for s in sweeps if s.network == name],
                     {n: v for n, v in stages.items() if n == name})  # fmt: skip
        left_out[name] = errs[name]
        folds[name] = fits[name]
    doc = {"gpu": GPU, "sibling_prior": prior(), "prior_weight": cz.PRIOR_WEIGHT, "prior_scale": cz.PRIOR_SCALE,
           "max_nfev": MAX_NFEV, "sweeps": SWEEPS, "stages": list(STAGES), "targets": TARGETS,
           "fitted": values(spec), "fitted_on": judge(spec, sweeps, stages), "folds": folds, "left_out": left_out,
           "before": before,
           "points": {s.name: cz.sweep_errors(spec, s) for s in sweeps}}  # fmt: skip
    doc["before_after"] = before_after(committed, spec)
    atomic_write_text(RESULTS, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(REPORT, report(doc) + "\n")
    print(report(doc))
    return 0


def before_after(before, after) -> str:
    """The issue's figures: ShuffleNetV2 at batch 1024 and bert-base at 128 at 175 W / 150 W / 100 W, before and
    after, beside Zeus's measurement."""
    sweeps = {s.name: s for s in cz.load_sweeps(zeus_path(), tuple(SWEEPS), {"shufflenetv2": (1024,),
                                                                             "bert_base_uncased": (128,)})}
    lines = ["| sweep | limit (W) | measured t rel, P (W) | before: t rel, P (W) | after: t rel, P (W) |",
             "|---|---:|---|---|---|"]
    for name, s in sweeps.items():
        b = {p["power_limit_w"]: p for p in cz.sweep_errors(before, s)["points"]}
        a = {p["power_limit_w"]: p for p in cz.sweep_errors(after, s)["points"]}
        for w in (100.0, 150.0, 175.0):
            if w in b:
                lines.append(f"| {name} | {w:.0f} | {b[w]['time_rel_measured']:.2f}x, "
                             f"{b[w]['avg_power_measured_w']:.0f} | "
                             f"{b[w]['time_rel_simulated']:.2f}x, {b[w]['avg_power_simulated_w']:.0f} | "
                             f"{a[w]['time_rel_simulated']:.2f}x, {a[w]['avg_power_simulated_w']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
