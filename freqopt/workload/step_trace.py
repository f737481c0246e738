"""Trace a user's own training step: ``freqopt.trace_step(step_fn, name=...)`` -> Trace.

``step_fn`` is a zero-argument callable that runs one training step (forward, ``loss.backward()``, optimizer
step) of a model built on the meta device, so any model size traces in seconds with no memory. It runs once under
freqopt's kernel recorder (freqopt.workload.trace), which records every ATen operator it dispatches as the kernel a GPU
would run, with ``F.scaled_dot_product_attention`` as one fused FlashAttention kernel each way where a GPU runs a
fused kernel, and so ``nn.MultiheadAttention`` with ``need_weights=False`` and the ``nn.Transformer*`` layers
(freqopt.workload.models.sdpa); it warns (``freqopt.workload.trace.GPUPathWarning``) of an operator traced on a path a GPU would not
take, naming it and its module. The passes are found without the user's help:

* backward: operators dispatched inside the autograd engine (``torch._C._current_graph_task_id() != -1``) or
  within a ``Tensor.backward`` call (the loss's ones gradient is made before the engine starts);
* optimizer: operators between torch.optim's global step pre- and post-hooks
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``), and any after the last backward kernel that are in
  neither (gradient clipping, ``zero_grad(set_to_none=False)``);
* forward: the rest.

torch.optim's optimizers trace as the kernels they launch on a GPU: torch.optim picks foreach (multi-tensor)
kernels for CUDA parameters by default and allows ``fused=True`` only on devices it lists; while ``step_fn`` runs,
"meta" is added to both lists (``torch.optim.optimizer._get_foreach_kernels_supported_devices`` and
``_get_fused_kernels_supported_devices``), so a meta model gets what a CUDA model gets. torch.optim keeps foreach
AdamW's step counters as host (CPU) scalars; operators on host scalars alone are not GPU kernels and are not
recorded. With ``module`` given, its phase modules (freqopt.workload.phases) mark phase boundaries as for the built-in
models.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.workload.fingerprint import FINGERPRINT_KEY, module_fingerprint
from freqopt.workload.autocast import CudaAutocast, enable_cuda_autocast
from freqopt.workload.layout import SINGLE_GPU
from freqopt.workload.models import Workload
from freqopt.workload.models.meta_checks import MetaChecks
from freqopt.workload.models.sdpa import FusedSDPA
from freqopt.workload.moe import BALANCED, UntraceableExpertsError, check_routing
from freqopt.workload.phases import PhaseHooks, quiet_backward_hooks
from freqopt.workload.trace import KernelRecorder, Trace, meta_as_cuda_for_optimizers

__all__ = ["StepConfig", "trace_step"]

_META_HINT = "build the model and its inputs under torch.device('meta')"


@dataclass(frozen=True)
class StepConfig:
    """The model config of a user's traced step, for what reads a Trace's ``workload.config`` (clock tables, study
    names). Only ``name`` and ``n_params`` are known from a step; the sizes are what the caller states, else None.

    Attributes:
        name: the model's name (Trace.workload.model).
        n_params: parameters of ``module`` (tied weights once), or None without a module.
        seq_len: tokens per sequence, as stated by the caller, or None.
        n_layers, d_model, n_heads: None: a user's model is not introspected.
    """

    name: str
    n_params: int | None = None
    seq_len: int | None = None
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None


class _RealTensorError(InvalidSettingError):
    pass


class _StepRecorder(KernelRecorder):
    """The kernel recorder with the pass of each operator found from the autograd engine and torch.optim's hooks,
    and a refusal of tensors that are not on the meta device."""

    def __init__(self, root: nn.Module | None = None, *, warn: bool = True, routing=BALANCED) -> None:
        super().__init__(root, warn=warn, routing=routing)
        self.optimizer_depth = 0  # inside an optimizer step (pre-hook run, post-hook not yet)
        self.backward_depth = 0  # inside a Tensor.backward call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        _check_meta(inputs, func)
        if inputs and all(t.device.type == "cpu" for t in inputs):  # host scalars only: no GPU kernel
            return func(*args, **kwargs)
        device = kwargs.get("device")
        if not inputs and device is not None and torch.device(device).type != "meta":  # a factory off the GPU
            out = func(*args, **kwargs)
            _check_meta([o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)], func)
            return out  # a host scalar (torch.tensor(0.0)): no GPU kernel
        if self.optimizer_depth:
            self.pass_name = "optimizer"
        elif self.backward_depth or torch._C._current_graph_task_id() != -1:
            self.pass_name = "backward"
        else:
            self.pass_name = "forward"
        out = super().__torch_dispatch__(func, types, args, kwargs)
        _check_meta([o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)], func)
        return out


def _check_meta(tensors: list[torch.Tensor], func) -> None:
    for t in tensors:
        if t.device.type != "meta" and not (t.device.type == "cpu" and t.dim() == 0):
            raise _RealTensorError(f"step_fn ran {func} on a {t.device.type} tensor of shape {tuple(t.shape)}; "
                                   f"{_META_HINT}")  # fmt: skip


class _BackwardCalls(TorchFunctionMode):
    """Counts the recorder into the backward pass for the duration of each ``Tensor.backward`` call."""

    def __init__(self, recorder: _StepRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            return func(*args, **kwargs)
        self.recorder.backward_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder.backward_depth -= 1


@contextlib.contextmanager
def _optimizer_hooks(recorder: _StepRecorder, phase_hooks: PhaseHooks | None):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(optimizer, args, kwargs):
        recorder.optimizer_depth += 1
        if phase_hooks is not None and recorder.optimizer_depth == 1:
            phase_hooks.mark_step()

    def post(optimizer, args, kwargs):
        recorder.optimizer_depth -= 1

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run(step_fn, recorder: _StepRecorder, phase_hooks: PhaseHooks | None) -> None:
    """One call of step_fn under the recorder, its pass detection and the tracing modes."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(meta_as_cuda_for_optimizers())
        stack.enter_context(_optimizer_hooks(recorder, phase_hooks))
        if phase_hooks is not None:
            stack.enter_context(phase_hooks)
        stack.enter_context(recorder)
        stack.enter_context(_BackwardCalls(recorder))
        stack.enter_context(FusedSDPA())
        stack.enter_context(MetaChecks())
        stack.enter_context(quiet_backward_hooks())
        stack.enter_context(enable_cuda_autocast())
        stack.enter_context(CudaAutocast())  # entered last, so it casts before FusedSDPA routes an attention call
        try:
            step_fn()
        except (_RealTensorError, UntraceableExpertsError):  # passed on as they are
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
            hint = f"; {_META_HINT}" if "meta" in first.lower() else ""
            raise InvalidSettingError(f"step_fn raised {type(e).__name__}: {first}{hint}") from e


def trace_step(step_fn, *, name: str, module: nn.Module | None = None, micro_batch_size: int = 1,
               seq_len: int | None = None, warmup: int = 1, routing=BALANCED) -> Trace:  # fmt: skip
    """Trace one call of ``step_fn`` (one training step on the meta device) into the GPU kernels it launches.

    Args:
        step_fn: zero-argument callable running forward, ``loss.backward()`` and an optimizer step (torch.optim
            or any code; its kernels after the last backward kernel count as the optimizer pass).
        name: the model's name in the Trace's workload (tables, study names).
        module: the model, for phase marks at its phase modules (freqopt.workload.phases) and the parameter count; its
            parameters must be on the meta device.
        micro_batch_size: sequences per step, as the caller states it (the workload records it; default 1).
        seq_len: tokens per sequence, as the caller states it (recorded in the workload's config), or None.
        warmup: steps run first and not traced (default 1), so that state made lazily on the first step
            (torch.optim's moments and step counters: zeros kernels that a training loop runs once) is not traced
            as part of every iteration; 0 traces the first step as is.
        routing: the token split of mixture-of-experts layers (transformers' experts modules, whose grouped GEMMs
            are traced as a GPU runs them): "balanced" (the default) or per-expert shares, as
            freqopt.workload.trace.trace_training_iteration's; ``meta["routing"]`` holds stated shares.

    Returns:
        Trace whose workload is ``Workload(name, StepConfig(...), micro_batch_size)`` on one GPU; ``meta`` holds
        "n_params" (None without a module), "mode" "train", "layout" and "marks" as trace_iteration's, and with a
        module its structure fingerprint (freqopt.workload.fingerprint), which DVFSRuntime checks against the module it wraps.

    Raises:
        InvalidSettingError: an empty name, a non-callable step_fn, parameters or tensors not on the meta device
            (says to build the model under ``torch.device('meta')``), a step that raises (``step_fn raised X: ...``),
            that runs no backward pass, or that launches no kernel; a bad routing; an experts module running
            transformers' "eager" loop, which cannot run on the meta device (says to build the model with
            ``experts_implementation="grouped_mm"``).
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidSettingError(f"name must be a non-empty string naming the model, not {name!r}")
    if not callable(step_fn):
        raise InvalidSettingError(f"step_fn must be a zero-argument callable, not {type(step_fn).__name__}")
    check_positive_int("micro_batch_size", micro_batch_size)
    shares = check_routing(routing)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidSettingError(f"warmup must be a non-negative integer, not {warmup!r}")
    if module is not None:
        if not isinstance(module, nn.Module):
            raise InvalidSettingError(f"module must be a torch.nn.Module, not {type(module).__name__}")
        off_meta = sorted({p.device.type for p in module.parameters() if p.device.type != "meta"})
        if off_meta:
            raise InvalidSettingError(f"module has parameters on {', '.join(off_meta)}; {_META_HINT}")
    for _ in range(warmup):  # recorded and checked as the traced step is, then dropped
        _run(step_fn, _StepRecorder(module, warn=False, routing=routing), None)
    recorder = _StepRecorder(module, routing=routing)
    _run(step_fn, recorder, PhaseHooks(module, recorder.mark) if module is not None else None)
    kernels = recorder.kernels
    if not kernels:
        raise InvalidSettingError("step_fn launched no kernel; it must run a training step on meta tensors")
    backward = [i for i, k in enumerate(kernels) if k.pass_name == "backward"]
    if not backward:
        raise InvalidSettingError("step_fn ran no backward pass; call loss.backward() in it")
    kernels = [dataclasses.replace(k, pass_name="optimizer") if i > backward[-1] and k.pass_name == "forward" else k
               for i, k in enumerate(kernels)]  # fmt: skip
    n_params = sum(p.numel() for p in module.parameters()) if module is not None else None
    workload = Workload(name, StepConfig(name, n_params=n_params, seq_len=seq_len), micro_batch_size, SINGLE_GPU)
    meta = {"n_params": n_params, "mode": "train", "layout": SINGLE_GPU.as_dict(), "marks": tuple(recorder.marks)}
    if shares is not None:
        meta["routing"] = shares
    if module is not None:  # DVFSRuntime checks that it wraps this module (freqopt.workload.fingerprint)
        meta[FINGERPRINT_KEY] = module_fingerprint(module)
    return Trace(workload=workload, kernels=tuple(kernels), meta=meta)
