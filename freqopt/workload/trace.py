"""Trace one training iteration into the GPU kernels one rank runs, on the meta device (no memory, any model size).

A TorchDispatchMode sees every ATen operator the forward pass, ``loss.backward()`` and the optimizer step
dispatch. Each operator that computes or moves data becomes a Kernel; views (``OpOverload.is_view``) and
allocations are not kernels. Each Kernel keeps the call that launches it again (``Kernel.call``, an OpCall: the
operator overload, and its arguments with every tensor reduced to shape, strides, dtype and storage offset), which
freqopt.gpu.replay uses to re-run the kernel itself on a real device. FLOPs come from torch.utils.flop_counter's
formulas; device-memory bytes are the bytes of the tensors each operator reads and writes (what an unfused eager
kernel moves).

A parallel layout (freqopt.workload.layout) traces one rank as DeepSpeed runs it (checked against a real run in
tests/test_deepspeed.py):

* tensor parallel (AutoTP): sharded q/k/v/up and o/down projections (freqopt.workload.models.parallel), an all-reduce of
  the activations after each row-parallel layer in forward and of the input gradient of each column-parallel
  layer in backward, all on the training stream;
* data parallel (ZeRO stages 0-1): gradients all-reduced in buckets of ``Layout.bucket_elements``, each issued on
  a communication stream as soon as its last gradient is accumulated (ZeRO-1 ``overlap_comm``), so that it
  overlaps the rest of the backward pass; the optimizer step waits for all of them;
* gradient clipping at global norm 1.0 (Brown et al. 2020 appendix B; DeepSpeed's default ``gradient_clipping``),
  whose squared norm is all-reduced over the tp and dp groups, as ``deepspeed.runtime.utils.clip_grad_norm_``.

The recorder warns (``GPUPathWarning``, once per operator and module, naming both) where it sees an operator run on
a path that PyTorch on a GPU would not take, so that the trace holds other kernels than the GPU runs:

* ``aten._safe_softmax``: the decomposed math path of ``F.scaled_dot_product_attention``
  (``_scaled_dot_product_attention_math`` in aten/src/ATen/native/transformers/attention.cpp; a softmax that PyTorch
  keeps for its SDPA math implementations), for 4-D inputs other than float64, outside a call that freqopt.workload.models.sdpa itself sent down that path because a
  GPU would take it too. On the meta device SDPA always takes this path; freqopt.workload.models.sdpa.FusedSDPA routes the
  calls it sees (direct ones, and ``nn.MultiheadAttention``'s) to one fused kernel, so this flags a call it did not
  see, or one that ``freqopt.flash_attention`` cannot express, where a GPU would run a fused kernel.
* a float32 GEMM while CUDA matmuls are allowed TF32 (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, or
  ``allow_tf32`` before PyTorch 2.9; ``torch.set_float32_matmul_precision("high")`` sets it): cuBLAS runs it on
  tensor cores in TF32, while the trace counts it at the FP32 CUDA-core rate (freqopt's GPU model has no TF32 rate).
* a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: ``nn.RNNBase``), warned of once its forward ends, with the
  kernels it was traced as: off CUDA ``aten.lstm``/``gru``/``rnn_tanh`` decompose into each time step's gate GEMMs
  and elementwise kernels (``_rnn_impl`` in aten/src/ATen/native/RNN.cpp), while on a GPU they dispatch to cuDNN's
  fused RNN (``aten._cudnn_rnn``: one kernel sequence per layer and direction, its weights' GEMM over all time
  steps at once). The trace, and what is predicted of it, rest on the decomposition.

A float32 GEMM with TF32 off, and ``nn.MultiheadAttention``'s explicit path with ``need_weights=True``, are what a
GPU runs, and are not warned of.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from unittest import mock

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from freqopt.workload.kernels import (  # noqa: F401  re-exported: a trace's data classes live in freqopt.workload.kernels
    COLLECTIVE_KINDS, DEVICE, PASSES, GPUPathWarning, Kernel, OpCall, TensorSpec, Trace, UntracedWarning, dtype_name,
    record_call,
)
from freqopt.workload.autocast import CudaAutocast, enable_cuda_autocast
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.ops import MixedPrecisionAdamW
from freqopt.workload.models.parallel import COMM_STREAM, COMPUTE_STREAM, all_reduce, shard_tensor_parallel
from freqopt.workload.models.meta_checks import MetaChecks
from freqopt.workload.moe import (
    BALANCED, UntraceableExpertsError, check_routing, expert_rows, experts_implementation, grouped_gemm_cost,
    is_experts_module,
)
from freqopt.workload.models.sdpa import FusedSDPA, gpu_math_path_active, user_sdpa_kernel_name
from freqopt.workload.phases import PhaseHooks, quiet_backward_hooks

__all__ = ["Kernel", "OpCall", "TensorSpec", "Trace", "trace_training_iteration", "trace_inference", "trace_iteration",
           "record_call", "MODES", "PASSES", "PRECISIONS", "GPUPathWarning", "UntracedWarning",
           "meta_as_cuda_for_optimizers"]

MODES = ("train", "inference")


# ATen operator (overload packet name) -> kernel kind; any other computing operator is elementwise.
OP_KINDS = {
    "mm": "gemm", "addmm": "gemm", "bmm": "gemm", "baddbmm": "gemm",
    # A mixture-of-experts layer's experts, one grouped GEMM per projection (freqopt.workload.moe).
    "_grouped_mm": "gemm",
    # Convolutions run as cuDNN's implicit GEMMs, on tensor cores in bf16/fp16 (FLOPs from the shapes:
    # torch.utils.flop_counter's convolution formulas).
    "convolution": "gemm", "convolution_backward": "gemm", "_convolution": "gemm",
    "flash_attention": "attention", "flash_attention_backward": "attention",
    "native_layer_norm": "normalization", "native_layer_norm_backward": "normalization",
    "_softmax": "softmax", "_softmax_backward_data": "softmax", "_safe_softmax": "softmax",
    "_log_softmax": "softmax", "_log_softmax_backward_data": "softmax",
    "nll_loss_forward": "reduction", "nll_loss_backward": "reduction",
    "sum": "reduction", "mean": "reduction",
    "embedding": "embedding", "embedding_dense_backward": "embedding",
    "_fused_adamw_": "optimizer", "_fused_adam_": "optimizer", "_fused_sgd_": "optimizer",
    # torch.optim's multi-tensor (foreach) optimizers: AdamW, Adam, SGD with momentum and the like. The in-place
    # _foreach_mul_ stays elementwise: the built-in models' gradient clipping scales the gradients with it, and
    # every recorded figure was searched on traces where it is (a kind is a label here: the simulated GPU's
    # physics treats elementwise and optimizer kernels alike).
    "_foreach_add_": "optimizer", "_foreach_add": "optimizer", "_foreach_sub_": "optimizer",
    "_foreach_mul": "optimizer", "_foreach_div_": "optimizer",
    "_foreach_div": "optimizer", "_foreach_lerp_": "optimizer", "_foreach_addcmul_": "optimizer",
    "_foreach_addcdiv_": "optimizer", "_foreach_sqrt": "optimizer", "_foreach_sqrt_": "optimizer",
    "_foreach_maximum_": "optimizer", "_foreach_neg": "optimizer", "_foreach_neg_": "optimizer",
    "_foreach_pow": "optimizer", "_foreach_reciprocal_": "optimizer", "_foreach_sign": "optimizer",
    "_to_copy": "memcpy", "copy_": "memcpy", "_foreach_copy_": "memcpy", "clone": "memcpy",
    "_foreach_norm": "reduction", "linalg_vector_norm": "reduction", "stack": "memcpy",
    "all_reduce": "all-reduce",
}  # fmt: skip
# Operators that allocate or only bookkeep: no kernel runs.
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "arange",
                "_unsafe_view"}
# Operator namespaces that launch no kernel: torch.profiler's record_function markers.
_NO_KERNEL_NAMESPACES = {"profiler"}
# Multi-tensor kernels (fused AdamW over every parameter) are keyed by tensor count and elements, not each shape.
_MULTI_TENSOR_MIN_INPUTS = 8


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for tensor t: its elements, but no more than its storage (broadcast views)."""
    nbytes = t.numel() * t.element_size()
    try:
        return min(nbytes, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return nbytes


# PyTorch's fused Adam(W) kernel stores the gradient back only when it unscales it (grad_scale given:
# aten/src/ATen/native/cuda/fused_adam_utils.cuh), though the schema marks the gradients as written.
_WRITES_GRADS_ONLY_WHEN_SCALED = {"_fused_adamw_", "_fused_adam_"}
_NLL_LOSS = {"nll_loss_forward", "nll_loss_backward"}


def _written_arguments(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator writes in place: its schema's arguments marked as written (``Tensor(a!)``), e.g.
    the parameters and moments of ``_fused_adamw_`` or the tensors of ``_foreach_mul_``, which return nothing."""
    found: list[torch.Tensor] = []
    op = func._overloadpacket.__name__
    scaled = kwargs.get("grad_scale") is not None
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name == "grads" and op in _WRITES_GRADS_ONLY_WHEN_SCALED and not scaled:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


def _nll_loss_bytes(op: str, args: tuple, written: list[torch.Tensor]) -> int:
    """Device-memory bytes of the negative log-likelihood loss: the forward reads the targets and one log-probability
    per row (a gather, not the (N, C) input); the backward reads the targets and writes the whole (N, C) gradient
    (zero-filled, then one entry per row), never reading the input (aten/src/ATen/native/cuda/Loss.cu)."""
    target = args[2] if op == "nll_loss_backward" else args[1]
    nbytes = _tensor_bytes(target) + sum(map(_tensor_bytes, written))
    if op == "nll_loss_forward":
        nbytes += target.numel() * args[0].element_size()
    return nbytes


# A convolution's backward is two GPU kernels (PyTorch's cudnn_convolution_backward calls cuDNN's data-gradient and
# weight-gradient convolutions one after the other, each its own implicit GEMM of another shape), so the tracer
# records one kernel per gradient it computes, named by it; the bias gradient (a sum over grad_output) rides with
# the weight's.
CONVOLUTION_BACKWARD_INPUT = "aten.convolution_backward_input"
CONVOLUTION_BACKWARD_WEIGHT = "aten.convolution_backward_weight"


def _conv_read_fraction(weight: torch.Tensor, stride) -> float:
    """Share of a convolution's input its windows read: in each spatial dimension a window of k taps every s pixels
    touches min(1, k / s) of them (a 1 x 1 convolution with stride 2 reads a quarter of a 2-D input)."""
    fraction = 1.0
    for k, s in zip(weight.shape[2:], stride if isinstance(stride, (list, tuple)) else [stride] * (weight.dim() - 2)):
        fraction *= min(1.0, k / s) if s > 0 else 1.0
    return fraction


def _convolution_backward_kernels(func, args: tuple, out, call: OpCall, *, pass_name: str) -> list[Kernel]:
    """The kernels of one ``aten.convolution_backward`` call: the data gradient (reads grad_output and the weight,
    writes grad_input) and the weight gradient (reads grad_output and the input, writes grad_weight and grad_bias),
    each where its ``output_mask`` entry asks for it, FLOPs from torch.utils.flop_counter's formula with only that
    entry set, and a ``call`` that replays it alone (the same operator with that output_mask)."""
    grad_output, x, weight = args[0], args[1], args[2]
    mask = tuple(bool(m) for m in args[10])
    formula = flop_registry[func._overloadpacket]
    dtype = dtype_name(grad_output.dtype)
    kernels = []
    for name, direction, written, read in ((CONVOLUTION_BACKWARD_INPUT, (True, False, False), out[:1], weight),
                                           (CONVOLUTION_BACKWARD_WEIGHT, (False, True, mask[2]), out[1:], x)):
        if not any(m and d for m, d in zip(mask, direction)):
            continue
        direction = tuple(m and d for m, d in zip(mask, direction))
        sub_args = (*args[:10], list(direction), *args[11:])
        outputs = [o for o in written if isinstance(o, torch.Tensor)]
        read_bytes = _tensor_bytes(read) * (_conv_read_fraction(weight, args[4]) if read is x else 1.0)
        flops = float(formula(*sub_args, out_val=out))
        sub_call = dataclasses.replace(call, args=(*call.args[:10], direction, *call.args[11:])) if call.args else call
        kernels.append(Kernel(
            name=name, kind="gemm", pass_name=pass_name, flops=flops,
            mem_bytes=float(_tensor_bytes(grad_output) + read_bytes + sum(map(_tensor_bytes, outputs))),
            dtype=dtype, shapes=_shapes([grad_output, x, weight]), tensor_core=dtype in ("bfloat16", "float16"),
            call=sub_call,
        ))  # fmt: skip
    return kernels


def _shapes(inputs: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    if len(inputs) >= _MULTI_TENSOR_MIN_INPUTS:
        return ((len(inputs), sum(t.numel() for t in inputs)),)
    return tuple(tuple(t.shape) for t in inputs)


def _cuda_matmul_uses_tf32() -> bool:
    """Whether cuBLAS may run float32 matmuls in TF32: ``torch.backends.cuda.matmul.fp32_precision`` (PyTorch >= 2.9;
    reading the legacy ``allow_tf32`` raises once the new API was used), else ``allow_tf32``."""
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):
        return bool(torch.backends.cuda.matmul.allow_tf32)


class KernelRecorder(TorchDispatchMode):
    """Records every operator that computes or moves data as a Kernel (module docstring), and warns of operators
    (and recurrent layers) traced on a path a GPU would not take, naming the module whose forward ran them (its
    qualified name under ``root``, else its class), which global forward hooks track while the recorder is active;
    ``warn=False`` records without warning (a warm-up step that is not kept). ``routing`` is the token split between
    a mixture-of-experts layer's experts (freqopt.workload.moe.check_routing: "balanced" or per-expert shares).

    Warns ``UntracedWarning`` (once per operator and module, naming both) of work it cannot see: an operator outside
    the ATen and freqopt namespaces (a custom operator, e.g. ``transformers::grouped_mm_fallback``, whose compute and
    memory traffic are left out) and an experts module running with transformers' expert parallelism on (its
    all-to-all is left out). Raises InvalidSettingError for an experts module running transformers' "eager" loop,
    which cannot run on the meta device (freqopt.workload.moe)."""

    def __init__(self, root: torch.nn.Module | None = None, *, warn: bool = True, routing=BALANCED) -> None:
        super().__init__()
        self.routing = check_routing(routing)
        self.kernels: list[Kernel] = []
        self.pass_name = "forward"
        self.marks: list[tuple[str, int]] = []
        self.root = root
        self._modules: list[torch.nn.Module] = []  # forwards running, innermost last
        self._module_hooks: list = []
        self._warned: set[tuple[str, str]] = set()
        self._rnn_starts: dict[int, int] = {}  # id of a recurrent module whose forward runs -> its first kernel
        self.warn = warn

    def mark(self, label: str) -> None:
        """A phase boundary (freqopt.workload.phases) before the next kernel."""
        self.marks.append((label, len(self.kernels)))

    def __enter__(self):
        self._module_hooks = [register_module_forward_pre_hook(self._module_start),
                              register_module_forward_hook(self._module_done, always_call=True)]  # fmt: skip
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            for handle in self._module_hooks:
                handle.remove()
            self._module_hooks, self._modules = [], []

    def _module_done(self, module, args, output) -> None:
        if self._modules and self._modules[-1] is module:
            if isinstance(module, torch.nn.RNNBase):
                self._check_recurrent(module)
            self._modules.pop()

    def _check_recurrent(self, module: torch.nn.RNNBase) -> None:
        """Warn that a recurrent layer, whose forward is ending (the innermost running module), was traced as the
        per-time-step decomposition its operator takes off CUDA, not as cuDNN's fused RNN (module docstring)."""
        start = self._rnn_starts.pop(id(module), len(self.kernels))
        n = len(self.kernels) - start
        if n == 0:
            return
        kind = type(module).__name__
        self._warn(f"nn.{kind}", f"traced as {n:,} forward kernels, the per-time-step decomposition (each step's "
                   "gate GEMMs and elementwise kernels, and more in backward) that PyTorch runs off CUDA, where a GPU "
                   "runs cuDNN's fused RNN (aten._cudnn_rnn, one kernel sequence per layer and direction); the "
                   "predicted time and energy rest on the decomposition, not on cuDNN's kernels")  # fmt: skip

    def _module_start(self, module, args) -> None:
        self._modules.append(module)
        if isinstance(module, torch.nn.RNNBase):
            self._rnn_starts[id(module)] = len(self.kernels)
        if is_experts_module(module):
            self._check_experts(module)

    def _check_experts(self, module: torch.nn.Module) -> None:
        """Refuse transformers' eager experts loop and warn of expert parallelism (freqopt.workload.moe)."""
        if experts_implementation(module) == "eager":
            raise UntraceableExpertsError(
                f"the experts{self._module_name()} run transformers' 'eager' experts loop, which reads the routing on "
                "the host (nonzero over the routing mask) and cannot run on the meta device; build the model with "
                "experts_implementation='grouped_mm' (transformers' default where grouped GEMMs are available)"
            )
        if getattr(module, "_is_expert_parallel", False):
            self._warn("expert parallelism", "the all-to-all dispatch and combine of the routed tokens are not traced "
                       "(freqopt's layouts have no expert-parallel degree; every rank is traced holding every expert)",
                       UntracedWarning)  # fmt: skip

    def _module_name(self) -> str:
        """The innermost running forward as ' in module NAME (Class)' (NAME qualified under the root), or '' outside
        any."""
        if not self._modules:
            return ""
        module = self._modules[-1]
        names = {id(m): name for name, m in self.root.named_modules()} if self.root is not None else {}
        name, kind = names.get(id(module)), type(module).__name__
        if name is None:
            return f" in a {kind} module"
        return f" in module {name} ({kind})" if name else f" in the root module ({kind})"

    def _warn(self, op: str, message: str, category: type[Warning] = GPUPathWarning) -> None:
        if not self.warn:
            return
        where = self._module_name()
        if (op, where) in self._warned:
            return
        self._warned.add((op, where))
        warnings.warn(f"{op}{where}: {message}", category, stacklevel=2)

    def _check_gpu_path(self, op: str, kind: str, inputs: list[torch.Tensor]) -> None:
        """Warn of an operator on a path a GPU would not take (the module docstring lists the two cases)."""
        if op == "aten._safe_softmax" and not gpu_math_path_active():
            scores = inputs[0]
            if scores.dim() == 4 and scores.dtype != torch.float64:
                self._warn(op, "scaled_dot_product_attention was traced through PyTorch's math path (q k^T, softmax "
                           f"and p v as separate {dtype_name(scores.dtype)} kernels and a {tuple(scores.shape)} score "
                           "tensor in device memory), where a GPU runs one fused attention kernel each way; call it "
                           "with inputs freqopt.flash_attention takes, from code the FusedSDPA mode sees")  # fmt: skip
        elif kind == "gemm" and inputs and inputs[0].dtype == torch.float32 and _cuda_matmul_uses_tf32():
            self._warn(op, "a float32 GEMM with TF32 allowed for CUDA matmuls (torch.backends.cuda.matmul): a GPU "
                       "runs it on tensor cores in TF32, while the trace counts it at the FP32 CUDA-core rate")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        op = packet.__name__
        if func.namespace not in ("aten", "freqopt") and func.namespace not in _NO_KERNEL_NAMESPACES:
            self._warn(f"{func.namespace}.{op}", "an operator from outside ATen, which the tracer cannot see into: "
                       "its compute and memory traffic are left out of the trace", UntracedWarning)  # fmt: skip
        if func.is_view or op in NOT_KERNELS or func.namespace not in ("aten", "freqopt"):
            return func(*args, **kwargs)
        call = record_call(func, args, kwargs)  # before the call: an in-place operator could change its inputs
        out = func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not inputs and not outputs:
            return out
        if op == "all_reduce":
            self.kernels.append(_all_reduce_kernel(*args, pass_name=self.pass_name, call=call))
            return out
        if op == "convolution_backward":
            self.kernels.extend(_convolution_backward_kernels(func, args, out, call, pass_name=self.pass_name))
            return out
        # In-place and out= operators return their (already counted) inputs, or nothing (the foreach and fused
        # optimizer operators): count each storage they write once more, as written.
        written = [o for o in outputs if not any(o is i for i in inputs)]
        mutated = [o for o in outputs if any(o is i for i in inputs)]
        mutated += [t for t in _written_arguments(func, args, kwargs) if not any(t is o for o in mutated)]
        mem_bytes = sum(map(_tensor_bytes, inputs)) + sum(map(_tensor_bytes, written)) + sum(map(_tensor_bytes, mutated))
        if op == "_foreach_copy_" or op == "copy_":  # reads the source, writes the destination
            mem_bytes = sum(map(_tensor_bytes, inputs))
        elif op in ("convolution", "_convolution"):  # a strided window reads only part of its input
            mem_bytes -= _tensor_bytes(args[0]) * (1.0 - _conv_read_fraction(args[1], args[3]))
        elif op in _NLL_LOSS:
            mem_bytes = _nll_loss_bytes(op, args, written)
        formula = flop_registry.get(packet)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
        shapes = _shapes(inputs)
        if op == "_grouped_mm":
            flops, mem_bytes, shapes = self._grouped_gemm(args, kwargs, out, shapes)
        floating = [t for t in inputs if t.is_floating_point()] or inputs or outputs  # outputs: factories (full)
        dtype = dtype_name(floating[0].dtype)
        kind = OP_KINDS.get(op, "elementwise")
        self._check_gpu_path(f"{func.namespace}.{op}", kind, inputs)
        name = (user_sdpa_kernel_name(op, args, outputs) if kind == "attention" else None) or f"{func.namespace}.{op}"
        self.kernels.append(
            Kernel(
                name=name,
                kind=kind,
                pass_name=self.pass_name,
                flops=flops,
                mem_bytes=float(mem_bytes),
                dtype=dtype,
                shapes=shapes,
                tensor_core=kind in ("gemm", "attention") and dtype in ("bfloat16", "float16"),
                causal=kind == "attention" and bool(args[-1]),
                call=call,
            )
        )
        return out


    def _grouped_gemm(self, args: tuple, kwargs: dict, out: torch.Tensor, shapes: tuple) -> tuple[float, float, tuple]:
        """FLOPs, bytes and shapes of one ``aten._grouped_mm`` under the recorder's token split (freqopt.workload.moe):
        the split dimension's rows divided between the ``offs`` groups; with a stated split, the shapes end with the
        rows of each group."""
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if offs is None:  # 3-D x 3-D: a batched GEMM, no groups
            return (*grouped_gemm_cost(a, b, out, None), shapes)
        split = a.shape[0] if (a.dim(), b.dim()) == (2, 3) else b.shape[1] if a.dim() == 3 else a.shape[1]
        rows = expert_rows(split, offs.shape[0], self.routing, where=f"the grouped GEMM{self._module_name()}")
        flops, mem_bytes = grouped_gemm_cost(a, b, out, rows)
        return flops, mem_bytes, shapes if self.routing is None else (*shapes, rows)


class _TrainerAdamW:
    """The optimizer step of Hugging Face's Trainer with bf16=True, on fp32 weights: the gradients' global norm
    clipped to 1.0 (torch.nn.utils.clip_grad_norm_, its foreach kernels; the squared norm summed over the other
    ranks as ``reduce_sq_norm`` does), then torch.optim.AdamW(fused=True) (Trainer's default adamw_torch_fused)."""

    def __init__(self, params, reduce_sq_norm):
        self.params = [p for p in params if p.requires_grad]
        self.reduce_sq_norm = reduce_sq_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=5e-5, fused=True)
        for p in self.params:  # the state torch.optim makes lazily on the first step: once per run, not per step
            self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                       "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def step(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0)
        total = self.reduce_sq_norm(torch.linalg.vector_norm(torch.stack(norms), 2.0) ** 2) ** 0.5
        torch._foreach_mul_(grads, torch.clamp(1.0 / (total + 1e-6), max=1.0))
        self.optimizer.step()


def _all_reduce_kernel(x: torch.Tensor, group_size: int, group_stride: int, stream: int, *, pass_name: str,
                       call: OpCall | None = None) -> Kernel:
    """A ring all-reduce of x over group_size ranks (NCCL's ring algorithm, Patarasuk & Yuan 2009): a
    reduce-scatter then an all-gather, each n - 1 steps of S / n bytes. Per rank it sends and receives
    2 (n - 1) / n S bytes, adds (n - 1) / n of the elements, and reads and writes its chunks in device memory
    about 5 (n - 1) / n S bytes (three chunk accesses per reduce step, two per gather step)."""
    n = group_size
    nbytes = float(x.numel() * x.element_size())
    return Kernel(
        name="freqopt.all_reduce", kind="all-reduce", pass_name=pass_name,
        flops=x.numel() * (n - 1) / n, mem_bytes=5 * (n - 1) / n * nbytes, dtype=dtype_name(x.dtype),
        shapes=(tuple(x.shape),), stream=stream, comm_bytes=nbytes, group_size=n, group_stride=group_stride,
        call=call,
    )  # fmt: skip


class _GradientBuckets:
    """Data-parallel gradient all-reduce in buckets, as DeepSpeed's ZeRO-1 with ``overlap_comm`` issues it:
    a gradient joins the open bucket when accumulated; a bucket that the next gradient would overflow is
    all-reduced first (on the communication stream), and the last bucket at the end of backward."""

    def __init__(self, params: list[torch.nn.Parameter], dp: int, tp: int, bucket_elements: int):
        self.dp, self.tp, self.limit = dp, tp, bucket_elements
        self.elements, self.dtype = 0, None
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params if p.requires_grad]

    def _ready(self, param: torch.Tensor) -> None:
        if self.elements and self.elements + param.numel() > self.limit:
            self.flush()
        self.elements += param.numel()
        self.dtype = param.dtype

    def flush(self) -> None:
        if self.elements:
            all_reduce(torch.empty(self.elements, dtype=self.dtype, device="meta"), self.dp, self.tp, COMM_STREAM)
        self.elements = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def meta_as_cuda_for_optimizers():
    """torch.optim treats meta parameters as CUDA ones while this is active: it picks its foreach (multi-tensor)
    kernels by default and allows ``fused=True``, as for CUDA parameters (``"meta"`` added to
    ``torch.optim.optimizer._get_foreach_kernels_supported_devices`` and ``_get_fused_kernels_supported_devices``)."""
    import torch.optim.optimizer as optimizer

    with contextlib.ExitStack() as stack:
        for name in ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices"):
            original = getattr(optimizer, name, None)
            if original is not None:
                stack.enter_context(mock.patch.object(optimizer, name, lambda _f=original: [*_f(), "meta"]))
        yield


# How a training step keeps its numbers (trace_iteration's ``precision``):
#   "bf16": bf16 weights and activations, fp32 master weights and moments in the optimizer (MixedPrecisionAdamW): as
#           DeepSpeed's bf16 mode and Megatron-LM train, and as freqopt's models run on a GPU;
#   "bf16-mixed": fp32 weights, the forward under torch.autocast("cuda", dtype=torch.bfloat16) (GEMMs in bf16, the
#           ops autocast keeps in fp32, the casts between), PyTorch's fused AdamW on the fp32 weights after the
#           gradients are clipped to norm 1.0: as Hugging Face's Trainer(bf16=True) trains (its default optimizer
#           adamw_torch_fused, max_grad_norm 1.0).
PRECISIONS = ("bf16", "bf16-mixed")


def trace_training_iteration(workload: Workload, *, dtype: torch.dtype = torch.bfloat16, precision: str = "bf16",
                             routing=BALANCED) -> Trace:  # fmt: skip
    """Kernels of one training iteration: forward, backward and an AdamW step.

    Runs on the meta device, so it needs no memory and takes seconds even for gpt3-175b.

    Args:
        workload: model and micro-batch.
        dtype: parameter and activation dtype of the "bf16" precision; the optimizer keeps FP32 master weights and
            moments.
        precision: one of PRECISIONS ("bf16", "bf16-mixed": fp32 weights under CUDA autocast, as
            Trainer(bf16=True)).
        routing: how a mixture-of-experts layer splits its routed tokens between its experts, which is data on a
            GPU and unknown on the meta device: "balanced" (the default, S / E token-expert pairs each) or a
            sequence of per-expert shares (freqopt.workload.moe). Models without experts ignore it.

    Returns:
        Trace with kernels in issue order; ``meta`` holds the parameter count and the mode.

    Raises:
        InvalidSettingError: an unknown precision; a routing that is neither "balanced" nor one non-negative share
            per expert.
    """
    return trace_iteration(workload, "train", dtype=dtype, precision=precision, routing=routing)


def trace_inference(workload: Workload, *, dtype: torch.dtype = torch.bfloat16, routing=BALANCED) -> Trace:
    """Kernels of one inference batch: the forward pass to logits, without gradients (on the meta device);
    ``routing`` as trace_training_iteration's."""
    return trace_iteration(workload, "inference", dtype=dtype, routing=routing)


def trace_iteration(workload: Workload, mode: str = "train", *, dtype: torch.dtype = torch.bfloat16,
                    precision: str = "bf16", routing=BALANCED) -> Trace:  # fmt: skip
    """One training step (mode "train") or one inference batch (mode "inference") of one rank of the workload's
    layout, traced on the meta device, in ``precision`` (PRECISIONS; "bf16" builds the model in ``dtype``), with
    ``routing`` the token split of its mixture-of-experts layers (trace_training_iteration; freqopt.workload.moe).

    A mixture-of-experts model is traced as a GPU runs it: its router's GEMM, softmax and top-k, each expert
    projection as one grouped GEMM (``aten._grouped_mm``) over the routed token-expert pairs, and shared experts as
    ordinary MLPs; with a stated split, ``meta["routing"]`` holds its shares (normalised to sum 1).

    Raises:
        UnknownNameError: unknown mode.
        InvalidSettingError: an unknown precision; a pipeline layout (pp > 1): its stages are traced by
            freqopt.workload.pipeline_trace.trace_pipeline_stages; a bad routing (trace_training_iteration).
    """
    from freqopt.errors import InvalidSettingError, UnknownNameError

    if mode not in MODES:
        raise UnknownNameError(f"unknown mode {mode!r}; choose train or inference")
    if precision not in PRECISIONS:
        raise InvalidSettingError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    shares = check_routing(routing)
    workload.layout.refuse_pipeline("tracing one rank's whole iteration")
    config, layout = workload.config, workload.layout
    mixed = precision == "bf16-mixed"
    model = shard_tensor_parallel(build_model(config, dtype=torch.float32 if mixed else dtype), layout.tp)
    # Made when entered: torch.autocast("cuda") decides in its constructor whether CUDA AMP is available.
    autocast = [enable_cuda_autocast, lambda: torch.autocast("cuda", dtype=torch.bfloat16), CudaAutocast] if mixed else []
    idx = torch.zeros(workload.micro_batch_size, config.seq_len, dtype=torch.long, device="meta")  # (B, T)
    recorder = KernelRecorder(model, routing=routing)
    hooks = PhaseHooks(model, recorder.mark)
    if mode == "train":
        params = list(model.parameters())
        buckets = _GradientBuckets(params, layout.dp, layout.tp, layout.bucket_elements) if layout.dp > 1 else None

        def reduce_norm(sq_norm: torch.Tensor) -> torch.Tensor:  # deepspeed.runtime.utils.clip_grad_norm_
            if layout.tp > 1:
                sq_norm = all_reduce(sq_norm, layout.tp, 1, COMPUTE_STREAM)
            if layout.dp > 1:
                sq_norm = all_reduce(sq_norm, layout.dp, layout.tp, COMPUTE_STREAM)
            return sq_norm

        optimizer = _TrainerAdamW(params, reduce_norm) if mixed else MixedPrecisionAdamW(params, reduce_sq_norm=reduce_norm)
        with recorder, hooks, FusedSDPA(), MetaChecks(), meta_as_cuda_for_optimizers():
            with contextlib.ExitStack() as stack:
                for make in autocast:
                    stack.enter_context(make())
                loss = model(idx, idx)
            recorder.pass_name = "backward"
            with quiet_backward_hooks():
                loss.backward()
            if buckets is not None:
                buckets.flush()
                buckets.remove()
            recorder.pass_name = "optimizer"
            hooks.mark_step()
            optimizer.step()
    else:
        with torch.no_grad(), recorder, hooks, FusedSDPA(), MetaChecks(), contextlib.ExitStack() as stack:
            for make in autocast:
                stack.enter_context(make())
            model(idx)
    n_params = sum(p.numel() for p in model.parameters())
    from freqopt.workload.fingerprint import FINGERPRINT_KEY, module_fingerprint

    meta = {"n_params": n_params, "mode": mode, "layout": layout.as_dict(), "marks": tuple(recorder.marks),
            FINGERPRINT_KEY: module_fingerprint(model)}  # checked by the runtime: freqopt.workload.fingerprint
    if shares is not None:
        meta["routing"] = shares
    return Trace(workload=workload, kernels=tuple(recorder.kernels), meta=meta)
