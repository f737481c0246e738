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
comparison (experiments/perseus_side_by_side.py) uses this schedule unchanged.

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
from freqopt.pipeline.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, deepspeed_1f1b_order, rank_of_stage,
                                        rank_orders, stages_per_rank)

__all__ = ["FORWARD", "BACKWARD", "KINDS", "ALL_KINDS", "SCHEDULES", "Instruction", "PipelineDAG", "stage_order",
           "one_f_one_b", "schedule_dag", "effective_energy_j"]

FORWARD = "forward"
BACKWARD = "backward"
KINDS = (FORWARD, BACKWARD)
# The zero-bubble schedules split a backward into its input gradient and its weight gradient (freqopt.pipeline.schedules):
# BACKWARD_INPUT, BACKWARD_WEIGHT.
ALL_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
# "1f1b" is DeepSpeed's TrainSchedule (one_f_one_b, the default); the others are torch.distributed.pipelining's
# schedules, their orders taken from the classes (freqopt.pipeline.schedules).
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zb-v", "dualpipe-v")


@dataclass(frozen=True, order=True)
class Instruction:
    """One pass of one micro-batch on one (model) stage: ``kind`` is one of ALL_KINDS (``"forward"`` or
    ``"backward"`` in 1F1B)."""

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
    return [Instruction(*inst) for inst in deepspeed_1f1b_order(stages, micro_batches, stage)]


@dataclass(frozen=True)
class PipelineDAG:
    """The instruction DAG of one pipeline iteration.

    Attributes:
        stages: S, the number of model stages (1F1B: one per GPU).
        micro_batches: M, micro-batches per iteration.
        instructions: the N instructions (1F1B: 2 S M), GPU by GPU, each GPU's in the order it runs them; an
            instruction's index in this tuple is its node id.
        edges: (E, 2) int array of (predecessor, successor) node ids; the successor starts after the predecessor
            ends.
        order: node ids in a topological order (a numpy int array of shape (N,)).
        gpu_of_stage: the GPU (pipeline rank) that runs each model stage, shape (S,); None: stage s on GPU s.
        schedule: the schedule's name (SCHEDULES).
    """

    stages: int
    micro_batches: int
    instructions: tuple[Instruction, ...]
    edges: np.ndarray
    order: np.ndarray
    gpu_of_stage: tuple[int, ...] | None = None
    schedule: str = "1f1b"

    @property
    def n(self) -> int:
        """The number of instructions, N."""
        return len(self.instructions)

    @property
    def stage_gpus(self) -> tuple[int, ...]:
        """The GPU that runs each model stage, shape (S,): ``gpu_of_stage``, or stage s on GPU s."""
        return tuple(range(self.stages)) if self.gpu_of_stage is None else self.gpu_of_stage

    @property
    def gpus(self) -> int:
        """The pipeline's GPUs (ranks): S, or S / v with v model stages per GPU."""
        return 1 + max(self.stage_gpus)

    def gpu_of(self, inst: Instruction) -> int:
        """The GPU that runs ``inst``."""
        return self.stage_gpus[inst.stage]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The instruction kinds this schedule runs, in ALL_KINDS order."""
        present = {inst.kind for inst in self.instructions}
        return tuple(k for k in ALL_KINDS if k in present)

    def index(self) -> dict[Instruction, int]:
        """Instruction -> node id."""
        return {inst: i for i, inst in enumerate(self.instructions)}

    def start_times_s(self, times_s) -> np.ndarray:
        """Each instruction's earliest start (s), shape (N,), given its duration ``times_s`` (shape (N,), s)."""
        times = np.asarray(times_s, dtype=float)
        start = np.zeros(self.n)
        preds = self.predecessors
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
        (shape (N,), J) plus ``blocking_power_w`` (W) for every GPU-second (``gpus`` GPUs) not spent in an
        instruction."""
        times = np.asarray(times_s, dtype=float)
        total = self.iteration_time_s(times)
        return float(np.sum(energies_j) + blocking_power_w * (self.gpus * total - np.sum(times)))

    @property
    def predecessors(self) -> list[np.ndarray]:
        """Per instruction (node id), the node ids that must finish before it starts (the DAG's edges into it),
        each an int array; built once."""
        cached = self.__dict__.get("_preds_cache")
        if cached is None:
            lists: list[list[int]] = [[] for _ in range(self.n)]
            for a, b in self.edges:
                lists[int(b)].append(int(a))
            cached = [np.asarray(p, dtype=int) for p in lists]
            object.__setattr__(self, "_preds_cache", cached)
        return cached


def effective_energy_j(energy_j, time_s, blocking_power_w: float):
    """An instruction's *effective* energy (J), energy_j - blocking_power_w * time_s: its own energy less what its
    GPU would have drawn blocked for its time (numbers or arrays of one shape, J and s; W). The iteration's energy
    (PipelineDAG.iteration_energy_j) is the instructions' effective energies plus blocking_power_w for every GPU
    over the whole iteration, S * p * T: the form the pipeline planner's model and heuristic count it in."""
    return energy_j - blocking_power_w * time_s


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


def schedule_dag(schedule: str, stages: int, micro_batches: int, *, virtual_stages: int | None = None) -> PipelineDAG:
    """The DAG of one iteration of ``schedule`` on ``stages`` GPUs: "1f1b" is DeepSpeed's (one_f_one_b); the
    others' per-GPU orders are torch.distributed.pipelining's own (freqopt.pipeline.schedules.rank_orders), with
    ``virtual_stages`` model stages per GPU for the looped ones (default 2), 2 for the V-shaped ones. Edges as
    freqopt.pipeline.schedules's module docstring says.

    Raises:
        InvalidSettingError: an unknown schedule, a bad count, or a combination torch's schedule refuses.
    """
    if schedule not in SCHEDULES:
        raise InvalidSettingError(f"schedule {schedule!r} is unknown; known: {', '.join(SCHEDULES)}",
                                  argument="schedule")  # fmt: skip
    if schedule == "1f1b" and virtual_stages in (None, 1):
        return one_f_one_b(stages, micro_batches)
    orders = rank_orders(schedule, stages, micro_batches, virtual_stages)
    v = stages_per_rank(schedule, virtual_stages)
    n_stages = stages * v
    gpu_of_stage = tuple(rank_of_stage(schedule, stages, k, virtual_stages) for k in range(n_stages))
    instructions = tuple(Instruction(k, kind, m) for order in orders for k, kind, m in order)
    node = {inst: i for i, inst in enumerate(instructions)}
    if len(node) != len(instructions):
        raise AssertionError(f"torch's {schedule} order runs an instruction twice")
    edges: list[tuple[int, int]] = []
    for order in orders:
        edges.extend((node[Instruction(*a)], node[Instruction(*b)]) for a, b in zip(order, order[1:]))

    def backward_of(k: int, m: int) -> int | None:  # the instruction that sends (k, m)'s gradient upstream
        for kind in (BACKWARD, BACKWARD_INPUT):
            if Instruction(k, kind, m) in node:
                return node[Instruction(k, kind, m)]
        return None

    for inst, i in node.items():
        k, m = inst.stage, inst.micro_batch
        if inst.kind == FORWARD and k > 0:
            edges.append((node[Instruction(k - 1, FORWARD, m)], i))
        elif inst.kind in (BACKWARD, BACKWARD_INPUT):
            edges.append((node[Instruction(k, FORWARD, m)], i))
            if k < n_stages - 1:
                edges.append((backward_of(k + 1, m), i))
        elif inst.kind == BACKWARD_WEIGHT:
            edges.append((node[Instruction(k, BACKWARD_INPUT, m)], i))
    edges = sorted(set(edges))
    return PipelineDAG(n_stages, micro_batches, instructions, np.asarray(edges, dtype=int).reshape(-1, 2),
                       _topological_order(len(instructions), edges), gpu_of_stage, schedule)  # fmt: skip


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
    if len(order) != n:  # cannot happen for a schedule that runs (torch checks its orders); a guard
        raise AssertionError("the pipeline's instruction graph has a cycle")
    return np.asarray(order, dtype=int)
