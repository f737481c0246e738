"""The DeepSpeed side of freqopt.apply.train (its module docstring): a data- or tensor-parallel rank's engine (ZeRO
stage 0, AutoTP) and a pipeline rank's stage (PipelineModule over freqopt's layer list, 1F1B), each with its DeepSpeed
configuration and the runtime that follows it, and what a pipeline's ranks asked for, gathered at the end.
"""

from __future__ import annotations

import contextlib
import io

import torch

from freqopt.gpu.backends.base import Backend
from freqopt.workload.models import Workload
from freqopt.apply.runtime import DVFSRuntime
from freqopt.tables import ClockTable
from freqopt.workload.kernels import Trace

__all__ = ["DEFAULT_MICRO_BATCHES_PER_STAGE", "SHM_COMM_OP", "init_distributed"]

DEFAULT_MICRO_BATCHES_PER_STAGE = 2  # a pipeline without a table trains 2 x pp micro-batches per step: 1F1B's
# steady state (a forward and a backward alternating) needs more micro-batches than stages


SHM_COMM_OP = "deepspeed_shm_comm"  # the name of DeepSpeed's ShareMemCommBuilder op (deepspeed/ops/op_builder/cpu)


def _status(on_status, message: str) -> None:
    if on_status is not None:
        on_status(message)


def init_distributed(*, on_cuda: bool, on_status=None) -> None:
    """Start this rank's process group through DeepSpeed (NCCL on CUDA, gloo on the CPU), telling ``on_status``.

    On CPU ranks DeepSpeed's communication backend would first JIT-compile its shared-memory all-reduce
    (ShareMemCommBuilder, op ``deepspeed_shm_comm``; deepspeed/comm/torch.py, build_shm_op, DeepSpeed 0.19), even
    with DS_BUILD_OPS=0, which only governs what ``pip install`` prebuilds: 2 min 24 s to about 4 minutes of silent
    compiling on a loaded 2-core CPU the first time, cached under
    ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR) afterwards. Only DeepSpeed's
    ``inference_all_reduce`` uses that op (AutoTP's row-parallel layers), and without it that call is
    ``torch.distributed.all_reduce`` over gloo, the same sum; so the op is marked incompatible in
    ``deepspeed.ops.__compatible_ops__`` (the dict build_shm_op checks before it builds, which DeepSpeed computes once
    and keeps so that edits persist), and no extension is compiled. Training and clocks are unchanged; only
    AutoTP's all-reduce on CPU ranks is gloo's rather than shared memory's.
    """
    import deepspeed

    if not on_cuda:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    _status(on_status, f"starting DeepSpeed's process group ({'NCCL' if on_cuda else 'gloo'})")
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")


def deepspeed_job(workload: Workload, model: torch.nn.Module, backend: Backend, table: ClockTable | None,
                  trace: Trace, *, on_cuda: bool, micro_batch_size: int | None = None,
                  on_status=None):  # fmt: skip
    """This rank of a data- or tensor-parallel job (freqopt.apply.train's module docstring): its DeepSpeed engine
    (ZeRO stage 0, AutoTP; BF16 on CUDA, torch's AdamW over DeepSpeed's FP32 master weights) and the DVFSRuntime
    following it. ``micro_batch_size``: the sequences of each batch the engine runs (default the workload's; smaller
    under train's small_step); ``on_status`` is told each stage of the set-up.

    Raises:
        MissingDependencyError: tp > 1 without transformers, which AutoTP imports (check_layout_packages; also
            checked by plan_training before any rank starts).
    """
    import deepspeed

    from freqopt.apply.train_checks import check_layout_packages
    from freqopt.workload.deepspeed_profile import adamw_factory, deepspeed_config

    check_layout_packages(workload.layout)  # in one line, before DeepSpeed's engine, not a traceback from AutoTP

    init_distributed(on_cuda=on_cuda, on_status=on_status)
    config = deepspeed_config(micro_batch_size or workload.micro_batch_size, workload.layout.tp, bf16=on_cuda)
    _status(on_status, f"building DeepSpeed's engine (ZeRO stage 0{', AutoTP' if workload.layout.tp > 1 else ''})")
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw_factory(fused=on_cuda), config=config)
    return engine, DVFSRuntime.for_deepspeed(engine, table=table, backend=backend, trace=trace)


class _StageLayer(torch.nn.Module):
    """One entry of freqopt's layer list of a GPT (pipeline_partition.pipeline_layers) as a layer of DeepSpeed's
    PipelineModule, holding the freqopt modules it runs; each layer gets a subclass named as its type
    (EmbeddingPipe, Block, LayerNorm, LMHeadPipe), which DeepSpeed's "type:REGEX" partition matches. The output
    layer holds its own copy of the tied weight (freqopt.apply.train's module docstring)."""

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


def deepspeed_pipeline_job(workload: Workload, model: torch.nn.Module, backend: Backend, table: ClockTable | None,
                           *, on_cuda: bool, micro_batches: int | None, partition_method: str | None,
                           micro_batch_size: int | None = None, on_status=None):  # fmt: skip
    """This rank's stage of the pipeline (freqopt.apply.train's module docstring, "Pipelines"): its PipelineEngine
    and PipelineRuntime. ``micro_batch_size``: the sequences of each micro-batch the engine runs (default the
    workload's; smaller under train's small_step); ``on_status`` is told each stage of the set-up."""
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
    init_distributed(on_cuda=on_cuda, on_status=on_status)
    _status(on_status, f"building DeepSpeed's PipelineModule ({layout.pp} stages, partition {partition_method!r})")
    layers = [type(layer.type_name, (_StageLayer,), {})(model, layer) for layer in pipeline_layers(model)]
    # PipelineModule prints its seed settings and the partition, layer by layer, on rank 0 (bare prints in DeepSpeed
    # 0.19's pipe/module.py): not freqopt's output; the stages are freqopt's own partition (pipeline_layers).
    with contextlib.redirect_stdout(io.StringIO()):
        module = PipelineModule(layers=layers, num_stages=layout.pp, loss_fn=_lm_loss,
                                partition_method=partition_method)  # fmt: skip
    config = {**deepspeed_config(micro_batch_size or workload.micro_batch_size, 1, bf16=on_cuda),
              "gradient_accumulation_steps": micro_batches, "steps_per_print": 2**31 - 1}  # no progress lines
    _status(on_status, f"building DeepSpeed's pipeline engine ({micro_batches} micro-batches a step, 1F1B)")
    engine, *_ = deepspeed.initialize(model=module, optimizer=adamw_factory(fused=on_cuda),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad],
                                      config=config)  # fmt: skip
    if backend.simulated:
        _status(on_status, f"tracing the {layout.pp} stages' passes for the simulated GPUs")
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


def gather_requests(runtime) -> dict:
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
