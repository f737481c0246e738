"""The freqopt command line. It parses arguments, calls the library and renders what it returns; errors print as
one line and exit non-zero (``main``). The library owns every check.

The commands live by group: freqopt.cli.search (search, worker), freqopt.cli.train (train, profile) and
freqopt.cli.tools (models, gpus, transfer, benchmark, powercap, statement, reset), freqopt.cli.plan (plan),
freqopt.cli.measure (measure), freqopt.cli.apply (apply), freqopt.cli.serve (serve-search).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from freqopt.budget import parse_slowdown
from freqopt.errors import FreqoptError

__all__ = ["main", "cli", "parse_slowdown", "FLAGS", "check_names_first"]

# The library's argument names (FreqoptError.argument) -> the flags of this command line, so that an error speaks
# of what the user typed (``--trials``, not ``n_trials``). Every command gives each of these the same meaning.
FLAGS = {
    "max_slowdown": "--max-slowdown", "granularity": "--granularity", "n_trials": "--trials", "n_jobs": "--jobs",
    "seed": "--seed", "out": "--out", "micro_batch_size": "--micro-batch-size", "seq_len": "--seq-len",
    "n_heads": "--n-heads", "vocab_multiple": "--vocab-multiple", "layout": "--layout", "wait_s": "--wait-s",
    "repeats": "--repeats", "caps": "--caps", "mode": "--mode", "host_gap_ms": "--host-gap-ms", "steps": "--steps",
    "device": "--device", "compare": "--compare", "read_only": "--read-only", "iterations": "--iterations",
    "gpus": "--gpus", "pue": "--pue", "grid_gco2_per_kwh": "--grid-gco2-per-kwh",
    "switch_latency_ms": "--switch-latency-ms", "sm_clock_mhz": "--sm-clock", "mem_clock_mhz": "--mem-clock",
    "power_limit_w": "--power-limit", "stage_profile": "--stage-profile", "stages": "--stages",
    "micro_batches": "--micro-batches", "schedule": "--schedule", "blocking_power_w": "--blocking-power-w",
    "n_points": "--frontier-points", "partition_method": "--partition-method", "backend": "--backend",
    "gpu": "--gpu", "host": "--host", "time_limit_s": "--time-limit-s", "node_limit": "--node-limit",
    "confidence": "--confidence",
    "virtual_stages": "--virtual-stages", "study": "--study", "gpu_indices": "--gpus",
    "sm_clocks_mhz": "--sm-clocks", "sm_clock_step_mhz": "--sm-clock-step",
    "small_step": "--small-step", "batch_sizes": "--batch-sizes", "prompt_len": "--prompt-len",
    "output_len": "--output-len", "max_itl_slowdown": "--max-itl-slowdown", "max_ttft_slowdown": "--max-ttft-slowdown",
    "model": "--model", "tp": "--tp",
}  # fmt: skip


@contextlib.contextmanager
def memory_warnings_as_lines():
    """Within: a GPUMemoryWarning is shown at once as one "freqopt: warning: ..." line on stderr (before a long
    search, not after it); other warnings as Python shows them."""
    import warnings

    from freqopt.errors import GPUMemoryWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, GPUMemoryWarning):
            click.echo(f"freqopt: warning: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", GPUMemoryWarning)
        warnings.showwarning = show
        yield


def check_names_first(model: str | None = None, gpu: str | None = None) -> None:
    """The library's name checks (freqopt.workload.model_names.check_model_name, freqopt.gpu.specs.get_gpu), run
    before a command imports the modules that load PyTorch, so that a mistyped name is refused at once; the library
    checks them again where it resolves them."""
    if model is not None:
        from freqopt.workload.model_names import check_model_name

        check_model_name(model)
    if gpu is not None:
        from freqopt.gpu.specs import get_gpu

        get_gpu(gpu)


def check_json_path(json_path: str | None) -> None:
    """Fail before any work when ``--json PATH`` cannot be written (the flag is the command line's own)."""
    if json_path:
        from freqopt.api import check_writable_file

        check_writable_file(Path(json_path), argument="--json")


def write_json(json_path: str | None, doc) -> None:
    """Write ``doc`` as indented JSON to ``json_path`` (atomically), if one was given."""
    if json_path:
        import json

        from freqopt.files import atomic_write_text

        atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")


def absolute_path(path) -> str:
    """``path`` made absolute (not resolving links), for a hint the user may paste in another folder."""
    return str(Path(path).expanduser().absolute())


def absolute_model(model: str) -> str:
    """A --model value that works from any folder: ``hf:PATH`` with PATH absolute; a built-in name as it is."""
    from freqopt.workload.models.hf import HF_PREFIX, is_hf_model

    return HF_PREFIX + absolute_path(model[len(HF_PREFIX):]) if is_hf_model(model) else model


def absolute_storage(url: str | None) -> str | None:
    """An Optuna storage URL that works from any folder: a relative SQLite file or journal:PATH made absolute."""
    if url is None:
        return None
    if url.startswith("journal:"):
        path = url.removeprefix("journal:").removeprefix("//")
        return url if not path or Path(path).is_absolute() else "journal:" + absolute_path(path)
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return url
    database = parsed.database
    if not parsed.drivername.startswith("sqlite") or not database or database == ":memory:" or \
            database.startswith("file:") or Path(database).is_absolute():  # fmt: skip
        return url
    return parsed.set(database=absolute_path(database)).render_as_string(hide_password=False)


def stdout_console():
    """A rich console for tables: the terminal's width, or 200 columns when output goes to a file or pipe."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def model_options(f):
    """The get_workload overrides every command on a model takes."""
    f = click.option("--layout", default=None,
                     help="Parallel layout dp=N,tp=M,pp=P (data-, tensor- and pipeline-parallel degrees; only some "
                          "commands take pp > 1); default one GPU.")(f)
    f = click.option("--vocab-multiple", type=int, default=None,
                     help="Pad the vocabulary to a multiple of this (default 128 for GPT-3, 1 for BERT; 1: none).")(f)
    f = click.option("--n-heads", type=int, default=None, help="Override the number of attention heads.")(f)
    f = click.option("--seq-len", type=int, default=None, help="Override the sequence length (tokens).")(f)
    f = click.option("--micro-batch-size", type=int, default=None, help="Sequences per GPU per step (default 4).")(f)
    return f


def verbose_option(f):
    """``--verbose``: Optuna's own INFO log lines, which the library keeps quiet by default."""
    return click.option("--verbose", "-v", is_flag=True, help="Show Optuna's own log lines (a line per study).")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="freqopt")
@click.option("--daemon", "daemon", default=None, metavar="SOCKET",
              help="Set GPUs through freqoptd at this socket (or tcp://host:port), for users without root; the same "
                   "as FREQOPT_DAEMON=SOCKET, which the ranks and commands freqopt starts inherit.")  # fmt: skip
def cli(daemon) -> None:
    """Find GPU clock settings that cut training energy within a slowdown budget."""
    if daemon is not None:
        import os

        os.environ["FREQOPT_DAEMON"] = daemon  # read where GPUs are opened (freqopt.gpu.nvml.open_devices)


def _freeze_at_exit() -> None:
    """At interpreter exit, move every object to gc's permanent generation (gc.freeze) before Python's final
    collections, which then skip them: the memory goes back to the operating system with the process. After a
    search those collections walked millions of objects (PyTorch's, Optuna's studies) for over a second of the
    command's time. Registered once (atexit runs it after the handlers registered after it)."""
    import atexit
    import gc

    if not getattr(_freeze_at_exit, "registered", False):
        atexit.register(gc.freeze)
        _freeze_at_exit.registered = True


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI; print freqopt and usage errors as one line and return non-zero."""
    _freeze_at_exit()
    try:
        # A command that ends with click.exceptions.Exit(code) (train, measure: the child's exit status) returns it
        code = cli.main(args=argv, prog_name="freqopt", standalone_mode=False)
    except FreqoptError as e:
        message = e.naming(FLAGS[e.argument]) if e.argument in FLAGS else str(e)
        click.echo(f"freqopt: error: {message}", err=True)
        return e.exit_code
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else str(e), err=True)
        return 2
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "freqopt"
        click.echo(f"freqopt: error: {e.format_message()} (see `{cmd} --help`)", err=True)
        return 2
    except click.Abort:
        click.echo("freqopt: interrupted", err=True)
        return 130
    except KeyboardInterrupt as e:
        click.echo(f"freqopt: interrupted; {e or 'finished studies are kept in the storage'}", err=True)
        return 130
    return code if isinstance(code, int) else 0


# The command modules register their commands on ``cli`` when imported (after it exists).
from freqopt.cli import apply, measure, plan, search, serve, tools, train  # noqa: E402,F401
