"""Tuning units: the sets of kernels that share one setting, by granularity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from freqopt.granularities import GRANULARITIES, check_granularity
from freqopt.workload.kernels import Kernel, Trace

__all__ = ["GRANULARITIES", "TuningUnit", "partition", "check_granularity", "kernel_families", "family_units",
           "search_units"]

# GRANULARITIES (freqopt.granularities), coarse to fine: power-cap tunes the whole-GPU power limit; the others lock
# (SM, memory) clock pairs; phase is the realizable phase schedule (freqopt.search.schedule): runs of phases a runtime
# can switch between.


@dataclass(frozen=True)
class TuningUnit:
    """Kernels of one iteration that share a setting.

    Attributes:
        name: "iteration", a pass name, or a kernel class (Kernel.class_key: pass and signature).
        kernel_indices: positions of its kernels in the trace, ascending.
    """

    name: str
    kernel_indices: tuple[int, ...]

    def kernels(self, trace: Trace) -> list[Kernel]:
        return [trace.kernels[i] for i in self.kernel_indices]


def partition(trace: Trace, granularity: str) -> list[TuningUnit]:
    """Split the trace's kernels into tuning units.

    iteration and power-cap: one unit; pass: forward, backward, optimizer; kernel: one unit per kernel class
    (equal pass and signature, Kernel.class_key), in first-seen order. The phase level's units depend on the
    GPU's kernel times: freqopt.search.schedule.phase_blocks makes them.

    Raises:
        UnknownNameError: unknown granularity.
        InvalidSettingError: "phase", which has no partition without kernel times.
    """
    check_granularity(granularity)
    if granularity == "phase":
        from freqopt.errors import InvalidSettingError

        raise InvalidSettingError("phase-level units come from the GPU's kernel times: use "
                                  "freqopt.search.schedule.phase_blocks(trace, kernel_time_s, switch_s)")  # fmt: skip
    if granularity in ("iteration", "power-cap"):
        return [TuningUnit("iteration", tuple(range(len(trace))))]
    key = (lambda k: k.pass_name) if granularity == "pass" else (lambda k: k.class_key)
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(trace.kernels):
        groups.setdefault(key(k), []).append(i)
    return [TuningUnit(name, tuple(idx)) for name, idx in groups.items()]


def kernel_families(trace: Trace, units: list[TuningUnit]) -> list[list[int]]:
    """Kernel-level units grouped by what governs their response to clocks: kind (gemm, elementwise, ...), the
    collective's group size, and arithmetic intensity (FLOPs per byte of the whole unit) in half-octave bins,
    which places a unit on the roofline (Williams et al. 2009) and so fixes how its time and power scale with the
    SM and memory clocks.

    Returns:
        Lists of indices into ``units``, each led by its representative: the unit with the most work
        (FLOPs / 256 + bytes, a roofline-weighted size; 256 FLOP/B is near the ridge point of current GPUs).
    """
    groups: dict[tuple, list[int]] = {}
    weight = []
    for i, unit in enumerate(units):
        kernels = unit.kernels(trace)
        flops, nbytes = sum(k.flops for k in kernels), sum(k.mem_bytes for k in kernels)
        intensity = flops / nbytes if nbytes else math.inf
        bin_ = "inf" if not math.isfinite(intensity) else round(2 * math.log2(max(intensity, 1e-6)))
        groups.setdefault((kernels[0].kind, kernels[0].group_size, bin_), []).append(i)
        weight.append(flops / 256 + nbytes)
    return [sorted(members, key=lambda i: (-weight[i], i)) for members in groups.values()]


def family_units(trace: Trace, units: list[TuningUnit], families: list[list[int]] | None = None) -> list[TuningUnit]:
    """Kernel-class units merged by kernel_families: one unit per family, holding its classes' kernels, named
    after its representative ("CLASS +N classes" for a family of N + 1). The classes of a family sit at one place
    on the roofline, so their best clocks coincide: one study and one setting serve them all.
    ``families``: kernel_families(trace, units), where the caller has it already."""
    out = []
    for family in kernel_families(trace, units) if families is None else families:
        lead = units[family[0]]
        name = lead.name if len(family) == 1 else f"{lead.name} +{len(family) - 1} classes"
        out.append(TuningUnit(name, tuple(sorted(i for j in family for i in units[j].kernel_indices))))
    return out


def search_units(trace: Trace, granularity: str, share_families: bool = False) -> list[TuningUnit]:
    """The units a granularity's studies run on: ``partition``'s, except at kernel level with
    ``share_families``, where each family of kernel classes is one unit (family_units)."""
    units = partition(trace, granularity)
    if granularity == "kernel" and share_families and len(units) > 1:
        return family_units(trace, units)
    return units
