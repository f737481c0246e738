"""Pipeline schedules as PyTorch's ``torch.distributed.pipelining`` orders them, as instruction DAGs.

Each schedule class of ``torch.distributed.pipelining.schedules`` computes, when it is built, every rank's list of
actions for one iteration (its ``pipeline_order``: compute actions F, B, I, W and, for DualPipeV, overlapped F+B
pairs); freqopt takes those lists from the classes themselves instead of deriving the orders by hand. A schedule is
built on stand-ins for its stages (``_StageStandIn``: the stage index, the stage count, the rank and the group size,
which is all the order depends on), so no process group, model or device is needed.

Names (``SCHEDULES``) and what they run, S ranks (GPUs) and M micro-batches:

======================  ====================================  ==========================  =======================
name                    torch class                           model stages per rank       backward
======================  ====================================  ==========================  =======================
``1f1b``                (DeepSpeed's TrainSchedule; freqopt.pipeline.dag.one_f_one_b: see below)
``gpipe``               ScheduleGPipe                         1                           whole
``interleaved-1f1b``    ScheduleInterleaved1F1B               v (looped: r, r + S, ...)   whole
``looped-bfs``          ScheduleLoopedBFS                     v (looped)                  whole
``interleaved-zb``      ScheduleInterleavedZeroBubble         v (looped)                  input and weight (I, W)
``zb-v``                ScheduleZBVZeroBubble                 2 (V: r and 2S - 1 - r)     input and weight
``dualpipe-v``          ScheduleDualPipeV                     2 (V)                       whole, and I, W
======================  ====================================  ==========================  =======================

``1f1b`` keeps DeepSpeed's order (deepspeed_1f1b_order; freqopt.pipeline.dag.stage_order), which torch's Schedule1F1B also runs: its
runtime loop is written by hand, and the IR it exposes (``pipeline_order``, which its dry run and visualizer read)
matches DeepSpeed's on every rank but the last, whose forwards it numbers from 1 to M instead of 0 to M - 1 in
torch 2.13 (tests/test_schedules.py watches this; every other schedule's IR is what its runtime executes, and is
checked complete before use).

Instructions: ``forward``, ``backward`` (the whole backward), ``backward_input`` (the input gradient, I: what the
previous stage waits for) and ``backward_weight`` (the weight gradient, W: nothing waits for it but the same
stage's optimizer step). A DualPipeV OVERLAP_F_B action (one micro-batch's forward run alongside another's
backward on two streams) is taken as its forward then its backward, one after the other: the overlap is not
modelled, so the time is an upper bound there.

The DAG's edges (freqopt.pipeline.dag.PipelineDAG): each rank's own order (one GPU runs one instruction at a
time); forward(k, m) after forward(k - 1, m); the backward (or backward_input) of (k, m) after the backward or
backward_input of (k + 1, m), and after forward(k, m); backward_weight(k, m) after backward_input(k, m). The edges
are those of torch's own dry run (``_simulate_comms_compute``: an action is ready when the action it receives from
is done), with P2P transfers taking no time, as in Perseus's emulation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from freqopt.errors import InvalidSettingError, check_positive_int

__all__ = ["TORCH_SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "rank_orders",
           "deepspeed_1f1b_order", "torch_rank_orders", "stages_per_rank", "rank_of_stage", "expected_kinds"]

BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"
# freqopt's name -> the torch.distributed.pipelining.schedules class that orders it.
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}
V_SHAPED = frozenset({"zb-v", "dualpipe-v"})  # rank r holds stages r and 2S - 1 - r
SINGLE = frozenset({"gpipe", "1f1b"})  # one model stage per rank
SPLIT_BACKWARD = frozenset({"interleaved-zb", "zb-v", "dualpipe-v"})  # orders backward_input and backward_weight
DEFAULT_VIRTUAL = 2  # model stages per rank where a schedule takes several and none is given


def stages_per_rank(schedule: str, virtual_stages: int | None = None) -> int:
    """How many model stages each rank runs under ``schedule``: 1 for gpipe and 1f1b, 2 for the V-shaped ones,
    ``virtual_stages`` (default 2) for the looped ones.

    Raises:
        InvalidSettingError: an unknown schedule, or a stage count the schedule does not take.
    """
    _check_schedule(schedule)
    if schedule in SINGLE or schedule in V_SHAPED:
        fixed = 1 if schedule in SINGLE else 2
        if virtual_stages not in (None, fixed):
            raise InvalidSettingError(f"virtual_stages {virtual_stages}: schedule {schedule} runs {fixed} model "
                                      f"stage(s) per rank; leave it out", argument="virtual_stages")  # fmt: skip
        return fixed
    if virtual_stages is None:
        return DEFAULT_VIRTUAL
    check_positive_int("virtual_stages", virtual_stages)
    return virtual_stages


def rank_of_stage(schedule: str, ranks: int, stage: int, virtual_stages: int | None = None) -> int:
    """The rank (GPU) that runs model stage ``stage`` of ``ranks * stages_per_rank`` under ``schedule``: looped
    (stage mod ranks) or V-shaped (stage r and 2 ranks - 1 - r on rank r), as torch's
    generate_stage_to_rank_mapping places them."""
    v = stages_per_rank(schedule, virtual_stages)
    if schedule in V_SHAPED:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks if v > 1 else stage


def rank_orders(schedule: str, ranks: int, micro_batches: int,
                virtual_stages: int | None = None) -> tuple[tuple[tuple[int, str, int], ...], ...]:  # fmt: skip
    """Every rank's compute instructions for one iteration, in the order torch.distributed.pipelining's schedule
    runs them: per rank, a tuple of (model stage, kind, micro-batch), kind one of forward, backward,
    backward_input, backward_weight (module docstring).

    Args:
        schedule: one of TORCH_SCHEDULES.
        ranks: S, the pipeline's GPUs.
        micro_batches: M; the schedules that interleave need M divisible by S (torch's rule), which is checked.
        virtual_stages: model stages per rank, for the looped schedules (default 2).

    Raises:
        InvalidSettingError: an unknown schedule, S or M not a positive integer, or a combination torch's schedule
            refuses (its message, in one line).
    """
    check_positive_int("stages", ranks)
    check_positive_int("micro_batches", micro_batches)
    v = stages_per_rank(schedule, virtual_stages)
    if schedule == "1f1b":  # torch's IR for it misnumbers the last rank's forwards (module docstring)
        return tuple(deepspeed_1f1b_order(ranks, micro_batches, r) for r in range(ranks))
    orders = _rank_orders(schedule, ranks, micro_batches, v)
    _check_complete(schedule, orders, ranks * v, micro_batches)
    return orders


def deepspeed_1f1b_order(stages: int, micro_batches: int, stage: int) -> tuple[tuple[int, str, int], ...]:
    """The (stage, kind, micro-batch) instructions stage ``stage`` of DeepSpeed's non-interleaved 1F1B
    ``TrainSchedule`` runs, in order (freqopt.pipeline.dag's module docstring): the forwards of micro-batches
    0 .. w-1 (w = min(stages - stage, micro_batches)), then backward m and forward m + w alternately, then the
    backwards left."""
    warmup = min(stages - stage, micro_batches)
    order = [(stage, "forward", m) for m in range(warmup)]
    next_forward = warmup
    for m in range(micro_batches):
        order.append((stage, "backward", m))
        if next_forward < micro_batches:
            order.append((stage, "forward", next_forward))
            next_forward += 1
    return tuple(order)


def torch_rank_orders(schedule: str, ranks: int, micro_batches: int, virtual_stages: int | None = None):
    """rank_orders as torch's schedule class gives them, unchecked (1f1b included): for tests and comparison."""
    return _rank_orders(schedule, ranks, micro_batches, stages_per_rank(schedule, virtual_stages))


def _check_complete(schedule: str, orders, n_stages: int, micro_batches: int) -> None:
    """Every model stage runs each micro-batch's forward once, and its backward (whole, or input and weight
    gradients) once: what a schedule must do, checked on torch's order before freqopt builds on it."""
    seen = sorted(inst for order in orders for inst in order)
    forwards = sorted((k, "forward", m) for k in range(n_stages) for m in range(micro_batches))
    if sorted(i for i in seen if i[1] == "forward") != forwards or len(set(seen)) != len(seen):
        raise AssertionError(f"torch's {schedule} order does not run every forward of {n_stages} stages x "
                             f"{micro_batches} micro-batches exactly once")  # fmt: skip


@functools.lru_cache(maxsize=64)
def _rank_orders(schedule: str, ranks: int, micro_batches: int, v: int):
    import torch
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_SCHEDULES[schedule])
    n_stages = ranks * v
    orders = []
    for rank in range(ranks):
        mine = [s for s in range(n_stages) if rank_of_stage(schedule, ranks, s, v if v > 1 else None) == rank]
        stand_ins = [_StageStandIn(s, n_stages, ranks, rank, torch.nn.Identity()) for s in mine]
        try:
            built = cls(stand_ins[0], micro_batches) if schedule in SINGLE else cls(stand_ins, micro_batches)
        except (ValueError, AssertionError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidSettingError(f"micro_batches {micro_batches}: torch.distributed.pipelining's "
                                      f"{cls.__name__} refuses {ranks} stages x {micro_batches} micro-batches (x {v} "
                                      f"per rank): {first}", argument="micro_batches") from None  # fmt: skip
        actions = (built.pipeline_order or {}).get(rank, [])
        orders.append(tuple(inst for action in actions if action is not None for inst in _instructions(action)))
    return tuple(orders)


def _instructions(action) -> list[tuple[int, str, int]]:
    """A torch _Action as freqopt instructions: compute actions only (communication, resharding and gradient
    reduction are not instructions); an overlapped F+B pair as its two parts in order."""
    kind = getattr(action.computation_type, "value", str(action.computation_type))
    if getattr(action, "sub_actions", None):
        return [inst for sub in action.sub_actions for inst in _instructions(sub)]
    names = {"F": "forward", "B": "backward", "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
    if kind not in names:
        return []
    return [(int(action.stage_index), names[kind], int(action.microbatch_index))]


class _StageStandIn:
    """What a torch.distributed.pipelining schedule reads of its stages when it computes its order: the stage's
    index, the stage count, the pipeline group's size and this rank, its first/last flags and a module (checked to
    be one, for torch.compile compatibility). It holds no model and no process group."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int, submod):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = submod
        self.stage_index_to_group_rank: dict[int, int] = {}


def _check_schedule(schedule: str) -> None:
    if schedule not in TORCH_SCHEDULES:
        raise InvalidSettingError(f"schedule {schedule!r} is unknown; known: {', '.join(TORCH_SCHEDULES)}",
                                  argument="schedule")  # fmt: skip


def expected_kinds(schedule: str) -> Sequence[str]:
    """The instruction kinds ``schedule`` orders: forward and backward, and for the zero-bubble ones also
    backward_input and backward_weight."""
    _check_schedule(schedule)
    if schedule == "dualpipe-v":
        return ("forward", "backward", BACKWARD_INPUT, BACKWARD_WEIGHT)
    if schedule in SPLIT_BACKWARD:
        return ("forward", BACKWARD_INPUT, BACKWARD_WEIGHT)
    return ("forward", "backward")
