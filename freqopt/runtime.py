"""The DVFS runtime: applies a clock table to a running PyTorch or DeepSpeed training job.

    with DVFSRuntime(model, optimizer, table=table, backend=backend, workload=workload) as runtime:
        for batch in batches:
            loss = model(batch, batch)
            loss.backward()
            optimizer.step()          # the step pre-hook marks the optimizer phase
            optimizer.zero_grad()

The table is laid onto the workload's trace (freqopt.transfer: exact class, else kind and intensity) and made
realizable (freqopt.search.realize): one setting per phase, a switch only into a run of phases at least as long as
the GPU's switch latency. Phase boundaries are module hooks (forward pre-hooks and full backward pre-hooks of the
phase modules) and the optimizer step, the same marks the tracer recorded, so the runtime knows which phase the
job is entering by counting marks. A switch is never issued from the training thread: the hook records a CUDA event
on the current stream and hands (event, setting) to a controller thread, which waits for the event (the GPU has
reached the boundary) and then calls NVML, as Perseus does; the training stream is never synchronized. On exit,
error or signal the backend restores the GPU (freqopt.nvml.GPUStateGuard).

On the simulated backend there is no GPU to switch: the controller applies each setting to the simulated GPU, which
only records it (``SimulatedGPU.applied``), and ``step_measurement()`` measures the traced iteration with the
settings the runtime actually asked for, switch latency included, so a table's realizable savings can be measured
without a GPU.
"""

from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass, field

import torch

from freqopt.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.fingerprint import check_trace_module, unwrap_module
from freqopt.kernels import Trace
from freqopt.phases import _HOOK_WARNING, STEP_MARK, PhaseHooks, phase_spans
from freqopt.search.realize import Realizer
from freqopt.search.schedule import requested_per_phase
from freqopt.tables import ClockTable
from freqopt.transfer import transfer_table

__all__ = ["PhasePlan", "DVFSRuntime", "plan_phases"]


@dataclass(frozen=True)
class PhasePlan:
    """What the runtime applies: per phase (in trace order) its label, kernel span and setting.

    Attributes:
        labels: the mark that opens each phase ("start" for the kernels before the first mark).
        spans: (first kernel, end kernel) of each phase.
        settings: the realizable setting of each phase.
    """

    labels: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    settings: tuple[ClockSetting, ...]

    def per_kernel(self, phase_settings: list[ClockSetting], n_kernels: int) -> list[ClockSetting]:
        out = [DEFAULT_SETTING] * n_kernels
        for (first, end), setting in zip(self.spans, phase_settings):
            out[first:end] = [setting] * (end - first)
        return out


def plan_phases(table: ClockTable | None, trace: Trace, backend: Backend) -> PhasePlan:
    """The realizable phase settings of ``table`` on ``trace`` on ``backend``'s GPU (all default when ``table`` is
    None): freqopt.search.realize.Realizer, weighing phases by ``backend.kernel_times_s`` at the default setting
    (the simulated physics on a simulated GPU, kernels timed on the device on a real one) and switching only
    where a run of phases outlasts the GPU type's clock-switch latency.

    A phase-level table (freqopt.search.schedule) is applied as it stands: each entry's setting is requested at
    its ``request_phase``.

    Raises:
        InvalidSettingError: ``backend`` is not a Backend (a GPU type, say, which realization cannot time kernels on).
        ClockTableError: a phase-level table whose request phases this trace does not have.
    """
    if not isinstance(backend, Backend):
        raise InvalidSettingError(f"backend must be a Backend such as freqopt.get_backend('sim', gpu), not "
                                  f"{type(backend).__name__}")  # fmt: skip
    spans = phase_spans(trace.meta.get("marks", ()), len(trace))
    labels = tuple(label for label, _, _ in spans)
    if table is not None and table.granularity == "phase":
        return PhasePlan(labels, tuple((a, b) for _, a, b in spans), requested_per_phase(table, labels))
    if table is None:
        per_kernel = [DEFAULT_SETTING] * len(trace)
    else:
        per_kernel = list(Realizer(trace, backend)(transfer_table(table, trace).per_kernel()))
    return PhasePlan(labels, tuple((a, b) for _, a, b in spans), tuple(per_kernel[a] for _, a, _ in spans))


@dataclass
class _Controller:
    """The thread that applies settings once the GPU reaches the boundary that asked for them."""

    backend: Backend
    requests: queue.Queue = field(default_factory=queue.Queue)
    error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:
                return
            event, setting = item
            try:
                if event is not None:
                    event.synchronize()  # this thread waits for the GPU; the training stream does not
                self.backend.apply(setting)
            except BaseException as e:  # surfaced to the training thread at the next boundary
                self.error = e


class DVFSRuntime:
    """Apply a clock table to a training job at phase boundaries (module docstring).

    While entered it also silences PyTorch's UserWarning "Full backward hook is firing when gradients are computed
    with respect to module outputs since no inputs require gradients", which its backward hook on the embeddings
    (whose inputs are token ids) raises every step: a ``warnings.catch_warnings()`` with one "ignore" filter for that
    message, entered with the runtime and exited with it (so, as with any catch_warnings, filters changed inside
    the ``with`` block are restored on exit too).

    Args:
        model: the module being trained; a DeepSpeed engine, DDP or ``torch.compile`` wrapper is looked through to
            the module it wraps (freqopt.fingerprint.unwrap_module).
        optimizer: a torch.optim.Optimizer whose step marks the optimizer phase, or None (call ``mark_step()``).
        table: the clock table; None runs at default settings (still counting phases).
        backend: the GPU the job runs on (NVMLBackend), or a simulated one (``backend.simulated``: a SimulatedGPU,
            whose timeline step_measurement reads).
        trace: the trace of the job's workload (trace_iteration), whose marks the hooks follow.
        check_trace: refuse a ``model`` the trace was not recorded from (freqopt.fingerprint); False lets a module
            with the same phase modules follow another module's trace (a small model driving a large model's
            simulated timeline, as the tests do).

    Raises:
        TraceMismatchError: ``check_trace`` and the trace is of a module of another structure (a trace recorded
            without a fingerprint is accepted with a TraceFingerprintWarning).
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, *, table: ClockTable | None, backend: Backend,
                 trace: Trace, check_trace: bool = True):  # fmt: skip
        model = unwrap_module(model)
        if check_trace:
            check_trace_module(trace, model)
        self.model, self.optimizer, self.backend, self.trace = model, optimizer, backend, trace
        self.simulated = backend.simulated
        self.plan = plan_phases(table, trace, backend)
        self._expected = self.plan.labels
        self._position = 0  # index of the phase the job is in
        self._current = self.plan.settings[-1]  # the clocks a previous step left (set before the first step)
        self._requested = list(self.plan.settings)  # the setting in force in each phase of the current step
        self._hooks = PhaseHooks(model, self._on_mark)
        self._handles: list = []
        self._controller = _Controller(backend)
        self._thread = threading.Thread(target=self._controller.run, name="freqopt-dvfs", daemon=True)
        self._warnings = warnings.catch_warnings()
        self.switches = 0

    @classmethod
    def for_deepspeed(cls, engine, **kwargs) -> DVFSRuntime:
        """A runtime for a DeepSpeed engine: hooks on ``engine.module``, the optimizer phase at ``engine.step()``."""
        runtime = cls(engine.module, None, **kwargs)
        step = engine.step

        def marked_step(*args, **kw):
            runtime.mark_step()
            return step(*args, **kw)

        engine.step = marked_step
        runtime._restore_engine = (engine, step)
        return runtime

    # -- phase tracking ------------------------------------------------------------------------------------------
    def _on_mark(self, label: str) -> None:
        if self._controller.error is not None:
            raise self._controller.error
        labels = self._expected
        # The next phase opened by this mark, after the current one (wrapping into the next step): each mark
        # occurs once per step, so counting them locates the job in the trace.
        n = len(labels)
        for offset in range(1, n + 1):
            j = (self._position + offset) % n
            if labels[j] == label:
                break
        else:
            return  # a boundary the trace does not have: stay in the current phase
        self._position = j
        setting = self.plan.settings[j]
        self._requested[j] = setting
        if setting != self._current:
            event = None
            if torch.cuda.is_available() and not self.simulated:
                event = torch.cuda.Event()
                event.record()
            self._controller.requests.put((event, setting))
            self._current = setting
            self.switches += 1

    def mark_step(self) -> None:
        """The optimizer phase begins (called by the optimizer's step pre-hook, or by hand)."""
        self._on_mark(STEP_MARK)

    def step_measurement(self) -> Measurement:
        """The simulated iteration with the settings this runtime requested in the last step, switch latency
        included (simulated backend only).

        Raises:
            TypeError: on a real GPU, where the job itself is the measurement.
        """
        if not self.simulated:
            raise TypeError("step_measurement() is for the simulated backend; time a real step with CUDA events")
        settings = self.plan.per_kernel(self._requested, len(self.trace))
        return self.backend.measure_schedule(self.trace.kernels, settings, key="runtime-step", switching=True)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> DVFSRuntime:
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
        self._thread.start()
        self._hooks.__enter__()
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self._handles.append(self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.mark_step()))
        # The clocks the steady state starts with, before the first step.
        self._controller.requests.put((None, self._current))
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        engine_step = getattr(self, "_restore_engine", None)
        if engine_step:
            engine_step[0].step = engine_step[1]
        self._controller.requests.put(None)
        self._thread.join(timeout=30)
        self._warnings.__exit__(*exc)
        self.backend.close()
