"""The oracle and the benchmark: an exhaustive sweep of every tuning unit at every supported setting, on the
simulated GPU, against which the Bayesian search is measured.

The oracle measures each unit at every supported (SM clock, memory clock) pair without noise (the simulated GPU's
true values), and charges for each the GPU-seconds a real sweep would spend on it (the backend's measurement
protocol: warm-up plus a window of several energy-counter updates), as Spaan et al. 2026 spent about 3 GPU-days.
Its options go through the same exact allocation and the same validation as the search's, so the two validated
savings compare like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting, Measurement
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.workload.kernels import Trace
from freqopt.search.allocation import allocate_validated
from freqopt.search.config import SearchConfig
from freqopt.search.result import SearchResult
from freqopt.search.runner import job_mem_clock_mhz, run_search
from freqopt.search.study import Option, UnitSearch
from freqopt.search.units import GRANULARITIES, partition
from freqopt.search.validate import Validator

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
    """

    energy_saved_pct: float
    slowdown_pct: float
    n_measurements: int
    search_cost_gpu_s: float
    true_energy_saved_pct: float | None = None
    true_slowdown_pct: float | None = None


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


def oracle_search(trace: Trace, backend: SimulatedGPU, config: SearchConfig, granularity: str = "kernel",
                  validator: Validator | None = None) -> OracleResult:  # fmt: skip
    """Sweep every unit of ``granularity`` at every supported clock pair, allocate ``config.max_slowdown`` exactly
    and validate (``validator``: share the search's, so both see one baseline measurement)."""
    spec = backend.spec
    validator = validator or Validator.for_search(trace, backend, config)
    before = (validator.n_measurements, validator.cost_gpu_s)  # the baseline's readings included, as a search's
    baseline = validator.baseline()
    units = partition(trace, granularity)
    def cost_s(m) -> float:  # one measurement of m's replay loop: whole loops over warm-up and window
        return backend.protocol.cost_gpu_s(spec.energy_counter_period_s, m.time_s)

    pairs = spec.clock_pairs()
    job_mem = job_mem_clock_mhz(spec, len(units))  # a memory clock set per job: the units sweep the SM clock at it
    unit_pairs = [(sm, mem) for sm, mem in pairs if job_mem is None or mem == job_mem]
    searches = []
    for unit in units:
        kernels = unit.kernels(trace)
        default = backend.true_measure(kernels, DEFAULT_SETTING)
        options = [Option(DEFAULT_SETTING, default.time_s, default.energy_j, 1)]
        for sm, mem in unit_pairs:
            m = backend.true_measure(kernels, ClockSetting(sm, mem))
            options.append(Option(ClockSetting(sm, mem), m.time_s, m.energy_j, 1))
        searches.append(UnitSearch(unit.name, "oracle", options[0], tuple(options), len(options),
                                   sum(cost_s(o) for o in options)))
    # The exhaustive space holds every uniform schedule too (one pair for all units): sweep the whole iteration at
    # every pair, as the search's coarse-to-fine chain starts from its iteration level, and offer the best one
    # that meets the budget (validated) as the first candidate.
    sweep = [(backend.step(trace.kernels, [ClockSetting(sm, mem)] * len(trace)), ClockSetting(sm, mem))
             for sm, mem in pairs]  # whole steps, as validation measures them
    sweep_cost = (len(pairs), sum(cost_s(m) for m, _ in sweep))
    within = [(m.energy_j, s) for m, s in sweep if m.time_s <= baseline.time_s * (1 + config.max_slowdown)]
    first = None
    if within:
        uniform = min(within, key=lambda x: x[0])[1]
        first = [uniform] * len(units)
    result = allocate_validated(units, searches, validator, baseline, config.max_slowdown,
                                rounds=config.max_validation_rounds, key=f"oracle-{granularity}",
                                candidates=[first] if first else ())  # fmt: skip
    true = noiseless_figures(validator, result.validated) or (None, None)
    return OracleResult(
        energy_saved_pct=100.0 * (1.0 - result.validated.energy_j / baseline.energy_j),
        slowdown_pct=100.0 * (result.validated.time_s / baseline.time_s - 1.0),
        n_measurements=sum(s.n_measurements for s in searches) + sweep_cost[0] + validator.n_measurements - before[0],
        search_cost_gpu_s=sum(s.cost_gpu_s for s in searches) + sweep_cost[1] + validator.cost_gpu_s - before[1],
        true_energy_saved_pct=true[0], true_slowdown_pct=true[1],
    )


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
        """{"oracle": {...}, "search": {...}, "savings_ratio", "true_savings_ratio", "cost_ratio"}: the search's
        validated saving over the oracle's, the same without noise, and its GPU-seconds over the oracle's (the
        whole coarse-to-fine chain is counted, the baseline's readings included). "search" and "oracle" each hold
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
            "savings_ratio": search["energy_saved_pct"] / saved if saved > 0 else None,
            "true_savings_ratio": (search["true_energy_saved_pct"] / true_saved
                                   if search["true_energy_saved_pct"] is not None and true_saved else None),
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
