"""How long the main job's search takes, and what each speed-up of issue 13 contributes (ratios from one run).

    python experiments/search_speed.py            # writes experiments/search_speed/report.md and results.json

Runs the README's main job (gpt3-small on the simulated H100, 1 % slowdown, every granularity, its storage in a
fresh folder) through the Python API, each variant in a fresh process, the variants interleaved and repeated, so
that the machine's drift hits them alike:

- "before": Optuna's own acquisition optimizer (GridGPSampler.max_grid_points = 0 hands every space back to
  it) and an SQLite storage in SQLite's default rollback journal (the WAL pragma switched off); it differs from
  the code before issue 13's speed-ups only in reading the study's trials once per trial instead of twice;
- "grid acquisition": the acquisition scored on the whole grid, SQLite's default journal;
- "SQLite, write-ahead log": the grid acquisition and SQLite in write-ahead-log mode (the default storage from
  issue 13 to issue 25, still what a sqlite:/// URL gets);
- "now": the grid acquisition and the default storage, an Optuna journal file under a flock
  (freqopt.search.storage.JournalFile; issue 25) (what freqopt does);
- "now, in memory": the same with no storage at all (the floor that storage costs come on top of; it also
  writes no tables or figures, about 2 s);
- "every level searched, a study per class": "now" without issue 25's measurement savings: the pass, kernel and
  phase levels searched although the step realizes one clock (runner.one_clock_reason answers ""), one
  study per kernel class instead of per family (search_units without share_families, where runner, unit_studies
  and free_switching call it), and every class searched, those that lead no phase too (unit_studies._unsearched
  answers ()).

Every variant must print the same search result; the script checks it (the last variant, which measures more,
must validate the same energy and time at the power cap and the iteration level; its finer levels search schedules
the others never measure).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "search_speed"
REPEATS = 2
SQLITE = "sqlite:///{tmp}/freqopt.db"  # beside the output folder: a given storage is opened before it is made
VARIANTS = {  # variant: (code run first, storage URL: None for the default)
    "before": ("GridGPSampler.max_grid_points = 0; storage._sqlite_write_ahead_log = lambda *a: None", SQLITE),
    "grid acquisition": ("storage._sqlite_write_ahead_log = lambda *a: None", SQLITE),
    "SQLite, write-ahead log": ("", SQLITE),
    "now": ("", None),
    "now, in memory": ("", None),
    "every level searched, a study per class": (
        "runner = sys.modules['freqopt.search.runner']; units = sys.modules['freqopt.search.units']; "
        "studies = sys.modules['freqopt.search.unit_studies']; free = sys.modules['freqopt.search.free_switching']; "
        "runner.one_clock_reason = lambda *a: ''; studies._unsearched = lambda *a: (); "
        "runner.search_units = studies.search_units = free.search_units = "
        "lambda trace, granularity, share=False: units.search_units(trace, granularity)", None),
}
# Measures more by design: compare the figures of the levels it searches as "now" does (the power cap and the
# iteration level); its pass, kernel and phase levels search schedules "now" never measures, so theirs may differ.
SAME_FIGURES_ONLY = {"every level searched, a study per class"}
SAME_LEVELS = ("power-cap", "iteration")
RUN = """
import json, sys, time
import freqopt
from freqopt.search import storage
from freqopt.search.study import GridGPSampler
{patch}
start = time.perf_counter()
result = freqopt.search("gpt3-small", max_slowdown="1%", out={out!r}, storage={storage!r})
summary = result.summary()
print(json.dumps({{"time_s": time.perf_counter() - start, "results": {{g: {{k: v for k, v in r.items() if k != "table"}}
                   for g, r in summary["results"].items()}}}}))
"""


def run(variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = None if variant.endswith("in memory") else str(Path(tmp) / "out")
        patch, storage = VARIANTS[variant]
        code = RUN.format(patch=patch, out=out, storage=storage and storage.format(tmp=tmp))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _figures(results: dict) -> dict:
    """Per granularity, the validated energy saved and slowdown (%)."""
    return {g: (r["energy_saved_pct"], r["slowdown_pct"]) for g, r in results.items()}


def main() -> int:
    HERE.mkdir(exist_ok=True)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    reference = None
    for r in range(REPEATS):
        for variant in VARIANTS:
            got = run(variant)
            times[variant].append(got["time_s"])
            print(f"round {r + 1}, {variant}: {got['time_s']:.1f} s", file=sys.stderr)
            if reference is None:
                reference = got["results"]
            elif (_figures({g: got["results"][g] for g in SAME_LEVELS}) != _figures({g: reference[g] for g in SAME_LEVELS})
                  if variant in SAME_FIGURES_ONLY else got["results"] != reference):
                print(f"{variant} found another result than the first run", file=sys.stderr)
                return 1
    median = {v: statistics.median(t) for v, t in times.items()}
    lines = ["# Time of the main job's search (issue 13: the README's main job in under 30 s)", "",
             f"Produced by `python experiments/search_speed.py` on {time.strftime('%Y-%m-%d')} on this 2-core CPU machine: "
             "`freqopt.search(\"gpt3-small\", max_slowdown=\"1%\", out=...)`, from the trace to the written tables "
             "and figures, each variant in a fresh process (imports not counted), the variants interleaved, "
             f"{REPEATS} rounds, medians. Every run found the same result (the last variant: the same validated "
             "figures at the power cap and the iteration level, from more measurements; its finer levels search "
             "schedules the others never measure).", "",
             "| variant | seconds (median) | runs | against before |", "|---|---:|---|---:|"]
    for v in VARIANTS:
        lines.append(f"| {v} | {median[v]:.1f} | {', '.join(f'{t:.1f}' for t in times[v])} | "
                     f"{median[v] / median['before']:.2f} |")
    (HERE / "report.md").write_text("\n".join(lines) + "\n")
    (HERE / "results.json").write_text(json.dumps({"times_s": times, "median_s": median}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
