"""Trace one training iteration into the GPU kernels it runs, on the meta device (no memory, any model size).

A TorchDispatchMode sees every ATen operator the forward pass, ``loss.backward()`` and the optimizer step
dispatch. Each operator that computes or moves data becomes a Kernel; views (``OpOverload.is_view``) and
allocations are not kernels. FLOPs come from torch.utils.flop_counter's formulas; device-memory bytes are the
bytes of the tensors each operator reads and writes (what an unfused eager kernel moves).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from freqopt.models import Workload, build_model
from freqopt.models.ops import MixedPrecisionAdamW

__all__ = ["Kernel", "Trace", "trace_training_iteration", "trace_inference", "trace_iteration", "MODES", "PASSES"]

MODES = ("train", "inference")

PASSES = ("forward", "backward", "optimizer")

# ATen operator (overload packet name) -> kernel kind, design.md section 2.
_KINDS = {
    "mm": "gemm", "addmm": "gemm", "bmm": "gemm", "baddbmm": "gemm",
    "flash_attention": "attention", "flash_attention_backward": "attention",
    "native_layer_norm": "normalization", "native_layer_norm_backward": "normalization",
    "_softmax": "softmax", "_softmax_backward_data": "softmax",
    "_log_softmax": "softmax", "_log_softmax_backward_data": "softmax",
    "nll_loss_forward": "reduction", "nll_loss_backward": "reduction",
    "sum": "reduction", "mean": "reduction",
    "embedding": "embedding", "embedding_dense_backward": "embedding",
    "_fused_adamw_": "optimizer", "_foreach_add_": "optimizer",
    "_to_copy": "memcpy", "copy_": "memcpy", "_foreach_copy_": "memcpy", "clone": "memcpy",
}  # fmt: skip
# Operators that allocate or only bookkeep: no kernel runs.
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "arange",
                "_unsafe_view"}
# Multi-tensor kernels (fused AdamW over every parameter) are keyed by tensor count and elements, not each shape.
_MULTI_TENSOR_MIN_INPUTS = 8


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel of a traced iteration.

    Attributes:
        name: the ATen operator (``aten.mm``, ``freqopt.flash_attention``).
        kind: gemm, attention, elementwise, normalization, softmax, reduction, embedding, optimizer, memcpy.
        pass_name: forward, backward or optimizer.
        flops: floating-point operations (torch.utils.flop_counter's count; causal masking not discounted).
        mem_bytes: bytes read from and written to device memory.
        dtype: element type of the first floating-point input (``bfloat16``).
        shapes: shapes of the tensor inputs, in argument order; for multi-tensor kernels (8 or more inputs)
            a single (tensor count, total elements) pair.
        tensor_core: runs on tensor cores (a 16-bit GEMM or attention).
        causal: an attention kernel with causal masking (FlashAttention skips the masked half of the work).
        stream: CUDA stream: 0 compute.
    """

    name: str
    kind: str
    pass_name: str
    flops: float
    mem_bytes: float
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    tensor_core: bool = False
    causal: bool = False
    stream: int = 0

    @cached_property
    def signature(self) -> str:
        """Kernel-class key: kernels with equal signatures run the same code on the same shapes."""
        shapes = ",".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.kind}|{self.name}|{self.dtype}|{shapes}"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of device memory traffic."""
        return self.flops / self.mem_bytes if self.mem_bytes else math.inf


@dataclass(frozen=True)
class Trace:
    """The ordered kernels of one training iteration on one GPU."""

    workload: Workload
    kernels: tuple[Kernel, ...]
    meta: dict = field(default_factory=dict)

    @property
    def total_flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    def kernel_classes(self) -> dict[str, int]:
        """Signature -> number of kernels of that class in the iteration, in first-seen order."""
        return dict(Counter(k.signature for k in self.kernels))

    def __len__(self) -> int:
        return len(self.kernels)


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for tensor t: its elements, but no more than its storage (broadcast views)."""
    nbytes = t.numel() * t.element_size()
    try:
        return min(nbytes, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return nbytes


def _shapes(inputs: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    if len(inputs) >= _MULTI_TENSOR_MIN_INPUTS:
        return ((len(inputs), sum(t.numel() for t in inputs)),)
    return tuple(tuple(t.shape) for t in inputs)


class _KernelRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []
        self.pass_name = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        op = packet.__name__
        if func.is_view or op in _NOT_KERNELS or func.namespace not in ("aten", "freqopt"):
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not inputs and not outputs:
            return out
        # In-place and out= operators return their (already counted) inputs: count each storage once as written.
        written = [o for o in outputs if not any(o is i for i in inputs)]
        mutated = [o for o in outputs if any(o is i for i in inputs)]
        mem_bytes = sum(map(_tensor_bytes, inputs)) + sum(map(_tensor_bytes, written)) + sum(map(_tensor_bytes, mutated))
        if op == "_foreach_copy_" or op == "copy_":  # reads the source, writes the destination
            mem_bytes = sum(map(_tensor_bytes, inputs))
        formula = flop_registry.get(packet)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
        floating = [t for t in inputs if t.is_floating_point()] or inputs
        dtype = _dtype_name(floating[0].dtype)
        kind = _KINDS.get(op, "elementwise")
        self.kernels.append(
            Kernel(
                name=f"{func.namespace}.{op}",
                kind=kind,
                pass_name=self.pass_name,
                flops=flops,
                mem_bytes=float(mem_bytes),
                dtype=dtype,
                shapes=_shapes(inputs),
                tensor_core=kind in ("gemm", "attention") and dtype in ("bfloat16", "float16"),
                causal=kind == "attention" and bool(args[-1]),
            )
        )
        return out


def trace_training_iteration(workload: Workload, *, dtype: torch.dtype = torch.bfloat16) -> Trace:
    """Kernels of one training iteration: forward, backward and a mixed-precision AdamW step.

    Runs on the meta device, so it needs no memory and takes seconds even for gpt3-175b.

    Args:
        workload: model and micro-batch.
        dtype: parameter and activation dtype; the optimizer keeps FP32 master weights and moments.

    Returns:
        Trace with kernels in issue order; ``meta`` holds the parameter count and the mode.
    """
    return trace_iteration(workload, "train", dtype=dtype)


def trace_inference(workload: Workload, *, dtype: torch.dtype = torch.bfloat16) -> Trace:
    """Kernels of one inference batch: the forward pass to logits, without gradients (on the meta device)."""
    return trace_iteration(workload, "inference", dtype=dtype)


def trace_iteration(workload: Workload, mode: str = "train", *, dtype: torch.dtype = torch.bfloat16) -> Trace:
    """One training step (mode "train") or one inference batch (mode "inference"), traced on the meta device.

    Raises:
        UnknownNameError: unknown mode.
    """
    from freqopt.errors import UnknownNameError

    if mode not in MODES:
        raise UnknownNameError(f"unknown mode {mode!r}; choose train or inference")
    config = workload.config
    model = build_model(config, dtype=dtype)
    idx = torch.zeros(workload.micro_batch_size, config.seq_len, dtype=torch.long, device="meta")  # (B, T)
    recorder = _KernelRecorder()
    if mode == "train":
        optimizer = MixedPrecisionAdamW(model.parameters())
        with recorder:
            loss = model(idx, idx)
            recorder.pass_name = "backward"
            loss.backward()
            recorder.pass_name = "optimizer"
            optimizer.step()
    else:
        with torch.no_grad(), recorder:
            model(idx)
    n_params = sum(p.numel() for p in model.parameters())
    return Trace(workload=workload, kernels=tuple(recorder.kernels), meta={"n_params": n_params, "mode": mode})
