"""Trace each pipeline stage of a ``pp > 1`` layout: the forward and the backward of one micro-batch, on the meta device.

A pipeline iteration (DeepSpeed's PipelineEngine, 1F1B) is, per stage, M forward and M backward instructions of one
micro-batch each, joined by P2P transfers between neighbouring stages; the schedule and the planner on top of it are
freqopt.pipeline.dag's. This module gives what one stage runs for one micro-batch (a ``StageTrace``):

* the stage's layers (freqopt.workload.pipeline_partition: DeepSpeed's partition methods over the model's layer
  list), traced by freqopt.workload.trace's recorder as a whole iteration is: stage 0 starts from the token ids at
  the embedding, the last stage ends with the output layer and the loss;
* forward: a receive of the activations from the previous stage (all stages but the first) before the layers, and
  a send of the stage's output to the next (all but the last) after them; backward: a receive of the output's
  gradient (all but the last; the last starts from its loss), then the layers' backward, then a send of the input's
  gradient (all but the first). Each transfer is micro_batch x seq_len x d_model elements of the activations' dtype
  (what DeepSpeed's ``p2p.send``/``p2p.recv`` move; its PipelineEngine sends the whole activation from every
  tensor-parallel rank);
* tensor parallelism inside each stage composes: the stage's layers are AutoTP-sharded as in a dp/tp trace, with
  their all-reduces (freqopt.workload.models.parallel).

A transfer is a collective-like Kernel (kind "send" or "recv", group of 2 ranks, ``group_stride`` dp x tp: stages
are the layout's outermost axis, so the group spans nodes when 2 x dp x tp exceeds the GPUs per node) on the
training stream (DeepSpeed's transfers block the stage). The simulated GPU times any collective as a ring all-reduce
(freqopt.gpu.backends.physics): over a group of two that is its bytes over the link bandwidth, a P2P transfer's time,
plus two link latencies where one P2P message has one.

Not in a StageTrace: the optimizer step, the data-parallel gradient all-reduce and the tied embedding's gradient
all-reduce between the first and last stage, which DeepSpeed runs once per iteration after all micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.workload.kernels import Kernel, Trace, dtype_name
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.meta_checks import MetaChecks
from freqopt.workload.models.parallel import COMPUTE_STREAM, shard_tensor_parallel
from freqopt.workload.models.sdpa import FusedSDPA
from freqopt.workload.pipeline_partition import (DEFAULT_PARTITION_METHOD, PipelineStage, partition_stages,
                                                 stage_module_parameters)
from freqopt.workload.trace import KernelRecorder

__all__ = ["StageTrace", "trace_pipeline_stages", "P2P_KINDS", "SPLIT_PASSES", "split_backward"]

P2P_KINDS = ("send", "recv")
# The zero-bubble schedules' two halves of a backward (freqopt.pipeline.schedules): the input gradient, which the
# previous stage waits for, and the weight gradient, which nothing waits for but the optimizer step.
SPLIT_PASSES = ("backward_input", "backward_weight")


def split_backward(kernels, tokens: int) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """A backward's kernels split into its input-gradient and weight-gradient instructions, each in issue order.

    A linear layer's backward runs two GEMMs: dX = dY W (inner dimension: the layer's output width) and
    dW = dY^T X, whose inner dimension is the micro-batch's ``tokens`` (rows of every activation); its bias
    gradient sums dY over the tokens. Those (``aten.mm``/``aten.addmm`` with inner dimension ``tokens``, and
    ``aten.sum`` of a (tokens, width) gradient) and the embedding's backward are the weight gradient; everything else, fused attention's and the
    layer norms' backward (whose weight gradients come out of the same kernel), the elementwise backwards and the
    P2P transfers, is the input gradient. A layer whose output width equals ``tokens`` would be counted on the
    weight side; the split is freqopt's reading of the kernels, not traced from two autograd passes.
    """
    inner_arg = {"aten.mm": 0, "aten.addmm": 1}  # the operand whose last dimension is the GEMM's inner one

    def weight(k: Kernel) -> bool:
        if k.name == "aten.embedding_dense_backward":  # the embedding's weight gradient, all of its backward
            return True
        if k.name in inner_arg:
            arg = inner_arg[k.name]
            return len(k.shapes) > arg and bool(k.shapes[arg]) and k.shapes[arg][-1] == tokens
        return k.name == "aten.sum" and bool(k.shapes) and len(k.shapes[0]) == 2 and k.shapes[0][0] == tokens

    flags = [weight(k) for k in kernels]
    return (tuple(k for k, w in zip(kernels, flags) if not w), tuple(k for k, w in zip(kernels, flags) if w))


@dataclass(frozen=True)
class StageTrace:
    """The kernels one rank of one pipeline stage runs for one micro-batch: its forward, then its backward.

    Attributes:
        workload: the model, micro-batch (sequences per micro-batch) and layout (pp stages).
        stage: the stage's layers (PipelineStage: its index, its layers and their unsharded parameter counts).
        kernels: in issue order; pass_name "forward" or "backward"; P2P transfers have kind "send" or "recv".
        n_params: trainable parameters one rank of the stage holds (tensor-parallel sharded; the tied output
            layer's weight counted on the last stage as on the first).
        partition_method: how the layers were partitioned (freqopt.workload.pipeline_partition).
    """

    workload: Workload
    stage: PipelineStage
    kernels: tuple[Kernel, ...]
    n_params: int
    partition_method: str = DEFAULT_PARTITION_METHOD
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def index(self) -> int:
        return self.stage.stage

    def pass_kernels(self, pass_name: str) -> tuple[Kernel, ...]:
        """The kernels of one pass ("forward" or "backward"), in issue order; "backward_input" and
        "backward_weight": the backward split as the zero-bubble schedules run it (split_backward)."""
        if pass_name in SPLIT_PASSES:
            return split_backward(self.pass_kernels("backward"), self.tokens)[SPLIT_PASSES.index(pass_name)]
        return tuple(k for k in self.kernels if k.pass_name == pass_name)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch (sequences x sequence length): the rows of every activation."""
        return self.workload.micro_batch_size * self.workload.config.seq_len

    @property
    def p2p_kernels(self) -> tuple[Kernel, ...]:
        """The sends and receives, in issue order."""
        return tuple(k for k in self.kernels if k.kind in P2P_KINDS)

    @property
    def total_flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    def as_trace(self) -> Trace:
        """The stage's kernels as a Trace (for a backend to time): meta holds the stage, the stage count, the
        layers, the parameter count and mode "train"."""
        meta = {"n_params": self.n_params, "mode": "train", "layout": self.workload.layout.as_dict(),
                "stage": self.index, "stages": self.stage.stages, "layers": tuple(l.name for l in self.stage.layers),
                "partition_method": self.partition_method, "marks": ()}  # fmt: skip
        return Trace(workload=self.workload, kernels=self.kernels, meta=meta)

    def __repr__(self) -> str:
        first, last = self.stage.layers[0].name, self.stage.layers[-1].name
        return (f"StageTrace(stage {self.index} of {self.stage.stages}, layers {first}..{last}, "
                f"{len(self.kernels)} kernels, {self.total_flops / 1e12:.3g} TFLOP, {self.n_params / 1e6:,.1f} M params)")


def _p2p_kernel(kind: str, x: torch.Tensor, pass_name: str, group_stride: int) -> Kernel:
    """A send or receive of x to or from the neighbouring stage: reads (send) or writes (recv) its bytes in device
    memory and moves them over the link."""
    nbytes = float(x.numel() * x.element_size())
    return Kernel(name=f"freqopt.{kind}", kind=kind, pass_name=pass_name, flops=0.0, mem_bytes=nbytes,
                  dtype=dtype_name(x.dtype), shapes=(tuple(x.shape),), stream=COMPUTE_STREAM, comm_bytes=nbytes,
                  group_size=2, group_stride=group_stride)  # fmt: skip


def trace_pipeline_stages(workload: Workload, *, partition_method: str = DEFAULT_PARTITION_METHOD,
                          dtype: torch.dtype = torch.bfloat16, model_stages: int | None = None) -> list[StageTrace]:  # fmt: skip
    """Per pipeline stage of the workload's layout (``layout.pp`` stages; pp=1 gives the whole model as one stage),
    the kernels of one micro-batch's forward and backward, traced on the meta device (seconds even for gpt3-175b).

    Args:
        workload: a built-in GPT-3 or BERT model, its micro-batch (sequences per micro-batch) and layout; tp > 1
            shards each stage's layers (AutoTP), dp only sets how far apart neighbouring stages are.
        partition_method: DeepSpeed's PipelineModule partition method: "parameters" (its default), "uniform" or
            "type:REGEX" (freqopt.workload.pipeline_partition).
        dtype: parameter and activation dtype (the transfers' too).
        model_stages: model stages to partition into (default ``layout.pp``): a multiple of it for the schedules
            that run several per GPU (freqopt.pipeline.schedules; interleaved: 2 x pp).

    Returns:
        One StageTrace per (model) stage, stage 0 first.

    Raises:
        InvalidSettingError: a model without a layer list (``hf:``), more stages than layers (argument "layout"),
            or an unknown or unmatched partition method (argument "partition_method").
    """
    config, layout = workload.config, workload.layout
    if model_stages is None:
        model_stages = layout.pp
    check_positive_int("model_stages", model_stages)
    if model_stages % layout.pp:
        raise InvalidSettingError(f"model_stages {model_stages} is not a multiple of the layout's pp={layout.pp}",
                                  argument="model_stages")  # fmt: skip
    model = build_model(config, dtype=dtype)
    stages = partition_stages(model, model_stages, partition_method)  # unsharded counts, as DeepSpeed partitions
    model = shard_tensor_parallel(model, layout.tp)
    B, T = workload.micro_batch_size, config.seq_len
    idx = torch.zeros(B, T, dtype=torch.long, device="meta")  # (B, T): inputs and targets, as trace_iteration
    stride = layout.dp * layout.tp
    traces = []
    for stage in stages:
        for p in model.parameters():
            p.grad = None  # each stage's backward starts without gradients, as on its own rank
        recorder = KernelRecorder(model)
        x_in = None
        if not stage.is_first:
            x_in = torch.empty(B, T, config.d_model, dtype=dtype, device="meta", requires_grad=True)  # (B, T, d)
        with recorder, FusedSDPA(), MetaChecks():
            if x_in is not None:
                recorder.kernels.append(_p2p_kernel("recv", x_in, "forward", stride))
            x = x_in
            for layer in stage.layers:
                x = layer.forward(x, idx)  # (B, T, d); the loss after the last stage's output layer
            if not stage.is_last:
                recorder.kernels.append(_p2p_kernel("send", x, "forward", stride))
            recorder.pass_name = "backward"
            if stage.is_last:
                x.backward()
            else:
                grad = torch.empty_like(x)  # (B, T, d): the next stage's input gradient
                recorder.kernels.append(_p2p_kernel("recv", grad, "backward", stride))
                x.backward(grad)
            if x_in is not None:
                recorder.kernels.append(_p2p_kernel("send", x_in.grad, "backward", stride))
        n_params = stage_module_parameters(model, stage)
        traces.append(StageTrace(workload, stage, tuple(recorder.kernels), n_params, partition_method))
    return traces
