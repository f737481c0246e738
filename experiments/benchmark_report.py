"""Write experiments/benchmark/benchmark.md from the `freqopt benchmark --json` files beside it.

    python experiments/benchmark_report.py

The runs themselves (27 s and 81 s for gpt3-small on h100-sxm, 225 s and 242 s for gpt3-xl on rtx3080ti, on 2
cores shared with two other runs, 2026-11-26, after issue 35):

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
    "Re-recorded 2026-11-26 after issue 35: each measurement is charged the whole steps (or replay loops) its "
    "warm-up and window ran (item 7), and with switching costs the search measures only the schedule a runtime "
    "realizes, no free-switching figure (SearchConfig.free_switching; the 2026-11-25 record charged the kernel "
    "level's free-switching allocation to it). The savings and predictions did not move; the sweeps' validated "
    "savings with free switching read 17.44 % and 6.86 % where the earlier record had 17.73 % and 6.75 % (the same "
    "17.44 % at bb64902, before issue 35: that record predates later changes), with the same noiseless figures on "
    "gpt3-small. Judged on the validated ratio instead, every verdict stays the same but gpt3-xl's with free "
    "switching, whose validated ratio (1.032) meets the savings target.",
    "",
    "- **gpt3-small on the H100, 26 ms switches: every target met.** The 27 ms step realizes one clock only, so the "
    "search measures the iteration level alone (35 measurements, 9 of them the baseline's; 0.6 % of the sweep's GPU "
    "time) and ends on the clock the sweep's best schedule realizes (SM 1935 MHz): a noiseless ratio of 1.000. The "
    "validated ratio (1.41) is larger because the sweep's per-kernel schedule validated on an unlucky reading of the "
    "same step.",
    "- **gpt3-xl on the RTX 3080 Ti, 100 ms switches: savings and prediction met, cost not** (0.0968 against 3 %; "
    "0.0263 when every measurement was charged about 1 s). The search's measurements are mostly whole 5.6 s steps "
    "(the iteration level's study, the phase level's block studies, validations), each now charged two steps, "
    "while most of the sweep's are kernel classes replayed alone, each a small fraction of a step: honest "
    "accounting of a long step moves the ratio against a search that measures whole steps. The sweep's schedule "
    "realizes the best single clock, SM 2085 MHz with memory at 9251 MHz (1.08 % at +0.86 % noiseless); the kernel "
    "level ends on the phase level's schedule: 1.19 % at +0.94 % noiseless (0.94 % validated, on unlucky readings), "
    "predicted 1.01 %. One seed is one draw of the noise: [seeds.md](seeds.md) runs this search for seeds 0-5.",
    "- **Free switching (not in issue 25's done-when):** gpt3-xl on the RTX 3080 Ti reaches 0.951 of the sweep's "
    "noiseless saving (1.032 validated) at 0.057 of its cost (0.024 before whole steps were charged), predicted 0.52 "
    "points below the validated figure; gpt3-small on the H100 reaches 0.915 at 0.076, predicted 3.4 points high. "
    "Before issue 25 (a study per class) it was 1.04 at 0.21: one setting per family of classes is much cheaper but "
    "loses what differing classes of one family would gain.",
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
