"""``freqopt train``: train a model on synthetic tokens under the DVFS runtime and report time and energy per step.

On the simulated backend the model trains for real on this machine's CPU (a small configuration), the runtime follows
its phases through the module hooks, and each step's GPU time and energy come from the simulated GPU running the traced
iteration with the settings the runtime asked for (switch latency included). On the nvml backend the model trains on the
GPU: each step is timed by CUDA events, and energy is the counter's delta over each block of consecutive steps with the
same clocks. With a layout of more than one rank the job runs under DeepSpeed (ZeRO stage 0 data parallelism, AutoTP
tensor parallelism), started with DeepSpeed's launcher.

**Small steps** (``small_step``, simulated backend only): the step a CPU runs exists to drive the runtime (its module
hooks and optimizer step, which mark the phases it switches at); their order does not depend on the batch's shape, and
the simulated GPU's figures come from the trace of the full workload, not from the CPU's run. So a step may run one
sequence of at most 32 tokens (train_loop.batch_shape) instead of the workload's micro-batch: the same requests,
switches, time and energy per step, with the model, its weights and optimizer at full size: gpt3-small at 4 x 2048
tokens takes 1.0 s a step on a 2-core CPU (the whole run of 8 steps 23 s), where a step at full size takes 127 s;
only the loss is the small batch's. It is what ``freqopt search`` suggests on the simulated GPU, so
that the suggested run finishes where the search ran. On a real GPU (nvml) the step measured is the step run, and
small_step is refused.

**Pipelines** (layout pp > 1, freqopt's GPT-3 models): the model is DeepSpeed's PipelineModule over freqopt's layer
list (freqopt.workload.pipeline_partition: the embedding, each block, the final norm and the output layer, split into
stages by DeepSpeed's partition method, the table's), each rank one stage, and every step is one
``engine.train_batch()`` of M micro-batches (DeepSpeed's gradient_accumulation_steps; the table's by default) in
DeepSpeed's 1F1B schedule. The table must be a pipeline table for pp stages (granularity "instruction"); the runtime is
freqopt.apply.pipeline_runtime.PipelineRuntime, which asks for each forward and backward pass's clock. The output
layer holds its own copy of the tied embedding weight, not kept equal to the embedding's afterwards (a TiedLayerSpec
would all-reduce their gradients): what this training exercises is the clocks and the schedule, not the model's
quality. On the simulated backend a step's time and energy are the whole pipeline's (PipelineRuntime.step_measurement:
all stages, blocking power while they wait); on NVML each rank reads its own GPU, and the report is rank 0's (stage
0's GPU) only. With the nvml backend each rank of a launched job opens the GPU of its LOCAL_RANK among the visible ones
(every rank's, not only a pipeline's). The summary's "pipeline" holds the settings every rank asked for, per step and
pass.

``compare``: blocks of steps alternate between the table and the default settings, so both see the same
conditions; the measured saving is the difference of their mean energy per step.

The module holds a run's plan (plan_training: every argument checked before a GPU is opened or a rank started;
TrainingPlan.run) and the host-memory checks; the per-rank loop is freqopt.apply.train_loop, DeepSpeed's engines
freqopt.apply.train_deepspeed, and the checks that need no model built freqopt.apply.train_checks (their public names
are importable from here as well).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from freqopt.gpu.backends.base import switch_latency
from freqopt.errors import InvalidSettingError
from freqopt.workload.memory import StepMemory, estimate_step_memory, workload_label
from freqopt.workload.models import Workload
from freqopt.apply.train_checks import (check_layout_packages, check_training_arguments, check_training_device,
                                        refuse_pipeline_options)  # fmt: skip
from freqopt.apply.train_loop import StepRecord, TrainReport, synthetic_batch, train
from freqopt.tables import ClockTable

__all__ = ["StepRecord", "TrainReport", "TrainingPlan", "plan_training", "check_training_device", "synthetic_batch",
           "train", "training_memory", "host_memory_bytes", "check_host_memory", "host_memory_report"]


def training_memory(workload: Workload, device: str = "cpu") -> StepMemory:
    """The memory one rank of ``train`` holds in a step (freqopt.workload.memory.estimate_step_memory): FP32 weights,
    gradients, AdamW moments and activations on the CPU, as ``train`` builds the model there; BF16 with FP32 master
    weights on CUDA."""
    return estimate_step_memory(workload, dtype=torch.bfloat16 if str(device).startswith("cuda") else torch.float32)


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory: psutil.virtual_memory() (on Linux /proc/meminfo's
    MemTotal and MemAvailable)."""
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


def _local_ranks(workload: Workload) -> int:
    """Ranks on this machine: the launcher's LOCAL_SIZE inside a launched rank, else every rank (``freqopt
    train`` starts all of them here)."""
    return int(os.environ.get("LOCAL_SIZE", workload.layout.world_size))


def check_host_memory(workload: Workload, memory: StepMemory | None = None, *,
                      total_bytes: int | None = None) -> StepMemory:  # fmt: skip
    """Refuse a CPU training run whose ranks clearly cannot fit this machine's memory: their estimated memory
    together (``memory``, else training_memory on the CPU, times the ranks on this machine) above its total
    memory (``total_bytes``, else host_memory_bytes). What other processes hold is not counted against it: a run
    that fits the total but not what is free is left to start (and if the kernel's out-of-memory killer ends a
    rank, ``freqopt train`` says so with host_memory_report).

    Returns:
        The per-rank estimate.

    Raises:
        InvalidSettingError: the message gives the estimate, the machine's memory and what to change.
    """
    memory = memory if memory is not None else training_memory(workload, "cpu")
    total = total_bytes if total_bytes is not None else host_memory_bytes()[0]
    ranks = _local_ranks(workload)
    if ranks * memory.total_bytes > total:
        need = f"{ranks} ranks x {memory.describe()}" if ranks > 1 else memory.describe()
        fewer = ", or fewer data-parallel ranks (layout dp)" if workload.layout.dp > 1 else ""
        raise InvalidSettingError(f"training {workload_label(workload)} on the CPU needs about {need} of host "
                                  f"memory, more than this machine's {total / 1e9:.3g} GB; use a smaller "
                                  f"micro_batch_size or seq_len{fewer}")  # fmt: skip
    return memory


def host_memory_report(workload: Workload, device: str = "cpu") -> str:
    """What the ranks of a training run need against this machine's memory, for a message about a rank that the
    out-of-memory killer ended: "each of the 2 ranks needs about 14.5 GB (weights ..., activations ... GB) of host
    memory, 29 GB in all, against this machine's 23.4 GB (12.1 GB available now)". On CUDA, where the weights live
    on the GPU, only the machine's memory."""
    total, available = host_memory_bytes()
    machine = f"this machine's {total / 1e9:.3g} GB ({available / 1e9:.3g} GB available now)"
    if str(device).startswith("cuda"):
        return f"the ranks train on the GPU; {machine}"
    memory, ranks = training_memory(workload, device), _local_ranks(workload)
    each = f"each of the {ranks} ranks needs" if ranks > 1 else "the run needs"
    together = f", {ranks * memory.total_bytes / 1e9:.3g} GB in all," if ranks > 1 else ""
    return f"{each} about {memory.describe()} of host memory{together} against {machine}"


@dataclass(frozen=True)
class TrainingPlan:
    """A training run whose arguments are all checked (plan_training); ``run()`` opens the GPU and trains.

    Attributes:
        workload: model, micro-batch and layout.
        table: the clock table to apply, or None; table_source: where it was read from (for messages).
        gpu: the GPU type asked for (GPUSpec), or None: h100-sxm simulated, the real GPU's on nvml.
        backend: "sim" or "nvml"; device: where the model trains; steps, compare, read_only, seed: see train.
        switch_s: the clock-switch latency in place of the GPU file's, s (plan_training's switch_latency_ms), or
            None.
        micro_batches, partition_method: a pipeline's (train), None for other layouts.
        small_step: run each step on one short sequence (train; the simulated backend only).
    """

    workload: Workload
    table: ClockTable | None
    table_source: str
    gpu: object
    backend: str
    device: str
    steps: int
    compare: bool
    read_only: bool
    seed: int
    switch_s: float | None = None
    micro_batches: int | None = None
    partition_method: str | None = None
    small_step: bool = False

    @property
    def needs_launcher(self) -> bool:
        """More than one rank, and not yet started by a launcher (no WORLD_SIZE in the environment): the caller
        must start one process per rank (the CLI runs DeepSpeed's launcher)."""
        return self.workload.layout.world_size > 1 and "WORLD_SIZE" not in os.environ

    def run(self, on_step=None, on_status=None) -> TrainReport:
        """Open the backend (checking the table against its GPU type), train (train), close the backend.

        Args:
            on_step: called with each StepRecord as it is measured (train).
            on_status: called with a line (str) before each stage of the set-up that takes seconds (train).

        Raises:
            InvalidSettingError: read_only on the simulated backend (freqopt.gpu.backends.get_backend).
            ClockTableError: the table was searched on another GPU type than the backend's.
            NVMLError, GPUPermissionError: the real GPU cannot be opened or set.
        """
        from freqopt.gpu.specs import DEFAULT_GPU, get_gpu

        spec = self.gpu if self.backend in ("nvml", "amdsmi") else self.gpu or get_gpu(DEFAULT_GPU)
        # On nvml, in a rank the launcher started, the visible GPU of index LOCAL_RANK (local_device), as DeepSpeed
        # gives that rank cuda:LOCAL_RANK.
        from freqopt.gpu.backends import get_backend

        measuring = get_backend(self.backend, spec, seed=self.seed, read_only=self.read_only)
        try:
            with switch_latency(measuring, self.switch_s):
                if self.table is not None:
                    self.table.check_gpu(measuring.spec, source=self.table_source)  # the GPU the table is applied to
                return train(self.workload, measuring, table=self.table, steps=self.steps, compare=self.compare,
                             device=self.device, seed=self.seed, on_step=on_step, micro_batches=self.micro_batches,
                             partition_method=self.partition_method, on_status=on_status,
                             small_step=self.small_step)  # fmt: skip
        finally:
            measuring.close()


def _table_sizes(table: ClockTable, workload: Workload, sizes: dict) -> dict:
    """The get_workload overrides ``sizes`` completed from the table's workload: each one not given (None) takes the
    table's value where it differs from ``workload``'s (the model's default), so a table trains the workload it was
    found for; given ones stay (and ClockTable.check_workload refuses them if they conflict)."""
    from freqopt.workload.layout import Layout

    found = table.workload
    config = workload.config
    out = dict(sizes)
    layout = Layout(found["layout"]["dp"], found["layout"]["tp"], pp=found["layout"].get("pp", 1))
    if out["layout"] is None and (layout.dp, layout.tp, layout.pp) != (workload.layout.dp, workload.layout.tp,
                                                                        workload.layout.pp):  # fmt: skip
        out["layout"] = layout
    if out["micro_batch_size"] is None and found["micro_batch_size"] != workload.micro_batch_size:
        out["micro_batch_size"] = found["micro_batch_size"]
    for name in ("seq_len", "n_heads"):
        if out[name] is None and found[name] is not None and found[name] != getattr(config, name, None):
            out[name] = found[name]
    return out


def plan_training(model, *, table=None, steps: int = 8, backend: str = "sim", gpu=None, compare: bool = False,
                  read_only: bool = False, device: str | None = None, seed: int = 0,
                  micro_batch_size: int | None = None, seq_len: int | None = None, n_heads: int | None = None,
                  vocab_multiple: int | None = None, layout=None, switch_latency_ms: float | None = None,
                  micro_batches: int | None = None, partition_method: str | None = None,
                  small_step: bool = False) -> TrainingPlan:  # fmt: skip
    """Check every argument of a training run before any GPU is opened or rank started.

    Args:
        model: a model name (with the get_workload overrides below) or a Workload.
        table: a ClockTable, the path of one, or None (default settings). It must have been found for the
            workload trained (ClockTable.check_workload); for a model name, the layout, micro-batch, sequence
            length and heads not given are the table's (so a table transferred to dp=2 trains as dp=2, and a
            pipeline's table trains its pipeline). A pipeline layout (pp > 1) takes a pipeline table for pp stages
            (granularity "instruction", freqopt.apply.pipeline_runtime).
        steps: training steps (positive).
        backend: "sim" (the simulated GPU's timeline) or "nvml" (a real GPU).
        gpu: GPU type name or GPUSpec (default: the table's, else h100-sxm simulated / the real GPU's).
        compare: alternate blocks of steps with and without ``table`` (needs one).
        read_only: nvml only: measure at the GPU's current settings and change nothing (so no table).
        device: where the model trains; default "cuda" with nvml, "cpu" with sim.
        seed: seeds weights, tokens and the simulated noise.
        switch_latency_ms: the GPU's clock-switch latency, ms, in place of its file's (GPUSpec.with_switch_latency).
        micro_batches: a pipeline's micro-batches per step (train); default the table's, else 2 x pp.
        partition_method: a pipeline's partition of the layers into stages (train); default the table's (another
            is refused: the plan is per stage), else DeepSpeed's "parameters".
        small_step: the simulated backend only: each step runs one sequence of at most 32 tokens on this machine,
            its figures still the full workload's on the simulated GPU (the module docstring, "Small steps").

    Raises:
        UnknownNameError: unknown model, backend or GPU type.
        InvalidSettingError: a bad override, layout, steps or switch_latency_ms; compare without a table; read_only
            with one; small_step on another backend than "sim"; a CUDA device this torch cannot use
            (check_training_device); a pipeline layout with tp > 1 or of a model other than freqopt's GPT-3 ones, a
            partition method DeepSpeed does not have or another than the table's, more stages than layers;
            micro_batches or partition_method without pipeline stages.
        ClockTableError: the table cannot be read; under a pipeline layout, a table that is not a pipeline table of
            pp stages (freqopt.apply.pipeline_runtime.check_pipeline_table).
        InvalidSettingError: also training on the CPU whose ranks clearly cannot fit this machine's memory
            (check_host_memory).
        TableWorkloadError: the table was found for another model, layout, micro-batch or sequence length; the
            message names the ``freqopt transfer`` command that lays it onto this workload.
        MissingDependencyError: a tensor-parallel layout (tp > 1) without transformers, which DeepSpeed's AutoTP
            imports (check_layout_packages).
    """
    from freqopt.resolve import resolve_workload

    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    # Those that need no model built first, in the order they always had (check_training_arguments, which the
    # command line runs before it imports PyTorch), then the model's.
    checked = check_training_arguments(model, table=table, steps=steps, backend=backend, gpu=gpu, compare=compare,
                                       read_only=read_only, switch_latency_ms=switch_latency_ms,
                                       micro_batches=micro_batches, partition_method=partition_method,
                                       small_step=small_step, **sizes)  # fmt: skip
    table, source = checked.table, checked.source
    workload = resolve_workload(model, **sizes)
    if table is not None and isinstance(model, str) and workload.model == table.workload["model"]:
        workload = resolve_workload(model, **_table_sizes(table, workload, sizes))
    if workload.layout.is_pipeline:
        partition_method = _check_pipeline_training(workload, table, source, micro_batches, partition_method)
    refuse_pipeline_options(workload.layout, micro_batches, partition_method)  # the table's layout, where it set one
    check_layout_packages(workload.layout)  # the layout trained, the table's included
    if table is not None:
        table.check_workload(workload, source=source, model=model if isinstance(model, str) else None)
    device = device or ("cuda" if backend in ("nvml", "amdsmi") else "cpu")
    check_training_device(device)  # a CPU-only torch says so before a GPU is opened or ranks are started
    if not str(device).startswith("cuda"):
        # before ranks are started, rather than the out-of-memory killer after; small steps hold one sequence
        check_host_memory(replace(workload, micro_batch_size=1) if small_step else workload)
    return TrainingPlan(workload, table, source, checked.gpu, backend, device, steps, compare, read_only, seed,
                        checked.switch_s, micro_batches, partition_method, small_step)  # fmt: skip


def _check_pipeline_training(workload: Workload, table: ClockTable | None, source: str, micro_batches: int | None,
                             partition_method: str | None) -> str | None:  # fmt: skip
    """The checks of a pipeline's training run (plan_training) before ranks start; returns the partition method
    given, else the table's (None: DeepSpeed's default, "parameters")."""
    from freqopt.apply.pipeline_runtime import check_pipeline_table
    from freqopt.errors import check_positive_int
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.pipeline_partition import DEFAULT_PARTITION_METHOD, stage_parameters

    layout = workload.layout
    if layout.tp > 1:
        raise InvalidSettingError(f"layout {layout}: training a pipeline with tensor parallelism (tp > 1) is not "
                                  "supported; use dp and pp", argument="layout")  # fmt: skip
    if not isinstance(workload.config, GPTConfig):
        raise InvalidSettingError(f"layout {layout}: training a pipeline takes freqopt's GPT-3 models (see freqopt "
                                  f"models), not {workload.model}; train it with dp", argument="layout")  # fmt: skip
    check_positive_int("micro_batches", micro_batches, optional=True)
    if table is not None:
        check_pipeline_table(table, layout.pp, source=source)
        found = table.pipeline.get("partition_method", DEFAULT_PARTITION_METHOD)
        if partition_method is not None and partition_method != found:
            raise InvalidSettingError(f"partition_method {partition_method!r} is not the {found!r} the table's "
                                      "stages were partitioned with (its plan is per stage); drop it or search the "
                                      "pipeline with it", argument="partition_method")  # fmt: skip
        partition_method = found
    stage_parameters(workload.config, layout, partition_method or DEFAULT_PARTITION_METHOD)  # a bad method, pp too big
    return partition_method
