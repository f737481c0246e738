"""One Optuna study per tuning unit: Bayesian optimization of (time, energy) over its setting space.

The study minimizes time and energy together (a Pareto front), with Optuna's GPSampler (Gaussian-process
Bayesian optimization with log expected hypervolume improvement, Daulton et al. 2020, arXiv 2006.05078). It is
warm-started with enqueued points (the highest clocks and a spread below them). Every measurement (trials,
the default's and the finalists' repeats) is logged in the study (freqopt.search.journal), and each trial's
sampler is seeded by the trial's index, so a study in persistent storage killed at any point resumes where it
stopped, measures nothing twice, and ends as an uninterrupted study would.

Throttling: the power limit may pull a locked clock down (the effective SM clock is read back with each
measurement); the unit's measured time and energy already include it, so such settings stay options.

Noise: a single sample of each setting would let the allocator pick favourable outliers (the winner's curse
that made Spaan et al. 2026 promise 15.6 % and re-measure 14.6 %). The Pareto finalists near the default's
time are therefore re-measured and their means, not their luckiest samples, are what the allocator sees.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import optuna
import torch
from optuna.trial import TrialState

from freqopt.gpu.backends.base import Backend, ClockSetting, DEFAULT_SETTING
from freqopt.workload.kernels import Kernel
from freqopt.search.journal import MeasurementLog

__all__ = ["Option", "UnitSearch", "search_unit", "optuna_logging", "GridGPSampler", "SPACES"]

SPACES = ("clocks", "power")


@contextlib.contextmanager
def optuna_logging(verbose: bool = False) -> Iterator[None]:
    """Hold Optuna's verbosity for a block and give back the one it found (optuna.logging.get/set_verbosity).

    A search creates a study per tuning unit (hundreds at kernel level), and Optuna's default INFO level logs a
    line for each. freqopt's studies run at WARNING unless ``verbose`` asks for those lines (INFO); the caller's
    own setting is restored on exit, also on an exception, so a library call leaves a user's logging as it was.
    """
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)


class GridGPSampler(optuna.samplers.GPSampler):
    """Optuna's GPSampler whose acquisition function is maximized by evaluating it at every point of the grid.

    A unit's space is a small grid: supported SM clocks (an integer step, 15 MHz on the H100: 110 clocks) times
    at most a few memory clocks, or whole watts of power limit (at most a few hundred). GPSampler maximizes the
    acquisition (log EHVI here) over any space by scoring 2048 quasi-random points and refining ten of them by
    local search, which on these grids cost more than half of a search's time and may still miss the best
    point. Scoring every grid point in one batch is exact and cheaper: the main job's search took 50.6 s instead
    of 112.7 s, with the same result (experiments/search_speed).
    This overrides ``GPSampler._optimize_acqf``, the hook Optuna's source names for replacing the acquisition
    optimizer (optuna/samplers/_gp/sampler.py, Optuna 5.0); spaces with a continuous dimension or more than
    ``max_grid_points`` points keep Optuna's optimizer.
    """

    max_grid_points = 20_000

    def sample_relative(self, study, trial, search_space):
        """GPSampler.sample_relative on one PyTorch thread, with ``__torch_function__`` handling off
        (torch._C.DisableTorchFunction); the caller's thread count is restored after.

        Optuna limits PyTorch to one thread while it fits the kernel parameters (optuna._gp.thread_limiting) but
        not while it scores the acquisition function, whose Monte Carlo log EHVI on every grid point is
        PyTorch's largest operation here: there, on a 2-core machine, PyTorch's thread pool waited on its own
        threads far longer than it computed (the main job's acquisition and fits took 38 s of CPU with the
        default threads, 8 s on one, with the same trials and figures: experiments/search_speed).

        Optuna runs the GP under ``with torch.device("cpu")`` so that a global ``torch.set_default_device("cuda")``
        does not move its tensors (optuna/optuna#6113). That context is a TorchFunctionMode: a Python call on every
        torch operation of the fit, a quarter of the GP's time on these small matrices. With torch-function
        handling off, no mode runs and every tensor is made on the CPU, as Optuna intends; the suggestions are the
        same (a 30-trial constrained two-objective study, same seed: identical trials, 12.4 s instead of 17.2 s;
        the main job's search about 4 s shorter).
        """
        disable = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with disable():
                return super().sample_relative(study, trial, search_space)
        finally:
            torch.set_num_threads(threads)

    def _optimize_acqf(self, acqf, best_params):
        """The grid point (normalized, shape (dim,)) where ``acqf`` is highest; Optuna's search outside a grid."""
        space = acqf.search_space
        choices = space.get_choices_of_discrete_params()  # normalized values, one array per discrete dimension
        size = int(np.prod([len(c) for c in choices]))
        if len(space.continuous_indices) or space.dim == 0 or size > self.max_grid_points:
            return super()._optimize_acqf(acqf, best_params)
        grid = np.empty((size, space.dim))
        grid[:, space.discrete_indices] = np.stack(np.meshgrid(*choices, indexing="ij"), axis=-1).reshape(size, -1)
        return grid[int(np.argmax(acqf.eval_acqf_no_grad(grid)))]


@dataclass(frozen=True)
class Option:
    """A measured setting of a unit: mean time and energy per iteration over n_samples measurements, and their
    sample standard deviations (ddof 1; 0 for a single sample)."""

    setting: ClockSetting
    time_s: float
    energy_j: float
    n_samples: int
    time_sd_s: float = 0.0
    energy_sd_j: float = 0.0


@dataclass(frozen=True)
class UnitSearch:
    """What a unit's study found: its default, the options offered to the allocator, and what it cost.

    n_measurements and cost_gpu_s count every measurement behind the result, including those a killed run took
    and this one read back from storage; n_new_measurements counts only those this call took, and
    n_stored_measurements those it read back from what the storage held before (MeasurementLog.n_stored).
    readings holds every setting the study measured, dominated ones too, each averaged over its readings, in
    order of time (a phase block's fit uses them all: freqopt.search.smooth)."""

    name: str
    study_name: str
    default: Option
    options: tuple[Option, ...]
    n_measurements: int
    cost_gpu_s: float
    n_new_measurements: int = 0
    n_stored_measurements: int = 0
    readings: tuple[Option, ...] = ()


def _pareto_front(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials not dominated in (time, energy) by another."""
    return [
        t for t in trials
        if not any(o.values[0] <= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values for o in trials)
    ]  # fmt: skip


def _stalled(trials: list[optuna.trial.FrozenTrial], n_first: int, limit_s: float, patience: int) -> bool:
    """Whether the last ``patience`` complete trials after the first ``n_first`` (the enqueued warm starts) all
    failed to improve the Pareto front within ``limit_s``: none of them was within the limit and undominated by
    every earlier trial within it. Computed from the study's history alone, so a resumed study stops where an
    uninterrupted one would."""
    complete = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.number)
    if len(complete) < n_first + patience:
        return False
    for j in range(len(complete) - patience, len(complete)):
        t, e = complete[j].values
        if t <= limit_s and not any(o.values[0] <= t and o.values[1] <= e
                                    for o in complete[:j] if o.values[0] <= limit_s):  # fmt: skip
            return False
    return True


def _is_progression(values: Sequence[int]) -> bool:
    steps = {b - a for a, b in zip(values, values[1:])}
    return len(steps) <= 1


def setting_tag(setting: ClockSetting) -> str:
    """The measurement log's name for a setting of a unit."""
    return f"{setting.sm_clock_mhz}/{setting.mem_clock_mhz}/{setting.power_limit_w}"


def _whole_watts(spec) -> tuple[int, int]:
    """The lowest and highest power limits, in whole watts, within the GPU's range (the power space's grid)."""
    return int(np.ceil(spec.power_limit_min_w)), int(np.floor(spec.power_limit_max_w))


class _Objective:
    """Maps a trial to a supported setting and measures settings through the unit's measurement log."""

    def __init__(self, backend: Backend, kernels: Sequence[Kernel], key: str, space: str, log: MeasurementLog,
                 whole_step: bool = False, mem_clock_mhz: int | None = None):  # fmt: skip
        self.backend, self.kernels, self.key, self.space, self.log = backend, kernels, key, space, log
        self.whole_step, self.mem_clock_mhz = whole_step, mem_clock_mhz
        spec = backend.spec
        self.sm_clocks = np.asarray(spec.sm_clocks_mhz)
        self.samples: dict[ClockSetting, list[tuple[float, float]]] = defaultdict(list)
        self.n_measurements = 0
        self._costs_gpu_s: list[float] = []

    @property
    def cost_gpu_s(self) -> float:
        """GPU-seconds of every measurement taken or read back, summed exactly (math.fsum): a resumed study reads
        its measurements back in another order than it took them, and must report the same total."""
        return math.fsum(self._costs_gpu_s)

    def suggest(self, trial: optuna.Trial) -> ClockSetting | None:
        spec = self.backend.spec
        if self.space == "power":
            lo, hi = _whole_watts(spec)
            return ClockSetting(power_limit_w=float(trial.suggest_int("power_limit_w", lo, hi)))
        clocks = spec.sm_clocks_mhz
        if _is_progression(clocks):
            sm = trial.suggest_int("sm_clock_mhz", clocks[0], clocks[-1], step=clocks[1] - clocks[0])
        else:  # V100: alternating 7/8 MHz steps; snap to the nearest supported clock
            wanted = trial.suggest_int("sm_clock_mhz", clocks[0], clocks[-1])
            sm = int(self.sm_clocks[np.argmin(np.abs(self.sm_clocks - wanted))])
        mem = spec.mem_clocks_mhz[0] if self.mem_clock_mhz is None else self.mem_clock_mhz
        if len(spec.mem_clocks_mhz) > 1 and self.mem_clock_mhz is None:
            # An ordinal index, not a categorical: bandwidth and power rise with the memory clock, so the GP may
            # model it as a dimension, and Optuna's acquisition search over a categorical costs 10-40x more per trial.
            mem = spec.mem_clocks_mhz[trial.suggest_int(MEM_CLOCK_INDEX, 0, len(spec.mem_clocks_mhz) - 1)]
        if not spec.supports(sm, mem):  # above what this memory clock allows: the highest SM clock it does allow
            allowed = self.sm_clocks[self.sm_clocks <= spec.max_sm_clock_for_mem_mhz.get(mem, spec.max_sm_clock_mhz)]
            if not len(allowed) or not spec.supports(int(allowed[-1]), mem):
                return None
            sm = int(allowed[-1])
        return ClockSetting(sm_clock_mhz=int(sm), mem_clock_mhz=int(mem))

    def measure(self, setting: ClockSetting) -> tuple[float, float]:
        """The next sample of ``setting`` (read back from the log if a killed run already took it)."""
        m = self.log.measure(setting_tag(setting), len(self.samples[setting]), lambda i: self._take(setting, i))
        self.samples[setting].append((m.time_s, m.energy_j))
        self.n_measurements += 1
        self._costs_gpu_s.append(m.cost_gpu_s)
        return m.time_s, m.energy_j

    def _take(self, setting: ClockSetting, sample: int):
        """Measure sample ``sample`` of ``setting`` on the GPU: the unit's kernels replayed, or, for a unit that is
        the whole iteration, the training step itself as validation measures it (Backend.measure_schedule)."""
        if self.whole_step:
            return self.backend.measure_schedule(self.kernels, [setting] * len(self.kernels), key=self.key,
                                                 sample=sample)  # fmt: skip
        return self.backend.measure(self.kernels, setting, key=self.key, sample=sample)

    def first(self, setting: ClockSetting) -> tuple[float, float]:
        """The first sample of ``setting``, measured if there is none: a trial repeating a setting costs nothing."""
        return self.samples[setting][0] if self.samples[setting] else self.measure(setting)

    def option(self, setting: ClockSetting) -> Option:
        samples = np.asarray(self.samples[setting])  # (n, 2): time_s, energy_j
        t, e = samples.mean(axis=0)
        sd_t, sd_e = samples.std(axis=0, ddof=1) if len(samples) > 1 else (0.0, 0.0)
        return Option(setting, float(t), float(e), len(samples), float(sd_t), float(sd_e))


MEM_CLOCK_INDEX = "mem_clock_index"  # the trial parameter: index into GPUSpec.mem_clocks_mhz (ascending)


def _params(setting: ClockSetting, backend: Backend, space: str, mem_fixed: bool = False) -> dict:
    """enqueue_trial parameters of a setting (no memory-clock index where the memory clock is fixed)."""
    if space == "power":
        return {"power_limit_w": int(round(setting.power_limit_w))}
    point = {"sm_clock_mhz": setting.sm_clock_mhz}
    if len(backend.spec.mem_clocks_mhz) > 1 and not mem_fixed:
        point[MEM_CLOCK_INDEX] = backend.spec.mem_clocks_mhz.index(setting.mem_clock_mhz)
    return point


def _warm_start_points(backend: Backend, space: str, mem_fixed: bool = False) -> list[dict]:
    """The highest setting and four below it (96 %, 90 %, 75 %, 60 % of the range), as enqueue_trial parameters:
    the top of the range, where tight budgets are met, is sampled before the GP takes over."""
    spec = backend.spec
    fractions = (1.0, 0.96, 0.9, 0.75, 0.6)
    if space == "power":
        lo, hi = spec.power_limit_min_w, spec.power_limit_max_w
        return [{"power_limit_w": int(round(lo + f * (hi - lo)))} for f in fractions]
    clocks = spec.sm_clocks_mhz
    points = []
    for f in fractions:
        sm = clocks[int(round(f * (len(clocks) - 1)))]
        point = {"sm_clock_mhz": sm}
        if len(spec.mem_clocks_mhz) > 1 and not mem_fixed:
            point[MEM_CLOCK_INDEX] = len(spec.mem_clocks_mhz) - 1
        points.append(point)
    return points


def _tracks(objective: _Objective, space: str) -> list[list[ClockSetting]]:
    """The unit's settings as tracks along which a step's time falls monotonically, slowest first: per memory clock
    (the highest first), its supported SM clocks in ascending order; or the power limits in whole watts."""
    spec = objective.backend.spec
    if space == "power":
        lo, hi = _whole_watts(spec)
        return [[ClockSetting(power_limit_w=float(w)) for w in range(lo, hi + 1)]]
    mems = [objective.mem_clock_mhz] if objective.mem_clock_mhz is not None else spec.mem_clocks_mhz
    return [[ClockSetting(int(c), mem) for c in objective.sm_clocks if spec.supports(int(c), mem)]
            for mem in sorted(mems, reverse=True)]  # fmt: skip


def _budget_edges(objective: _Objective, space: str, limit_s: float) -> list[ClockSetting]:
    """On each track (_tracks) whose fastest setting meets ``limit_s``: the slowest setting that meets it and the
    next slower one, found by bisection between the unit's measured settings on that track (first readings).

    A step's time falls monotonically as a clock or the power limit rises, so on each track the settings within a
    time budget are an interval up to its fastest, and the least energy within it (for a budget of a few percent,
    above the energy-optimal clock) lies at its slow end. Tracks are walked from the fastest memory clock down,
    and the walk stops at the first whose fastest setting breaks the budget (slower memory is slower still). The
    memory clock's own saving at the edge (a few tenths of a percent on GDDR6X) is of the order of one reading's
    noise, so a GP left to itself may never measure the edge at the memory clock that saves most (on
    gpt3-xl on the RTX 3080 Ti, SM 2085 MHz at memory 9251 against 9501), nor the power limit at the edge (the
    main job's, 640 W). A time reading's noise (0.2 %) is small against one SM clock step's effect (0.7 % there),
    so first readings locate the edge.
    """
    edges = []
    for track in _tracks(objective, space):
        if not track or objective.first(track[-1])[0] > limit_s:
            break
        measured = {i: objective.samples[s][0][0] for i, s in enumerate(track) if objective.samples.get(s)}
        lo = max((i for i, t in measured.items() if t > limit_s), default=-1)  # fastest known to break the budget
        hi = min(i for i, t in measured.items() if t <= limit_s and i > lo)  # slowest above it known to meet it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if objective.first(track[mid])[0] <= limit_s:
                hi = mid
            else:
                lo = mid
        edges += [track[i] for i in (hi, lo) if i >= 0]
    return edges


def search_unit(
    backend: Backend,
    kernels: Sequence[Kernel],
    *,
    name: str,
    study_name: str,
    storage: optuna.storages.BaseStorage | str | None,
    space: str = "clocks",
    n_trials: int = 16,
    finalist_repeats: int = 2,
    finalist_slowdown: float = 0.05,
    seed: int = 0,
    warm_start: Sequence[ClockSetting] = (),
    constrained: bool = False,
    spread: bool = True,
    whole_step: bool = False,
    mem_clock_mhz: int | None = None,
    patience: int | None = None,
    edge_slowdown: float | None = None,
) -> UnitSearch:
    """Run (or resume) one unit's study and return its options for the allocator.

    Args:
        backend: the GPU to measure on.
        kernels: the unit's kernels in one iteration.
        name: the unit's name (also the key of its measurement noise).
        study_name: the Optuna study's name in ``storage``.
        storage: Optuna storage (URL or object); None keeps the study in memory.
        space: "clocks" (sm_clock_mhz, and mem_clock_mhz where the GPU has several) or "power" (power_limit_w).
        n_trials: trials of the study in total (a resumed study runs only the missing ones).
        finalist_repeats: extra measurements of each Pareto point within ``finalist_slowdown`` of the default.
        finalist_slowdown: fractional slowdown, relative to the default, below which Pareto points are finalists.
        seed: the sampler's seed.
        warm_start: settings known to be good (a coarser granularity's choice, a previous table): enqueued first
            and always offered to the allocator.
        spread: also enqueue the top of the range and a spread below it (off for a unit whose warm starts come
            from a kernel class like it, which already span its useful range).
        constrained: sample only where the unit is within ``finalist_slowdown`` of its default (a constraint of
            Optuna's GPSampler, Trial.set_constraint): for a unit that is the whole iteration, whose options beyond
            the budget are useless, so that its trials crowd the budget's edge. It costs GP time (a second model),
            so units of finer granularities, which trade slowdown among themselves, sample the whole front.
        whole_step: the unit is the whole iteration: each measurement is the training step with the setting
            throughout (Backend.measure_schedule, issued as a training loop issues it, host included), the step
            validation measures, not a replay loop of its kernels (in which a launch-bound step's host gaps vanish).
        mem_clock_mhz: search the SM clock alone at this memory clock (a GPU whose memory clock is set per job,
            not while it runs: GPUSpec.mem_clock_runtime); None: the memory clock is a dimension where the GPU
            has several. Warm-start settings are taken as given.
        patience: stop before ``n_trials`` once this many trials in a row, after the warm starts, added nothing to
            the Pareto front within ``finalist_slowdown`` of the default (_stalled): the region the allocator
            chooses from has stopped moving, and further trials would not change its choice. None:
            always ``n_trials``.
        edge_slowdown: the budget (a fraction of the default's time) a unit that is the whole iteration is held
            to: after the study, the budget's edge at each memory clock (or in power limit) is measured and
            offered to the allocator (_budget_edges). None: not searched for (units that trade slowdown among
            themselves).

    Returns:
        UnitSearch whose options are the default and the study's Pareto front, finalists averaged.
    """
    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}")
    fixed = mem_clock_mhz is not None
    warm = [_params(s, backend, space, fixed) for s in warm_start] + (_warm_start_points(backend, space, fixed)
                                                                      if spread else [])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(study_name=study_name, storage=storage, directions=["minimize", "minimize"],
                                    load_if_exists=True)  # fmt: skip
        log = MeasurementLog(study)
        objective = _Objective(backend, kernels, name, space, log, whole_step, mem_clock_mhz)
        _resume(study, objective)
        # The default first: its mean time bounds the region worth sampling (when constrained).
        for _ in range(1 + finalist_repeats - len(objective.samples[DEFAULT_SETTING])):
            objective.measure(DEFAULT_SETTING)
        limit_s = objective.option(DEFAULT_SETTING).time_s * (1.0 + finalist_slowdown)

        _run_trials(study, objective, warm, n_trials=n_trials, patience=patience, limit_s=limit_s, seed=seed,
                    constrained=constrained)  # fmt: skip
        pareto = _offered(study, objective, space, warm_start, edge_slowdown)

    default = objective.option(DEFAULT_SETTING)
    _repeat_finalists(objective, pareto, default, finalist_repeats, finalist_slowdown)
    options = (default,) + tuple(sorted((objective.option(s) for s in pareto), key=lambda o: o.time_s))
    readings = tuple(sorted((objective.option(s) for s, v in objective.samples.items() if v), key=lambda o: o.time_s))
    return UnitSearch(name, study_name, default, options, objective.n_measurements, objective.cost_gpu_s, log.n_new,
                      log.n_stored, readings)  # fmt: skip


def _resume(study: optuna.Study, objective: _Objective) -> None:
    """Resume ``study``. A trial left running by a killed run is failed; its measurement, if it finished, is in the
    log and the trial asked in its place (same index, same seed, same history) reads it back. Each complete trial's
    first reading is read back from the log."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        objective.first(ClockSetting(*trial.user_attrs["setting"]))


def _run_trials(study: optuna.Study, objective: _Objective, warm: list[dict], *, n_trials: int,
                patience: int | None, limit_s: float, seed: int, constrained: bool) -> None:  # fmt: skip
    """Ask and tell ``study``'s trials until ``n_trials`` are done (complete or pruned) or, with ``patience``, the
    study has stalled (_stalled): the ``warm`` points (Optuna parameters) enqueued first; with ``constrained``,
    each trial's time held to ``limit_s``, s (search_unit's arguments)."""
    while True:
        trials = study.get_trials(deepcopy=False)  # one read of the storage per trial
        states = [t.state for t in trials]
        done = states.count(TrialState.COMPLETE) + states.count(TrialState.PRUNED)
        if done >= n_trials or (patience and _stalled(trials, len(warm), limit_s, patience)):
            break
        # A fresh sampler per trial, seeded by the trial's index: the n-th suggestion depends only on the
        # study's history, not on how many processes the search took to get there.
        trial_seed = zlib.crc32(f"{seed}:{done}".encode())
        study.sampler = GridGPSampler(seed=trial_seed, n_startup_trials=len(warm), deterministic_objective=False)
        if done < len(warm) and TrialState.WAITING not in states:
            study.enqueue_trial(warm[done])
        trial = study.ask()
        setting = objective.suggest(trial)
        if setting is None:  # a clock pair the GPU does not support
            study.tell(trial, state=TrialState.PRUNED)
            continue
        trial.set_user_attr("setting", [setting.sm_clock_mhz, setting.mem_clock_mhz, setting.power_limit_w])
        values = objective.first(setting)
        if constrained:  # feasible (<= 0): within the limit; constrained LogEHVI samples where that holds
            trial.set_constraint("within_limit", values[0] / limit_s - 1.0)
        study.tell(trial, values)


def _offered(study: optuna.Study, objective: _Objective, space: str, warm_start: Sequence[ClockSetting],
             edge_slowdown: float | None) -> set[ClockSetting]:  # fmt: skip
    """The settings offered to the allocator beside the default: the study's Pareto front, the warm starts and,
    with ``edge_slowdown``, the budget's edges (_budget_edges), each measured at least once."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    pareto = {ClockSetting(*t.user_attrs["setting"]) for t in _pareto_front(complete)}
    extra = list(warm_start)
    if edge_slowdown is not None:
        extra += _budget_edges(objective, space, objective.option(DEFAULT_SETTING).time_s * (1.0 + edge_slowdown))
    for setting in extra:
        objective.first(setting)
        pareto.add(setting)
    return pareto


def _repeat_finalists(objective: _Objective, pareto: set[ClockSetting], default: Option, finalist_repeats: int,
                      finalist_slowdown: float) -> None:  # fmt: skip
    """Measure each finalist (a setting of ``pareto`` within ``finalist_slowdown`` of the ``default``'s time)
    ``finalist_repeats`` more times, fastest first, so that the allocator sees means, not lucky samples."""
    for setting in sorted(pareto, key=lambda s: objective.option(s).time_s):
        if objective.option(setting).time_s <= default.time_s * (1 + finalist_slowdown):
            for _ in range(finalist_repeats):
                objective.measure(setting)
