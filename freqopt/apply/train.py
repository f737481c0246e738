"""``freqopt train``: train a model on synthetic tokens under the DVFS runtime and report time and energy per step.

On the simulated backend the model trains for real on this machine's CPU (a small configuration), the runtime
follows its phases through the module hooks, and each step's GPU time and energy come from the simulated GPU
running the traced iteration with the settings the runtime asked for (switch latency included). On the nvml
backend the model trains on the GPU: each step is timed by CUDA events, and energy is the counter's delta over each
block of consecutive steps with the same clocks. With a layout of more than one rank the job runs under DeepSpeed
(ZeRO stage 0 data parallelism, AutoTP tensor parallelism), started with DeepSpeed's launcher.

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
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass

import torch

from freqopt.gpu.backends.base import Backend, Measurement, switch_latency
from freqopt.errors import InvalidSettingError
from freqopt.workload.memory import StepMemory, estimate_step_memory, workload_label
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.ops import MixedPrecisionAdamW
from freqopt.workload.phases import quiet_backward_hooks
from freqopt.apply.runtime import DVFSRuntime, plan_phases
from freqopt.tables import ClockTable
from freqopt.workload.trace import trace_training_iteration

DEFAULT_MICRO_BATCHES_PER_STAGE = 2  # a pipeline without a table trains 2 x pp micro-batches per step: 1F1B's
# steady state (a forward and a backward alternating) needs more micro-batches than stages

__all__ = ["StepRecord", "TrainReport", "TrainingPlan", "plan_training", "check_training_device", "synthetic_batch",
           "train", "training_memory", "host_memory_bytes", "check_host_memory", "host_memory_report"]


@dataclass(frozen=True)
class StepRecord:
    """One step: with the table or not, its GPU time and energy (per step; a block's mean on a real GPU)."""

    step: int
    with_table: bool
    time_s: float
    energy_j: float


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


def synthetic_batch(workload: Workload, generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of synthetic language-model data: tokens (B, T) drawn from the tokenizer's vocabulary (not its
    padding) and their targets (B, T), the next tokens, both on ``device``."""
    config = workload.config
    tokens = torch.randint(0, config.vocab_size, (workload.micro_batch_size, config.seq_len + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def check_training_device(device: str) -> None:
    """Check that this torch can train on ``device`` ("cpu", "cuda", "cuda:N").

    Raises:
        InvalidSettingError: ``device`` is CUDA and this torch is a CPU build (``torch.version.cuda`` is None) or
            sees no CUDA device; the message says what to install or to train on "cpu".
    """
    if not str(device).startswith("cuda"):
        return
    if torch.version.cuda is None:
        raise InvalidSettingError(
            f"device {device!r}: torch {torch.__version__} is a CPU build; install a CUDA build of torch (on Linux "
            "x86-64 a plain `pip install 'torch>=2.4,<2.14'` from PyPI is one) or train on device 'cpu'"
        )
    if not torch.cuda.is_available():
        raise InvalidSettingError(
            f"device {device!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; check the "
            "NVIDIA driver and CUDA_VISIBLE_DEVICES, or train on device 'cpu'"
        )


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


def train(workload: Workload, backend: Backend, *, table: ClockTable | None, steps: int, compare: bool = False,
          device: str = "cpu", seed: int = 0, on_step=None, micro_batches: int | None = None,
          partition_method: str | None = None) -> TrainReport:  # fmt: skip
    """Train ``workload`` for ``steps`` steps on synthetic tokens under the DVFS runtime (module docstring).

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
        on_step: called with each StepRecord (progress; on the nvml backend at the end of each block).
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
    torch.manual_seed(seed)
    layout = workload.layout
    on_cuda = str(device).startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    trace = None if layout.is_pipeline else trace_training_iteration(workload)  # a pipeline's stages: its runtime's
    model = build_model(workload.config, device=device, dtype=torch.float32)
    engine = pipeline = None
    if layout.is_pipeline:
        engine, runtime = _pipeline_job(workload, model, backend, table, on_cuda=on_cuda, micro_batches=micro_batches,
                                        partition_method=partition_method)  # fmt: skip
        pipeline = True
        data_rank = engine.grid.get_data_parallel_rank()  # the first and last stages load the same micro-batches
        table_plan = default_plan = None
    elif layout.world_size > 1:
        import deepspeed

        from freqopt.workload.deepspeed_profile import adamw_factory, deepspeed_config

        deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")
        config = deepspeed_config(workload.micro_batch_size, layout.tp, bf16=dtype == torch.bfloat16)
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw_factory(fused=on_cuda), config=config)
        runtime = DVFSRuntime.for_deepspeed(engine, table=table, backend=backend, trace=trace)
        data_rank = int(os.environ.get("RANK", "0")) // layout.tp
        table_plan, default_plan = runtime.plan, plan_phases(None, trace, backend)
    else:
        model = model.to(dtype)
        optimizer = MixedPrecisionAdamW(model.parameters())  # GPT-3's AdamW settings, clipping at 1.0
        runtime = DVFSRuntime(model, optimizer, table=table, backend=backend, trace=trace)
        data_rank = 0
        table_plan, default_plan = runtime.plan, plan_phases(None, trace, backend)
    generator = torch.Generator().manual_seed(seed + 1000 * data_rank)
    schedule = _blocks(steps, compare, table is not None)
    records, losses = [], []
    block: list[tuple[int, bool, float]] = []  # (step, with_table, time_s) of the real GPU's current block
    energy_before = None
    with runtime:
        for i, with_table in enumerate(schedule):
            if pipeline:
                runtime.use_table = with_table
                batches = [synthetic_batch(workload, generator, device) for _ in range(runtime.micro_batches)]
            else:
                runtime.plan = table_plan if with_table else default_plan
                idx, targets = synthetic_batch(workload, generator, device)
            if not runtime.simulated and energy_before is None:
                if on_cuda:
                    torch.cuda.synchronize(device)
                energy_before = backend.energy_j()  # the block starts
            if on_cuda:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
            started = time.perf_counter()
            if pipeline:
                loss = engine.train_batch(data_iter=iter(batches))  # M micro-batches, 1F1B, the optimizer step
            elif engine is not None:
                loss = engine(idx, targets)
                with quiet_backward_hooks():
                    engine.backward(loss)
                engine.step()
            else:
                loss = model(idx, targets)
                with quiet_backward_hooks():
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if on_cuda:
                end_event.record()
            losses.append(float(loss.detach()))  # waits for the step on CUDA
            if runtime.simulated:
                m = runtime.step_measurement()
                records.append(StepRecord(i, with_table, m.time_s, m.energy_j))
                if on_step:
                    on_step(records[-1])
                continue
            if on_cuda:
                end_event.synchronize()
                block.append((i, with_table, start_event.elapsed_time(end_event) / 1000.0))
            else:
                block.append((i, with_table, time.perf_counter() - started))
            if i + 1 == len(schedule) or schedule[i + 1] != with_table:  # the block ends
                energy_j = (backend.energy_j() - energy_before) / len(block)
                for step, on_table, time_s in block:
                    records.append(StepRecord(step, on_table, time_s, energy_j))
                    if on_step:
                        on_step(records[-1])
                block, energy_before = [], None
    pipeline = _gather_requests(runtime) if pipeline else None
    return TrainReport(tuple(records), losses[0], losses[-1], runtime.switches / max(steps, 1), backend.spec.name,
                       pipeline)  # fmt: skip


class _StageLayer(torch.nn.Module):
    """One entry of freqopt's layer list of a GPT (pipeline_partition.pipeline_layers) as a layer of DeepSpeed's
    PipelineModule, holding the freqopt modules it runs; each layer gets a subclass named as its type
    (EmbeddingPipe, Block, LayerNorm, LMHeadPipe), which DeepSpeed's "type:REGEX" partition matches. The output
    layer holds its own copy of the tied weight (module docstring)."""

    def __init__(self, model: torch.nn.Module, layer):
        super().__init__()
        self.role = layer.name
        if layer.name == "lm_head":
            head = model.lm_head
            self.inner = torch.nn.Linear(head.in_features, head.out_features, bias=False)
            self.inner.weight.data.copy_(head.weight.data)
        elif layer.name == "embedding":
            self.wte, self.wpe = model.wte, model.wpe
        else:
            self.inner = model.get_submodule(layer.modules[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.role == "embedding":  # x: token ids (B, T)
            return self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))  # (B, T, d)
        return self.inner(x)  # a block or the final norm: (B, T, d); the output layer: logits (B, T, V)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss (PipelineModule's loss_fn): mean cross-entropy of logits (B, T, V) on targets (B, T),
    as GPTModel.forward computes it."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _pipeline_job(workload: Workload, model: torch.nn.Module, backend: Backend, table: ClockTable | None, *,
                  on_cuda: bool, micro_batches: int | None, partition_method: str | None):  # fmt: skip
    """This rank's stage of the pipeline (module docstring, "Pipelines"): its PipelineEngine and PipelineRuntime."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from freqopt.apply.pipeline_runtime import PipelineRuntime, check_pipeline_table
    from freqopt.workload.deepspeed_profile import adamw_factory, deepspeed_config
    from freqopt.workload.pipeline_partition import pipeline_layers
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    layout = workload.layout
    if table is not None:
        check_pipeline_table(table, layout.pp)
    micro_batches, partition_method = _pipeline_defaults(table, layout, micro_batches, partition_method)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")
    layers = [type(layer.type_name, (_StageLayer,), {})(model, layer) for layer in pipeline_layers(model)]
    # PipelineModule prints its seed settings and the partition, layer by layer, on rank 0 (bare prints in DeepSpeed
    # 0.19's pipe/module.py): not freqopt's output; the stages are freqopt's own partition (pipeline_layers).
    with contextlib.redirect_stdout(io.StringIO()):
        module = PipelineModule(layers=layers, num_stages=layout.pp, loss_fn=_lm_loss,
                                partition_method=partition_method)  # fmt: skip
    config = {**deepspeed_config(workload.micro_batch_size, 1, bf16=on_cuda),
              "gradient_accumulation_steps": micro_batches, "steps_per_print": 2**31 - 1}  # no progress lines
    engine, *_ = deepspeed.initialize(model=module, optimizer=adamw_factory(fused=on_cuda),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad],
                                      config=config)  # fmt: skip
    traces = trace_pipeline_stages(workload, partition_method=partition_method) if backend.simulated else None
    return engine, PipelineRuntime(engine, table=table, backend=backend, stage_traces=traces)


def _pipeline_defaults(table: ClockTable | None, layout, micro_batches: int | None,
                       partition_method: str | None) -> tuple[int, str]:  # fmt: skip
    """A pipeline's micro-batches per step and partition method: as given, else the table's, else 2 x pp and
    DeepSpeed's "parameters"."""
    from freqopt.workload.pipeline_partition import DEFAULT_PARTITION_METHOD

    pipeline = table.pipeline if table is not None else {}
    if micro_batches is None:
        micro_batches = pipeline.get("micro_batches", DEFAULT_MICRO_BATCHES_PER_STAGE * layout.pp)
    if partition_method is None:
        partition_method = pipeline.get("partition_method", DEFAULT_PARTITION_METHOD)
    return micro_batches, partition_method


def _gather_requests(runtime) -> dict:
    """What every rank's PipelineRuntime asked for (TrainReport.pipeline), gathered on every rank (gloo or NCCL
    all_gather_object), then the ranks' process group closed: every rank gets here after its last step, so none
    tears gloo down while a peer still transfers."""
    import torch.distributed as dist

    mine = {"rank": dist.get_rank(), "stage": runtime.stage,
            "requested_sm_clock_mhz": [[s.sm_clock_mhz for s in step] for step in runtime.requested]}  # fmt: skip
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    dist.barrier()
    dist.destroy_process_group()
    return {"stages": runtime.stages, "micro_batches": runtime.micro_batches,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}  # fmt: skip


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

    @property
    def needs_launcher(self) -> bool:
        """More than one rank, and not yet started by a launcher (no WORLD_SIZE in the environment): the caller
        must start one process per rank (the CLI runs DeepSpeed's launcher)."""
        return self.workload.layout.world_size > 1 and "WORLD_SIZE" not in os.environ

    def run(self, on_step=None) -> TrainReport:
        """Open the backend (checking the table against its GPU type), train (train), close the backend.

        Raises:
            InvalidSettingError: read_only on the simulated backend (freqopt.gpu.backends.get_backend).
            ClockTableError: the table was searched on another GPU type than the backend's.
            NVMLError, GPUPermissionError: the real GPU cannot be opened or set.
        """
        from freqopt.gpu.specs import DEFAULT_GPU, get_gpu

        spec = self.gpu if self.backend == "nvml" else self.gpu or get_gpu(DEFAULT_GPU)
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
                             partition_method=self.partition_method)  # fmt: skip
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
                  micro_batches: int | None = None, partition_method: str | None = None) -> TrainingPlan:  # fmt: skip
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

    Raises:
        UnknownNameError: unknown model, backend or GPU type.
        InvalidSettingError: a bad override, layout, steps or switch_latency_ms; compare without a table; read_only
            with one; a CUDA device this torch cannot use (check_training_device); a pipeline layout with tp > 1 or
            of a model other than freqopt's GPT-3 ones, a partition method DeepSpeed does not have or another than
            the table's, more stages than layers; micro_batches or partition_method without pipeline stages.
        ClockTableError: the table cannot be read; under a pipeline layout, a table that is not a pipeline table of
            pp stages (freqopt.apply.pipeline_runtime.check_pipeline_table).
        InvalidSettingError: also training on the CPU whose ranks clearly cannot fit this machine's memory
            (check_host_memory).
        TableWorkloadError: the table was found for another model, layout, micro-batch or sequence length; the
            message names the ``freqopt transfer`` command that lays it onto this workload.
    """
    from freqopt.errors import check_positive_int
    from freqopt.gpu.specs import check_switch_latency_ms
    from freqopt.resolve import resolve_gpu, resolve_workload
    from freqopt.gpu.backends import check_backend
    from freqopt.tables import load_table

    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    workload = resolve_workload(model, **sizes)
    check_backend(backend)
    check_positive_int("steps", steps)
    switch_s = check_switch_latency_ms(switch_latency_ms)
    if compare and table is None:
        raise InvalidSettingError("compare needs a table: it alternates steps with and without the table",
                                  argument="compare")  # fmt: skip
    if read_only and table is not None:
        raise InvalidSettingError("read_only cannot apply a table (that changes clocks); drop one of them",
                                  argument="read_only")  # fmt: skip
    if table is not None and not isinstance(table, ClockTable):
        table = load_table(table)
    source = "clock table" if table is None else table.source or "the clock table"
    if table is not None and isinstance(model, str) and workload.model == table.workload["model"]:
        workload = resolve_workload(model, **_table_sizes(table, workload, sizes))
    if workload.layout.is_pipeline:
        partition_method = _check_pipeline_training(workload, table, source, micro_batches, partition_method)
    elif micro_batches is not None or partition_method is not None:
        name = "micro_batches" if micro_batches is not None else "partition_method"
        raise InvalidSettingError(f"{name} applies to a pipeline layout (pp > 1), not {workload.layout}",
                                  argument=name)  # fmt: skip
    if table is not None:
        table.check_workload(workload, source=source)
    requested = resolve_gpu(gpu) if gpu is not None else (resolve_gpu(table.gpu) if table is not None else None)
    device = device or ("cuda" if backend == "nvml" else "cpu")
    check_training_device(device)  # a CPU-only torch says so before a GPU is opened or ranks are started
    if not str(device).startswith("cuda"):
        check_host_memory(workload)  # before ranks are started, rather than the out-of-memory killer after
    return TrainingPlan(workload, table, source, requested, backend, device, steps, compare, read_only, seed,
                        switch_s, micro_batches, partition_method)  # fmt: skip


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
