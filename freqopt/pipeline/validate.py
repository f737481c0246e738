"""The pipeline search's validation (freqopt.pipeline.search): whole iterations of the simulated pipeline measured
per schedule, held to the budget at a confidence level as the one-GPU levels are (freqopt.search.validate)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.gpu.backends.base import Measurement
from freqopt.pipeline.dag import PipelineDAG
from freqopt.pipeline.sim import SimulatedPipeline
from freqopt.search.journal import MeasurementLog, digest
from freqopt.search.validate import DEFAULT_CONFIDENCE, PairedReadings

__all__ = ["Validated", "PipelineValidator"]


@dataclass(frozen=True)
class Validated:
    """A schedule's whole iteration measured ``n`` times on the simulated pipeline: means and standard errors.

    Attributes:
        time_s, energy_j: mean iteration time (s) and energy of all stages (J).
        time_se_s, energy_se_j: their standard errors (sample standard deviation / sqrt(n); 0 for one sample).
        n: measurements averaged.
        cost_gpu_s: the GPU-seconds they took.
        n_switches: clock switches the runtime asks for per iteration, all stages together.
        max_stage_switches: the most of them any one stage's GPU is asked for per iteration (each GPU's runtime
            thread issues its own: GPUSpec.max_switches_per_s).
        time_upper_s: for a schedule held to the budget, the upper confidence bound of its time (s), from readings
            paired with the defaults' (PipelineValidator); None otherwise.
    """

    time_s: float
    energy_j: float
    time_se_s: float
    energy_se_j: float
    n: int
    cost_gpu_s: float
    n_switches: int = 0
    max_stage_switches: int = 0
    time_upper_s: float | None = None

    @property
    def time_bound_s(self) -> float:
        """The time the budget holds this schedule to, s: ``time_upper_s`` where computed, else ``time_s``."""
        return self.time_s if self.time_upper_s is None else self.time_upper_s

    @property
    def switches_per_s(self) -> float:
        """The busiest stage's GPU's clock switches per second (max_stage_switches / time_s)."""
        return self.max_stage_switches / self.time_s if self.time_s > 0 else 0.0


class PipelineValidator:
    """Measures whole iterations of the simulated pipeline, ``repeats`` times per distinct schedule, logged in
    ``log`` (read back on resume) and counted. A schedule held to a time limit is held to it at ``confidence`` as
    the one-GPU levels' are (freqopt.search.validate.Validator): each reading paired with one of the defaults taken
    just before it, its ``time_upper_s`` the upper confidence bound of its time (PairedReadings), read again one pair
    at a time while that bound is over the limit and its mean is not clearly over it, up to ``max_repeats``."""

    def __init__(self, pipeline: SimulatedPipeline, repeats: int, log: MeasurementLog, *,
                 confidence: float = DEFAULT_CONFIDENCE, max_repeats: int | None = None):  # fmt: skip
        self.pipeline, self.repeats, self.log = pipeline, repeats, log
        self.max_repeats = max(max_repeats or repeats, repeats)
        self.paired = PairedReadings(confidence)
        self.cache: dict[tuple, Validated] = {}
        self.samples: dict[tuple, list[Measurement]] = {}
        self.pairs: dict[tuple, list[Measurement]] = {}
        self.n_measurements = 0
        self.cost_gpu_s = 0.0

    def _take(self, tag: str, r: int, requests: tuple, switching: bool, key: str) -> Measurement:
        m = self.log.measure(tag, r, lambda i: self.pipeline.run(list(requests), switching=switching, key=key,
                                                                 sample=i).as_measurement())  # fmt: skip
        self.n_measurements += 1
        self.cost_gpu_s += m.cost_gpu_s
        return m

    def _read(self, ident: tuple, n: int, key: str, paired: bool) -> None:
        """At least ``n`` readings of ``ident`` ((requests, switching), or ("confirm", requests, switching): the
        confirmation's, under their own log tag and noise key), each after one of the defaults with ``paired``."""
        fresh = ident[0] == "confirm"
        requests, switching = ident[-2:]
        samples = self.samples.setdefault(ident, [])
        pairs = self.pairs.setdefault(ident, [])
        tag = ("confirm-" if fresh else "") + digest(("pipeline", requests, switching))
        key = f"{key}-confirm" if fresh else key
        self.paired.read(ident, samples, pairs, n, paired=paired,
                         take=lambda r: self._take(tag, r, requests, switching, key),
                         take_default=lambda r: self._take(f"paired-{tag}", r, (None,) * len(requests), True,
                                                           f"paired-{tag}"))  # fmt: skip

    def _validated(self, ident: tuple, *, bounded: bool) -> Validated:
        requests, switching = ident[-2:]
        ms = self.samples[ident]
        t = np.array([m.time_s for m in ms])
        e = np.array([m.energy_j for m in ms])
        n = len(ms)
        se = (lambda x: float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0)
        upper = None
        if bounded:
            base = self.cache[((None,) * len(requests), True)]
            upper = self.paired.upper_time_s(ident, float(t.mean()), base.time_s, self._default_times(requests))
        n_switches, max_stage_switches = _n_switches(self.pipeline.dag, requests) if switching else (0, 0)
        return Validated(time_s=float(t.mean()), energy_j=float(e.mean()), time_se_s=se(t), energy_se_j=se(e), n=n,
                         cost_gpu_s=float(sum(m.cost_gpu_s for m in ms + self.pairs.get(ident, []))),
                         n_switches=n_switches, max_stage_switches=max_stage_switches, time_upper_s=upper)

    def confirm(self, requests: Sequence[int | None], *, switching: bool = True, key: str = "schedule") -> Validated:
        """The schedule read again afresh (freqopt.search.validate.Validator.confirm): ``max_repeats`` new
        readings, each paired with a new one of the defaults; their means, bounded from them alone."""
        requests = tuple(None if r is None else int(r) for r in requests)
        if requests == (None,) * len(requests) and switching:
            return self.cache[(requests, True)]
        ident = ("confirm", requests, switching)
        self._read(ident, self.max_repeats, key, True)
        self.cache[ident] = self._validated(ident, bounded=True)
        return self.cache[ident]

    def _default_times(self, requests: tuple) -> list[float]:
        return [m.time_s for m in self.samples.get(((None,) * len(requests), True), ())]

    def __call__(self, requests: Sequence[int | None], *, switching: bool = True, key: str = "schedule",
                 limit_s: float | None = None) -> Validated:  # fmt: skip
        """The iteration with ``requests`` (per instruction, dag.instructions order: the SM clock in MHz the runtime
        asks for at its start; None: the default) measured ``repeats`` times; with ``limit_s`` (s per iteration,
        the baseline read first), paired and bounded (class docstring)."""
        requests = tuple(None if r is None else int(r) for r in requests)
        ident = (requests, switching)
        paired = limit_s is not None and ident != ((None,) * len(requests), True)
        if ident in self.cache and (not paired or self.cache[ident].time_upper_s is not None):
            return self.cache[ident]
        self._read(ident, self.repeats, key, paired)
        if paired:
            ratio_limit = limit_s / self.cache[((None,) * len(requests), True)].time_s
            times = self._default_times(requests)
            while len(self.samples[ident]) < self.max_repeats and self.paired.undecided(ident, ratio_limit, times):
                self._read(ident, len(self.samples[ident]) + 1, key, paired)
        self.cache[ident] = self._validated(ident, bounded=paired)
        return self.cache[ident]


def _n_switches(dag: PipelineDAG, requests: Sequence) -> tuple[int, int]:
    """Changes of the requested clock per iteration, each GPU's order read cyclically (iterations repeat): all
    GPUs' together, and the most of any one GPU's (1F1B: one stage per GPU)."""
    counts = []
    for g in range(dag.gpus):
        seq = [r for inst, r in zip(dag.instructions, requests) if dag.gpu_of(inst) == g]
        counts.append(sum(1 for a, b in zip(seq, seq[1:] + seq[:1]) if a != b))
    return sum(counts), max(counts, default=0)
