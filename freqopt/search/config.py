"""How to search: the budget, granularities, trial counts and storage of one search."""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.search.units import GRANULARITIES, check_granularity
from freqopt.budget import DEFAULT_CONFIDENCE, check_confidence

__all__ = ["SearchConfig"]


@dataclass(frozen=True)
class SearchConfig:
    """How to search.

    Attributes:
        max_slowdown: allowed fractional slowdown of the iteration, in (0, 1) (0.01 = 1 %; zero is refused:
            freqopt.budget.parse_slowdown).
        granularities: which of GRANULARITIES to search.
        n_trials_1d: trials per unit when the space has one dimension (SM clock only, or power limit).
        n_trials_2d: trials per unit when memory clocks are searched too; None: ``n_trials_1d`` plus
            ``n_trials_per_mem_clock`` for each memory clock beyond the first (H100, 2 clocks: 18; RTX 3080 Ti,
            5 clocks: 30).
        n_trials_per_mem_clock: see n_trials_2d.
        finalist_repeats: extra measurements of each finalist (noise-aware selection).
        validation_repeats: measurements of the whole iteration, averaged, for each schedule validated.
        baseline_repeats: measurements of the whole iteration at the defaults, averaged: the baseline every
            schedule of every level is judged against, so its error is common to all of those judgments
            (freqopt.search.validate.Validator).
        validation_max_repeats: measurements at most of a schedule whose upper confidence bound is over the
            budget's limit while its mean is not clearly over it (Validator.requests); it is read again, one pair
            of measurements at a time, until the bound is inside or it has this many.
        confidence: a schedule is accepted only if the upper one-sided confidence bound of its slowdown, at this
            level, is within the budget, from readings paired with the defaults' (Validator);
            in [0.5, 1), 0.5 judging on the mean alone.
        max_validation_rounds: allocations tried before giving up on meeting the budget when validated.
        seed: seeds the samplers.
        storage: Optuna storage URL; None keeps studies in memory.
        switching: validate schedules as a phase-switching runtime realizes them (freqopt.workload.phases), with each
            change of clocks landing one clock-switch latency late, so the budget is met with switching costs
            included; the free-switching ("ideal") figure is measured beside it.
        free_switching: with ``switching``, also search and validate each level's free-switching figure (the
            pass and kernel levels' allocations as if switching were free, even where a runtime can realize only
            one clock). False measures only what a runtime realizes (``freqopt benchmark``,
            which prices finding the realizable schedule against a sweep).
        share_classes: at kernel level, each family of kernel classes (kind, group size and arithmetic
            intensity: freqopt.search.units.kernel_families) shares one study and one setting.
        n_jobs: processes (joblib) that run this process's tuning units; the simulated backend only (one
            process per real GPU: start ``freqopt worker`` on each).
        max_phase_blocks: phase level: at most about this many blocks of phases (freqopt.search.schedule).
        patience: a unit's study stops before its trials are spent once this many trials in a row added nothing
            to its Pareto front near the default's time (search_unit); None (the default): every study runs all
            its trials. Off by default: at 4 it cut the kernel level's measurements on gpt3-xl / RTX 3080 Ti by a
            third, but with free switching its saving fell from 7.40 % to 2.74 % (2-D fronts stall
            before they are explored). The phase level has its own (phase_patience).
        phase_patience: the same for the phase level's block studies, each of whose measurements is a whole
            iteration (4 by default; None: every block's study runs all its trials). At 4 it cut the phase level on
            gpt3-xl / RTX 3080 Ti (100 ms switches, 1 % budget) from 348 to 198 measurements and gpt3-xl's kernel level
            on the H100 from 592 to 569, with the same validated savings (the free-switching figures do
            not use the phase level).
        phase_finalist_repeats: phase level: extra measurements of each finalist. Its measurements are whole
            iterations, whose noise is large against one block's share, so it repeats more than the other levels.
    """

    max_slowdown: float
    granularities: tuple[str, ...] = GRANULARITIES
    n_trials_1d: int = 14
    n_trials_2d: int | None = None
    n_trials_per_mem_clock: int = 4
    finalist_repeats: int = 2
    validation_repeats: int = 3
    baseline_repeats: int = 9
    validation_max_repeats: int = 16
    confidence: float = DEFAULT_CONFIDENCE
    max_validation_rounds: int = 8
    seed: int = 0
    storage: str | None = None
    switching: bool = True
    free_switching: bool = True
    n_jobs: int = 1
    share_classes: bool = True
    max_phase_blocks: int = 8
    phase_finalist_repeats: int = 4
    patience: int | None = None
    phase_patience: int | None = 4

    def __post_init__(self):
        if self.n_jobs < 1:
            raise InvalidSettingError(f"n_jobs must be a positive integer, not {self.n_jobs}")
        if not 0.0 < self.max_slowdown < 1.0:
            raise InvalidSettingError(f"max_slowdown must be above 0 and below 1 (100 %), not {self.max_slowdown:.4g}"
                                      "; give a budget like 0.01", argument="max_slowdown")  # fmt: skip
        for g in self.granularities:
            check_granularity(g)
        check_confidence(self.confidence)
        for name in ("validation_repeats", "baseline_repeats", "validation_max_repeats"):
            check_positive_int(name, getattr(self, name))
        for name in ("patience", "phase_patience"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidSettingError(f"{name} must be a positive integer or None, not {value!r}")
