"""``freqopt measure -- CMD [ARGS...]``: run a command in one measurement window (freqopt.measure.monitor) and
report its time and energy per GPU, CPU package and DRAM, each with what it covers. It imports neither PyTorch
nor Optuna, so a bad argument is refused at once."""

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
@click.option("--backend", default="nvml", show_default=True,
              help="The GPUs' library: nvml (NVIDIA) or amdsmi (AMD GPUs, HIP_VISIBLE_DEVICES order).")
@click.option("--json", "json_path", default=None, help="Also write the measurement as JSON to this file.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def measure(gpus, backend, json_path, command) -> None:
    """Run COMMAND (after --) and measure it: wall-clock time, each GPU's energy (NVML's energy counter, or its
    power sampled where it has none), and each CPU package's and its DRAM's energy where Linux's RAPL counters are
    readable (/sys/class/powercap). Each figure is a whole device over every process on it, not COMMAND alone: an
    idle GPU still counts its idle power, a CPU package is the whole socket. The table goes to stderr, as time(1)'s
    does, leaving stdout to the command; freqopt exits with the command's exit status. Ctrl-C reaches the
    command, and what ran until it stopped is still reported.

        freqopt measure --gpus 0 --json run.json -- python train.py --epochs 1
    """
    from freqopt.measure.monitor import measure_command

    check_json_path(json_path)
    with _warnings_as_lines():
        run = measure_command(list(command), gpu_indices=gpus, backend=backend)
    _render(run)
    if run.interrupted:
        click.echo(f"freqopt: the command was interrupted (signal {', '.join(map(str, run.interrupted))}); measured "
                   "until it ended", err=True)  # fmt: skip
    write_json(json_path, run.summary())
    if run.exit_code:
        raise click.exceptions.Exit(run.exit_code)


@contextlib.contextmanager
def _warnings_as_lines():
    """Within: a RAPLWarning (before the command runs) or a ShortWindowWarning (after it) is shown at once as one
    "freqopt: warning: ..." line."""
    import warnings

    from freqopt.measure.monitor import RAPLWarning, ShortWindowWarning

    ours = (RAPLWarning, ShortWindowWarning)
    with warnings.catch_warnings():
        shown = warnings.showwarning
        for category in ours:
            warnings.simplefilter("always", category)

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, ours):
                click.echo(f"freqopt: warning: {message}", err=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _gpu_covers(source: str, backend: str = "nvml") -> str:
    from freqopt.measure.monitor import POWER_SAMPLE_PERIOD_S, POWER_SAMPLES, POWER_X_TIME

    how = {POWER_SAMPLES: f"no energy counter: power sampled every {POWER_SAMPLE_PERIOD_S:g} s, trapezoid rule",
           POWER_X_TIME: "power x time: the run was shorter than the energy counter's update period"}.get(
               source, "AMD SMI energy counter" if backend == "amdsmi" else "NVML energy counter")  # fmt: skip
    return f"the whole board, every process on it ({how})"


def _render(run) -> None:
    """The command and its exit status on one line, then a table of each figure and what it covers, to stderr.
    A terminal's table fits its width (the "covers" column wraps, the figures never); a pipe or a file gets it
    200 columns wide, whatever COLUMNS or TERM say."""
    from rich.console import Console
    from rich.table import Table

    m = run.measurement
    command = " ".join(run.command)
    command = command if len(command) <= 100 else command[:99] + "…"
    click.echo(f"freqopt: {command} (exit status {run.exit_code})", err=True)
    table = Table()
    table.add_column("measured", no_wrap=True)
    table.add_column("value", no_wrap=True, justify="right")
    table.add_column("covers")
    table.add_row("time", f"{m.time_s:,.3f} s", "wall clock, from start to exit")
    for i, energy in m.gpu_energy_j.items():
        table.add_row(f"GPU {i} ({run.gpu_names.get(i, '?')})", f"{energy:,.1f} J",
                      _gpu_covers(m.gpu_energy_source.get(i, ""), run.backend))  # fmt: skip
    if len(m.gpu_energy_j) > 1:
        table.add_row("GPUs together", f"{m.gpu_total_energy_j:,.1f} J",
                      "every GPU above, idle ones too (--gpus measures fewer)")  # fmt: skip
    if m.cpu_energy_j is None:
        table.add_row("CPU packages, DRAM", "not measured", "see the warning above")
    else:
        for package, energy in m.cpu_energy_j.items():
            table.add_row(f"CPU package {package}", f"{energy:,.1f} J",
                          "the whole socket (cores, caches, uncore), every process on the host (RAPL)")  # fmt: skip
        if m.dram_energy_j is None:
            table.add_row("DRAM", "not measured", "this CPU's RAPL reports no DRAM domain")
        else:
            for package, energy in m.dram_energy_j.items():
                table.add_row(f"DRAM of package {package}", f"{energy:,.1f} J",
                              f"the DRAM on package {package}, every process on the host (RAPL)")  # fmt: skip
    if m.gpu_energy_j or m.cpu_energy_j is not None:
        table.add_row("total energy", f"{m.total_energy_j:,.1f} J",
                      "the GPUs, CPU packages and DRAM above, added: every process on them, not the command alone",
                      style="bold")  # fmt: skip
    else:
        table.add_row("total energy", "nothing measured", "no GPU asked for and no RAPL counters", style="bold")
    # Width and height both given: rich then never falls back to 80 columns (as it does for TERM=dumb).
    console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200, height=25)
    console.print(table)
