"""The search, end to end, for one trace on one backend (design.md section 4).

For each granularity: partition the trace into tuning units, run each unit's study, allocate the slowdown
budget over all units at once (MILP), then validate by measuring the whole iteration with the chosen schedule.
If the validated slowdown breaks the budget (units interact through the power limit; measurements are noisy),
the allocation's budget is tightened by the overshoot and solved again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from freqopt.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.errors import InvalidSettingError, StorageError
from freqopt.search.allocate import allocate
from freqopt.search.study import UnitSearch, search_unit
from freqopt.search.units import GRANULARITIES, TuningUnit, check_granularity, partition
from freqopt.trace import Trace

__all__ = ["SearchConfig", "GranularityResult", "SearchResult", "run_search", "study_prefix", "open_storage"]


def open_storage(url: str | None):
    """The Optuna storage at ``url`` (optuna.storages.get_storage; None: in memory), opened once and shared by
    every study of a search.

    Raises:
        StorageError: the URL cannot be opened (unknown scheme, missing folder, unreachable server).
    """
    import optuna

    if url is None:
        return None
    try:
        return optuna.storages.get_storage(url)
    except Exception as e:  # SQLAlchemy and the drivers raise many kinds; all mean "cannot open"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StorageError(
            f"cannot open Optuna storage {url!r} ({reason}); give a URL like sqlite:///path/to/freqopt.db"
        ) from e


@dataclass(frozen=True)
class SearchConfig:
    """How to search.

    Attributes:
        max_slowdown: allowed fractional slowdown of the iteration, in [0, 1) (0.01 = 1 %).
        granularities: which of GRANULARITIES to search.
        n_trials_1d: trials per unit when the space has one dimension (SM clock only, or power limit).
        n_trials_2d: trials per unit when memory clocks are searched too.
        finalist_repeats: extra measurements of each finalist (noise-aware selection).
        validation_repeats: measurements of the whole iteration, averaged, for the baseline and each schedule.
        max_validation_rounds: allocations tried before giving up on meeting the budget when validated.
        seed: seeds the samplers.
        storage: Optuna storage URL; None keeps studies in memory.
    """

    max_slowdown: float
    granularities: tuple[str, ...] = GRANULARITIES
    n_trials_1d: int = 14
    n_trials_2d: int = 30
    finalist_repeats: int = 2
    validation_repeats: int = 3
    max_validation_rounds: int = 8
    seed: int = 0
    storage: str | None = None

    def __post_init__(self):
        if not 0.0 <= self.max_slowdown < 1.0:
            raise InvalidSettingError(f"max slowdown must be in [0, 100 %), not {self.max_slowdown:.4g}")
        for g in self.granularities:
            check_granularity(g)


@dataclass(frozen=True)
class GranularityResult:
    """The validated outcome of one granularity.

    Attributes:
        granularity: one of GRANULARITIES.
        units: per unit, its name, kernel indices and chosen setting.
        predicted: the allocator's sum of the chosen options (time_s and energy_j per iteration).
        validated: the whole iteration measured with the schedule.
        n_measurements, search_cost_gpu_s: measurements and GPU-seconds the search spent, validation included.
        unit_searches: each unit's study outcome.
        study_names: the Optuna studies behind the result.
    """

    granularity: str
    units: tuple[tuple[TuningUnit, ClockSetting], ...]
    predicted: Measurement
    predicted_baseline: Measurement
    validated: Measurement
    n_measurements: int
    search_cost_gpu_s: float
    unit_searches: tuple[UnitSearch, ...] = field(repr=False, default=())

    @property
    def n_settings(self) -> int:
        """Distinct settings in the schedule."""
        return len({s for _, s in self.units})

    @property
    def study_names(self) -> list[str]:
        return [u.study_name for u in self.unit_searches]


@dataclass(frozen=True)
class SearchResult:
    trace: Trace
    gpu: str
    max_slowdown: float
    baseline: Measurement
    results: dict[str, GranularityResult]
    storage: str | None

    def energy_saved_pct(self, g: str) -> float:
        return 100.0 * (1.0 - self.results[g].validated.energy_j / self.baseline.energy_j)

    def slowdown_pct(self, g: str) -> float:
        return 100.0 * (self.results[g].validated.time_s / self.baseline.time_s - 1.0)

    def predicted_energy_saved_pct(self, g: str) -> float:
        r = self.results[g]
        return 100.0 * (1.0 - r.predicted.energy_j / r.predicted_baseline.energy_j)


def study_prefix(trace: Trace, gpu: str, seed: int) -> str:
    """A study-name prefix unique to the workload, GPU and seed, so one storage can hold many searches."""
    w = trace.workload
    c = w.config
    ident = f"{w.model}|{c}|{w.micro_batch_size}|{gpu}|{seed}"
    return f"{w.model}-{gpu}-{hashlib.sha1(ident.encode()).hexdigest()[:8]}"


def _mean(ms: list[Measurement]) -> Measurement:
    return Measurement(
        time_s=float(np.mean([m.time_s for m in ms])),
        energy_j=float(np.mean([m.energy_j for m in ms])),
        cost_gpu_s=float(np.sum([m.cost_gpu_s for m in ms])),
    )


def _per_kernel_settings(trace: Trace, unit_settings) -> list[ClockSetting]:
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for unit, setting in unit_settings:
        for k in unit.kernel_indices:
            per_kernel[k] = setting
    return per_kernel


def _schedule(trace: Trace, units, searches, picks) -> tuple[ClockSetting, ...]:
    """Per-kernel settings of one option per unit."""
    return tuple(_per_kernel_settings(trace, [(u, s.options[j].setting) for u, s, j in zip(units, searches, picks)]))


def _measure_iteration(backend: Backend, trace: Trace, settings: list[ClockSetting], repeats: int, key: str):
    return _mean([backend.measure_schedule(trace.kernels, settings, key=key) for _ in range(repeats)])


def _search_granularity(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, baseline: Measurement,
    on_unit: Callable[[str, int, int], None] | None, coarser: GranularityResult | None = None,
    validations: dict[tuple[ClockSetting, ...], Measurement] | None = None, storage=None,
) -> GranularityResult:  # fmt: skip
    """Search one granularity. ``coarser``: the validated result of the next coarser clock granularity; its
    settings warm-start each unit's study and its schedule is the first candidate, so a finer granularity never
    ends worse than a coarser one (any coarser schedule is also a finer one). ``validations``: schedules already
    measured whole (per-kernel settings -> measurement), shared across granularities so that one schedule is
    measured once and reported alike wherever it wins."""
    validations = {} if validations is None else validations
    units = partition(trace, granularity)
    inherited: list[ClockSetting | None] = [None] * len(units)
    if coarser is not None:
        per_kernel = _per_kernel_settings(trace, coarser.units)
        inherited = [per_kernel[u.kernel_indices[0]] for u in units]
    space = "power" if granularity == "power-cap" else "clocks"
    two_d = space == "clocks" and len(backend.spec.mem_clocks_mhz) > 1
    n_trials = config.n_trials_2d if two_d else config.n_trials_1d
    prefix = study_prefix(trace, backend.spec.name, config.seed)
    searches = []
    for i, unit in enumerate(units):
        digest = hashlib.sha1(unit.name.encode()).hexdigest()[:10]
        searches.append(
            search_unit(
                backend, unit.kernels(trace), name=unit.name, study_name=f"{prefix}-{granularity}-{digest}",
                storage=storage, space=space, n_trials=n_trials, finalist_repeats=config.finalist_repeats,
                finalist_slowdown=max(0.05, 3 * config.max_slowdown), seed=config.seed,
                warm_start=[inherited[i]] if inherited[i] not in (None, DEFAULT_SETTING) else [],
            )
        )  # fmt: skip
        if on_unit:
            on_unit(granularity, i + 1, len(units))
    options = [[(o.time_s, o.energy_j) for o in s.options] for s in searches]
    predicted_base_t = sum(s.default.time_s for s in searches)
    predicted_base_e = sum(s.default.energy_j for s in searches)
    n_meas = sum(s.n_measurements for s in searches)
    cost = sum(s.cost_gpu_s for s in searches)
    chosen, validated = [s.default for s in searches], baseline  # the defaults meet any budget
    tried: set[tuple[int, ...]] = set()

    def evaluate(picks: tuple[int, ...]) -> float:
        """Validate one option per unit on the whole iteration (once per schedule); keep it if it is the best
        within budget. Returns the validated slowdown."""
        nonlocal chosen, validated, n_meas, cost
        tried.add(picks)
        candidate = [searches[u].options[j] for u, j in enumerate(picks)]
        schedule = _schedule(trace, units, searches, picks)
        if schedule not in validations:
            validations[schedule] = _measure_iteration(backend, trace, list(schedule), config.validation_repeats,
                                                       key=granularity)  # fmt: skip
            n_meas += config.validation_repeats
            cost += validations[schedule].cost_gpu_s
        measured = validations[schedule]
        slowdown = measured.time_s / baseline.time_s - 1.0
        if slowdown <= config.max_slowdown and measured.energy_j < validated.energy_j:
            chosen, validated = candidate, measured
        return slowdown

    if coarser is not None and coarser.validated.energy_j < baseline.energy_j:
        evaluate(tuple(
            next(j for j, o in enumerate(s.options) if o.setting == (inherited[u] or DEFAULT_SETTING))
            for u, s in enumerate(searches)
        ))  # fmt: skip
    # The allocator's budget is relative to its own model of the iteration (the sum of the units' defaults, each
    # measured alone), then calibrated by validation: units measured alone do not add up exactly to the iteration
    # (the power limit averages power over neighbouring kernels), so the budget is moved by the validated
    # overshoot or slack (a secant step on validated slowdown, kept inside the bracket of budgets known to meet
    # and to break the limit, else bisection), and the best schedule that meets the budget wins.
    budget = (1.0 + config.max_slowdown) * predicted_base_t
    meets, breaks = None, None  # largest budget validated within the limit, smallest validated over it
    for _ in range(config.max_validation_rounds):
        try:
            picks = tuple(allocate(options, budget))
        except InvalidSettingError:  # below the fastest the units can go
            meets = budget
            budget = budget * 1.01 if breaks is None else (budget * breaks) ** 0.5
            continue
        if picks in tried:  # validated in an earlier round
            slowdown = validations[_schedule(trace, units, searches, picks)].time_s / baseline.time_s - 1.0
        else:
            slowdown = evaluate(picks)
        if abs(slowdown - config.max_slowdown) <= 0.1 * max(config.max_slowdown, 0.001):
            break
        if slowdown <= config.max_slowdown:
            meets = budget if meets is None else max(meets, budget)
        else:
            breaks = budget if breaks is None else min(breaks, budget)
        step = budget * (1.0 + config.max_slowdown) / (1.0 + slowdown)
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4 * budget:
                break
            if not meets < step < breaks:
                step = (meets * breaks) ** 0.5
        budget = step
    predicted = Measurement(sum(o.time_s for o in chosen), sum(o.energy_j for o in chosen))
    return GranularityResult(
        granularity=granularity,
        units=tuple((u, o.setting) for u, o in zip(units, chosen)),
        predicted=predicted,
        predicted_baseline=Measurement(predicted_base_t, predicted_base_e),
        validated=validated,
        n_measurements=n_meas,
        search_cost_gpu_s=cost,
        unit_searches=tuple(searches),
    )


def run_search(
    trace: Trace,
    backend: Backend,
    config: SearchConfig,
    *,
    on_unit: Callable[[str, int, int], None] | None = None,
) -> SearchResult:
    """Search every granularity in ``config`` and validate each result on ``backend``.

    Args:
        trace: the iteration's kernels.
        backend: the GPU to measure on.
        config: budget, granularities, trial counts, storage.
        on_unit: called as on_unit(granularity, units_done, units_total) after each unit's study (progress).

    Returns:
        SearchResult with the measured baseline (all defaults) and one validated result per granularity.
    """
    baseline = _measure_iteration(
        backend, trace, [DEFAULT_SETTING] * len(trace), config.validation_repeats, key="baseline"
    )
    storage = open_storage(config.storage)
    results: dict[str, GranularityResult] = {}
    coarser = None
    validations = {tuple([DEFAULT_SETTING] * len(trace)): baseline}
    for g in GRANULARITIES:
        if g in config.granularities:
            results[g] = _search_granularity(trace, backend, config, g, baseline, on_unit,
                                             coarser=coarser if g != "power-cap" else None,
                                             validations=validations, storage=storage)  # fmt: skip
            if g != "power-cap":
                coarser = results[g]
    return SearchResult(trace, backend.spec.name, config.max_slowdown, baseline, results, config.storage)
