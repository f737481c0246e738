"""Each granularity's unit studies: the trace partitioned into tuning units (search_units), and each unit's study
run or resumed, in this process, in joblib processes, or by ``freqopt worker`` processes sharing the storage
(freqopt.search.workers); with what a unit's study is given: its trials, its slack, its memory clock and its warm
starts.
"""

from __future__ import annotations

from collections.abc import Callable

from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING
from freqopt.workload.kernels import Trace
from freqopt.search.allocation import coarser_settings
from freqopt.search.config import SearchConfig
from freqopt.search.realize import phase_leaders
from freqopt.search.result import GranularityResult
from freqopt.search.storage import storage_here, study_prefix
from freqopt.search.study import UnitSearch
from freqopt.search.units import TuningUnit, search_units
from freqopt.search.workers import UnitQueue, UnitWork, is_persistent, run_unit

__all__ = ["run_unit_studies", "job_mem_clock_mhz"]


def unit_slack(max_slowdown: float, n_units: int) -> float:
    """How much slower than its default a unit's options may be (the region its study samples, and where its
    finalists are re-measured). A lone unit (the whole iteration) can only ever spend the budget, plus timing
    noise; one of many may spend more where others spend less."""
    return 1.5 * max_slowdown + 0.005 if n_units == 1 else max(0.05, 3 * max_slowdown)


def _unit_task(trace: Trace, backend: Backend, work: UnitWork, i: int, unit: TuningUnit, storage, url: str | None,
               queue_name: str | None, warm: list[ClockSetting], verbosity: int) -> tuple[int, UnitSearch | None]:  # fmt: skip
    """One unit as a joblib task: claimed from the queue first when the storage is shared (None: a worker has it).
    ``verbosity`` is the calling process's Optuna verbosity, which joblib's worker processes do not inherit."""
    import optuna

    optuna.logging.set_verbosity(verbosity)
    if storage is None and url is not None:
        storage = storage_here(url)
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
    import optuna
    from joblib import Parallel, delayed

    queue = UnitQueue.create(storage, work, which, warm) if is_persistent(storage) else None
    parallel = config.n_jobs > 1
    tasks = (delayed(_unit_task)(trace, backend, work, i, units[i], None if parallel else storage,
                                 config.storage if parallel else None, queue.name if queue else None, w,
                                 optuna.logging.get_verbosity())
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


def job_mem_clock_mhz(spec, n_units: int) -> int | None:
    """The memory clock the units of a granularity with ``n_units`` units are searched at: None (searched, a
    dimension) where the GPU can change its memory clock while a job runs (GPUSpec.mem_clock_runtime) or the unit
    is the whole iteration (one setting for the job); else the GPU's highest, its default (on
    such a GPU the memory clock is a per-job setting, so a finer schedule may not change it)."""
    if n_units == 1 or len(spec.mem_clocks_mhz) == 1 or spec.mem_clock_runtime:
        return None
    return max(spec.mem_clocks_mhz)


def at_job_mem_clock(settings, mem_clock_mhz: int | None) -> bool:
    """Every setting keeps the job's memory clock (always, where the memory clock is searched)."""
    return mem_clock_mhz is None or all(s is None or s.mem_clock_mhz in (None, mem_clock_mhz) for s in settings)


def trials_per_unit(config: SearchConfig, backend: Backend, space: str, mem_searched: bool = True) -> int:
    """Trials per unit: config.n_trials_1d, and more where the memory clock is a second dimension."""
    n_mem = len(backend.spec.mem_clocks_mhz) if space == "clocks" and mem_searched else 1
    if n_mem > 1:
        return config.n_trials_2d or config.n_trials_1d + config.n_trials_per_mem_clock * (n_mem - 1)
    return config.n_trials_1d


def _unsearched(trace: Trace, units: list[TuningUnit], kernel_time_s) -> tuple[str, ...]:
    """The names of the units a phase-switching runtime never gives their own setting (realize.phase_leaders;
    none without ``kernel_time_s``, or for a single unit)."""
    if kernel_time_s is None or len(units) < 2:
        return ()
    leaders = phase_leaders(trace.meta.get("marks", ()), units, kernel_time_s)
    return tuple(u.name for j, u in enumerate(units) if j not in leaders)


def run_unit_studies(
    trace: Trace, backend: Backend, config: SearchConfig, granularity: str, *, storage=None,
    warm_start: list[ClockSetting | None] | None = None, on_unit: Callable[[str, int, int], None] | None = None,
    kernel_time_s=None,
) -> tuple[list[TuningUnit], list[UnitSearch]]:  # fmt: skip
    """Partition the trace (search_units) and run (or resume) each tuning unit's study.

    Kernel level, with ``config.share_classes``: each family of kernel classes (kernel_families: kind, group
    size and arithmetic intensity) is one unit, with one study and one setting (11 studies in place of
    gpt3-small's 54 classes).

    With a storage other processes can see, the units are a queue that ``freqopt worker`` processes join
    (freqopt.search.workers); units they ran are read back from the storage, units whose worker died are resumed
    here. ``config.n_jobs`` > 1 runs this process's share in that many joblib processes.

    Args:
        warm_start: per unit (of search_units), a setting, or a list of settings, to enqueue first and always
            offer (the coarser granularities' choices).
        kernel_time_s: every kernel's time at the default setting, shape (K,), s, where a phase-switching runtime
            realizes the schedule (Validator.kernel_time_s, with switching costs): units that lead no phase
            (realize.phase_leaders) are then not searched, only measured at their warm starts. None:
            every unit is searched.

    Returns:
        The units and, per unit, its study's outcome (in unit order, whoever ran it).
    """
    share = config.share_classes and granularity == "kernel"
    units = search_units(trace, granularity, share)
    space = "power" if granularity == "power-cap" else "clocks"
    mem = job_mem_clock_mhz(backend.spec, len(units)) if space == "clocks" else None
    work = UnitWork(
        prefix=study_prefix(trace, backend.spec, config.seed), granularity=granularity, space=space,
        n_trials=trials_per_unit(config, backend, space, mem is None), finalist_repeats=config.finalist_repeats,
        finalist_slowdown=unit_slack(config.max_slowdown, len(units)), seed=config.seed, constrained=len(units) == 1,
        whole_step=len(units) == 1, mem_clock_mhz=mem, share_families=share, patience=config.patience,
        edge_slowdown=config.max_slowdown if len(units) == 1 else None,
        unsearched=_unsearched(trace, units, kernel_time_s),
    )  # fmt: skip
    inherited = []  # per unit: its warm settings, without the default (every study measures it), repeats, or
    for w in warm_start or [None] * len(units):  # another memory clock than the job's where that is fixed
        settings = w if isinstance(w, (list, tuple)) else [w]  # ClockSetting is a dataclass, not a tuple
        inherited.append([x for x in dict.fromkeys(settings)
                          if x not in (None, DEFAULT_SETTING) and at_job_mem_clock([x], mem)])  # fmt: skip
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        if on_unit:
            on_unit(granularity, done, len(units))

    results = _run_units(trace, backend, config, work, units, list(range(len(units))), inherited, storage, progress)
    return units, [results[i] for i in range(len(units))]


def warm_starts(trace: Trace, coarser: list[GranularityResult], units: list[TuningUnit],
                 schedules: list[list[ClockSetting]], kernel_time_s=None) -> list[list[ClockSetting]]:  # fmt: skip
    """Per unit, the settings its study starts from: the nearest coarser level's (even when it saved nothing),
    then each of ``schedules``' (one setting per unit); see run_unit_studies's ``warm_start``."""
    warm = [[c[i] for c in schedules] for i in range(len(units))]
    if coarser:
        warm = [[s, *w] for s, w in zip(coarser_settings(trace, coarser[-1], units, kernel_time_s), warm)]
    return warm
