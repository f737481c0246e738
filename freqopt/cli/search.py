"""``freqopt search`` (one search, comparing granularities) and ``freqopt worker`` (joining one from elsewhere)."""

from __future__ import annotations

import time

import click

from freqopt.cli import (absolute_storage, check_json_path, cli, memory_warnings_as_lines, model_options,
                         stdout_console, verbose_option, write_json)  # fmt: skip


def switch_latency_option(f):
    """``--switch-latency-ms``: the GPU's clock-switch latency in place of its search_spaces/ file's (search,
    transfer and train pass it on as ``switch_latency_ms``, which the library checks)."""
    return click.option("--switch-latency-ms", default=None, type=click.FloatRange(min=0.0),
                        help="Clock-switch latency in ms in place of the GPU file's (search_spaces/*.toml "
                             "clock_switch_ms; 0: instant switches).")(f)  # fmt: skip


def confidence_option(f):
    """``--confidence``: the one-sided confidence at which every schedule's slowdown is held to the budget (search,
    transfer and benchmark pass it on as ``confidence``, which the library checks: freqopt.budget.check_confidence)."""
    return click.option("--confidence", default="0.95", show_default=True,
                        help="Confidence at which the slowdown is held to the budget: a schedule is kept only if the "
                             "upper bound of its slowdown at this level is within it; 0.5 judges on the mean "
                             "alone.")(f)  # fmt: skip


@cli.command(short_help="Search clock settings and compare granularities.")
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--max-slowdown", required=True, help="Allowed slowdown: 1% or 0.01.")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm.")
@click.option("--granularity", default="all", show_default=True,
              help="all, or one or a comma list of power-cap, iteration, pass, kernel, phase (e.g. iteration,kernel); "
                   "with a pipeline layout: iteration, stage, instruction.")
@click.option("--backend", default="sim", show_default=True,
              help="Measurement backend: sim (simulated GPU), nvml (the first visible NVIDIA GPU; needs root) or "
                   "amdsmi (the first visible AMD GPU, through AMD SMI; needs root).")
@click.option("--storage", default=None, help="Optuna storage URL; default journal:OUT/freqopt.journal.")
@click.option("--out", "out_dir", default="freqopt-out", show_default=True, help="Directory for tables and storage.")
@click.option("--json", "json_path", default=None, help="Also write the results as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of samplers and simulated noise.")
@click.option("--trials", default=None, type=int, help="Trials per tuning unit (default 14, plus 4 per memory clock beyond the first).")
@click.option("--jobs", default=1, show_default=True, type=int,
              help="Processes that run tuning units in parallel (simulated GPU; for real GPUs start a "
                   "`freqopt worker` per GPU).")
@click.option("--micro-batches", type=int, default=None,
              help="Micro-batches per iteration of a pipeline layout (pp > 1; DeepSpeed's gradient_accumulation_steps).")
@click.option("--partition-method", default=None,
              help="How a pipeline layout's layers split into stages: parameters (DeepSpeed's default), uniform or "
                   "type:REGEX.")
@confidence_option
@click.option("--schedule", default=None,
              help="A pipeline layout's schedule: 1f1b (DeepSpeed's, the default) or torch.distributed.pipelining's "
                   "gpipe, interleaved-1f1b, looped-bfs, interleaved-zb, zb-v, dualpipe-v (only 1f1b writes a "
                   "clock table so far).")
@click.option("--virtual-stages", type=int, default=None,
              help="Model stages per GPU for interleaved-1f1b, looped-bfs and interleaved-zb (default 2).")
@click.option("--host", default=None,
              help="The host issuing the kernels on the simulated GPU (a name `freqopt gpus` lists, or a host TOML "
                   "file); default the GPU file's (h100-node). One-GPU search only.")
@switch_latency_option
@model_options
@verbose_option
def search(model, max_slowdown, gpu, granularity, backend, storage, out_dir, json_path, seed, trials, jobs,
           micro_batches, partition_method, confidence, schedule, virtual_stages, host, switch_latency_ms,
           micro_batch_size, seq_len, n_heads, vocab_multiple, layout, verbose) -> None:  # fmt: skip
    """Search clock settings for one training iteration and compare granularities.

    With a pipeline layout (--layout ...,pp=S and --micro-batches M) it searches the simulated pipeline's iteration
    (granularities iteration: one clock for all GPUs; stage: one clock per stage, never switching; instruction: one
    clock per stage's forward or backward of one micro-batch).

    A search in a storage other processes can reach is a work queue: `freqopt worker --storage URL --study NAME`
    (NAME is printed at the start) joins it from another process or machine."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)  # fmt: skip

    from freqopt.api import search as run_search
    from freqopt.errors import InvalidSettingError
    from freqopt.workload.layout import parse_layout

    check_json_path(json_path)
    levels = [g.strip() for g in granularity.split(",")]
    if parse_layout(layout).is_pipeline:
        if host is not None:
            raise InvalidSettingError("host applies to the one-GPU search; a pipeline's GPUs are issued by their GPU "
                                      "file's host", argument="host")  # fmt: skip
        if jobs != 1:
            raise InvalidSettingError("n_jobs applies to the one-GPU search; a pipeline's studies run in one process",
                                      argument="n_jobs")  # fmt: skip
        _search_pipeline(model, max_slowdown, gpu, levels, backend, storage, out_dir, json_path, seed, trials,
                         micro_batches, partition_method or "parameters", switch_latency_ms, micro_batch_size,
                         seq_len, n_heads, vocab_multiple, layout, verbose, confidence, schedule or "1f1b",
                         virtual_stages)  # fmt: skip
        return
    _refuse_pipeline_options(micro_batches=micro_batches, partition_method=partition_method, schedule=schedule,
                             virtual_stages=virtual_stages)  # fmt: skip
    console = Console(stderr=True)
    started = time.monotonic()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)  # fmt: skip
    status = console.status(f"tracing one training iteration of {model}")

    begun = []  # the SearchStart, once the search has started

    def on_start(start) -> None:
        begun.append(start)
        status.stop()
        w = start.trace.workload
        where = "" if w.layout.is_single_gpu else f" ({w.layout}, one rank of {w.layout.world_size})"
        console.print(f"traced {w.model}{where}: {len(start.trace)} kernels, {len(start.trace.kernel_classes())} "
                      f"kernel classes, {start.trace.total_flops / 1e12:.2f} TFLOP per iteration; GPU "
                      f"{start.spec.name}" + (f" (simulated, host {start.spec.host})" if start.backend == "sim"
                                              else ""))  # fmt: skip
        console.print(f"search {start.study_name}; other processes join it with: freqopt worker --storage "
                      f"{absolute_storage(start.storage)} --study {start.study_name}", soft_wrap=True)  # fmt: skip
        progress.add_task("searching tuning units", total=start.n_units)
        progress.start()

    def on_unit(granularity: str, done: int, n: int) -> None:
        progress.update(progress.task_ids[0], advance=1, description=f"{granularity}: unit {done}/{n}")

    if console.is_terminal:  # transient there; elsewhere stopping it would leave a blank line before any error
        status.start()
    try:
        with memory_warnings_as_lines():
            result = run_search(model, max_slowdown=max_slowdown, gpu=gpu, granularity=levels[0] if len(levels) == 1
                                else levels, backend=backend,
                                storage=storage, out=out_dir, seed=seed, n_trials=trials, n_jobs=jobs,
                                micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout, switch_latency_ms=switch_latency_ms,
                                confidence=confidence, host=host, on_unit=on_unit, on_start=on_start,
                                verbose=verbose)  # fmt: skip
    except KeyboardInterrupt:
        if begun:  # the search had started: its studies are in the storage
            raise KeyboardInterrupt("run the same command to resume: finished measurements are kept in "
                                    f"{absolute_storage(begun[0].storage)}")  # fmt: skip
        raise
    finally:
        status.stop()
        if progress.task_ids:  # started (stopping one never started prints a blank line)
            progress.stop()
    _print_search(result, console, started, model, n_heads, vocab_multiple)
    write_json(json_path, result.summary())


def _refuse_pipeline_options(**options) -> None:
    """Refuse, on a one-GPU layout, the options that apply to a pipeline layout only (given: not None).

    Raises:
        InvalidSettingError: the first such option given, by name.
    """
    from freqopt.errors import InvalidSettingError

    for name, value in options.items():
        if value is not None:
            raise InvalidSettingError(f"{name} applies to a pipeline layout (pp > 1, e.g. --layout pp=4)",
                                      argument=name)  # fmt: skip


def _print_search(result, console, started: float, model: str, n_heads, vocab_multiple) -> None:
    """A one-GPU search's result rendered: its table on stdout (_search_table), with the tables and figures
    written; on ``console`` (stderr) the levels' notes, the switching and waiting statements, what was read back,
    the time since ``started`` (time.monotonic), and the command that applies the table that saved the most."""
    out = stdout_console()
    out.print(_search_table(result))
    notes: dict[str, list[str]] = {}
    for g, r in result.results.items():
        if r.note:
            notes.setdefault(r.note, []).append(g)
    for note, levels in notes.items():
        keeps = (f"; {'they keep' if len(levels) > 1 else 'it keeps'} the iteration level's clock"
                 if result.results[levels[0]].held_to_one_clock else "")  # fmt: skip
        console.print(f"{', '.join(levels)}: {note}{keeps}", soft_wrap=True)
    for line in (result.switching_statement(), result.waiting_statement()):
        if line:
            console.print(line, soft_wrap=True)
    for g, path in result.table_paths.items():
        out.print(f"{g} table: {path} (and .csv)", soft_wrap=True)
    for name, path in result.figure_paths.items():
        out.print(f"{name} figure: {path}", soft_wrap=True)
    if result.table_paths and not result.figure_paths:
        from freqopt.errors import install_hint

        console.print(f"no figures: install matplotlib for them: {install_hint('plots')}", soft_wrap=True)
    if result.n_stored_measurements:
        what = "resumed" if result.resumed else "shared with workers"
        console.print(f"{what}: {result.n_stored_measurements} measurements read back from "
                      f"{absolute_storage(result.storage)}, {result.n_new_measurements} new", soft_wrap=True)  # fmt: skip
    console.print(f"done in {time.monotonic() - started:.0f} s; studies in {absolute_storage(result.storage)}",
                  soft_wrap=True)  # fmt: skip
    if result.table_paths:
        best = max(result.results, key=lambda g: result.energy_saved_pct(g) if g in result.table_paths else -1.0)
        from freqopt.cli.suggest import train_command

        command = train_command(model, result.trace.workload, result.table_paths[best], backend=result.backend_name,
                                n_heads=n_heads, vocab_multiple=vocab_multiple)  # fmt: skip
        console.print(f"apply the {best} table (the most saved) to training with: {command}", soft_wrap=True,
                      highlight=False)  # fmt: skip


def slowdown_cell(row: dict) -> str:
    """A summary row's slowdown (%) and, where one was computed, the upper confidence bound held to the budget:
    "0.57, 0.64"."""
    bound = row.get("slowdown_bound_pct")
    return f"{row['slowdown_pct']:.2f}" + ("" if bound is None else f", {bound:.2f}")


def _search_table(result):
    """The rich table of a SearchResult: the baseline, then one row per granularity."""
    from rich.table import Table

    w, spec, summary = result.trace.workload, result.spec, result.summary()
    held = "" if result.confidence is None else f" at {100 * result.confidence:g} % confidence"
    table = Table(title=f"{w.model} ({w.layout}) on {spec.name}, max slowdown {100 * result.max_slowdown:g} %{held} "
                        f"(validated by measuring the whole iteration, clock switches taking "
                        f"{1e3 * spec.clock_switch_s:g} ms)")  # fmt: skip
    # Fixed widths that fit a 110-column terminal (headers wrap at spaces); the tables' paths are listed after it.
    # "level" (the granularity) at 9 leaves the slowdown's mean and bound 11 columns: "9.87, 10.00" at a 10 % budget.
    table.add_column("level", width=9, no_wrap=True)
    # The chosen clocks (SearchResult.clock_summary): one setting fits ("1410/1593 MHz", SM/memory), a finer level's
    # summary wraps and counts its settings (the column of the settings' count it replaces).
    table.add_column("clocks (SM/mem)", width=13)
    for col, width in (("energy J/iter", 7), ("time s/iter", 7), ("saved (%)", 5),
                       ("slowdown (%): mean, bound", 11), ("free switching: saved / slowdown (%)", 13),
                       ("measure- ments", 8), ("search cost (GPU-h)", 7)):  # fmt: skip
        table.add_column(col, justify="right", width=width)
    base = result.baseline
    table.add_row("default", "default", f"{base.energy_j:.3f}", f"{base.time_s:.5f}", "0.00", "0.00", "-", "-", "-")
    for g, r in result.results.items():
        doc = summary["results"][g]
        ideal = ("-" if doc["ideal_energy_saved_pct"] is None
                 else f"{doc['ideal_energy_saved_pct']:.2f} / {doc['ideal_slowdown_pct']:.2f}")  # fmt: skip
        table.add_row(g, result.clock_summary(g), f"{r.validated.energy_j:.3f}", f"{r.validated.time_s:.5f}",
                      f"{doc['energy_saved_pct']:.2f}",
                      slowdown_cell(doc), ideal, str(r.n_measurements),
                      f"{r.search_cost_gpu_s / 3600:.3f}")  # fmt: skip
    return table


def _search_pipeline(model, max_slowdown, gpu, levels, backend, storage, out_dir, json_path, seed, trials,
                     micro_batches, partition_method, switch_latency_ms, micro_batch_size, seq_len, n_heads,
                     vocab_multiple, layout, verbose, confidence, schedule="1f1b",
                     virtual_stages=None) -> None:  # fmt: skip
    """``freqopt search`` on a pipeline layout: freqopt.search_pipeline, rendered."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from freqopt.api import search_pipeline

    console = Console(stderr=True)
    started = time.monotonic()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=False)  # fmt: skip
    begun = []

    def on_start(start) -> None:
        begun.append(start)
        w = start.trace.workload
        console.print(f"traced {w.model} ({w.layout}): {w.layout.pp} stages, {micro_batches} micro-batches per "
                      f"iteration ({schedule}); GPU {start.spec.name} (simulated)")  # fmt: skip
        if set(levels) != {"iteration"}:  # instruction studies to share: a work queue (freqopt.pipeline.workers)
            console.print(f"search {start.study_name}; other processes take its instruction studies with: freqopt "
                          f"worker --storage {absolute_storage(start.storage)} --study {start.study_name}",
                          soft_wrap=True)  # fmt: skip
        else:
            console.print(f"search {start.study_name}; studies in {absolute_storage(start.storage)}", soft_wrap=True)
        progress.add_task("searching", total=start.n_units)
        progress.start()

    def on_unit(granularity: str, done: int, n: int) -> None:
        ending = " (planning and validating: minutes)" if granularity == "instruction" and done == n else ""
        progress.update(progress.task_ids[0], advance=1, description=f"{granularity}: study {done}/{n}{ending}")

    try:
        result = search_pipeline(model, max_slowdown=max_slowdown, micro_batches=micro_batches, gpu=gpu,
                                 layout=layout, granularities=levels[0] if len(levels) == 1 else levels,
                                 partition_method=partition_method, backend=backend, seed=seed, storage=storage,
                                 out=out_dir, n_trials=trials, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                 n_heads=n_heads, vocab_multiple=vocab_multiple, switch_latency_ms=switch_latency_ms,
                                 confidence=confidence, on_unit=on_unit, on_start=on_start, verbose=verbose,
                                 schedule=schedule, virtual_stages=virtual_stages)  # fmt: skip
    except KeyboardInterrupt:
        if begun:
            raise KeyboardInterrupt("run the same command to resume: finished measurements are kept in "
                                    f"{absolute_storage(begun[0].storage)}")  # fmt: skip
        raise
    finally:
        if progress.task_ids:
            progress.stop()
    out = stdout_console()
    out.print(_pipeline_table(result))
    for line in _pipeline_notes(result):
        out.print(line, soft_wrap=True)
    if result.table_path is not None:
        out.print(f"instruction table: {result.table_path} (and .csv)", soft_wrap=True)
        from freqopt.cli.suggest import train_command

        command = train_command(model, result.workload, result.table_path, backend=backend, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, micro_batches=result.micro_batches)  # fmt: skip
        console.print(f"apply it to training with: {command}", soft_wrap=True, highlight=False)
    if result.n_stored_measurements:
        what = "shared with workers" if result.resumed is False else "resumed"
        console.print(f"{what}: {result.n_stored_measurements} measurements read back from "
                      f"{absolute_storage(result.storage)}, {result.n_new_measurements} new", soft_wrap=True)  # fmt: skip
    console.print(f"done in {time.monotonic() - started:.0f} s; studies in {absolute_storage(result.storage)}",
                  soft_wrap=True)  # fmt: skip
    write_json(json_path, result.summary())


def _pipeline_table(result):
    """The rich table of a PipelineSearchResult: the default iteration, then one row per granularity."""
    from rich.table import Table

    w, doc = result.workload, result.summary()
    table = Table(title=f"{w.model} ({w.layout}) on {result.gpu}, {result.micro_batches} micro-batches ({result.schedule}), max "
                        f"slowdown {100 * result.max_slowdown:g} % (validated on the simulated pipeline, clock "
                        f"switches taking {1e3 * result.switch_s:g} ms)")  # fmt: skip
    table.add_column("granularity", width=11, no_wrap=True)
    for col, width in (("energy (J/iter)", 8), ("time (s/iter)", 8), ("saved (%)", 10), ("slow- down (%)", 10),
                       ("free switching: saved / slowdown (%)", 13), ("switches per iter", 8),
                       ("measure- ments", 8), ("search cost (GPU-h)", 7)):  # fmt: skip
        table.add_column(col, justify="right", width=width)
    base = result.baseline
    table.add_row("default", f"{base.energy_j:.1f}", f"{base.time_s:.4f}", "0.00", "0.00", "-", "0", "-", "-")
    bounds = ", ".join(f"{g} {r['slowdown_bound_pct']:.2f}" for g, r in doc["results"].items()
                       if r["slowdown_bound_pct"] is not None)  # fmt: skip
    table.caption = ("saved and slowdown: mean ± standard error of the validation's measurements"
                     + (f"; slowdown's upper bound at {100 * result.confidence:g} % confidence, held to the budget: "
                        f"{bounds} %" if bounds and result.confidence else ""))  # fmt: skip
    for g, level in result.levels.items():
        r = doc["results"][g]
        ideal = ("-" if r["ideal_energy_saved_pct"] is None
                 else f"{r['ideal_energy_saved_pct']:.2f} / {r['ideal_slowdown_pct']:.2f}")  # fmt: skip
        table.add_row(g, f"{level.validated.energy_j:.1f}", f"{level.validated.time_s:.4f}",
                      f"{r['energy_saved_pct']:.2f}±{r['energy_saved_se_pct']:.2f}",
                      f"{r['slowdown_pct']:.2f}±{r['slowdown_se_pct']:.2f}", ideal, str(r["n_switches"]),
                      str(r["n_measurements"]), f"{r['search_cost_gpu_s'] / 3600:.3f}")  # fmt: skip
    return table


def clock_runs(clocks) -> str:
    """Clocks as runs, for a line of text: "1110 x13, 1410, 1110 x2" (a clock repeated n times in a row as "x n")."""
    out, prev, count = [], None, 0
    for c in list(clocks) + [object()]:
        if c == prev:
            count += 1
            continue
        if prev is not None:
            out.append(f"{prev}" + (f" x{count}" if count > 1 else ""))
        prev, count = c, 1
    return ", ".join(out)


def _pipeline_notes(result) -> list[str]:
    """What follows the table: the blocked power, the plan's optimality and the clocks asked for per stage."""
    from freqopt.gpu.specs import OVER_SWITCH_LIMIT

    spec = result.spec
    perseus = result.perseus_blocking_power_w
    lines = [f"blocked power: {result.blocking_power_w:.1f} W at {spec.max_sm_clock_mhz} MHz, less at lower clocks "
             "(a NCCL receive spinning at the clock in force: the GPU's waiting power)"
             + (f"; Perseus measured {perseus:g} W on this GPU type" if perseus is not None else "")]  # fmt: skip
    ends = {g: r.saving_pct_waiting_range for g, r in result.levels.items() if r.saving_pct_waiting_range}
    if ends:  # how far the savings rest on a blocked GPU's power falling with its clock, which no reading pins
        lines.append("saved without noise, blocked power falling with the clock as modelled / not falling at all: "
                     + ", ".join(f"{g} {e[1]:.2f} / {e[0]:.2f} %" for g, e in ends.items()))  # fmt: skip
    level = result.levels.get("instruction")
    if level is not None:
        stage = result.levels.get("stage")
        if level.plan is not None and stage is not None and level.plan is stage.plan:
            lines.append("instruction level: the stage level's plan (one clock per stage) validated better than any "
                         "plan with switches; its table holds that plan")  # fmt: skip
        elif level.plan is not None:
            lines.append(f"instruction plan: within {100 * level.plan.gap:.3g} % of the least energy the measured "
                         "fronts allow (proven by the planner)")  # fmt: skip
        else:
            lines.append("instruction level: the iteration level's clock (or the defaults) validated better than any plan")
        lines.append(f"clocks asked for at each instruction's start (MHz), in each stage's {result.schedule} order, one switch "
                     f"latency ahead:")  # fmt: skip
        for stage in result.stage_requests():
            lines.append(f"  stage {stage['stage']}: " + clock_runs([i["sm_clock_mhz"] for i in stage["instructions"]]))
        if level.validated.max_stage_switches:
            limit, rate = spec.max_switches_per_s, level.validated.switches_per_s
            verdict = "" if not limit else (f"; {spec.switch_limit_text}"
                                            + (f": {OVER_SWITCH_LIMIT}" if spec.over_switch_limit(rate) else ""))  # fmt: skip
            lines.append(f"clock switches per second on the busiest stage's GPU: {rate:.1f} "
                         f"({level.validated.max_stage_switches} per iteration){verdict}")  # fmt: skip
        if level.frontier:
            f0, f1 = level.frontier[0], level.frontier[-1]
            lines.append(f"time-energy frontier (the planner's prediction: the instructions' critical path and energy, "
                         f"without the optimizer step; {len(level.frontier)} points): {f0.time_s:.4f} s "
                         f"{f0.energy_j:.1f} J to {f1.time_s:.4f} s {f1.energy_j:.1f} J (--json lists them)")  # fmt: skip
    return lines


@cli.command(short_help="Join a running search from another process or machine.")
@click.option("--storage", required=True, help="The search's Optuna storage URL (as `freqopt search` printed it).")
@click.option("--study", "name", default=None,
              help="The search's name (printed by `freqopt search`); default: the one search running in the storage.")
@click.option("--backend", default=None,
              help="Measurement backend; default (and required): the search's own, sim or nvml.")
@click.option("--wait-s", default=None, type=float,
              help="Wait this long (s) for the search to appear in the storage (a worker started beside its search), "
                   "and give up after this long with nothing to claim; default: a storage without the search is "
                   "refused at once, and the worker gives up after 600 s with nothing to claim.")
@click.option("--json", "json_path", default=None, help="Also write what this worker did as JSON to this file.")
@click.option("--device", type=int, default=None,
              help="The GPU to measure on, an index among the visible ones (CUDA_VISIBLE_DEVICES order); default "
                   "LOCAL_RANK (torchrun; under Slurm export LOCAL_RANK=$SLURM_LOCALID), else 0.")
@verbose_option
def worker(storage, name, backend, wait_s, json_path, device, verbose) -> None:
    """Join a running search: claim its tuning units from the shared storage and run their studies, until the
    search is done. One worker per GPU; several may run on one machine with the simulated GPU."""
    from rich.console import Console

    from freqopt.worker import IDLE_S, join_search

    check_json_path(json_path)
    console = Console(stderr=True)

    def on_wait(what: str, waited_s: float) -> None:
        console.print(f"waiting for {what} ({waited_s:.0f} s of --wait-s {wait_s:g})", soft_wrap=True)

    def on_idle(idle_s: float) -> None:
        console.print(f"nothing to claim for {idle_s:.0f} s (the search's other processes hold its units); stopping "
                      f"after {IDLE_S if wait_s is None else wait_s:g} s", soft_wrap=True)  # fmt: skip

    def on_join(joined, job, spec, backend_name, index) -> None:
        where = "simulated" if backend_name == "sim" else f"GPU {index}"
        console.print(f"joined {joined}: {job['model']} on {spec.name} ({where})")

    report = join_search(storage, name, backend=backend, wait_s=wait_s, on_join=on_join, device=device,
                         on_unit=lambda g, unit: console.print(f"{g}: {unit} done"), on_wait=on_wait,
                         on_idle=on_idle, verbose=verbose)  # fmt: skip
    ending = (f"nothing to claim for {IDLE_S if wait_s is None else wait_s:g} s" if report.idle_timeout
              else "the search is done")  # fmt: skip
    console.print(f"worker stopped ({ending}): {report.units} units, {report.n_new_measurements} measurements")
    write_json(json_path, {"units": report.units, "n_new_measurements": report.n_new_measurements,
                           "idle_timeout": report.idle_timeout})  # fmt: skip
