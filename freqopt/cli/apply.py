"""``freqopt apply TABLE -- CMD [ARGS...]``: hold a job-level table's setting on the GPUs while a command runs
(freqopt.apply.job). It imports no PyTorch before the table, the command and the GPUs are checked, so a bad
argument is refused at once."""

from __future__ import annotations

import click

from freqopt.cli import cli


@cli.command(short_help="Hold a job-level table's setting while a command runs.",
             context_settings={"ignore_unknown_options": True})  # fmt: skip
@click.argument("table", type=click.Path(dir_okay=False))
@click.option("--gpus", default=None,
              help="GPUs to set, by index (CUDA_VISIBLE_DEVICES order), e.g. 0,1; default: every visible GPU.")
@click.option("--print", "print_only", is_flag=True,
              help="Print the equivalent nvidia-smi lines (and the lines that undo them) instead of running a "
                   "command; changes nothing.")  # fmt: skip
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def apply(table, gpus, print_only, command) -> None:
    """Put the GPUs at TABLE's one setting for the job (its power limit, its locked SM and memory clocks), run
    COMMAND (after --), and restore the GPUs when it ends: on exit, on Ctrl-C or SIGTERM (passed on to the command
    first), and after a SIGKILL of freqopt with `freqopt reset`. freqopt exits with the command's exit status.

    TABLE is a power-cap or iteration-level table, or any table whose units all hold one setting; a table whose
    schedule switches clocks while the job runs is applied by `freqopt train` or freqopt.DVFSRuntime instead.

        freqopt apply gpt3-small-h100-sxm-1pct-power-cap.json --gpus 0 -- python train.py

        freqopt apply gpt3-small-h100-sxm-1pct-iteration.json --print
    """
    from freqopt.apply.job import apply_table, job_setting, nvidia_smi_lines
    from freqopt.tables import load_table

    if print_only and command:
        raise click.UsageError("--print changes nothing and runs no command; drop the command after --")
    loaded = load_table(table)
    if print_only:
        job_setting(loaded)
        for line in nvidia_smi_lines(loaded, gpus):
            click.echo(line)
        click.echo("# to undo:")
        for line in nvidia_smi_lines(loaded, gpus, undo=True):
            click.echo(line)
        return
    code = apply_table(loaded, list(command), gpu_indices=gpus,
                       announce=lambda line: click.echo(f"freqopt: {line}", err=True))  # fmt: skip
    if code:
        raise click.exceptions.Exit(code)
