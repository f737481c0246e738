"""A search's outcome as a JSON-ready document (what ``freqopt search --json`` writes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

__all__ = ["summarize"]


def summarize(result, table_paths: Mapping[str, str | Path] | None = None) -> dict:
    """The summary document of a SearchResult.

    Args:
        result: a SearchResult.
        table_paths: granularity -> the clock table's JSON file, where one was written.

    Returns:
        ``{"baseline": {"time_s", "energy_j"}, "results": {GRANULARITY: {"energy_saved_pct", "slowdown_pct",
        "slowdown_bound_pct", "ideal_energy_saved_pct", "ideal_slowdown_pct", "predicted_energy_saved_pct", "n_settings",
        "n_measurements", "search_cost_gpu_s", "table", "note", "waiting_saved_pct", "saving_pct_waiting_range",
        "switches_per_s"}}, "n_new_measurements", "host_wait_pct", "max_switches_per_s", "confidence"}``, granularities coarse to
        fine. "slowdown_bound_pct": the upper confidence bound of the slowdown at "confidence", from readings paired
        with the defaults', the figure held to the budget (None where none was computed).
        Percentages are of the baseline (validated: the whole iteration measured with the schedule as a runtime
        realizes it; ideal: with free, instant switching, kernel level only, else None; predicted: the sum of the
        units' own measurements). time_s in s, energy_j in J per iteration, search_cost_gpu_s in GPU-seconds;
        "table" is the path as a string, or None where no table was written; "note" says why a level was not
        searched itself, or which coarser level's schedule it runs as (GranularityResult.note), else None.
        "host_wait_pct": the share of the default step the GPU waits for the host; "waiting_saved_pct": the share
        of the level's noiseless saving saved while it waits; "saving_pct_waiting_range": [the noiseless saving with
        a waiting power flat in the clock, as modelled] (freqopt.gpu.specs.WaitingPower) (all three
        simulated GPU only, else None).
        "switches_per_s": the clock switches per second the level's schedule asks for as a runtime realizes it
        (None without switching); "max_switches_per_s": the most one runtime thread can issue on this GPU
        (GPUSpec.max_switches_per_s).
    """
    paths = dict(table_paths or {})
    base = result.baseline
    doc = {"baseline": {"time_s": base.time_s, "energy_j": base.energy_j}, "results": {},
           "n_new_measurements": result.n_new_measurements, "host_wait_pct": result.host_wait_pct,
           "max_switches_per_s": getattr(result.spec, "max_switches_per_s", None),
           "confidence": result.confidence}  # fmt: skip
    for g, r in result.results.items():
        doc["results"][g] = {
            "energy_saved_pct": result.energy_saved_pct(g), "slowdown_pct": result.slowdown_pct(g),
            "slowdown_bound_pct": result.slowdown_bound_pct(g),
            "ideal_energy_saved_pct": result.ideal_energy_saved_pct(g),
            "ideal_slowdown_pct": result.ideal_slowdown_pct(g),
            "predicted_energy_saved_pct": result.predicted_energy_saved_pct(g),
            "n_settings": r.n_settings, "n_measurements": r.n_measurements,
            "search_cost_gpu_s": r.search_cost_gpu_s,
            "table": str(paths[g]) if g in paths else None,
            "note": r.note or None,
            "waiting_saved_pct": r.waiting_saved_pct,
            "saving_pct_waiting_range": list(r.saving_pct_waiting_range) if r.saving_pct_waiting_range else None,
            "switches_per_s": r.switches_per_s,
        }  # fmt: skip
    return doc
