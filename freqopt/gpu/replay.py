"""Replay a tuning unit's kernels on a device, each as itself, and time them (the nvml backend replays a
unit's kernels in a loop for a measurement window).

Each traced kernel carries the call that launched it (``Kernel.call``, freqopt.workload.trace.OpCall: the ATen or freqopt
operator overload and its arguments, tensors as shape, strides, dtype and storage offset). The replay allocates
those input tensors once on the device, fills them with random data suited to the operator, and calls the same
overload with the same arguments, so the device runs the same kernels (cuBLAS GEMMs, the fused attention kernels
through ``freqopt.flash_attention``, PyTorch's GELU, layer-norm, softmax, loss, embedding, multi-tensor and fused
AdamW kernels) on operands of the traced shapes and layouts. This matters for power: on a real H100 a tanh-GELU
draws 696 W where a copy of the same bytes draws 504 W (microbenchmarks.json of shared/calibration/h100).

Data (``_fill``): floating-point tensors normal with standard deviation ``FLOAT_STD``; 0-dim floating-point
tensors (losses, norms, clipping coefficients, step counters) 1.0, so that in-place scaling replayed again and
again neither vanishes nor explodes and square roots stay real; AdamW's second moments non-negative; integer index
tensors uniform within the dimension they index (embedding rows, loss classes, gathered dimension); a grouped
GEMM's ``offs`` (``aten._grouped_mm``: a mixture-of-experts layer's experts) the cumulative rows of the token split
it was traced with (freqopt.workload.moe: balanced, or the rows its shapes end with); other integer tensors 0;
booleans random. In-place operators (``add_``, ``_foreach_*_``, ``_fused_adamw_``) re-run on the same
buffers. ``freqopt.flash_attention_backward`` takes the forward's output and log-sum-exp where its schema has them:
they come from one forward call on the same q, k, v at build time, so the values are consistent.

Input tensors of equal spec and data rule are shared between kernels (a unit of many kernels of one class needs
memory for one), but never between two arguments of one kernel, which would turn its second read into a cache hit.

Kernels replayed as a device-to-device copy of their traced bytes (half read, half written) instead, each listed
in ``ReplayPlan.reasons`` with why: collectives (``freqopt.all_reduce``), which need their group's other ranks, so
on one GPU they stand for their memory traffic only; kernels with no recorded call (built by hand) or an argument
the tracer could not record; operators that no longer resolve; and calls that raise when tried once at build time.

``detect_counter_period`` finds how often the energy counter changes by polling it, rather than assuming it.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import freqopt.workload.models.ops  # noqa: F401  registers torch.ops.freqopt.flash_attention*
import freqopt.workload.models.parallel  # noqa: F401  registers torch.ops.freqopt.all_reduce
from freqopt.workload.kernels import COLLECTIVE_KINDS, DEVICE, Kernel, OpCall, TensorSpec
from freqopt.workload.moe import expert_rows

__all__ = ["ReplayPlan", "build_replay", "detect_counter_period", "resolve_op", "FLOAT_STD", "COPY_OP"]

FLOAT_STD = 0.02  # standard deviation of replayed floating-point data: GPT-2/3's weight initialization (Radford 2019)
COPY_OP = "aten.copy_.default"  # what a kernel replayed as a copy of its bytes runs


@dataclass
class ReplayPlan:
    """Callables that re-launch a list of kernels, with the tensors they need allocated once.

    Attributes:
        steps: one callable per kernel, in order; each returns what its operator returns.
        modes: per kernel, "exact" (its own operator on its traced arguments) or "copy" (a device-to-device copy
            of its traced bytes).
        reasons: per kernel, why it is a copy (None where exact).
        ops: per kernel, the overload its step calls (``aten.gelu.default``; ``COPY_OP`` for copies).
        names: per kernel, Kernel.name.
    """

    steps: list[Callable[[], object]]
    modes: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def exact(self) -> list[bool]:
        """Per kernel, whether it runs its own operator."""
        return [m == "exact" for m in self.modes]

    def copies(self) -> dict[str, str]:
        """Kernel name -> why it is replayed as a copy (the first kernel's reason for each name), in plan order."""
        found: dict[str, str] = {}
        for name, mode, reason in zip(self.names, self.modes, self.reasons):
            if mode == "copy" and name not in found:
                found[name] = reason or ""
        return found

    def __call__(self) -> None:
        for step in self.steps:
            step()


def resolve_op(op: str) -> torch._ops.OpOverload:
    """The OpOverload named ``namespace.packet.overload`` (OpCall.op).

    Raises:
        LookupError: no such operator or overload (freqopt's own operators are registered on import).
    """
    parts = op.split(".")
    if len(parts) != 3:
        raise LookupError(f"{op!r} is not namespace.packet.overload")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as e:
        raise LookupError(f"no operator {op} in this PyTorch ({e})") from e


# Integer index arguments: operator packet -> (argument position, bound(args) = size of the dimension it indexes).
def _dim_size(args, self_pos: int = 0, dim_pos: int = 1) -> int:
    shape = args[self_pos].shape
    return shape[args[dim_pos] % len(shape)] if shape else 1


def _classes(spec: TensorSpec) -> int:
    return spec.shape[1] if len(spec.shape) > 1 else spec.shape[0]


_INDEX_ARGS: dict[str, tuple[int, Callable[[tuple], int]]] = {
    "embedding": (1, lambda a: a[0].shape[0]),  # (weight (V, d), indices)
    "embedding_dense_backward": (1, lambda a: a[2]),  # (grad, indices, num_weights, ...)
    "nll_loss_forward": (1, lambda a: _classes(a[0])),  # (self (N, C), target (N,), ...)
    "nll_loss2d_forward": (1, lambda a: _classes(a[0])),
    "nll_loss_backward": (2, lambda a: _classes(a[1])),  # (grad, self, target, ...)
    "nll_loss2d_backward": (2, lambda a: _classes(a[1])),
    "index_select": (2, _dim_size), "gather": (2, _dim_size), "index_add": (2, _dim_size),
    "index_copy": (2, _dim_size), "index_fill": (2, _dim_size), "scatter": (2, _dim_size),
    "scatter_add": (2, _dim_size), "scatter_reduce": (2, _dim_size),
}  # fmt: skip
# Arguments that must not be negative: AdamW's second moments (exp_avg_sqs, max_exp_avg_sqs), whose root it takes.
_NON_NEGATIVE_ARGS = {"_fused_adamw_": (3, 4), "_fused_adam_": (3, 4)}


def _fill(packet: str, call: OpCall, position: int | str, spec: TensorSpec) -> tuple:
    """How to fill the tensor ``spec`` at argument ``position`` of ``call`` (module docstring): ("index", high),
    ("nonneg",), ("ones",), ("normal",), ("bool",) or ("zeros",)."""
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        if position in _NON_NEGATIVE_ARGS.get(packet, ()):
            return ("nonneg",)
        return ("ones",) if not spec.shape else ("normal",)
    if spec.dtype == torch.bool:
        return ("bool",)
    if packet in _INDEX_ARGS and _INDEX_ARGS[packet][0] == position:
        return ("index", max(int(_INDEX_ARGS[packet][1](call.args)), 1))
    return ("zeros",)


def _allocate(spec: TensorSpec, fill: tuple, device: torch.device) -> torch.Tensor:
    """A tensor of ``spec``'s shape, strides, dtype and storage offset on ``device``, filled by ``fill``: the whole
    storage is filled, then viewed with the traced strides (broadcast and transposed views included)."""
    n = spec.storage_elements
    kind = fill[0]
    if kind == "index":
        base = torch.randint(0, fill[1], (n,), dtype=spec.dtype, device=device)
    elif kind == "bool":
        base = torch.randint(0, 2, (n,), device=device).bool()
    elif kind == "offsets":
        base = torch.tensor(fill[1], dtype=spec.dtype, device=device)
    elif kind == "zeros":
        base = torch.zeros(n, dtype=spec.dtype, device=device)
    elif kind == "ones":
        base = torch.ones(n, dtype=spec.dtype, device=device)
    else:
        base = torch.empty_strided((n,), (1,), dtype=spec.dtype, device=device).normal_(0.0, FLOAT_STD)
        if kind == "nonneg":
            base.abs_()
    return base.as_strided(spec.shape, spec.stride, spec.offset)


def _grouped_offsets(kernel: Kernel) -> tuple[int, ...]:
    """The ``offs`` of a traced ``aten._grouped_mm``: cumulative rows of each group, from the rows its shapes end
    with (a stated token split), else the balanced split of the dimension the groups divide."""
    a, b = kernel.call.args[:2]
    offs = kernel.call.args[2] if len(kernel.call.args) > 2 else dict(kernel.call.kwargs)["offs"]
    if len(kernel.shapes) > len(kernel.call.tensors):
        rows = kernel.shapes[-1]
    else:
        dims = (len(a.shape), len(b.shape))
        split = a.shape[0] if dims == (2, 3) else b.shape[1] if dims[0] == 3 else a.shape[1]
        rows = expert_rows(split, offs.shape[0])
    return tuple(itertools.accumulate(rows))


def _arguments(kernel: Kernel, device: torch.device, cache: dict) -> tuple[list, dict]:
    """The call's arguments on ``device``: tensors from ``cache`` (key: spec, fill, and the how-many-th equal
    tensor of this kernel it is), lists as lists, DEVICE as ``device``."""
    call = kernel.call
    packet = call.op.split(".")[1]
    seen: Counter = Counter()

    def tensor(position, spec: TensorSpec) -> torch.Tensor:
        fill = ("offsets", _grouped_offsets(kernel)) if packet == "_grouped_mm" and position in (2, "offs") else \
            _fill(packet, call, position, spec)
        seen[(spec, fill)] += 1
        key = ("tensor", spec, fill, seen[(spec, fill)])
        if key not in cache:
            cache[key] = _allocate(spec, fill, device)
        return cache[key]

    def value(position, v):
        if isinstance(v, TensorSpec):
            return tensor(position, v)
        if isinstance(v, tuple):
            return [value(position, x) for x in v]
        return device if v is DEVICE else v

    args = [value(i, v) for i, v in enumerate(call.args)]
    kwargs = {k: value(k, v) for k, v in call.kwargs}
    return args, kwargs


def _attention_backward_inputs(func, args: list) -> list:
    """Put a forward's (out, logsumexp) into a ``freqopt.flash_attention_backward`` call whose schema takes them:
    one ``freqopt.flash_attention`` call on the call's q, k, v (so the backward reads consistent values)."""
    names = [a.name for a in func._schema.arguments]
    if "out" not in names:
        return args
    at = {name: i for i, name in enumerate(names)}
    q, k, v, is_causal = (args[at[name]] for name in ("q", "k", "v", "is_causal"))
    result = torch.ops.freqopt.flash_attention.default(q, k, v, is_causal)
    out, lse = (result[0], result[1]) if isinstance(result, (tuple, list)) else (result, None)
    args = list(args)
    args[at["out"]] = out
    if "logsumexp" in at and lse is not None:
        args[at["logsumexp"]] = lse
    return args


_PREPARE = {"freqopt.flash_attention_backward": _attention_backward_inputs}


def _copy_step(kernel: Kernel, device: torch.device, cache: dict) -> Callable[[], object]:
    n_bytes = max(int(kernel.mem_bytes // 2), 1)  # read half, write half
    src = cache.setdefault(("bytes-src", n_bytes), torch.empty(n_bytes, dtype=torch.uint8, device=device))
    dst = cache.setdefault(("bytes-dst", n_bytes), torch.empty(n_bytes, dtype=torch.uint8, device=device))
    return functools.partial(dst.copy_, src)


def _exact_step(kernel: Kernel, device: torch.device, cache: dict) -> tuple[Callable[[], object] | None, str | None]:
    """(the step that calls the kernel's own operator, None) or (None, why it cannot)."""
    call = kernel.call
    if kernel.kind in COLLECTIVE_KINDS or kernel.is_collective:
        return None, "a collective needs its group's other ranks: a copy of its bytes stands for its memory traffic"
    if call is None:
        return None, "no recorded call (a kernel not from freqopt.workload.trace)"
    if call.unreplayable:
        return None, f"{call.op} has {call.unreplayable}, which the tracer does not record"
    try:
        func = resolve_op(call.op)
    except LookupError as e:
        return None, str(e)
    try:
        args, kwargs = _arguments(kernel, device, cache)
        prepare = _PREPARE.get(call.op.rsplit(".", 1)[0])
        if prepare is not None:
            args = prepare(func, args)
        step = functools.partial(func, *args, **kwargs)
        step()  # tried once at build time: a call that raises is replayed as a copy, visibly
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any operator error; reported in ReplayPlan.reasons
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"{call.op} raised {type(e).__name__} when tried: {message[:200]}"
    return step, None


def build_replay(kernels: Sequence[Kernel], device: str | torch.device = "cuda", *,
                 cache: dict | None = None) -> ReplayPlan:  # fmt: skip
    """A plan that re-launches ``kernels`` on ``device``, each as itself where it can (module docstring).

    Each exact step is called once while building (a check and a first warm-up). Input tensors are shared between
    kernels by spec and data rule, so a unit of many kernels of one class needs memory for one.

    Args:
        kernels: in issue order.
        device: where to replay them.
        cache: input tensors to share with other plans built on the same device with the same dict (the phases
            of one schedule); None: this plan's own.

    Raises:
        torch.OutOfMemoryError: the kernels' tensors do not fit on the device.
    """
    device = torch.device(device)
    cache = {} if cache is None else cache
    plan = ReplayPlan([])
    for kernel in kernels:
        step, reason = _exact_step(kernel, device, cache)
        if step is None:
            step = _copy_step(kernel, device, cache)
        plan.steps.append(step)
        plan.modes.append("exact" if reason is None else "copy")
        plan.reasons.append(reason)
        plan.ops.append(kernel.call.op if reason is None else COPY_OP)
        plan.names.append(kernel.name)
    return plan


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
