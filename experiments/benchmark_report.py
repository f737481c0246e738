"""Write experiments/benchmark/benchmark.md from the `freqopt benchmark --json` files beside it.

    python experiments/benchmark_report.py

The runs themselves (17 s and 26 s for gpt3-small on h100-sxm, 265 s and 54 s for gpt3-xl on rtx3080ti, on 2
cores shared with one or two other experiment runs, 2026-11-25, after issue 25's change):

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
    "Recorded 2026-11-25 after issue 25's change (a family of kernel classes shares one study; levels a runtime "
    "cannot realize are not measured). Judged on the validated ratio instead, every verdict in the table stays "
    "the same.",
    "",
    "- **gpt3-small on the H100, 26 ms switches: every target met.** The 27 ms step realizes one clock only, so the "
    "search measures the iteration level alone (26 measurements, 0.4 % of the sweep's) and ends on the clock the "
    "sweep's best schedule realizes (SM 1935 MHz): a noiseless ratio of 1.000. The validated ratio (1.42) is larger "
    "because the sweep's per-kernel schedule validated on an unlucky reading of the same step.",
    "- **gpt3-xl on the RTX 3080 Ti, 100 ms switches: savings (0.83) and cost (0.0303) missed; the prediction, "
    "0.28 points off, meets its target.** The best uniform clock is SM 2085 MHz with memory at 9251 MHz (1.08 % noiseless); "
    "the search ends at 2085/9501 (0.90 %). Its iteration level measured 2085/9251 only once near the edge, and the "
    "GP left it. A trial patch (not kept) that offered the neighbouring memory clocks at the edge with repeated "
    "readings had it come out ahead (0.99 % against 0.93 % over three readings each), but the whole-step "
    "validations then chose 2085/9501, whose three readings fell 0.36 points on the lucky side (1.26 % validated against "
    "0.90 % noiseless): the least validated energy among schedules a few tenths apart is a winner's-curse choice. "
    "The cost, 872 measurements against the 865 the target allows, is just over it: the phase level's block "
    "studies (whole iterations, searched as the kernel level's candidates) take 198 of them, stopping once 4 trials in "
    "a row leave a block's front unchanged (SearchConfig.phase_patience; 348 without it, a cost ratio of 0.035; "
    "at 3 it is 865, 0.0300, the same saving).",
    "- **Free switching (not in issue 25's done-when):** gpt3-xl on the RTX 3080 Ti meets savings and cost (0.987, "
    "0.023) with a prediction 0.70 points below the validated figure; gpt3-small on the H100 reaches 0.875 at 0.072, "
    "predicted 4 points high. Before issue 25 (a study per class) it was 1.04 at 0.21: one setting per family of "
    "classes is much cheaper but loses what differing classes of one family would gain.",
]


def main() -> int:
    lines = ["# Bayesian search against an exhaustive sweep (kernel level, 1 % budget, simulated GPUs)", "",
             "Produced by `python experiments/benchmark_report.py` from the `freqopt benchmark --json` files here; "
             "the commands are in that script's docstring. The sweep measures every kernel class at every "
             "supported clock pair (and the whole iteration at every pair), charged as a real sweep would spend "
             "GPU time; both results are validated on the whole iteration against the same kind of baseline, and "
             "each chosen schedule's noiseless saving (the simulated step without measurement noise) is shown "
             "beside it; the savings target is judged on the noiseless ratio (below). "
             f"Targets: at least {TARGET_SAVINGS:.0%} of the sweep's saving at no more than {TARGET_COST:.0%} of its "
             f"cost, and a prediction within {TARGET_PREDICTION_PP} points of the validated saving.", "",
             "| setting | switching | search: saved (%) | predicted (%) | noiseless (%) | sweep: saved (%) | "
             "noiseless (%) | savings ratio, noiseless (validated) | search cost (GPU-h) | sweep cost (GPU-h) | "
             "cost ratio | targets met |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for stem, setting, switching in RUNS:
        path = HERE / f"{stem}.json"
        if not path.exists():
            lines.append(f"| {setting} | {switching} | not run | | | | | | | | | |")
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
            f"{s['true_energy_saved_pct']:.2f} | {o['energy_saved_pct']:.2f} | {o['true_energy_saved_pct']:.2f} | "
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
