"""The memory one rank's training step holds: weights, gradients, optimizer state and activations.

The step is the one freqopt traces and trains (freqopt.workload.trace, freqopt.apply.train): parameters and activations in one
dtype, gradients in the parameters' dtype, and ``MixedPrecisionAdamW`` (freqopt.workload.models.ops): FP32 master weights
(none in FP32, where ``Tensor.float()`` returns the parameter itself), FP32 first and second moments and an FP32
step count per parameter tensor. In BF16 that is the 2 + 2 + 12 bytes per parameter that Rajbhandari et al.
count for mixed-precision Adam ("ZeRO", SC 2020, section 3.1). Data-parallel ranks each hold all of it: freqopt
runs DeepSpeed at ZeRO stage 0 (freqopt.workload.deepspeed_profile.deepspeed_config), as its trace models the step;
tensor-parallel ranks hold their shards (freqopt.workload.models.parallel).

Activations are the tensors the forward pass saves for the backward pass, the quantity Korthikanti et al.
estimate ("Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, section 4). They are
found, not modelled: the rank's module runs its forward pass on the meta device (no memory, any size) under
``torch.autograd.graph.saved_tensors_hooks``, with the fused attention freqopt traces, and the bytes of every
distinct storage saved are summed, the parameters' own storages left out (they are weights).

The total, weights + gradients + optimizer state + activations, is what the step needs at once, to a first
approximation: backward frees activations while gradients accumulate (so the sum overstates the peak by up to
the smaller of the two), and the transient buffers it leaves out (the logits' gradient, the optimizer's FP32
copy of BF16 gradients, cuBLAS workspaces, the caching allocator's fragmentation, the CUDA context) take some
of that back. Measured on this project's CPU machine (FP32 gpt3-small steps, 512 to 2048 tokens per micro-batch):
the peak resident memory of a real step (getrusage's ru_maxrss) was 1 to 14 % above the total, and what a real
forward pass leaves allocated (torch.profiler's memory profile) matched the activations to 0.3 %
(tests/test_profile.py checks the latter on a small model).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from freqopt.errors import GPUMemoryWarning, InvalidSettingError
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.meta_checks import MetaChecks
from freqopt.workload.models.parallel import shard_tensor_parallel
from freqopt.workload.models.sdpa import FusedSDPA

__all__ = ["StepMemory", "estimate_step_memory", "check_gpu_memory", "workload_label", "GPUMemoryWarning",
           "GPUMemory"]


class GPUMemory(Protocol):
    """What a step's memory check reads of a GPU type: a freqopt.gpu.specs.GPUSpec (the GPU's wing stands above
    the workload's, so this module names the two attributes it needs rather than importing the type).

    Attributes:
        name: the GPU type's name ("h100-sxm"), for the message.
        memory_gb: device memory, GB as the data sheet states it; None where the GPU type's file gives none.
    """

    @property
    def name(self) -> str: ...

    @property
    def memory_gb(self) -> float | None: ...


@dataclass(frozen=True)
class StepMemory:
    """Bytes one rank's training step holds (module docstring).

    Attributes:
        weights_bytes: the parameters, in their dtype.
        gradients_bytes: one gradient per trainable parameter, in its dtype.
        optimizer_bytes: MixedPrecisionAdamW's FP32 master weights (none for FP32 parameters), moments and step
            counts.
        activations_bytes: the tensors the forward pass saves for the backward pass.
        n_params: parameters the rank holds (tied weights once).
        dtype: the parameters' and activations' dtype ("bfloat16", "float32").
    """

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    n_params: int
    dtype: str

    @property
    def total_bytes(self) -> int:
        """weights + gradients + optimizer state + activations, bytes."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def summary(self) -> dict[str, float]:
        """{"weights_gb", "gradients_gb", "optimizer_gb", "activations_gb", "total_gb"}, GB (1e9 bytes)."""
        return {"weights_gb": self.weights_bytes / 1e9, "gradients_gb": self.gradients_bytes / 1e9,
                "optimizer_gb": self.optimizer_bytes / 1e9, "activations_gb": self.activations_bytes / 1e9,
                "total_gb": self.total_bytes / 1e9}  # fmt: skip

    def describe(self) -> str:
        """One line: "5.28 GB (weights 0.251, gradients 0.251, optimizer state 1.5, activations 3.27 GB)"."""
        return (f"{_gb(self.total_bytes)} GB (weights {_gb(self.weights_bytes)}, gradients "
                f"{_gb(self.gradients_bytes)}, optimizer state {_gb(self.optimizer_bytes)}, activations "
                f"{_gb(self.activations_bytes)} GB)")  # fmt: skip


def _gb(nbytes: float) -> str:
    """Bytes as GB (1e9 bytes) for people: three significant digits, whole GB from 100 up (81,797)."""
    gb = nbytes / 1e9
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"


def estimate_step_memory(workload: Workload, *, dtype: torch.dtype = torch.bfloat16) -> StepMemory:
    """The memory one rank of ``workload``'s layout holds in a training step (module docstring).

    Args:
        workload: model, micro-batch and layout (one tensor-parallel rank's shard is counted).
        dtype: of the parameters, gradients and activations: torch.bfloat16 as on a GPU (freqopt.workload.trace,
            freqopt.profile), torch.float32 as freqopt.apply.train runs on a CPU.

    Returns:
        StepMemory, in bytes. Runs the forward pass on the meta device: seconds at most, no memory.
    """
    config, layout = workload.config, workload.layout
    model = shard_tensor_parallel(build_model(config, dtype=dtype), layout.tp)
    params = list(model.parameters())  # tied weights once
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    fp32 = 4  # bytes of a torch.float32
    master = sum(p.numel() * fp32 for p in trainable if p.dtype != torch.float32)  # p.float() copies only these
    optimizer = master + sum(2 * p.numel() * fp32 + fp32 for p in trainable)  # exp_avg, exp_avg_sq, step
    param_storages = {p.untyped_storage()._cdata for p in params}
    saved: dict[int, int] = {}  # storage -> bytes
    kept: list[torch.Tensor] = []  # holds each saved tensor, so that no storage's address is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in param_storages:
            saved[storage._cdata] = storage.nbytes()
        kept.append(t)
        return t

    idx = torch.zeros(workload.micro_batch_size, config.seq_len, dtype=torch.long, device="meta")  # (B, T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FusedSDPA(), MetaChecks():
        model(idx, idx)
    return StepMemory(weights, gradients, optimizer, sum(saved.values()), sum(p.numel() for p in params),
                      str(dtype).removeprefix("torch."))  # fmt: skip


def workload_label(workload: Workload) -> str:
    """"gpt3-small (micro_batch_size 4, seq_len 2048, dp=1,tp=1)": what a memory message says it is about."""
    return (f"{workload.model} (micro_batch_size {workload.micro_batch_size}, seq_len {workload.config.seq_len}, "
            f"{workload.layout})")  # fmt: skip


def check_gpu_memory(workload: Workload, spec: GPUMemory, memory: StepMemory | None = None) -> StepMemory:
    """Refuse a training step that does not fit one GPU of type ``spec``.

    The estimate (``memory``, else estimate_step_memory in BF16) is held against ``spec.memory_gb`` read as
    1e9-byte GB, although data sheets mean 2^30 bytes: the 7 % between the two readings is left for what the
    estimate does not count (the CUDA context, cuBLAS workspaces, the caching allocator's fragmentation).
    Nothing is checked where the GPU type's file gives no memory_gb.

    Returns:
        The estimate.

    Raises:
        InvalidSettingError: the step needs more; the message gives the estimate, the GPU's memory and what to
            change.
    """
    memory = memory if memory is not None else estimate_step_memory(workload)
    if spec.memory_gb is not None and memory.total_bytes > spec.memory_gb * 1e9:
        weights_bound = memory.weights_bytes + memory.gradients_bytes + memory.optimizer_bytes > spec.memory_gb * 1e9
        todo = ("spread the model over more GPUs: a layout with more tensor-parallel ranks (tp), which shards the "
                "weights, gradients and optimizer state" if weights_bound else
                "use a smaller micro_batch_size (more data-parallel ranks keep the batch) or seq_len, or a layout with "
                "more tensor-parallel ranks (tp)")  # fmt: skip
        raise InvalidSettingError(f"{workload_label(workload)} needs about {memory.describe()} of GPU memory per "
                                  f"rank, more than one {spec.name}'s {spec.memory_gb:g} GB; {todo}")  # fmt: skip
    return memory


def check_step_fits(workload: Workload, spec: GPUMemory, *, simulated: bool, what: str,
                    memory: StepMemory | None = None) -> StepMemory:  # fmt: skip
    """check_gpu_memory where a job will run: on a real GPU a step that does not fit is refused; on the simulated
    GPU it is a what-if, run all the same with a GPUMemoryWarning (one pipeline stage of gpt3-175b, say, run as the
    whole model's ratios to the top clock). ``what`` ends the warning: "profiled anyway", "searched anyway";
    ``memory``: the estimate, else estimate_step_memory in BF16.

    Raises:
        InvalidSettingError: on a real GPU (``simulated`` False), the step needs more memory than ``spec`` has.

    Warns:
        GPUMemoryWarning: on the simulated GPU, the same (pointing at the caller's caller: the user's call).
    """
    memory = memory if memory is not None else estimate_step_memory(workload, dtype=torch.bfloat16)
    if not simulated:
        return check_gpu_memory(workload, spec, memory)
    try:
        check_gpu_memory(workload, spec, memory)
    except InvalidSettingError as e:
        warnings.warn(f"{e}; {what}: the simulated time and energy of one rank's kernels, a step that could not run "
                      "as it stands", GPUMemoryWarning, stacklevel=3)  # fmt: skip
    return memory
