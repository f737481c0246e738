"""The per-rank training loop of freqopt.apply.train (its module docstring): the model built for this rank (one GPU,
a DeepSpeed engine, or a pipeline stage: freqopt.apply.train_deepspeed), synthetic tokens, and each step's time and
energy under the DVFS runtime, with the table or at the defaults.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import Backend, Measurement
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.ops import MixedPrecisionAdamW
from freqopt.workload.phases import quiet_backward_hooks
from freqopt.apply.runtime import DVFSRuntime, plan_phases
from freqopt.apply.train_checks import check_training_device
from freqopt.apply.train_deepspeed import deepspeed_job, deepspeed_pipeline_job, gather_requests
from freqopt.tables import ClockTable
from freqopt.workload.trace import trace_training_iteration

__all__ = ["SMALL_STEP_MICRO_BATCH_SIZE", "SMALL_STEP_SEQ_LEN", "StepRecord", "TrainReport", "batch_shape",
           "synthetic_batch", "train"]

# train's small_step: the batch each step runs on this machine's CPU, one sequence of at most 32 tokens. Chosen, not
# derived: a gpt3-small step (125 M parameters, FP32 AdamW) takes 1.0 s on a 2-core CPU, where its full
# 4 x 2048 tokens take 127 s, and it still runs every module the phases hook.
SMALL_STEP_MICRO_BATCH_SIZE = 1
SMALL_STEP_SEQ_LEN = 32


@dataclass(frozen=True)
class StepRecord:
    """One step: with the table or not, its GPU time and energy (per step; a block's mean on a real GPU), and the
    seconds it took on this machine (wall clock: on the simulated backend the CPU's run of the step, which is not
    the simulated GPU's time_s)."""

    step: int
    with_table: bool
    time_s: float
    energy_j: float
    wall_s: float | None = None


@dataclass(frozen=True)
class TrainReport:
    steps: tuple[StepRecord, ...]
    loss_first: float
    loss_last: float
    switches_per_step: float
    gpu_name: str = ""  # the GPU type measured on (GPUSpec.name)
    # A pipeline's: {"stages", "micro_batches", "ranks": [{"rank", "stage", "requested_sm_clock_mhz": per step the
    # SM clock (MHz, None: the default) each forward and backward pass asked for, in the stage's 1F1B order}]}.
    pipeline: dict | None = None

    def mean(self, with_table: bool) -> Measurement | None:
        rows = [s for s in self.steps if s.with_table == with_table]
        if not rows:
            return None
        return Measurement(sum(r.time_s for r in rows) / len(rows), sum(r.energy_j for r in rows) / len(rows))

    def summary(self) -> dict:
        on, off = self.mean(True), self.mean(False)
        doc = {"steps": [vars(s) for s in self.steps], "loss_first": self.loss_first, "loss_last": self.loss_last,
               "switches_per_step": self.switches_per_step}  # fmt: skip
        for name, m in (("with_table", on), ("default", off)):
            if m is not None:
                doc[name] = {"time_s_per_step": m.time_s, "energy_j_per_step": m.energy_j}
        if on is not None and off is not None:
            doc["energy_saved_pct"] = 100.0 * (1.0 - on.energy_j / off.energy_j)
            doc["slowdown_pct"] = 100.0 * (on.time_s / off.time_s - 1.0)
        if self.pipeline is not None:
            doc["pipeline"] = self.pipeline
        return doc


def _blocks(steps: int, compare: bool, has_table: bool) -> list[bool]:
    """Per step, whether the table is applied: all steps, or (compare) alternating blocks of a quarter each."""
    if not compare:
        return [has_table] * steps
    block = max(1, steps // 4)
    return [(i // block) % 2 == 0 for i in range(steps)]


def batch_shape(workload: Workload, small_step: bool = False) -> tuple[int, int]:
    """(B, T) of the batches ``train`` runs: the workload's micro-batch and sequence length, or with ``small_step``
    SMALL_STEP_MICRO_BATCH_SIZE sequences of at most SMALL_STEP_SEQ_LEN tokens."""
    if small_step:
        return SMALL_STEP_MICRO_BATCH_SIZE, min(SMALL_STEP_SEQ_LEN, workload.config.seq_len)
    return workload.micro_batch_size, workload.config.seq_len


def synthetic_batch(workload: Workload, generator: torch.Generator, device: str,
                    shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One batch of synthetic language-model data: tokens (B, T) drawn from the tokenizer's vocabulary (not its
    padding) and their targets (B, T), the next tokens, both on ``device``. ``shape``: (B, T), default the
    workload's micro-batch and sequence length (batch_shape)."""
    config = workload.config
    b, t = shape if shape is not None else batch_shape(workload)
    tokens = torch.randint(0, config.vocab_size, (b, t + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)



def train(workload: Workload, backend: Backend, *, table: ClockTable | None, steps: int, compare: bool = False,
          device: str = "cpu", seed: int = 0, on_step=None, micro_batches: int | None = None,
          partition_method: str | None = None, on_status=None, small_step: bool = False) -> TrainReport:  # fmt: skip
    """Train ``workload`` for ``steps`` steps on synthetic tokens under the DVFS runtime (freqopt.apply.train's
    module docstring).

    The optimizer is the one freqopt's trace models: on one rank ``MixedPrecisionAdamW`` (FP32 master weights,
    one fused AdamW kernel; BF16 weights on CUDA, FP32 on the CPU), gradients clipped at 1.0; under DeepSpeed
    torch's AdamW (fused on CUDA, foreach on the CPU) over DeepSpeed's FP32 master weights, with BF16 weights on
    CUDA and the same clipping.

    Args:
        workload: model, micro-batch and layout (a layout of more than one rank needs the DeepSpeed launcher's
            environment: RANK, WORLD_SIZE).
        backend: SimulatedGPU or NVMLBackend; closed (GPU restored) when training ends, however it ends.
        table: the clock table, or None for default settings.
        steps: training steps.
        compare: alternate blocks with and without the table.
        device: where the model trains ("cuda" with the nvml backend; "cpu" trains there, the GPU idling).
        on_step: called with each StepRecord as it is measured (progress; on the nvml backend at the end of each
            block of steps with the same clocks).
        on_status: called with a short line (str) before each stage of the set-up that can take seconds (tracing,
            building the model, starting DeepSpeed), so that a caller can say what the run is doing.
        small_step: the simulated backend only: each step runs on this machine one sequence of at most
            SMALL_STEP_SEQ_LEN tokens (batch_shape) instead of the workload's micro-batch, while its time and energy
            remain the simulated GPU's for the workload's traced iteration with the settings the runtime asked for.
            The runtime follows module hooks and the optimizer step, whose order does not depend on the batch's
            shape, so the requests, switches and figures are the full step's; only the loss is the small batch's
            (freqopt.apply.train's module docstring).
        micro_batches: a pipeline's micro-batches per step (DeepSpeed's gradient_accumulation_steps); default the
            table's, else 2 x pp. Another count than the table's re-plans from its fronts (stage_schedule).
        partition_method: a pipeline's partition of the layers (DeepSpeed's: "parameters", "uniform",
            "type:REGEX"); default the table's, else "parameters".

    Returns:
        TrainReport. On the simulated backend each step's time and energy are the simulated GPU's. On the nvml
        backend each step's time is its own (CUDA events when training on CUDA, else wall time), and its energy
        the mean over its block of consecutive steps with the same clocks (the counter's delta over the block),
        since NVML's energy counter moves only every few tens of milliseconds; a block shorter than that reads
        a coarse or zero energy.

    Raises:
        InvalidSettingError: see ``check_training_device``.
        ClockTableError: a pipeline given a table that is not a pipeline table of pp stages (check_pipeline_table).
    """
    check_training_device(device)
    if small_step and not backend.simulated:
        raise InvalidSettingError("small_step applies to the simulated backend, whose step figures come from the "
                                  "trace; on a real GPU the step measured is the step run",
                                  argument="small_step")  # fmt: skip
    torch.manual_seed(seed)
    shape = batch_shape(workload, small_step)
    job = _training_job(workload, backend, table, device=device, micro_batches=micro_batches,
                        partition_method=partition_method, micro_batch_size=shape[0], on_status=on_status)  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 1000 * job.data_rank)
    schedule = _blocks(steps, compare, table is not None)
    if on_status is not None:
        on_status(f"training {steps} step{'s' * (steps > 1)} of {shape[0]} x {shape[1]} tokens on {device}")
    with job.runtime:
        records, losses = _run_steps(job, workload, backend, schedule, generator, device, on_step, shape)
    pipeline = gather_requests(job.runtime) if job.pipeline else None
    return TrainReport(tuple(records), losses[0], losses[-1], job.runtime.switches / max(steps, 1), backend.spec.name,
                       pipeline)  # fmt: skip


@dataclass(frozen=True)
class _Job:
    """This rank's training set up (_training_job).

    Attributes:
        model: the model (on one GPU, what the optimizer steps; else the engine's module).
        engine: DeepSpeed's engine (a PipelineEngine for a pipeline), or None on one GPU.
        optimizer: MixedPrecisionAdamW on one GPU, else None (the engine's own).
        runtime: the DVFSRuntime, or a pipeline's PipelineRuntime.
        data_rank: this rank's data-parallel index (it seeds the tokens: the ranks of one replica load the same).
        table_plan, default_plan: the runtime's plans with the table and at default settings (None for a pipeline,
            whose runtime switches with use_table).
        pipeline: whether this is a pipeline's stage.
    """

    model: torch.nn.Module
    engine: object
    optimizer: object
    runtime: object
    data_rank: int
    table_plan: object = None
    default_plan: object = None
    pipeline: bool = False


def _training_job(workload: Workload, backend: Backend, table: ClockTable | None, *, device: str,
                  micro_batches: int | None, partition_method: str | None, micro_batch_size: int,
                  on_status=None) -> _Job:  # fmt: skip
    """Build this rank's model (FP32, cast to BF16 on one CUDA GPU) and its training: a pipeline's stage
    (deepspeed_pipeline_job), a DeepSpeed engine for more than one rank (deepspeed_job), or MixedPrecisionAdamW on
    one GPU; each with its runtime. ``micro_batch_size``: of the batches run (batch_shape); ``on_status``: train's."""

    def status(message: str) -> None:
        if on_status is not None:
            on_status(message)

    layout = workload.layout
    on_cuda = str(device).startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    trace = None
    if not layout.is_pipeline:  # a pipeline's stages: its runtime's
        status(f"tracing one training iteration of {workload.model} (the phases the runtime follows)")
        trace = trace_training_iteration(workload)
    status(f"building {workload.model} on {device}")
    model = build_model(workload.config, device=device, dtype=torch.float32)
    if layout.is_pipeline:
        engine, runtime = deepspeed_pipeline_job(workload, model, backend, table, on_cuda=on_cuda,
                                                 micro_batches=micro_batches, partition_method=partition_method,
                                                 micro_batch_size=micro_batch_size, on_status=on_status)  # fmt: skip
        # The first and last stages load the same micro-batches.
        return _Job(model, engine, None, runtime, engine.grid.get_data_parallel_rank(), pipeline=True)
    if layout.world_size > 1:
        engine, runtime = deepspeed_job(workload, model, backend, table, trace, on_cuda=on_cuda,
                                        micro_batch_size=micro_batch_size, on_status=on_status)  # fmt: skip
        data_rank = int(os.environ.get("RANK", "0")) // layout.tp
        return _Job(model, engine, None, runtime, data_rank, runtime.plan, plan_phases(None, trace, backend))
    model = model.to(dtype)
    optimizer = MixedPrecisionAdamW(model.parameters())  # GPT-3's AdamW settings, clipping at 1.0
    runtime = DVFSRuntime(model, optimizer, table=table, backend=backend, trace=trace)
    return _Job(model, None, optimizer, runtime, 0, runtime.plan, plan_phases(None, trace, backend))


def _next_batch(job: _Job, workload: Workload, generator: torch.Generator, device: str, with_table: bool,
                shape: tuple[int, int]):  # fmt: skip
    """Set the runtime to the table's clocks or the defaults' for the next step, and make its synthetic batch of
    ``shape`` (B, T) (a pipeline's: one per micro-batch)."""
    if job.pipeline:
        job.runtime.use_table = with_table
        return [synthetic_batch(workload, generator, device, shape) for _ in range(job.runtime.micro_batches)]
    job.runtime.plan = job.table_plan if with_table else job.default_plan
    return synthetic_batch(workload, generator, device, shape)


def _compute_step(job: _Job, batch) -> torch.Tensor:
    """One training step on ``batch`` (forward, backward, optimizer step); its loss."""
    if job.pipeline:
        return job.engine.train_batch(data_iter=iter(batch))  # M micro-batches, 1F1B, the optimizer step
    idx, targets = batch
    if job.engine is not None:
        loss = job.engine(idx, targets)
        with quiet_backward_hooks():
            job.engine.backward(loss)
        job.engine.step()
        return loss
    loss = job.model(idx, targets)
    with quiet_backward_hooks():
        loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    return loss


def _run_steps(job: _Job, workload: Workload, backend: Backend, schedule: list[bool], generator: torch.Generator,
               device: str, on_step, shape: tuple[int, int]) -> tuple[list[StepRecord], list[float]]:  # fmt: skip
    """Run the steps (``schedule``: per step, whether with the table); their records and losses. On the simulated
    backend each step's figures are the runtime's; on a real GPU each step's time is its own (CUDA events, else wall
    time) and its energy the mean over its block of consecutive steps with the same clocks (train)."""
    runtime, on_cuda = job.runtime, str(device).startswith("cuda")
    records, losses = [], []
    block: list[tuple[int, bool, float, float]] = []  # (step, with_table, time_s, wall_s) of the GPU's current block
    energy_before = None
    for i, with_table in enumerate(schedule):
        batch = _next_batch(job, workload, generator, device, with_table, shape)
        if not runtime.simulated and energy_before is None:
            if on_cuda:
                torch.cuda.synchronize(device)
            energy_before = backend.energy_j()  # the block starts
        if on_cuda:
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
        started = time.perf_counter()
        loss = _compute_step(job, batch)
        if on_cuda:
            end_event.record()
        losses.append(float(loss.detach()))  # waits for the step on CUDA
        wall_s = time.perf_counter() - started
        if runtime.simulated:
            m = runtime.step_measurement()
            records.append(StepRecord(i, with_table, m.time_s, m.energy_j, wall_s))
            if on_step:
                on_step(records[-1])
            continue
        if on_cuda:
            end_event.synchronize()
            block.append((i, with_table, start_event.elapsed_time(end_event) / 1000.0, wall_s))
        else:
            block.append((i, with_table, wall_s, wall_s))
        if i + 1 == len(schedule) or schedule[i + 1] != with_table:  # the block ends
            energy_j = (backend.energy_j() - energy_before) / len(block)
            for step, on_table, time_s, step_wall_s in block:
                records.append(StepRecord(step, on_table, time_s, energy_j, step_wall_s))
                if on_step:
                    on_step(records[-1])
            block, energy_before = [], None
    return records, losses
