"""Energy statements: what a training run used and what a clock table saved, as McDonald et al. 2022 (arXiv
2205.09646, section 7) ask papers to report.

GPU energy = energy per iteration (the table's validated figure, and its default baseline) x iterations x GPUs.
A pipeline table's (granularity "instruction") iteration energy is that of its S stages' GPUs together, so there
it is multiplied by the number of pipeline replicas, GPUs / S.
Facility energy = GPU energy x PUE (power usage effectiveness). Emissions = facility energy x grid carbon
intensity. With a site PUE profile (hourly or monthly), the job's facility energy is computed for every start
hour or month, which shows the paper's day/night and summer/winter effect.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freqopt.errors import InvalidSettingError
from freqopt.tables import ClockTable

__all__ = ["DEFAULT_PUE", "DEFAULT_GRID_GCO2_PER_KWH", "PueProfile", "load_pue_profile", "energy_statement",
           "statement"]

DEFAULT_PUE = 1.58  # average data-centre PUE, Uptime Institute Global Data Center Survey 2023
DEFAULT_GRID_GCO2_PER_KWH = 436.0  # world electricity carbon intensity 2022, Ember Global Electricity Review 2023
HOURS_PER_MONTH = 365.25 * 24 / 12
J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class PueProfile:
    """A site's PUE by hour of day (24 values) or by month (12 values, January first)."""

    period: str  # "hour" or "month"
    values: tuple[float, ...]

    @property
    def hours_per_step(self) -> float:
        return 1.0 if self.period == "hour" else HOURS_PER_MONTH

    def mean_over(self, start: int, duration_h: float) -> float:
        """Time-weighted mean PUE of a job of ``duration_h`` hours starting at step ``start`` (cyclic)."""
        n = len(self.values)
        steps = duration_h / self.hours_per_step
        whole, part = int(steps), steps - int(steps)
        weights = np.zeros(n)
        for i in range(whole):
            weights[(start + i) % n] += 1.0
        weights[(start + whole) % n] += part
        return float(np.dot(weights, self.values) / weights.sum()) if weights.sum() else self.values[start % n]


def load_pue_profile(path: str | Path) -> PueProfile:
    """Read a CSV with columns ``hour,pue`` (hours 0-23) or ``month,pue`` (months 1-12).

    Raises:
        InvalidSettingError: unreadable, another layout, a missing step, or a PUE below 1.
    """
    hint = "expected a CSV with columns hour,pue (hours 0-23) or month,pue (months 1-12)"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise InvalidSettingError(f"cannot read site PUE profile {path}: {e.strerror or e}") from e
    except csv.Error as e:
        raise InvalidSettingError(f"site PUE profile {path} is not CSV ({e}); {hint}") from e
    columns = set(rows[0]) if rows else set()
    period = "hour" if {"hour", "pue"} <= columns else "month" if {"month", "pue"} <= columns else None
    if period is None:
        raise InvalidSettingError(f"site PUE profile {path}: {hint}")
    first, n = (0, 24) if period == "hour" else (1, 12)
    try:
        by_step = {int(r[period]): float(r["pue"]) for r in rows}
    except (TypeError, ValueError) as e:
        raise InvalidSettingError(f"site PUE profile {path} has a value that is not a number; {hint}") from e
    if sorted(by_step) != list(range(first, first + n)):
        raise InvalidSettingError(f"site PUE profile {path} must have one row per {period} {first}-{first + n - 1}")
    if min(by_step.values()) < 1.0:
        raise InvalidSettingError(f"site PUE profile {path}: a PUE below 1 is impossible (facility >= IT energy)")
    return PueProfile(period, tuple(by_step[s] for s in range(first, first + n)))


def energy_statement(
    table: ClockTable,
    *,
    iterations: int,
    gpus: int | None = None,
    pue: float | None = None,
    profile: PueProfile | None = None,
    grid_gco2_per_kwh: float = DEFAULT_GRID_GCO2_PER_KWH,
) -> str:
    """The energy statement of a run of ``iterations`` steps on ``gpus`` GPUs with and without the table, markdown.

    ``gpus`` defaults to one GPU, or for a pipeline table to one pipeline (its S stages' GPUs); a pipeline table's
    ``gpus`` must be a multiple of S (the replicas of the pipeline).

    Raises:
        InvalidSettingError: non-positive iterations or GPUs, GPUs not a multiple of a pipeline's stages, a PUE
            below 1, a negative grid intensity, or both a PUE and a profile.
    """
    stages = int(table.pipeline["stages"]) if table.is_pipeline else 1
    if gpus is None:
        gpus = stages
    _check_statement_arguments(iterations, gpus, stages, pue, profile, grid_gco2_per_kwh)
    d = table.data
    base, tuned = d["baseline"], d["validated"]
    scale = iterations * gpus // stages  # a pipeline table's iteration energy covers its S GPUs
    runs = {"default clocks": (base["energy_j"] * scale, base["time_s"] * iterations),
            f"with the {d['granularity']}-level table": (tuned["energy_j"] * scale, tuned["time_s"] * iterations)}
    mean_pue = pue if pue is not None else (float(np.mean(profile.values)) if profile else DEFAULT_PUE)
    pue_source = (f"{pue:g} (given)" if pue is not None else
                  f"{mean_pue:.3f} (mean of the site's {profile.period}ly profile)" if profile else
                  f"{DEFAULT_PUE:g} (industry average, Uptime Institute 2023; give your site's PUE)")  # fmt: skip
    w = d["workload"]
    lines = [
        "# Energy statement", "",
        f"Training {w['model']} (micro-batch {w['micro_batch_size']}, sequence {w['seq_len']}) for {iterations:,} "
        f"iterations on {gpus} x {d['gpu']['name']}, clock table {d['granularity']} level searched by freqopt "
        f"{d['provenance'].get('freqopt_version', '?')} (max slowdown {100 * d['max_slowdown']:g} %, backend "
        f"{d['provenance'].get('backend', '?')}). Energy per iteration is the table's validated measurement of the "
        "whole iteration.", "",
        "| run | wall time (h) | GPU energy (kWh) | facility energy (kWh) | emissions (kg CO2e) |",
        "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    kwh = {}
    for name, (energy_j, time_s) in runs.items():
        gpu_kwh = energy_j / J_PER_KWH
        kwh[name] = gpu_kwh
        facility = gpu_kwh * mean_pue
        lines.append(f"| {name} | {time_s / 3600:,.2f} | {gpu_kwh:,.3f} | {facility:,.3f} | "
                     f"{facility * grid_gco2_per_kwh / 1000:,.3f} |")  # fmt: skip
    saved_kwh = kwh["default clocks"] - list(kwh.values())[1]
    lines += ["", f"The table saved {saved_kwh:,.3f} kWh of GPU energy ({100 * saved_kwh / kwh['default clocks']:.1f} %), "
              f"{saved_kwh * mean_pue:,.3f} kWh at the facility and "
              f"{saved_kwh * mean_pue * grid_gco2_per_kwh / 1000:,.3f} kg CO2e, for "
              f"{100 * (tuned['time_s'] / base['time_s'] - 1):+.2f} % wall time.", "",
              f"PUE: {pue_source}. Grid carbon intensity: {grid_gco2_per_kwh:g} gCO2e/kWh"
              + (" (world average 2022, Ember 2023; give your grid's intensity)."
                 if grid_gco2_per_kwh == DEFAULT_GRID_GCO2_PER_KWH else " (given).")]  # fmt: skip
    if profile is not None:
        lines += _when_to_start(profile, list(kwh.values())[1], runs[list(runs)[1]][1] / 3600)
    return "\n".join(lines) + "\n"


def _check_statement_arguments(iterations: int, gpus: int, stages: int, pue: float | None,
                               profile: PueProfile | None, grid_gco2_per_kwh: float) -> None:  # fmt: skip
    """energy_statement's checks (its Raises), in its order."""
    for name, value in (("iterations", iterations), ("gpus", gpus)):
        if value < 1:
            raise InvalidSettingError(f"{name} must be a positive integer, not {value}", argument=name)
    if pue is not None and profile is not None:
        raise InvalidSettingError("give a PUE or a site PUE profile, not both")
    if pue is not None and pue < 1.0:
        raise InvalidSettingError(f"pue {pue:g} is below 1; PUE is facility energy over IT energy, at least 1",
                                  argument="pue")  # fmt: skip
    if grid_gco2_per_kwh < 0:
        raise InvalidSettingError(f"grid_gco2_per_kwh must not be negative, not {grid_gco2_per_kwh:g}",
                                  argument="grid_gco2_per_kwh")  # fmt: skip
    if gpus % stages:
        raise InvalidSettingError(f"gpus {gpus} is not a multiple of the pipeline's {stages} stages; each replica "
                                  f"of the pipeline runs on {stages} GPUs", argument="gpus")  # fmt: skip


def _when_to_start(profile: PueProfile, tuned_kwh: float, duration_h: float) -> list[str]:
    """The statement's "When to start" section (its lines): the tuned run's facility energy, ``tuned_kwh`` of GPU
    energy lasting ``duration_h`` hours, for each start hour or month of the site's PUE profile, and what the best
    start saves against the worst."""
    facility = [tuned_kwh * profile.mean_over(s, duration_h) for s in range(len(profile.values))]
    first = 0 if profile.period == "hour" else 1
    best, worst = int(np.argmin(facility)), int(np.argmax(facility))
    lines = ["", f"## When to start ({profile.period}ly site PUE)", "",
             f"The tuned run lasts {duration_h:,.2f} h. Its facility energy by start {profile.period}:", "",
             f"| start {profile.period} | mean PUE over the run | facility energy (kWh) |", "|---:|---:|---:|"]
    for s, e in enumerate(facility):
        lines.append(f"| {s + first} | {e / tuned_kwh:.3f} | {e:,.3f} |")
    lines += ["", f"Starting at {profile.period} {best + first} instead of {worst + first} saves "
                  f"{facility[worst] - facility[best]:,.3f} kWh ({100 * (1 - facility[best] / facility[worst]):.1f} %) "
                  "at the facility."]  # fmt: skip
    return lines


def statement(table, *, iterations: int = 1000, gpus: int | None = None, pue: float | None = None, site_pue_profile=None,
              grid_gco2_per_kwh: float | None = None, out: str | Path | None = None) -> str:  # fmt: skip
    """The energy statement (energy_statement) of a clock table, read from its file, optionally written to ``out``.

    Args:
        table: a ClockTable or the path of one (freqopt.tables.load_table).
        iterations, gpus, pue: see energy_statement (pue default 1.58, DEFAULT_PUE).
        site_pue_profile: a PueProfile, or the path of a CSV hour,pue or month,pue (load_pue_profile); None: none.
        grid_gco2_per_kwh: grid carbon intensity; None: DEFAULT_GRID_GCO2_PER_KWH (436, world 2022).
        out: also write the statement (markdown) to this file, atomically; checked before anything is read.

    Returns:
        The statement, markdown.

    Raises:
        OutputError: ``out`` is a directory or its folder is not writable.
        ClockTableError: the table cannot be read.
        InvalidSettingError: see energy_statement and load_pue_profile.
    """
    from freqopt.api import check_writable_file
    from freqopt.files import atomic_write_text
    from freqopt.tables import load_table

    if out is not None:
        check_writable_file(out, argument="out")
    if not isinstance(table, ClockTable):
        table = load_table(table)
    profile = site_pue_profile
    if profile is not None and not isinstance(profile, PueProfile):
        profile = load_pue_profile(profile)
    grid = DEFAULT_GRID_GCO2_PER_KWH if grid_gco2_per_kwh is None else grid_gco2_per_kwh
    text = energy_statement(table, iterations=iterations, gpus=gpus, pue=pue, profile=profile, grid_gco2_per_kwh=grid)
    if out is not None:
        atomic_write_text(out, text)
    return text
