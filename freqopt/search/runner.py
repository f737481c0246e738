"""The search, end to end, for one trace on one backend (design.md section 4).

For each granularity: partition the trace into tuning units, run each unit's study (run_unit_studies), allocate
the slowdown budget over all units at once (MILP), and validate by measuring the whole iteration with the chosen
schedule (allocate_validated). Units measured alone do not add up exactly to the iteration (the power limit
averages power over neighbouring kernels; measurements are noisy), so the allocator's budget is calibrated by
validation until the validated slowdown meets the limit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from freqopt.backends.base import Backend, ClockSetting, DEFAULT_SETTING, Measurement
from freqopt.errors import InvalidSettingError, StorageError
from freqopt.kernels import Trace
from freqopt.search.allocate import allocate
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.study import UnitSearch
from freqopt.search.units import GRANULARITIES, TuningUnit, check_granularity, kernel_families, partition
from freqopt.search.workers import UnitQueue, UnitWork, finish_job, is_persistent, publish_job, run_unit

__all__ = ["SearchConfig", "GranularityResult", "SearchResult", "run_search", "study_prefix", "open_storage",
           "run_unit_studies", "Validator", "validation_log", "Allocation", "allocate_validated"]


def open_storage(url: str | None):
    """The Optuna storage at ``url``, opened once and shared by every study of a search.

    URLs: None (in memory); an SQLAlchemy URL for optuna.storages.RDBStorage (sqlite:///path.db,
    postgresql+psycopg2://user@host/db, mysql+pymysql://...; SQLite waits up to 60 s for another process's
    lock); or journal:PATH for optuna.storages.JournalStorage on a JournalFileBackend (an append-only file that
    several processes share through its lock; no server needed).

    Raises:
        StorageError: the URL cannot be opened (unknown scheme, missing folder, unreachable server).
    """
    import optuna
    import sqlalchemy

    if url is None:
        return None
    try:
        if url.startswith("journal:"):
            path = url.removeprefix("journal:").removeprefix("//")
            if not path:
                raise ValueError("no file after journal:")
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(path))
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):  # processes creating a new
                # database's tables at once collide ("duplicate key", "relation already exists"): the tables exist now
                if attempt == 4:
                    raise
                time.sleep(0.5 * (attempt + 1))
    except Exception as e:  # SQLAlchemy, the drivers and the file system raise many kinds; all mean "cannot open"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StorageError(
            f"cannot open Optuna storage {url!r} ({reason}); give a URL like sqlite:///path/to/freqopt.db, "
            "postgresql+psycopg2://user@host/db or journal:path/to/journal.log"
        ) from e


@dataclass(frozen=True)
class SearchConfig:
    """How to search.

    Attributes:
        max_slowdown: allowed fractional slowdown of the iteration, in [0, 1) (0.01 = 1 %).
        granularities: which of GRANULARITIES to search.
        n_trials_1d: trials per unit when the space has one dimension (SM clock only, or power limit).
        n_trials_2d: trials per unit when memory clocks are searched too; None: ``n_trials_1d`` plus
            ``n_trials_per_mem_clock`` for each memory clock beyond the first (H100, 2 clocks: 18; RTX 3080 Ti,
            5 clocks: 30).
        n_trials_per_mem_clock: see n_trials_2d.
        finalist_repeats: extra measurements of each finalist (noise-aware selection).
        validation_repeats: measurements of the whole iteration, averaged, for the baseline and each schedule.
        max_validation_rounds: allocations tried before giving up on meeting the budget when validated.
        seed: seeds the samplers.
        storage: Optuna storage URL; None keeps studies in memory.
        switching: validate schedules as a phase-switching runtime realizes them (freqopt.phases), with each
            change of clocks landing one clock-switch latency late, so the budget is met with switching costs
            included; the free-switching ("ideal") figure is measured beside it.
        share_classes: at kernel level, run full studies only for one kernel class per family (kind and
            arithmetic intensity) and short warm-started ones for the rest (run_unit_studies).
        n_jobs: processes (joblib) that run this process's tuning units; the simulated backend only (one
            process per real GPU: start ``freqopt worker`` on each).
    """

    max_slowdown: float
    granularities: tuple[str, ...] = GRANULARITIES
    n_trials_1d: int = 14
    n_trials_2d: int | None = None
    n_trials_per_mem_clock: int = 4
    finalist_repeats: int = 2
    validation_repeats: int = 3
    max_validation_rounds: int = 8
    seed: int = 0
    storage: str | None = None
    switching: bool = True
    n_jobs: int = 1
    share_classes: bool = True

    def __post_init__(self):
        if self.n_jobs < 1:
            raise InvalidSettingError(f"n_jobs must be a positive integer, not {self.n_jobs}")
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
        predicted: what the search predicted for the schedule in ``units`` before validating it: the sum of the
            units' measured options (time_s and energy_j per iteration), or the coarser granularity's prediction
            when its schedule is kept (_prediction).
        predicted_baseline: the same sum at the defaults.
        validated: the whole iteration measured with the schedule, as a runtime realizes it (switching costs
            included when SearchConfig.switching).
        ideal: the whole iteration measured with the schedule and free, instant switching (None if not measured).
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
    ideal: Measurement | None = None

    @property
    def n_settings(self) -> int:
        """Distinct settings in the schedule."""
        return len({s for _, s in self.units})

    @property
    def study_names(self) -> list[str]:
        return [u.study_name for u in self.unit_searches]


@dataclass(frozen=True)
class SearchResult:
    """A search's outcome: the measured baseline and one validated result per granularity.

    Attributes:
        trace: the searched iteration.
        gpu: the GPU type's name; spec: the GPU type itself (clock lists as the backend reported them).
        max_slowdown: the budget, a fraction.
        baseline: the whole iteration at default settings (time_s, energy_j per iteration).
        results: granularity -> GranularityResult, coarse to fine.
        storage: the Optuna storage URL (None: in memory).
        n_new_measurements: measurements this process took (the rest were read back, or taken by other workers).
        backend_name: "sim", "nvml", ... (None: not known); seed: the samplers' seed.
        table_paths: granularity -> clock-table JSON file written by ``freqopt.search(..., out=...)``.
    """

    trace: Trace
    gpu: str
    max_slowdown: float
    baseline: Measurement
    results: dict[str, GranularityResult]
    storage: str | None
    n_new_measurements: int = 0
    spec: object = field(default=None, repr=False)  # GPUSpec
    backend_name: str | None = None
    seed: int = 0
    table_paths: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """The JSON document ``freqopt search --json`` writes (freqopt.search.summary.summarize)."""
        from freqopt.search.summary import summarize

        return summarize(self, self.table_paths)

    def table(self, granularity: str):
        """The clock table (freqopt.tables.ClockTable) of one searched granularity.

        Raises:
            UnknownNameError: ``granularity`` was not searched.
        """
        from freqopt.tables import result_table

        return result_table(self, granularity)

    def write_tables(self, out) -> dict:
        """Write each granularity's clock table as JSON and CSV into folder ``out``; returns granularity -> JSON
        path (freqopt.tables.write_result_tables)."""
        from freqopt.tables import write_result_tables

        return write_result_tables(self, out)

    def energy_saved_pct(self, g: str) -> float:
        return 100.0 * (1.0 - self.results[g].validated.energy_j / self.baseline.energy_j)

    def slowdown_pct(self, g: str) -> float:
        return 100.0 * (self.results[g].validated.time_s / self.baseline.time_s - 1.0)

    def ideal_energy_saved_pct(self, g: str) -> float | None:
        ideal = self.results[g].ideal
        return None if ideal is None else 100.0 * (1.0 - ideal.energy_j / self.baseline.energy_j)

    def ideal_slowdown_pct(self, g: str) -> float | None:
        ideal = self.results[g].ideal
        return None if ideal is None else 100.0 * (ideal.time_s / self.baseline.time_s - 1.0)

    def predicted_energy_saved_pct(self, g: str) -> float:
        r = self.results[g]
        return 100.0 * (1.0 - r.predicted.energy_j / r.predicted_baseline.energy_j)


def study_prefix(trace: Trace, spec, seed: int) -> str:
    """A study-name prefix unique to the workload (model, micro-batch, layout, mode), the GPU type (with all its constants, so a recalibrated GPU
    does not resume studies measured under the old ones) and the seed, so one storage can hold many searches."""
    w = trace.workload
    ident = f"{w.model}|{w.config}|{w.micro_batch_size}|{w.layout!r}|{trace.meta.get('mode', 'train')}|{spec!r}|{seed}"
    layout = "" if w.layout.is_single_gpu else f"-dp{w.layout.dp}tp{w.layout.tp}"
    return f"{w.model}{layout}-{spec.name}-{hashlib.sha1(ident.encode()).hexdigest()[:8]}"


def validation_log(storage, prefix: str) -> MeasurementLog:
    """The log of a search's whole-iteration measurements: study ``<prefix>-validation`` in ``storage``."""
    import optuna

    return MeasurementLog(optuna.create_study(study_name=f"{prefix}-validation", storage=storage, load_if_exists=True))


def _per_kernel_settings(trace: Trace, unit_settings) -> list[ClockSetting]:
    per_kernel = [DEFAULT_SETTING] * len(trace)
    for unit, setting in unit_settings:
        for k in unit.kernel_indices:
            per_kernel[k] = setting
    return per_kernel


class Validator:
    """Measures whole iterations, once per distinct per-kernel schedule, and counts what that cost.

    Args:
        trace, backend: the iteration and the GPU.
        repeats: measurements averaged per schedule.
        switching: measure schedules as a phase-switching runtime realizes them (freqopt.phases.Realizer) and
            with the GPU's clock-switch latency; False: the schedule as given, switching free (the ideal).
        log: where measurements are recorded and read back on resume (freqopt.search.journal); default an
            in-memory one.
    """

    def __init__(self, trace: Trace, backend: Backend, repeats: int, *, switching: bool = False,
                 log: MeasurementLog | None = None):  # fmt: skip
        import optuna

        from freqopt.phases import Realizer

        self.trace, self.backend, self.repeats, self.switching = trace, backend, repeats, switching
        self.realize = Realizer(trace, backend.spec) if switching else (lambda schedule: schedule)
        self.log = log or MeasurementLog(optuna.create_study())
        self.cache: dict[tuple[ClockSetting, ...], Measurement] = {}
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    def __call__(self, schedule: tuple[ClockSetting, ...], key: str = "schedule") -> Measurement:
        schedule = self.realize(tuple(schedule))
        if schedule not in self.cache:
            tag = digest((schedule, self.switching))
            ms = [self.log.measure(tag, r, lambda i: self.backend.measure_schedule(
                      self.trace.kernels, schedule, key=key, switching=self.switching, sample=i))
                  for r in range(self.repeats)]  # fmt: skip
            self.cache[schedule] = Measurement(
                time_s=float(np.mean([m.time_s for m in ms])),
                energy_j=float(np.mean([m.energy_j for m in ms])),
                cost_gpu_s=float(np.sum([m.cost_gpu_s for m in ms])),
            )
            self.n_measurements += self.repeats
            self.cost_gpu_s += self.cache[schedule].cost_gpu_s
        return self.cache[schedule]

    def baseline(self) -> Measurement:
        return self(tuple([DEFAULT_SETTING] * len(self.trace)), key="baseline")

    def units(self, units: list[TuningUnit], settings: list[ClockSetting], key: str) -> Measurement:
        return self(tuple(_per_kernel_settings(self.trace, zip(units, settings))), key=key)


def _slack(max_slowdown: float, n_units: int) -> float:
    """How much slower than its default a unit's options may be (the region its study samples, and where its
    finalists are re-measured). A lone unit (the whole iteration) can only ever spend the budget, plus timing
    noise; one of many may spend more where others spend less."""
    return 1.5 * max_slowdown + 0.005 if n_units == 1 else max(0.05, 3 * max_slowdown)


_STORAGES: dict[str, object] = {}


def _storage_here(url: str):
    """``url`` opened once per process (joblib workers open their own connection)."""
    if url not in _STORAGES:
        _STORAGES[url] = open_storage(url)
    return _STORAGES[url]


def _unit_task(trace: Trace, backend: Backend, work: UnitWork, i: int, unit: TuningUnit, storage, url: str | None,
               queue_name: str | None, warm: list[ClockSetting]) -> tuple[int, UnitSearch | None]:  # fmt: skip
    """One unit as a joblib task: claimed from the queue first when the storage is shared (None: a worker has it)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # in joblib's worker processes too
    if storage is None and url is not None:
        storage = _storage_here(url)
    if queue_name is None:
        return i, run_unit(trace, backend, work, unit, storage, warm)
    queue = UnitQueue(storage, queue_name)
    claimed = queue.claim(i)
    if claimed is None:
        return i, None
    with queue.owning(claimed[1]):
        return i, run_unit(trace, backend, work, unit, storage, warm)


def _run_units(trace: Trace, backend: Backend, config: SearchConfig, work: UnitWork, units: list[TuningUnit],
               which: list[int], warm: list[list[ClockSetting]], storage, progress: Callable[[], None]
               ) -> dict[int, UnitSearch]:  # fmt: skip
    """Run units ``which`` (indices into ``units``) with their warm starts: through a queue that workers share when
    the storage is persistent, in ``config.n_jobs`` joblib processes."""
    from joblib import Parallel, delayed

    queue = UnitQueue.create(storage, work, which, warm) if is_persistent(storage) else None
    parallel = config.n_jobs > 1
    tasks = (delayed(_unit_task)(trace, backend, work, i, units[i], None if parallel else storage,
                                 config.storage if parallel else None, queue.name if queue else None, w)
             for i, w in zip(which, warm))  # fmt: skip
    results: dict[int, UnitSearch] = {}
    for i, result in Parallel(n_jobs=config.n_jobs, return_as="generator_unordered")(tasks):
        if result is not None:
            results[i] = result
            progress()
    if queue is not None:
        queue.settle()  # units other workers hold: wait for them, or take them over if their worker is gone
        for i, w in zip(which, warm):
            if i not in results:
                results[i] = run_unit(trace, backend, work, units[i], storage, w)
                progress()
    return results


def _shared_settings(search: UnitSearch, slack: float, n: int = 5) -> list[ClockSetting]:
    """Up to ``n`` of a representative's options within ``slack`` of its default time, spread over that range."""
    useful = [o for o in search.options[1:] if o.time_s <= search.default.time_s * (1 + slack)]
    useful.sort(key=lambda o: o.time_s)
    if len(useful) > n:
        useful = [useful[round(j * (len(useful) - 1) / (n - 1))] for j in range(n)]
    return [o.setting for o in useful]


def run_unit_studies(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, *, storage=None,
    warm_start: list[ClockSetting | None] | None = None, on_unit: Callable[[str, int, int], None] | None = None,
) -> tuple[list[TuningUnit], list[UnitSearch]]:  # fmt: skip
    """Partition the trace and run (or resume) each tuning unit's study.

    Kernel level, with ``config.share_classes``: the units are grouped by kernel_families; each family's
    representative runs a full study first, and the other members run short ones warm-started with the
    representative's useful settings (what one kernel class teaches about kernels of the same kind and
    arithmetic intensity).

    With a storage other processes can see, the units are a queue that ``freqopt worker`` processes join
    (freqopt.search.workers); units they ran are read back from the storage, units whose worker died are resumed
    here. ``config.n_jobs`` > 1 runs this process's share in that many joblib processes.

    Args:
        warm_start: per unit, a setting to enqueue first and always offer (a coarser granularity's choice).

    Returns:
        The units and, per unit, its study's outcome (in unit order, whoever ran it).
    """
    units = partition(trace, granularity)
    space = "power" if granularity == "power-cap" else "clocks"
    n_mem = len(backend.spec.mem_clocks_mhz) if space == "clocks" else 1
    n_trials = config.n_trials_1d
    if n_mem > 1:
        n_trials = config.n_trials_2d or config.n_trials_1d + config.n_trials_per_mem_clock * (n_mem - 1)
    work = UnitWork(
        prefix=study_prefix(trace, backend.spec, config.seed), granularity=granularity, space=space,
        n_trials=n_trials, finalist_repeats=config.finalist_repeats,
        finalist_slowdown=_slack(config.max_slowdown, len(units)), seed=config.seed, constrained=len(units) == 1,
    )  # fmt: skip
    inherited = [[] if w in (None, DEFAULT_SETTING) else [w] for w in (warm_start or [None] * len(units))]
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        if on_unit:
            on_unit(granularity, done, len(units))

    if granularity != "kernel" or not config.share_classes or len(units) == 1:
        results = _run_units(trace, backend, config, work, units, list(range(len(units))), inherited, storage,
                             progress)  # fmt: skip
        return units, [results[i] for i in range(len(units))]
    families = kernel_families(trace, units)
    leaders = [f[0] for f in families]
    results = _run_units(trace, backend, config, work, units, leaders, [inherited[i] for i in leaders], storage,
                         progress)  # fmt: skip
    members, warm = [], []
    for family in families:
        shared = _shared_settings(results[family[0]], work.finalist_slowdown)
        for i in family[1:]:
            members.append(i)
            warm.append(inherited[i] + [s for s in shared if s not in inherited[i]])
    if members:
        member_work = dataclasses.replace(work, n_trials=max(4, work.n_trials // 3), spread=False)
        results.update(_run_units(trace, backend, config, member_work, units, members, warm, storage, progress))
    return units, [results[i] for i in range(len(units))]


@dataclass(frozen=True)
class Allocation:
    """One option per unit and the whole iteration measured with them."""

    chosen: tuple  # Option per unit
    validated: Measurement


def allocate_validated(
    units: list[TuningUnit], searches: list[UnitSearch], validator: Validator, baseline: Measurement,
    max_slowdown: float, *, rounds: int = 8, first: list[ClockSetting] | None = None, key: str = "schedule",
) -> Allocation:  # fmt: skip
    """The schedule with the least validated energy whose validated slowdown is within ``max_slowdown``.

    The allocator's budget starts at (1 + max_slowdown) x the sum of the units' own defaults and is then moved by
    the validated overshoot or slack: a secant step on validated slowdown, kept inside the bracket of budgets known
    to meet and to break the limit, else bisection. ``first``: a schedule (one setting per unit, each among its
    unit's options) validated before the allocator's, so the result is never worse than it.
    """
    options = [[(o.time_s, o.energy_j) for o in s.options] for s in searches]
    best = Allocation(tuple(s.default for s in searches), baseline)  # the defaults meet any budget

    def evaluate(chosen: tuple) -> float:
        nonlocal best
        measured = validator.units(units, [o.setting for o in chosen], key)
        slowdown = measured.time_s / baseline.time_s - 1.0
        if slowdown <= max_slowdown and measured.energy_j < best.validated.energy_j:
            best = Allocation(chosen, measured)
        return slowdown

    if first is not None:
        evaluate(tuple(next(o for o in s.options if o.setting == setting) for s, setting in zip(searches, first)))
    budget = (1.0 + max_slowdown) * sum(s.default.time_s for s in searches)
    meets, breaks = None, None  # largest budget validated within the limit, smallest validated over it
    for _ in range(rounds):
        try:
            picks = allocate(options, budget)
        except InvalidSettingError:  # below the fastest the units can go
            meets = budget
            budget = budget * 1.01 if breaks is None else (budget * breaks) ** 0.5
            continue
        slowdown = evaluate(tuple(s.options[j] for s, j in zip(searches, picks)))
        if max_slowdown - 0.1 * max(max_slowdown, 0.001) <= slowdown <= max_slowdown:
            break  # uses the budget to within a tenth
        if slowdown <= max_slowdown:
            meets = budget if meets is None else max(meets, budget)
        else:
            breaks = budget if breaks is None else min(breaks, budget)
        step = budget * (1.0 + max_slowdown) / (1.0 + slowdown)
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4 * budget:
                break
            if not meets < step < breaks:
                step = (meets * breaks) ** 0.5
        budget = step
    return best


def _as_applied(
    trace: Trace, units: list[TuningUnit], settings: list[ClockSetting], validated: Measurement, validator: Validator,
    baseline: Measurement, max_slowdown: float, *, key: str,
) -> tuple[list[ClockSetting], Measurement]:  # fmt: skip
    """The per-unit settings a runtime actually applied, for the clock table.

    With switching costs the runtime realizes a schedule per phase, so some units never run at the setting the
    allocator gave them. The table then holds, per unit, the realized setting its kernels spend most time in, so
    that it says what ran (and transfers what ran); that schedule is validated in turn and kept if it meets the
    budget and still saves energy, else the allocator's settings are kept.
    """
    if not validator.switching:
        return settings, validated
    realized = validator.realize(tuple(_per_kernel_settings(trace, zip(units, settings))))
    kernel_time_s = validator.realize.kernel_time_s
    applied = []
    for unit in units:
        weights: dict[ClockSetting, float] = {}
        for i in unit.kernel_indices:
            weights[realized[i]] = weights.get(realized[i], 0.0) + float(kernel_time_s[i])
        applied.append(max(weights, key=weights.get))
    if applied == list(settings):
        return settings, validated
    measured = validator.units(units, applied, key)
    if measured.time_s / baseline.time_s - 1.0 <= max_slowdown and measured.energy_j < baseline.energy_j:
        return applied, measured
    return settings, validated


def _prediction(trace: Trace, units: list[TuningUnit], searches: list[UnitSearch], settings: list[ClockSetting],
                chosen: tuple, coarser: GranularityResult | None) -> tuple[Measurement, Measurement]:  # fmt: skip
    """What the search predicted, before validating it, for the schedule it ends with, and for the default.

    The schedule in the table is not always the allocator's pick: the coarser granularity's schedule may have
    validated better (then its own prediction stands: the same schedule, predicted from coarser units), and the
    runtime realizes settings per phase (then the units' own measurements at the realized settings, where they
    have them, are summed); otherwise the allocator's sum of its picks."""
    baseline = Measurement(sum(s.default.time_s for s in searches), sum(s.default.energy_j for s in searches))
    if coarser is not None and (_per_kernel_settings(trace, zip(units, settings))
                                == _per_kernel_settings(trace, coarser.units)):  # fmt: skip
        return coarser.predicted, coarser.predicted_baseline
    measured = [{o.setting: o for o in s.options} for s in searches]
    if all(setting in options for setting, options in zip(settings, measured)):
        chosen = tuple(options[setting] for setting, options in zip(settings, measured))
    return Measurement(sum(o.time_s for o in chosen), sum(o.energy_j for o in chosen)), baseline


def _search_granularity(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, validator: Validator,
    baseline: Measurement, on_unit, coarser: GranularityResult | None, storage,
    ideal_validator: Validator | None = None,
) -> GranularityResult:  # fmt: skip
    """Search one granularity. ``coarser``: the validated result of the next coarser clock granularity; its
    settings warm-start each unit's study and its schedule is the first candidate, so a finer granularity never
    ends worse than a coarser one (any coarser schedule is also a finer one). ``ideal_validator``: also allocate
    the budget as if switching were free, and report that schedule's validated figure as the ideal."""
    inherited = None
    if coarser is not None:
        per_kernel = _per_kernel_settings(trace, coarser.units)
        inherited = [per_kernel[u.kernel_indices[0]] for u in partition(trace, granularity)]
    measured_before = (validator.n_measurements, validator.cost_gpu_s)
    ideal_before = (ideal_validator.n_measurements, ideal_validator.cost_gpu_s) if ideal_validator else (0, 0.0)
    units, searches = run_unit_studies(trace, backend, config, granularity, storage=storage, warm_start=inherited,
                                       on_unit=on_unit)  # fmt: skip
    improves = coarser is not None and coarser.validated.energy_j < baseline.energy_j
    result = allocate_validated(units, searches, validator, baseline, config.max_slowdown,
                                rounds=config.max_validation_rounds, key=granularity,
                                first=[s or DEFAULT_SETTING for s in inherited] if improves else None)  # fmt: skip
    settings, validated = _as_applied(trace, units, [o.setting for o in result.chosen], result.validated, validator,
                                      baseline, config.max_slowdown, key=f"{granularity}-applied")  # fmt: skip
    ideal = None
    if ideal_validator is not None:  # the best schedule if switching were free, found the same way
        # Against the same baseline measurement (the default schedule has no switches to realize differently).
        ideal = allocate_validated(units, searches, ideal_validator, baseline, config.max_slowdown,
                                   rounds=config.max_validation_rounds, key=f"{granularity}-ideal",
                                   first=[s or DEFAULT_SETTING for s in inherited] if improves else None).validated
    predicted, predicted_baseline = _prediction(trace, units, searches, settings, result.chosen, coarser)
    return GranularityResult(
        granularity=granularity,
        units=tuple(zip(units, settings)),
        ideal=ideal,
        predicted=predicted,
        predicted_baseline=predicted_baseline,
        validated=validated,
        n_measurements=sum(s.n_measurements for s in searches) + validator.n_measurements - measured_before[0]
        + (ideal_validator.n_measurements - ideal_before[0] if ideal_validator else 0),
        search_cost_gpu_s=sum(s.cost_gpu_s for s in searches) + validator.cost_gpu_s - measured_before[1]
        + (ideal_validator.cost_gpu_s - ideal_before[1] if ideal_validator else 0.0),
        unit_searches=tuple(searches),
    )


def run_search(
    trace: Trace,
    backend: Backend,
    config: SearchConfig,
    *,
    on_unit: Callable[[str, int, int], None] | None = None,
    validator: Validator | None = None,
) -> SearchResult:
    """Search every granularity in ``config`` and validate each result on ``backend``.

    Args:
        trace: the iteration's kernels.
        backend: the GPU to measure on.
        config: budget, granularities, trial counts, storage.
        on_unit: called as on_unit(granularity, units_done, units_total) after each unit's study (progress).
        validator: measures whole iterations (its cache and baseline shared with the caller); default a new one
            with ``config.validation_repeats``.

    Returns:
        SearchResult with the measured baseline (all defaults) and one validated result per granularity.

    Raises:
        StorageError: the storage URL cannot be opened.
    """
    storage = open_storage(config.storage)
    prefix = study_prefix(trace, backend.spec, config.seed)
    if validator is None:
        log = validation_log(storage, prefix)
        validator = Validator(trace, backend, config.validation_repeats, switching=config.switching, log=log)
    # With switching costs in the validation, the kernel level's free-switching figure is measured beside it.
    ideal_validator = Validator(trace, backend, config.validation_repeats, log=validator.log) if validator.switching else None
    if is_persistent(storage):
        publish_job(storage, prefix, trace, backend, config.seed)
    baseline = validator.baseline()
    results: dict[str, GranularityResult] = {}
    coarser = None
    for g in GRANULARITIES:
        if g not in config.granularities:
            continue
        results[g] = _search_granularity(trace, backend, config, g, validator, baseline, on_unit,
                                         coarser if g != "power-cap" else None, storage,
                                         ideal_validator if g == "kernel" else None)  # fmt: skip
        if g != "power-cap":
            coarser = results[g]
    if is_persistent(storage):
        finish_job(storage, prefix)
    n_new = validator.log.n_new + sum(u.n_new_measurements for r in results.values() for u in r.unit_searches)
    return SearchResult(trace, backend.spec.name, config.max_slowdown, baseline, results, config.storage, n_new,
                        spec=backend.spec, backend_name=getattr(backend, "name", None), seed=config.seed)
