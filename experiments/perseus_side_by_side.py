"""Perseus itself beside ``freqopt plan`` on Perseus's own stage profiles, both scored on the measured data (issue 34).

For each shared profile (BLOOM on the A100 SXM and the A40, GPT-3 175B on the A40; 8 stages, 1F1B) and micro-batch
count M, back to back and ``--repeats`` times in alternation:

- Perseus: its planner script as published (../shared/peers/perseus/perseus.py, run with the `lowtime` package
  from a separate environment, ``--perseus-python``), with its defaults (1 ms time unit) and ``--plot-interval``
  above its iteration count, so that it draws only its 16 cost-model figures and two pipeline figures. The two
  adaptations its README names for lowtime 0.3.0 are made in a temporary copy; nothing of it is kept here.
- freqopt: ``python -m freqopt.cli plan --stage-profile P --micro-batches M --blocking-power-w W --json F`` as a
  user runs it (the plan at its default 1 % and the whole time-energy frontier), W the GPU's measured blocking power
  that ``--gpu G`` would give; not ``--gpu`` itself, which also prices the plan with G's switch latency and plans one
  clock per GPU beside it (since issue 50, item 5), work Perseus does not do.

Both planners' plans are then scored by one evaluator, freqopt's ``PipelinePlanner.evaluate`` on the measured profile,
unfloored (each instruction's measured time and energy at its clock, the 1F1B critical path, and Perseus's blocking
power for every GPU-second outside an instruction: 83.64 W A100, 70.38 W A40): Perseus's from the clock files it
writes (``freqs_pipeline_NNNNN.py``, each stage's clocks in its Synchronous1F1B order, which is freqopt's stage
order), freqopt's from the clocks in its JSON. Compared at every Perseus plan's measured time t: freqopt's
staircase (the least energy among its plans no slower than t) against that plan's energy. No deadline is chosen by
reading Perseus's results: freqopt plans as a user's command does.

Also: the small made-up case of issue 34 (4 stages, 22 smooth clocks, 6 and 8 micro-batches, 2 %), timed, and how
long a Ctrl-C takes to end ``freqopt plan`` in the middle of its MILP.

Run (Perseus's environment as ../shared/peers/perseus/README.md says):

    python3 -m venv /tmp/perseus-venv && /tmp/perseus-venv/bin/pip install lowtime==0.3.0 pandas tyro 'matplotlib<3.9'
    python experiments/perseus_side_by_side.py --perseus-python /tmp/perseus-venv/bin/python

It writes experiments/perseus/results.json, report.md and frontiers.png; ``--settings a100_sxm:bloom:12 ...`` runs
some settings and keeps the others recorded. ``--perseus-limit-s S`` stops Perseus after S seconds and scores the
plans it wrote by then, marked as stopped in the report. The published A40 frontiers step by 0.1 ms (57,641 and
65,844 points at M = 96), the A100's by 1 ms; Perseus runs here at its default 1 ms unit, so a whole A40 run at
M = 96 writes about a tenth of the published points (about 5,800 and 6,600 plans). HELD OUT and never read: the GPT-3 175B A100 files.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from freqopt.files import atomic_write_text  # noqa: E402
from freqopt.pipeline.planner import PipelinePlanner  # noqa: E402
from freqopt.pipeline.profile import MEASURED_BLOCKING_POWER_W, load_stage_profile  # noqa: E402

DATA = ROOT / "experiments" / "data" / "perseus"
OUT = ROOT / "experiments" / "perseus"
PEER = ROOT.parent / "shared" / "peers" / "perseus" / "perseus.py"
# freqopt's commands run from this checkout (not whichever freqopt is installed).
FREQOPT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
SETTINGS = [  # (gpu tag of Perseus's files, model, profile, freqopt GPU, Perseus's --gpu-type)
    ("a100_sxm", "bloom", "bloom+a100_sxm_bf16.csv", "a100-sxm4-80gb", "A100"),
    ("a40", "bloom", "bloom+a40_bf16.csv", "a40", "A40"),
    ("a40", "gpt3-175b", "gpt3-175b+a40_bf16.csv", "a40", "A40"),
]
MICRO_BATCHES = (12, 24, 48, 96)
TOLERANCE = 0.002  # the issue's: freqopt's staircase at most Perseus's energy + 0.2 %


def perseus_copy(directory: Path) -> Path:
    """Perseus's script with the two adaptations its README names for lowtime 0.3.0 (DependencyResolver's new module;
    matplotlib < 3.9 is the environment's), in a temporary folder."""
    text = PEER.read_text()
    text = text.replace("    DependencyResolver,\n", "", 1)
    text = text.replace("from lowtime.graph_utils import add_source_node, add_sink_node",
                        "from lowtime.graph_utils import add_source_node, add_sink_node, DependencyResolver", 1)
    path = directory / "perseus_run.py"
    path.write_text(text)
    return path


def run_perseus(python: str, script: Path, profile: Path, gpu_type: str, m: int, out: Path,
                limit_s: float | None = None) -> tuple[float, bool]:
    """Perseus's script on one setting: (wall s, whether it was stopped at ``limit_s`` before it finished; its plans
    written by then are kept)."""
    cmd = [python, str(script), "--inst-profile", str(profile), "--gpu-type", gpu_type, "--output-dir", str(out),
           "--num-mbs", str(m), "--num-stages", "8", "--plot-interval", "1000000"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "MPLBACKEND": "Agg"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate()
        return time.perf_counter() - start, True
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"Perseus failed ({proc.returncode}): {stderr[-2000:]}")
    return wall, False


def run_freqopt(profile: Path, gpu: str, m: int, out: Path, extra: list[str] = ()) -> float:
    cmd = [sys.executable, "-m", "freqopt.cli", "plan", "--stage-profile", str(profile), "--micro-batches", str(m),
           "--blocking-power-w", str(MEASURED_BLOCKING_POWER_W[gpu]), "--json", str(out), *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=FREQOPT_ENV)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"freqopt plan failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall


def in_dag_order(planner: PipelinePlanner, by_stage: list[list[int]]) -> list[int]:
    """Clocks given per stage in the stage's own order -> one per instruction in the DAG's order."""
    position = [0] * planner.stages
    clocks = []
    for inst in planner.dag.instructions:
        clocks.append(int(by_stage[inst.stage][position[inst.stage]]))
        position[inst.stage] += 1
    if any(len(by_stage[s]) != position[s] for s in range(planner.stages)):
        raise SystemExit("a plan does not have one clock per instruction of every stage")
    return clocks


def perseus_plans(planner: PipelinePlanner, out: Path, stopped: bool = False) -> list[tuple[float, float]]:
    """Every plan Perseus wrote, scored: (measured time s, measured energy J). A run stopped at its limit may have
    left its last file half-written: that one is skipped."""
    scored = []
    for path in sorted(out.glob("freqs_pipeline_*.py")):
        text = path.read_text()
        try:
            by_stage = ast.literal_eval(text[:text.index("#")] if "#" in text else text)
            clocks = in_dag_order(planner, by_stage)
        except (SyntaxError, ValueError, IndexError, SystemExit):
            if stopped:
                continue
            raise
        scored.append(planner.evaluate(clocks))
    return scored


def staircase(plans: list[tuple[float, float]], times: np.ndarray) -> np.ndarray:
    """The least energy among plans (time_s, energy_j) no slower than each of ``times`` (inf where none)."""
    order = sorted(plans)
    plan_times = np.array([t for t, _ in order])
    running = np.minimum.accumulate(np.array([e for _, e in order]))
    index = np.searchsorted(plan_times, times * (1 + 1e-12), side="right") - 1
    return np.where(index >= 0, running[np.maximum(index, 0)], np.inf)


def published(gpu: str, model: str, m: int) -> dict:
    """Perseus's published frontier (floored times, energies from its fitted curves): shown beside, as such."""
    with open(DATA / "frontiers" / f"{gpu}_{model}_mb{m}.csv", newline="") as f:
        rows = [(float(r["time"]), float(r["energy"])) for r in csv.DictReader(x for x in f if not x.startswith("#"))]
    rows.sort()
    # The time unit the published run planned at: the most common step between consecutive floored times (the A100
    # files step by 1 ms, the A40 files by 0.1 ms, so they hold ten times the points a 1 ms run writes).
    steps = [round(b[0] - a[0], 6) for a, b in zip(rows, rows[1:]) if b[0] > a[0]]
    unit_s = max(set(steps), key=steps.count) if steps else None
    return {"points": len(rows), "unit_s": unit_s, "fastest_time_s": rows[0][0], "fastest_energy_j": rows[0][1],
            "least_energy_j": min(e for _, e in rows), "time_s": [t for t, _ in rows][:: max(1, len(rows) // 300)],
            "energy_j": [e for _, e in rows][:: max(1, len(rows) // 300)]}


def run_setting(args, setting, m: int, script: Path, scratch: Path) -> dict:
    tag, model, profile_file, gpu, gpu_type = setting
    profile = args.data / profile_file
    # Perseus reads the CSV with pandas, which takes the copies' '# Source' line for the header: it gets the rows
    # alone (the file as ../shared/calibration/perseus has it).
    bare = scratch / profile_file
    bare.write_text("".join(x for x in profile.read_text().splitlines(keepends=True) if not x.startswith("#")))
    planner = PipelinePlanner(load_stage_profile(profile), m, gpu=gpu)  # the evaluator: measured, unfloored
    perseus_s, freqopt_s, stopped = [], [], False
    load = {"perseus": [], "freqopt": []}  # per run: the 1-min load average (os.getloadavg) before and after it
    repeats = args.repeats if m <= args.repeat_up_to else 1
    for r in range(repeats):
        p_out, f_out = scratch / f"perseus-{tag}-{model}-{m}-{r}", scratch / f"freqopt-{tag}-{model}-{m}-{r}.json"
        first, second = (("perseus", "freqopt") if r % 2 == 0 else ("freqopt", "perseus"))
        for who in (first, second):
            before = os.getloadavg()[0]
            if who == "perseus":
                wall, stopped = run_perseus(args.perseus_python, script, bare, gpu_type, m, p_out, args.perseus_limit_s)
                perseus_s.append(wall)
            else:
                freqopt_s.append(run_freqopt(profile, gpu, m, f_out))
            load[who].append([before, os.getloadavg()[0]])
        print(f"  {model} {tag} M={m} round {r + 1}/{repeats}: Perseus {perseus_s[-1]:.1f} s, freqopt "
              f"{freqopt_s[-1]:.1f} s", flush=True)  # fmt: skip
    theirs = perseus_plans(planner, p_out, stopped)
    if not theirs:
        raise SystemExit(f"Perseus wrote no plan for {model} {tag} M={m} within --perseus-limit-s")
    doc = json.loads(f_out.read_text())
    ours = [planner.evaluate(in_dag_order(planner, p["sm_clock_mhz"])) for p in doc["frontier"]]
    for (t, e), p in zip(ours, doc["frontier"]):  # freqopt's JSON says what the evaluator finds
        if abs(t - p["time_s"]) > 1e-9 * t or abs(e - p["energy_j"]) > 1e-9 * e:
            raise SystemExit(f"freqopt's JSON point ({p['time_s']}, {p['energy_j']}) scores as ({t}, {e})")
    p_times = np.array([t for t, _ in theirs])
    p_energy = np.array([e for _, e in theirs])
    ours_at = staircase(ours, p_times)
    diff = ours_at / p_energy - 1
    worst = int(np.argmax(diff))
    o_times = np.array([t for t, _ in ours])
    theirs_at = staircase(theirs, o_times)  # the other way round: Perseus's staircase at freqopt's plans' times
    back = (np.array([e for _, e in ours]) / theirs_at - 1)[np.isfinite(theirs_at)]  # where Perseus has a plan
    distinct_p = len({(round(t, 12), round(e, 9)) for t, e in theirs})
    return {
        "gpu": tag, "model": model, "micro_batches": m, "freqopt_gpu": gpu, "blocking_power_w": planner.blocking_power_w,
        "repeats": repeats, "perseus_wall_s": perseus_s, "freqopt_wall_s": freqopt_s, "load_1min": load,
        "wall_ratio": statistics.median(freqopt_s) / statistics.median(perseus_s),
        "perseus": {"plans": len(theirs), "distinct_plans": distinct_p, "fastest_time_s": float(p_times.min()),
                    "least_energy_j": float(p_energy.min()), "stopped_at_limit_s": args.perseus_limit_s if stopped
                    else None, "slowest_time_s": float(p_times.max())},  # fmt: skip
        "freqopt": {"plans": len(ours), "fastest_time_s": float(o_times.min()),
                    "least_energy_j": float(min(e for _, e in ours)), "proven_gap": doc["frontier_proven_gap"],
                    "solves": doc["frontier_solves"], "frontier_solve_s": doc["frontier_solve_s"]},
        "at_perseus_times": {"worst": float(diff[worst]), "worst_time_s": float(p_times[worst]),
                             "median": float(np.median(diff)), "best": float(np.min(diff)),
                             "above_tolerance": int(np.sum(diff > TOLERANCE)), "count": len(diff)},
        "at_freqopt_times": {"worst": float(np.max(back)), "median": float(np.median(back))},
        "curve": {"perseus": sorted(theirs)[:: max(1, len(theirs) // 300)], "freqopt": sorted(ours)},
        "published": published(tag, model, m),
    }


def smooth_profile(path: Path) -> None:
    """Issue 34's made-up case: 4 stages, 22 smooth clocks (tests/test_pipeline_plan.py's smooth_profile)."""
    grid = [1410 - round(i * (1410 - 855) / 21) for i in range(22)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["stage", "instruction", "frequency", "time", "energy"])
        for stage, scale in enumerate([1.0, 1.05, 0.95, 1.1]):
            for kind, base in (("forward", 0.05), ("backward", 0.1)):
                for clock in grid:
                    time_s = base * scale * (0.3 + 0.7 * 1410 / clock)
                    writer.writerow([stage, kind, clock, time_s, (100 + 300 * (clock / 1410) ** 2.5) * time_s])


def small_case(scratch: Path) -> dict:
    """Wall time of ``freqopt plan`` (plan and whole frontier) on the small case, and Ctrl-C's latency mid-MILP."""
    profile = scratch / "smooth4.csv"
    smooth_profile(profile)
    out: dict = {"plan_s": {}}
    for m in (6, 8):
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "freqopt.cli", "plan", "--stage-profile", str(profile), "--micro-batches", str(m),
               "--max-slowdown", "2%", "--blocking-power-w", "80", "--json", str(scratch / f"smooth{m}.json")]
        subprocess.run(cmd, check=True, capture_output=True, env=FREQOPT_ENV)
        out["plan_s"][str(m)] = time.perf_counter() - start
    latencies = []
    for delay in (3.0, 6.0, 9.0):  # into the LP, the MILP (no node limit: it would run for minutes) and later
        target = scratch / "interrupted.json"
        cmd = [sys.executable, "-m", "freqopt.cli", "plan", "--stage-profile", str(profile), "--micro-batches", "8",
               "--max-slowdown", "2%", "--blocking-power-w", "80", "--node-limit", "1000000000", "--json", str(target)]
        process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=FREQOPT_ENV,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        time.sleep(delay)
        sent = time.perf_counter()
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        latencies.append({"after_s": delay, "exit_s": time.perf_counter() - sent, "code": process.returncode,
                          "written": target.exists()})
    out["ctrl_c"] = latencies
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, (len(results) + 2) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4 * rows), tight_layout=True, squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, results):
        c = r["curve"]
        ax.plot(*zip(*c["perseus"]), ".", ms=2, color="tab:orange", label="Perseus's plans (measured)")
        ax.step(*zip(*c["freqopt"]), where="post", color="tab:blue", label="freqopt's staircase (measured)")
        pub = r["published"]
        ax.plot(pub["time_s"], pub["energy_j"], color="grey", lw=0.8, label="Perseus as published (floored, fitted)")
        ax.set_title(f"{r['model']} on {r['gpu']}, M={r['micro_batches']}", fontsize=10)
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy (J)")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=80)


def pct(x: float) -> str:
    return f"{100 * x:+.2f} %"


def load_range(r: dict) -> str:
    """The 1-min load averages read before and after the setting's runs, lowest-highest; older results lack them."""
    readings = [x for runs in r.get("load_1min", {}).values() for pair in runs for x in pair]
    return f"{min(readings):.2f}-{max(readings):.2f}" if readings else "not recorded"


PERSEUS_UNIT_S = 1e-3  # Perseus's default time unit: one plan per 1 ms of floored iteration time


def stopped_estimate(r: dict) -> str:
    """For a Perseus run stopped at its limit: its rate (plans written per second) and the wall time a whole run
    would take at that rate, the plans to write estimated as one per PERSEUS_UNIT_S from its slowest plan's time to
    freqopt's fastest (where every finished setting has Perseus's fastest within 0.1 % of freqopt's)."""
    p = r["perseus"]
    if "slowest_time_s" not in p:
        return ""
    wall = r["perseus_wall_s"][-1]
    rate = p["plans"] / wall
    total = (p["slowest_time_s"] - r["freqopt"]["fastest_time_s"]) / PERSEUS_UNIT_S
    return (f" (rate {rate:.2f} plans/s; about {total:.0f} plans in all, so a whole run would take about "
            f"{total / rate / 3600:.1f} h at that rate, a linear extrapolation)")


def report(doc: dict) -> str:
    results = doc["settings"]
    lines = [
        "# Perseus beside `freqopt plan`, both scored on the measured profiles (issue 34)",
        "",
        f"Made by `{doc['command']}` on {doc['date']} ({doc['machine']}"
        + (f"; {doc['wall_s'] / 60:.0f} min" if doc.get("wall_s") else "") + ")"
        + (f". {doc['note']}" if doc.get("note") else "") + "; source: experiments/perseus_side_by_side.py "
        "(its docstring says how each planner ran and how both are scored). Data: experiments/data/perseus/ (Perseus's "
        "measured stage profiles and published frontiers, copied with their source).",
        "",
        "Scoring: every plan of either planner is evaluated by freqopt's `PipelinePlanner.evaluate` on the measured "
        "profile, unfloored (measured times and energies, the 1F1B critical path, blocking power "
        + ", ".join(f"{w} W on the {g}" for g, w in MEASURED_BLOCKING_POWER_W.items())
        + "). *diff* = freqopt's staircase (its least energy no slower than t) / Perseus's plan's energy - 1 at every "
        "Perseus plan's time t: negative where freqopt uses less. Target: at most +0.2 % everywhere, freqopt's "
        "fastest plan no slower, its wall time no longer.",
        "",
        "| setting | wall s: Perseus / freqopt (median of runs) | ratio | plans: Perseus (distinct) / freqopt | "
        "fastest s: Perseus / freqopt | diff at Perseus's times: worst (at s) / median / best | above +0.2 % | "
        "freqopt proven gap | Perseus at freqopt's times: worst |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        a, b = r["at_perseus_times"], r["at_freqopt_times"]
        stopped = r["perseus"].get("stopped_at_limit_s") is not None
        fastest = "- (stopped)" if stopped else f"{r['perseus']['fastest_time_s']:.4f}"
        lines.append(
            f"| {r['model']} {r['gpu']} M={r['micro_batches']} | {'>= ' if stopped else ''}"
            f"{statistics.median(r['perseus_wall_s']):.1f}{' (stopped)' if stopped else ''} / "
            f"{statistics.median(r['freqopt_wall_s']):.1f} ({r['repeats']}) | {'<= ' if stopped else ''}"
            f"{r['wall_ratio']:.2f} | "
            f"{r['perseus']['plans']} ({r['perseus']['distinct_plans']}) / {r['freqopt']['plans']} | "
            f"{fastest} / {r['freqopt']['fastest_time_s']:.4f} | "
            f"{pct(a['worst'])} ({a['worst_time_s']:.4f}) / {pct(a['median'])} / {pct(a['best'])} | "
            f"{a['above_tolerance']} of {a['count']} | {100 * r['freqopt']['proven_gap']:.2f} % | "
            f"{pct(b['worst'])} |")  # fmt: skip
    stopped = [r for r in results if r["perseus"].get("stopped_at_limit_s") is not None]
    finished = [r for r in results if r not in stopped]
    met = [r for r in finished if r["at_perseus_times"]["above_tolerance"] == 0 and r["wall_ratio"] <= 1
           and r["freqopt"]["fastest_time_s"] <= r["perseus"]["fastest_time_s"] * (1 + 1e-12)]
    lines += [
        "",
        f"**{len(met)} of the {len(finished)} settings Perseus finished meet all three targets.** "
        + ("Settings missing them: " + "; ".join(
            f"{r['model']} {r['gpu']} M={r['micro_batches']} (worst {pct(r['at_perseus_times']['worst'])}, ratio "
            f"{r['wall_ratio']:.2f})" for r in finished if r not in met) + "." if len(met) < len(finished) else ""),
    ]
    if stopped:
        lines += [
            "",
            "**Perseus stopped at its time limit** (`--perseus-limit-s`; it starts from its least-energy plan and "
            "writes one plan per 1 ms faster, so the plans it wrote cover the slow end of its frontier; its wall "
            "time is a lower bound, the ratio an upper bound, and its fastest time is not reached): "
            + "; ".join(f"{r['model']} {r['gpu']} M={r['micro_batches']}: stopped after "
                        f"{r['perseus_wall_s'][-1]:.0f} s with {r['perseus']['plans']} plans written, where its "
                        f"published frontier has {r['published']['points']} points"
                        + (f" at a {1e3 * r['published']['unit_s']:g} ms unit (about "
                           f"{r['published']['points'] * r['published']['unit_s'] / 1e-3:.0f} at the 1 ms unit run here)"
                           if r['published'].get('unit_s') else "")
                        + stopped_estimate(r) + "; at those plans' times "
                        f"freqopt's staircase is {pct(r['at_perseus_times']['worst'])} at worst, "
                        f"{r['at_perseus_times']['above_tolerance']} above +0.2 %, and freqopt's whole frontier "
                        f"took {statistics.median(r['freqopt_wall_s']):.0f} s" for r in stopped) + ".",
        ]
    lines += [
        "",
        "- *load*: the 1-min load average (os.getloadavg) read before and after each planner's run, lowest-highest "
        "per setting (a 2-core machine: above about 1.2, something else was running): "
        + "; ".join(f"{r['model']} {r['gpu']} M={r['micro_batches']} {load_range(r)}" for r in results) + ".",
        "- *wall s*: each planner's whole process, back to back on one machine, alternating which runs first; "
        "Perseus's includes fitting its cost models and drawing 18 figures (its script's own output), freqopt's "
        "the plan at 1 % and the whole frontier written as JSON with every plan's clocks.",
        "- *plans*: Perseus writes one plan per 1 ms step of its floored time; *distinct* counts different measured "
        "(time, energy) pairs. freqopt's plans are distinct by construction, each strictly cheaper than every "
        "faster one.",
        "- *freqopt proven gap*: PipelineFrontier.proven_gap, an upper bound on how far freqopt's staircase lies above "
        "the least energy any plan could have at each time (the hull LP's bound).",
        "- *Perseus at freqopt's times*: the same comparison the other way round: each freqopt plan's energy / "
        "Perseus's staircase at that plan's time - 1 (negative where freqopt uses less), at the worst of freqopt's plans "
        "no faster than Perseus's fastest.",
        "",
        "Perseus's published frontier (floored times, energies from its fitted exponential curves, as "
        "../shared/calibration/perseus/frontiers/ has it) is drawn beside in grey, not scored: "
        + "; ".join(f"{r['model']} {r['gpu']} M={r['micro_batches']}: {r['published']['points']} points from "
                    f"{r['published']['fastest_time_s']:.4f} s"
                    + (f", one per {1e3 * r['published']['unit_s']:g} ms" if r['published'].get('unit_s') else "")
                    for r in results) + ". A frontier published at a 0.1 ms unit holds about ten times the plans a run "
        "at Perseus's default 1 ms unit (this script's) writes over the same times.",
        "",
        "![frontiers](frontiers.png)",
        "",
    ]
    missing = [f"{model} {tag} M={m}" for m in MICRO_BATCHES for tag, model, *_ in SETTINGS
               if not any((r["gpu"], r["model"], r["micro_batches"]) == (tag, model, m) for r in results)]
    if missing:
        lines += [f"Not run: {', '.join(missing)}.", ""]
    small = doc.get("small_case")
    if small:
        lines += [
            "## The small case (4 stages, 22 smooth clocks, 2 %)",
            "",
            "`freqopt plan` with the plan and the whole frontier: "
            + ", ".join(f"{m} micro-batches {s:.1f} s" for m, s in small["plan_s"].items())
            + ". Ctrl-C during `freqopt plan` (8 micro-batches, MILP limit 600 s): "
            + "; ".join(f"sent at {c['after_s']:.0f} s, exited {c['exit_s']:.2f} s later with code {c['code']}, "
                        f"JSON {'written' if c['written'] else 'not written'}" for c in small["ctrl_c"]) + ".",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perseus-python", default=os.environ.get("PERSEUS_PYTHON", "/tmp/perseus-venv/bin/python"),
                        help="a Python with lowtime==0.3.0, pandas, tyro and matplotlib<3.9")
    parser.add_argument("--settings", nargs="*", default=None, help="gpu:model:M, e.g. a100_sxm:bloom:12 (default all)")
    parser.add_argument("--repeats", type=int, default=3, help="back-to-back rounds per setting")
    parser.add_argument("--repeat-up-to", type=int, default=24, help="settings above this M run one round")
    parser.add_argument("--small-case", action="store_true", help="also time the small case and Ctrl-C")
    parser.add_argument("--perseus-limit-s", type=float, default=None,
                        help="stop Perseus after this many seconds and score the plans it wrote by then (it starts "
                             "from its least-energy plan and writes one plan per 1 ms faster)")
    parser.add_argument("--note", default=None, help="a sentence for the report: what else ran on the machine")
    parser.add_argument("--merge", type=Path, nargs="*", default=(),
                        help="results.json files of other runs of this script whose settings join these (no run)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.merge:  # settings run elsewhere (another process, in parallel) join this folder's results
        path = args.out / "results.json"
        doc = json.loads(path.read_text())
        commands, merged, base_settings = [doc["command"]], False, list(doc["settings"])
        for other in map(lambda p: json.loads(p.read_text()), args.merge):
            keys = {(r["gpu"], r["model"], r["micro_batches"]) for r in other["settings"]}
            doc["settings"] = [r for r in doc["settings"] if (r["gpu"], r["model"], r["micro_batches"]) not in keys]
            doc["settings"] += other["settings"]
            commands.append(other["command"])
            if "small_case" in other:
                doc["small_case"] = other["small_case"]
            # The runs ran side by side: the longest is the merged run's wall time; the latest date its date.
            doc["wall_s"] = max(other.get("wall_s", 0.0), doc["wall_s"] if merged else 0.0)
            doc["date"], merged = max(doc["date"], other["date"]) if merged else other["date"], True
        doc["settings"].sort(key=lambda r: (r["micro_batches"], [s[:2] for s in SETTINGS].index((r["gpu"], r["model"]))))
        if not any(r in base_settings for r in doc["settings"]):  # every setting of this folder's run replaced
            commands = commands[1:]
        doc["command"] = "; ".join(dict.fromkeys(commands))
        if args.note:
            doc["note"] = args.note
        atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
        plot(doc["settings"], args.out / "frontiers.png")
        atomic_write_text(args.out / "report.md", report(doc))
        return
    wanted = [(tag, model, m) for m in MICRO_BATCHES for tag, model, *_ in SETTINGS]
    if args.settings:
        wanted = [tuple(s.split(":")[:2]) + (int(s.split(":")[2]),) for s in args.settings]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    if doc.get("format") != "perseus-side-by-side":  # results in an older format (the retired perseus_frontiers.py wrote one): start anew
        doc = {"format": "perseus-side-by-side", "settings": []}
    started = time.perf_counter()
    doc.update(command="python experiments/perseus_side_by_side.py " + " ".join(sys.argv[1:]),
               date=str(date.today()), machine=f"{os.cpu_count()} cores, {platform.machine()}, no GPU")
    with tempfile.TemporaryDirectory(prefix="perseus-side-by-side-") as tmp:
        scratch = Path(tmp)
        script = perseus_copy(scratch)
        for tag, model, m in wanted:
            setting = next(s for s in SETTINGS if s[:2] == (tag, model))
            result = run_setting(args, setting, m, script, scratch)
            doc["settings"] = [r for r in doc["settings"] if (r["gpu"], r["model"], r["micro_batches"]) != (tag, model, m)]
            doc["settings"].append(result)
            doc["settings"].sort(key=lambda r: (r["micro_batches"], [s[:2] for s in SETTINGS].index((r["gpu"], r["model"]))))
            a = result["at_perseus_times"]
            print(f"{model} {tag} M={m}: worst {pct(a['worst'])}, median {pct(a['median'])}, ratio "
                  f"{result['wall_ratio']:.2f}", flush=True)  # fmt: skip
            atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
            atomic_write_text(args.out / "report.md", report(doc))
            for p in scratch.glob("perseus-*"):  # Perseus's files are scored; only their figures remain
                subprocess.run(["rm", "-rf", str(p)], check=True)
        if args.small_case:
            doc["small_case"] = small_case(scratch)
    doc["wall_s"] = time.perf_counter() - started
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    plot(doc["settings"], args.out / "frontiers.png")
    atomic_write_text(args.out / "report.md", report(doc))


if __name__ == "__main__":
    main()
