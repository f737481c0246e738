"""The kernels of a traced iteration, as data: what freqopt.workload.trace records and every layer above reads.

A ``Kernel`` is one GPU kernel (an ATen operator that computes or moves data) with its FLOPs, device-memory bytes,
shapes and, for a collective, its message size and group; a ``Trace`` is the ordered kernels of one iteration of
one rank. ``OpCall`` keeps what it takes to launch a kernel's operator again (freqopt.gpu.replay), with every tensor
reduced to a ``TensorSpec`` (shape, strides, dtype, storage offset).

This module imports nothing of freqopt, so that the backends, the replay and the search can use these types
without importing the tracer (which imports the models and the phase hooks).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch

__all__ = ["Kernel", "OpCall", "TensorSpec", "Trace", "TracedWorkload", "record_call", "DEVICE", "PASSES",
           "COLLECTIVE_KINDS", "GPUPathWarning", "UntracedWarning"]

PASSES = ("forward", "backward", "optimizer")
COLLECTIVE_KINDS = ("all-reduce", "send", "recv")  # send, recv: pipeline P2P (freqopt.workload.pipeline_trace)


class GPUPathWarning(UserWarning):
    """An operator was traced on a path that PyTorch on a GPU would not take (the message names the operator and,
    where known, its module), so the trace holds other kernels than the GPU runs. freqopt.workload.trace's recorder issues
    it; its module docstring lists when."""


class UntracedWarning(UserWarning):
    """Part of a module's work is not in the trace: the message names the module and what is left out (an
    operator from outside ATen, whose compute and memory traffic the tracer cannot see; expert parallelism's
    all-to-all). freqopt.workload.trace's recorder issues it."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of a recorded operator, without its data: what a replay allocates to call it again.

    Attributes:
        shape, stride: in elements, as the operator saw them (strides of transposed or broadcast views kept).
        dtype: element type.
        offset: storage offset, elements (0 for a tensor at the start of its storage).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0

    @property
    def storage_elements(self) -> int:
        """Elements the storage must hold for this view: offset + 1 + sum((size - 1) * stride); 0 if empty."""
        if any(s == 0 for s in self.shape):
            return 0
        return self.offset + 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))


class _Device:
    """Stands for a ``torch.device`` argument: a replay passes the device it replays on."""

    def __repr__(self) -> str:
        return "DEVICE"

    def __reduce__(self):
        return "DEVICE"


DEVICE = _Device()


@dataclass(frozen=True)
class OpCall:
    """What it takes to call a traced operator again: the overload and its arguments, data left out.

    Attributes:
        op: the overload, ``namespace.packet.overload`` (``aten.gelu.default``, ``aten._foreach_add_.Scalar``,
            ``freqopt.flash_attention.default``); ``torch.ops`` resolves it.
        args: positional arguments: a TensorSpec per tensor, tuples for lists (of tensors or of ints), ``DEVICE``
            for a device, and scalars, bools, strings, None, dtypes, layouts and memory formats as themselves.
        kwargs: keyword arguments, (name, value) pairs in call order, values as in ``args``.
        unreplayable: why the call cannot be made again (an argument of another type), or None.
    """

    op: str
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    unreplayable: str | None = None

    @property
    def tensors(self) -> list[TensorSpec]:
        """Every TensorSpec in the arguments, in order (lists flattened)."""
        found: list[TensorSpec] = []

        def visit(value) -> None:
            if isinstance(value, TensorSpec):
                found.append(value)
            elif isinstance(value, tuple):
                for v in value:
                    visit(v)

        visit(self.args)
        visit(tuple(v for _, v in self.kwargs))
        return found


_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.layout, torch.memory_format)


class _Unreplayable(Exception):
    pass


def _arg_spec(value):
    """The hashable replay spec of one argument (OpCall.args); raises _Unreplayable for any other type."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, int(value.storage_offset()))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.device):
        return DEVICE
    if isinstance(value, (list, tuple)):
        return tuple(_arg_spec(v) for v in value)
    raise _Unreplayable(f"an argument of type {type(value).__name__}")


def record_call(func, args: tuple, kwargs: dict) -> OpCall:
    """The OpCall of ``func(*args, **kwargs)`` (func an OpOverload): shapes, strides, dtypes, the rest as is."""
    op = f"{func.namespace}.{func._overloadpacket.__name__}.{func._overloadname}"
    try:
        return OpCall(op, _arg_spec(tuple(args)), tuple((k, _arg_spec(v)) for k, v in kwargs.items()))
    except _Unreplayable as e:
        return OpCall(op, unreplayable=str(e))


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel of a traced iteration.

    Attributes:
        name: the ATen operator (``aten.mm``, ``freqopt.flash_attention``).
        kind: gemm, attention, elementwise, normalization, softmax, reduction, embedding, optimizer, memcpy,
            all-reduce; send and recv (a pipeline stage's P2P transfers, freqopt.workload.pipeline_trace).
        pass_name: forward, backward or optimizer: for a collective, the pass it is issued in (it runs at that
            pass's clocks under a pass-level table, as the GPU's clock is one for all streams).
        flops: floating-point operations (torch.utils.flop_counter's count; causal masking not discounted).
        mem_bytes: bytes read from and written to device memory.
        dtype: element type of the first floating-point input (``bfloat16``).
        shapes: shapes of the tensor inputs, in argument order; for multi-tensor kernels (8 or more inputs)
            a single (tensor count, total elements) pair; for a grouped GEMM (``aten._grouped_mm``) traced with a
            stated token split (freqopt.workload.moe), followed by the rows of each expert's group.
        tensor_core: runs on tensor cores (a 16-bit GEMM or attention).
        causal: an attention kernel with causal masking (FlashAttention skips the masked half of the work).
        stream: CUDA stream: 0 the training stream, 1 the communication stream that overlaps it.
        comm_bytes: for a collective, the message size in bytes (the buffer each rank contributes).
        group_size: ranks in the collective's group (1: not a collective).
        group_stride: distance between the group's global ranks (1 for tp groups, tp for dp groups), which
            decides whether the group spans nodes.
        call: how to call the operator again (freqopt.gpu.replay): its overload and argument specs; None for a kernel
            not recorded by the tracer. Not part of equality, hash, signature or repr, so kernel classes are as
            before; it holds shapes, not tensors.
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
    comm_bytes: float = 0.0
    group_size: int = 1
    group_stride: int = 1
    call: OpCall | None = field(default=None, compare=False, repr=False)

    @cached_property
    def signature(self) -> str:
        """Kernel-class key: kernels with equal signatures run the same code on the same shapes (and, for a
        collective, over the same group)."""
        shapes = ",".join("x".join(map(str, s)) for s in self.shapes)
        group = f"|ranks={self.group_size},stride={self.group_stride},stream={self.stream}" if self.is_collective else ""
        return f"{self.kind}|{self.name}|{self.dtype}|{shapes}{group}"

    @property
    def class_key(self) -> str:
        """Kernel-class key of a tuning unit at kernel level: the pass and the signature. Kernels of one signature in
        different passes are different classes, so that the kernel level refines the pass level (any pass-level
        schedule is a kernel-level one) and a runtime switching at phase boundaries can apply it."""
        return f"{self.pass_name}/{self.signature}"

    @property
    def is_collective(self) -> bool:
        return self.group_size > 1

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of device memory traffic."""
        return self.flops / self.mem_bytes if self.mem_bytes else math.inf


class TracedWorkload(Protocol):
    """The workload a Trace was traced from: a freqopt.workload.models.Workload (the models sit above this module,
    which imports nothing of freqopt, so it names the attributes a trace's readers take rather than the type).

    Attributes:
        model: the model's name ("gpt3-small", "hf:NAME").
        config: its architecture (freqopt.workload.models.ModelConfig, or a user's own step's StepConfig): seq_len
            (tokens per sequence) and, for the built-in models, n_layers, d_model, n_heads.
        micro_batch_size: sequences per model replica per step.
        layout: the parallel layout (freqopt.workload.layout.Layout) the trace is one rank of.
    """

    @property
    def model(self) -> str: ...

    @property
    def config(self) -> Any: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def layout(self) -> Any: ...


@dataclass(frozen=True)
class Trace:
    """The ordered kernels of one training iteration on one GPU (one rank of the workload's layout)."""

    workload: TracedWorkload
    kernels: tuple[Kernel, ...]
    meta: dict = field(default_factory=dict)

    @property
    def total_flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    def kernel_classes(self) -> dict[str, int]:
        """Kernel class (Kernel.class_key) -> number of kernels of that class in the iteration, first-seen order."""
        return dict(Counter(k.class_key for k in self.kernels))

    def __len__(self) -> int:
        return len(self.kernels)

    def __repr__(self) -> str:
        """One line: the workload, kernel and kernel-class counts, FLOPs and layout (not the kernels themselves,
        which run to hundreds of kilobytes; ``trace.kernels`` holds them)."""
        w = self.workload
        config = getattr(w, "config", None)
        layout = getattr(w, "layout", None)
        mode = self.meta.get("mode", "train")
        size = (f"micro-batch {getattr(w, 'micro_batch_size', '?')} x {getattr(config, 'seq_len', '?')} tokens"
                if config is not None else "")  # fmt: skip
        parts = [f"model={getattr(w, 'model', w)!r}", mode, size, f"{len(self.kernels)} kernels",
                 f"{len(self.kernel_classes())} classes", f"{self.total_flops / 1e12:.3g} TFLOP", str(layout or "")]
        return f"Trace({', '.join(p for p in parts if p)})"
