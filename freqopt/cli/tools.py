"""The other commands: listing models and GPU types, applying a table elsewhere (transfer), the search against
an exhaustive sweep (benchmark), power capping alone (powercap), the energy statement, and reset."""

from __future__ import annotations

import click

from freqopt.cli import (check_json_path, check_names_first, cli, model_options, stdout_console, verbose_option,
                         write_json)  # fmt: skip
from freqopt.cli.search import confidence_option, slowdown_cell, switch_latency_option

@cli.command(short_help="List the models and their parameter counts.")
@click.argument("names", nargs=-1)
@model_options
def models(names, micro_batch_size, seq_len, n_heads, vocab_multiple, layout) -> None:
    """List the models (or only NAMES, which may include hf:PATH for a Hugging Face config.json), with parameter
    counts computed from the PyTorch modules (per GPU under --layout) and the vocabulary the embedding and output
    layer hold (the tokenizer's in parentheses where padded)."""
    from rich.table import Table

    from freqopt.resolve import check_workload_arguments
    from freqopt.workload.layout import parse_layout

    parsed = parse_layout(layout)
    for name in names:  # the library's checks that need no model built, before the models (and PyTorch) load
        check_workload_arguments(name, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                 vocab_multiple=vocab_multiple)  # fmt: skip
    from freqopt.workload.models import count_parameters, get_workload, list_models

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
            row.append(_parameters_per_gpu(c, parsed) if fits else f"tp must divide {c.n_heads} heads")
        table.add_row(*row)
    stdout_console().print(table)


def _parameters_per_gpu(config, layout) -> str:
    """One rank's parameters under ``layout``: the whole model's tp shard, or with pp > 1 the largest stage's."""
    from freqopt.errors import InvalidSettingError
    from freqopt.workload.models import count_parameters
    from freqopt.workload.pipeline_partition import stage_parameters

    if not layout.is_pipeline:
        return f"{count_parameters(config, layout.tp) / 1e6:,.1f} M"
    try:
        return f"{max(stage_parameters(config, layout)) / 1e6:,.1f} M (largest stage)"
    except InvalidSettingError as e:  # a model without a layer list, or fewer layers than stages
        return str(e).split(";")[0]


@cli.command(short_help="List the GPU types in search_spaces/.")
def gpus() -> None:
    """List the GPU types in search_spaces/ and the hosts that issue their kernels (search_spaces/hosts/)."""
    from rich.table import Table

    from freqopt.gpu.host import get_host, list_hosts
    from freqopt.gpu.specs import DEFAULT_GPU, get_gpu, list_gpus

    table = Table("gpu", "name", "SM clocks (MHz)", "memory clocks (MHz)", "power limit (W)", "BF16 peak (TFLOP/s)",
                  "host")  # fmt: skip
    for name in list_gpus():
        g = get_gpu(name)
        table.add_row(
            name + (" (default)" if name == DEFAULT_GPU else ""), g.marketing_name,
            f"{g.sm_clocks_mhz[0]}-{g.max_sm_clock_mhz} ({len(g.sm_clocks_mhz)})",
            ", ".join(map(str, g.mem_clocks_mhz)),
            f"{g.power_limit_min_w:g}-{g.power_limit_max_w:g} (default {g.power_limit_default_w:g})",
            f"{g.tensor_peak_flops / 1e12:,.0f}", g.host,
        )  # fmt: skip
    hosts = Table("host", "machine", "issue a kernel (us)", "a GEMM (us)", "a step's kernel on top: forward, backward, "
                  "optimizer (us)")  # fmt: skip
    for name in list_hosts():
        h = get_host(name)
        hosts.add_row(name, h.description, f"{h.issue_us:.1f}", f"{h.gemm_issue_us:.1f}",
                      ", ".join(f"{h.step_us.get(p, 0.0):.1f}" for p in ("forward", "backward", "optimizer")))
    stdout_console().print(table)
    stdout_console().print(hosts)


@cli.command(short_help="Apply a clock table to another model or layout.")
@click.option("--table", "table_path", required=True, help="A clock table written by `freqopt search`.")
@click.option("--model", required=True, help="Target model (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type; must be the table's (default: the table's).")
@click.option("--max-slowdown", default=None, help="Budget on the target (default: the table's).")
@click.option("--backend", default="sim", show_default=True, help="Measurement backend: sim (simulated GPU).")
@click.option("--storage", default=None, help="Optuna storage URL of the target's studies; default journal:OUT/freqopt.journal.")
@click.option("--out", "out_dir", default="freqopt-out", show_default=True,
              help="Directory for the storage and the re-allocated table.")  # fmt: skip
@click.option("--native/--no-native", default=True, show_default=True,
              help="Also search the target natively, for comparison (most of the time).")  # fmt: skip
@click.option("--json", "json_path", default=None, help="Also write the comparison as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of samplers and simulated noise.")
@click.option("--trials", default=None, type=int, help="Trials per tuning unit of the target's studies.")
@switch_latency_option
@confidence_option
@model_options
@verbose_option
def transfer(table_path, model, gpu, max_slowdown, backend, storage, out_dir, native, json_path, seed, trials,
             switch_latency_ms, confidence, micro_batch_size, seq_len, n_heads, vocab_multiple, layout,
             verbose) -> None:  # fmt: skip
    """Apply a clock table to another model or layout: as it is, with its budget re-allocated there, and beside a
    native search; writes the re-allocated table."""
    from rich.console import Console
    from rich.table import Table

    check_names_first(model)
    check_json_path(json_path)
    from freqopt.apply.transfer_checks import check_transfer_arguments

    # The library's checks that need no model built, before the modules that load PyTorch.
    check_transfer_arguments(table_path, model, gpu=gpu, max_slowdown=max_slowdown, backend=backend, n_trials=trials,
                             micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                             vocab_multiple=vocab_multiple, layout=layout, switch_latency_ms=switch_latency_ms,
                             confidence=confidence, storage=storage)  # fmt: skip
    from freqopt.apply.transfer import transfer as run_transfer

    console = Console(stderr=True)
    status = console.status("validating the transferred table")

    def on_start(table, trace, spec) -> None:
        source, workload = table.data["workload"], trace.workload
        source_layout = source.get("layout", {"dp": 1, "tp": 1})
        console.print(f"transferring {table.granularity}-level table of {source['model']} "
                      f"(dp={source_layout['dp']},tp={source_layout['tp']}, micro-batch {source.get('micro_batch_size')}) "
                      f"to {workload.model} ({workload.layout}, micro-batch {workload.micro_batch_size}) on {spec.name}")  # fmt: skip
        status.start()

    def on_unit(granularity: str, done: int, n: int) -> None:
        what = "re-allocation" if granularity == "transfer" else f"search, {granularity}"
        status.update(f"target {what}: unit {done}/{n}")

    try:
        report = run_transfer(table_path, model, gpu=gpu, max_slowdown=max_slowdown, backend=backend, storage=storage,
                              out=out_dir, seed=seed, n_trials=trials, micro_batch_size=micro_batch_size,
                              seq_len=seq_len, n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout,
                              native=native, switch_latency_ms=switch_latency_ms, confidence=confidence,
                              on_start=on_start,
                              on_unit=on_unit, verbose=verbose)  # fmt: skip
    finally:
        status.stop()
    summary = report.summary()
    workload, limit = report.schedule.trace.workload, summary["max_slowdown_pct"]
    t = summary["transferred"]
    rich_table = Table("settings", "energy saved (%)", "slowdown (%): mean, bound", "measurements",
                       title=f"{workload.model} ({workload.layout}) on {report.spec.name}, {report.schedule.granularity} "
                             f"level, budget {limit:g} %")  # fmt: skip
    rich_table.add_row("as transferred", f"{t['energy_saved_pct']:.2f}", slowdown_cell(t), "-")
    for key, label in (("reallocated", "re-allocated"), ("native", "native search")):
        row = summary[key]
        if row is not None:
            rich_table.add_row(label, f"{row['energy_saved_pct']:.2f}", slowdown_cell(row),
                               str(row["n_measurements"]))  # fmt: skip
    out = stdout_console()
    out.print(rich_table)
    out.print(f"units matched exactly / by kind / not: {t['matched_exact']} / {t['matched_by_kind']} / {t['unmatched']}")
    search_line = _search_line(model, workload, report.source.granularity, limit, vocab_multiple)
    if not t["within_budget"]:
        instead = ("use the re-allocated table" if report.table_path is not None and not summary["not_reallocated"]
                   else f"a table that holds there comes from a search of this layout: {search_line}")  # fmt: skip
        bound = ("" if t["slowdown_bound_pct"] is None
                 else f", at most {t['slowdown_bound_pct']:+.2f} % at {100 * report.confidence:g} %")  # fmt: skip
        out.print(f"as transferred, the table is not within the {limit:g} % budget on this layout "
                  f"({t['slowdown_pct']:+.2f} % time{bound}); {instead}")  # fmt: skip
    why_not = summary["not_reallocated"]
    if report.table_path is not None:
        what = ("re-allocated table" if not why_not
                else "phase-level table for this workload" if report.schedule.granularity == "phase"
                else f"table as transferred (not re-allocated: {why_not})")  # fmt: skip
        out.print(f"{what}: {report.table_path} (and .csv); apply it with `"
                  f"{_train_line(model, workload, report.table_path, vocab_multiple, backend)}` or freqopt.DVFSRuntime",
                  soft_wrap=True)  # fmt: skip
    else:
        why = f"it cannot be re-allocated ({why_not})" if report.reallocated is None else why_not
        out.print(f"no table written: as transferred it saves nothing within the budget, and {why}; search this "
                  f"layout for one: {search_line}", soft_wrap=True)  # fmt: skip
    write_json(json_path, summary)


def _model_options(model: str, workload, vocab_multiple: int | None) -> str:
    """The options that name ``workload`` for a command: the model (an ``hf:PATH`` with PATH absolute), its layout,
    and its micro-batch, sequence length and heads where not the model's defaults (and --vocab-multiple where
    given)."""
    from pathlib import Path

    from freqopt.workload.models import get_workload
    from freqopt.workload.models.hf import is_hf_model

    default = get_workload(model)
    name = f"hf:{Path(model[3:]).resolve()}" if is_hf_model(model) else model
    line = f"--model {name} --layout {workload.layout}"
    if workload.micro_batch_size != default.micro_batch_size:
        line += f" --micro-batch-size {workload.micro_batch_size}"
    if workload.config.seq_len != default.config.seq_len:
        line += f" --seq-len {workload.config.seq_len}"
    if workload.config.n_heads != default.config.n_heads:
        line += f" --n-heads {workload.config.n_heads}"
    if vocab_multiple is not None:
        line += f" --vocab-multiple {vocab_multiple}"
    return line


def _search_line(model: str, workload, granularity: str, max_slowdown_pct: float, vocab_multiple: int | None) -> str:
    """The `freqopt search` command of ``workload`` at ``granularity`` within ``max_slowdown_pct`` (%): the native
    search whose table holds on this layout."""
    return (f"freqopt search {_model_options(model, workload, vocab_multiple)} --granularity {granularity} "
            f"--max-slowdown {max_slowdown_pct:g}%")


def _train_line(model: str, workload, table_path, vocab_multiple: int | None, backend: str = "sim") -> str:
    """The `freqopt train` command that applies ``table_path`` to ``workload``, from any folder: the model (an
    ``hf:PATH`` with PATH absolute), its layout, and its micro-batch, sequence length and heads where not the
    model's defaults (and --vocab-multiple where given), the table's absolute path, and the options that make it
    finish where it is suggested (freqopt.cli.suggest.backend_options: small steps and --compare on the simulated
    GPU)."""
    from pathlib import Path

    from freqopt.cli.suggest import backend_options

    line = f"freqopt train {_model_options(model, workload, vocab_multiple)}"
    options = backend_options(backend, multi_gpu=not workload.layout.is_single_gpu)
    return f"{line} --table {Path(table_path).resolve()} {' '.join(options)}"


@cli.command(short_help="Compare the Bayesian search with an exhaustive sweep.")
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--granularity", default="kernel", show_default=True, help="iteration, pass or kernel.")
@click.option("--max-slowdown", default="1%", show_default=True, help="Allowed slowdown: 1% or 0.01.")
@click.option("--repeats", default=1, show_default=True, type=int, help="Bayesian searches (seeds) averaged.")
@click.option("--free-switching", is_flag=True, help="Treat clock switches as free (as Spaan et al. 2026 did).")
@click.option("--json", "json_path", default=None, help="Also write the comparison as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the first search and of the noise.")
@confidence_option
@model_options
@verbose_option
def benchmark(model, gpu, granularity, max_slowdown, repeats, free_switching, json_path, seed, confidence,
              micro_batch_size, seq_len, n_heads, vocab_multiple, layout, verbose) -> None:  # fmt: skip
    """The Bayesian search against an exhaustive sweep of every unit at every setting (simulated GPU)."""
    from rich.console import Console
    from rich.table import Table

    from freqopt.measure.benchmark import benchmark as run_benchmark

    check_json_path(json_path)
    with Console(stderr=True).status(f"searching {repeats}x and sweeping every setting of {model}"):
        report = run_benchmark(model, gpu=gpu, granularity=granularity, max_slowdown=max_slowdown, repeats=repeats,
                               free_switching=free_switching, seed=seed, confidence=confidence,
                               micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                               vocab_multiple=vocab_multiple, layout=layout,
                               verbose=verbose)  # fmt: skip
    summary = report.summary()
    workload, spec = report.trace.workload, report.spec
    o, b = summary["oracle"], summary["search"]
    table = Table("", "energy saved (%)", "predicted (%)", "noiseless (%)", "noiseless slowdown (%)", "measurements",
                  "search cost (GPU-h)",
                  title=f"{workload.model} ({workload.layout}) on {spec.name}, {granularity} level, budget "
                        f"{100 * report.config.max_slowdown:g} %, "
                        f"{'free switching' if free_switching else 'switching costs included'}")  # fmt: skip
    def pct(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    def times(x) -> str:
        return "-" if x is None else f"{x:.3f}"

    table.add_row("Bayesian search", f"{b['energy_saved_pct']:.2f}", f"{b['predicted_energy_saved_pct']:.2f}",
                  pct(b["true_energy_saved_pct"]), pct(b["true_slowdown_pct"]), f"{b['n_measurements']:.0f}",
                  f"{b['search_cost_gpu_s'] / 3600:.3f}")  # fmt: skip
    table.add_row("exhaustive sweep", f"{o['energy_saved_pct']:.2f}", "-", pct(o["true_energy_saved_pct"]),
                  pct(o["true_slowdown_pct"]),
                  str(o["n_measurements"]), f"{o['search_cost_gpu_s'] / 3600:.3f}")  # fmt: skip
    table.add_row("ratio", times(summary["measured_savings_ratio"]), "-", times(summary["savings_ratio"]), "-", "-",
                  f"{summary['cost_ratio']:.4f}")  # fmt: skip
    stdout_console().print(table)
    write_json(json_path, summary)


@cli.command(short_help="Restore GPUs that a killed freqopt left changed.")
def reset() -> None:
    """Restore GPUs that a killed freqopt left with changed clocks or power limit (from its state files)."""
    from freqopt.gpu.nvml import reset_from_state_files, state_dir

    done = reset_from_state_files()
    if not done:
        click.echo(f"nothing to restore: no state files in {state_dir()}")
    for uuid, what in done:
        click.echo(f"{uuid}: {what}")


@cli.command(short_help="Measure one iteration at each power limit.")
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--caps", default=None, help="Power limits in W, e.g. 100,150,200,250; default: 4 from min to default.")
@click.option("--mode", default="train", show_default=True, help="train (one training step) or inference (one batch).")
@click.option("--backend", default="sim", show_default=True, help="Measurement backend: sim (simulated GPU).")
@click.option("--json", "json_path", default=None, help="Also write the results as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the simulated noise.")
@click.option("--host-gap-ms", default=0.0, show_default=True, type=float,
              help="Host time per iteration in which the GPU idles (data loading, Python).")
@model_options
def powercap(model, gpu, caps, mode, backend, json_path, seed, host_gap_ms, micro_batch_size, seq_len,
             n_heads, vocab_multiple, layout) -> None:  # fmt: skip
    """Measure one iteration at each power limit, relative to the GPU's default limit (McDonald et al. 2022)."""
    from rich.table import Table

    from freqopt.measure.powercap import powercap as run_powercap

    check_json_path(json_path)
    report = run_powercap(model, gpu=gpu, caps=caps, mode=mode, backend=backend, seed=seed, host_gap_ms=host_gap_ms,
                          micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                          vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    spec, base = report.spec, report.baseline
    table = Table("power limit (W)", "time (rel)", "energy (rel)", "avg power (W)", "time/iter (s)", "energy/iter (J)",
                  title=f"{report.workload.model} {mode} on {spec.name}: relative to the default "
                        f"{spec.power_limit_default_w:g} W limit")  # fmt: skip
    table.add_row(f"{spec.power_limit_default_w:g} (default)", "1.000", "1.000", f"{base.avg_power_w:.1f}",
                  f"{base.time_s:.5f}", f"{base.energy_j:.3f}")  # fmt: skip
    for p in report.points:
        if p.power_limit_w == spec.power_limit_default_w:
            continue  # the default limit's row above (sweep_power_caps measures it once)
        table.add_row(f"{p.power_limit_w:g}" + ("" if p.power_limit_met else " (not met)"), f"{p.time_rel:.3f}",
                      f"{p.energy_rel:.3f}", f"{p.avg_power_w:.1f}", f"{p.time_s:.5f}", f"{p.energy_j:.3f}")  # fmt: skip
    stdout_console().print(table)
    unmet = [p for p in report.points if not p.power_limit_met]
    if unmet:
        stdout_console().print(
            f"not met: at {', '.join(f'{p.power_limit_w:g}' for p in unmet)} W even the lowest SM clock draws more, so "
            "the GPU runs there above the limit (as firmware does)")
    write_json(json_path, report.summary())


@cli.command(short_help="Write an energy statement (McDonald et al. 2022).")
@click.option("--table", "table_path", required=True, help="A clock table written by `freqopt search`.")
@click.option("--iterations", default=1000, show_default=True, type=int, help="Training iterations of the run.")
@click.option("--gpus", default=None, type=int,
              help="GPUs running the same iterations (default: 1, or a pipeline table's stages).")
@click.option("--pue", default=None, type=float, help="Facility PUE (default 1.58, Uptime Institute 2023 average).")
@click.option("--site-pue-profile", default=None, help="CSV hour,pue (0-23) or month,pue (1-12): PUE over time.")
@click.option("--grid-gco2-per-kwh", default=None, type=float, help="Grid carbon intensity (default 436, world 2022).")
@click.option("--out", "out_path", default=None, help="Also write the statement (markdown) to this file.")
def statement(table_path, iterations, gpus, pue, site_pue_profile, grid_gco2_per_kwh, out_path) -> None:
    """Write an energy statement (McDonald et al. 2022) for a run with and without a clock table."""
    from freqopt.apply.statement import statement as write_statement

    text = write_statement(table_path, iterations=iterations, gpus=gpus, pue=pue, site_pue_profile=site_pue_profile,
                           grid_gco2_per_kwh=grid_gco2_per_kwh, out=out_path)  # fmt: skip
    click.echo(text, nl=False)
