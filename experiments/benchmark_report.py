"""Write experiments/benchmark/benchmark.md from the `freqopt benchmark --json` files beside it.

    python experiments/benchmark_report.py

The runs themselves (14 s and 25 s for gpt3-small on h100-sxm, 119 s and 147 s for gpt3-xl on rtx3080ti, on 2
cores shared with one other run, 2026-11-25, after issue 25's second change):

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
    "Recorded 2026-11-25 after issue 25's second change (the baseline read 9 times and a schedule too near the "
    "limit to call read again; the whole iteration's study measures the budget's edge at each memory clock; kernel "
    "families that lead no phase are not searched where a runtime switches per phase; the phase level predicts on the "
    "bounds it chose on; the baseline's readings are counted). Judged on the validated ratio instead, every verdict "
    "stays the same but gpt3-xl's with free switching, whose validated ratio (1.049) meets the savings target.",
    "",
    "- **gpt3-small on the H100, 26 ms switches: every target met.** The 27 ms step realizes one clock only, so the "
    "search measures the iteration level alone (35 measurements, 9 of them the baseline's; 0.6 % of the sweep's) and "
    "ends on the clock the sweep's best schedule realizes (SM 1935 MHz): a noiseless ratio of 1.000. The validated "
    "ratio (1.41) is larger because the sweep's per-kernel schedule validated on an unlucky reading of the same step.",
    "- **gpt3-xl on the RTX 3080 Ti, 100 ms switches: every target met** (0.83 and 0.0303 before this change). The "
    "sweep's schedule realizes the best single clock, SM 2085 MHz with memory at 9251 MHz (1.08 % at +0.86 % "
    "noiseless). The search's iteration level used to end at memory 9501 MHz (0.90 %): its GP never measured the "
    "budget's edge at 9251, and the memory clock's 0.18 points there are less than one reading's noise. The study "
    "now measures that edge at every memory clock, and ends at 2085/9251; the kernel level then ends on the phase "
    "level's schedule, whose blocks run at 2085/9251, 2100/9501, 2025/9501 and the defaults (45, 27, 16 and 13 % of "
    "the step's time): 1.19 % at +0.94 % noiseless (0.94 % validated, on unlucky readings), predicted 1.01 %. The kernel level no longer "
    "searches the 4 of its 11 families that lead no phase (flash attention's backward, softmax, reductions, copies): "
    "a runtime switching per phase gives each phase its dominant setting, so theirs would never be applied. One "
    "seed is one draw of the noise: [seeds.md](seeds.md) runs this search for seeds 0-5.",
    "- **Free switching (not in issue 25's done-when):** gpt3-xl on the RTX 3080 Ti meets the cost target (0.024), "
    "reaches 0.964 of the sweep's noiseless saving (1.049 validated) and predicts 0.52 points below the validated "
    "figure; gpt3-small on the H100 reaches 0.915 at 0.075, predicted 3.4 points high. Before issue 25 (a study per "
    "class) it was 1.04 at 0.21: one setting per family of classes is much cheaper but loses what differing classes "
    "of one family would gain.",
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
