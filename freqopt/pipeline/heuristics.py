"""The pipeline planner's heuristic (freqopt.pipeline.planner): plans rounded from the hull LP, repaired to the
deadline and slowed into their float.

Every plan starts from the hull LP (the planner's step 1); these are the plans made from it (step 2), each made to
meet the deadline and then improved by the reclaim pass below; the best is kept:
- Round down: every instruction takes its slowest kept option no slower than its LP time t_lp = sum_k x[i, k]
  t[i, k] (the cheapest such, kept options being non-dominated). Every instruction is then no slower than in
  the LP, so the LP's start times still certify the deadline: feasible by construction.
- Error diffusion (``plan`` only): where the LP mixes a fast and a slow option lo < hi of an instruction, the
  slow one's share of its time, (t_lp - t[lo]) / (t[hi] - t[lo]), is summed over the micro-batches of its
  (stage, kind) in order, and the instruction takes hi whenever the sum reaches 1/2 (then less 1), else lo: the
  LP's count of slow options, where a slow option is one large step that rounding down gives up everywhere
  (Perseus's GPT-3 175B A40 profile, experiments/data/perseus: stage 0's backward pass from 1170 to 960 MHz adds
  1.6 ms and saves 6.5 J of effective energy at 70.38 W). It may break the deadline; a repair pass then speeds
  up, one option at a time, the instruction on a too-long path whose faster option costs the least effective
  energy per second saved, until the critical path fits (it always ends: the fastest plan meets every deadline).
- A warm start, when the caller gives a plan within the deadline; in a frontier, also the next slower plan
  found, repaired down to the deadline.
The reclaim pass: each instruction's total float under the deadline (latest minus earliest start, the critical
path method's forward and backward passes over the DAG) bounds how much slower it may run. The move (one
instruction to a slower kept option within its float) that saves the most effective energy per second it adds
is applied first, the floats updated, and so on to a fixed point; a move that lengthens the critical path
counts S p per second of it against its saving. It never breaks the deadline nor raises the energy.

A plan is an int array of shape (N,): each instruction's index into its (stage, kind)'s kept options, fastest first
(times increasing, effective energies decreasing). ``PlanHeuristics`` holds the options grouped that way and the
passes over them; the planner is one.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from freqopt.pipeline.dag import PipelineDAG, effective_energy_j

__all__ = ["PlanHeuristics", "KeptOptions"]

# Relative slack (of the deadline) the heuristic's passes allow for floating-point sums of instruction times.
PLAN_TOLERANCE = 1e-12


class KeptOptions(NamedTuple):
    """One (stage, kind)'s kept options (the non-dominated ones), fastest first: arrays of shape (K',)."""

    sm_clock_mhz: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray


class PlanHeuristics:
    """The heuristic's view of a pipeline (module docstring): one group per (stage, kind), each instruction's group,
    the groups' kept clocks, times and effective energies, and the DAG as adjacency lists (``_group_options``); and
    the passes over plans. A subclass sets ``dag``, ``gpus``, ``blocking_power_w`` and ``_offsets`` (the LP's
    option columns per instruction) and calls ``_group_options``."""

    dag: PipelineDAG
    gpus: int
    blocking_power_w: float
    _offsets: np.ndarray

    def _group_options(self, options: Mapping[tuple[int, str], KeptOptions]) -> None:
        """Group the kept ``options`` ((stage, kind) -> KeptOptions) for the passes below."""
        keys = sorted(options)
        self._group = [keys.index((i.stage, i.kind)) for i in self.dag.instructions]
        self._kept_clocks = [options[key].sm_clock_mhz for key in keys]
        self._kept_times = [options[key].time_s for key in keys]
        self._kept_effective = [effective_energy_j(options[key].energy_j, options[key].time_s, self.blocking_power_w)
                                for key in keys]  # fmt: skip
        self._graph = _Graph(self.dag)
        self._by_micro_batch = sorted(range(self.dag.n), key=lambda i: (self._group[i], self.dag.instructions[i].micro_batch))

    def _choices(self, x: np.ndarray) -> np.ndarray:
        """The option each instruction takes in a MILP solution x."""
        offsets = self._offsets
        return np.asarray([int(np.argmax(x[offsets[i]:offsets[i + 1]])) for i in range(self.dag.n)], dtype=int)

    def _clocks(self, choice: np.ndarray) -> np.ndarray:
        return np.asarray([self._kept_clocks[g][k] for g, k in zip(self._group, choice)], dtype=int)

    def _durations(self, choice) -> list[float]:
        return [float(self._kept_times[g][k]) for g, k in zip(self._group, choice)]

    def _cost(self, choice) -> float:
        """The plan's energy (J) as the MILP counts it: effective energies plus S * p * its critical path. The same
        accounting as PipelineDAG.iteration_energy_j (which a plan's reported energy_j comes from), written as the
        MILP's objective; its sums run in another order, so the two may differ in the last bits, and the plans
        compared by this one must stay compared by it."""
        effective = sum(float(self._kept_effective[g][k]) for g, k in zip(self._group, choice))
        return effective + self.gpus * self.blocking_power_w * self._graph.length(self._durations(choice))

    def _round_down(self, x_lp: np.ndarray, deadline_s: float) -> np.ndarray:
        """Each instruction's slowest kept option no slower than the LP's time for it, sum_k x[i, k] t[i, k]: every
        instruction is no slower than in the LP, whose start times then still meet the deadline; a repair pass
        speeds up what the LP's tolerance (1e-7) pushed past it."""
        offsets = self._offsets
        choice = np.empty(self.dag.n, dtype=int)
        for i, g in enumerate(self._group):
            times = self._kept_times[g]
            t_lp = float(x_lp[offsets[i]:offsets[i + 1]] @ times)
            choice[i] = max(0, int(np.searchsorted(times, t_lp * (1 + 1e-7), side="right")) - 1)
        return self._repair(choice, deadline_s)

    def _round_dither(self, x_lp: np.ndarray, deadline_s: float) -> np.ndarray:
        """The LP rounded by error diffusion: where the LP mixes a fast and a slow option of an instruction (x[i, k]
        > 0 on options lo < hi), the share of the slow one's time, a = (t_lp - t[lo]) / (t[hi] - t[lo]), accumulates
        over the micro-batches of its (stage, kind) in order, and the instruction takes hi when the sum reaches 1/2
        (then less 1), else lo: each stage's chain gets about the LP's count of slow options, at the same
        micro-batches on every stage where the LP mixes alike. Not feasible by construction: _repair follows."""
        offsets = self._offsets
        choice = np.empty(self.dag.n, dtype=int)
        carry: dict[int, float] = {}
        for i in self._by_micro_batch:
            g = self._group[i]
            share = x_lp[offsets[i]:offsets[i + 1]]
            support = np.flatnonzero(share > 1e-7)
            lo, hi = (int(support[0]), int(support[-1])) if len(support) else (0, 0)
            if lo == hi:
                choice[i] = lo
                continue
            times = self._kept_times[g]
            carry[g] = carry.get(g, 0.0) + (float(share @ times) - times[lo]) / (times[hi] - times[lo])
            choice[i] = hi if carry[g] >= 0.5 else lo
            carry[g] -= choice[i] == hi
        return self._repair(choice, deadline_s)

    def _repair(self, choice: np.ndarray, deadline_s: float) -> np.ndarray:
        """The plan made to meet the deadline: while some instruction lies on a path longer than it, speed up the
        late instruction whose faster option costs the least effective energy per second saved (a heap; the
        earliest starts and latest finishes updated after each move). Ends: every option at its fastest meets it."""
        graph, group, tol = self._graph, self._group, PLAN_TOLERANCE * max(1.0, deadline_s)
        times_of, effective_of = self._kept_times, self._kept_effective
        choice = np.asarray(choice, dtype=int).copy()
        d = self._durations(choice)
        es, lf = graph.earliest(d), graph.latest(d, deadline_s)

        def late(i):
            return es[i] + d[i] > lf[i] + tol

        def speed_up(i):  # (cost per second saved, option) of i's best faster option
            g, k = group[i], choice[i]
            rate = (effective_of[g][:k] - effective_of[g][k]) / (d[i] - times_of[g][:k])
            j = int(np.argmin(rate))
            return float(rate[j]), j

        heap = [(speed_up(i)[0], i) for i in range(self.dag.n) if late(i) and choice[i] > 0]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            if not late(i) or choice[i] == 0:
                continue
            choice[i] = speed_up(i)[1]
            d[i] = float(times_of[group[i]][choice[i]])
            graph.update(i, d, es, lf)
            if late(i) and choice[i] > 0:
                heapq.heappush(heap, (speed_up(i)[0], i))
        return choice

    def _reclaim(self, choice: np.ndarray, deadline_s: float) -> np.ndarray:
        """The plan slowed into its float (module docstring): repeatedly the move (one instruction to a slower kept
        option that fits within its total float under the deadline) that saves the most energy per second it adds,
        to a fixed point. Saving: its effective-energy drop minus S * p times what it adds to the critical path.
        Never slower than the deadline (its critical path stays at most deadline_s), never dearer than ``choice``."""
        graph, group, sp = self._graph, self._group, self.gpus * self.blocking_power_w
        times_of, effective_of = self._kept_times, self._kept_effective
        choice = [int(k) for k in choice]
        d = self._durations(choice)
        horizon, tol = deadline_s, PLAN_TOLERANCE * max(1.0, deadline_s)

        def best_move(i, es, lf, length):  # (saving per second added, option) of i's best slower option, or None
            g, k = group[i], choice[i]
            times = times_of[g]
            end = int(np.searchsorted(times, lf[i] - es[i] + tol, side="right"))  # the options within i's float
            if end <= k + 1:
                return None
            delta = times[k + 1:end] - d[i]
            change = effective_of[g][k + 1:end] - effective_of[g][k]
            if sp:  # what the move adds to the critical path: past the longest path through i, es + d + tail
                change = change + sp * np.maximum(0.0, es[i] + d[i] + horizon - lf[i] + delta - length)
            rate = -change / delta
            j = int(np.argmax(rate))
            return (float(rate[j]), k + 1 + j) if change[j] < -1e-12 else None

        while True:
            es, lf = graph.earliest(d), graph.latest(d, horizon)
            length = max(e + t for e, t in zip(es, d))
            heap = []
            for i in range(len(choice)):
                move = best_move(i, es, lf, length)
                if move is not None:
                    heap.append((-move[0], i))
            heapq.heapify(heap)
            applied = 0
            while heap:
                _, i = heapq.heappop(heap)
                move = best_move(i, es, lf, length)
                if move is None:
                    continue
                if heap and move[0] < -heap[0][0]:  # its rate fell since it was pushed: wait its turn
                    heapq.heappush(heap, (-move[0], i))
                    continue
                choice[i], d[i] = move[1], float(times_of[group[i]][move[1]])
                applied += 1
                graph.update(i, d, es, lf)
                length = max(length, es[i] + d[i] + horizon - lf[i])
                move = best_move(i, es, lf, length)
                if move is not None:
                    heapq.heappush(heap, (-move[0], i))
            if not applied:
                return np.asarray(choice, dtype=int)


class _Graph:
    """The instruction DAG as adjacency lists, with its forward and backward passes (plain Python: at N = 1536 one
    pass takes about a millisecond, less than numpy's per-call overhead on the few predecessors of each node)."""

    def __init__(self, dag: PipelineDAG) -> None:
        self.succ: list[list[int]] = [[] for _ in range(dag.n)]
        self.pred: list[list[int]] = [[] for _ in range(dag.n)]
        for a, b in dag.edges.tolist():
            self.succ[a].append(b)
            self.pred[b].append(a)
        self.order = dag.order.tolist()
        self.rank = [0] * dag.n  # each node's position in the topological order
        for position, node in enumerate(self.order):
            self.rank[node] = position

    def earliest(self, d: Sequence[float]) -> list[float]:
        """Each instruction's earliest start (s) given the durations d (s)."""
        es = [0.0] * len(d)
        for j in self.order:
            for p in self.pred[j]:
                es[j] = max(es[j], es[p] + d[p])
        return es

    def length(self, d: Sequence[float]) -> float:
        """The critical path (s) with durations d (s)."""
        return max(e + t for e, t in zip(self.earliest(d), d))

    def update(self, i: int, d: Sequence[float], es: list[float], lf: list[float]) -> None:
        """Update earliest starts es and latest finishes lf (in place) after instruction i's duration d[i] changed:
        each node after i is recomputed from all its predecessors, at most once and in topological order (its
        predecessors first), and only where a neighbour's value changed; likewise each node before i from its
        successors, in reverse order."""
        rank, pred, succ = self.rank, self.pred, self.succ
        heap = [(rank[v], v) for v in succ[i]]
        queued = set(succ[i])
        heapq.heapify(heap)
        while heap:
            _, v = heapq.heappop(heap)
            start = max(es[p] + d[p] for p in pred[v])
            if start != es[v]:
                es[v] = start
                for w in succ[v]:
                    if w not in queued:
                        queued.add(w)
                        heapq.heappush(heap, (rank[w], w))
        heap = [(-rank[p], p) for p in pred[i]]
        queued = set(pred[i])
        heapq.heapify(heap)
        while heap:
            _, p = heapq.heappop(heap)
            finish = min(lf[s] - d[s] for s in succ[p])
            if finish != lf[p]:
                lf[p] = finish
                for q in pred[p]:
                    if q not in queued:
                        queued.add(q)
                        heapq.heappush(heap, (-rank[q], q))

    def latest(self, d: Sequence[float], horizon_s: float) -> list[float]:
        """Each instruction's latest finish (s) for the iteration to end by horizon_s."""
        lf = [horizon_s] * len(d)
        for i in reversed(self.order):
            for s in self.succ[i]:
                lf[i] = min(lf[i], lf[s] - d[s])
        return lf
