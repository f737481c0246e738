"""Replay a tuning unit's kernels on a device as PyTorch operations with the traced shapes and dtypes, and time
them (design.md section 2: the nvml backend replays the unit's kernels in a loop for a measurement window).

GEMMs (``aten.mm``, ``aten.addmm``, ``aten.bmm``, ``aten.baddbmm``) and attention (``freqopt.flash_attention``
and its backward) run as the same operators on tensors of the traced shapes, so they launch the same library
kernels (cuBLAS, FlashAttention through SDPA) as the training step. Every other kernel is memory-bound in
practice (elementwise, normalization, softmax, reductions, copies, the optimizer step) and is replayed as a
device-to-device copy moving the kernel's traced bytes (half read, half written), which puts the same load on
device memory; collectives, which need other ranks, are replayed the same way, so on one GPU they stand for
their memory traffic only.

``detect_counter_period`` finds how often the energy counter changes by polling it, rather than assuming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from freqopt.trace import Kernel

__all__ = ["ReplayPlan", "build_replay", "detect_counter_period", "EXACT_OPS"]

EXACT_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "freqopt.flash_attention",
             "freqopt.flash_attention_backward")  # fmt: skip


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else torch.float32


@dataclass
class ReplayPlan:
    """Callables that re-launch a list of kernels, with the tensors they need allocated once.

    Attributes:
        steps: one callable per kernel, in order.
        exact: per kernel, whether it runs its own operator (True) or a copy of its bytes (False).
    """

    steps: list[Callable[[], object]]
    exact: list[bool]

    def __call__(self) -> None:
        for step in self.steps:
            step()


def _step(kernel: Kernel, device: torch.device, cache: dict) -> tuple[Callable[[], object], bool]:
    dtype = _dtype(kernel.dtype)

    def tensor(shape) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in cache:
            cache[key] = torch.randn(*shape, device=device, dtype=dtype) * 0.01
        return cache[key]

    shapes = kernel.shapes
    if kernel.name == "aten.mm":
        a, b = tensor(shapes[0]), tensor(shapes[1])
        return (lambda: torch.mm(a, b)), True
    if kernel.name == "aten.addmm":
        bias, a, b = tensor(shapes[0]), tensor(shapes[1]), tensor(shapes[2])
        return (lambda: torch.addmm(bias, a, b)), True
    if kernel.name == "aten.bmm":
        a, b = tensor(shapes[0]), tensor(shapes[1])
        return (lambda: torch.bmm(a, b)), True
    if kernel.name == "aten.baddbmm":
        c, a, b = tensor(shapes[0]), tensor(shapes[1]), tensor(shapes[2])
        return (lambda: torch.baddbmm(c, a, b)), True
    if kernel.name == "freqopt.flash_attention":
        q, k, v = (tensor(s) for s in shapes[:3])
        return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=kernel.causal)), True
    if kernel.name == "freqopt.flash_attention_backward":
        from freqopt.models.ops import flash_attention_backward

        grad, q, k, v = (tensor(s) for s in shapes[:4])
        return (lambda: flash_attention_backward(grad, q, k, v, kernel.causal)), True
    n_bytes = max(int(kernel.mem_bytes // 2), 1)  # read half, write half
    src = cache.setdefault(("bytes-src", n_bytes), torch.empty(n_bytes, dtype=torch.uint8, device=device))
    dst = cache.setdefault(("bytes-dst", n_bytes), torch.empty(n_bytes, dtype=torch.uint8, device=device))
    return (lambda: dst.copy_(src)), False


def build_replay(kernels: Sequence[Kernel], device: str | torch.device = "cuda") -> ReplayPlan:
    """A plan that re-launches ``kernels`` on ``device`` (module docstring); tensors of equal shape and dtype are
    shared, so a unit of many kernels of one class needs memory for one."""
    device = torch.device(device)
    cache: dict = {}
    steps, exact = [], []
    for kernel in kernels:
        step, is_exact = _step(kernel, device, cache)
        steps.append(step)
        exact.append(is_exact)
    return ReplayPlan(steps, exact)


def detect_counter_period(read_energy_j: Callable[[], float], *, duration_s: float = 1.0, poll_s: float = 0.002,
                          clock: Callable[[], float] = time.monotonic,
                          sleep: Callable[[float], None] = time.sleep) -> float:  # fmt: skip
    """How often the energy counter changes, s: the median interval between observed changes while polling for
    ``duration_s`` (the GPU should be busy, so that the counter moves at each update).

    Raises:
        RuntimeError: the counter changed fewer than three times (an idle GPU, or a period longer than the poll).
    """
    changes = []
    last = read_energy_j()
    start = clock()
    while clock() - start < duration_s:
        sleep(poll_s)
        value = read_energy_j()
        if value != last:
            changes.append(clock())
            last = value
    if len(changes) < 3:
        raise RuntimeError(f"the energy counter changed {len(changes)} times in {duration_s:g} s; keep the GPU busy "
                           "while detecting its update period, or poll longer")  # fmt: skip
    intervals = sorted(b - a for a, b in zip(changes, changes[1:]))
    return intervals[len(intervals) // 2]
