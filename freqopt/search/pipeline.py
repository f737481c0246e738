"""The 1F1B pipeline schedule (DeepSpeed's ``TrainSchedule``) as a DAG of instructions, its critical path and energy.

A pipeline of S stages trains M micro-batches per iteration. An *instruction* is the forward (``"forward"``) or
backward (``"backward"``) pass of one micro-batch on one stage; it runs on its stage's GPU. The non-interleaved 1F1B
schedule (PipeDream-Flush, as DeepSpeed's ``deepspeed.runtime.pipe.schedule.TrainSchedule`` runs it) gives each
stage ``s`` this order:

- warm-up: the forwards of micro-batches 0 .. w-1, with w = min(S - s, M);
- steady state: backward m, then forward m + w, for m = 0, 1, ... while a forward is left;
- cool-down: the backwards left.

(DeepSpeed counts the first steady forward among the warm-up ones: its stage s runs S - s forwards before its first
backward, e.g. stage 0 of 4 runs F0 F1 F2 F3 B0 F4 B1 ...; tests/test_pipeline_plan.py checks this order against
``TrainSchedule`` itself.) Perseus's emulation (github.com/ml-energy/zeus, branch ``kronos``,
``lowtime/lowtime/perseus/schedule.py``, ``Synchronous1F1B``) is adapted from the same DeepSpeed code and yields the
same per-stage order; its DAG (``lowtime/scripts/perseus.py``) has the edges below. The two agree, so the Perseus
comparison (experiments/perseus_frontiers.py) uses this schedule unchanged.

The instruction DAG's edges:

- each stage's own order (one GPU runs one instruction at a time);
- forward(s, m) after forward(s - 1, m) (activations sent downstream);
- backward(s, m) after backward(s + 1, m) (gradients sent upstream);
- backward(S - 1, m) after forward(S - 1, m), which the last stage's own order already implies.

P2P transfer time is not modelled (zero), as in Perseus's emulation.

Time and energy (Perseus's accounting, ``lowtime/scripts/perseus.py``: each option's cost becomes
``energy - p2p_power * time``, and the plan's energy is that sum plus ``num_stages * iteration_time * p2p_power``):
the iteration time T is the DAG's longest path (every instruction starts as soon as its predecessors finish), and its
energy is

    E = sum_i energy_i + blocking_power_w * (S * T - sum_i time_i),

that is, every instruction's own energy, plus each of the S GPUs drawing ``blocking_power_w`` whenever it is not
running an instruction during the iteration (waiting on a P2P receive, in the bubbles, and idle until the last
stage finishes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freqopt.errors import InvalidSettingError, check_positive_int

__all__ = ["FORWARD", "BACKWARD", "KINDS", "Instruction", "PipelineDAG", "stage_order", "one_f_one_b"]

FORWARD = "forward"
BACKWARD = "backward"
KINDS = (FORWARD, BACKWARD)
SCHEDULES = ("1f1b",)


@dataclass(frozen=True, order=True)
class Instruction:
    """One pass of one micro-batch on one stage: ``kind`` is ``"forward"`` or ``"backward"``."""

    stage: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind[0].upper()}{self.micro_batch}@s{self.stage}"


def stage_order(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """The instructions stage ``stage`` of a 1F1B pipeline runs, in order (see the module docstring).

    Returns:
        2 * micro_batches instructions: every micro-batch's forward and backward on that stage.

    Raises:
        InvalidSettingError: stages or micro_batches not a positive integer, stage outside [0, stages).
    """
    check_positive_int("stages", stages)
    check_positive_int("micro_batches", micro_batches)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise InvalidSettingError(f"stage must be an integer in [0, {stages}), not {stage!r}", argument="stage")
    warmup = min(stages - stage, micro_batches)
    order = [Instruction(stage, FORWARD, m) for m in range(warmup)]
    next_forward = warmup
    for m in range(micro_batches):
        order.append(Instruction(stage, BACKWARD, m))
        if next_forward < micro_batches:
            order.append(Instruction(stage, FORWARD, next_forward))
            next_forward += 1
    return order


@dataclass(frozen=True)
class PipelineDAG:
    """The instruction DAG of one pipeline iteration.

    Attributes:
        stages: S, the number of pipeline stages (one GPU each).
        micro_batches: M, micro-batches per iteration.
        instructions: the N = 2 S M instructions, stage by stage, each stage in its own order; an instruction's
            index in this tuple is its node id.
        edges: (E, 2) int array of (predecessor, successor) node ids; the successor starts after the predecessor
            ends.
        order: node ids in a topological order (a numpy int array of shape (N,)).
    """

    stages: int
    micro_batches: int
    instructions: tuple[Instruction, ...]
    edges: np.ndarray
    order: np.ndarray

    @property
    def n(self) -> int:
        """The number of instructions, N = 2 S M."""
        return len(self.instructions)

    def index(self) -> dict[Instruction, int]:
        """Instruction -> node id."""
        return {inst: i for i, inst in enumerate(self.instructions)}

    def start_times_s(self, times_s) -> np.ndarray:
        """Each instruction's earliest start (s), shape (N,), given its duration ``times_s`` (shape (N,), s)."""
        times = np.asarray(times_s, dtype=float)
        start = np.zeros(self.n)
        preds = self._preds
        for j in self.order:
            p = preds[j]
            if len(p):
                start[j] = np.max(start[p] + times[p])
        return start

    def iteration_time_s(self, times_s) -> float:
        """The critical path (s): the latest finish when every instruction starts as early as it can."""
        times = np.asarray(times_s, dtype=float)
        return float(np.max(self.start_times_s(times) + times))

    def iteration_energy_j(self, times_s, energies_j, blocking_power_w: float) -> float:
        """The iteration's energy (J) under Perseus's accounting (module docstring): the instructions' energies
        (shape (N,), J) plus ``blocking_power_w`` (W) for every GPU-second not spent in an instruction."""
        times = np.asarray(times_s, dtype=float)
        total = self.iteration_time_s(times)
        return float(np.sum(energies_j) + blocking_power_w * (self.stages * total - np.sum(times)))

    @property
    def _preds(self) -> list[np.ndarray]:
        cached = self.__dict__.get("_preds_cache")
        if cached is None:
            lists: list[list[int]] = [[] for _ in range(self.n)]
            for a, b in self.edges:
                lists[int(b)].append(int(a))
            cached = [np.asarray(p, dtype=int) for p in lists]
            object.__setattr__(self, "_preds_cache", cached)
        return cached


def one_f_one_b(stages: int, micro_batches: int) -> PipelineDAG:
    """The DAG of one 1F1B iteration with ``stages`` stages and ``micro_batches`` micro-batches (module docstring).

    Raises:
        InvalidSettingError: stages or micro_batches not a positive integer.
    """
    orders = [stage_order(stages, micro_batches, s) for s in range(stages)]
    instructions = tuple(inst for order in orders for inst in order)
    node = {inst: i for i, inst in enumerate(instructions)}
    edges: list[tuple[int, int]] = []
    for order in orders:
        edges.extend((node[a], node[b]) for a, b in zip(order, order[1:]))
    for s in range(stages):
        for m in range(micro_batches):
            if s > 0:
                edges.append((node[Instruction(s - 1, FORWARD, m)], node[Instruction(s, FORWARD, m)]))
            if s < stages - 1:
                edges.append((node[Instruction(s + 1, BACKWARD, m)], node[Instruction(s, BACKWARD, m)]))
            else:
                edges.append((node[Instruction(s, FORWARD, m)], node[Instruction(s, BACKWARD, m)]))
    edges = sorted(set(edges))
    edge_array = np.asarray(edges, dtype=int).reshape(-1, 2)
    return PipelineDAG(stages, micro_batches, instructions, edge_array, _topological_order(len(instructions), edges))


def _topological_order(n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    indegree = [0] * n
    succs: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succs[a].append(b)
        indegree[b] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in succs[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(order) != n:  # cannot happen for 1F1B; a guard for a wrong edge list
        raise AssertionError("the pipeline's instruction graph has a cycle")
    return np.asarray(order, dtype=int)
