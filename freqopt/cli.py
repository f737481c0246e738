"""The freqopt command line. It parses arguments and calls the library; errors print as one line, exit non-zero."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from freqopt.budget import parse_slowdown
from freqopt.errors import FreqoptError, InvalidSettingError, OutputError

__all__ = ["main", "cli", "parse_slowdown"]


def _check_writable_file(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputError(f"--json {path} is a directory; give a file path")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write --json {path}: {parent} is not a writable directory")


def _stdout_console():
    """A rich console for tables: the terminal's width, or 200 columns when output goes to a file or pipe."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _model_options(f):
    f = click.option("--layout", default=None,
                     help="Parallel layout dp=N,tp=M (data- and tensor-parallel degrees); default one GPU.")(f)
    f = click.option("--vocab-multiple", type=int, default=None,
                     help="Pad the vocabulary to a multiple of this (default 128 for GPT-3, 1 for BERT; 1: none).")(f)
    f = click.option("--n-heads", type=int, default=None, help="Override the number of attention heads.")(f)
    f = click.option("--seq-len", type=int, default=None, help="Override the sequence length (tokens).")(f)
    f = click.option("--micro-batch-size", type=int, default=None, help="Sequences per GPU per step (default 4).")(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="freqopt")
def cli() -> None:
    """Find GPU clock settings that cut training energy within a slowdown budget."""


@cli.command()
@click.argument("names", nargs=-1)
@_model_options
def models(names, micro_batch_size, seq_len, n_heads, vocab_multiple, layout) -> None:
    """List the models (or only NAMES, which may include hf:PATH for a Hugging Face config.json), with parameter
    counts computed from the PyTorch modules (per GPU under --layout) and the vocabulary the embedding and output
    layer hold (the tokenizer's in parentheses where padded)."""
    from rich.table import Table

    from freqopt.layout import parse_layout
    from freqopt.models import count_parameters, get_workload, list_models

    parsed = parse_layout(layout)
    columns = ["model", "layers", "d_model", "heads", "seq len", "vocabulary (padded)", "parameters"]
    if not parsed.is_single_gpu:
        columns.append(f"parameters per GPU ({parsed})")
    table = Table(*columns)
    for name in names or list_models():
        w = get_workload(name, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                         vocab_multiple=vocab_multiple)  # fmt: skip
        c = w.config
        vocab = str(c.padded_vocab_size) + (f" ({c.vocab_size})" if c.padded_vocab_size != c.vocab_size else "")
        row = [w.model, str(c.n_layers), str(c.d_model), str(c.n_heads), str(c.seq_len), vocab,
               f"{count_parameters(c) / 1e6:,.1f} M"]  # fmt: skip
        if not parsed.is_single_gpu:
            fits = c.n_heads % parsed.tp == 0 and getattr(c, "n_kv_heads", c.n_heads) % parsed.tp == 0
            row.append(f"{count_parameters(c, parsed.tp) / 1e6:,.1f} M" if fits else f"tp must divide {c.n_heads} heads")
        table.add_row(*row)
    _stdout_console().print(table)


@cli.command()
def gpus() -> None:
    """List the GPU types in search_spaces/."""
    from rich.table import Table

    from freqopt.gpus import DEFAULT_GPU, get_gpu, list_gpus

    table = Table("gpu", "name", "SM clocks (MHz)", "memory clocks (MHz)", "power limit (W)", "BF16 peak (TFLOP/s)")
    for name in list_gpus():
        g = get_gpu(name)
        table.add_row(
            name + (" (default)" if name == DEFAULT_GPU else ""), g.marketing_name,
            f"{g.sm_clocks_mhz[0]}-{g.max_sm_clock_mhz} ({len(g.sm_clocks_mhz)})",
            ", ".join(map(str, g.mem_clocks_mhz)),
            f"{g.power_limit_min_w:g}-{g.power_limit_max_w:g} (default {g.power_limit_default_w:g})",
            f"{g.tensor_peak_flops / 1e12:,.0f}",
        )  # fmt: skip
    _stdout_console().print(table)


@cli.command()
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--max-slowdown", required=True, help="Allowed slowdown: 1% or 0.01.")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--granularity", default="all", show_default=True, help="all, power-cap, iteration, pass or kernel.")
@click.option("--backend", default="sim", show_default=True,
              help="Measurement backend: sim (simulated GPU) or nvml (the first visible GPU; needs root).")
@click.option("--storage", default=None, help="Optuna storage URL; default sqlite:///OUT/freqopt.db.")
@click.option("--out", "out_dir", default="freqopt-out", show_default=True, help="Directory for tables and storage.")
@click.option("--json", "json_path", default=None, help="Also write the results as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of samplers and simulated noise.")
@click.option("--trials", default=None, type=int, help="Trials per tuning unit (default 14, plus 4 per memory clock beyond the first).")
@click.option("--jobs", default=1, show_default=True, type=int,
              help="Processes that run tuning units in parallel (simulated GPU; for real GPUs start a "
                   "`freqopt worker` per GPU).")
@_model_options
def search(model, max_slowdown, gpu, granularity, backend, storage, out_dir, json_path, seed, trials, jobs,
           micro_batch_size, seq_len, n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """Search clock settings for one training iteration and compare granularities.

    A search in a storage other processes can reach is a work queue: `freqopt worker --storage URL --study NAME`
    (NAME is printed at the start) joins it from another process or machine."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from freqopt.api import search as run_search

    if json_path:
        _check_writable_file(Path(json_path))
    console = Console(stderr=True)
    started = time.monotonic()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)  # fmt: skip
    status = console.status(f"tracing one training iteration of {model}")

    def on_start(start) -> None:
        status.stop()
        w = start.trace.workload
        where = "" if w.layout.is_single_gpu else f" ({w.layout}, one rank of {w.layout.world_size})"
        console.print(f"traced {w.model}{where}: {len(start.trace)} kernels, {len(start.trace.kernel_classes())} "
                      f"kernel classes, {start.trace.total_flops / 1e12:.2f} TFLOP per iteration; GPU "
                      f"{start.spec.name}" + (" (simulated)" if start.backend == "sim" else ""))  # fmt: skip
        console.print(f"search {start.study_name}; other processes join it with: freqopt worker --storage "
                      f"{start.storage} --study {start.study_name}", soft_wrap=True)  # fmt: skip
        progress.add_task("searching tuning units", total=start.n_units)
        progress.start()

    def on_unit(granularity: str, done: int, n: int) -> None:
        progress.update(progress.task_ids[0], advance=1, description=f"{granularity}: unit {done}/{n}")

    if console.is_terminal:  # transient there; elsewhere stopping it would leave a blank line before any error
        status.start()
    try:
        result = run_search(model, max_slowdown=max_slowdown, gpu=gpu, granularity=granularity, backend=backend,
                            storage=storage, out=out_dir, seed=seed, n_trials=trials, n_jobs=jobs,
                            micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                            vocab_multiple=vocab_multiple, layout=layout, on_unit=on_unit, on_start=on_start)  # fmt: skip
    finally:
        status.stop()
        if progress.task_ids:  # started (stopping one never started prints a blank line)
            progress.stop()
    _stdout_console().print(_search_table(result))
    console.print(f"done in {time.monotonic() - started:.0f} s; studies in {result.storage}")
    if json_path:
        from freqopt.tables import atomic_write_text

        atomic_write_text(json_path, json.dumps(result.summary(), indent=1) + "\n")


def _search_table(result):
    """The rich table of a SearchResult: the baseline, then one row per granularity."""
    from rich.table import Table

    w, spec, summary = result.trace.workload, result.spec, result.summary()
    table = Table(title=f"{w.model} ({w.layout}) on {spec.name}, max slowdown {100 * result.max_slowdown:g} % "
                        f"(validated by measuring the whole iteration, clock switches taking "
                        f"{1e3 * spec.clock_switch_s:g} ms)")  # fmt: skip
    for col in ("granularity", "energy/iter (J)", "time/iter (s)", "energy saved (%)", "slowdown (%)",
                "free switching: saved/slowdown (%)", "settings", "measurements", "search cost (GPU-h)",
                "clock table"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("granularity", "clock table") else "right")
    base = result.baseline
    table.add_row("baseline (default)", f"{base.energy_j:.3f}", f"{base.time_s:.5f}", "0.00", "0.00", "-", "-", "-",
                  "-", "-")  # fmt: skip
    for g, r in result.results.items():
        doc = summary["results"][g]
        ideal = ("-" if doc["ideal_energy_saved_pct"] is None
                 else f"{doc['ideal_energy_saved_pct']:.2f} / {doc['ideal_slowdown_pct']:.2f}")  # fmt: skip
        table.add_row(g, f"{r.validated.energy_j:.3f}", f"{r.validated.time_s:.5f}", f"{doc['energy_saved_pct']:.2f}",
                      f"{doc['slowdown_pct']:.2f}", ideal, str(r.n_settings), str(r.n_measurements),
                      f"{r.search_cost_gpu_s / 3600:.3f}", doc["table"] or "-")  # fmt: skip
    return table


@cli.command()
@click.option("--storage", required=True, help="The search's Optuna storage URL (as `freqopt search` printed it).")
@click.option("--study", "name", required=True, help="The search's name (printed by `freqopt search`).")
@click.option("--backend", default=None,
              help="Measurement backend; default (and required): the search's own, sim or nvml.")
@click.option("--wait-s", default=600.0, show_default=True, type=float,
              help="Give up after this long with nothing to claim (or no search of that name).")
@click.option("--json", "json_path", default=None, help="Also write what this worker did as JSON to this file.")
def worker(storage, name, backend, wait_s, json_path) -> None:
    """Join a running search: claim its tuning units from the shared storage and run their studies, until the
    search is done. One worker per GPU; several may run on one machine with the simulated GPU."""
    import optuna
    from rich.console import Console

    from freqopt.backends import check_backend, get_backend
    from freqopt.errors import StorageError
    from freqopt.gpus import get_gpu
    from freqopt.search.storage import open_storage, study_prefix
    from freqopt.search.workers import WorkerReport, check_worker_backend, load_job, serve, trace_from_job
    from freqopt.tables import atomic_write_text

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console(stderr=True)
    if backend is not None:
        check_backend(backend)
    if json_path:
        _check_writable_file(Path(json_path))
    if wait_s < 0:
        raise InvalidSettingError(f"--wait-s must not be negative, not {wait_s:g}")
    opened = open_storage(storage)
    started = time.monotonic()
    while (state := load_job(opened, name)) is None:
        if time.monotonic() - started > wait_s:
            raise StorageError(f"no freqopt search named {name!r} in {storage} after {wait_s:g} s; start it with "
                               f"`freqopt search --storage {storage}` and pass the name it prints")  # fmt: skip
        time.sleep(0.5)
    job = state["job"]
    backend_name = check_worker_backend(job, backend)
    measuring = get_backend(backend_name, get_gpu(job["gpu"]) if backend_name == "sim" else None, seed=job["seed"])
    try:
        trace = trace_from_job(job)
        if study_prefix(trace, measuring.spec, job["seed"]) != name:
            raise StorageError(f"this worker's trace or GPU differs from search {name!r}'s (another freqopt version, "
                               f"or a GPU of type {measuring.spec.name} against the search's {job['gpu']}); run the "
                               "same freqopt on the same GPU type")  # fmt: skip
        console.print(f"joined {name}: {job['model']} on {measuring.spec.name} ({backend_name})")
        report: WorkerReport = serve(opened, name, trace, measuring, idle_s=wait_s,
                                     on_unit=lambda g, unit: console.print(f"{g}: {unit} done"))  # fmt: skip
    finally:
        measuring.close()
    ending = f"nothing to claim for {wait_s:g} s" if report.idle_timeout else "the search is done"
    console.print(f"worker stopped ({ending}): {report.units} units, {report.n_new_measurements} measurements")
    if json_path:
        atomic_write_text(json_path, json.dumps({"units": report.units, "n_new_measurements": report.n_new_measurements,
                                                 "idle_timeout": report.idle_timeout}, indent=1) + "\n")  # fmt: skip


@cli.command()
@click.option("--table", "table_path", required=True, help="A clock table written by `freqopt search`.")
@click.option("--model", required=True, help="Target model (see `freqopt models`).")
@click.option("--gpu", default=None, help="GPU type; must be the table's (default: the table's).")
@click.option("--max-slowdown", default=None, help="Budget of the native search (default: the table's).")
@click.option("--backend", default="sim", show_default=True, help="Measurement backend: sim (simulated GPU).")
@click.option("--storage", default=None, help="Optuna storage URL of the native search; default sqlite:///OUT/freqopt.db.")
@click.option("--out", "out_dir", default="freqopt-out", show_default=True, help="Directory for the storage.")
@click.option("--json", "json_path", default=None, help="Also write the comparison as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of samplers and simulated noise.")
@click.option("--trials", default=None, type=int, help="Trials per tuning unit of the native search.")
@_model_options
def transfer(table_path, model, gpu, max_slowdown, backend, storage, out_dir, json_path, seed, trials,
             micro_batch_size, seq_len, n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """Apply a clock table to another model or layout, validate it, and compare it with a native search."""
    import optuna
    from rich.console import Console
    from rich.table import Table

    from freqopt.backends import get_backend
    from freqopt.gpus import get_gpu
    from freqopt.layout import parse_layout
    from freqopt.models import get_workload
    from freqopt.search import SearchConfig
    from freqopt.search.storage import open_storage
    from freqopt.tables import atomic_write_text, load_table
    from freqopt.trace import trace_training_iteration
    from freqopt.api import check_writable_dir
    from freqopt.transfer import evaluate_transfer

    workload = get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                            vocab_multiple=vocab_multiple, layout=parse_layout(layout))  # fmt: skip
    if gpu is not None:
        get_gpu(gpu)  # an unknown name fails as such before the table is read
    table = load_table(table_path)
    spec = get_gpu(gpu or table.gpu)
    table.check_gpu(spec, source=table_path)
    slowdown = parse_slowdown(max_slowdown) if max_slowdown is not None else table.data["max_slowdown"]
    if trials is not None and trials < 1:
        raise InvalidSettingError(f"--trials must be a positive integer, not {trials}")
    measuring = get_backend(backend, spec, seed=seed)
    try:
        out = Path(out_dir)
        if json_path:
            _check_writable_file(Path(json_path))
        check_writable_dir(out)
        storage = storage or f"sqlite:///{(out / 'freqopt.db').resolve()}"
        open_storage(storage)
        counts = {"n_trials_1d": trials, "n_trials_2d": trials} if trials else {}
        config = SearchConfig(max_slowdown=slowdown, seed=seed, storage=storage, **counts)

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        console = Console(stderr=True)
        source = table.data["workload"]
        source_layout = source.get("layout", {"dp": 1, "tp": 1})
        trace = trace_training_iteration(workload)
        console.print(f"transferring {table.granularity}-level table of {source['model']} "
                      f"(dp={source_layout['dp']},tp={source_layout['tp']}, micro-batch {source.get('micro_batch_size')}) "
                      f"to {workload.model} ({workload.layout}, micro-batch {workload.micro_batch_size}) on {spec.name}")  # fmt: skip
        with console.status("validating the transferred table and searching the target natively") as status:
            def on_unit(granularity: str, done: int, n: int) -> None:
                status.update(f"native search, {granularity}: unit {done}/{n}")

            report = evaluate_transfer(table, trace, measuring, config, on_unit=on_unit)
    finally:
        measuring.close()  # a real GPU goes back to what it was found with
    summary = report.summary()
    t, n = summary["transferred"], summary["native"]
    rich_table = Table("settings", "energy saved (%)", "slowdown (%)", "kernel classes matched exactly / by kind / not",
                       title=f"{workload.model} ({workload.layout}) on {spec.name}, {table.granularity} level, "
                             f"budget {100 * slowdown:g} %")  # fmt: skip
    rich_table.add_row("transferred table", f"{t['energy_saved_pct']:.2f}", f"{t['slowdown_pct']:.2f}",
                       f"{t['matched_exact']} / {t['matched_by_kind']} / {t['unmatched']}")  # fmt: skip
    rich_table.add_row("native search", f"{n['energy_saved_pct']:.2f}", f"{n['slowdown_pct']:.2f}", "-")
    _stdout_console().print(rich_table)
    if json_path:
        atomic_write_text(json_path, json.dumps(summary, indent=1) + "\n")


@cli.command()
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--table", "table_path", default=None, help="A clock table to apply (default: none, default clocks).")
@click.option("--steps", default=8, show_default=True, type=int, help="Training steps.")
@click.option("--backend", default="sim", show_default=True, help="sim (simulated GPU timeline) or nvml (a real GPU).")
@click.option("--gpu", default=None, help="GPU type of the simulated backend (default: the table's, else h100-sxm).")
@click.option("--compare", is_flag=True, help="Alternate blocks of steps with and without the table.")
@click.option("--read-only", is_flag=True, help="nvml: measure at the GPU's current settings; change nothing.")
@click.option("--device", default=None, help="Where the model trains (default: cuda with nvml, cpu with sim).")
@click.option("--json", "json_path", default=None, help="Also write the per-step figures as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of weights, tokens and simulated noise.")
@_model_options
def train(model, table_path, steps, backend, gpu, compare, read_only, device, json_path, seed, micro_batch_size,
          seq_len, n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """Train on synthetic tokens under the DVFS runtime and report time and energy per step."""
    from rich.table import Table

    from freqopt.backends import check_backend, get_backend
    from freqopt.gpus import DEFAULT_GPU, get_gpu
    from freqopt.layout import parse_layout
    from freqopt.models import get_workload
    from freqopt.tables import atomic_write_text, load_table
    from freqopt.train import check_training_device
    from freqopt.train import train as run_training

    workload = get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                            vocab_multiple=vocab_multiple, layout=parse_layout(layout))  # fmt: skip
    check_backend(backend)
    if steps < 1:
        raise InvalidSettingError(f"--steps must be a positive integer, not {steps}")
    if compare and table_path is None:
        raise InvalidSettingError("--compare needs --table: it alternates steps with and without the table")
    if read_only and table_path is not None:
        raise InvalidSettingError("--read-only cannot apply a table (that changes clocks); drop one of them")
    if json_path:
        _check_writable_file(Path(json_path))
    table = load_table(table_path) if table_path else None
    requested = get_gpu(gpu) if gpu else (get_gpu(table.gpu) if table else None)
    device = device or ("cuda" if backend == "nvml" else "cpu")
    check_training_device(device)  # a CPU-only torch says so before a GPU is opened or ranks are started
    if workload.layout.world_size > 1 and "WORLD_SIZE" not in os.environ:
        _relaunch_under_deepspeed(workload.layout.world_size)
        return
    measuring = get_backend(backend, requested if backend == "nvml" else requested or get_gpu(DEFAULT_GPU), seed=seed,
                            read_only=read_only)  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    try:
        if table is not None:
            table.check_gpu(measuring.spec, source=table_path)  # the GPU the table is applied to
        report = run_training(workload, measuring, table=table, steps=steps, compare=compare, device=device,
                              seed=seed)  # fmt: skip
    finally:
        measuring.close()
    if rank != 0:
        return
    summary = report.summary()
    rich_table = Table("step", "clocks", "time/step (s)", "energy/step (J)",
                       title=f"{workload.model} ({workload.layout}) training on {measuring.spec.name} "
                             f"({'simulated' if backend == 'sim' else 'NVML'}); loss {report.loss_first:.3f} -> "
                             f"{report.loss_last:.3f}")  # fmt: skip
    for r in report.steps:
        rich_table.add_row(str(r.step), "table" if r.with_table else "default", f"{r.time_s:.5f}", f"{r.energy_j:.3f}")
    _stdout_console().print(rich_table)
    if "energy_saved_pct" in summary:
        click.echo(f"with the table: {summary['energy_saved_pct']:.2f} % less energy per step, "
                   f"{summary['slowdown_pct']:+.2f} % time per step ({report.switches_per_step:.1f} clock switches "
                   "per step)")  # fmt: skip
    if json_path:
        atomic_write_text(json_path, json.dumps(summary, indent=1) + "\n")


def _relaunch_under_deepspeed(world_size: int) -> None:
    """Run this same command under DeepSpeed's launcher, one process per rank (gloo on a CPU machine)."""
    import subprocess

    # As a module (-m freqopt.cli), not a script: a script's folder (freqopt/) would come first on sys.path, and
    # freqopt/profile.py would shadow the standard library's profile module.
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size), "--no_local_rank",
           "--module", "freqopt.cli", *sys.argv[1:]]  # fmt: skip
    code = subprocess.call(cmd)
    if code:
        raise click.exceptions.Exit(code)


@cli.command()
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm (nvml: the real GPU's).")
@click.option("--backend", default="sim", show_default=True,
              help="sim (the simulated GPU) or nvml (trains on the first visible GPU and reads it, never sets it).")
@click.option("--device", default=None, help="nvml: where the model trains (default cuda; cpu for tests).")
@click.option("--steps", default=10, show_default=True, type=int,
              help="nvml: fewest measured steps; more run until the window spans 1 s and 5 energy-counter updates.")
@click.option("--json", "json_path", default=None, help="Also write the profile as JSON to this file.")
@_model_options
def profile(model, gpu, backend, device, steps, json_path, layout, **sizes) -> None:
    """Report one training iteration: time, energy, average power, FLOPs and a breakdown by kernel kind.

    With --backend nvml the GPU is only read: the measurement is shown beside the simulated GPU's prediction,
    and one step under torch.profiler beside the trace, kind by kind."""
    from rich.table import Table

    from freqopt.layout import parse_layout
    from freqopt.profile import profile as run_profile
    from freqopt.tables import atomic_write_text

    if json_path:
        _check_writable_file(Path(json_path))
    report = run_profile(model, backend, gpu=gpu, device=device, steps=steps, layout=layout, **sizes)
    nvml = report.backend == "nvml"
    console = _stdout_console()
    where = f"NVML, trained on {report.device}, {report.n_steps} steps" if nvml else "simulated"
    console.print(f"{report.model} ({parse_layout(layout)}), one training iteration on {report.gpu} ({where}): "
                  f"{report.time_s:.5f} s, {report.energy_j:.3f} J, {report.avg_power_w:.1f} W, "
                  f"{report.flops / 1e12:.4g} TFLOP")  # fmt: skip
    time_s, energy_j = sum(f.time_s for f in report.by_kind.values()), sum(f.energy_j for f in report.by_kind.values())
    kinds = Table("kind", "kernels", "time (s)", "time (%)", "energy (J)", "energy (%)",
                  title="by kernel kind" + (" (the simulated GPU's prediction)" if nvml else ""))  # fmt: skip
    for kind, f in report.by_kind.items():
        kinds.add_row(kind, str(f.n_kernels), f"{f.time_s:.6f}", f"{100 * f.time_s / time_s:.1f}", f"{f.energy_j:.4f}",
                      f"{100 * f.energy_j / energy_j:.1f}")  # fmt: skip
    console.print(kinds)
    if nvml:
        p = report.predicted
        versus = Table("per step", "measured", "predicted (simulated)", "measured / predicted")
        for name, m, q, fmt in (("time (s)", report.time_s, p.time_s, ".5f"), ("energy (J)", report.energy_j,
                                p.energy_j, ".3f"), ("avg power (W)", report.avg_power_w, p.avg_power_w, ".1f")):  # fmt: skip
            versus.add_row(name, format(m, fmt), format(q, fmt), f"{m / q:.3f}")
        console.print(versus)
        seen = Table("kind", "traced kernels", "predicted time (s)", "profiled kernels",
                     f"measured time (s, {report.profiler_time})", title="trace against torch.profiler, one step")  # fmt: skip
        for kind, r in report.profiler_by_kind.items():
            seen.add_row(kind, str(r.traced_n_kernels), f"{r.predicted_time_s:.6f}", str(r.profiled_n_kernels),
                         f"{r.measured_time_s:.6f}")  # fmt: skip
        console.print(seen)
    if json_path:
        atomic_write_text(json_path, json.dumps(report.summary(), indent=1) + "\n")


@cli.command()
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--granularity", default="kernel", show_default=True, help="iteration, pass or kernel.")
@click.option("--max-slowdown", default="1%", show_default=True, help="Allowed slowdown: 1% or 0.01.")
@click.option("--repeats", default=1, show_default=True, type=int, help="Bayesian searches (seeds) averaged.")
@click.option("--free-switching", is_flag=True, help="Treat clock switches as free (as Spaan et al. 2026 did).")
@click.option("--json", "json_path", default=None, help="Also write the comparison as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the first search and of the noise.")
@_model_options
def benchmark(model, gpu, granularity, max_slowdown, repeats, free_switching, json_path, seed, micro_batch_size,
              seq_len, n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """The Bayesian search against an exhaustive sweep of every unit at every setting (simulated GPU)."""
    import optuna
    from rich.console import Console
    from rich.table import Table

    from freqopt.backends.simulated import SimulatedGPU
    from freqopt.gpus import DEFAULT_GPU, get_gpu
    from freqopt.layout import parse_layout
    from freqopt.models import get_workload
    from freqopt.search import SearchConfig
    from freqopt.search.oracle import benchmark as run_benchmark
    from freqopt.tables import atomic_write_text
    from freqopt.trace import trace_training_iteration

    slowdown = parse_slowdown(max_slowdown)
    workload = get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                            vocab_multiple=vocab_multiple, layout=parse_layout(layout))  # fmt: skip
    spec = get_gpu(gpu or DEFAULT_GPU)
    if granularity not in ("iteration", "pass", "kernel"):
        raise InvalidSettingError(f"--granularity {granularity!r}: choose iteration, pass or kernel")
    if repeats < 1:
        raise InvalidSettingError(f"--repeats must be a positive integer, not {repeats}")
    if json_path:
        _check_writable_file(Path(json_path))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console(stderr=True)
    trace = trace_training_iteration(workload)
    config = SearchConfig(max_slowdown=slowdown, seed=seed, switching=not free_switching)
    with console.status(f"searching {repeats}x and sweeping every setting of {workload.model} on {spec.name}"):
        result = run_benchmark(trace, SimulatedGPU(spec, seed=seed), config, granularity=granularity, repeats=repeats)
    summary = result.summary()
    o, b = summary["oracle"], summary["search"]
    table = Table("", "energy saved (%)", "predicted (%)", "measurements", "search cost (GPU-h)",
                  title=f"{workload.model} ({workload.layout}) on {spec.name}, {granularity} level, budget "
                        f"{100 * slowdown:g} %, {'free switching' if free_switching else 'switching costs included'}")  # fmt: skip
    table.add_row("Bayesian search", f"{b['energy_saved_pct']:.2f}", f"{b['predicted_energy_saved_pct']:.2f}",
                  f"{b['n_measurements']:.0f}", f"{b['search_cost_gpu_s'] / 3600:.3f}")  # fmt: skip
    table.add_row("exhaustive sweep", f"{o['energy_saved_pct']:.2f}", "-", str(o["n_measurements"]),
                  f"{o['search_cost_gpu_s'] / 3600:.3f}")  # fmt: skip
    ratio = summary["savings_ratio"]
    table.add_row("ratio", "-" if ratio is None else f"{ratio:.3f}", "-", "-", f"{summary['cost_ratio']:.4f}")
    _stdout_console().print(table)
    if json_path:
        atomic_write_text(json_path, json.dumps(summary, indent=1) + "\n")


@cli.command()
def reset() -> None:
    """Restore GPUs that a killed freqopt left with changed clocks or power limit (from its state files)."""
    from freqopt.nvml import reset_from_state_files, state_dir

    done = reset_from_state_files()
    if not done:
        click.echo(f"nothing to restore: no state files in {state_dir()}")
    for uuid, what in done:
        click.echo(f"{uuid}: {what}")


def parse_caps(text: str) -> list[float]:
    """Power limits in watts from "100,150,200".

    Raises:
        InvalidSettingError: not a comma-separated list of positive numbers.
    """
    try:
        caps = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        caps = []
    if not caps or any(not (c > 0) or c != c for c in caps):
        raise InvalidSettingError(f"--caps {text!r} is not a list of watts; write it like 100,150,200,250")
    return caps


@cli.command()
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--caps", default=None, help="Power limits in W, e.g. 100,150,200,250; default: 4 from min to default.")
@click.option("--mode", default="train", show_default=True, help="train (one training step) or inference (one batch).")
@click.option("--backend", default="sim", show_default=True, help="Measurement backend: sim (simulated GPU).")
@click.option("--json", "json_path", default=None, help="Also write the results as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the simulated noise.")
@click.option("--host-gap-ms", default=0.0, show_default=True, type=float,
              help="Host time per iteration in which the GPU idles (data loading, Python).")
@_model_options
def powercap(model, gpu, caps, mode, backend, json_path, seed, host_gap_ms, micro_batch_size, seq_len,
             n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """Measure one iteration at each power limit, relative to the GPU's default limit (McDonald et al. 2022)."""
    from rich.table import Table

    from freqopt.backends import get_backend
    from freqopt.gpus import DEFAULT_GPU, get_gpu
    from freqopt.models import get_workload
    from freqopt.search.powercap import default_caps, sweep_power_caps
    from freqopt.tables import atomic_write_text
    from freqopt.layout import parse_layout
    from freqopt.trace import MODES, trace_iteration

    workload = get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                            vocab_multiple=vocab_multiple, layout=parse_layout(layout))  # fmt: skip
    spec = get_gpu(gpu or DEFAULT_GPU)
    if mode not in MODES:
        raise InvalidSettingError(f"--mode {mode!r} is not a mode; choose train or inference")
    caps_w = parse_caps(caps) if caps is not None else default_caps(spec)
    for cap in caps_w:
        spec.check_power_limit(cap)
    if host_gap_ms < 0:
        raise InvalidSettingError(f"--host-gap-ms must not be negative, not {host_gap_ms:g}")
    if json_path:
        _check_writable_file(Path(json_path))
    measuring = get_backend(backend, spec, seed=seed)
    try:
        trace = trace_iteration(workload, mode)
        base, points = sweep_power_caps(trace, measuring, caps_w, host_gap_s=host_gap_ms / 1000)
    finally:
        measuring.close()  # a real GPU goes back to the power limit it was found with
    table = Table("power limit (W)", "time (rel)", "energy (rel)", "avg power (W)", "time/iter (s)", "energy/iter (J)",
                  title=f"{workload.model} {mode} on {spec.name}: relative to the default "
                        f"{spec.power_limit_default_w:g} W limit")  # fmt: skip
    table.add_row(f"{spec.power_limit_default_w:g} (default)", "1.000", "1.000", f"{base.avg_power_w:.1f}",
                  f"{base.time_s:.5f}", f"{base.energy_j:.3f}")  # fmt: skip
    for p in points:
        table.add_row(f"{p.power_limit_w:g}", f"{p.time_rel:.3f}", f"{p.energy_rel:.3f}", f"{p.avg_power_w:.1f}",
                      f"{p.time_s:.5f}", f"{p.energy_j:.3f}")  # fmt: skip
    _stdout_console().print(table)
    if json_path:
        doc = {"baseline_power_limit_w": spec.power_limit_default_w,
               "caps": [{"power_limit_w": p.power_limit_w, "time_rel": p.time_rel, "energy_rel": p.energy_rel,
                         "avg_power_w": p.avg_power_w} for p in points]}  # fmt: skip
        atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")


@cli.command()
@click.option("--table", "table_path", required=True, help="A clock table written by `freqopt search`.")
@click.option("--iterations", default=1000, show_default=True, type=int, help="Training iterations of the run.")
@click.option("--gpus", default=1, show_default=True, type=int, help="GPUs running the same iterations.")
@click.option("--pue", default=None, type=float, help="Facility PUE (default 1.58, Uptime Institute 2023 average).")
@click.option("--site-pue-profile", default=None, help="CSV hour,pue (0-23) or month,pue (1-12): PUE over time.")
@click.option("--grid-gco2-per-kwh", default=None, type=float, help="Grid carbon intensity (default 436, world 2022).")
@click.option("--out", "out_path", default=None, help="Also write the statement (markdown) to this file.")
def statement(table_path, iterations, gpus, pue, site_pue_profile, grid_gco2_per_kwh, out_path) -> None:
    """Write an energy statement (McDonald et al. 2022) for a run with and without a clock table."""
    from freqopt.statement import DEFAULT_GRID_GCO2_PER_KWH, energy_statement, load_pue_profile
    from freqopt.tables import atomic_write_text, load_table

    if out_path:
        _check_writable_file(Path(out_path))
    table = load_table(table_path)
    profile = load_pue_profile(site_pue_profile) if site_pue_profile else None
    grid = DEFAULT_GRID_GCO2_PER_KWH if grid_gco2_per_kwh is None else grid_gco2_per_kwh
    text = energy_statement(table, iterations=iterations, gpus=gpus, pue=pue, profile=profile, grid_gco2_per_kwh=grid)
    click.echo(text, nl=False)
    if out_path:
        atomic_write_text(out_path, text)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI; print freqopt and usage errors as one line and return non-zero."""
    try:
        cli.main(args=argv, prog_name="freqopt", standalone_mode=False)
    except FreqoptError as e:
        click.echo(f"freqopt: error: {e}", err=True)
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
    except KeyboardInterrupt:
        click.echo("freqopt: interrupted; finished studies are kept in the storage", err=True)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
