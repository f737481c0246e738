"""``freqopt plan``: one SM clock per pipeline instruction from a measured stage profile (freqopt.pipeline.planner);
``freqopt stage-profile``: measure that profile (freqopt.measure.stage_profile)."""

from __future__ import annotations

import os
import sys

import click

from freqopt.cli import (absolute_path, check_json_path, check_names_first, cli, model_options, parse_slowdown,
                         stdout_console, write_json)  # fmt: skip
from freqopt.cli.search import clock_runs


@cli.command(short_help="Plan a clock per pipeline instruction from a stage profile.")
@click.option("--stage-profile", "stage_profile", required=True,
              help="CSV with columns stage, instruction, frequency, time, energy (Perseus's and Zeus's format).")
@click.option("--stages", type=int, default=None,
              help="Pipeline GPUs (default: the profile's stages over the schedule's model stages per GPU; must match).")
@click.option("--micro-batches", type=int, required=True, help="Micro-batches per iteration.")
@click.option("--schedule", default="1f1b", show_default=True,
              help="Pipeline schedule: 1f1b (DeepSpeed's), or torch.distributed.pipelining's gpipe, interleaved-1f1b, "
                   "looped-bfs, interleaved-zb, zb-v, dualpipe-v (their own per-GPU orders). With several model "
                   "stages per GPU (interleaved, looped: --virtual-stages, default 2; V-shaped: 2) the profile's "
                   "stages are the model's; the zero-bubble ones need backward_input and backward_weight rows.")
@click.option("--virtual-stages", type=int, default=None,
              help="Model stages per GPU for interleaved-1f1b, looped-bfs and interleaved-zb (default 2).")
@click.option("--max-slowdown", default="1%", show_default=True,
              help="Allowed slowdown of the iteration against every instruction at its fastest clock: 1% or 0.01.")
@click.option("--gpu", default=None,
              help="The profiled GPU (freqopt gpus), for its measured blocking power (a100-sxm4-80gb 83.64 W, "
                   "a40 70.38 W: Perseus's measurements) and its clock-switch latency and NVML call time, with which "
                   "the plan is also priced as a runtime realizes it.")
@click.option("--blocking-power-w", type=float, default=None,
              help="Power (W) a GPU draws while it waits on its pipeline neighbours; required unless --gpu has a "
                   "measured figure.")
@click.option("--switch-latency-ms", default=None, type=click.FloatRange(min=0.0),
              help="Clock-switch latency (ms) to price the plan with, in place of the --gpu file's clock_switch_ms "
                   "(0: switches land at once, as the plan assumes).")
@click.option("--frontier-points", type=int, default=None,
              help="With --json: this many evenly spaced deadlines instead of the whole time-energy frontier (every "
                   "distinct plan from the fastest to the least-energy one).")
@click.option("--node-limit", type=int, default=None,
              help="Branch-and-bound nodes of the plan's MILP solve (default 100; 0 keeps the heuristic's plan): a "
                   "limit of work, so the plan is the same on any machine. The frontier's points run no MILP.")
@click.option("--time-limit-s", type=float, default=None,
              help="Also a wall-clock limit (s) of the plan's MILP solve (default none): a plan it cuts short depends "
                   "on the machine's speed and load, and says so.")
@click.option("--json", "json_path", default=None,
              help="Also write the plan and the frontier (each point with its clocks) as JSON to this file.")
def plan(stage_profile, stages, micro_batches, schedule, virtual_stages, max_slowdown, gpu, blocking_power_w,
         switch_latency_ms, frontier_points, node_limit, time_limit_s, json_path) -> None:  # fmt: skip
    """The least-energy SM clock for every forward and backward of every micro-batch on every stage, with the
    iteration (the critical path of the schedule) at most --max-slowdown slower than at the fastest clocks.

    With --json, also the whole time-energy frontier: every distinct plan from the fastest to the least-energy one,
    each with its clocks and a proven lower bound.

    The plan assumes, as Perseus does, that a clock holds from the instruction it is set for. With --gpu or
    --switch-latency-ms it is also priced as a runtime realizes it (each clock asked for one switch latency ahead,
    one NVML call at a time), beside the best plan with one clock per GPU, which never switches. Ctrl-C stops the
    planner within a second and writes nothing."""
    from rich.table import Table

    from freqopt.pipeline.plan_checks import check_plan_arguments

    # The library's checks that need no solver, before the planner's modules (and PyTorch) load.
    checked = check_plan_arguments(stage_profile, micro_batches, max_slowdown=max_slowdown,
                                   n_points=frontier_points if json_path else None, stages=stages,
                                   blocking_power_w=blocking_power_w, gpu=gpu, schedule=schedule, node_limit=node_limit,
                                   time_limit_s=time_limit_s, virtual_stages=virtual_stages)  # fmt: skip
    check_json_path(json_path)
    from rich.console import Console

    # Each step said on stderr as it starts, under a spinner with the time elapsed on a terminal: the planner's
    # build and solves take seconds to minutes, which no step of it should spend silent.
    err = Console(stderr=True)
    status = err.status("loading the planner")
    status.start()

    def step(text: str) -> None:
        err.print(text)
        status.update(text)

    try:  # Ctrl-C anywhere from loading the planner to the last solve writes nothing
        from freqopt.pipeline.planner import PipelinePlanner

        step(f"building the plan's problem: {micro_batches} micro-batches ({schedule}) on the profile's stages")
        planner = PipelinePlanner(checked.profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w,
                                  gpu=gpu, schedule=schedule, node_limit=node_limit, time_limit_s=time_limit_s,
                                  virtual_stages=virtual_stages)  # fmt: skip
        step(f"planning the clocks of {planner.dag.n:,} instructions within {max_slowdown} (MILP, at most "
             f"{planner.node_limit} branch-and-bound nodes)")
        result = planner.plan(max_slowdown=max_slowdown)
        realized = stage_plan = None
        if gpu is not None or switch_latency_ms is not None:
            step("pricing the plan as a runtime realizes it, and planning one clock per GPU")
            realized = planner.realized(result, None if switch_latency_ms is None else switch_latency_ms / 1e3)
            stage_plan = planner.plan_stage_clocks(result.deadline_s)
        if json_path:
            step("the time-energy frontier" + (f" ({frontier_points} points)" if frontier_points else ""))
        frontier = planner.frontier(frontier_points) if json_path else None
    except KeyboardInterrupt:
        status.stop()
        # HiGHS's threads may still be stopping (a MIP notices its cancellation within about a second), and the
        # process would wait for them at exit; nothing is held or half-written here, so leave at once.
        click.echo("freqopt: interrupted; nothing written", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    status.stop()
    if json_path:
        write_json(json_path, {
            "stages": planner.stages, "gpus": planner.gpus, "micro_batches": micro_batches, "schedule": schedule,
            "blocking_power_w": planner.blocking_power_w, "max_slowdown": parse_slowdown(max_slowdown, allow_zero=True),
            "frontier": [{"time_s": p.time_s, "energy_j": p.energy_j, "lower_bound_j": p.lower_bound_j,
                          "deadline_s": p.deadline_s, "sm_clock_mhz": _by_stage(planner.dag, p.sm_clock_mhz)}
                         for p in frontier],
            "frontier_proven_gap": frontier.proven_gap, "frontier_solves": frontier.solves,
            "frontier_solve_s": frontier.solve_s,
            "plan": {"time_s": result.time_s, "energy_j": result.energy_j, "lower_bound_j": result.lower_bound_j,
                     "default_time_s": result.default_time_s, "default_energy_j": result.default_energy_j,
                     "milp_stopped_by": result.milp_stopped_by, "node_limit": planner.node_limit,
                     "time_limit_s": planner.time_limit_s, "stages": result.stage_clocks()},
            "realized": None if realized is None else {
                "switch_s": realized.switch_s, "nvml_call_s": realized.call_s, "time_s": realized.time_s,
                "energy_j": realized.energy_j, "switches_per_iteration": realized.switches,
                "dropped_per_iteration": realized.dropped, "max_switches_per_s": realized.max_switches_per_s,
                "requests_mhz": _by_stage(planner.dag, realized.requests_mhz)},
            "stage_clocks_plan": None if stage_plan is None else {
                "time_s": stage_plan.time_s, "energy_j": stage_plan.energy_j, "lower_bound_j": stage_plan.lower_bound_j,
                "sm_clock_mhz": _by_stage(planner.dag, stage_plan.sm_clock_mhz)},
        })  # fmt: skip
    table = Table("", "iteration time (s)", "energy (J)", "saved (%)",
                  title=f"{planner.stages} stages{_on_gpus(planner)} x {micro_batches} micro-batches ({schedule}), "
                        f"deadline {result.deadline_s:.4f} s, waiting GPUs at {planner.blocking_power_w:g} W")  # fmt: skip
    table.add_row("fastest clocks", f"{result.default_time_s:.4f}", f"{result.default_energy_j:,.1f}", "0.00")
    saved = lambda energy_j: f"{100 * (1 - energy_j / result.default_energy_j):.2f}"  # noqa: E731
    table.add_row("plan" if realized is None else "plan, switches landing at once", f"{result.time_s:.4f}",
                  f"{result.energy_j:,.1f}", saved(result.energy_j))
    if realized is not None:
        table.add_row(f"plan, realized ({1e3 * realized.switch_s:g} ms switches, {1e3 * realized.call_s:g} ms NVML "
                      "calls)", f"{realized.time_s:.4f}", f"{realized.energy_j:,.1f}", saved(realized.energy_j))
        table.add_row("one clock per GPU (no switches)", f"{stage_plan.time_s:.4f}", f"{stage_plan.energy_j:,.1f}",
                      saved(stage_plan.energy_j))
    console = stdout_console()
    console.print(table)
    console.print(f"optimal within {100 * result.gap:.3f} % (proven lower bound {result.lower_bound_j:,.1f} J)"
                  + _stopped(result, planner))
    console.print(f"the plan's clocks (MHz), in each stage's {schedule} order:", soft_wrap=True)
    for stage in result.stage_clocks():
        console.print(f"  stage {stage['stage']}: " + clock_runs([i["sm_clock_mhz"] for i in stage["instructions"]]),
                      soft_wrap=True)  # fmt: skip
    if realized is None:
        console.print("switches priced as landing at once (as Perseus plans); give --gpu or --switch-latency-ms to "
                      "price the GPU's switch latency")
    else:
        console.print(_realized_note(realized, stage_plan, result))
    if frontier is not None:
        console.print(f"frontier: {len(frontier)} plans from {frontier[0].time_s:.4f} s to {frontier[-1].time_s:.4f} s "
                      f"({frontier[0].energy_j:,.1f} to {frontier[-1].energy_j:,.1f} J), each within "
                      f"{100 * frontier.proven_gap:.2f} % of the least energy at its time (proven); "
                      f"{frontier.solves} deadlines solved in {frontier.solve_s:.1f} s")  # fmt: skip


def _stopped(result, planner) -> str:
    """What cut the plan's MILP short, if anything: its node limit (the same on any machine), or its time limit (the
    plan then depends on the machine's speed and load)."""
    if result.milp_stopped_by == "node limit":
        return f"; the MILP stopped at its {planner.node_limit:,}-node limit"
    if result.milp_stopped_by == "time limit":
        return (f"; the MILP stopped at its {planner.time_limit_s:g} s time limit, so this plan depends on the "
                "machine's speed and load (--node-limit alone gives the same plan on any machine)")
    return ""


def _realized_note(realized, stage_plan, result) -> str:
    """What the realized row means: the switches it asks for, whether it keeps the deadline, and whether one clock per
    GPU would cost less."""
    note = (f"realized: {realized.switches} switches an iteration ({realized.max_switches_per_s:.1f} a second on the "
            "busiest GPU), each clock asked for one switch latency ahead so that no instruction runs slower than "
            "planned")
    if realized.time_s > result.deadline_s * (1 + 1e-9):
        note += f"; it misses the deadline by {100 * (realized.time_s / result.deadline_s - 1):.2f} %"
    if stage_plan.energy_j < realized.energy_j:
        note += ("; one clock per GPU costs less on this GPU (freqopt.pipeline.planner.PipelinePlanner."
                 "plan_stage_clocks)")
    return note


def _on_gpus(planner) -> str:
    """' on G GPUs' where the schedule runs several model stages per GPU, else ""."""
    return f" on {planner.gpus} GPUs" if planner.gpus != planner.stages else ""


def _by_stage(dag, clocks) -> list[list[int]]:
    """Clocks (DAG order) as one list per stage, each in the order the stage runs its instructions."""
    out: list[list[int]] = [[] for _ in range(dag.stages)]
    for inst, clock in zip(dag.instructions, clocks):
        out[inst.stage].append(int(clock))
    return out


@cli.command("stage-profile", short_help="Measure each pipeline stage's time and energy per SM clock.")
@click.option("--model", required=True,
              help="Model name (see `freqopt models`): a built-in GPT-3 or BERT; hf:PATH (a Hugging Face config.json) "
                   "is refused, having no pipeline layer list yet.")
@click.option("--out", required=True,
              help="The CSV to write (stage, instruction, frequency, time, energy: what plan --stage-profile and "
                   "Perseus read), with OUT.meta.json beside it naming the run; where it exists from a run of the "
                   "same arguments, that run is resumed.")
@click.option("--gpu", default=None,
              help="GPU type (see `freqopt gpus`): the simulated GPU's (default h100-sxm); with --backend nvml the "
                   "real GPU must be of this type.")
@click.option("--backend", default="sim", show_default=True,
              help="sim (the simulated GPU) or nvml (a real GPU: clocks locked in turn and restored; needs root or "
                   "CAP_SYS_ADMIN).")
@click.option("--read-only", is_flag=True,
              help="nvml: refused, with what to do instead: a stage profile is measured at locked clocks.")
@click.option("--sm-clocks", "sm_clocks_mhz", default=None,
              help="SM clocks (MHz) to measure at, comma-separated (1980,1500,1200); default every supported one.")
@click.option("--sm-clock-step", "sm_clock_step_mhz", type=int, default=None,
              help="Thin the clocks: the highest, then each at least this many MHz below the last one kept.")
@click.option("--repeats", default=1, show_default=True, type=int,
              help="Readings averaged per stage, instruction and clock.")
@click.option("--schedule", default="1f1b", show_default=True,
              help="The pipeline schedule the stages run (as plan's --schedule): with several model stages per GPU "
                   "the model's stages are profiled, and the zero-bubble ones also backward_input and "
                   "backward_weight.")
@click.option("--virtual-stages", type=int, default=None,
              help="Model stages per GPU for interleaved-1f1b, looped-bfs and interleaved-zb (default 2).")
@click.option("--partition-method", default="parameters", show_default=True,
              help="How the layers split into stages: parameters (DeepSpeed's default), uniform or type:REGEX.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the simulated GPU's noise.")
@click.option("--device", type=int, default=None,
              help="nvml: the GPU to measure on, an index among the visible ones (default LOCAL_RANK, else 0).")
@click.option("--micro-batches", type=int, default=None,
              help="Micro-batches per iteration, for the plan command printed at the end (default 2 x pp).")
@model_options
def stage_profile(model, out, gpu, backend, read_only, sm_clocks_mhz, sm_clock_step_mhz, repeats, schedule,
                  virtual_stages, partition_method, seed, device, micro_batches, micro_batch_size, seq_len, n_heads,
                  vocab_multiple, layout) -> None:  # fmt: skip
    """Measure the stage profile that `freqopt plan --stage-profile` reads: each pipeline stage's forward and
    backward time (s) and energy (J) at each SM clock, on the simulated GPU or a real one (--backend nvml), written
    to --out after each clock. Ctrl-C keeps the finished clocks; the same command resumes. Needs --layout pp=N."""
    check_names_first(model, gpu)
    from freqopt.errors import check_positive_int
    from freqopt.measure.stage_profile import check_stage_profile_arguments

    options = dict(out=out, layout=layout, gpu=gpu, backend=backend, sm_clocks_mhz=sm_clocks_mhz,
                   sm_clock_step_mhz=sm_clock_step_mhz, repeats=repeats, read_only=read_only, schedule=schedule,
                   virtual_stages=virtual_stages, partition_method=partition_method,
                   micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads, vocab_multiple=vocab_multiple,
                   seed=seed, device=device)  # fmt: skip
    checked = check_stage_profile_arguments(model, **options)  # before PyTorch is imported
    check_positive_int("micro_batches", micro_batches, optional=True)
    _stage_profile_run(model, options, micro_batches or 2 * checked.layout.pp)


def _stage_profile_run(model, options: dict, micro_batches: int) -> None:
    """``freqopt stage-profile`` once its arguments are checked: the measurement with a progress bar, then the
    profile's figures and the plan command to run next."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from freqopt.measure.stage_profile import measure_stage_profile

    console = Console(stderr=True)
    started = time.monotonic()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)  # fmt: skip
    # Tracing (seconds to a minute for the largest models) shows as a running clock, then each row measured.
    task = progress.add_task(f"tracing {model}'s {options['layout']} stages ({options['partition_method']} partition)",
                             total=None)  # fmt: skip
    measuring = []

    def on_progress(done: int, total: int, what: str) -> None:
        if not measuring:
            measuring.append(total)
            kept = f"; {done} of them read back from {options['out']}" if done else ""
            console.print(f"measuring {total} rows (stage x instruction x SM clock){kept}", soft_wrap=True,
                          markup=False)  # fmt: skip
            progress.update(task, total=total, completed=done, description="measuring")
        elif what:
            progress.update(task, completed=done, description=what)

    progress.start()
    try:
        run = measure_stage_profile(model, **options, on_progress=on_progress)
    except KeyboardInterrupt:
        from pathlib import Path

        kept = Path(options["out"]).exists()
        raise KeyboardInterrupt(f"the finished clocks are kept in {absolute_path(options['out'])}; run the same "
                                "command to resume" if kept else "nothing written") from None  # fmt: skip
    finally:
        progress.stop()
    out = stdout_console()
    out.print(_stage_profile_table(run))
    console.print(f"wrote {absolute_path(run.path)}: {run.stages} stages x {len(run.kinds)} instructions x "
                  f"{len(run.sm_clocks_mhz)} SM clocks on {run.gpu} ({'simulated' if run.backend == 'sim' else 'NVML'}"
                  f"); {run.n_measured} rows measured ({run.cost_gpu_s:,.0f} GPU-s), {run.n_reused} read back, in "
                  f"{time.monotonic() - started:.0f} s", soft_wrap=True, markup=False)  # fmt: skip
    console.print(f"blocking power {run.blocking_power_w:.5g} W: {run.blocking_power_source}", soft_wrap=True,
                  markup=False)  # fmt: skip
    console.print(f"plan it with ({micro_batches} micro-batches per iteration; give yours): "
                  + _plan_command(run, micro_batches), soft_wrap=True, markup=False)  # fmt: skip


def _plan_command(run, micro_batches: int) -> str:
    """The ``freqopt plan`` command that plans ``run``'s profile as it was measured (StageProfileRun.plan_options)."""
    import shlex

    options = run.plan_options()
    words = ["freqopt", "plan", "--stage-profile", absolute_path(run.path), "--micro-batches", str(micro_batches),
             "--blocking-power-w", f"{options['blocking_power_w']:.5g}"]  # fmt: skip
    if "gpu" in options:
        words += ["--gpu", options["gpu"]]
    if options["schedule"] != "1f1b":
        words += ["--schedule", options["schedule"]]
    if "virtual_stages" in options:
        words += ["--virtual-stages", str(options["virtual_stages"])]
    return shlex.join(words)


def _stage_profile_table(run):
    """Per stage and instruction: its time and energy at the highest clock measured, and the clock of least energy
    with its time and energy (the planner's cheapest option, before it weighs the waiting GPUs)."""
    from rich.table import Table

    table = Table("stage", "instruction", "fastest clock (MHz)", "time (ms)", "energy (J)", "least-energy clock (MHz)",
                  "time (ms)", "energy (J)", title=f"stage profile of {run.path.name}")  # fmt: skip
    for (stage, kind), o in sorted(run.profile.options.items(), key=lambda item: (item[0][0], run.kinds.index(
            item[0][1]) if item[0][1] in run.kinds else len(run.kinds))):  # fmt: skip
        top, low = int(o.sm_clock_mhz.argmax()), int(o.energy_j.argmin())
        table.add_row(str(stage), kind, str(o.sm_clock_mhz[top]), f"{1e3 * o.time_s[top]:.3f}",
                      f"{o.energy_j[top]:.4g}", str(o.sm_clock_mhz[low]), f"{1e3 * o.time_s[low]:.3f}",
                      f"{o.energy_j[low]:.4g}")  # fmt: skip
    return table
