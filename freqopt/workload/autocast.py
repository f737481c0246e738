"""``torch.autocast("cuda", ...)`` traced as a GPU runs it, on the meta device and on machines without CUDA.

A training step written for mixed precision (fp32 weights, the forward under ``torch.autocast("cuda",
dtype=torch.bfloat16)``: Hugging Face's ``Trainer(bf16=True)``, most AMP recipes) runs its GEMMs and convolutions
in bf16 on a GPU. Traced where freqopt traces, it would not: on a machine without CUDA, ``torch.autocast("cuda")``
warns "CUDA is not available ... Disabling autocast" and the step runs in fp32; and even with CUDA present, autocast
acts on CUDA tensors only (its dispatch key), never on the meta tensors freqopt traces. The trace would hold fp32
kernels and the simulated step would run 3-4x slower than the GPU's (as a ResNet-50 step so traced does).

``CudaAutocast`` (a TorchFunctionMode, active while freqopt traces) applies CUDA autocast's casting policy itself,
wherever ``torch.is_autocast_enabled("cuda")`` says a region is on, with the region's ``torch.get_autocast_dtype``:

* operators autocast runs in the lower precision (``LOWER_PRECISION``: GEMMs, convolutions, linear, attention):
  their floating-point inputs cast to it;
* operators it runs in fp32 (``FP32``: layer and group norm, the losses, pow, exp, ...): their 16-bit inputs cast
  to fp32; softmax, log-softmax, sum and the like (``FP32_OUTPUT``) instead read their 16-bit input and compute and
  write fp32 (``dtype=torch.float32``), unless the call names a dtype;
* operators it promotes (``PROMOTE``): to the widest floating-point input type;
* any other operator runs on its inputs as they are (batch norm takes a bf16 input with fp32 statistics).

Each cast is a ``_to_copy`` kernel, recorded as the GPU would launch it; a leaf tensor that requires grad (a
weight) is cast once per autocast region, as autocast's cast cache does, and autograd records the casts so the
backward holds the gradients' casts back to fp32. The lists follow PyTorch's CUDA autocast
(aten/src/ATen/autocast_mode.cpp, ``KERNEL_CUDA(..., lower_precision_fp | fp32 | promote)``; the AMP documentation's
"CUDA Ops that can autocast to float16 / to float32 / promote"), by the torch-level function or method name.

``enable_cuda_autocast`` lets ``torch.autocast("cuda")`` switch its region on where CUDA is absent (it patches
torch's "is CUDA AMP available" and "bf16 supported" checks for the duration), so the step's own autocast
regions, their dtype and nesting are what the mode reads.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["CudaAutocast", "enable_cuda_autocast", "LOWER_PRECISION", "FP32", "FP32_OUTPUT", "PROMOTE"]

LOWER_PRECISION = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum",
    "mm", "mv", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "linalg_multi_dot", "linalg_vecdot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
    "_native_multi_head_attention",
})  # fmt: skip
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "cross_entropy",
    "cross_entropy_loss", "rms_norm", "__rtruediv__", "__rdiv__",
})  # fmt: skip
# fp32_set_opt_dtype: run with dtype=float32 (accumulate and write fp32 from a 16-bit input, no separate cast) unless
# the call names a dtype.
FP32_OUTPUT = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                         "linalg_matrix_norm", "sum"})
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
                     "scatter_add", "tensordot", "vdot"})  # fmt: skip
_HALF = (torch.float16, torch.bfloat16)
_HALF_TO_FLOAT = {"softmax": torch._softmax, "log_softmax": torch._log_softmax}


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casting policy applied to whatever device the tensors are on (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, its cast)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cuda"):
            self._cache.clear()  # out of every region: autocast drops its cache (nesting 0)
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in FP32_OUTPUT:
            if "dtype" in kwargs or not any(t.dtype in _HALF for t in _tensors(args, kwargs)):
                return func(*args, **kwargs)
            with torch.autocast("cuda", enabled=False):
                if name in _HALF_TO_FLOAT and len(args) >= 2 and args[0].dtype in _HALF:
                    # CUDA's softmax with dtype=float32 on a 16-bit input is one kernel (half_to_float), not a
                    # cast and a softmax as the composite runs it elsewhere (aten/src/ATen/native/SoftMax.cpp)
                    return _HALF_TO_FLOAT[name](args[0], args[1], True)
                return func(*args, **{**kwargs, "dtype": torch.float32})
        if name in LOWER_PRECISION:
            target = torch.get_autocast_dtype("cuda")
        elif name in FP32:
            target = torch.float32
        elif name in PROMOTE:
            floats = [t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()]
            target = max(floats, key=lambda d: torch.finfo(d).bits) if floats else None
        else:
            return func(*args, **kwargs)
        if target is None:
            return func(*args, **kwargs)
        with torch.autocast("cuda", enabled=False):  # the casts and the call itself run outside the region
            args, kwargs = tree_map(lambda a: self._cast(a, target, only_half=target is torch.float32), (args, kwargs))
            return func(*args, **kwargs)

    def _cast(self, value, dtype: torch.dtype, *, only_half: bool):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if value.dtype is torch.float64 or (only_half and value.dtype not in _HALF):
            return value  # autocast leaves float64 alone, and casts only 16-bit inputs up to fp32
        if value.is_leaf and value.requires_grad:
            hit = self._cache.get(id(value))
            if hit is not None and hit[0] is value and hit[1].dtype == dtype:
                return hit[1]
            cast = value.to(dtype)
            self._cache[id(value)] = (value, cast)
            return cast
        return value.to(dtype)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda a: found.append(a) if isinstance(a, torch.Tensor) else None, (args, kwargs))
    return found


@contextlib.contextmanager
def enable_cuda_autocast():
    """``torch.autocast("cuda", ...)`` switches its region on even where CUDA is absent (module docstring); nothing
    else changes, and torch's checks are restored on exit."""
    common = torch.cuda.amp.common
    with mock.patch.object(common, "amp_definitely_not_available", lambda: False), \
            mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True):  # fmt: skip
        yield
