"""Write experiments/benchmark/benchmark.md from the `freqopt benchmark --json` files beside it.

    python experiments/benchmark_report.py

The runs themselves (20 s and 31 s for gpt3-small on h100-sxm, 128 s and 141 s for gpt3-xl on rtx3080ti, on 2
cores, nothing else running but a wait loop, 2026-11-26, after issue 35's item 1):

    freqopt benchmark --model gpt3-small --gpu h100-sxm --json experiments/benchmark/gpt3-small-h100-sxm.json
    freqopt benchmark --model gpt3-small --gpu h100-sxm --free-switching --json experiments/benchmark/gpt3-small-h100-sxm-free-switching.json
    freqopt benchmark --model gpt3-xl --gpu rtx3080ti --micro-batch-size 40 --seq-len 1024 --json experiments/benchmark/gpt3-xl-rtx3080ti.json
    freqopt benchmark --model gpt3-xl --gpu rtx3080ti --micro-batch-size 40 --seq-len 1024 --free-switching --json experiments/benchmark/gpt3-xl-rtx3080ti-free-switching.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "benchmark"
def _switches(gpu: str) -> str:
    """The GPU file's effective clock-switch latency, as the benchmark validated with it."""
    from freqopt.gpu.specs import get_gpu

    return f"{1e3 * get_gpu(gpu).clock_switch_s:g} ms switches"


RUNS = [
    ("gpt3-small-h100-sxm", "gpt3-small (micro-batch 4, sequence 2048) on h100-sxm", _switches("h100-sxm")),
    ("gpt3-small-h100-sxm-free-switching", "gpt3-small (micro-batch 4, sequence 2048) on h100-sxm", "free switching"),
    ("gpt3-xl-rtx3080ti", "gpt3-xl (micro-batch 40, sequence 1024) on rtx3080ti", _switches("rtx3080ti")),
    ("gpt3-xl-rtx3080ti-free-switching", "gpt3-xl (micro-batch 40, sequence 1024) on rtx3080ti", "free switching"),
]
TARGET_SAVINGS, TARGET_COST, TARGET_PREDICTION_PP = 0.97, 0.03, 0.5  # issue 6's targets, issue 25's done-when
NOTES = [
    "Re-recorded 2026-11-26 after issue 35's item 1: every schedule of the search and of the sweep is held to the "
    "budget at 95 % confidence (the upper bound of its slowdown from readings paired with the defaults'), and the "
    "one chosen is read again on 9 fresh pairs, its figures those fresh readings' (Validator.confirm). Before it "
    "(the mean held to the budget), the search's free-switching schedule on gpt3-small was truly +1.05 % slow. "
    "gpt3-xl on the RTX 3080 Ti with switching was re-run 2026-11-27 after the phase level came to fit its blocks "
    "along the SM clock and to sample within the budget's reach: the same schedule and figures, at 962 measurements "
    "where it took 810 (cost ratio 0.141, was 0.110); the other three runs search no phase level and were not re-run.",
    "",
    "- **gpt3-small on the H100, 26 ms switches: every target met.** The 27 ms step realizes one clock only, so the "
    "search measures the iteration level alone (59 measurements: its study, the baseline's 9, the paired and fresh "
    "readings; 1.0 % of the sweep's GPU time) and ends on the clock the sweep's best schedule realizes (SM 1935 "
    "MHz): 1.62 % validated by both (1.85 % and 1.32 % before, on the readings each was chosen on), 1.59 % noiseless.",
    "- **gpt3-small on the H100, free switching: the search loses.** It ends on the one clock's 1.58 % where the "
    "sweep allocates 17.19 % (17.14 % at +0.87 % noiseless): the kernel level's allocations from its noisy unit "
    "fronts measured about 1 % slow or more whatever the allocator's budget, none confirmed within 1 % at 95 %, and "
    "the search fell back to its coarser schedule; the sweep's noiseless fronts allocate the budget exactly. Before "
    "item 1 it kept 15.85 % (0.915 of the sweep), truly +1.05 % slow.",
    "- **gpt3-xl on the RTX 3080 Ti, 100 ms switches: no savings ratio, prediction met, cost not** (0.141 against "
    "3 %). The sweep saves nothing: its best single clock (SM 2085 MHz, memory 9251 MHz, 1.08 % at +0.86 % "
    "noiseless) and its allocations lie too near the 1 % edge to confirm at 95 % on 9 fresh pairs of 5.6 s steps, so "
    "it ends on the defaults. The search ends at 0.51 % validated, 0.90 % at +0.67 % noiseless (predicted 0.93 %). "
    "[seeds.md](seeds.md) runs this search for seeds 0-7: 0.96 % on average, none over the budget. The cost ratio "
    "is against a search that measures whole 5.6 s steps, two per measurement, where most of the sweep's "
    "measurements replay single kernel classes.",
    "- **Free switching (not in issue 25's done-when):** gpt3-xl on the RTX 3080 Ti reaches 1.005 of the sweep's "
    "noiseless saving (1.016 validated: 6.66 % against 6.56 %) at 0.066 of its cost, predicted 0.04 points from its "
    "validated figure.",
]


def main() -> int:
    lines = ["# Bayesian search against an exhaustive sweep (kernel level, 1 % budget, simulated GPUs)", "",
             "Produced by `python experiments/benchmark_report.py` from the `freqopt benchmark --json` files here; "
             "the commands are in that script's docstring. The sweep measures every kernel class at every "
             "supported clock pair (and the whole iteration at every pair), charged as a real sweep would spend "
             "GPU time; both results are validated on the whole iteration against the same kind of baseline, and "
             "each chosen schedule's noiseless saving and slowdown (the simulated step without measurement noise) are shown "
             "beside them; the savings target is judged on the noiseless ratio (below). "
             f"Targets: at least {TARGET_SAVINGS:.0%} of the sweep's saving at no more than {TARGET_COST:.0%} of its "
             f"cost, and a prediction within {TARGET_PREDICTION_PP} points of the validated saving.", "",
             "| setting | switching | search: saved (%) | predicted (%) | noiseless: saved / slowdown (%) | "
             "sweep: saved (%) | noiseless: saved / slowdown (%) | savings ratio, noiseless (validated) | "
             "search cost (GPU-h) | sweep cost (GPU-h) | cost ratio | targets met |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for stem, setting, switching in RUNS:
        path = HERE / f"{stem}.json"
        if not path.exists():
            lines.append(f"| {setting} | {switching} | not run | | | | | | | | | |")  # 12 columns
            continue
        d = json.loads(path.read_text())
        s, o = d["search"], d["oracle"]
        ratio, validated_ratio = d["true_savings_ratio"], d["savings_ratio"]
        met = []
        met.append("savings" if ratio is not None and ratio >= TARGET_SAVINGS else "not savings")
        met.append("cost" if d["cost_ratio"] <= TARGET_COST else "not cost")
        gap = abs(s["predicted_energy_saved_pct"] - s["energy_saved_pct"])
        met.append("prediction" if gap <= TARGET_PREDICTION_PP else f"not prediction ({gap:.1f} pp off)")
        lines.append(
            f"| {setting} | {switching} | {s['energy_saved_pct']:.2f} | {s['predicted_energy_saved_pct']:.2f} | "
            f"{s['true_energy_saved_pct']:.2f} / {s['true_slowdown_pct']:.2f} | {o['energy_saved_pct']:.2f} | "
            f"{o['true_energy_saved_pct']:.2f} / {o['true_slowdown_pct']:.2f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} ({'-' if validated_ratio is None else f'{validated_ratio:.3f}'}) | "
            f"{s['search_cost_gpu_s'] / 3600:.3f} | {o['search_cost_gpu_s'] / 3600:.3f} | {d['cost_ratio']:.4f} | "
            f"{', '.join(met)} |"
        )
    lines += ["", *NOTES, ""]
    (HERE / "benchmark.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
