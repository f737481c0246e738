"""What a pipeline plan is made from: the measured stage profile and the power a GPU draws while it waits.

A stage profile (``load_stage_profile``) holds, for every pipeline stage and instruction kind (forward, backward),
the time (s) and energy (J) of one instruction at each locked SM clock (MHz), as Perseus (Chung et al., SOSP'24)
and Zeus write them: CSV columns ``stage, instruction, frequency, time, energy``. The blocking power
(``blocking_power_w_for``) is the power (W) a GPU draws while it waits on its pipeline neighbours: given, or the
figure Perseus measured on the named GPU (MEASURED_BLOCKING_POWER_W).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freqopt.errors import InvalidSettingError
from freqopt.pipeline.dag import ALL_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, effective_energy_j

__all__ = ["InstructionOptions", "StageProfile", "load_stage_profile", "stage_profile_from_rows",
           "blocking_power_w_for", "check_number", "MEASURED_BLOCKING_POWER_W", "PROFILE_COLUMNS"]  # fmt: skip

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
# The power (W) a GPU draws while blocked on a pipeline P2P transfer, measured by Perseus (Chung et al., SOSP'24;
# lowtime/scripts/perseus.py, branch kronos of github.com/ml-energy/zeus: "Raw P2P blocking power consumption"),
# by freqopt GPU name (search_spaces/). The default blocking_power_w where the caller names one of these GPUs.
MEASURED_BLOCKING_POWER_W = {"a100-sxm4-80gb": 83.64, "a40": 70.38}


@dataclass(frozen=True)
class InstructionOptions:
    """The measured options of one (stage, instruction kind): arrays of shape (K,), one entry per SM clock.

    Attributes:
        sm_clock_mhz: the locked SM clock (MHz), int array.
        time_s: the instruction's time at that clock (s).
        energy_j: its energy at that clock (J).
    """

    sm_clock_mhz: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray

    def non_dominated(self, blocking_power_w: float = 0.0) -> np.ndarray:
        """Indices of the options no other option dominates, fastest first (shape (K',), K' <= K).

        Option a dominates b when time_s[a] <= time_s[b] and the effective energy
        energy_j - blocking_power_w * time_s is no higher at a, one of the two strictly (freqopt.pipeline.planner's
        module docstring, "Dominated clocks"). Of equal
        options, the higher clock is kept.
        """
        effective = effective_energy_j(self.energy_j, self.time_s, blocking_power_w)
        order = np.lexsort((-self.sm_clock_mhz, effective, self.time_s))  # by time, then effective energy
        kept: list[int] = []
        best = math.inf
        for k in order:
            if effective[k] < best:
                kept.append(int(k))
                best = effective[k]
        return np.asarray(kept, dtype=int)


@dataclass(frozen=True)
class StageProfile:
    """A pipeline's measured stage profile: ``options[(stage, kind)]`` for stage in 0..stages-1 and kind in
    ("forward", "backward"), or with the backward split ("backward_input", "backward_weight") for the zero-bubble
    schedules (freqopt.pipeline.schedules); with virtual stages, the stages are the model's (several per GPU).

    Attributes:
        stages: the number of stages profiled.
        options: (stage, kind) -> InstructionOptions.
        source: where it was read from (a path), or None.
    """

    stages: int
    options: Mapping[tuple[int, str], InstructionOptions]
    source: str | None = None


def _profile_error(source: str | None, message: str) -> InvalidSettingError:
    where = f" {source}" if source else ""
    return InvalidSettingError(f"stage_profile{where}: {message}", argument="stage_profile")


def stage_profile_from_rows(rows: Iterable[Mapping[str, object]], *, source: str | None = None) -> StageProfile:
    """A StageProfile from rows with the keys stage, instruction, frequency (MHz), time (s), energy (J).

    Args:
        rows: mappings (a csv.DictReader's rows, or dicts of numbers); extra keys are ignored.
        source: the rows' origin, for error messages.

    Raises:
        InvalidSettingError (argument ``stage_profile``): a missing column, a value that is not a number (or not a
            whole number for stage and frequency), an instruction other than forward/backward, a time that is not
            positive or an energy that is negative or not finite, a clock listed twice for one stage and
            instruction, stages that are not 0..S-1, or a stage without forward or backward rows.
    """
    grouped: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    n_rows = 0
    for line, row in enumerate(rows, start=2):
        n_rows += 1
        missing = [c for c in PROFILE_COLUMNS if c not in row or row[c] is None]
        if missing:
            raise _profile_error(source, f"missing column(s) {', '.join(missing)}; a stage profile has the columns "
                                         f"{', '.join(PROFILE_COLUMNS)}")  # fmt: skip
        values = {}
        for column in PROFILE_COLUMNS[2:] + ("stage",):
            raw = row[column]
            try:
                values[column] = float(raw)
            except (TypeError, ValueError):
                raise _profile_error(source, f"row {line}: {column} {raw!r} is not a number") from None
            if not math.isfinite(values[column]):
                raise _profile_error(source, f"row {line}: {column} {raw!r} is not finite")
        for column in ("stage", "frequency"):
            if values[column] != int(values[column]) or values[column] < 0:
                raise _profile_error(source, f"row {line}: {column} {row[column]!r} is not a whole number >= 0")
        kind = str(row["instruction"]).strip().lower()
        if kind not in ALL_KINDS:
            raise _profile_error(source, f"row {line}: instruction {row['instruction']!r} is not one of "
                                         f"{', '.join(ALL_KINDS)}")  # fmt: skip
        if values["time"] <= 0:
            raise _profile_error(source, f"row {line}: time {row['time']!r} is not positive (seconds)")
        if values["energy"] < 0:
            raise _profile_error(source, f"row {line}: energy {row['energy']!r} is negative (joules)")
        grouped.setdefault((int(values["stage"]), kind), []).append(
            (int(values["frequency"]), values["time"], values["energy"]))
    if not n_rows:
        raise _profile_error(source, f"no rows; a stage profile has the columns {', '.join(PROFILE_COLUMNS)}")
    stages = 1 + max(stage for stage, _ in grouped)
    options: dict[tuple[int, str], InstructionOptions] = {}
    for stage in range(stages):
        split = (stage, BACKWARD_INPUT) in grouped or (stage, BACKWARD_WEIGHT) in grouped
        needed = [FORWARD] + ([BACKWARD_INPUT, BACKWARD_WEIGHT] if split else [BACKWARD])
        for kind in [k for k in ALL_KINDS if k in needed or (stage, k) in grouped]:
            entries = grouped.get((stage, kind))
            if not entries:
                raise _profile_error(source, f"stage {stage} has no {kind} rows; profile every stage 0..{stages - 1} "
                                             "forward and backward (or the backward split into backward_input and "
                                             "backward_weight, for the zero-bubble schedules)")  # fmt: skip
            clocks = [c for c, _, _ in entries]
            if len(set(clocks)) != len(clocks):
                twice = sorted({c for c in clocks if clocks.count(c) > 1})
                raise _profile_error(source, f"stage {stage} {kind} lists clock(s) {twice} more than once")
            entries.sort()
            options[(stage, kind)] = InstructionOptions(
                np.asarray([c for c, _, _ in entries], dtype=int), np.asarray([t for _, t, _ in entries]),
                np.asarray([e for _, _, e in entries]))  # fmt: skip
    return StageProfile(stages, options, source)


def load_stage_profile(path: str | Path) -> StageProfile:
    """Read a stage profile CSV (columns stage, instruction, frequency, time, energy; Perseus's and Zeus's format).
    Lines starting with ``#`` are comments (a source line, as experiments/data/perseus's copies carry).

    Raises:
        InvalidSettingError (argument ``stage_profile``): the file cannot be read, or its content is invalid
            (stage_profile_from_rows).
    """
    source = str(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(line for line in f if not line.lstrip().startswith("#"))
            if reader.fieldnames is None:
                raise _profile_error(source, "is empty; a stage profile has the columns " + ", ".join(PROFILE_COLUMNS))
            fieldnames = [name.strip() for name in reader.fieldnames]
            missing = [c for c in PROFILE_COLUMNS if c not in fieldnames]
            if missing:
                raise _profile_error(source, f"missing column(s) {', '.join(missing)}; a stage profile has the "
                                             f"columns {', '.join(PROFILE_COLUMNS)}")  # fmt: skip
            reader.fieldnames = fieldnames
            return stage_profile_from_rows(list(reader), source=source)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _profile_error(source, f"cannot be read ({reason}); give a CSV file") from None


def blocking_power_w_for(blocking_power_w: float | None, gpu: str | None) -> float:
    """The blocking power (W) to plan with: ``blocking_power_w`` if given, else the measured figure of ``gpu``
    (MEASURED_BLOCKING_POWER_W).

    Raises:
        InvalidSettingError: gpu is not a known GPU (argument ``gpu``); neither is given, or the GPU has no measured
            figure (argument ``blocking_power_w``): waiting is not free, so the planner does not guess it.
    """
    if blocking_power_w is not None:
        check_number("blocking_power_w", blocking_power_w, minimum=0.0)
        return float(blocking_power_w)
    if gpu is not None:
        from freqopt.gpu.specs import list_gpus

        if gpu not in list_gpus():
            raise InvalidSettingError(f"gpu {gpu!r} is unknown; known: {', '.join(list_gpus())}", argument="gpu")
        if gpu in MEASURED_BLOCKING_POWER_W:
            return MEASURED_BLOCKING_POWER_W[gpu]
    known = ", ".join(f"{name} {watts} W" for name, watts in MEASURED_BLOCKING_POWER_W.items())
    where = f"no measured figure for {gpu}" if gpu else "no gpu named"
    raise InvalidSettingError(f"blocking_power_w is required ({where}): give the power (W) a GPU draws while it waits "
                              f"on its pipeline neighbours, or a gpu with a measured one ({known})",
                              argument="blocking_power_w")  # fmt: skip


def check_number(name: str, value, *, minimum: float, strict: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and (value > minimum if strict else value >= minimum):
        return
    relation = ">" if strict else ">="
    raise InvalidSettingError(f"{name} must be a finite number {relation} {minimum:g}, not {value!r}", argument=name)
