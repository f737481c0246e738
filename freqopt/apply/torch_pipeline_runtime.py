"""The DVFS runtime inside a ``torch.distributed.pipelining`` schedule.

PyTorch's pipeline schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ...;
freqopt.pipeline.schedules) run each action of a rank on its PipelineStage objects: ``forward_one_chunk`` for a
forward, ``backward_one_chunk`` for a backward (``full_backward=False``: its input gradient alone, in the
zero-bubble schedules) and ``backward_weight_one_chunk`` for a weight gradient. TorchPipelineRuntime wraps those
three methods on the rank's own stage instances (nothing global is patched): as an action begins it asks for the
clock its plan gives that (model stage, instruction kind, micro-batch), where it differs from the last one asked
for. The request goes on the queue of a worker thread (freqopt.apply.runtime's ``ClockWorker``, the one the
DeepSpeed runtimes use), which waits for the GPU to reach the action (a CUDA event recorded on the current stream)
and applies the setting; the training thread never calls NVML and never waits. On exit, by exception or signal
included, the hooks come off and the backend is closed, which restores the GPU's clocks and power limit.

The plan is per instruction, as the pipeline search validated it (``rank_plan``: a PipelineSearchResult's
``stage_requests``, the clocks asked for one switch latency ahead), keyed by (model stage, kind, micro-batch): the
schedule's own order decides when each is asked for, so the runtime holds no copy of the order to fall out of
step with. An action the plan does not name runs at the default setting.

Stragglers: ``StragglerFollower`` keeps a pipeline's plans along its frontier and, every N steps, learns the
slowest data-parallel pipeline's pace (an all-reduce of one float per pipeline) or takes it from a scheduler that
knows it; ``TorchPipelineRuntime.follow`` switches to the plan it picks from the next action on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import torch

from freqopt.apply.runtime import ClockWorker, stop_clock_worker
from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting

__all__ = ["TorchPipelineRuntime", "StragglerFollower", "rank_plan", "STAGE_METHODS"]

# The PipelineStage methods a schedule runs its compute actions through, and the instruction kind of each
# (backward_one_chunk's kind depends on its full_backward argument).
STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def rank_plan(result, rank: int, granularity: str = "instruction") -> dict[tuple[int, str, int], int]:
    """GPU ``rank``'s plan from a pipeline search (freqopt.search_pipeline's PipelineSearchResult, any schedule):
    (model stage, kind, micro-batch) -> the SM clock (MHz) to ask for as that action begins (the validated
    requests of level ``granularity``, stage_requests).

    Raises:
        InvalidSettingError: ``rank`` is not one of the pipeline's GPUs.
        KeyError: ``granularity`` was not searched.
    """
    requests = result.stage_requests(granularity)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(requests):
        raise InvalidSettingError(f"rank must be an integer in [0, {len(requests)}), not {rank!r}", argument="rank")
    return {(int(i.get("model_stage", rank)), i["kind"], int(i["micro_batch"])): int(i["sm_clock_mhz"])
            for i in requests[rank]["instructions"]}  # fmt: skip


class TorchPipelineRuntime:
    """Apply an instruction-level plan on one rank of a torch.distributed.pipelining schedule (module docstring).

    Args:
        stages: this rank's PipelineStage (or the list of them, for the schedules that run several per rank).
        plan: (model stage, kind, micro-batch) -> SM clock (MHz), ClockSetting or None (the default); kinds
            "forward", "backward", "backward_input", "backward_weight". None: every action at the default clocks
            (the actions still counted).
        backend: this rank's GPU (NVMLBackend), or a SimulatedGPU; closed (the GPU restored) on exit.

    Attributes:
        requested: every action begun inside the runtime, in order: (model stage, kind, micro-batch, setting).
        switches: requests put on the worker's queue (where the setting changes), the first action's included.

    Raises:
        InvalidSettingError: a stage without the PipelineStage methods, or a plan key or value that is not one.
    """

    def __init__(self, stages, *, plan: Mapping | None, backend: Backend):
        self.stages = list(stages) if isinstance(stages, Iterable) and not hasattr(stages, "forward_one_chunk") \
            else [stages]  # fmt: skip
        for stage in self.stages:
            if not all(callable(getattr(stage, name, None)) for name in STAGE_METHODS) or not hasattr(stage, "stage_index"):
                raise InvalidSettingError(f"stages must be torch.distributed.pipelining PipelineStages, not "
                                          f"{type(stage).__name__}", argument="stages")  # fmt: skip
        self._lock = threading.Lock()
        self.follow(plan)
        self.backend = backend
        self.simulated = getattr(backend, "simulated", False)
        self.requested: list[tuple[int, str, int, ClockSetting]] = []
        self.switches = 0
        self._current: ClockSetting | None = None
        self._worker = ClockWorker(backend)
        self._thread = threading.Thread(target=self._worker.run, name="freqopt-dvfs-torch-pipeline", daemon=True)
        self._hooked: list[tuple[object, str]] = []

    def follow(self, plan) -> None:
        """Run ``plan`` from the next action on (e.g. the one StragglerFollower.step_done returned); same form as
        the constructor's ``plan``.

        Raises:
            InvalidSettingError: as the constructor's plan.
        """
        checked = {}
        for key, value in (plan or {}).items():
            if not (isinstance(key, tuple) and len(key) == 3 and key[1] in _KINDS):
                raise InvalidSettingError(f"plan keys must be (model stage, kind, micro-batch) with kind one of "
                                          f"{', '.join(_KINDS)}, not {key!r}", argument="plan")  # fmt: skip
            checked[(int(key[0]), key[1], int(key[2]))] = _setting(value)
        with self._lock:
            self.plan = checked

    def _on_action(self, stage_index: int, kind: str, micro_batch: int) -> None:
        """An action begins: ask for its planned setting if it differs from the last one asked for. Never waits:
        no NVML call, no synchronization."""
        if self._worker.error is not None:
            raise self._worker.error
        setting = self.plan.get((stage_index, kind, micro_batch), DEFAULT_SETTING)
        with self._lock:
            self.requested.append((stage_index, kind, micro_batch, setting))
            if setting == self._current:
                return
            self._current = setting
            self.switches += 1
        event = None
        if torch.cuda.is_available() and not self.simulated:
            event = torch.cuda.Event()
            event.record()  # on the current stream: the worker waits for the GPU to reach the action
        self._worker.requests.put((event, setting))

    def _hook(self) -> None:
        """Wrap the three compute methods on each of this rank's stage instances."""
        for stage in self.stages:
            index = int(stage.stage_index)
            forward, backward, weight = (getattr(stage, name) for name in STAGE_METHODS)

            def hooked_forward(fwd_chunk_id, *args, _index=index, _run=forward, **kwargs):
                self._on_action(_index, "forward", int(fwd_chunk_id))
                return _run(fwd_chunk_id, *args, **kwargs)

            def hooked_backward(bwd_chunk_id, *args, _index=index, _run=backward, **kwargs):
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                self._on_action(_index, "backward" if full else "backward_input", int(bwd_chunk_id))
                return _run(bwd_chunk_id, *args, **kwargs)

            def hooked_weight(bwd_chunk_id, *args, _index=index, _run=weight, **kwargs):
                self._on_action(_index, "backward_weight", int(bwd_chunk_id))
                return _run(bwd_chunk_id, *args, **kwargs)

            for name, hooked in zip(STAGE_METHODS, (hooked_forward, hooked_backward, hooked_weight)):
                setattr(stage, name, hooked)
                self._hooked.append((stage, name))

    def _unhook(self) -> None:
        for stage, name in self._hooked:
            stage.__dict__.pop(name, None)  # the class's method again
        self._hooked = []

    def __enter__(self) -> TorchPipelineRuntime:
        self._thread.start()
        self._hook()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._unhook()
            stop_clock_worker(self._worker, self._thread)
        finally:
            self.backend.close()


_KINDS = ("forward", "backward", "backward_input", "backward_weight")


def _setting(value) -> ClockSetting:
    if value is None:
        return DEFAULT_SETTING
    if isinstance(value, ClockSetting):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ClockSetting(sm_clock_mhz=value)
    raise InvalidSettingError(f"plan values must be SM clocks in MHz, ClockSettings or None, not {value!r}",
                              argument="plan")  # fmt: skip


class StragglerFollower:
    """Which of a pipeline's plans to run so that it ends with the slowest data-parallel pipeline
    (freqopt.pipeline.stragglers says why): every ``every_n_steps`` steps each pipeline reports the iteration time
    it would take on its fastest plan - its measured time scaled by the fastest plan's predicted time over the
    running plan's - and the reports are all-reduced to their maximum, the slowest pipeline's own pace; each
    pipeline then runs the least-energy plan (the slowest of ``plans``) predicted to fit that pace, and returns to
    the fastest when the straggler recovers (its report falls).

    Args:
        plans: (predicted iteration time s, plan) pairs from one pipeline's frontier (e.g. each from
            freqopt.pipeline.stragglers.matched_requests and rank_plan at a deadline), any order; the fastest is run
            first.
        every_n_steps: steps between reductions (an all-reduce of one float; default 10).
        reduce_max: maps this pipeline's report (s) to the maximum over the data-parallel pipelines; default: a
            torch.distributed all_reduce (MAX) over ``group``, on the GPU under NCCL (call it on every rank of the
            group alike); where the process group is not initialized, the pipeline's own report only, for a
            scheduler that knows the straggler (``set_straggler_time_s``).
        group: the data-parallel process group of this pipeline stage's ranks (one rank per pipeline).

    Raises:
        InvalidSettingError: no plans, a time that is not positive, or every_n_steps not a positive integer.
    """

    def __init__(self, plans, *, every_n_steps: int = 10, reduce_max=None, group=None):
        from freqopt.errors import check_positive_int

        check_positive_int("every_n_steps", every_n_steps)
        ranked = sorted(((float(t), p) for t, p in plans), key=lambda tp: tp[0])
        if not ranked or ranked[0][0] <= 0:
            raise InvalidSettingError("plans must be one or more (predicted iteration time > 0 s, plan) pairs",
                                      argument="plans")  # fmt: skip
        self.plans = ranked
        self.every_n_steps = every_n_steps
        self.reduce_max = reduce_max if reduce_max is not None else _all_reduce_max(group)
        self.current = 0  # index into plans of the plan running
        self.steps = 0
        self.reports: list[float] = []  # this pipeline's fastest-plan times since the last reduction
        self.straggler_time_s: float | None = None  # the last pace learnt
        self.pace = 1.0  # this pipeline's measured time on its fastest plan over the predicted

    @property
    def plan(self):
        """The plan to run now."""
        return self.plans[self.current][1]

    def step_done(self, time_s: float):
        """Record one finished step's own iteration time (s): this pipeline's, up to its last instruction, before
        the data-parallel gradient all-reduce (not the wait for the other pipelines there, which would hide a
        recovered straggler); every ``every_n_steps`` steps, learn the slowest pipeline's pace and return the plan
        to run from the next step where it changes, else None."""
        self.reports.append(time_s * self.plans[0][0] / self.plans[self.current][0])
        self.steps += 1
        if self.steps % self.every_n_steps:
            return None
        mine = max(self.reports)  # the slowest of this pipeline's own recent steps, on its fastest plan
        self.reports = []
        self.pace = mine / self.plans[0][0]  # this pipeline's own slowness: >1 where it is the straggler
        return self.set_straggler_time_s(float(self.reduce_max(mine)))

    def set_straggler_time_s(self, time_s: float):
        """Run the slowest plan predicted to fit an iteration of ``time_s`` (s; the fastest where none is slower),
        each plan's predicted time scaled by this pipeline's own slowness (1 unless it is the straggler itself);
        returns that plan where it changes, else None."""
        self.straggler_time_s = time_s
        fits = [i for i, (t, _) in enumerate(self.plans) if t * self.pace <= time_s * (1 + 1e-9)]
        chosen = max(fits) if fits else 0
        if chosen == self.current:
            return None
        self.current = chosen
        return self.plan


def _all_reduce_max(group):
    """The maximum of a float over ``group`` by torch.distributed (MAX all-reduce of one tensor: on this rank's
    CUDA device under NCCL, which reduces GPU tensors only; on the CPU otherwise), or the float itself without a
    process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return lambda value: value

    nccl = dist.get_backend(group) == "nccl"

    def reduce(value: float) -> float:
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return float(tensor.item())

    return reduce
