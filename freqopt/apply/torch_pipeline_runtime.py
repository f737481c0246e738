"""The DVFS runtime inside a ``torch.distributed.pipelining`` schedule (issue 37, item 2).

PyTorch's pipeline schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ...;
freqopt.search.schedules) run each action of a rank on its PipelineStage objects: ``forward_one_chunk`` for a
forward, ``backward_one_chunk`` for a backward (``full_backward=False``: its input gradient alone, in the
zero-bubble schedules) and ``backward_weight_one_chunk`` for a weight gradient. TorchPipelineRuntime wraps those
three methods on the rank's own stage instances (nothing global is patched): as an action begins it asks for the
clock its plan gives that (model stage, instruction kind, micro-batch), where it differs from the last one asked
for. The request goes on the queue of a worker thread (freqopt.apply.runtime's ``_Worker``, the one the
DeepSpeed runtimes use), which waits for the GPU to reach the action (a CUDA event recorded on the current stream)
and applies the setting; the training thread never calls NVML and never waits. On exit, by exception or signal
included, the hooks come off and the backend is closed, which restores the GPU's clocks and power limit.

The plan is per instruction, as the pipeline search validated it (``rank_plan``: a PipelineSearchResult's
``stage_requests``, the clocks asked for one switch latency ahead), keyed by (model stage, kind, micro-batch): the
schedule's own order decides when each is asked for, so the runtime holds no copy of the order to fall out of
step with. An action the plan does not name runs at the default setting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import torch

from freqopt.apply.runtime import _STOP, _Worker
from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting

__all__ = ["TorchPipelineRuntime", "rank_plan", "STAGE_METHODS"]

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
        self.plan = {}
        for key, value in (plan or {}).items():
            if not (isinstance(key, tuple) and len(key) == 3 and key[1] in _KINDS):
                raise InvalidSettingError(f"plan keys must be (model stage, kind, micro-batch) with kind one of "
                                          f"{', '.join(_KINDS)}, not {key!r}", argument="plan")  # fmt: skip
            self.plan[(int(key[0]), key[1], int(key[2]))] = _setting(value)
        self.backend = backend
        self.simulated = getattr(backend, "simulated", False)
        self.requested: list[tuple[int, str, int, ClockSetting]] = []
        self.switches = 0
        self._current: ClockSetting | None = None
        self._lock = threading.Lock()
        self._worker = _Worker(backend)
        self._thread = threading.Thread(target=self._worker.run, name="freqopt-dvfs-torch-pipeline", daemon=True)
        self._hooked: list[tuple[object, str]] = []

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
            self._worker.requests.put(_STOP)  # the worker drains what is queued (the latest request only), then stops
            self._thread.join(timeout=30)
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
