"""``freqopt plan``: one SM clock per pipeline instruction from a measured stage profile (freqopt.search.pipeline_plan)."""

from __future__ import annotations

import click

from freqopt.cli import check_json_path, cli, parse_slowdown, stdout_console, write_json


@cli.command(short_help="Plan a clock per pipeline instruction from a stage profile.")
@click.option("--stage-profile", "stage_profile", required=True,
              help="CSV with columns stage, instruction, frequency, time, energy (Perseus's and Zeus's format).")
@click.option("--stages", type=int, default=None, help="Pipeline stages (default: the profile's; must match it).")
@click.option("--micro-batches", type=int, required=True, help="Micro-batches per iteration.")
@click.option("--schedule", default="1f1b", show_default=True, help="Pipeline schedule: 1f1b (DeepSpeed's).")
@click.option("--max-slowdown", default="1%", show_default=True,
              help="Allowed slowdown of the iteration against every instruction at its fastest clock: 1% or 0.01.")
@click.option("--blocking-power-w", type=float, default=0.0, show_default=True,
              help="Power (W) a GPU draws while it waits on its pipeline neighbours (Perseus: 83.64 A100, 70.38 A40).")
@click.option("--frontier-points", type=int, default=10, show_default=True,
              help="Deadlines of the time-energy frontier (with --json).")
@click.option("--json", "json_path", default=None, help="Also write the frontier and the plan as JSON to this file.")
def plan(stage_profile, stages, micro_batches, schedule, max_slowdown, blocking_power_w, frontier_points,
         json_path) -> None:  # fmt: skip
    """The least-energy SM clock for every forward and backward of every micro-batch on every stage, with the
    iteration (the critical path of the schedule) at most --max-slowdown slower than at the fastest clocks."""
    from rich.table import Table

    from freqopt.search.pipeline_plan import PipelinePlanner

    check_json_path(json_path)
    planner = PipelinePlanner(stage_profile, micro_batches, stages=stages, blocking_power_w=blocking_power_w,
                              schedule=schedule)  # fmt: skip
    result = planner.plan(max_slowdown=max_slowdown)
    if json_path:
        frontier = planner.frontier(n_points=frontier_points)
        write_json(json_path, {
            "stages": planner.stages, "micro_batches": micro_batches, "schedule": schedule,
            "blocking_power_w": blocking_power_w, "max_slowdown": parse_slowdown(max_slowdown),
            "frontier": [{"time_s": p.time_s, "energy_j": p.energy_j, "lower_bound_j": p.lower_bound_j,
                          "deadline_s": p.deadline_s} for p in frontier],
            "plan": {"time_s": result.time_s, "energy_j": result.energy_j, "lower_bound_j": result.lower_bound_j,
                     "default_time_s": result.default_time_s, "default_energy_j": result.default_energy_j,
                     "stages": result.stage_clocks()},
        })  # fmt: skip
    table = Table("", "iteration time (s)", "energy (J)", "saved (%)",
                  title=f"{planner.stages} stages x {micro_batches} micro-batches ({schedule}), "
                        f"deadline {result.deadline_s:.4f} s")  # fmt: skip
    table.add_row("fastest clocks", f"{result.default_time_s:.4f}", f"{result.default_energy_j:,.1f}", "0.00")
    table.add_row("plan", f"{result.time_s:.4f}", f"{result.energy_j:,.1f}", f"{100 * result.saved:.2f}")
    console = stdout_console()
    console.print(table)
    console.print(f"optimal within {100 * result.gap:.3f} % (proven lower bound {result.lower_bound_j:,.1f} J)")
