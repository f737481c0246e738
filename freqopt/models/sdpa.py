"""``torch.nn.functional.scaled_dot_product_attention`` traced as the fused kernel a GPU runs.

On the meta device PyTorch's SDPA takes its math path (bmm, softmax, bmm and their backwards: a (T, T) score
tensor and five or more kernels each way), while a GPU trains through FlashAttention-2: one kernel forward, one
backward, nothing (T, T) in device memory. ``FusedSDPA``, a TorchFunctionMode active while freqopt traces,
routes every SDPA call on meta tensors to ``torch.ops.freqopt.flash_attention`` (freqopt.models.ops), so a
Hugging Face model (``attn_implementation="sdpa"``) or a user's module traces as the built-in models do. Calls on
real tensors pass through unchanged, so numerics never change.

How the arguments are counted (the kernel's FLOPs come from freqopt.models.ops's formula, its bytes from the
tensors it reads and writes):

* grouped-query attention (``enable_gqa=True``, k and v with nh_kv = nh / g heads): k and v go to the kernel with
  their nh_kv heads, as FlashAttention-2 reads them (each query head reads key/value head h // g; nothing is
  expanded in memory). FLOPs are those of nh query heads (4 B nh T_q T_k hs forward, twice that backward); bytes
  count k and v once at nh_kv heads (forward) and dk, dv at nh_kv heads (backward; FlashAttention-2 sums the g
  query heads' contributions in its kernel).
* ``is_causal``: passed on (top-left aligned, as SDPA's); the kernel is marked causal.
* an explicit ``attn_mask``: a meta tensor holds no values, so whether it is causal cannot be read. The kernel is
  recorded as dense attention over all T_q x T_k pairs (``is_causal=False``: full FLOPs, no causal saving) and
  the mask's own bytes are not counted. This is an approximation: FlashAttention-2 takes no arbitrary mask (a
  GPU would run the memory-efficient kernel, which reads it). Hugging Face's SDPA path passes no mask and
  ``is_causal=True`` for unpadded causal-LM training, so its traces are exact in this respect.
* ``dropout_p`` and ``scale`` change no kernel's work (FlashAttention-2 applies both inside the kernel) and are
  not passed on.
* Inputs the kernel cannot take (not 3-D or 4-D, value head dim unlike the query's, query heads not a multiple
  of key/value heads) keep PyTorch's own SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import freqopt.models.ops  # noqa: F401  (registers torch.ops.freqopt.flash_attention)

__all__ = ["FusedSDPA", "fused_sdpa"]


def fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` on meta tensors as ``freqopt.flash_attention`` (see the module
    docstring for how each argument is counted); returns the attention output shaped like SDPA's,
    (..., T_q, hs). Tensors on other devices, and inputs the fused kernel cannot take, go to PyTorch's SDPA."""
    original = (query, key, value)
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
              "enable_gqa": enable_gqa}  # fmt: skip
    if not _fusable(query, key, value, enable_gqa):
        return F.scaled_dot_product_attention(*original, **kwargs)
    squeeze = query.dim() == 3
    q, k, v = (t.unsqueeze(1) if squeeze else t for t in original)  # (B, nh, T, hs)
    out = freqopt.models.ops.flash_attention(q, k, v, bool(is_causal) and attn_mask is None)
    return out.squeeze(1) if squeeze else out


def _fusable(query, key, value, enable_gqa: bool) -> bool:
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return False
    if query.dim() not in (3, 4) or not query.dim() == key.dim() == value.dim():
        return False
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1] or key.shape[-2] != value.shape[-2]:
        return False
    if query.dim() == 4:
        nh, nh_kv = query.shape[1], key.shape[1]
        if value.shape[1] != nh_kv or (nh != nh_kv and (not enable_gqa or nh % nh_kv)):
            return False
    return query.shape[0] == key.shape[0] == value.shape[0]


class FusedSDPA(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on meta tensors runs as ``fused_sdpa``; everything else
    runs as usual. Enter it inside the tracer's dispatch mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return fused_sdpa(*args, **kwargs)
        return func(*args, **kwargs)
