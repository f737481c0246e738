"""The fidelity scoreboard (issue 56, items 3 and 4): every registered data set, each GPU judged on data it was not
fitted on, in one table.

    python experiments/fidelity.py                 # every fold's refit, then the table; writes fidelity.{md,json}
    python experiments/fidelity.py --jobs 1        # the refits one at a time (default: 2 processes)
    python experiments/fidelity.py --only NAME     # refit only these data sets' folds, keep the others' recorded
    python experiments/fidelity.py --reset-before  # record today's figures as the "before" column too
    python experiments/fidelity.py --no-refit      # re-predict the rows with the recorded folds (what the guard
                                                   # does), for a new note or report; not after a refit
    python experiments/fidelity.py --report-only   # rewrite fidelity.md from fidelity.json

The data sets, what each leaves out and how to register another: freqopt/gpu/calibration/fidelity.py. Writes
experiments/fidelity.json (every row, every fold's fitted values, the guard's tolerances, the "before" figures) and
experiments/fidelity.md; tests/test_fidelity.py re-predicts the cheap rows from the recorded folds' values and fails
when a left-out error moves past its recorded value plus its tolerance. Re-run this after a refit of any GPU file or a
change to the physics, so that the guard holds the new figures.

"Before": the first recording keeps its rows as the "before" figures and later recordings keep those, so the table
shows what a refit changed; ``--reset-before`` starts again from today's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from freqopt.files import atomic_write_text
from freqopt.gpu.calibration import fidelity as fd

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE / "fidelity.json"
REPORT = HERE / "fidelity.md"


def _fit(entry: str, fold: str) -> tuple[str, str, dict, float]:
    t0 = time.process_time()
    values = fd.REGISTRY[entry].fit_fold(fold)
    return entry, fold, values, time.process_time() - t0


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             check=True)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "freqopt", "search_spaces"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _fmt(value, metric: str) -> str:
    if value is None:
        return "-"
    if metric.endswith(("_w", "_mhz")):
        return f"{value:.0f}"
    return f"{value:.2f}"


def _unit(metric: str) -> str:
    return {"time_rel_pp": "pp", "energy_rel_pp": "pp", "figure_pp": "pp", "optimal_limit_w": "W",
            "optimal_clock_mhz": "MHz", "mean_abs_pct": "%", "time_pct": "%", "energy_pct": "%",
            "power_pct": "%"}.get(metric, "")  # fmt: skip


def report(result: dict) -> str:
    before = {tuple(r[k] for k in ("entry", "gpu", "dataset", "metric")): r for r in result["before"]["rows"]}
    minutes, seconds = divmod(round(result["elapsed_s"]), 60)
    out = ["# Fidelity scoreboard: every GPU on every data set, left out", "",
           f"Produced by `python experiments/fidelity.py` on {result['date']} (commit {result['commit']}) in "
           f"{minutes} min {seconds} s of wall time with {result['jobs']} processes on a machine of "
           f"{result['cpus']} cores shared with other work ({result['fit_cpu_s']:.0f} s of refits' CPU time). Data "
           "sets, what each leaves out, and how to register another: freqopt/gpu/calibration/fidelity.py."
           + (f" Rows re-predicted with those refits' recorded folds on {result['rows_repredicted']['date']} (commit "
              f"{result['rows_repredicted']['commit']}, `--no-refit`)." if "rows_repredicted" in result else ""), "",
           "*Fitted on*: the committed constants' error on the data they were fitted on (a residual, not fidelity). "
           "*Left out*: each point predicted by a refit that did not see it (a workload, batch size, stage, shape or "
           "step left out at a time, per the note), the figure the targets judge. Figures are the largest |error| over "
           "the points (``mean_abs_pct``: the mean over a family's shapes); pp are percentage points of a ratio to "
           "the top clock or the highest power limit; % are of the measured. *Before*: the left-out figure recorded "
           f"on {result['before']['date']} (commit {result['before']['commit']}). Target: issue 56's, on the "
           "left-out figure.", "",
           "| GPU | data set | kind | metric | fitted on | left out | before | target | met | n | note |",
           "|---|---|---|---|---:|---:|---:|---:|:---:|---:|---|"]  # fmt: skip
    for r in result["rows"]:
        key = (r["entry"], r["gpu"], r["dataset"], r["metric"])
        unit = _unit(r["metric"])
        met = {True: "yes", False: "**no**", None: "-"}[r["meets"]]
        if r["status"] != "computed":
            met = r["status"] if r["status"] == "not modelled yet" else f"{met} ({r['status']})"
        prior = before.get(key, {}).get("left_out")
        out.append(f"| {r['gpu']} | {r['dataset']} | {r['kind']} | {r['metric']} | "
                   f"{_fmt(r['fitted_on'], r['metric'])} | "
                   f"{_fmt(r['left_out'], r['metric'])} | {_fmt(prior, r['metric'])} | "
                   f"{_fmt(r['target'], r['metric'])} {unit if r['target'] is not None else ''} | {met} | "
                   f"{r['n_points'] if r['n_points'] is not None else '-'} | "
                   f"{r['note'].replace('|', '/')} |")  # fmt: skip
    judged = [r for r in result["rows"] if r["meets"] is not None]
    out += ["", f"{sum(r['meets'] for r in judged)} of {len(judged)} left-out figures with a target meet it; "
            f"{sum(r['left_out'] is None and r['status'] == 'computed' for r in result['rows'])} computed rows have no "
            f"left-out figure (the note says why); {sum(r['status'] == 'not modelled yet' for r in result['rows'])} "
            "rows are data no model reads yet.", "",
            "The guard (tests/test_fidelity.py) recomputes the rows of the data sets marked cheap, re-applying each "
            "fold's recorded constants through today's code, and fails when a figure moves past its recorded value "
            "plus its tolerance (fidelity.json `tolerances`: " + ", ".join(
                f"{m} {a:g}" + (f" or {100 * rel:g} %" if rel else "") for m, (a, rel) in fd.TOLERANCES.items())
            + "; the larger applies). Folds' refit CPU time, by data set: " + ", ".join(
                f"{name} {sum(f['fit_cpu_s'] for f in e['folds'].values()):.0f} s ({len(e['folds'])} folds)"
                for name, e in result["entries"].items() if e["folds"]) + ".", ""]  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="processes for the refits (default 2)")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(fd.REGISTRY),
                        help="refit only these data sets' folds; the others' recorded folds are reused")
    parser.add_argument("--reset-before", action="store_true", help="record today's figures as 'before' too")
    parser.add_argument("--no-refit", action="store_true",
                        help="reuse every recorded fold (no refit), re-predict the rows and rewrite the report")
    parser.add_argument("--report-only", action="store_true", help="rewrite fidelity.md from fidelity.json")
    args = parser.parse_args(argv)
    if args.report_only:
        atomic_write_text(REPORT, report(json.loads(JSON_PATH.read_text())))
        return 0
    if args.no_refit:
        args.only = []
    started = time.time()
    old = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else None
    tasks = []
    folds: dict[str, dict[str, dict]] = {name: {} for name in fd.REGISTRY}
    for name, ds in fd.REGISTRY.items():
        names = ds.fold_names()
        if args.only is not None and name not in args.only:
            recorded = (old or {}).get("entries", {}).get(name, {}).get("folds", {})
            if set(recorded) != set(names):
                raise SystemExit(f"{name}: no recorded folds to reuse (run without --only)")
            folds[name] = recorded
            continue
        tasks += [(name, f) for f in names]
    # The longest refits first, so that the pool's processes finish together.
    tasks.sort(key=lambda t: {"zeus-v100-bert-squad": 0, "perseus-a40-stages": 1}.get(t[0], 2))
    print(f"{len(tasks)} refits on {args.jobs} processes", flush=True)
    if args.jobs > 1:  # fork: the workers inherit the loaded data (the H200's traced points)
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            pending = [pool.submit(_fit, *t) for t in tasks]
            for i, future in enumerate(as_completed(pending), 1):
                entry, fold, values, cpu = future.result()
                folds[entry][fold] = {"values": values, "fit_cpu_s": cpu}
                print(f"[{i}/{len(tasks)} {time.time() - started:.0f} s] {entry} / {fold}: {cpu:.1f} s", flush=True)
    else:
        for i, t in enumerate(tasks, 1):
            entry, fold, values, cpu = _fit(*t)
            folds[entry][fold] = {"values": values, "fit_cpu_s": cpu}
            print(f"[{i}/{len(tasks)} {time.time() - started:.0f} s] {entry} / {fold}: {cpu:.1f} s", flush=True)
    rows, entries = [], {}
    for name, ds in fd.REGISTRY.items():
        ordered = {f: folds[name][f] for f in ds.fold_names()}
        rows += [r.as_dict() for r in ds.rows({f: v["values"] for f, v in ordered.items()})]
        entries[name] = {"gpus": list(ds.gpus), "kind": ds.kind, "source": ds.source, "cheap": ds.cheap,
                         "modelled": ds.modelled, "folds": ordered}  # fmt: skip
    commit, date = _commit(), time.strftime("%Y-%m-%d")
    result = {"date": date, "commit": commit, "jobs": args.jobs, "cpus": os.cpu_count(),
              "elapsed_s": time.time() - started,
              "fit_cpu_s": sum(f["fit_cpu_s"] for e in entries.values() for f in e["folds"].values()),
              "tolerances": {m: list(t) for m, t in fd.TOLERANCES.items()},
              "tolerances_note": "(absolute, relative to the recorded figure): the larger applies; why: "
                                 "freqopt/gpu/calibration/fidelity.py TOLERANCES",
              "rows": rows, "entries": entries}  # fmt: skip
    if args.no_refit:  # the refits are the recorded ones: so are their date, commit and time
        result.update({k: old[k] for k in ("date", "commit", "jobs", "cpus", "elapsed_s", "fit_cpu_s")},
                      rows_repredicted={"date": date, "commit": commit})  # fmt: skip
    keep = old is not None and "before" in old and not args.reset_before
    result["before"] = old["before"] if keep else {"date": date, "commit": commit, "rows": rows}
    atomic_write_text(JSON_PATH, json.dumps(result, indent=1) + "\n")
    atomic_write_text(REPORT, report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
