"""Pipeline schedules compared at equal iteration time, each with its instruction plan (issue 37, item 4).

    python experiments/schedules.py        # writes experiments/schedules/report.md and results.json

Two layouts, each on the simulated A100 and H100: gpt3-xl at pp=4 (4 GPUs, DeepSpeed's "parameters" partition of the
layers into 4 stages, or 8 model stages for the schedules that run two per GPU), 8 micro-batches of 4 x 2048 tokens;
and gpt3-175b at tp=8,pp=8 (64 GPUs as Megatron-LM trained it, Narayanan et al. 2021: 8 pipeline GPUs of 8-way
tensor parallelism, 8 or 16 model stages), 16 micro-batches of 1 x 2048 tokens. For each schedule:

1. freqopt's pipeline search (freqopt.search_pipeline, instruction level, 1 % budget, seed 0) measures every model
   stage's instruction fronts on the simulated GPU (noisy, as a real search would);
2. the planner (PipelinePlanner on those fronts, the schedule's own DAG) plans at one common deadline: 1 % over the
   slowest of the schedules' noiseless default iterations (the search's own budget), so every schedule is held to
   the same iteration time, and even the slowest has the slack a switch latency on its critical path needs; its switches are realized one latency ahead (realize_plan) and the deadline bisected
   on the realized iteration until it fits (freqopt.pipeline.stragglers.matched_requests);
3. against the same schedule with one clock per GPU (plan_stage_clocks at the same deadline) and with one clock
   for all (the least-energy single clock whose iteration fits).

Every figure is a noiseless run of the simulated pipeline (SimulatedPipeline.true_run, switch latency included).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from freqopt.files import atomic_write_text

OUT = Path(__file__).resolve().parent / "schedules"
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-v")
# (label, model, layout, micro-batches, GPU, sizes)
CONFIGS = (("gpt3-xl pp=4, A100", "gpt3-xl", "pp=4", 8, "a100-sxm4-80gb", {}),
           ("gpt3-xl pp=4, H100", "gpt3-xl", "pp=4", 8, "h100-sxm", {}),
           ("gpt3-175b tp=8,pp=8, A100", "gpt3-175b", "tp=8,pp=8", 16, "a100-sxm4-80gb", {"micro_batch_size": 1}),
           ("gpt3-175b tp=8,pp=8, H100", "gpt3-175b", "tp=8,pp=8", 16, "h100-sxm", {"micro_batch_size": 1}))
SLACK = 0.01  # the common deadline: this much over the slowest schedule's default iteration
QUICK = {}  # --quick: gpt3-small, micro-batch 1 of 128 tokens, 4 trials per study, into a temporary folder


def run(config: tuple, schedule: str) -> dict:
    import freqopt
    from freqopt.pipeline.planner import PipelinePlanner
    from freqopt.pipeline.sim import SimulatedPipeline
    from freqopt.workload.layout import parse_layout
    from freqopt.workload.models import get_workload
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    _, model, layout, m, gpu, sizes = config
    started = time.perf_counter()
    if QUICK:
        model, sizes = "gpt3-small", {k: v for k, v in QUICK.items() if k != "n_trials"}
    result = freqopt.search_pipeline(model, gpu=gpu, layout=layout, micro_batches=m, max_slowdown="1%",
                                     granularities="instruction", schedule=schedule, n_trials=QUICK.get("n_trials"),
                                     **sizes)  # fmt: skip
    spec, dag = result.spec, result.dag
    stages = trace_pipeline_stages(get_workload(model, layout=parse_layout(layout), **sizes),
                                   model_stages=dag.stages)  # fmt: skip
    pipe = SimulatedPipeline(stages, spec, m, noise=False, schedule=schedule)
    planner = PipelinePlanner(result.profile, m, blocking_power_w=result.blocking_power_w, schedule=schedule)
    default = pipe.true_run(None)
    return {"schedule": schedule, "gpus": dag.gpus, "model_stages": dag.stages, "default_time_s": default.time_s,
            "default_energy_j": default.energy_j, "tail_s": default.time_s - planner.fastest().time_s,
            "search_wall_s": time.perf_counter() - started, "_pipe": pipe, "_planner": planner,
            "_profile": result.profile}  # fmt: skip


def at_deadline(d: dict, deadline_s: float) -> dict:
    from freqopt.pipeline.stragglers import matched_requests

    pipe, planner, profile, spec = d["_pipe"], d["_planner"], d["_profile"], d["_pipe"].spec
    measure = lambda r: pipe.true_run(r).time_s  # noqa: E731
    plan, requests = matched_requests(planner, profile, deadline_s, measure, switch_s=spec.clock_switch_s,
                                      tail_s=d["tail_s"])  # fmt: skip
    inst = pipe.true_run(requests)
    # One clock per GPU: the stage-clock plan at the deadline, its deadline bisected the same way.
    _, requests_g = matched_requests(planner, profile, deadline_s, measure, switch_s=spec.clock_switch_s,
                                     tail_s=d["tail_s"], plan_with=planner.plan_stage_clocks)  # fmt: skip
    per_gpu = pipe.true_run(requests_g)
    # One clock for all: the least-energy supported clock whose iteration fits.
    single = min((pipe.true_run(c) for c in spec.sm_clocks_mhz if c >= 600),
                 key=lambda r: (r.time_s > deadline_s, r.energy_j))  # fmt: skip
    if single.time_s > deadline_s:
        single = pipe.true_run(None)
    return {"instruction": {"time_s": inst.time_s, "energy_j": inst.energy_j},
            "per_gpu": {"time_s": per_gpu.time_s, "energy_j": per_gpu.energy_j},
            "one_clock": {"time_s": single.time_s, "energy_j": single.energy_j}}  # fmt: skip


def section(label: str, docs: list[dict], deadline_s: float) -> list[str]:
    """One layout's table: every schedule at ``deadline_s``."""
    ref = next(d for d in docs if d["schedule"] == "1f1b")["default_energy_j"]
    lines = [f"## {label}", "", f"Every schedule held to {deadline_s:.4f} s per iteration ({100 * SLACK:g} % over the "
             "slowest default).", "",
             "| schedule | GPUs x model stages | default (s, J) | one clock for all (J, %) | one clock per GPU (J, %) "
             "| one clock per instruction (J, %) | its time (s) |",
             "| --- | --- | --- | --- | --- | --- | ---: |"]  # fmt: skip
    for d in docs:
        r = d["at"]

        def cell(key):
            return f"{r[key]['energy_j']:,.0f} ({100 * r[key]['energy_j'] / ref:.1f})"

        lines.append(f"| {d['schedule']} | {d['gpus']} x {d['model_stages'] // d['gpus']} | "
                     f"{d['default_time_s']:.4f}, {d['default_energy_j']:,.0f} | {cell('one_clock')} | "
                     f"{cell('per_gpu')} | {cell('instruction')} | {r['instruction']['time_s']:.4f} |")  # fmt: skip
    return lines + [""]


def report(sections: list[list[str]], total_s: float) -> str:
    lines = ["# Pipeline schedules at equal iteration time (simulated A100 and H100)", "",
             f"Written by `python experiments/schedules.py` ({total_s / 60:.0f} min on 2 CPU cores, "
             f"{time.strftime('%Y-%m-%d')}); method in its docstring. Energies in J per iteration of the pipeline's "
             "GPUs (one GPU per pipeline stage; with tensor parallelism, one of each stage's tp GPUs), noiseless, and "
             "in % of 1F1B's default energy. One clock for all is the best supported clock found by running every "
             "one noiselessly (an oracle); one clock per GPU and per instruction are the planner's plans on the "
             "search's measured (noisy) fronts, so the oracle can beat a plan by a little.", ""]  # fmt: skip
    for part in sections:
        lines += part
    lines += ["Not modelled here: a V-shaped schedule's hand-over between its two stages on one GPU is timed as "
              "a link transfer; the zero-bubble schedules' split of the backward is freqopt's reading of the kernels "
              "(freqopt.workload.pipeline_trace.split_backward); memory (interleaving and zero-bubble schedules hold "
              "more activations) is not checked.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import tempfile

    from freqopt.search.study import optuna_logging

    global OUT
    configs = CONFIGS
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        QUICK.update(micro_batch_size=1, seq_len=128, n_trials=4)
        OUT = Path(tempfile.mkdtemp(prefix="schedules-"))
        configs = CONFIGS[:1]

    started = time.perf_counter()
    results, sections = [], []
    for config in configs:
        with optuna_logging(False):
            docs = []
            for schedule in SCHEDULES:
                docs.append(run(config, schedule))
                print(f"{config[0]}, {schedule}: default {docs[-1]['default_time_s']:.4f} s, "
                      f"{docs[-1]['default_energy_j']:.0f} J ({docs[-1]['search_wall_s']:.0f} s)", flush=True)
        deadline_s = (1 + SLACK) * max(d["default_time_s"] for d in docs)  # every schedule's default meets it
        for d in docs:
            d["at"] = at_deadline(d, deadline_s)
            print(d["schedule"], {k: round(v["energy_j"], 1) for k, v in d["at"].items()}, flush=True)
        sections.append(section(config[0], docs, deadline_s))
        results.append({"label": config[0], "deadline_s": deadline_s,
                        "schedules": [{k: v for k, v in d.items() if not k.startswith("_")} for d in docs]})
    total = time.perf_counter() - started
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / "results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(OUT / "report.md", report(sections, total))
    print(f"wrote {OUT / 'report.md'} in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
