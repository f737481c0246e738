"""Where the main job's time goes: imports, the trace, each level's search, validation, tables and figures.

    python experiments/search_speed.py            # writes experiments/search_speed/report.md and results.json
    python experiments/search_speed.py --runs 1   # one run (a quick look; the report wants the median of 3)

Runs the README's main job, ``freqopt search --model gpt3-small --max-slowdown 1% --out DIR`` (the simulated H100,
every granularity, the journal on disk, tables and figures written), each run in a fresh Python process through the
CLI's own entry point (freqopt.cli.main), so that every import it needs is counted. Inside that process each phase's
time is taken with time.perf_counter around the functions that do it, exclusive of the phases nested in it:

- "imports": every module loaded (importlib._bootstrap._find_and_load, outermost import only), wherever it is loaded;
- "memory check": the step's memory estimate (freqopt.workload.memory.estimate_step_memory, a forward pass on
  the meta device);
- "trace": tracing the iteration (freqopt.workload.trace.trace_training_iteration);
- "search: LEVEL": a level's own studies and allocation (freqopt.search.runner._search_granularity,
  _search_phase); "free switching: LEVEL": the free-switching figure of a level held to one clock
  (freqopt.search.free_switching.search_free_switching);
- "validation": every whole-iteration measurement of a schedule (freqopt.search.validate.Validator.requests),
  within whichever level asked for it;
- "tables", "figures": SearchResult.write_tables and freqopt.search.plots.write_search_figures;
- "other": the rest of the process's time from its first line (argument checks, the CLI's rendering, ...);
- "interpreter": the process's wall time as seen from outside less its time from its first line (Python's start).

Every run must give the same validated figures (energy saved and slowdown at every level, free-switching figures
included); the script checks it and stops otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "search_speed"
ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["search", "--model", "gpt3-small", "--max-slowdown", "1%"]
FIGURES = ("energy_saved_pct", "slowdown_pct", "ideal_energy_saved_pct", "ideal_slowdown_pct")

# Run in the fresh process: the phase clock is installed before freqopt is imported.
RUN = r'''
import time
START = time.perf_counter()
import functools, importlib, importlib._bootstrap as bootstrap, json, sys

totals, stack = {}, [["other", START]]  # the phase running now is stack[-1]: [label, since]

def enter(label):
    now = time.perf_counter()
    top = stack[-1]
    totals[top[0]] = totals.get(top[0], 0.0) + now - top[1]
    stack.append([label, now])

def leave():
    now = time.perf_counter()
    label, since = stack.pop()
    totals[label] = totals.get(label, 0.0) + now - since
    stack[-1][1] = now

def timed(fn, label):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enter(label(*args, **kwargs) if callable(label) else label)
        try:
            return fn(*args, **kwargs)
        finally:
            leave()
    return wrapper

find_and_load = bootstrap._find_and_load
def loading(name, import_):
    if stack[-1][0] == "imports":  # nested in another import: counted there
        module = find_and_load(name, import_)
    else:
        enter("imports")
        try:
            module = find_and_load(name, import_)
        finally:
            leave()
    for attr, label in TARGETS.get(name, ()):
        owner, _, fn = attr.rpartition(".")
        holder = getattr(module, owner) if owner else module
        setattr(holder, fn, timed(getattr(holder, fn), label))
    return module
bootstrap._find_and_load = loading

TARGETS = {
    "freqopt.workload.memory": [("estimate_step_memory", "memory check")],
    "freqopt.workload.trace": [("trace_training_iteration", "trace")],
    "freqopt.search.runner": [("_search_granularity", lambda *a, **k: "search: " + a[3]),
                              ("_search_phase", "search: phase"),
                              ("search_free_switching", lambda *a, **k: "free switching: " + a[3].granularity)],
    "freqopt.search.validate": [("Validator.requests", "validation")],
    "freqopt.search.result": [("SearchResult.write_tables", "tables")],
    "freqopt.search.plots": [("write_search_figures", "figures")],
}

import freqopt.api
search = freqopt.api.search
found = {}
def keep(*args, **kwargs):
    found["result"] = search(*args, **kwargs)
    return found["result"]
freqopt.api.search = keep
import freqopt.cli
code = freqopt.cli.main(sys.argv[2:])
bootstrap._find_and_load = find_and_load
totals["other"] += time.perf_counter() - stack[0][1]
inside_s = time.perf_counter() - START
summary = found["result"].summary()
json.dump({"phases_s": totals, "inside_s": inside_s, "code": code,
           "results": {g: {k: r[k] for k in FIGURES} for g, r in summary["results"].items()}},
          open(sys.argv[1], "w"))
'''


def run_once() -> dict:
    """One main job in a fresh process: its phases (s), its wall time from outside (s) and its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "phases.json"
        code = f"FIGURES = {FIGURES!r}\n" + RUN
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code, str(report), *COMMAND, "--out", str(Path(tmp) / "out")],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
        wall_s = time.perf_counter() - start
        got = json.loads(report.read_text())
    if got["code"]:
        raise SystemExit(f"the main job exited with {got['code']}")
    got["wall_s"] = wall_s
    got["phases_s"]["interpreter"] = wall_s - got["inside_s"]
    return got


def _order(labels) -> list[str]:
    """Phases in the order of the job: imports, the trace, the levels' searches, writing, the rest."""
    head = ["interpreter", "imports", "memory check", "trace"]
    levels = sorted(x for x in labels if x.startswith(("search: ", "free switching: ")))
    order = {"power-cap": 0, "iteration": 1, "pass": 2, "phase": 3, "kernel": 4}
    levels.sort(key=lambda x: (order.get(x.split(": ")[1], 9), x.startswith("free")))
    tail = ["validation", "tables", "figures", "other"]
    return [x for x in head + levels + tail if x in labels] + sorted(set(labels) - set(head + levels + tail))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes, medians reported (default 3)")
    parser.add_argument("--note", default="", help="a sentence on the machine's load, put in the report")
    args = parser.parse_args()
    HERE.mkdir(exist_ok=True)
    runs = []
    for i in range(args.runs):
        runs.append(run_once())
        print(f"run {i + 1}: {runs[-1]['wall_s']:.1f} s", file=sys.stderr)
        if runs[-1]["results"] != runs[0]["results"]:
            print("this run found other figures than the first", file=sys.stderr)
            return 1
    labels = _order({k for r in runs for k in r["phases_s"]})
    median = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in runs) for k in labels}
    wall = statistics.median(r["wall_s"] for r in runs)
    lines = ["# Where the main job's time goes", "",
             f"Produced by `python experiments/search_speed.py` on {time.strftime('%Y-%m-%d')}, on a 2-core CPU "
             f"machine{': ' + args.note if args.note else ''}. The main job, `freqopt {' '.join(COMMAND)} --out DIR` "
             "(the simulated H100, every granularity, the journal on disk, tables and figures written), runs in a "
             f"fresh process {args.runs} times; each phase is timed inside it with time.perf_counter, exclusive of "
             "the phases nested in it (the script's docstring says which function each phase is), and the "
             "medians are shown. Every run gave the same validated figures.", "",
             f"Wall time, median: **{wall:.1f} s** (runs: {', '.join(format(r['wall_s'], '.1f') for r in runs)}).", "",
             "| phase | seconds (median) | share |", "|---|---:|---:|"]  # fmt: skip
    for k in labels:
        lines.append(f"| {k} | {median[k]:.2f} | {100 * median[k] / wall:.0f} % |")
    lines += ["", "What the phases hold:", "",
              "- imports: PyTorch (the trace runs the model on the meta device, and Optuna's GP is PyTorch code), "
              "torch._dynamo (loaded by the first meta-device operation PyTorch implements in Python, so by the "
              "trace and the memory check), Optuna, scipy.optimize (the GP's L-BFGS and the allocator's MILP) and "
              "matplotlib's Figure (no pyplot); the rest of scipy.stats, pyplot and SQLAlchemy are not loaded;",
              "- search: power-cap and iteration: one study each over the whole step, sampled by Optuna's GP "
              "(GridGPSampler, on one PyTorch thread), then allocation and validation;",
              "- free switching: pass and kernel: the free-switching figure of levels held to one clock, their "
              "units' studies sampled by Optuna's GP as the realizable levels' are, allocated exactly (MILP) and "
              "validated without switch "
              "latency;",
              "- nothing is cached between runs: every run traces the model and measures from scratch."]
    results = runs[0]["results"]
    lines += ["", "The figures every run gave (energy saved and slowdown, %; free switching beside them):", "",
              "| level | saved | slowdown | free switching: saved | free switching: slowdown |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for g, r in results.items():
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in FIGURES]
        lines.append(f"| {g} | {' | '.join(cells)} |")
    (HERE / "report.md").write_text("\n".join(lines) + "\n")
    (HERE / "results.json").write_text(json.dumps({"command": COMMAND, "wall_s": [r["wall_s"] for r in runs],
                                                   "median_wall_s": wall, "median_phases_s": median,
                                                   "runs": runs}, indent=1) + "\n")  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
