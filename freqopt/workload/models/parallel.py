"""One rank's view of a parallel layout, for tracing: collectives as operators, and AutoTP's sharded linear layers.

``freqopt::all_reduce`` stands for a NCCL all-reduce (ring algorithm) over a group of ranks; on the meta device
it only has a shape, and the tracer records it as a communication kernel. ``shard_tensor_parallel`` rewrites a
model the way DeepSpeed's AutoTP training does (deepspeed.module_inject: ``LinearLayer`` and
``LinearAllreduce``, checked against a real two-rank DeepSpeed run in tests/test_deepspeed.py):

* q_proj, k_proj, v_proj, gate_proj, up_proj become column-parallel: each rank holds out_features / tp rows of
  the weight (and bias); forward is ``x @ W_r^T + b_r``; backward all-reduces the input gradient over the tp group.
* o_proj, down_proj become row-parallel: each rank holds in_features / tp columns; forward is ``x_r @ W_r^T``,
  all-reduced over the tp group, then the full bias is added; backward needs no collective.
* Embeddings, layer norms and the output layer stay replicated.

Hugging Face models (freqopt.workload.models.hf) use the same names (Llama, Mistral, Qwen2: q/k/v/o_proj, gate/up/down_proj;
their heads and key/value heads are divided by tp, which the attention's ``view(..., -1, head_dim)`` follows).
GPT-2's ``transformers.pytorch_utils.Conv1D`` layers (weight (in, out)) are sharded as Megatron-LM shards GPT-2:
the fused q/k/v ``c_attn`` and the MLP's ``c_fc`` column-parallel (each rank holds the q, k and v columns of its
nh / tp heads, so the attention's ``split_size`` becomes d / tp), both ``c_proj`` row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["all_reduce", "shard_tensor_parallel", "COLUMN_PARALLEL", "ROW_PARALLEL", "COMPUTE_STREAM", "COMM_STREAM"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# GPT-2's Conv1D layers (Hugging Face transformers): fused q/k/v and MLP up projection; attention and MLP outputs.
CONV1D_COLUMN_PARALLEL = ("c_attn", "c_fc")
CONV1D_ROW_PARALLEL = ("c_proj",)
# Fused projections whose rank-local slice the model's own forward cannot read (it splits the fused output by the
# whole model's head counts, as Phi-3's attention splits qkv_proj): refused under tensor parallelism, in one line.
FUSED_UNSHARDED = ("qkv_proj", "gate_up_proj", "query_key_value", "W_pack", "Wqkv")
COMPUTE_STREAM = 0  # the training stream: kernels run in issue order
COMM_STREAM = 1  # a side stream: data-parallel gradient buckets overlap the backward pass (ZeRO-1 overlap_comm)


@torch.library.custom_op("freqopt::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_size: int, group_stride: int, stream: int) -> torch.Tensor:
    """Sum of ``x`` over a group of ``group_size`` ranks (global ranks ``group_stride`` apart), issued on
    ``stream``. For tracing only: with no process group it returns a copy of ``x`` (same shape and dtype)."""
    return x.clone()


@all_reduce.register_fake
def _(x, group_size, group_stride, stream):
    return torch.empty_like(x)


class _ReduceInForward(torch.autograd.Function):
    """Row-parallel output: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: int) -> torch.Tensor:
        return all_reduce(x, tp, 1, COMPUTE_STREAM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ReduceInBackward(torch.autograd.Function):
    """Column-parallel input: identity in forward, all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), ctx.tp, 1, COMPUTE_STREAM), None


class ColumnParallelLinear(nn.Module):
    """Rank-local slice of a column-parallel linear layer: weight (out_features / tp, in_features)."""

    def __init__(self, linear: nn.Linear, tp: int):
        super().__init__()
        out_features, in_features = linear.weight.shape
        self.tp = tp
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features // tp, **factory)) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, in) -> (B, T, out / tp)
        x = _ReduceInBackward.apply(x, self.tp)
        y = torch.matmul(x, self.weight.t())
        return y + self.bias if self.bias is not None else y


class RowParallelLinear(nn.Module):
    """Rank-local slice of a row-parallel linear layer: weight (out_features, in_features / tp), full bias."""

    def __init__(self, linear: nn.Linear, tp: int):
        super().__init__()
        out_features, in_features = linear.weight.shape
        self.tp = tp
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, in / tp) -> (B, T, out)
        y = _ReduceInForward.apply(torch.matmul(x, self.weight.t()), self.tp)
        return y + self.bias if self.bias is not None else y


def shard_tensor_parallel(model: nn.Module, tp: int) -> nn.Module:
    """Replace, in place, every linear layer named in COLUMN_PARALLEL or ROW_PARALLEL by its rank-local slice.

    Args:
        model: a GPTModel or BertModel (AutoTP layer names); its parameters are replaced, not copied.
        tp: tensor-parallel degree; must divide the heads (checked by Layout.check_model).

    Returns:
        The model.

    Raises:
        InvalidSettingError: ``tp`` > 1 on a model with a fused projection its forward splits by the whole model's
            head counts (FUSED_UNSHARDED: Phi-3's qkv_proj and gate_up_proj, Falcon's query_key_value, ...), or with
            mixture-of-experts layers whose experts are 3-D parameters (freqopt.workload.moe.is_experts_module:
            AutoTP shards linear layers only, so every rank would compute every expert in full).
    """
    if tp == 1:
        return model
    from freqopt.workload.moe import experts_modules

    experts = experts_modules(model)
    if experts:
        from freqopt.errors import InvalidSettingError

        config = getattr(getattr(model, "model", model), "config", None)
        kind = getattr(config, "model_type", None) or type(model).__name__
        more = f" and {len(experts) - 1} more" if len(experts) > 1 else ""
        raise InvalidSettingError(f"layout tp={tp} would shard {kind}'s mixture-of-experts layers "
                                  f"({experts[0]}{more}), whose expert weights freqopt does not shard: use tp=1, with "
                                  "data parallelism (every rank holds every expert)", argument="layout")  # fmt: skip
    fused = sorted({name for name, child in model.named_modules() if name.rsplit(".", 1)[-1] in FUSED_UNSHARDED})
    if fused:
        from freqopt.errors import InvalidSettingError

        config = getattr(getattr(model, "model", model), "config", None)
        kind = getattr(config, "model_type", None) or type(model).__name__
        names = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in fused}))
        raise InvalidSettingError(f"layout tp={tp} shards {kind}'s fused projections ({names}), which freqopt does "
                                  "not model: use tp=1, with data or pipeline parallelism", argument="layout")  # fmt: skip
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_conv1d(child) and name in CONV1D_COLUMN_PARALLEL + CONV1D_ROW_PARALLEL:
                child = _conv1d_as_linear(child)
                column = name in CONV1D_COLUMN_PARALLEL
                if name == "c_attn" and hasattr(parent, "split_size"):  # GPT-2 attention splits q, k, v of d each
                    parent.split_size //= tp
            elif isinstance(child, nn.Linear) and name in COLUMN_PARALLEL + ROW_PARALLEL:
                column = name in COLUMN_PARALLEL
            else:
                continue
            setattr(parent, name, ColumnParallelLinear(child, tp) if column else RowParallelLinear(child, tp))
    return model


def _is_conv1d(module: nn.Module) -> bool:
    """A transformers.pytorch_utils.Conv1D (GPT-2's linear layer, weight (in, out)), told by type name so that this
    module does not import transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """An nn.Linear of a Conv1D's shape (weight (out, in)) on its device, for the sharded layers to read."""
    in_features, out_features = conv.weight.shape
    return nn.Linear(in_features, out_features, bias=conv.bias is not None, device=conv.weight.device,
                     dtype=conv.weight.dtype)
