"""The trace set beside torch.profiler: one real training step recorded by torch.profiler, its operators counted
as freqopt.workload.trace counts the kernels it traces, kind by kind (``profiled_kinds``, ``compare_with_profiler``). Used by
freqopt.measure.profile on a real GPU to show what the trace holds against what the device ran.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch

from freqopt.workload.trace import NOT_KERNELS, OP_KINDS

__all__ = ["ProfilerRow", "profiled_kinds", "compare_with_profiler", "STEP_LABEL"]

STEP_LABEL = "freqopt.profile.step"  # torch.profiler label around the profiled training step
# Operators that only bookkeep or hand back their input (when nothing needs converting): no kernel, as the tracer
# never sees them either (below the dispatch level it records, or returning their input).
_BOOKKEEPING = {"to", "resize_", "detach_", "item", "_local_scalar_dense", "is_nonzero", "result_type"}
_OPERATOR = re.compile(r"^(aten|freqopt)::(\w+)$")



@dataclass(frozen=True)
class ProfilerRow:
    """One kernel kind, the trace against torch.profiler on the real device (one training step each).

    Attributes:
        traced_n_kernels: kernels of this kind in the trace.
        predicted_time_s: the simulated GPU's time for them, s.
        profiled_n_kernels: profiled operators of this kind that did device work (each is what the tracer counts as
            one kernel; on a GPU one operator may launch several CUDA kernels).
        measured_time_s: their time, s: CUDA device time on a GPU, CPU time on the CPU (each operator's, what
            runs beneath it included).
    """

    traced_n_kernels: int
    predicted_time_s: float
    profiled_n_kernels: int
    measured_time_s: float


def compare_with_profiler(step, by_kind, *, cuda: bool) -> dict[str, ProfilerRow]:
    """Two training steps under torch.profiler (the first warms the profiler up, the second is recorded),
    compared by kind with the trace.

    Args:
        step: runs one training step when called as step(label), inside torch.profiler.record_function(label).
        by_kind: kind -> the simulated GPU's figures for the trace (objects with ``n_kernels`` and ``time_s``).
        cuda: the step runs on CUDA: count and time by device time, else by CPU time.

    Returns:
        kind -> ProfilerRow, the trace's kinds first, then kinds only the profiler saw.
    """
    from torch.profiler import ProfilerActivity, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                                acc_events=True) as prof:  # fmt: skip
        for _ in range(2):
            step(STEP_LABEL)
            prof.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = prof.events()
    seen = profiled_kinds(events, device_time=cuda)
    rows = {}
    for kind in dict.fromkeys([*by_kind, *seen]):
        traced = by_kind.get(kind)
        n, time_s = seen.get(kind, (0, 0.0))
        rows[kind] = ProfilerRow(traced.n_kernels if traced else 0, traced.time_s if traced else 0.0, n, time_s)
    return rows


def _overloads(op: str) -> list:
    """The functional (not out=) overloads of aten ``op``; [] for an unknown name."""
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return []
    found = []
    for name in packet.overloads():
        if name == "out" or name.endswith("_out"):
            continue
        try:
            found.append(getattr(packet, name))
        except (AttributeError, RuntimeError):
            pass
    return found


@lru_cache(maxsize=None)
def _is_view(op: str) -> bool:
    """Whether aten ``op`` is a view (OpOverload.is_view, the tracer's test) in every functional overload."""
    overloads = _overloads(op)
    return bool(overloads) and all(o.is_view for o in overloads)


@lru_cache(maxsize=None)
def _decomposes(op: str) -> bool:
    """Whether aten ``op`` is CompositeImplicitAutograd in every functional overload (aten::linear, matmul,
    layer_norm, cross_entropy_loss, to, reshape): decomposed before a TorchDispatchMode sees it, so the tracer sees
    the operators it calls instead, never it."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    overloads = _overloads(op)
    try:
        return bool(overloads) and all(o.has_kernel_for_dispatch_key(key) for o in overloads)
    except RuntimeError:
        return False


def profiled_kinds(events, *, device_time: bool, label: str = STEP_LABEL) -> dict[str, tuple[int, float]]:
    """Kernel kinds of the operators torch.profiler recorded inside ``label`` (a record_function around the step),
    counted as freqopt.workload.trace counts what it traces.

    The tracer sees operators at the level a TorchDispatchMode sees them: below autograd, after the
    CompositeImplicitAutograd decompositions. So, walking the profiler's operator tree: an ``aten::`` operator that
    decomposes (aten::linear, matmul, layer_norm, to) is looked through; a view, an allocation (the tracer's
    NOT_KERNELS) or bookkeeping is skipped; any other ``aten::OP`` or ``freqopt::OP`` is one kernel, of kind
    freqopt.workload.trace.OP_KINDS[OP] (keyed by the overload packet's name: "aten::addmm" -> "gemm"), else
    "elementwise", and what runs beneath it is its own work (``freqopt::flash_attention_backward``'s matmuls, ``aten::embedding``'s
    index_select, the per-tensor loops of ``aten::_foreach_mul_`` on the CPU). Non-operator events (autograd nodes)
    are looked through. A kernel counts if it did work: on a GPU, device time (``device_time_total`` > 0); on the
    CPU, CPU time. Events of other threads (the autograd engine's, on CUDA) count when they fall inside the label's
    time range.

    Args:
        events: ``torch.profiler.profile(...).events()``.
        device_time: count and time by device time (a CUDA run) rather than CPU time.

    Returns:
        kind -> (kernels, their time in s: each operator's device time, or its CPU time, children included), in
        first-seen order.
    """
    cpu_events = [e for e in events if getattr(e, "device_type", None) in (None, torch.autograd.DeviceType.CPU)]
    windows = [(e.time_range.start, e.time_range.end) for e in cpu_events if e.name == label]
    if not windows:
        return {}
    inside = [e for e in cpu_events if e.name != label
              and any(a <= e.time_range.start and e.time_range.end <= b for a, b in windows)]  # fmt: skip
    ids = {id(e) for e in inside}
    roots = [e for e in inside if e.cpu_parent is None or id(e.cpu_parent) not in ids]
    found: dict[str, list] = {}

    def visit(e) -> None:
        match = _OPERATOR.match(e.name)
        if match is None or (match.group(1) == "aten" and _decomposes(match.group(2))):
            for child in e.cpu_children:
                visit(child)
            return
        namespace, op = match.groups()
        if op in NOT_KERNELS or op in _BOOKKEEPING or (namespace == "aten" and _is_view(op)):
            return
        seconds = (e.device_time_total if device_time else e.cpu_time_total) * 1e-6
        if seconds > 0:
            entry = found.setdefault(OP_KINDS.get(op, "elementwise"), [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    for root in roots:
        visit(root)
    return {kind: (n, seconds) for kind, (n, seconds) in found.items()}
