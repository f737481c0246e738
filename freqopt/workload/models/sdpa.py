"""``torch.nn.functional.scaled_dot_product_attention`` traced as the kernels a GPU runs.

On the meta device PyTorch's SDPA takes its math path (bmm, softmax, bmm and their backwards: a (T, T) score
tensor and five or more kernels each way, in float32 for 16-bit inputs), while a GPU trains through a fused kernel
(FlashAttention-2 or memory-efficient attention): one kernel forward, one backward, nothing (T, T) in device memory.
``FusedSDPA``, a TorchFunctionMode active while freqopt traces, routes every SDPA call on meta tensors for which
PyTorch on a CUDA GPU would pick a fused kernel (``cuda_sdpa_backend``) to ``torch.ops.freqopt.flash_attention``
(freqopt.workload.models.ops), so a Hugging Face model (``attn_implementation="sdpa"``) or a user's module traces as the
built-in models do; calls for which the GPU too runs the math path (3-D inputs, float64, misaligned head dims) keep
PyTorch's math path, which is then what the GPU runs. Calls on real tensors pass through unchanged, so numerics
never change.

``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and
``nn.Transformer``) computes attention in ``F.multi_head_attention_forward`` (torch/nn/functional.py), which
decides the path itself: with ``need_weights=False`` (what the transformer layers pass) it calls the module-level
``scaled_dot_product_attention`` of torch.nn.functional, with ``need_weights=True`` (MultiheadAttention's default)
it materializes the weights explicitly (``baddbmm``/``bmm``, ``softmax``, ``bmm`` in the input dtype), as on a GPU.
A TorchFunctionMode does not see calls made inside a function it handles, so while ``FusedSDPA`` handles
``F.multi_head_attention_forward`` it binds that module-level name to ``fused_sdpa`` (and restores it after): PyTorch's
own code picks the path, and its SDPA call is routed as a direct one. Not modelled: in eval mode with no gradient
needed, these modules may take PyTorch's inference fast path (``torch._native_multi_head_attention``, in
aten/src/ATen/native/transformers/cuda/attention.cu), which fuses attention likewise when no mask is given but
computes a masked one explicitly; the trace follows the path a training step runs.

How the arguments are counted (the kernel's FLOPs come from freqopt.workload.models.ops's formula, its bytes from the
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
  GPU runs the memory-efficient kernel, which reads it). Hugging Face's SDPA path passes no mask and
  ``is_causal=True`` for unpadded causal-LM training, so its traces are exact in this respect;
  ``nn.MultiheadAttention`` turns a key padding mask into such a mask.
* ``dropout_p`` and ``scale`` change no kernel's work (FlashAttention-2 applies both inside the kernel) and are
  not passed on.
* Inputs the GPU would fuse but ``freqopt.flash_attention`` cannot express (a value head dim unlike the query's,
  which memory-efficient attention takes) keep PyTorch's math path; freqopt.workload.trace warns (``GPUPathWarning``) where
  a math path runs that the GPU would not take.
"""

from __future__ import annotations

import collections
import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import freqopt.workload.models.ops  # noqa: F401  (registers torch.ops.freqopt.flash_attention)

__all__ = ["FusedSDPA", "fused_sdpa", "cuda_sdpa_backend", "gpu_math_path_active", "user_sdpa_kernel_name",
           "SDPA_KERNEL_NAMES"]

# PyTorch's SDPA, the builtin that F.scaled_dot_product_attention names: what a fallback calls while FusedSDPA has
# rebound that name in torch.nn.functional, and what the mode's handler receives for a direct call.
_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
_FLASH_HEAD_DIM_MAX = 256  # check_head_dim_size_flash: q, k, v head dims equal and at most 256
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # check_dtypes_low_precision, compute capability >= 8.0
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # can_use_mem_efficient_attention, >= 8.0
_gpu_math_depth = 0  # > 0 while fused_sdpa runs a math path that the GPU runs too
_sdpa_depth = 0  # > 0 while fused_sdpa calls freqopt.flash_attention for a user's F.scaled_dot_product_attention
# The names the tracer gives the fused kernels of a user's F.scaled_dot_product_attention (forward, backward): the
# kernel PyTorch's SDPA picks on the GPU (cuDNN's fused attention on Hopper with PyTorch 2.11: the kernels the
# measured H100 steps ran; FlashAttention-2 on Ampere), against freqopt.flash_attention, which freqopt's own models
# call and which always runs FlashAttention-2 (freqopt.workload.models.ops). A GPU file may rate the two apart
# (GPUSpec.attention_rate_rel).
SDPA_KERNEL_NAMES = ("aten.scaled_dot_product_attention", "aten.scaled_dot_product_attention_backward")
# The forward outputs of such calls, to name their backward: by their storage (autograd hands the backward another
# tensor object over the same storage) and shape; an entry goes when its backward is recorded.
_sdpa_outputs: collections.OrderedDict = collections.OrderedDict()
_SDPA_OUTPUTS_KEPT = 4096


def _output_key(t: torch.Tensor) -> tuple:
    return t.untyped_storage()._cdata, tuple(t.shape), tuple(t.stride())


def user_sdpa_kernel_name(op: str, args: tuple, outputs: list) -> str | None:
    """The name the tracer records for a ``freqopt.flash_attention`` (``op`` "flash_attention") or its backward that
    a user's ``F.scaled_dot_product_attention`` launched (SDPA_KERNEL_NAMES), else None (freqopt's own call). A
    forward counts while ``fused_sdpa`` calls it; its backward is the one given that forward's output."""
    if op == "flash_attention" and _sdpa_depth > 0:
        if outputs:
            _sdpa_outputs[_output_key(outputs[0])] = True
            while len(_sdpa_outputs) > _SDPA_OUTPUTS_KEPT:
                _sdpa_outputs.popitem(last=False)
        return SDPA_KERNEL_NAMES[0]
    if op == "flash_attention_backward" and len(args) > 4 and isinstance(args[4], torch.Tensor):
        if _sdpa_outputs.pop(_output_key(args[4]), None):
            return SDPA_KERNEL_NAMES[1]
    return None


def gpu_math_path_active() -> bool:
    """Whether ``fused_sdpa`` is running PyTorch's SDPA math path because a GPU would run that path too (for these
    inputs ``cuda_sdpa_backend`` is "math"): freqopt.workload.trace warns of a math path only outside such a call."""
    return _gpu_math_depth > 0


@contextlib.contextmanager
def _gpu_math_path():
    global _gpu_math_depth
    _gpu_math_depth += 1
    try:
        yield
    finally:
        _gpu_math_depth -= 1


def cuda_sdpa_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> str:
    """The kernel PyTorch's ``F.scaled_dot_product_attention`` runs for these (dense) inputs on a CUDA GPU of
    compute capability 8.0 or newer (A100, H100, RTX 30xx and newer): "flash" (FlashAttention-2), "efficient"
    (memory-efficient attention) or "math" (the decomposed path: q k^T, softmax and p v as separate kernels).

    The rules are ``select_sdp_backend`` and the checks it calls in
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.h (PyTorch 2.13), in its priority order,
    for dense tensors:

    * both fused kernels: q, k, v 4-D (``check_tensor_shapes``); equal batch sizes, and equal head counts or, with
      ``enable_gqa``, query heads a multiple of key/value heads (``check_batch_size_and_num_heads_dense``); nonzero
      sequence lengths (``check_nonzero_sequence_lengths_dense``); the last dim contiguous
      (``check_last_dim_stride_equals_1_dense``); the backend not disabled (``torch.backends.cuda.flash_sdp_enabled``,
      ``mem_efficient_sdp_enabled``, as ``torch.nn.attention.sdpa_kernel`` sets them).
    * flash: no ``attn_mask`` (``check_for_attn_mask``); q, k, v head dims equal and at most 256
      (``check_head_dim_size_flash``); float16 or bfloat16 (``check_dtypes_low_precision``); ``is_causal`` only with
      T_q == T_k (``check_flash_causal_non_square_seqlens``).
    * efficient: float16, bfloat16 or float32; q and k head dims equal, q and v head dims multiples of 8 (16-bit)
      or 4 (float32) (``check_head_dim_size_mem_efficient`` with ``minimum_gemm_alignment``), and storage offsets
      aligned likewise (``check_data_ptr_alignment_mem_efficient``).

    Not modelled: the GPU-specific refusals (flash with head dims over 192 needing gradients on compute capability
    8.6/8.9, which takes the memory-efficient kernel instead, still fused) and cuDNN attention, which PyTorch
    prefers on some Hopper/Blackwell builds and which is fused too. On a V100 (7.0) neither FlashAttention-2 nor
    bfloat16 memory-efficient attention exists, so there a bfloat16 attention runs the math path.
    """
    q, k, v = query, key, value
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "math"
    (b, nh, t_q, hs), (b_k, nh_k, t_k, hs_k), (b_v, nh_v, _, hs_v) = q.shape, k.shape, v.shape
    if not (b == b_k == b_v) or nh_k != nh_v or not (nh == nh_k or (enable_gqa and nh_k and nh % nh_k == 0)):
        return "math"
    if not (t_q and t_k) or any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (q, k, v)):
        return "math"
    if not q.dtype == k.dtype == v.dtype:
        return "math"
    flash = (torch.backends.cuda.flash_sdp_enabled() and attn_mask is None and hs == hs_k == hs_v <= _FLASH_HEAD_DIM_MAX
             and q.dtype in _FLASH_DTYPES and not (is_causal and t_q != t_k))  # fmt: skip
    if flash:
        return "flash"
    align = 8 if q.dtype in _FLASH_DTYPES else 4  # minimum_gemm_alignment: 128 bits, at least 4 elements
    aligned = hs % align == 0 and hs_v % align == 0 and all(t.storage_offset() % align == 0 for t in (q, k, v))
    efficient = torch.backends.cuda.mem_efficient_sdp_enabled() and q.dtype in _EFFICIENT_DTYPES and hs == hs_k
    return "efficient" if efficient and aligned else "math"


def fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` on meta tensors as ``freqopt.flash_attention`` where a GPU would run a
    fused kernel (``cuda_sdpa_backend``; see the module docstring for how each argument is counted), else PyTorch's
    math path; returns the attention output shaped like SDPA's, (B, nh, T_q, hs_v). Tensors on other devices go to
    PyTorch's SDPA unchanged."""
    original = (query, key, value)
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    if enable_gqa:  # passed only when set: PyTorch before 2.5 has no such argument
        kwargs["enable_gqa"] = enable_gqa
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in original):
        return _TORCH_SDPA(*original, **kwargs)
    if cuda_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) == "math":
        with _gpu_math_path():  # the GPU runs this math path too
            return _TORCH_SDPA(*original, **kwargs)
    if value.shape[-1] != query.shape[-1]:  # fused on a GPU, but not expressible: freqopt.workload.trace warns of the math path
        return _TORCH_SDPA(*original, **kwargs)
    global _sdpa_depth
    _sdpa_depth += 1
    try:
        return freqopt.workload.models.ops.flash_attention(query, key, value, bool(is_causal) and attn_mask is None)
    finally:
        _sdpa_depth -= 1


@contextlib.contextmanager
def _functional_sdpa_fused():
    """torch.nn.functional's module-level ``scaled_dot_product_attention`` (which ``multi_head_attention_forward``
    calls) bound to ``fused_sdpa``, restored on exit."""
    with mock.patch.object(F, "scaled_dot_product_attention", fused_sdpa):
        yield


class FusedSDPA(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on meta tensors runs as ``fused_sdpa``, and so does the
    one that ``F.multi_head_attention_forward`` calls (``nn.MultiheadAttention`` with ``need_weights=False``, the
    ``nn.Transformer*`` layers); everything else runs as usual. Enter it inside the tracer's dispatch mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TORCH_SDPA:
            return fused_sdpa(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            with _functional_sdpa_fused():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
