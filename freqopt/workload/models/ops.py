"""Fused operators that a GPU runs as one kernel, made visible to the tracer as one operator each.

* ``freqopt::flash_attention`` / ``freqopt::flash_attention_backward``: scaled dot-product attention as
  FlashAttention runs it (Dao et al. 2022, arXiv 2205.14135): one kernel forward, one backward, the (T, T)
  score matrix never written to device memory. On the meta device PyTorch's own SDPA falls back to the math
  path (bmm, softmax, bmm), which would show five kernels and a T x T tensor; this op shows what a GPU runs.
  On real devices the ops run PyTorch's fused kernels: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward; on CUDA FlashAttention-2 (``aten._scaled_dot_product_flash_attention`` and its backward)
  where it takes the inputs, else (with a one-time RuntimeWarning saying why) PyTorch's SDPA, whose backward
  recomputes the forward. The forward returns (out, logsumexp); the backward takes (grad_out, q, k, v, out,
  logsumexp, is_causal), so it can be called with a forward's tensors. ``flash_attention`` is what models call.
* ``mixed_precision_adamw_step``: AdamW on FP32 master weights for BF16 parameters, as DeepSpeed's BF16
  optimizer and Megatron-LM run it: grads cast to FP32, one fused multi-tensor AdamW kernel
  (``torch._fused_adamw_``), master weights cast back to BF16.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward", "MixedPrecisionAdamW"]


_FLASH_HEAD_DIM_MAX = 256  # FlashAttention-2 kernels exist for head dims up to 256 (Dao 2023, arXiv 2307.08691)
_FLASH_HEAD_DIM_MULTIPLE = 8  # the kernels take head dims in multiples of 8; PyTorch's SDPA pads others
_warned: set[str] = set()


def _fused_kernel_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    """Why no fused attention kernel of PyTorch takes these inputs directly, or None when one does.

    CPU and meta always have one (``_scaled_dot_product_flash_attention_for_cpu``, the fake implementation). On
    CUDA, PyTorch's FlashAttention-2 (``_scaled_dot_product_flash_attention``) needs float16 or bfloat16, a head
    dim that is a multiple of 8 and at most 256, and compute capability 8.0 or newer (PyTorch's sdp_utils checks,
    asked through torch.backends.cuda.can_use_flash_attention). Other devices have none wired here.
    """
    device = q.device.type
    if device in ("cpu", "meta"):
        return None
    if device != "cuda":
        return f"no fused attention kernel is wired for device type {device!r}"
    hs = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return f"inputs are {q.dtype}; PyTorch's FlashAttention-2 takes float16 or bfloat16 (train in bfloat16)"
    if hs % _FLASH_HEAD_DIM_MULTIPLE or hs > _FLASH_HEAD_DIM_MAX or k.shape[-1] != hs or v.shape[-1] != hs:
        return (f"head dim {hs}; PyTorch's FlashAttention-2 takes multiples of {_FLASH_HEAD_DIM_MULTIPLE} up to "
                f"{_FLASH_HEAD_DIM_MAX} (choose n_heads so that d_model / n_heads is one)")  # fmt: skip
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return f"GPU compute capability {major}.{minor}; PyTorch's FlashAttention-2 needs 8.0 (A100) or newer"
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    try:
        params = SDPAParams(q, k, v, None, 0.0, is_causal, False)  # enable_gqa=False (PyTorch >= 2.5)
    except TypeError:
        params = SDPAParams(q, k, v, None, 0.0, is_causal)
    if not can_use_flash_attention(params, False):
        return ("PyTorch refuses its FlashAttention-2 kernel for these inputs (a disabled backend or an unsupported "
                "build or layout; torch.backends.cuda.can_use_flash_attention(params, True) says which)")  # fmt: skip
    return None


def _warn_fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"freqopt.flash_attention: {reason}; attention runs through torch.nn.functional.scaled_dot_product_attention"
            " and its backward recomputes that forward, so this GPU runs more kernels than freqopt's trace counts",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip


@torch.library.custom_op("freqopt::flash_attention", mutates_args=())
def flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward: (out, logsumexp), out = softmax(q k^T / sqrt(hs)) v.

    Args:
        q, k, v: (B, nh, T, hs), T_k for k and v; the last dim contiguous.
        is_causal: mask keys after each query (top-left aligned).

    Returns:
        out (B, nh, T, hs) in q's dtype, and logsumexp (B, nh, T) of the scaled scores, float32 (float64 for
        float64 inputs on CPU), which the backward reads. Where no fused kernel takes the inputs (see
        ``_fused_kernel_refusal``), logsumexp is NaN and the backward recomputes the forward.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)
        return out, lse
    reason = _fused_kernel_refusal(q, k, v, is_causal)
    if reason is None:  # CUDA, FlashAttention-2
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False)
        return out, lse
    _warn_fallback(reason)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return out, torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=q.device)


@flash_attention_forward.register_fake
def _(q, k, v, is_causal):
    # FlashAttention's logsumexp is float32 (B, nh, T), as in PyTorch's meta registration of its flash op.
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("freqopt::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    logsumexp: torch.Tensor, is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused attention backward: (dq, dk, dv), each shaped like its input (B, nh, T, hs).

    Args:
        grad_out: gradient of ``out`` (B, nh, T, hs).
        q, k, v, out, logsumexp, is_causal: the forward's inputs and its two outputs, as
            ``flash_attention_forward`` returned them (the kernel recomputes the scores tile by tile from them,
            as FlashAttention does; nothing (T, T) is written to memory).

    Where no fused kernel takes the inputs (see ``_fused_kernel_refusal``), a direct call computes the gradients
    by the (T, T) math path; training through ``flash_attention`` recomputes through PyTorch's SDPA instead.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, logsumexp, 0.0, is_causal
        )
    reason = _fused_kernel_refusal(q, k, v, is_causal)
    if reason is None:  # CUDA, FlashAttention-2
        # Dense (not variable-length) inputs: no cumulative sequence lengths (None: undefined tensors). The
        # Philox seed and offset are read only with dropout, which is 0 here; their shapes are those of
        # PyTorch's meta registration of the forward.
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, logsumexp, None, None, q.shape[-2], k.shape[-2], 0.0, is_causal, seed, offset
        )
        return dq, dk, dv
    _warn_fallback(reason)
    return _math_attention_backward(grad_out, q, k, v, is_causal)


@flash_attention_backward.register_fake
def _(grad_out, q, k, v, out, logsumexp, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _math_attention_backward(grad_out, q, k, v, is_causal):
    """(dq, dk, dv) through the (B, nh, T, T) scores: the last resort where no fused kernel takes the inputs."""
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
    return dscores @ k * scale, dscores.transpose(-2, -1) @ q * scale, dv


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = is_causal
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros kernel for the logsumexp's (absent) gradient


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:  # out did not reach the loss
        return None, None, None, None
    if _fused_kernel_refusal(q, k, v, ctx.is_causal) is not None:
        # No fused backward for these inputs: recompute the forward with autograd through PyTorch's SDPA, which
        # picks its best kernel (memory-efficient attention on most GPUs) instead of the (T, T) math path.
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            again = F.scaled_dot_product_attention(*inputs, is_causal=ctx.is_causal)
            dq, dk, dv = torch.autograd.grad(again, inputs, grad_out)
        return dq, dk, dv, None
    dq, dk, dv = flash_attention_backward(grad_out, q, k, v, out, lse, ctx.is_causal)
    return dq, dk, dv, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """Attention softmax(q k^T / sqrt(hs)) v as one fused kernel each way (``freqopt::flash_attention`` and its
    backward): q, k, v of shape (B, nh, T, hs) (T_k for k and v), result (B, nh, T, hs); differentiable."""
    out, _ = torch.ops.freqopt.flash_attention(q, k, v, is_causal)
    return out


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
def _flash_attention_backward_flop(grad_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, is_causal, *args,
                                   out_shape=None, **kwargs) -> int:  # fmt: skip
    # dv = p^T do, dp = do v^T, dq = ds k, dk = ds^T q: twice the forward's two matmuls (the recomputed
    # q k^T is not counted, the convention of torch.utils.flop_counter's SDPA backward formula).
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
        self._step_pre_hooks: OrderedDict = OrderedDict()  # weakly referenced by the handles, as in torch.optim

    def register_step_pre_hook(self, hook) -> torch.utils.hooks.RemovableHandle:
        """Call ``hook(optimizer, args, kwargs)`` before each step, as torch.optim.Optimizer does (the DVFS
        runtime marks the optimizer phase this way); returns a handle whose ``remove()`` unregisters it."""
        handle = torch.utils.hooks.RemovableHandle(self._step_pre_hooks)
        self._step_pre_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def step(self) -> None:
        for hook in list(self._step_pre_hooks.values()):
            hook(self, (), {})
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none``, the default) or zero them in place."""
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()
