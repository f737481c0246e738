"""The clock table of a one-GPU (or data- and tensor-parallel) search: built from a SearchResult's granularity,
each unit's setting with its measured default and front, and the file-name stem a search's tables are written
under (table_stem)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from freqopt import __version__
from freqopt.gpu.specs import GPUSpec
from freqopt.tables.format import SCHEMA_NAME, SCHEMA_VERSION, ClockTable, clock_mhz, gpu_doc, workload_doc

__all__ = ["table_from_result", "result_table", "budget_tag", "table_stem"]


def table_from_result(result, granularity: str, spec: GPUSpec, *, backend: str, seed: int) -> ClockTable:
    """Build the clock table of one granularity of a SearchResult."""
    r = result.results[granularity]
    trace = result.trace
    w = trace.workload
    entries = []
    # The units' measured fronts, where the options are the unit's own (not at phase level, whose options are
    # changes of the whole iteration) and the table holds what they allocated (not a level held to one clock,
    # whose studies served its free-switching figure only: its table is that clock, transferred as it stands).
    own = not r.requests and not r.held_to_one_clock
    fronts = r.unit_searches if own and len(r.unit_searches) == len(r.units) else None
    if own and r.searched_units and len(r.searched_units) == len(r.unit_searches):
        # Classes that shared their family's study carry the family's front: a transfer uses only its ratios
        # to the default (freqopt.apply.transfer), which the family's classes share.
        owner = {k: s for u, s in zip(r.searched_units, r.unit_searches) for k in u.kernel_indices}
        fronts = [owner[unit.kernel_indices[0]] for unit, _ in r.units]
    for i, (unit, setting) in enumerate(r.units):
        kernels = unit.kernels(trace)
        first = kernels[0]
        per_class = granularity == "kernel" and not r.requests  # a kernel level may end on phase blocks
        flops = sum(k.flops for k in kernels)
        nbytes = sum(k.mem_bytes for k in kernels)
        entries.append({
            "unit": unit.name,
            "kind": first.kind if per_class else None,
            "signature": first.signature if per_class else None,
            "arithmetic_intensity": (flops / nbytes) if nbytes else None,
            "n_kernels": len(kernels),
            "sm_clock_mhz": clock_mhz(setting.sm_clock_mhz),
            "mem_clock_mhz": clock_mhz(setting.mem_clock_mhz),
            "power_limit_w": setting.power_limit_w,
            **({"request_phase": r.requests[i]} if r.requests else {}),
            **(_front(fronts[i]) if fronts else {}),
        })  # fmt: skip
    base = result.baseline

    def rel(m) -> dict[str, float]:
        return {"time_s": m.time_s, "energy_j": m.energy_j,
                "energy_saved_pct": 100 * (1 - m.energy_j / base.energy_j),
                "slowdown_pct": 100 * (m.time_s / base.time_s - 1)}  # fmt: skip

    predicted = {"time_s": r.predicted.time_s, "energy_j": r.predicted.energy_j,
                 "energy_saved_pct": result.predicted_energy_saved_pct(granularity),
                 "baseline_time_s": r.predicted_baseline.time_s,
                 "baseline_energy_j": r.predicted_baseline.energy_j}  # fmt: skip
    data = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "gpu": gpu_doc(spec),
        "workload": workload_doc(w),
        "granularity": granularity,
        "max_slowdown": result.max_slowdown,
        "entries": entries,
        "baseline": {"time_s": base.time_s, "energy_j": base.energy_j},
        "predicted": predicted,
        "validated": rel(r.validated),
        "ideal": rel(r.ideal) if r.ideal is not None else None,
        **({"note": r.note} if r.note else {}),
        "provenance": {
            "freqopt_version": __version__,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "backend": backend,
            "seed": seed,
            "storage": result.storage,
            "studies": r.study_names,
            "n_measurements": r.n_measurements,
            "search_cost_gpu_s": r.search_cost_gpu_s,
        },
    }  # fmt: skip
    return ClockTable(data)


def _measured_option(option) -> dict[str, Any]:
    s = option.setting
    return {"sm_clock_mhz": clock_mhz(s.sm_clock_mhz), "mem_clock_mhz": clock_mhz(s.mem_clock_mhz),
            "power_limit_w": s.power_limit_w,
            "time_s": option.time_s, "energy_j": option.energy_j, "n_samples": option.n_samples}  # fmt: skip


def _front(search) -> dict[str, Any]:
    """A unit's "default" (its measured default settings) and "front" (its other options, by time: the Pareto
    front its study found, finalists averaged), in seconds and joules per iteration."""
    return {"default": _measured_option(search.default),
            "front": [_measured_option(o) for o in search.options if o.setting != search.default.setting]}


def result_table(result, granularity: str) -> ClockTable:
    """The clock table of one granularity of a SearchResult, for the GPU type, backend and seed it records
    (``result.spec``; the search_spaces/ type of ``result.gpu`` where it has none).

    Raises:
        UnknownNameError: ``granularity`` was not searched; the message lists those that were.
    """
    from freqopt.errors import UnknownNameError
    from freqopt.gpu.specs import get_gpu

    if granularity not in result.results:
        raise UnknownNameError(f"granularity {granularity!r} was not searched; choose from "
                               f"{', '.join(result.results) or 'none (no granularity was searched)'}")  # fmt: skip
    spec = result.spec if result.spec is not None else get_gpu(result.gpu)
    return table_from_result(result, granularity, spec, backend=result.backend_name, seed=result.seed)


def budget_tag(max_slowdown: float) -> str:
    """The budget as a file name takes it: 0.01 -> "1pct", 0.005 -> "0.5pct"."""
    return f"{round(100.0 * max_slowdown, 6):g}pct"


def table_stem(workload, gpu: str, max_slowdown: float, seed: int = 0) -> str:
    """The file-name stem of a search's tables and figures (freqopt.tables, "File names"): MODEL-GPU, then
    -dpNtpM under a parallel layout (-dpNtpMppP with pipeline stages), the budget (budget_tag), and -seedN for a seed other than 0 (the ':' of an
    ``hf:NAME`` model becomes '-', which file systems and shells take without quoting).

    Args:
        workload: the searched freqopt.workload.models.Workload; gpu: the GPU type's name; max_slowdown: the budget, a
            fraction; seed: the samplers' seed.
    """
    layout = "" if workload.layout.is_single_gpu else f"-dp{workload.layout.dp}tp{workload.layout.tp}"
    if workload.layout.is_pipeline:
        layout += f"pp{workload.layout.pp}"
    tag = f"-seed{seed}" if seed else ""
    return f"{workload.model.replace(':', '-')}-{gpu}{layout}-{budget_tag(max_slowdown)}{tag}"
