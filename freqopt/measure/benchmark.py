"""The Bayesian search against an exhaustive sweep of every tuning unit at every setting, on the simulated GPU:
``freqopt.measure.benchmark.benchmark("gpt3-small", granularity="iteration")`` (freqopt.search.oracle does the work)."""

from __future__ import annotations

from dataclasses import dataclass, field

from freqopt.budget import DEFAULT_CONFIDENCE

__all__ = ["benchmark", "BenchmarkReport"]


@dataclass(frozen=True)
class BenchmarkReport:
    """What was compared and how it came out.

    Attributes:
        result: freqopt.search.oracle.BenchmarkResult (its ``summary()`` is the comparison).
        trace: the traced iteration; spec: the simulated GPU type; config: the searches' SearchConfig (its
            max_slowdown the budget, its switching whether clock switches cost time).
    """

    result: object = field(repr=False)
    trace: object = field(repr=False)
    spec: object = field(repr=False)
    config: object

    def summary(self) -> dict:
        """The comparison: see freqopt.search.oracle.BenchmarkResult.summary."""
        return self.result.summary()


def benchmark(model, *, gpu=None, granularity: str = "kernel", max_slowdown: float | str = "1%", repeats: int = 1,
              free_switching: bool = False, seed: int = 0, confidence: float = DEFAULT_CONFIDENCE,
              micro_batch_size: int | None = None, seq_len: int | None = None, n_heads: int | None = None, vocab_multiple: int | None = None,
              layout=None, on_unit=None, verbose: bool = False):  # fmt: skip
    """Trace one training iteration of ``model`` and compare ``repeats`` Bayesian searches (seeds seed, seed+1,
    ...) with the oracle that measures every unit at every clock pair (freqopt.search.oracle.benchmark).

    Args:
        model: a model name (with the get_workload overrides below) or a Workload.
        gpu: GPU type name or GPUSpec; default h100-sxm. Always simulated: the sweep is far too long for a real GPU.
        granularity: iteration, pass or kernel (the oracle sweeps clock pairs, so not power-cap).
        max_slowdown: the budget, a fraction or "1%".
        repeats: Bayesian searches averaged (positive).
        free_switching: treat clock switches as free (as Spaan et al. 2026 did); default: their cost counts.
        seed: seed of the first search and of the simulated noise.
        confidence: the one-sided confidence, in [0.5, 1), at which every schedule of the searches and of the sweep
            is held to the budget (freqopt.search as search takes it).
        on_unit: called as on_unit(granularity, units_done, units_total) during each search.
        verbose: let Optuna log at INFO (a line per study it creates); by default WARNING, and the caller's
            Optuna verbosity is restored on return (freqopt.search.study.optuna_logging).

    Returns:
        BenchmarkReport: ``.summary()`` is the comparison.

    Raises:
        UnknownNameError: unknown model or GPU type.
        InvalidSettingError: a bad slowdown, confidence, override or layout; power-cap or an unknown granularity;
            repeats < 1.
    """
    from freqopt.budget import check_confidence, parse_slowdown
    from freqopt.errors import InvalidSettingError, check_positive_int
    from freqopt.gpu.specs import DEFAULT_GPU, get_gpu
    from freqopt.resolve import check_workload_arguments, resolve_gpu

    # The checks that need no model built first, before the modules that load PyTorch and Optuna.
    slowdown = parse_slowdown(max_slowdown)
    confidence = check_confidence(confidence)
    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    check_workload_arguments(model, **sizes)
    spec = resolve_gpu(gpu) or get_gpu(DEFAULT_GPU)
    if granularity not in ("iteration", "pass", "kernel"):
        raise InvalidSettingError(f"granularity {granularity!r}: the benchmark compares clock granularities; "
                                  "choose iteration, pass or kernel", argument="granularity")  # fmt: skip
    check_positive_int("repeats", repeats)
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.resolve import resolve_workload
    from freqopt.search import SearchConfig
    from freqopt.search.oracle import benchmark as run_benchmark
    from freqopt.search.study import optuna_logging
    from freqopt.workload.trace import trace_training_iteration

    workload = resolve_workload(model, **sizes)
    trace = trace_training_iteration(workload)
    config = SearchConfig(max_slowdown=slowdown, seed=seed, switching=not free_switching, confidence=confidence)
    with optuna_logging(verbose):
        result = run_benchmark(trace, SimulatedGPU(spec, seed=seed), config, granularity=granularity,
                               repeats=repeats, on_unit=on_unit)  # fmt: skip
    return BenchmarkReport(result, trace, spec, config)
