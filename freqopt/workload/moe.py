"""Mixture-of-experts layers as a GPU runs them: the grouped expert GEMMs, and how tokens are split between experts.

Hugging Face transformers (5.x) keeps the experts of a layer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3,
...) as 3-D parameters (``gate_up_proj`` (E, 2F, D), ``down_proj`` (E, D, F)) in a module decorated with
``transformers.integrations.use_experts_implementation``. Its default implementation, ``"grouped_mm"`` (what
transformers picks on a GPU of compute capability 8.0 or later), sorts the S = tokens x top_k routed (token, expert)
pairs by expert and runs each projection as one grouped GEMM, ``aten._grouped_mm``, whose ``offs`` argument holds the
cumulative rows of each expert's group; its backward runs two grouped GEMMs per projection (input and weight
gradients). The router is an ordinary GEMM (``F.linear`` to E logits) with a softmax, a top-k and, for DeepSeek,
group-limited selection; a shared expert (Qwen2-MoE, DeepSeek) is an ordinary MLP. freqopt traces all of them as
they run: the grouped GEMMs as GEMM kernels on tensor cores, FLOPs and bytes by ``grouped_gemm_cost``.

Routing is data: which expert a token goes to is decided on the GPU from the values of the router's logits, and a
meta tensor has no values. The grouped GEMM's FLOPs do not depend on it (every one of the S pairs is multiplied
once, whichever expert takes it); what does is which experts' weights are read (an expert given no token reads
none) and, through the replay (freqopt.gpu.replay), the offsets a real GPU runs the kernel with. The split is
stated, not guessed (``expert_rows``):

* ``routing="balanced"`` (the default): every expert gets S / E pairs (the remainder one each to the first), which
  is what an auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2022 section 2.2; Mixtral's
  ``router_aux_loss_coef``) drives training toward;
* ``routing=(share_0, ..., share_{E-1})``: each expert's share of the S pairs (non-negative, normalised to sum 1),
  e.g. a measured histogram of ``tokens_per_expert``; rows are rounded by largest remainder so they sum to S. The
  kernel's ``shapes`` then end with the tuple of rows per expert, so that kernel classes of two splits differ.

Not modelled: expert parallelism. freqopt's layouts have no expert-parallel degree, so every rank holds every
expert (data parallelism replicates them and all-reduces their gradients); the all-to-all dispatch and combine of
expert parallelism (GShard, Lepikhin et al. 2021) is not traced, and a module that runs with transformers' expert
parallelism on is warned of (``UntracedWarning``). Tensor parallelism does not shard the experts' 3-D weights and is
refused for a model that has them (freqopt.workload.models.parallel.shard_tensor_parallel). Transformers'
``"eager"`` experts loop (``nonzero`` over the routing mask, one GEMM per expert hit) cannot run on the meta device
and is refused with what to set instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from freqopt.errors import InvalidSettingError

__all__ = ["BALANCED", "UntraceableExpertsError", "check_routing", "expert_rows", "grouped_gemm_cost",
           "is_experts_module", "experts_modules", "experts_implementation", "EXPERT_IMPLEMENTATIONS_TRACED"]

BALANCED = "balanced"
# transformers' experts implementations the tracer reads as a GPU runs them: grouped_mm (one grouped GEMM per
# projection) and batched_mm (each pair's expert weights gathered, then one batched GEMM, aten.bmm).
EXPERT_IMPLEMENTATIONS_TRACED = ("grouped_mm", "batched_mm")


class UntraceableExpertsError(InvalidSettingError):
    """An experts module runs a path the tracer cannot follow on the meta device (transformers' "eager" loop); the
    message names the module and what to set instead."""


def check_routing(routing) -> tuple[float, ...] | None:
    """The token split a trace assumes: None for ``"balanced"``, else each expert's share, normalised to sum 1.

    Args:
        routing: ``"balanced"`` or a sequence of E non-negative finite numbers (one per expert, any scale).

    Raises:
        InvalidSettingError: another string, an empty sequence, a negative, non-finite or non-numeric share, or
            shares summing to 0 (argument "routing").
    """
    if isinstance(routing, str):
        if routing == BALANCED:
            return None
        raise InvalidSettingError(f"routing must be {BALANCED!r} or a sequence of per-expert token shares, not "
                                  f"{routing!r}", argument="routing")  # fmt: skip
    try:
        shares = [float(s) for s in routing]
    except (TypeError, ValueError):
        raise InvalidSettingError(f"routing must be {BALANCED!r} or a sequence of per-expert token shares (numbers), "
                                  f"not {routing!r}", argument="routing") from None  # fmt: skip
    if not shares or any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
        raise InvalidSettingError("routing shares must be finite, non-negative and not all zero, one per expert; "
                                  f"got {routing!r}", argument="routing")  # fmt: skip
    total = sum(shares)
    return tuple(s / total for s in shares)


def expert_rows(total: int, n_experts: int, shares: Sequence[float] | None = None, *,
                where: str = "") -> tuple[int, ...]:  # fmt: skip
    """Rows (routed token-expert pairs) of each of ``n_experts`` groups of a grouped GEMM of ``total`` rows.

    Args:
        total: S, the rows split between the experts.
        n_experts: E, the groups.
        shares: each expert's share (check_routing), or None for the balanced split (S // E each, the remainder one
            each to the first experts).
        where: the module, for the error message.

    Returns:
        E non-negative integers summing to ``total`` (largest-remainder rounding of ``total * share``).

    Raises:
        InvalidSettingError: ``shares`` of another length than ``n_experts`` (argument "routing").
    """
    if shares is None:
        q, r = divmod(total, n_experts)
        return tuple(q + (i < r) for i in range(n_experts))
    if len(shares) != n_experts:
        raise InvalidSettingError(f"routing gives {len(shares)} expert shares, but {where or 'a grouped GEMM'} has "
                                  f"{n_experts} experts; give one share per expert", argument="routing")  # fmt: skip
    exact = [total * s for s in shares]
    rows = [math.floor(x) for x in exact]
    for i in sorted(range(n_experts), key=lambda i: rows[i] - exact[i])[: total - sum(rows)]:
        rows[i] += 1
    return tuple(rows)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def grouped_gemm_cost(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                      rows: Sequence[int] | None) -> tuple[float, float]:  # fmt: skip
    """FLOPs and device-memory bytes of ``aten._grouped_mm(a, b, offs)`` with ``rows[g]`` rows in group g.

    The four forms of ``torch._grouped_mm`` (its docstring, aten/src/ATen/native/cuda/Blas.cpp): 2-D x 3-D, a (S, K)
    split into groups by rows, times b (E, K, N): 2 S K N FLOPs (the forward projections and the input gradient);
    2-D x 2-D, a (M, S) times b (S, N) split along S, giving (E, M, N): 2 M S N (the weight gradient); 3-D x 2-D,
    a (E, M, K) times b (K, S) split along columns: 2 M K S; 3-D x 3-D, a batched GEMM (no offsets): 2 E M K N.

    Bytes: both operands read and the output written once, except that the 3-D operand of a split form is read only
    for the groups that have rows (the grouped kernel skips an empty group, so an expert given no token reads no
    weight). The 2-D x 2-D output is counted whole (every expert's gradient is written).
    """
    if a.dim() == 3 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2], float(_nbytes(a) + _nbytes(b) + _nbytes(out))
    if a.dim() == 2 and b.dim() == 3:
        flops, grouped, dense = 2.0 * a.shape[0] * a.shape[1] * b.shape[2], b, [a]
    elif a.dim() == 3 and b.dim() == 2:
        flops, grouped, dense = 2.0 * a.shape[1] * a.shape[2] * b.shape[1], a, [b]
    else:
        flops, grouped, dense = 2.0 * a.shape[0] * a.shape[1] * b.shape[1], None, [a, b]
    nbytes = sum(map(_nbytes, dense)) + _nbytes(out)
    if grouped is not None:
        active = sum(1 for r in rows if r > 0) if rows is not None else grouped.shape[0]
        nbytes += _nbytes(grouped) * active / grouped.shape[0]
    return flops, float(nbytes)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer's experts as 3-D parameters (transformers' ``use_experts_implementation``
    classes: Mixtral, Qwen2-MoE, DeepSeek, ...), told by its ``num_experts`` and a 3-D parameter of that many rows, so
    that this module does not import transformers."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or n < 1:
        return False
    return any(p.dim() == 3 and p.shape[0] == n for p in module.parameters(recurse=False))


def experts_modules(model: nn.Module) -> list[str]:
    """Qualified names of the experts modules in ``model`` (is_experts_module), in module order."""
    return [name for name, m in model.named_modules() if is_experts_module(m)]


def experts_implementation(module: nn.Module) -> str | None:
    """The transformers experts implementation an experts module runs (``config._experts_implementation``: "eager",
    "grouped_mm", "batched_mm", ...), or None where it has none (a user's own module)."""
    config = getattr(module, "config", None)
    value = getattr(config, "_experts_implementation", None) if config is not None else None
    return value if isinstance(value, str) else None
