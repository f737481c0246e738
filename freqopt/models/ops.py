"""Fused operators that a GPU runs as one kernel, made visible to the tracer as one operator each.

* ``freqopt::flash_attention`` / ``freqopt::flash_attention_backward``: scaled dot-product attention as
  FlashAttention runs it (Dao et al. 2022, arXiv 2205.14135): one kernel forward, one backward, the (T, T)
  score matrix never written to device memory. On the meta device PyTorch's own SDPA falls back to the math
  path (bmm, softmax, bmm), which would show five kernels and a T x T tensor; this op shows what a GPU runs.
* ``mixed_precision_adamw_step``: AdamW on FP32 master weights for BF16 parameters, as DeepSpeed's BF16
  optimizer and Megatron-LM run it: grads cast to FP32, one fused multi-tensor AdamW kernel
  (``torch._fused_adamw_``), master weights cast back to BF16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

__all__ = ["flash_attention", "MixedPrecisionAdamW"]


@torch.library.custom_op("freqopt::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Attention softmax(q k^T / sqrt(hs)) v, q, k, v and result of shape (B, nh, T, hs)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


@flash_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("freqopt::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash_attention, each (B, nh, T, hs); recomputes the scores as FlashAttention does."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T, T)
    if is_causal:
        t_q, t_k = scores.shape[-2:]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, nh, T, T)
    dv = probs.transpose(-2, -1) @ grad_out  # (B, nh, T, hs)
    dprobs = grad_out @ v.transpose(-2, -1)  # (B, nh, T, T)
    dscores = probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True))  # softmax backward
    dq = dscores @ k * scale  # (B, nh, T, hs)
    dk = dscores.transpose(-2, -1) @ q * scale  # (B, nh, T, hs)
    return dq, dk, dv


@flash_attention_backward.register_fake
def _(grad_out, q, k, v, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal = inputs
    ctx.save_for_backward(q, k, v)
    ctx.is_causal = is_causal


def _backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(grad_out, q, k, v, ctx.is_causal)
    return dq, dk, dv, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def _attention_flops(q_shape, k_shape) -> int:
    """Forward FLOPs: q k^T and p v, 2 * B * nh * T_q * T_k * hs each (causal masking not discounted,
    the convention of torch.utils.flop_counter and of Narayanan et al. 2021)."""
    b, nh, t_q, hs = q_shape
    t_k = k_shape[-2]
    return 2 * (2 * b * nh * t_q * t_k * hs)


@register_flop_formula(torch.ops.freqopt.flash_attention)
def _flash_attention_flop(q_shape, k_shape, v_shape, is_causal, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape)


@register_flop_formula(torch.ops.freqopt.flash_attention_backward)
def _flash_attention_backward_flop(grad_shape, q_shape, k_shape, v_shape, is_causal, *args, out_shape=None, **kwargs):
    # dv = p^T do, dp = do v^T, dq = ds k, dk = ds^T q: twice the forward's two matmuls.
    return 2 * _attention_flops(q_shape, k_shape)


class MixedPrecisionAdamW:
    """AdamW over FP32 master copies of (BF16) parameters; works on meta, CPU and CUDA tensors.

    Args:
        params: the model's parameters.
        lr, betas, eps, weight_decay: AdamW's (Loshchilov & Hutter 2019); GPT-3 used betas (0.9, 0.95) and
            weight decay 0.1 (Brown et al. 2020, appendix B).
        max_grad_norm: clip the gradients' global L2 norm to this (GPT-3: 1.0, Brown et al. 2020 appendix B;
            DeepSpeed's default ``gradient_clipping``); None: no clipping.
        reduce_sq_norm: sums the local squared norm over the other ranks that hold parameters (tensor- and
            data-parallel groups); identity on one GPU.
    """

    def __init__(self, params, *, lr: float = 6e-4, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 max_grad_norm: float | None = 1.0, reduce_sq_norm=None):  # fmt: skip
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.max_grad_norm = max_grad_norm
        self.reduce_sq_norm = reduce_sq_norm or (lambda sq_norm: sq_norm)
        with torch.no_grad():
            self.master = [p.detach().float() for p in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.steps = [torch.zeros((), dtype=torch.float32, device=m.device) for m in self.master]

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad.float() if p.grad is not None else torch.zeros_like(m) for p, m in zip(self.params, self.master)]
        if self.max_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_'s multi-tensor path
            sq_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) ** 2
            total_norm = self.reduce_sq_norm(sq_norm).sqrt()
            torch._foreach_mul_(grads, torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0))
        torch._foreach_add_(self.steps, 1.0)
        torch._fused_adamw_(
            self.master, grads, self.exp_avg, self.exp_avg_sq, [], self.steps,
            lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay,
            eps=self.eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        torch._foreach_copy_(self.params, self.master)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
