"""One clock per pipeline instruction against one clock for the iteration, on the simulated pipeline (issue 24).

    nice -n 10 python experiments/pipeline_levels.py           # writes experiments/pipeline/report.md and results.json
    python experiments/pipeline_levels.py --quick              # a tiny pipeline, few trials, into a temporary folder

For each configuration, freqopt's pipeline search (freqopt.pipeline.search.run_pipeline_search, what
``freqopt search --layout ...,pp=S --micro-batches M`` runs) at a 1 % budget on the simulated GPU named, with its own
clock-switch latency (search_spaces/*.toml: the A100's cautious 170 ms, the H100's 26 ms):

* gpt3-xl at pp=4 (DeepSpeed's default partition, "parameters"), micro-batch 4 of 2048 tokens, 8 micro-batches;
* gpt3-175b at tp=8,pp=8, micro-batch 1 (as Megatron-LM trained it, Narayanan et al. 2021), 16 micro-batches;

on the A100 (a100-sxm4-80gb) and the H100 (h100-sxm). M = 2 x pp: the fewest micro-batches that keep the 1F1B
bubble, (S - 1) / (M + S - 1), at or below a third (27 % at pp=4, 32 % at pp=8); more micro-batches shrink the
bubble and, with it, what clocks can take for free, which the micro-batch rows show (gpt3-xl on the A100 at M = 16
and 32, re-planned from the same instruction fronts: no instruction is measured again). A blocked GPU draws its
waiting power (freqopt.gpu.backends.physics.waiting_power_w: on the A100 Perseus's measured 83.64 W at the top
clock, since issue 36; 147 W before), part of which falls with the clock as modelled; each level's saving is also
given, without noise, with a blocked power that does not fall at all (Perseus's constant accounting), to show how
much the figures rest on what no measurement pins.

Every figure is validated: the whole simulated pipeline's iteration measured (mean and standard error of fresh
readings taken after the choice, its slowdown held to the budget at 95 % confidence)
with the schedule a runtime realizes, each clock requested at an instruction's start, served one at a time by the
stage's runtime thread (each NVML set call taking nvml_call_s, 20 ms on the A100 and H100; a request still waiting
when a newer one comes is dropped) and landing one switch latency after its call starts (issue 35, item 6). The
studies are kept in experiments/pipeline/studies.db (not committed): a rerun resumes from it; delete it after a change
to the simulated GPU, whose readings it holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from freqopt.files import atomic_write_text
from freqopt.gpu.backends.physics import waiting_power_w
from freqopt.gpu.spec_parts import WaitingPower
from freqopt.gpu.specs import get_gpu
from freqopt.pipeline.config import PipelineSearchConfig
from freqopt.pipeline.search import run_pipeline_search
from freqopt.pipeline.sim import SimulatedPipeline
from freqopt.search.storage import open_storage
from freqopt.search.study import optuna_logging
from freqopt.workload.layout import parse_layout
from freqopt.workload.models import get_workload
from freqopt.workload.pipeline_trace import trace_pipeline_stages

OUT = Path(__file__).resolve().parent / "pipeline"
BUDGET = 0.01
STALLS_S = (0.0, 1e-4, 1e-3)  # a GPU stall per clock switch landing mid-instruction (issue 34's sensitivity)
# (label, model, get_workload overrides, layout, micro-batches, GPU type, constant blocked power or None)
CONFIGS = (
    ("gpt3-xl pp=4, A100", "gpt3-xl", {}, "pp=4", 8, "a100-sxm4-80gb", None),
    ("gpt3-xl pp=4, H100", "gpt3-xl", {}, "pp=4", 8, "h100-sxm", None),
    ("gpt3-175b tp=8,pp=8, A100", "gpt3-175b", {"micro_batch_size": 1}, "tp=8,pp=8", 16, "a100-sxm4-80gb", None),
    ("gpt3-175b tp=8,pp=8, H100", "gpt3-175b", {"micro_batch_size": 1}, "tp=8,pp=8", 16, "h100-sxm", None),
    ("gpt3-xl pp=4, A100, M=16", "gpt3-xl", {}, "pp=4", 16, "a100-sxm4-80gb", None),
    ("gpt3-xl pp=4, A100, M=32", "gpt3-xl", {}, "pp=4", 32, "a100-sxm4-80gb", None),
)
QUICK = (("gpt3-small pp=2, A100 (quick)", "gpt3-small", {"micro_batch_size": 2, "seq_len": 256}, "pp=2", 4,
          "a100-sxm4-80gb", None),)  # fmt: skip


def run(config, storage, *, quick: bool) -> dict:
    label, model, overrides, layout, micro_batches, gpu, blocked = config
    workload = get_workload(model, layout=parse_layout(layout), **overrides)
    started = time.perf_counter()
    stages = trace_pipeline_stages(workload)
    search_config = PipelineSearchConfig(max_slowdown=BUDGET, seed=0, storage=None, blocked_power_w=blocked,
                                         **({"n_trials": 5, "validation_repeats": 2, "frontier_points": 4}
                                            if quick else {}))  # fmt: skip
    spec = get_gpu(gpu)
    result = run_pipeline_search(stages, spec, micro_batches, search_config, storage=storage)
    doc = result.summary()
    # The instruction level's validated schedule again, noiseless, with a switch that also stalls the GPU while it
    # lands mid-instruction (SimulatedPipeline's switch_stall_s), against the noiseless default iteration.
    requests = list(result.levels["instruction"].requests)
    stall = []
    for stall_s in STALLS_S:
        pipe = SimulatedPipeline(stages, spec, micro_batches, noise=False, blocked_power_w=blocked,
                                 switch_stall_s=stall_s)  # fmt: skip
        base, run_ = pipe.true_run(None), pipe.true_run(requests)
        stall.append({"stall_s": stall_s, "energy_saved_pct": 100 * (1 - run_.energy_j / base.energy_j),
                      "slowdown_pct": 100 * (run_.time_s / base.time_s - 1)})
    busy = [r.busy_s for r in SimulatedPipeline(stages, spec, micro_batches, noise=False).true_run(None).stages]
    # What the fitted power model says a waiting GPU draws without the file's measured waiting power (its loaded
    # baseline at the top clocks): the figure to judge by the measurement where the file takes the measurement itself.
    model_w = float(waiting_power_w(dataclasses.replace(spec, waiting_power=WaitingPower()), spec.max_mem_clock_mhz)[0, -1])
    doc.update(label=label, layout=layout, constant_blocked_power_w=blocked, wall_s=time.perf_counter() - started,
               model_blocking_power_w=model_w, file_waiting_power_w=spec.waiting_power.top_clocks_w,
               switch_stall=stall, stage_busy_s=busy,
               stage_layers=[[s.stage.layers[0].name, s.stage.layers[-1].name] for s in stages],
               requests=result.stage_requests() if "instruction" in result.levels else None)  # fmt: skip
    print(f"{label}: " + ", ".join(f"{g} {r['energy_saved_pct']:.2f} % at {r['slowdown_pct']:+.2f} %"
                                   for g, r in doc["results"].items()) + f" ({doc['wall_s']:.0f} s)", flush=True)
    return doc


def _pct(r: dict, key: str) -> str:
    return f"{r[key]:.2f} ± {r[key.replace('_pct', '_se_pct')]:.2f}"


def report(docs: list[dict], command: str, total_s: float) -> str:
    lines = ["# One clock per pipeline instruction against one per stage and one for the iteration (simulated "
             "pipeline)", "",
             f"Written by `experiments/pipeline_levels.py` ({command}; {total_s / 60:.0f} min on 2 shared CPU "
             "cores). Every figure is validated: the whole simulated pipeline's iteration (freqopt.pipeline."
             "sim: S simulated GPUs running DeepSpeed's 1F1B schedule, P2P transfers timed by the "
             "physics, each GPU drawing its blocked power while it waits, the optimizer step after the last "
             "backward) measured with the schedule a runtime realizes (each clock asked for at an "
             "instruction's start, served one at a time by the stage's runtime thread, 20 ms per NVML set call, a waiting request "
             "dropped when a newer one comes, and landing one switch latency after its call starts: issue 35, item "
             "6): mean ± standard error of 8 fresh readings "
             "taken after the schedule was chosen, against the default iteration measured 4 times. Budget: 1 % "
             "slowdown, held at 95 % confidence (issue 35, item 1): a schedule is kept only if the upper confidence "
             "bound of its slowdown (\"bound\"), from readings each paired with one of the defaults, is within it, "
             "on the readings it was chosen on and again on the fresh ones. Search cost: every measurement the level "
             "took (its studies and its validations) in GPU-hours, as a real pipeline would spend them (a whole "
             "iteration's measurement occupies its S GPUs), and the wall time of this machine.", "",
             "| configuration | switch (ms) | default (s, J) | level | saved (%) | slowdown (%) | bound (%) | free "
             "switching: saved / slowdown (%) | switches / iter | measurements | GPU-h | wall (s) |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for d in docs:
        base = d["baseline"]
        for g in ("iteration", "stage", "instruction"):
            r = d["results"][g]
            ideal = "-" if r["ideal_energy_saved_pct"] is None else \
                f"{r['ideal_energy_saved_pct']:.2f} / {r['ideal_slowdown_pct']:.2f}"
            head = (f"{d['label']} | {1e3 * d['switch_s']:g} | {base['time_s']:.4f} s, {base['energy_j']:,.0f} J"
                    if g == "iteration" else " | | ")
            bound = "-" if r.get("slowdown_bound_pct") is None else f"{r['slowdown_bound_pct']:.2f}"
            lines.append(f"| {head} | {g} | {_pct(r, 'energy_saved_pct')} | {_pct(r, 'slowdown_pct')} | {bound} | {ideal} | "
                         f"{r['n_switches']} | {r['n_measurements']} | {r['search_cost_gpu_s'] / 3600:.3f} | "
                         f"{r['search_wall_s']:.0f} |")  # fmt: skip
    lines += ["", "The stage level is one clock per stage that never switches (PipelinePlanner.plan_stage_clocks on "
              "the instruction level's fronts): what balancing the stages gives with no switch at all. Instruction "
              "level against it and against the iteration level (validated savings):", ""]
    for d in docs:
        it, st, inst = (d["results"][g]["energy_saved_pct"] for g in ("iteration", "stage", "instruction"))
        ratio = f"{inst / it:.2f}x the iteration level's" if it > 0 else "(iteration level saved nothing)"
        lines.append(f"- {d['label']}: {inst:.2f} % against {st:.2f} % one clock per stage and {it:.2f} % one for "
                     f"all: {inst - st:+.2f} points from switching per instruction, {ratio}; the plan within "
                     f"{100 * (d['results']['instruction']['plan_gap'] or 0):.3g} % of the optimum of the measured "
                     f"fronts (proven); search {d['wall_s']:.0f} s in all")  # fmt: skip
    lines += ["", "## A switch that also stalls the GPU", "",
              "The instruction level's validated schedule measured again without noise, each switch that lands "
              "mid-instruction pausing the GPU for the stall (drawing its blocked power); whether a real transition "
              "pauses the SMs is not in the sources. Energy saved and slowdown against the default iteration:", "",
              "| configuration | " + " | ".join(f"stall {1e3 * s:g} ms" for s in STALLS_S) + " |",
              "| --- | " + " | ".join("---:" for _ in STALLS_S) + " |"]
    for d in docs:
        lines.append(f"| {d['label']} | " + " | ".join(f"{x['energy_saved_pct']:.2f} % at {x['slowdown_pct']:+.2f} %"
                                                     for x in d["switch_stall"]) + " |")  # fmt: skip
    gaps = [d["results"]["instruction"]["ideal_energy_saved_pct"] - d["results"]["instruction"]["energy_saved_pct"]
            for d in docs if d["results"]["instruction"]["ideal_energy_saved_pct"] is not None]
    xl = next((d for d in docs if d["label"].startswith("gpt3-xl pp=4, A100")), None)
    big = next((d for d in docs if d["label"].startswith("gpt3-175b") and "A100" in d["label"]), None)

    def idle(d, which):  # how much less than the busiest stage a stage is busy, %
        busy = d["stage_busy_s"]
        return 100 * (1 - busy[which] / max(busy))

    lines += ["", "Where the instruction level's saving comes from: unequal stages and the bubbles. DeepSpeed's "
              "'parameters' partition balances parameters, not time: gpt3-xl's first stage holds the embedding (as "
              "many parameters as two blocks, almost no compute) and 5 blocks, against 7 in each middle stage and 5 "
              "plus the output layer in the last"
              + (f", so its first stage is busy {idle(xl, 0):.0f} % less than the busiest (the default iteration, "
                 "noiseless)" if xl else "")
              + "; gpt3-175b's last stage holds the output layer, whose GEMM (2 x tokens x d_model x vocabulary) is "
              "not split by AutoTP's tensor parallelism (freqopt.workload.models.parallel)"
              + (f", so the seven other stages are busy {min(idle(big, s) for s in range(7)):.0f}-"
                 f"{max(idle(big, s) for s in range(7)):.0f} % less than it" if big else "")
              + ", and at the A100's fitted power curve (experiments/dvfs_fit.md) slowing them into that wait saves "
              "most of their energy for no time. A longer switch costs the instruction level more: each switch is "
              "asked for one latency ahead and the faster clock is held over its neighbours (freqopt.pipeline."
              "realize.realize_requests)"
              + (f", and the free-switching column is {min(gaps):.1f}-{max(gaps):.1f} points above the realized one"
                 if gaps else "") + ".",
              "", "## Blocked power", "",
              "A GPU waiting on a P2P receive spins in a NCCL kernel that has received nothing: it draws the GPU's "
              "waiting power at the clock in force (freqopt.gpu.backends.physics.waiting_power_w, issue 36, item 2). "
              "Perseus measured this power as a constant (lowtime/scripts/perseus.py, ml-energy/zeus branch kronos): "
              "83.64 W on an A100 SXM, 70.38 W on an A40, which the A100's GPU file takes as its waiting power at "
              "the top clock; before issue 36 the physics gave it the loaded power model's baseline, 147.3 W, 76 % "
              "over. The H100 waits at its power model's baseline, fitted to its idle readings (71.6 W at 405 MHz, "
              "119-128 W with a context at 1980 MHz).", ""]  # fmt: skip
    for d in {d["gpu"]: d for d in docs if d["constant_blocked_power_w"] is None}.values():
        perseus, model_w = d["perseus_blocking_power_w"], d["model_blocking_power_w"]
        line = f"- {d['gpu']}: {d['blocking_power_w']:.1f} W at its top clock (the planner's constant)"
        if perseus and d["file_waiting_power_w"] == perseus:
            line += (f", which is Perseus's measured {perseus:g} W itself (the GPU file takes it: no check); the "
                     f"fitted power model alone would say {model_w:.1f} W ({100 * (model_w / perseus - 1):+.1f} % of the "
                     "measurement)")
        elif perseus:
            line += f"; Perseus measured {perseus:g} W: the physics is {100 * (d['blocking_power_w'] / perseus - 1):+.1f} %"
        else:
            line += "; no measured figure"
        lines.append(line)
    lines += ["", "How much of that power falls at a lower clock is measured on no GPU with a context open: the "
              "modelled share (0.503 of the top clock's figure, scaling with V^2 f: the H100's idle readings) is "
              "one end of a range whose other end is a blocked power that does not fall at all, Perseus's constant "
              "accounting (freqopt.gpu.specs.WaitingPower). Each level's validated schedule, noiseless, at both "
              "ends (energy saved against the default iteration, %: as modelled / flat):", "",
              "| configuration | iteration | stage | instruction |", "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for d in docs:
        ends = [d["results"][g].get("saving_pct_waiting_range") for g in ("iteration", "stage", "instruction")]
        lines.append(f"| {d['label']} | " + " | ".join("-" if e is None else f"{e[1]:.2f} / {e[0]:.2f}" for e in ends)
                     + " |")  # fmt: skip
    lines += ["", "## Time-energy frontiers (the planner's prediction)", "",
              "Each instruction plan's frontier as PipelinePlanner.frontier gives it: the least energy of the "
              "instructions' critical path at each deadline (Perseus's accounting with the constant blocked power "
              "above, free switching, without the optimizer step), relative to every instruction at its default.",
              ""]  # fmt: skip
    for d in docs:
        points = d["results"]["instruction"]["frontier"]
        if not points:
            continue
        default = d["results"]["instruction"]["predicted_baseline"]
        unique = list({(p["time_s"], p["energy_j"]): p for p in points}.values())  # later deadlines may keep a plan
        lines.append(f"- {d['label']} (every instruction at its default: {default['time_s']:.4f} s, "
                     f"{default['energy_j']:,.0f} J): " + ", ".join(
                         f"{100 * (p['time_s'] / default['time_s'] - 1):+.1f} % time, "
                         f"{100 * (1 - p['energy_j'] / default['energy_j']):.1f} % saved" for p in unique))  # fmt: skip
    lines += ["", "## What is not modelled", "",
              "The simulated pipeline's own list (freqopt/pipeline/sim.py): the two ends of a P2P transfer "
              "are timed one after the other; the data-parallel and tied-embedding gradient all-reduces (dp = 1 here; "
              "the tied gradient is under 1 ms on NVLink); the power limit's control window across an instruction's "
              "neighbours; the host's issue of one instruction overlapping the previous; activation recomputation. "
              "gpt3-175b's micro-batch memory is not checked against the GPU's.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny pipeline into a temporary folder")
    parser.add_argument("--only", default=None, help="run only the configurations whose label contains this")
    parser.add_argument("--report-only", action="store_true",
                        help="write report.md again from results.json, measuring nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        docs = json.loads((OUT / "results.json").read_text())
        atomic_write_text(OUT / "report.md", report(docs, docs[0].get("command", "python experiments/pipeline_levels.py"),
                                                    docs[0].get("total_s", 0.0)))  # fmt: skip
        return 0
    out = Path(tempfile.mkdtemp(prefix="pipeline-levels-")) if args.quick else OUT
    out.mkdir(parents=True, exist_ok=True)
    storage = open_storage(f"sqlite:///{out / 'studies.db'}")
    configs = QUICK if args.quick else CONFIGS
    if args.only:
        configs = tuple(c for c in configs if args.only in c[0])
    started = time.perf_counter()
    with optuna_logging(False):
        docs = [run(c, storage, quick=args.quick) for c in configs]
    total = time.perf_counter() - started
    command = "python experiments/pipeline_levels.py" + (" --quick" if args.quick else "") + \
        (f" --only '{args.only}'" if args.only else "")
    for d in docs:
        d.update(command=command, total_s=total)
    atomic_write_text(out / "results.json", json.dumps(docs, indent=1) + "\n")
    atomic_write_text(out / "report.md", report(docs, command, total))
    print(f"wrote {out / 'report.md'} and results.json in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
