"""Energy saved by matching a straggler, on dp = 4 simulated pipelines (issue 37, item 3).

    python experiments/stragglers.py        # writes experiments/stragglers/report.md and results.json

For each configuration, freqopt's pipeline search (freqopt.search_pipeline, instruction level, 1 % budget, seed 0)
gives the instruction fronts a real search would measure; then four data-parallel copies of the pipeline run on
the simulated GPU without noise (freqopt.search.stragglers.run_data_parallel): pipeline 0 is a straggler, its first
GPU held under the clock ceiling that slows its default iteration closest to 1.1x or 1.2x (as a thermal or
power-brake slowdown would: straggler_ceiling), and the other three either

* wait for it at their fastest clocks (what data-parallel training does today: their GPUs blocked at the gradient
  all-reduce), or
* run the least-energy plan of their time-energy frontier whose iteration, as its switches are realized, still
  ends within the straggler's (matched_requests: Perseus's answer to extrinsic energy bloat, Chung et al. SOSP'24);

and, to separate the two savings, the search's own 1 % instruction plan, blind to the straggler (the intrinsic
saving alone).

Reported: the three pipelines' energy either way, the saving, and the data-parallel iteration time either way.
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
# (label, model, overrides, layout, micro-batches, GPU)
CONFIGS = (
    ("gpt3-xl pp=4, A100", "gpt3-xl", {}, "pp=4", 8, "a100-sxm4-80gb"),
    ("gpt3-xl pp=4, H100", "gpt3-xl", {}, "pp=4", 8, "h100-sxm"),
)


def run(config) -> dict:
    import freqopt
    from freqopt.search.pipeline_plan import PipelinePlanner
    from freqopt.search.pipeline_sim import SimulatedPipeline
    from freqopt.search.stragglers import clock_ceiling, matched_requests, run_data_parallel, straggler_ceiling
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
    rows = []
    for slowdown in SLOWDOWNS:
        ceiling, got = straggler_ceiling(pipe, slowdown)
        slow = clock_ceiling(pipe, None, 0, ceiling)
        straggler_s = pipe.true_run(slow).time_s
        plan, matched = matched_requests(planner, result.profile, straggler_s, lambda r: pipe.true_run(r).time_s,
                                         switch_s=spec.clock_switch_s, tail_s=tail_s)  # fmt: skip
        waiting = run_data_parallel(pipe, [slow] + [None] * (DP - 1))
        after = run_data_parallel(pipe, [slow] + [matched] * (DP - 1))
        own = list(result.levels["instruction"].requests)  # the search's 1 % plan, blind to the straggler
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
    return {"label": label, "gpu": gpu, "micro_batches": m, "dp": DP, "rows": rows,
            "wall_s": time.perf_counter() - started}  # fmt: skip


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
    lines += ["", "Not modelled: the gradient all-reduce's own time (the same either way); how a pipeline learns the "
              "straggler's time (an all-reduce of iteration times every N steps, or a scheduler that knows it: "
              "freqopt's runtime does neither yet, so these figures assume the straggler is known); a straggler "
              "whose slowdown changes while the plan runs.", ""]
    return "\n".join(lines)


def main() -> int:
    from freqopt.search.study import optuna_logging

    started = time.perf_counter()
    with optuna_logging(False):
        docs = [run(c) for c in CONFIGS]
    total = time.perf_counter() - started
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / "results.json", json.dumps(docs, indent=1) + "\n")
    atomic_write_text(OUT / "report.md", report(docs, total))
    print(f"wrote {OUT / 'report.md'} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
