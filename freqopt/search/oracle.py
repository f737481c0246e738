"""The oracle and the benchmark: an exhaustive sweep of every tuning unit at every supported setting, on the
simulated GPU, against which the Bayesian search is measured.

The oracle measures each unit at every supported (SM clock, memory clock) pair without noise (the simulated GPU's
true values), and charges for each the GPU-seconds a real sweep would spend on it (the backend's measurement
protocol: warm-up plus a window of several energy-counter updates), as Spaan et al. 2026 spent about 3 GPU-days.
It sweeps every kind of schedule the search may end on at a granularity (one clock for the iteration, one per
pass, one per phase block, one per kernel class: oracle_search), judges each on its noiseless step, and keeps the
best that the search's own validation accepts, so the two validated savings compare like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting, Measurement
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.workload.kernels import Trace
from freqopt.search.config import SearchConfig
from freqopt.search.result import SearchResult
from freqopt.search.runner import job_mem_clock_mhz, run_search
from freqopt.search.study import Option, UnitSearch
from freqopt.search.units import GRANULARITIES, partition
from freqopt.search.validate import Validator, per_kernel_settings

__all__ = ["OracleResult", "oracle_search", "BenchmarkResult", "benchmark", "noiseless_figures", "noiseless_saved_pct"]


@dataclass(frozen=True)
class OracleResult:
    """The exhaustive sweep's validated result at one granularity.

    Attributes:
        energy_saved_pct, slowdown_pct: the allocated schedule measured on the whole iteration, against the
            baseline.
        n_measurements: unit measurements a real sweep makes (every unit at every supported setting and at the
            default) plus the validations.
        search_cost_gpu_s: their GPU-seconds.
        true_energy_saved_pct, true_slowdown_pct: the same schedule's noiseless saving and slowdown
            (noiseless_figures).
        level: the level whose schedule the sweep ended on (iteration, pass, phase or kernel: oracle_search);
            None where it kept the defaults.
    """

    energy_saved_pct: float
    slowdown_pct: float
    n_measurements: int
    search_cost_gpu_s: float
    true_energy_saved_pct: float | None = None
    true_slowdown_pct: float | None = None
    level: str | None = None


def noiseless_figures(validator: Validator, validated: Measurement) -> tuple[float, float] | None:
    """The noiseless saving and slowdown (%) of the schedule behind ``validated``, one of ``validator``'s own
    measurements: the simulated GPU's step (SimulatedGPU.step, switching as the validator measured) with that
    schedule against its step at the defaults. A validated saving carries the noise of a few energy readings
    (0.5 % each), which is of the order of a 1 % budget's whole saving, and a validated slowdown that of a few time
    readings (0.2 % each): two schedules compare like with like only without it, and only without it does a
    slowdown say whether the budget was truly met. None when ``validated`` is not one of ``validator``'s
    measurements."""
    schedule = validator.schedule_of(validated)
    if schedule is None:
        return None
    backend, kernels = validator.backend, validator.trace.kernels
    measured = backend.step(kernels, list(schedule), switching=validator.switching)
    default = backend.step(kernels)
    return 100.0 * (1.0 - measured.energy_j / default.energy_j), 100.0 * (measured.time_s / default.time_s - 1.0)


def noiseless_saved_pct(validator: Validator, validated: Measurement) -> float | None:
    """The noiseless saving (%) of the schedule behind ``validated`` (noiseless_figures), or None."""
    figures = noiseless_figures(validator, validated)
    return None if figures is None else figures[0]


# The budgets each level's exact allocation is solved at, as multiples of the slowdown budget over the units' own
# defaults (the phase level: of the reference schedule's slack): the units' sum and the step as a runtime realizes it
# differ, so the sweep allocates over a range of budgets and judges each schedule on its own noiseless step.
BUDGET_FACTORS = tuple(0.1 * i for i in range(1, 31))
# The phase level's budgets: the reference schedule's slack within the budget plus these multiples of the slowdown
# budget. Blocks changed together slow the step more than their changes measured one at a time add up to (each
# change brings its own switches), so most of the range lies below the slack.
PHASE_BUDGET_FACTORS = tuple(0.05 * i for i in range(-80, 21))


def oracle_search(trace: Trace, backend: SimulatedGPU, config: SearchConfig, granularity: str = "kernel",
                  validator: Validator | None = None) -> OracleResult:  # fmt: skip
    """The exhaustive counterpart of a search at ``granularity``: every kind of schedule that search may end on,
    swept without noise, and the best that its validation accepts.

    A search at a granularity ends on the best of its own allocation and of the coarser schedules it chooses among
    (freqopt.search.runner.CANDIDATES: one clock for the iteration, one per pass, one per phase block where clock
    switches cost time), so the sweep's candidates are, coarse to fine:

    - iteration: one clock pair for the whole step, at every supported pair;
    - pass and kernel: each unit measured at every supported pair (the job's memory clock where the GPU sets it
      per job), allocated exactly over all units (freqopt.search.allocate's MILP) at each budget of
      BUDGET_FACTORS;
    - phase (the kernel level's candidate, with switching costs and more than one block): the phase level's blocks
      each changed alone from the best confirmed one-clock schedule (as the phase level starts from the iteration
      level's clock) at every supported SM clock, on the whole step, allocated the same way at each budget of
      PHASE_BUDGET_FACTORS.

    Every candidate is judged on its noiseless step as a runtime requests it (SimulatedGPU.step, switching as
    the validator measures). Those within the budget that save energy are validated least noiseless energy first
    as the search validates its own (held to the budget at the validator's confidence, deliverable, then confirmed
    on fresh readings: Validator.confirm), and the first accepted is the result: the least noiseless energy of
    every candidate the search's validation accepts. A candidate at the budget's very edge is seldom accepted (its
    upper bound lies over it), so the next is tried. The work is bounded by the candidates: the clock pairs, and
    len(BUDGET_FACTORS) allocations per level, each validated at most once.

    Args:
        trace: the iteration's kernels.
        backend: the simulated GPU (its true values are the sweep's measurements).
        config: the budget (max_slowdown), switching, validation and phase-block settings the search used.
        granularity: iteration, pass or kernel.
        validator: share the search's, so both see one baseline measurement; default a new one for ``config``.

    Returns:
        OracleResult; ``level`` names the level whose candidate it ended on (None where it kept the defaults).
    """
    spec = backend.spec
    validator = validator or Validator.for_search(trace, backend, config)
    before = (validator.n_measurements, validator.cost_gpu_s)  # the baseline's readings included, as a search's
    baseline = validator.baseline()
    count = [0, 0.0]  # the sweep's own measurements and GPU-seconds

    def charge(measurements) -> None:  # each as a real sweep spends it: whole replay loops over warm-up and window
        for m in measurements:
            count[0] += 1
            count[1] += backend.protocol.cost_gpu_s(spec.energy_counter_period_s, m.time_s)

    candidates = _Candidates(trace, backend, validator, baseline, config.max_slowdown)
    uniform = [ClockSetting(sm, mem) for sm, mem in spec.clock_pairs()]
    charge([candidates.add("iteration", tuple([s] * len(trace)), requested=True) for s in uniform])
    best = candidates.first_accepted()  # the best confirmed one clock: the phase level's reference
    levels = [g for g in ("pass", "kernel") if GRANULARITIES.index(g) <= GRANULARITIES.index(granularity)]
    for g in levels:
        units = partition(trace, g)
        searches = _unit_sweeps(trace, backend, units, charge)
        options = [[(o.time_s, o.energy_j) for o in u.options] for u in searches]
        budget_s = sum(u.default.time_s for u in searches)
        for factor in BUDGET_FACTORS:
            picks = _allocate(options, budget_s * (1.0 + factor * config.max_slowdown))
            if picks is not None:
                settings = [u.options[j].setting for u, j in zip(searches, picks)]
                candidates.add(g, tuple(per_kernel_settings(trace, zip(units, settings))))
        if g == "kernel" and validator.switching:
            reference = best[0][0] if best else DEFAULT_SETTING
            for schedule in _phase_schedules(trace, backend, config, reference, charge):
                candidates.add("phase", schedule, requested=True)
    best = candidates.first_accepted()
    if best is None:
        validated, level, true = baseline, None, (0.0, 0.0)
    else:
        _, validated, level = best
        true = noiseless_figures(validator, validated)
    return OracleResult(
        energy_saved_pct=100.0 * (1.0 - validated.energy_j / baseline.energy_j),
        slowdown_pct=100.0 * (validated.time_s / baseline.time_s - 1.0),
        n_measurements=count[0] + validator.n_measurements - before[0],
        search_cost_gpu_s=count[1] + validator.cost_gpu_s - before[1],
        true_energy_saved_pct=true[0], true_slowdown_pct=true[1], level=level,
    )


class _Candidates:
    """The sweep's candidate schedules, each as a runtime requests it, with its noiseless step; validated least
    noiseless energy first (first_accepted)."""

    def __init__(self, trace: Trace, backend: SimulatedGPU, validator: Validator, baseline: Measurement,
                 max_slowdown: float):  # fmt: skip
        self.trace, self.backend, self.validator, self.baseline = trace, backend, validator, baseline
        self.default = backend.step(trace.kernels)
        self.max_slowdown = max_slowdown
        self.steps: dict[tuple, tuple[Measurement, str]] = {}  # requested schedule -> (noiseless step, level)
        self.rejected: set[tuple] = set()  # validated and not accepted
        self.best: tuple | None = None  # (requested schedule, confirmed measurement, level)

    def add(self, level: str, schedule: tuple, *, requested: bool = False) -> Measurement:
        """Add the per-kernel ``schedule`` (shape (K,); ``requested``: already as a runtime requests it, else
        realized as the validator realizes it) found at ``level``, the coarsest level first; its noiseless step."""
        v = self.validator
        if not requested and v.switching:
            schedule = v.realize.requests(schedule)
        if schedule not in self.steps:
            self.steps[schedule] = (self.backend.step(self.trace.kernels, list(schedule), switching=v.switching),
                                    level)  # fmt: skip
        return self.steps[schedule][0]

    def first_accepted(self) -> tuple | None:
        """The candidate of least noiseless energy that the search's validation accepts, as (requested schedule,
        its confirmed Measurement, level), trying every candidate within the budget without noise that saves
        energy, least noiseless energy first, until one is; None where none is (each is validated once)."""
        v, limit_s = self.validator, (1.0 + self.max_slowdown) * self.baseline.time_s
        order = sorted(((m.energy_j, schedule) for schedule, (m, _) in self.steps.items()
                        if m.time_s <= (1.0 + self.max_slowdown) * self.default.time_s
                        and m.energy_j < self.default.energy_j), key=lambda x: x[0])  # fmt: skip
        for energy_j, schedule in order:
            if self.best is not None and energy_j >= self.steps[self.best[0]][0].energy_j:
                break
            if schedule in self.rejected:
                continue
            measured = v.requests(schedule, f"oracle-{self.steps[schedule][1]}", limit_s=limit_s)
            if v.accepts(measured, limit_s, self.baseline.energy_j):
                fresh = v.confirm(measured)
                if v.accepts(fresh, limit_s, self.baseline.energy_j, fresh=True):
                    self.best = (schedule, fresh, self.steps[schedule][1])
                    break
            self.rejected.add(schedule)
        return self.best


def _allocate(options, budget_s: float) -> list[int] | None:
    """freqopt.search.allocate.allocate, or None where no choice meets ``budget_s``."""
    from freqopt.errors import InvalidSettingError
    from freqopt.search.allocate import allocate

    try:
        return allocate(options, budget_s)
    except InvalidSettingError:
        return None


def _unit_sweeps(trace: Trace, backend: SimulatedGPU, units: list, charge) -> list[UnitSearch]:
    """Each unit measured without noise (SimulatedGPU.true_measure) at the defaults and at every supported pair
    (every SM clock at the job's memory clock where the GPU sets that per job: job_mem_clock_mhz), as UnitSearch
    outcomes the allocator takes; each measurement charged (``charge``) as a real sweep would spend it."""
    spec = backend.spec
    job_mem = job_mem_clock_mhz(spec, len(units))
    pairs = [(sm, mem) for sm, mem in spec.clock_pairs() if job_mem is None or mem == job_mem]
    searches = []
    for unit in units:
        kernels = unit.kernels(trace)
        default = backend.true_measure(kernels, DEFAULT_SETTING)
        options = [Option(DEFAULT_SETTING, default.time_s, default.energy_j, 1)]
        for sm, mem in pairs:
            m = backend.true_measure(kernels, ClockSetting(sm, mem))
            options.append(Option(ClockSetting(sm, mem), m.time_s, m.energy_j, 1))
        charge(options)
        cost = sum(backend.protocol.cost_gpu_s(spec.energy_counter_period_s, o.time_s) for o in options)
        searches.append(UnitSearch(unit.name, "oracle", options[0], tuple(options), len(options), cost))
    return searches


def _phase_schedules(trace: Trace, backend: SimulatedGPU, config: SearchConfig, reference: ClockSetting,
                     charge) -> list[tuple]:  # fmt: skip
    """The phase level's candidates, as a runtime requests them (request_schedule): the phase level's blocks
    (search_blocks), each changed alone from ``reference`` at every supported SM clock (at the reference's memory
    clock where the GPU sets it per job, as the phase level searches), the whole step measured without noise with
    switching (each measurement charged), and those changes allocated over the blocks at each budget of
    PHASE_BUDGET_FACTORS (around the reference schedule's slack). Empty where the iteration makes one block (the
    one-clock schedules are then all of them)."""
    from freqopt.search.schedule import request_schedule, search_blocks

    spec, kernels = backend.spec, trace.kernels
    blocks = search_blocks(trace, backend, max_blocks=config.max_phase_blocks)
    if len(blocks) < 2:
        return []
    mem = job_mem_clock_mhz(spec, 2)
    if mem is not None and reference.mem_clock_mhz is not None:
        mem = reference.mem_clock_mhz
    settings = [DEFAULT_SETTING] + [ClockSetting(sm, m) for sm, m in spec.clock_pairs() if mem is None or m == mem]

    def step(per_block) -> Measurement:
        return backend.step(kernels, list(request_schedule(trace, blocks, per_block)), switching=True)

    ref = step([reference] * len(blocks))
    charge([ref])
    choices = []  # per block: (setting, change of time_s, change of energy_j) from the reference schedule
    for i in range(len(blocks)):
        options = [(reference, 0.0, 0.0)]
        for s in settings:
            if s != reference:
                m = step([s if j == i else reference for j in range(len(blocks))])
                charge([m])
                options.append((s, m.time_s - ref.time_s, m.energy_j - ref.energy_j))
        choices.append(options)
    deltas = [[(dt, de) for _, dt, de in c] for c in choices]
    slack_s = (1.0 + config.max_slowdown) * backend.step(kernels).time_s - ref.time_s
    out = []
    for factor in PHASE_BUDGET_FACTORS:
        picks = _allocate(deltas, slack_s + factor * config.max_slowdown * ref.time_s)
        if picks is not None:
            out.append(request_schedule(trace, blocks, [c[j][0] for c, j in zip(choices, picks)]))
    return out


@dataclass(frozen=True)
class BenchmarkResult:
    """The Bayesian search (mean over repeats) against the oracle, at one granularity."""

    oracle: OracleResult
    searches: tuple[SearchResult, ...]
    granularity: str
    true_energy_saved_pct: tuple[float | None, ...] = ()  # per search: its schedule's noiseless saving,
    true_slowdown_pct: tuple[float | None, ...] = ()  # and slowdown (noiseless_figures)

    def _mean(self, fn) -> float:
        return sum(fn(r) for r in self.searches) / len(self.searches)

    def summary(self) -> dict:
        """{"oracle": {...}, "search": {...}, "savings_ratio", "measured_savings_ratio", "cost_ratio"}: the
        search's noiseless saving over the oracle's (both chosen schedules' simulated steps without measurement
        noise: one yardstick for both; above 1 where the search ends on a schedule the sweep's candidates lack, or
        one better than the first the sweep's validation accepted), the same of their validated savings
        (independent fresh readings of each, so it may also exceed 1 by their noise where the two save alike), and its GPU-seconds over the oracle's (the whole coarse-to-fine chain is counted, the
        baseline's readings included); a ratio is None where the oracle saved nothing. "search" and "oracle" each hold
        the validated energy_saved_pct, true_energy_saved_pct and true_slowdown_pct (noiseless_figures; means
        over the searches), n_measurements and search_cost_gpu_s."""
        g = self.granularity
        search = {
            "energy_saved_pct": self._mean(lambda r: r.energy_saved_pct(g)),
            "predicted_energy_saved_pct": self._mean(lambda r: r.predicted_energy_saved_pct(g)),
            "n_measurements": self._mean(lambda r: sum(x.n_measurements for x in r.results.values())),
            "search_cost_gpu_s": self._mean(lambda r: sum(x.search_cost_gpu_s for x in r.results.values())),
        }
        oracle = {"energy_saved_pct": self.oracle.energy_saved_pct, "n_measurements": self.oracle.n_measurements,
                  "search_cost_gpu_s": self.oracle.search_cost_gpu_s}  # fmt: skip
        saved = oracle["energy_saved_pct"]
        for name in ("true_energy_saved_pct", "true_slowdown_pct"):
            true = [t for t in getattr(self, name) if t is not None]
            search[name] = sum(true) / len(true) if true and len(true) == len(self.searches) else None
            oracle[name] = getattr(self.oracle, name)
        true_saved = oracle["true_energy_saved_pct"]
        return {
            "oracle": oracle,
            "search": search,
            "savings_ratio": (search["true_energy_saved_pct"] / true_saved
                              if search["true_energy_saved_pct"] is not None and true_saved else None),
            "measured_savings_ratio": search["energy_saved_pct"] / saved if saved > 0 else None,
            "cost_ratio": search["search_cost_gpu_s"] / oracle["search_cost_gpu_s"],
        }


def benchmark(trace: Trace, backend: SimulatedGPU, config: SearchConfig, *, granularity: str = "kernel",
              repeats: int = 1, on_unit=None) -> BenchmarkResult:  # fmt: skip
    """Run the Bayesian search ``repeats`` times (seeds config.seed, +1, ...; each as ``freqopt search`` runs it:
    the clock granularities from iteration down to ``granularity``) and the oracle, on the same backend. With
    switching costs the search measures only the schedule a runtime realizes (SearchConfig.free_switching False):
    that is what the sweep finds too, and the free-switching figure a search adds is a product of its own, priced
    by ``--free-switching`` runs.

    Raises:
        InvalidSettingError: power-cap granularity (the oracle sweeps clock pairs), or repeats < 1.
    """
    import dataclasses

    from freqopt.errors import InvalidSettingError

    if granularity not in ("iteration", "pass", "kernel"):
        raise InvalidSettingError(f"granularity {granularity!r}: the benchmark compares clock granularities; "
                                  "choose iteration, pass or kernel")  # fmt: skip
    if repeats < 1:
        raise InvalidSettingError(f"repeats must be a positive integer, not {repeats}")
    clocks = [g for g in GRANULARITIES if g != "power-cap"]
    chain = tuple(clocks[: clocks.index(granularity) + 1])
    # Each run validates with its own Validator, so every validation it needs is measured and paid for.
    searches, true = [], []  # true: per search, its schedule's noiseless (saving, slowdown)
    for i in range(repeats):
        validator = Validator.for_search(trace, backend, config)
        searches.append(run_search(trace, backend, dataclasses.replace(config, granularities=chain,
                                                                      seed=config.seed + i, free_switching=False),
                                   on_unit=on_unit, validator=validator))  # fmt: skip
        true.append(noiseless_figures(validator, searches[-1].results[granularity].validated) or (None, None))
    oracle = oracle_search(trace, backend, config, granularity)
    return BenchmarkResult(oracle, tuple(searches), granularity, tuple(t[0] for t in true), tuple(t[1] for t in true))
