"""``freqopt measure -- CMD [ARGS...]``: run a command in one measurement window (freqopt.measure.monitor) and
report its time and energy per GPU, CPU package and DRAM. It imports neither PyTorch nor Optuna, so a bad argument
is refused at once."""

from __future__ import annotations

import contextlib
import sys

import click

from freqopt.cli import check_json_path, cli, write_json


@cli.command(short_help="Measure a command's time and GPU, CPU and DRAM energy.",
             context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})  # fmt: skip
@click.option("--gpus", default=None,
              help="GPUs to measure, by index (CUDA_VISIBLE_DEVICES order), e.g. 0,1; none: time and CPU energy "
                   "only, without NVML; default: every visible GPU.")  # fmt: skip
@click.option("--json", "json_path", default=None, help="Also write the measurement as JSON to this file.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def measure(gpus, json_path, command) -> None:
    """Run COMMAND (after --) and measure it: wall-clock time, each GPU's energy (NVML's energy counter), and each
    CPU package's and its DRAM's energy where Linux's RAPL counters are readable (/sys/class/powercap). The table
    goes to stderr, as time(1)'s does, leaving stdout to the command; freqopt exits with the command's exit status.
    Ctrl-C reaches the command, and what ran until it stopped is still reported.

        freqopt measure --gpus 0 --json run.json -- python train.py --epochs 1
    """
    from freqopt.measure.monitor import measure_command

    check_json_path(json_path)
    with _warnings_as_lines():
        run = measure_command(list(command), gpu_indices=gpus)
    _render(run)
    if run.interrupted:
        click.echo(f"freqopt: the command was interrupted (signal {', '.join(map(str, run.interrupted))}); measured "
                   "until it ended", err=True)  # fmt: skip
    write_json(json_path, run.summary())
    if run.exit_code:
        raise click.exceptions.Exit(run.exit_code)


@contextlib.contextmanager
def _warnings_as_lines():
    """Within: a RAPLWarning is shown at once (before the command runs) as one "freqopt: warning: ..." line."""
    import warnings

    from freqopt.measure.monitor import RAPLWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning
        warnings.simplefilter("always", RAPLWarning)

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, RAPLWarning):
                click.echo(f"freqopt: warning: {message}", err=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _render(run) -> None:
    from rich.console import Console
    from rich.table import Table

    m = run.measurement
    table = Table("measured", "value", title=f"{' '.join(run.command)[:100]} (exit status {run.exit_code})")
    table.add_row("time", f"{m.time_s:,.3f} s")
    for i, energy in m.gpu_energy_j.items():
        table.add_row(f"GPU {i} ({run.gpu_names.get(i, '?')})", f"{energy:,.1f} J")
    if m.cpu_energy_j is None:
        table.add_row("CPU packages, DRAM", "not measured (see the warning above)")
    else:
        for package, energy in m.cpu_energy_j.items():
            table.add_row(f"CPU package {package}", f"{energy:,.1f} J")
        if m.dram_energy_j is None:
            table.add_row("DRAM", "not reported by this CPU's RAPL")
        else:
            for package, energy in m.dram_energy_j.items():
                table.add_row(f"DRAM of package {package}", f"{energy:,.1f} J")
    if m.gpu_energy_j or m.cpu_energy_j is not None:
        table.add_row("total energy (the parts above)", f"{m.total_energy_j:,.1f} J", style="bold")
    else:
        table.add_row("total energy", "nothing measured: no GPU asked for and no RAPL counters", style="bold")
    console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)
    console.print(table)
