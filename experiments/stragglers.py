"""Energy saved by matching a straggler, on dp = 4 simulated pipelines (issue 37, item 3).

    python experiments/stragglers.py        # writes experiments/stragglers/report.md and results.json

For each configuration, freqopt's pipeline search (freqopt.search_pipeline, instruction level, 1 % budget, seed 0)
gives the instruction fronts a real search would measure; then four data-parallel copies of the pipeline run on
the simulated GPU without noise (freqopt.pipeline.stragglers.run_data_parallel): pipeline 0 is a straggler, its first
GPU held under the clock ceiling that slows its default iteration closest to 1.1x or 1.2x (as a thermal or
power-brake slowdown would: straggler_ceiling), and the other three either

* wait for it at their fastest clocks (what data-parallel training does today: their GPUs blocked at the gradient
  all-reduce), or
* run the least-energy plan of their time-energy frontier whose iteration, as its switches are realized, still
  ends within the straggler's (matched_requests: Perseus's answer to extrinsic energy bloat, Chung et al. SOSP'24);

and, to separate the two savings, the search's own 1 % instruction plan, blind to the straggler (the intrinsic
saving alone).

Reported: the three pipelines' energy either way, the saving, and the data-parallel iteration time either way.

Then the runtime's side, the straggler learnt rather than known: a run of FOLLOW_STEPS iterations in which pipeline
0 is the 1.2x straggler from STRAGGLE[0] to STRAGGLE[1] (its first GPU under the ceiling) and every pipeline runs a
StragglerFollower (freqopt.apply.torch_pipeline_runtime, every_n_steps each of EVERY) over its plans: the search's 1 % plan
(the fastest) and the matched plans for a straggler 1.05x to 1.3x as slow (matched_requests; each plan's predicted
time its noiseless simulated iteration). After each iteration a follower is told its own pipeline's simulated
time, and every every_n_steps iterations the four followers' reports are reduced to their maximum (in this process, as
the all-reduce would). Against the same run with no follower (every pipeline on its 1 % plan throughout).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from freqopt.files import atomic_write_text

OUT = Path(__file__).resolve().parent / "stragglers"
SLOWDOWNS = (0.1, 0.2)
DP = 4
FOLLOW_STEPS, STRAGGLE = 60, (10, 35)  # the follower run: iterations, and the straggler's
EVERY = (1, 5)  # the follower runs' iterations between reductions
LADDER = (0.05, 0.1, 0.15, 0.2, 0.3)  # the follower's plans: matched to a straggler this much slower
# (label, model, overrides, layout, micro-batches, GPU)
CONFIGS = (
    ("gpt3-xl pp=4, A100", "gpt3-xl", {}, "pp=4", 8, "a100-sxm4-80gb"),
    ("gpt3-xl pp=4, H100", "gpt3-xl", {}, "pp=4", 8, "h100-sxm"),
)


def run(config) -> dict:
    import freqopt
    from freqopt.pipeline.planner import PipelinePlanner
    from freqopt.pipeline.sim import SimulatedPipeline
    from freqopt.pipeline.stragglers import clock_ceiling, matched_requests, run_data_parallel, straggler_ceiling
    from freqopt.workload.layout import parse_layout
    from freqopt.workload.models import get_workload
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    label, model, overrides, layout, m, gpu = config
    started = time.perf_counter()
    result = freqopt.search_pipeline(model, gpu=gpu, layout=layout, micro_batches=m, max_slowdown="1%",
                                     granularities="instruction", **overrides)  # fmt: skip
    spec = result.spec
    stages = trace_pipeline_stages(get_workload(model, layout=parse_layout(layout), **overrides))
    pipe = SimulatedPipeline(stages, spec, m, noise=False)
    planner = PipelinePlanner(result.profile, m, blocking_power_w=result.blocking_power_w)
    tail_s = pipe.true_run(None).time_s - planner.fastest().time_s
    own = list(result.levels["instruction"].requests)  # the search's 1 % plan, blind to the straggler
    rows = []
    for slowdown in SLOWDOWNS:
        ceiling, got = straggler_ceiling(pipe, slowdown)
        slow = clock_ceiling(pipe, None, 0, ceiling)
        straggler_s = pipe.true_run(slow).time_s
        plan, matched = matched_requests(planner, result.profile, straggler_s, lambda r: pipe.true_run(r).time_s,
                                         switch_s=spec.clock_switch_s, tail_s=tail_s)  # fmt: skip
        waiting = run_data_parallel(pipe, [slow] + [None] * (DP - 1))
        after = run_data_parallel(pipe, [slow] + [matched] * (DP - 1))
        intrinsic = run_data_parallel(pipe, [slow] + [own] * (DP - 1))
        others_wait, others_after = sum(waiting.pipeline_energy_j[1:]), sum(after.pipeline_energy_j[1:])
        rows.append({"slowdown_target": slowdown, "ceiling_mhz": ceiling, "straggler_slowdown": got,
                     "iteration_s_waiting": waiting.time_s, "iteration_s_matched": after.time_s,
                     "others_energy_j_waiting": others_wait, "others_energy_j_matched": others_after,
                     "others_saved_pct": 100 * (1 - others_after / others_wait),
                     "others_energy_j_own_plan": sum(intrinsic.pipeline_energy_j[1:]),
                     "others_saved_pct_own_plan": 100 * (1 - sum(intrinsic.pipeline_energy_j[1:]) / others_wait),
                     "all_saved_pct": 100 * (1 - after.energy_j / waiting.energy_j),
                     "iteration_change_pct": 100 * (after.time_s / waiting.time_s - 1)})  # fmt: skip
        print(f"{label}, straggler {1 + got:.3f}x: others save {rows[-1]['others_saved_pct']:.2f} %, iteration "
              f"{rows[-1]['iteration_change_pct']:+.3f} %", flush=True)
    base_s = pipe.true_run(own).time_s
    ladder = [(base_s, own)]
    for s in LADDER:
        _, requests = matched_requests(planner, result.profile, base_s * (1 + s), lambda r: pipe.true_run(r).time_s,
                                       switch_s=spec.clock_switch_s, tail_s=tail_s)  # fmt: skip
        time_s = pipe.true_run(requests).time_s
        if time_s > base_s:  # else nothing slower fitted: matched_requests' fastest plan
            ladder.append((time_s, requests))
    follow = [follow_run(pipe, ladder, clock_ceiling(pipe, None, 0, ceiling), every) for every in EVERY]
    for f in follow:
        print(f"{label}, follower every {f['every_n_steps']}: others save {f['others_saved_pct']:.2f} %, run time "
              f"{f['time_change_pct']:+.3f} %", flush=True)
    return {"label": label, "gpu": gpu, "micro_batches": m, "dp": DP, "rows": rows, "follow": follow,
            "wall_s": time.perf_counter() - started}  # fmt: skip


def follow_run(pipe, ladder, slow_ceiling, every: int) -> dict:
    """FOLLOW_STEPS iterations of DP pipelines, pipeline 0 a straggler (under ``slow_ceiling``'s clocks, a ceiling
    on its first GPU) from STRAGGLE[0] to STRAGGLE[1], every pipeline following the straggler over ``ladder``
    ((predicted time s, requests) pairs) with a reduction every ``every`` iterations, against the same iterations with
    no follower."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from freqopt.apply.torch_pipeline_runtime import StragglerFollower
    from freqopt.pipeline.stragglers import run_data_parallel

    barrier, reports = threading.Barrier(DP), {}

    def reduce_max(i):
        def reduce(mine: float) -> float:  # what the all-reduce (MAX) does, over threads
            reports[i] = mine
            barrier.wait()
            top = max(reports.values())
            barrier.wait()
            return top

        return reduce

    followers = [StragglerFollower(ladder, every_n_steps=every, reduce_max=reduce_max(i)) for i in range(DP)]
    top = pipe.spec.max_sm_clock_mhz
    ceiling = [c if c < top else None for c in slow_ceiling]

    def requests(i, plan, step):
        if i == 0 and STRAGGLE[0] <= step < STRAGGLE[1]:
            return [min(c, r or top) if c else r for c, r in zip(ceiling, plan)]
        return plan

    steps, blind = [], []
    with ThreadPoolExecutor(DP) as pool:
        for step in range(FOLLOW_STEPS):
            run = run_data_parallel(pipe, [requests(i, f.plan, step) for i, f in enumerate(followers)])
            chosen = [next(k for k, (_, p) in enumerate(ladder) if p is f.plan) for f in followers]
            steps.append({"time_s": run.time_s, "others_energy_j": sum(run.pipeline_energy_j[1:]), "plans": chosen})
            list(pool.map(lambda i: followers[i].step_done(run.pipeline_time_s[i]), range(DP)))
            no = run_data_parallel(pipe, [requests(i, ladder[0][1], step) for i in range(DP)])
            blind.append({"time_s": no.time_s, "others_energy_j": sum(no.pipeline_energy_j[1:])})
    others = sum(s["others_energy_j"] for s in steps)
    others_blind = sum(s["others_energy_j"] for s in blind)
    time_s, time_blind = sum(s["time_s"] for s in steps), sum(s["time_s"] for s in blind)
    moved = [k for k, s in enumerate(steps) if s["plans"][1] != 0]
    return {"every_n_steps": every, "steps": steps, "blind": blind, "others_saved_pct": 100 * (1 - others / others_blind),
            "time_change_pct": 100 * (time_s / time_blind - 1),
            "slowest_step_change_pct": 100 * max(a["time_s"] / b["time_s"] - 1 for a, b in zip(steps, blind)),
            "first_matched_step": moved[0] if moved else None, "last_matched_step": moved[-1] if moved else None,
            "ladder_s": [t for t, _ in ladder]}  # fmt: skip


def report(docs: list[dict], total_s: float) -> str:
    lines = ["# Matching a straggler: energy saved by the other data-parallel pipelines (simulated)", "",
             f"Written by `python experiments/stragglers.py` ({total_s / 60:.0f} min on 2 CPU cores, "
             f"{time.strftime('%Y-%m-%d')}); the method is in its docstring. dp = {DP} pipelines; one straggler, "
             "its first GPU under a clock ceiling; noiseless runs of the simulated pipeline with the GPU's switch "
             "latency.", "",
             "| configuration | straggler | ceiling (MHz) | iteration (s): waiting / matched | change (%) | other 3 "
             "pipelines (J): waiting / matched | saved by them (%) | of which their own 1 % plan, blind to the "
             "straggler (%) | saved, all 4 (%) |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for d in docs:
        for r in d["rows"]:
            lines.append(f"| {d['label']} | {1 + r['straggler_slowdown']:.3f}x | {r['ceiling_mhz']} | "
                         f"{r['iteration_s_waiting']:.4f} / {r['iteration_s_matched']:.4f} | "
                         f"{r['iteration_change_pct']:+.3f} | {r['others_energy_j_waiting']:,.0f} / "
                         f"{r['others_energy_j_matched']:,.0f} | {r['others_saved_pct']:.2f} | "
                         f"{r['others_saved_pct_own_plan']:.2f} | {r['all_saved_pct']:.2f} |")  # fmt: skip
    lines += ["", f"The straggler learnt by the runtime (StragglerFollower; {FOLLOW_STEPS} iterations, the 1.2x "
              f"straggler from iteration {STRAGGLE[0]} to {STRAGGLE[1] - 1}; against the same run with every pipeline "
              "on its 1 % plan throughout):", "",
              "| configuration | a reduction every (iterations) | iterations the others ran a matched plan | energy "
              "saved by the other 3 pipelines over the run (%) | the run's time (%) | slowest iteration against the "
              "same without a follower (%) |",
              "| --- | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for d in docs:
        for f in d["follow"]:
            lines.append(f"| {d['label']} | {f['every_n_steps']} | {f['first_matched_step']}-{f['last_matched_step']} "
                         f"| {f['others_saved_pct']:.2f} | {f['time_change_pct']:+.3f} | "
                         f"{f['slowest_step_change_pct']:+.3f} |")  # fmt: skip
    lines += ["", "A follower sees the straggler at the first reduction after it starts and its recovery at the first "
              "after it ends: the others take a matched plan up to N iterations late (they wait meanwhile, as without "
              "a follower) and leave it up to N iterations late, those iterations as slow as the straggler was (the "
              "time columns). A reduction all-reduces one float per pipeline (its cost is not timed here); a shorter N "
              "loses less time.", "",
              "Not modelled: the gradient all-reduce's own time (the same either way); a straggler whose slowdown "
              "changes between reductions.", ""]
    return "\n".join(lines)


def main() -> int:
    from freqopt.search.study import optuna_logging

    started = time.perf_counter()
    with optuna_logging(False):
        docs = [run(c) for c in CONFIGS]
    total = time.perf_counter() - started
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / "results.json", json.dumps(docs, indent=1) + "\n")  # follow: every iteration too
    atomic_write_text(OUT / "report.md", report(docs, total))
    print(f"wrote {OUT / 'report.md'} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
