"""freqopt's pipeline planner beside Perseus's (Chung et al., SOSP'24) on Perseus's own stage profiles (issue 24).

For BLOOM on the A100 SXM and the A40 and GPT-3 175B on the A40, 8 stages, 1F1B, M = 12, 24, 48, 96 micro-batches:
plans freqopt's frontier (freqopt.search.pipeline_plan, method "hull") on the shared stage profile and compares it
with Perseus's frontier (experiments/data/perseus/frontiers/, copied from ../shared) at every one of Perseus's iteration times.

Perseus's accounting, reproduced: every GPU draws the P2P-blocking power while it waits (83.64 W A100, 70.38 W A40;
lowtime/scripts/perseus.py), and every instruction's time is floored to Perseus's time unit before planning
(ExecutionOption.quant_time, lowtime/lowtime/operation.py): 1 ms for the A100 files and 0.1 ms for the A40 files, the
step between consecutive points of Perseus's frontier files. The energies are the measured ones at the chosen clock.

freqopt's energy at a Perseus time T is that of the best plan freqopt solved whose time is at most T (a staircase
through the solved deadlines: every value is a real plan). Deadlines: 12 from Perseus's fastest to its slowest time,
denser at the fast end, then up to ``--refine`` more, each at the earliest Perseus time where freqopt is not yet
0.05 % below Perseus. Each solve starts also from the best plan already solved within its deadline (warm_start).
Planner: method "hull" (the hull LP's bound, its roundings and the reclaim pass; freqopt/search/pipeline_plan.py),
with the MILP step only where the proven gap is still above ``--mip-rel-gap``, for ``--time-limit-s``.

Run: ``nice -n 10 python experiments/perseus_frontiers.py`` (writes experiments/perseus/report.md, results.json,
frontiers.png). HELD OUT and never read: the GPT-3 175B A100 files.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from freqopt.files import atomic_write_text
from freqopt.search.pipeline_plan import PipelinePlanner, load_stage_profile

# Perseus's stage profiles and frontiers, copied from shared/calibration/perseus with a source line each.
DATA = ROOT / "experiments" / "data" / "perseus"
OUT = ROOT / "experiments" / "perseus"
SETTINGS = [  # (gpu, model, profile file, blocking power W, Perseus's time unit s)
    ("a100_sxm", "bloom", "bloom+a100_sxm_bf16.csv", 83.64, 1e-3),
    ("a40", "bloom", "bloom+a40_bf16.csv", 70.38, 1e-4),
    ("a40", "gpt3-175b", "gpt3-175b+a40_bf16.csv", 70.38, 1e-4),
]
MICRO_BATCHES = (12, 24, 48, 96)
TOLERANCE = 0.002  # the issue's: freqopt's energy at most Perseus's + 0.2 %
REFINE_MARGIN = 0.0005  # refine until freqopt's staircase is at least 0.05 % below Perseus's (or out of solves)


def read_frontier(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, newline="") as f:
        rows = [(float(r["time"]), float(r["energy"])) for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    rows.sort()
    return np.array([t for t, _ in rows]), np.array([e for _, e in rows])


def staircase(plans: list[tuple[float, float]], times: np.ndarray) -> np.ndarray:
    """The least energy among plans (time_s, energy_j) with time at most each of ``times`` (inf where none)."""
    out = np.full(len(times), np.inf)
    for t, e in plans:
        hit = times >= t - 1e-9
        out[hit] = np.minimum(out[hit], e)
    return out


def run_setting(gpu, model, profile_file, power_w, unit_s, m, refine, mip_rel_gap, time_limit_s, data_dir):
    profile = load_stage_profile(data_dir / profile_file)
    p_times, p_energies = read_frontier(data_dir / "frontiers" / f"{gpu}_{model}_mb{m}.csv")
    planner = PipelinePlanner(profile, m, blocking_power_w=power_w, time_quantum_s=unit_s, method="hull",
                              mip_rel_gap=mip_rel_gap, time_limit_s=time_limit_s)  # fmt: skip
    start = time.perf_counter()
    fastest = planner.fastest()
    plans = [fastest]
    solved = []

    def solve(deadline: float) -> None:
        # The best plan already solved within this deadline is a starting point (the frontier's reuse of work).
        within = [p for p in plans if p.time_s <= max(deadline, fastest.time_s)]
        plan = planner.plan(deadline, warm_start=min(within, key=lambda p: p.energy_j))
        plans.append(plan)
        solved.append({"deadline_s": deadline, "time_s": plan.time_s, "energy_j": plan.energy_j,
                       "lower_bound_j": plan.lower_bound_j, "gap": plan.gap, "solve_s": plan.solve_s})

    lo, hi = p_times[0], p_times[-1]
    for u in np.linspace(0, 1, 12):
        if lo + (hi - lo) * u * u >= fastest.time_s * (1 - 1e-12):  # plan()'s own tolerance
            solve(float(lo + (hi - lo) * u * u))
    for _ in range(refine):
        # Solve again at the earliest Perseus time where freqopt's staircase is not yet below Perseus's energy by
        # REFINE_MARGIN: one solve there covers the Perseus points after it until the next drop.
        ours = staircase([(p.time_s, p.energy_j) for p in plans], p_times)
        failing = np.flatnonzero(ours / p_energies - 1 > -REFINE_MARGIN)
        failing = [i for i in failing if p_times[i] >= fastest.time_s * (1 - 1e-12)
                   and not any(abs(s["deadline_s"] - p_times[i]) < 1e-12 for s in solved)]
        if not failing:
            break
        solve(float(p_times[failing[0]]))
    plans = [(p.time_s, p.energy_j) for p in plans]
    elapsed = time.perf_counter() - start
    ours = staircase(plans, p_times)
    diff = ours / p_energies - 1
    worst = int(np.argmax(diff))
    # The fastest plan on measured (unfloored) times, for context: Perseus's floored times understate it.
    real = PipelinePlanner(profile, m, blocking_power_w=power_w).fastest()
    return {
        "gpu": gpu, "model": model, "micro_batches": m, "blocking_power_w": power_w, "time_unit_s": unit_s,
        "perseus_points": len(p_times),
        "perseus_fastest": {"time_s": float(p_times[0]), "energy_j": float(p_energies[0])},
        "freqopt_fastest_plan": {"time_s": fastest.time_s, "energy_j": fastest.energy_j,
                                 "energy_at_perseus_fastest_time_j": float(ours[0]),
                                 "unfloored_time_s": real.time_s, "unfloored_energy_j": real.energy_j},
        "worst": {"time_s": float(p_times[worst]), "perseus_energy_j": float(p_energies[worst]),
                  "freqopt_energy_j": float(ours[worst]), "difference": float(diff[worst])},
        "mean_difference": float(np.mean(diff)), "best_difference": float(np.min(diff)),
        "points_within_tolerance": int(np.sum(diff <= TOLERANCE)),
        "max_proven_gap": max(s["gap"] for s in solved), "solves": solved, "planner_s": elapsed,
        "mip_rel_gap": mip_rel_gap, "time_limit_s": time_limit_s,
        "curve": {"perseus_time_s": p_times[:: max(1, len(p_times) // 400)].tolist(),
                  "perseus_energy_j": p_energies[:: max(1, len(p_times) // 400)].tolist(),
                  "freqopt_energy_j": ours[:: max(1, len(p_times) // 400)].tolist()},
    }


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 4, figsize=(16, 10), tight_layout=True)
    for ax, r in zip(axes.flat, results):
        c = r["curve"]
        ax.plot(c["perseus_time_s"], c["perseus_energy_j"], label="Perseus", color="tab:orange")
        ax.step(c["perseus_time_s"], c["freqopt_energy_j"], where="post", label="freqopt", color="tab:blue")
        ax.plot([s["time_s"] for s in r["solves"]], [s["energy_j"] for s in r["solves"]], ".", color="tab:blue")
        ax.set_title(f"{r['model']} on {r['gpu']}, M={r['micro_batches']}", fontsize=10)
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy (J)")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=90)


def report(results, command: str, total_s: float) -> str:
    lines = [
        "# freqopt's pipeline planner beside Perseus's, on Perseus's stage profiles (issue 24, item 6)",
        "",
        f"Command: `{command}` ({total_s:.0f} s wall on the 2-core shared machine, niced). Source: "
        "experiments/perseus_frontiers.py (its docstring gives the accounting). Data: experiments/data/perseus/ (copies of ../shared/calibration/perseus/).",
        "",
        "8 stages, 1F1B (DeepSpeed's TrainSchedule order), one SM clock per instruction. Perseus's accounting: "
        "blocking power while a GPU waits (83.64 W A100, 70.38 W A40), instruction times floored to Perseus's unit "
        "(1 ms A100, 0.1 ms A40). freqopt's energy at each of Perseus's frontier times is the best plan it solved "
        "within that time (a staircase of real plans, each with measured energies). Difference = freqopt / Perseus - 1 "
        "(negative: freqopt uses less). Target: at most +0.2 % at every point.",
        "",
        "Planner: PipelinePlanner, method \"hull\" (freqopt/search/pipeline_plan.py's docstring): the hull LP (a proven "
        "lower bound), its roundings (down, and by error diffusion with a repair pass) and the warm start (the best "
        "plan already solved within the deadline), each improved by the reclaim pass; the MILP over the LP's "
        "fractional instructions only where the proven gap is still above "
        + " or ".join(sorted({f"{100 * r['mip_rel_gap']:g} % ({r['time_limit_s']:g} s limit)"
                              for r in results})) + ".",
        "",
    ]
    within = [r for r in results if r["worst"]["difference"] <= TOLERANCE]
    as_fast = [r for r in results if r["freqopt_fastest_plan"]["time_s"] <= r["perseus_fastest"]["time_s"] + 1e-9]
    lines += [
        f"**{len(within)} of {len(results)} settings within Perseus + 0.2 % at every point; freqopt's fastest plan as "
        f"fast as Perseus's on {len(as_fast)} of {len(results)}.** Before this planner (the report at commit 9e7717f: "
        "the MILP over the LP's fractional instructions, 10 s, returning the fastest plan when it found nothing): 8 of "
        "12, worst +9.79 % (GPT-3 175B/A40 M=96), max proven gap 13.3 %, 4859 s in all.",
        "",
        "| setting | Perseus points | worst diff (at s) | mean diff | best diff | within +0.2 % | fastest: Perseus "
        "s / J | fastest: freqopt s / J | solves | max proven gap | solve s mean / max | planner s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        f, pf = r["freqopt_fastest_plan"], r["perseus_fastest"]
        lines.append(
            f"| {r['model']} {r['gpu']} M={r['micro_batches']} | {r['perseus_points']} | "
            f"{100 * r['worst']['difference']:+.2f} % ({r['worst']['time_s']:.4f}) | {100 * r['mean_difference']:+.2f} % | "
            f"{100 * r['best_difference']:+.2f} % | {r['points_within_tolerance']}/{r['perseus_points']} | "
            f"{pf['time_s']:.4f} / {pf['energy_j']:.0f} | {f['time_s']:.4f} / {f['energy_at_perseus_fastest_time_j']:.0f} | "
            f"{len(r['solves'])} | {100 * r['max_proven_gap']:.3f} % | "
            f"{np.mean([x['solve_s'] for x in r['solves']]):.1f} / {max(x['solve_s'] for x in r['solves']):.1f} | "
            f"{r['planner_s']:.0f} |")  # fmt: skip
    lines += [
        "",
        "- *fastest: freqopt s / J*: the time of freqopt's fastest plan (every instruction at its fastest "
        "non-dominated clock) and freqopt's least energy within Perseus's fastest time.",
        "- *max proven gap*: (plan energy - hull LP bound) / plan energy, the largest over the solved deadlines: how "
        "far each solved plan can be from the optimum at its deadline (method \"hull\", "
        "freqopt/search/pipeline_plan.py).",
        f"- *worst diff*: at {-100 * REFINE_MARGIN:+.2f} % where the refinement stopped as designed (a solve at the "
        f"earliest Perseus time where freqopt is not yet {100 * REFINE_MARGIN:.2f} % below, until none is left): "
        "between two solved deadlines the staircase stays flat while Perseus's frontier falls, so its worst point "
        "is just before a solve; the solved plans themselves lie further below (the last line).",
        "- *solve s*: PipelinePlan.solve_s, one deadline's LP, heuristics and MILP step; *planner s*: the setting's "
        "wall time, solves and bookkeeping.",
        "- Perseus's energies are its planner's: an exponential fit of each instruction's effective energy, evaluated "
        "at integer durations (lowtime/lowtime/cost_model.py); freqopt's are the measured energies of the clocks it "
        "chose.",
        "- On measured (unfloored) times the fastest plans are slower than Perseus's floored times say: "
        + "; ".join(f"{r['model']} {r['gpu']} M={r['micro_batches']}: {r['freqopt_fastest_plan']['unfloored_time_s']:.4f} s"
                    for r in results) + ".",
        "",
        "![frontiers](frontiers.png)",
        "",
    ]
    missing = [f"{model} {gpu} M={m}" for m in MICRO_BATCHES for gpu, model, *_ in SETTINGS
               if not any((r["gpu"], r["model"], r["micro_batches"]) == (gpu, model, m) for r in results)]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)} (`--resume` runs them and keeps the rows above).", ""]
    # Each solved plan against Perseus's frontier at the plan's own time (no staircase): the solver's own margin.
    margins = []
    for r in results:
        times, energies = read_frontier(DATA / "frontiers" / f"{r['gpu']}_{r['model']}_mb{r['micro_batches']}.csv")
        margins.append(max((s["energy_j"] / energies[times <= s["time_s"] + 1e-9].min() - 1
                            for s in r["solves"] if (times <= s["time_s"] + 1e-9).any()), default=-1.0))  # fmt: skip
    worst_solved = int(np.argmax(margins))
    r = results[worst_solved]
    lines += [f"Every solved plan against Perseus's frontier at its own time: at most {100 * margins[worst_solved]:+.2f} "
              f"% ({r['model']} {r['gpu']} M={r['micro_batches']}). Every solved plan is in results.json, `solves`.",
              ""]  # fmt: skip
    failing = [f"{r['model']} {r['gpu']} M={r['micro_batches']}" for r in results
               if r["worst"]["difference"] > TOLERANCE]
    if failing:
        lines += [f"Above +0.2 % somewhere: {', '.join(failing)}: where a solved plan is within Perseus + 0.2 %, "
                  "between two solved deadlines the staircase is coarser than the frontier's drop (more solves, "
                  "`--refine`, close that); otherwise the plan's proven gap says how far it may be from the optimum.",
                  ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refine", type=int, default=60, help="extra solves per setting at the worst point")
    parser.add_argument("--mip-rel-gap", type=float, default=5e-3,
                        help="proven gap above which a solve runs the MILP step (PipelinePlanner's mip_rel_gap)")
    parser.add_argument("--time-limit-s", type=float, default=5.0, help="HiGHS limit per MILP step")
    parser.add_argument("--micro-batches", type=int, nargs="*", default=list(MICRO_BATCHES))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--resume", action="store_true", help="keep the settings experiments/perseus/results.json has")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for report.md, results.json, frontiers.png")
    args = parser.parse_args()
    out = args.out
    start = time.perf_counter()
    results = []
    if args.resume and (out / "results.json").is_file():  # keep the settings a previous run finished
        previous = json.loads((out / "results.json").read_text())
        results, start = previous["settings"], start - previous["wall_s"]
    done = {(r["gpu"], r["model"], r["micro_batches"]) for r in results}
    out.mkdir(parents=True, exist_ok=True)
    command = ("nice -n 10 python experiments/perseus_frontiers.py " + " ".join(sys.argv[1:])).strip()
    total = time.perf_counter() - start
    if done:  # the command and time as recorded, until this run adds a setting
        command, total = previous["command"], previous["wall_s"]
    for m in args.micro_batches:  # every GPU at M = 12 first, then 24, ...: the report is rewritten after each
        for gpu, model, profile_file, power_w, unit_s in SETTINGS:
            if (gpu, model, m) in done:
                continue
            r = run_setting(gpu, model, profile_file, power_w, unit_s, m, args.refine, args.mip_rel_gap,
                            args.time_limit_s, args.data)  # fmt: skip
            print(f"{model} {gpu} M={m}: worst {100 * r['worst']['difference']:+.3f} % at {r['worst']['time_s']:.4f} s, "
                  f"max gap {100 * r['max_proven_gap']:.3f} %, {r['planner_s']:.0f} s", flush=True)  # fmt: skip
            results.append(r)
            command = ("nice -n 10 python experiments/perseus_frontiers.py " + " ".join(sys.argv[1:])).strip()
            total = time.perf_counter() - start
            atomic_write_text(out / "results.json", json.dumps({"command": command, "wall_s": total,
                                                                 "settings": results}, indent=1) + "\n")  # fmt: skip
            plot(results, out / "frontiers.png")
            atomic_write_text(out / "report.md", report(results, command, total))
    if results and done >= {(gpu, model, m) for m in args.micro_batches for gpu, model, *_ in SETTINGS}:
        plot(results, out / "frontiers.png")  # nothing new to run: the report again from the recorded results
        atomic_write_text(out / "report.md", report(results, command, total))


if __name__ == "__main__":
    main()
