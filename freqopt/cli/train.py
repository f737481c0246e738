"""``freqopt train`` (training under the DVFS runtime, one process per rank under DeepSpeed's launcher) and
``freqopt profile`` (one iteration's time, energy and breakdown)."""

from __future__ import annotations

import os
import sys

import click

from freqopt.cli import (check_json_path, check_names_first, cli, memory_warnings_as_lines, model_options,
                         stdout_console, write_json)  # fmt: skip
from freqopt.cli.search import switch_latency_option

@cli.command(short_help="Train under the DVFS runtime; time and energy per step.")
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--table", "table_path", default=None,
              help="A clock table to apply (default: none, default clocks); found for this model, whose layout, "
                   "micro-batch and sequence length it sets unless given.")
@click.option("--steps", default=8, show_default=True, type=int, help="Training steps.")
@click.option("--backend", default="sim", show_default=True, help="sim (simulated GPU timeline) or nvml (a real GPU).")
@click.option("--gpu", default=None, help="GPU type of the simulated backend (default: the table's, else h100-sxm).")
@click.option("--compare", is_flag=True, help="Alternate blocks of steps with and without the table.")
@click.option("--read-only", is_flag=True, help="nvml: measure at the GPU's current settings; change nothing.")
@click.option("--device", default=None, help="Where the model trains (default: cuda with nvml, cpu with sim).")
@click.option("--json", "json_path", default=None, help="Also write the per-step figures as JSON to this file.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of weights, tokens and simulated noise.")
@click.option("--micro-batches", "micro_batches", default=None, type=int,
              help="Pipelines (--layout pp=N): micro-batches per step (default: the table's, else 2 x pp); another "
                   "count than the table's is planned again from its fronts.")
@click.option("--small-step", "small_step", is_flag=True,
              help="sim: run each step on one sequence of at most 32 tokens on this machine; the simulated GPU's "
                   "time and energy stay the full workload's (only the loss differs). Seconds a step on a CPU.")
@switch_latency_option
@model_options
def train(model, table_path, steps, backend, gpu, compare, read_only, device, json_path, seed, micro_batches,
          small_step, switch_latency_ms, micro_batch_size, seq_len, n_heads, vocab_multiple,
          layout) -> None:  # fmt: skip
    """Train on synthetic tokens under the DVFS runtime and report time and energy per step.

    Progress goes to stderr: each stage of the set-up (tracing, building the model, starting DeepSpeed) and each
    step as it is measured; the table of steps to stdout at the end. With --layout pp=N the model trains as a
    DeepSpeed pipeline (one rank per stage, 1F1B), and a pipeline table (granularity instruction) sets each stage's
    SM clock at every forward and backward pass."""
    from rich.console import Console
    from rich.table import Table

    check_names_first(model, gpu)
    check_json_path(json_path)
    from freqopt.apply.train_checks import check_training_arguments

    # The library's checks that need no model built, before the modules that load PyTorch.
    check_training_arguments(model, table=table_path, steps=steps, backend=backend, gpu=gpu, compare=compare,
                             read_only=read_only, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                             vocab_multiple=vocab_multiple, layout=layout, switch_latency_ms=switch_latency_ms,
                             micro_batches=micro_batches, small_step=small_step)  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    progress = _TrainProgress(Console(stderr=True), steps, quiet=rank != 0)
    with progress:
        # On the live bar only, unless a launcher started this rank (whose run the command line checked before): a
        # line on stderr before a refusal would make it two
        progress.status("checking the run: the model, " + ("the table, " if table_path else "") + "this machine's "
                        "memory", line="WORLD_SIZE" in os.environ)  # fmt: skip
        from freqopt.apply.train import plan_training

        plan = plan_training(model, table=table_path, steps=steps, backend=backend, gpu=gpu, compare=compare,
                             read_only=read_only, device=device, seed=seed, micro_batch_size=micro_batch_size,
                             seq_len=seq_len, n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout,
                             switch_latency_ms=switch_latency_ms, micro_batches=micro_batches,
                             small_step=small_step)  # fmt: skip
        if plan.needs_launcher:
            progress.status(f"starting {plan.workload.layout.world_size} ranks under DeepSpeed's launcher (rank 0 "
                            "reports)")  # fmt: skip
            progress.close()
            _relaunch_under_deepspeed(plan)
            return
        report = plan.run(on_step=progress.step, on_status=progress.status)
    if rank != 0:
        return
    workload = plan.workload
    summary = report.summary()
    rich_table = Table("step", "clocks", "time/step (s)", "energy/step (J)",
                       title=f"{workload.model} ({workload.layout}) training on {report.gpu_name} "
                             f"({'simulated' if backend == 'sim' else 'NVML'}); loss {report.loss_first:.3f} -> "
                             f"{report.loss_last:.3f}")  # fmt: skip
    for r in report.steps:
        rich_table.add_row(str(r.step), "table" if r.with_table else "default", f"{r.time_s:.5f}", f"{r.energy_j:.3f}")
    stdout_console().print(rich_table)
    if small_step:
        from freqopt.apply.train_loop import batch_shape

        b, t = batch_shape(workload, small_step=True)
        click.echo(f"small steps: each step ran {b} x {t} tokens on the {plan.device.upper()}; its time and energy are "
                   f"the simulated GPU's for the workload's {workload.micro_batch_size} x {workload.config.seq_len} "
                   "tokens, and the loss the small batch's")  # fmt: skip
    if report.pipeline is not None:
        p = report.pipeline
        click.echo(f"pipeline of {p['stages']} stages x {p['micro_batches']} micro-batches (1F1B): each rank asked for "
                   f"its stage's clock at every forward and backward pass ({report.switches_per_step:.1f} clock "
                   "switches per step on rank 0)")  # fmt: skip
    if "energy_saved_pct" in summary:
        click.echo(f"with the table: {summary['energy_saved_pct']:.2f} % less energy per step, "
                   f"{summary['slowdown_pct']:+.2f} % time per step ({report.switches_per_step:.1f} clock switches "
                   "per step)")  # fmt: skip
    write_json(json_path, summary)


class _TrainProgress:
    """``freqopt train``'s progress on stderr (rich): a line for each stage of the set-up (TrainingPlan.run's
    on_status) and for each step as it is measured (on_step: its clocks, GPU time and energy, and the seconds it
    took here), under a live bar of the steps on a terminal. Where stderr is not a terminal (a log, a pipe), where
    the bar is not drawn, a line says what the run is still doing after every ``heartbeat_s`` without one, so that no
    stretch of a run is silent (a full-size step on a CPU takes minutes). ``quiet``: print nothing (a launched rank
    other than 0)."""

    def __init__(self, console, steps: int, *, quiet: bool = False, heartbeat_s: float = 10.0):
        import threading
        import time

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console, self.steps, self.quiet, self.heartbeat_s = console, steps, quiet, heartbeat_s
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)  # fmt: skip
        self.task = None
        self.doing = "starting"
        self.last = self.since = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None

    def __enter__(self):
        import threading

        if self.quiet:
            return self
        if self.console.is_terminal:
            self.task = self.progress.add_task(self.doing, total=self.steps)
            self.progress.start()
        else:
            self.thread = threading.Thread(target=self._heartbeat, name="freqopt-train-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.task is not None:
            self.progress.stop()
            self.task = None

    def _print(self, line: str) -> None:
        import time

        with self.lock:
            self.console.print(line, soft_wrap=True, highlight=False)
            self.last = time.monotonic()

    def _heartbeat(self) -> None:
        import time

        while not self.stopped.wait(1.0):
            now = time.monotonic()
            if now - self.last >= self.heartbeat_s:
                self._print(f"  ... {self.doing} ({now - self.since:.0f} s)")

    def status(self, message: str, line: bool = True) -> None:
        """A stage of the set-up begins (on_status): a line on stderr (``line``) and the live bar's description."""
        import time

        if self.quiet:
            return
        self.doing, self.since = message, time.monotonic()
        if self.task is not None:
            self.progress.update(self.task, description=message)
        if line:
            self._print(message)

    def step(self, record) -> None:
        """A step was measured (on_step: a StepRecord)."""
        import time

        if self.quiet:
            return
        done = record.step + 1
        here = "" if record.wall_s is None else f" (ran {record.wall_s:.1f} s here)"
        self._print(f"step {done}/{self.steps} ({'table' if record.with_table else 'default'} clocks): "
                    f"{record.time_s:.5f} s, {record.energy_j:.3f} J{here}")  # fmt: skip
        self.doing, self.since = (f"running step {done + 1}/{self.steps}" if done < self.steps
                                  else "finishing"), time.monotonic()  # fmt: skip
        if self.task is not None:
            self.progress.update(self.task, completed=done, description=self.doing)


def _relaunch_under_deepspeed(plan) -> None:
    """Run this same command under DeepSpeed's launcher, one process per rank (gloo on a CPU machine), each
    watched by freqopt.cli.rank; a rank that a signal ended is reported in one line (_killed_rank_error)."""
    import shutil
    import subprocess
    import tempfile

    from freqopt.cli.rank import STATUS_DIR_ENV, killed_ranks

    # As a module (-m freqopt.cli.rank, which runs -m freqopt.cli), not a script: a script's folder would come
    # first on sys.path, where a freqopt module could shadow the standard library's (as freqopt/workload/trace.py
    # would shadow trace).
    # The launcher's own INFO lines (its command, world info, each rank spawned and exiting) and its warnings (no
    # hostfile) are not freqopt's output: --log_level error, which it hands on to each node's launch. On a CPU,
    # DS_ACCELERATOR=cpu says what DeepSpeed would otherwise warn, in every process, that it fell back to.
    # The ranks meet at MASTER_PORT where the user set it, else at a port free now: DeepSpeed's default, 29500,
    # is taken by any other job on this machine that kept it.
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--log_level", "error", "--num_gpus",
           str(plan.workload.layout.world_size), "--master_port", port, "--no_local_rank", "--module",
           "freqopt.cli.rank", *sys.argv[1:]]  # fmt: skip
    status_dir = tempfile.mkdtemp(prefix="freqopt-ranks-")
    env = {**os.environ, STATUS_DIR_ENV: status_dir}
    if str(plan.device or "cpu").startswith("cpu"):
        env.setdefault("DS_ACCELERATOR", "cpu")
    try:
        code = subprocess.call(cmd, env=env)
        killed = killed_ranks(status_dir) if code else {}
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if killed:
        raise _killed_rank_error(plan, *min(killed.items()))
    if code:
        raise click.exceptions.Exit(code)


def _free_port() -> int:
    """A TCP port on localhost that no process listens on now (the kernel's pick for port 0)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _killed_rank_error(plan, rank: int, signum: int):
    """The one-line error for rank ``rank`` ended by signal ``signum``; exit status 128 + signum, as a shell's."""
    import signal

    from freqopt.errors import FreqoptError
    from freqopt.apply.train import host_memory_report

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    world = plan.workload.layout.world_size
    if signum == signal.SIGKILL:
        message = (f"rank {rank} of {world} was killed ({name}, as the kernel's out-of-memory killer ends a process), "
                   f"likely for memory: {host_memory_report(plan.workload, plan.device)}; use a smaller "
                   "--micro-batch-size or --seq-len" + (", or fewer ranks (--layout)" if world > 1 else ""))  # fmt: skip
    else:
        message = f"rank {rank} of {world} died of {name}"
    error = FreqoptError(message)
    error.exit_code = 128 + signum
    return error


@cli.command(short_help="Report one training iteration: time, energy and kernel kinds.")
@click.option("--model", required=True, help="Model name (see `freqopt models`), or hf:PATH (a Hugging Face config.json).")
@click.option("--gpu", default=None, help="GPU type (see `freqopt gpus`); default h100-sxm (nvml: the real GPU's).")
@click.option("--backend", default="sim", show_default=True,
              help="sim (the simulated GPU) or nvml (trains on the first visible GPU and reads it, never sets it).")
@click.option("--device", default=None, help="nvml: where the model trains (default cuda; cpu for tests).")
@click.option("--steps", default=10, show_default=True, type=int,
              help="nvml: fewest measured steps; more run until the window spans 1 s and 5 energy-counter updates.")
@click.option("--sm-clock", "sm_clock_mhz", type=int, default=None,
              help="sim: lock the SM clock at this many MHz for the whole step (default: boost clocks).")
@click.option("--mem-clock", "mem_clock_mhz", type=int, default=None,
              help="sim: lock the memory clock at this many MHz (default: the highest).")
@click.option("--power-limit", "power_limit_w", type=float, default=None,
              help="sim: run under this power limit, W (default: the GPU's default limit).")
@click.option("--json", "json_path", default=None, help="Also write the profile as JSON to this file.")
@click.option("--host", default=None,
              help="The host issuing the kernels (a name `freqopt gpus` lists, or a host TOML file); default the GPU "
                   "file's (h100-node). nvml: the one your machine's host is measured against.")
@click.option("--attention", type=click.Choice(["flash", "sdpa"]), default=None,
              help="GPT-3 models: flash (freqopt's FlashAttention-2 op, the default) or sdpa (PyTorch's "
                   "scaled_dot_product_attention, cuDNN's kernels on Hopper: what the H100 steps of "
                   "experiments/data/h100/whole_steps ran).")
@model_options
def profile(model, gpu, backend, device, steps, sm_clock_mhz, mem_clock_mhz, power_limit_w, json_path, host, attention,
            layout, **sizes) -> None:  # fmt: skip
    """Report one training iteration: time, energy, average power, FLOPs and a breakdown by kernel kind and by pass.

    On the simulated GPU the whole step runs at one setting: the GPU's defaults, or --sm-clock, --mem-clock and
    --power-limit (the step the search's validation measures for that setting). With --backend nvml the GPU is only read: the measurement is shown beside the simulated GPU's prediction,
    and one step under torch.profiler beside the trace, kind by kind."""
    from rich.table import Table

    check_names_first(model, gpu)
    check_json_path(json_path)
    from freqopt.measure.profile_checks import check_profile_arguments

    # The library's checks that need no model built, before the modules that load PyTorch.
    check_profile_arguments(model, backend, gpu=gpu, device=device, steps=steps, layout=layout,
                            sm_clock_mhz=sm_clock_mhz, mem_clock_mhz=mem_clock_mhz, power_limit_w=power_limit_w,
                            host=host, **sizes)  # fmt: skip
    from freqopt.gpu.backends.base import DEFAULT_SETTING, Measurement
    from freqopt.workload.layout import parse_layout
    from freqopt.measure.profile import profile as run_profile

    if attention is not None:  # the model built here with its attention path, then profiled as a Workload
        from freqopt.workload.models import get_workload

        what = {"workload": get_workload(model, layout=parse_layout(layout), attention=attention, **sizes)}
    else:
        what = {"workload": model, "layout": layout, **sizes}
    with memory_warnings_as_lines():
        report = run_profile(backend=backend, gpu=gpu, device=device, steps=steps, sm_clock_mhz=sm_clock_mhz,
                             mem_clock_mhz=mem_clock_mhz, power_limit_w=power_limit_w, host=host, **what)  # fmt: skip
    nvml = report.backend == "nvml"
    console = stdout_console()
    where = f"NVML, trained on {report.device}, {report.n_steps} steps" if nvml else \
        f"simulated, {report.setting.label() if report.setting != DEFAULT_SETTING else 'default settings'}"
    console.print(f"{report.model} ({parse_layout(layout)}), one training iteration on {report.gpu} ({where}): "
                  f"{report.time_s:.5f} s, {report.energy_j:.3f} J, {report.avg_power_w:.1f} W, "
                  f"{report.flops / 1e12:.4g} TFLOP")  # fmt: skip
    waiting = report.waiting_line()
    if waiting is not None:
        console.print(waiting)
        if report.host_scale is not None:
            console.print(f"your host issues kernels {report.host_scale:.3g}x as slowly as {report.host}'s: copy "
                          f"search_spaces/hosts/{report.host}.toml, multiply its times by {report.host_scale:.3g} "
                          "and pass the file as --host to freqopt search and profile")  # fmt: skip
    if report.memory is not None:
        of_gpu = f" of the GPU's {report.gpu_memory_gb:g} GB" if report.gpu_memory_gb is not None else ""
        console.print(f"memory per rank (estimated, {report.memory.dtype}): {report.memory.describe()}{of_gpu}")
    # The step's time and energy the tables' shares are of: the simulated step (sim) or the prediction (nvml).
    step = report.predicted if nvml else report
    host = report.predicted_waiting if nvml else Measurement(report.waiting_s, report.waiting_energy_j)
    time_s, energy_j = step.time_s, step.energy_j
    prediction = " (the simulated GPU's prediction)" if nvml else ""
    kinds = Table("kind", "kernels", "time (s)", "time (%)", "energy (J)", "energy (%)", "GB moved", "TB/s",
                  "TFLOP/s", title=f"by kernel kind{prediction}: kernel time, the waiting for the host apart; "
                  "rates on kernel time")  # fmt: skip
    for kind, f in report.by_kind.items():
        kinds.add_row(kind, str(f.n_kernels), f"{f.time_s:.6f}", f"{100 * f.time_s / time_s:.1f}", f"{f.energy_j:.4f}",
                      f"{100 * f.energy_j / energy_j:.1f}", f"{f.mem_bytes / 1e9:.3g}", f"{f.bandwidth_tb_s:.3g}",
                      f"{f.tflop_s:.3g}")  # fmt: skip
    kinds.add_row("waiting for the host", "", f"{host.time_s:.6f}", f"{100 * host.time_s / time_s:.1f}",
                  f"{host.energy_j:.4f}", f"{100 * host.energy_j / energy_j:.1f}", "", "", "", style="bold")
    console.print(kinds)
    passes = Table("pass", "time (s)", "time (%)", "energy (J)", "energy (%)", "waiting for the host (s)",
                   "waiting (J)", title=f"by pass{prediction}: kernel time and energy, and the waiting for the host "
                   "before its kernels")  # fmt: skip
    for name, f in report.by_pass.items():
        passes.add_row(name, f"{f.time_s:.6f}", f"{100 * f.time_s / time_s:.1f}", f"{f.energy_j:.4f}",
                       f"{100 * f.energy_j / energy_j:.1f}", f"{f.waiting_s:.6f}", f"{f.waiting_energy_j:.4f}")
    console.print(passes)
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
    write_json(json_path, report.summary())


