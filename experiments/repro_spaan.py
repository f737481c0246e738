"""Reproduce Spaan, Chen, Varbanescu 2026 with freqopt: pass- and kernel-level DVFS of GPT-3 XL training on an
RTX 3080 Ti, local and global allocation, goals "no slowdown" and "minimal energy-delay product", and the
energy saved against the allowed slowdown from 0 % to 100 %.

    python experiments/repro_spaan.py       # 20-30 minutes on 2 cores; writes experiments/spaan/

Paper: "Reducing Compute Waste in LLMs through Kernel-Level DVFS" (arXiv 2601.08539, ACM Computing Frontiers
2026); its figures as quoted in shared/calibration/published.md. Setup here, as theirs: GPT-3 XL (24 layers,
d_model 2048, 16 heads), sequence 1024, micro-batch 40, one training iteration, the simulated rtx3080ti
(SM clocks 210-2100 MHz, memory clocks 405-9501 MHz). Differences: freqopt traces the whole model rather than one
layer times 24, its pass level has a third unit for the optimizer step, and it searches with Bayesian
optimization (about 30 trials per unit) instead of sweeping every clock pair. Every freqopt figure is validated:
the whole iteration measured with the chosen clocks. Local allocation: each unit keeps its own time (no
slowdown) or minimizes its own energy-delay product; global: the MILP over all units for the whole iteration.
The constants were fitted to the Zeus V100 sweep only; nothing here is tuned to these figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import optuna

from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import get_workload
from freqopt.search.runner import SearchConfig, Validator, allocate_validated, open_storage, run_unit_studies
from freqopt.files import atomic_write_text
from freqopt.workload.trace import trace_training_iteration

OUT = Path(__file__).resolve().parent / "spaan"
GPU = "rtx3080ti"
SLOWDOWNS = [0.0, 0.01, 0.02, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 0.75, 1.00]
# Their Table 2 (published.md): (energy change %, time change %).
PAPER = {
    ("pass", "local", "no slowdown"): (-1.98, -0.2),
    ("pass", "global", "no slowdown"): (-2.07, -0.10),
    ("kernel", "local", "no slowdown"): (-11.54, -1.78),
    ("kernel", "global", "no slowdown"): (-14.6, 0.6),  # re-measured; the search had promised -15.64 % at +0.00 %
    ("pass", "global", "min EDP"): (-25.42, 10.21),
    ("kernel", "global", "min EDP"): (-27.52, 10.28),
}


def local_choice(searches, score) -> tuple:
    """Per unit, the option minimizing ``score(option, default)`` among those not slower than its default."""
    return tuple(min((o for o in s.options), key=lambda o: score(o, s.default)) for s in searches)


def run() -> dict:
    spec = get_gpu(GPU)
    workload = get_workload("gpt3-xl", micro_batch_size=40, seq_len=1024, n_heads=16)
    trace = trace_training_iteration(workload)
    backend = SimulatedGPU(spec, seed=0)
    OUT.mkdir(exist_ok=True)
    storage = open_storage(f"sqlite:///{OUT / 'studies.db'}")
    # Finalists are re-measured up to 30 % slowdown, where the energy-delay optimum lies.
    config = SearchConfig(max_slowdown=0.10, n_trials_2d=30, seed=0)
    validator = Validator(trace, backend, repeats=3)
    base = validator.baseline()
    # The paper ignored the cost of switching clocks; a phase-switching runtime on this GPU pays about 100 ms.
    switching = Validator(trace, backend, repeats=3, switching=True)

    def change(m) -> dict:
        return {"energy_pct": 100 * (m.energy_j / base.energy_j - 1), "time_pct": 100 * (m.time_s / base.time_s - 1)}

    results: dict = {"baseline": {"time_s": base.time_s, "energy_j": base.energy_j}, "rows": {}, "curve": {}}
    for granularity in ("pass", "kernel"):
        units, searches = run_unit_studies(trace, backend, config, granularity, storage=storage,
                                           on_unit=lambda g, i, n: print(f"\r{g}: unit {i}/{n}", end="", flush=True))
        print()
        predicted_base = sum(s.default.energy_j for s in searches)

        def record(goal, scope, chosen, validated):
            predicted = 100 * (sum(o.energy_j for o in chosen) / predicted_base - 1)
            results["rows"][f"{granularity}|{scope}|{goal}"] = {**change(validated), "predicted_energy_pct": predicted}

        # No slowdown.
        local = local_choice(searches, lambda o, d: o.energy_j if o.time_s <= d.time_s else float("inf"))
        record("no slowdown", "local", local, validator.units(units, [o.setting for o in local], granularity))
        best = allocate_validated(units, searches, validator, base, 0.0, key=granularity)
        record("no slowdown", "global", best.chosen, best.validated)
        real = allocate_validated(units, searches, switching, base, 0.0, key=f"{granularity}-switching")
        record(f"no slowdown, {1e3 * spec.clock_switch_s:.0f} ms switches", "global", real.chosen, real.validated)
        # Minimal energy-delay product: local per unit; global over validated schedules at every budget.
        local = local_choice(searches, lambda o, d: o.energy_j * o.time_s)
        record("min EDP", "local", local, validator.units(units, [o.setting for o in local], granularity))
        curve = [allocate_validated(units, searches, validator, base, s, key=granularity) for s in SLOWDOWNS]
        edp = min(curve, key=lambda a: a.validated.energy_j * a.validated.time_s)
        record("min EDP", "global", edp.chosen, edp.validated)
        results["curve"][granularity] = [{"max_slowdown_pct": 100 * s, **change(a.validated)}
                                         for s, a in zip(SLOWDOWNS, curve)]  # fmt: skip
        results[f"{granularity}_measurements"] = sum(s.n_measurements for s in searches)
        results[f"{granularity}_search_cost_gpu_h"] = sum(s.cost_gpu_s for s in searches) / 3600
    return results


def report(results: dict) -> str:
    lines = ["# Spaan et al. 2026 reproduced with freqopt (GPT-3 XL, simulated RTX 3080 Ti)", "",
             "Produced by `python experiments/repro_spaan.py`. Changes relative to default clocks; freqopt's are "
             "validated on the whole iteration, with the allocator's prediction beside them. Paper figures: their "
             "Table 2 as quoted in shared/calibration/published.md (kernel-level global no-slowdown: the re-measured "
             "figure). Like the paper, every row but the \"switches\" rows treats switching clocks as free; those "
             "rows validate schedules as a phase-switching runtime realizes them, each switch landing 100 ms late "
             "(the paper's nvidia-smi figure for this card).", "",
             "| granularity | allocation | goal | paper E (%) | paper t (%) | freqopt E (%) | freqopt t (%) | "
             "freqopt predicted E (%) | E difference (pp) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key, row in results["rows"].items():
        granularity, scope, goal = key.split("|")
        paper = PAPER.get((granularity, scope, goal))
        p_e, p_t = (f"{paper[0]:+.2f}", f"{paper[1]:+.2f}") if paper else ("-", "-")
        diff = f"{row['energy_pct'] - paper[0]:+.1f}" if paper else "-"
        lines.append(f"| {granularity} | {scope} | {goal} | {p_e} | {p_t} | {row['energy_pct']:+.2f} | "
                     f"{row['time_pct']:+.2f} | {row['predicted_energy_pct']:+.2f} | {diff} |")
    lines += ["", "Search cost: pass level {:,} measurements ({:.2f} GPU-h), kernel level {:,} measurements "
              "({:.2f} GPU-h); the paper's exhaustive sweep took about 3 GPU-days.".format(
                  results["pass_measurements"], results["pass_search_cost_gpu_h"],
                  results["kernel_measurements"], results["kernel_search_cost_gpu_h"]), "",
              "## Why we differ", "",
              _comparison(results) + " Two parts of the model set how much power a lower clock saves without costing "
              "time, and neither is measured for this GPU. First, memory power: the RTX 3080 Ti's constants are "
              "derived from the fitted HBM2 V100 by bandwidth, so its GDDR6X draws {:.0f} W at the highest memory "
              "clock when idle and {:.0f} W more at full bandwidth; GDDR6X spends more energy per bit than HBM2, so "
              "a lower memory clock under compute-bound kernels (the paper's main source of waste) saves less here "
              "than on the card. Second, the SM's clock-tree power ({:.0f} W at the highest clock, scaled from the "
              "V100 fit by power headroom) and voltage curve set how steeply power falls with the SM clock, and so "
              "where the energy-delay optimum lies. Measurements of this GPU would settle both; nothing here was "
              "tuned to the paper.".format(*_constants()), "",
              "## Energy saved against allowed slowdown (global allocation, validated)", "",
              "| allowed slowdown (%) | pass: E (%) | pass: t (%) | kernel: E (%) | kernel: t (%) |",
              "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p, k in zip(results["curve"]["pass"], results["curve"]["kernel"]):
        lines.append(f"| {p['max_slowdown_pct']:.0f} | {p['energy_pct']:+.2f} | {p['time_pct']:+.2f} | "
                     f"{k['energy_pct']:+.2f} | {k['time_pct']:+.2f} |")
    return "\n".join(lines) + "\n"


def _comparison(results: dict) -> str:
    """Where freqopt and the paper differ, in numbers taken from the results."""
    rows = results["rows"]
    k0, edp = rows["kernel|global|no slowdown"], rows["kernel|global|min EDP"]
    p_e0, _ = PAPER[("kernel", "global", "no slowdown")]
    p_edp_e, p_edp_t = PAPER[("kernel", "global", "min EDP")]
    return (f"At no slowdown freqopt saves {0.0 - k0['energy_pct']:.1f} % at kernel level where the paper re-measured "
            f"{-p_e0:.1f} %: the simulated GPU has less waste. freqopt's kernel-level energy-delay optimum saves "
            f"{-edp['energy_pct']:.1f} % at {edp['time_pct']:+.1f} % time; the paper's saves {-p_edp_e:.1f} % at "
            f"{p_edp_t:+.1f} %: the simulated GPU's energy falls "
            f"{'further' if -edp['energy_pct'] > -p_edp_e else 'less'} with lower clocks than the card's.")


def _constants() -> tuple[float, float, float]:
    pm = get_gpu(GPU).power_model
    return pm.p_mem_clock_w, pm.p_mem_active_w, pm.p_sm_clock_w


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    for granularity, style in (("pass", "o-"), ("kernel", "s-")):
        curve = results["curve"][granularity]
        ax.plot([c["time_pct"] for c in curve], [-c["energy_pct"] for c in curve], style, label=f"freqopt, {granularity}")
    for (granularity, scope, goal), (e, t) in PAPER.items():
        if scope == "global":
            ax.plot([t], [-e], "k*" if granularity == "kernel" else "kx", ms=11)
    ax.plot([], [], "k*", label="paper, kernel level")
    ax.plot([], [], "kx", label="paper, pass level")
    ax.set_xlabel("validated slowdown (%)")
    ax.set_ylabel("energy saved (%)")
    ax.set_title("GPT-3 XL on a simulated RTX 3080 Ti (Spaan et al. 2026 setting)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = run()
    atomic_write_text(OUT / "results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(OUT / "report.md", report(results))
    plot(results, OUT / "energy_vs_slowdown.png")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
