"""What the simulated pipeline (freqopt.pipeline.sim) measures: one iteration, and each stage's GPU over it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freqopt.gpu.backends.base import Measurement

__all__ = ["StageRun", "PipelineRun"]


@dataclass(frozen=True)
class StageRun:
    """One stage's GPU over one iteration.

    Attributes:
        stage: the stage's index.
        busy_s: time (s) it ran instructions and its optimizer step.
        blocked_s: the rest of the iteration (s): waiting on P2P, in bubbles, at barriers.
        instruction_energy_j: energy (J) of its 2M instructions.
        optimizer_energy_j: energy (J) of its optimizer step (0 without one).
        blocked_energy_j: energy (J) drawn while blocked (blocked power at the clock in force).
        energy_j: the stage's whole energy (J) over the iteration, as its energy counter read it (noisy in ``run``).
        n_switches: clock changes the runtime asked for during the iteration.
    """

    stage: int
    busy_s: float
    blocked_s: float
    instruction_energy_j: float
    optimizer_energy_j: float
    blocked_energy_j: float
    energy_j: float
    n_switches: int

    @property
    def blocked_power_w(self) -> float:
        """Average power (W) while blocked (0 when never blocked)."""
        return self.blocked_energy_j / self.blocked_s if self.blocked_s > 0 else 0.0


@dataclass(frozen=True)
class PipelineRun:
    """One iteration of the simulated pipeline.

    Attributes:
        time_s: the iteration's time (s): the instructions' critical path, then the optimizer step.
        energy_j: all stages' energy (J) over the iteration.
        stages: per-stage breakdown (StageRun), stage 0 first.
        start_s, end_s: each instruction's start and end (s, noiseless), shape (N,), in dag.instructions order.
        instruction_time_s, instruction_energy_j: each instruction's own time (s) and energy (J), shape (N,).
        cost_gpu_s: GPU-seconds the measurement took (S GPUs, each for the protocol's warm-up and window); 0 for
            ``true_run``.
    """

    time_s: float
    energy_j: float
    stages: tuple[StageRun, ...]
    start_s: np.ndarray
    end_s: np.ndarray
    instruction_time_s: np.ndarray
    instruction_energy_j: np.ndarray
    cost_gpu_s: float = 0.0

    @property
    def avg_power_w(self) -> float:
        """All stages' average power over the iteration (W)."""
        return self.energy_j / self.time_s

    def as_measurement(self) -> Measurement:
        """time_s, energy_j and cost_gpu_s as a Measurement (what a study logs)."""
        return Measurement(self.time_s, self.energy_j, self.cost_gpu_s)
