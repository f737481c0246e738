"""The DVFS runtime: applies a clock table to a running PyTorch or DeepSpeed training job.

    with DVFSRuntime(model, optimizer, table=table, backend=backend, trace=trace) as runtime:
        for batch in batches:
            loss = model(batch, batch)
            loss.backward()
            optimizer.step()          # the step pre-hook marks the optimizer phase
            optimizer.zero_grad()

The table must have been found for the trace's workload (ClockTable.check_workload: model, layout, micro-batch,
sequence length); one found for another is laid onto it with ``freqopt transfer`` first. It is laid onto the
trace's kernels (freqopt.apply.transfer: exact class, else kind and intensity) and made realizable
(freqopt.search.realize): one setting per phase, a switch only into a run of phases at least as long as the GPU's
switch latency, and each switch asked for one latency ahead, at the last phase boundary at least
``GPUSpec.clock_switch_s`` of kernel time before the run where it must land (realize.requested_settings, the
look-ahead the phase-schedule granularity plans with; a phase-level table carries its requests already). Phase
boundaries are module hooks (forward pre-hooks and full backward pre-hooks of the phase modules) and the optimizer
step, the same marks the tracer recorded, so the runtime knows which phase the job is entering by counting marks.

The training thread never waits for NVML: at a boundary the hook only puts (CUDA event, setting) on a queue
(queue.Queue), and only when the setting differs from the one last requested. A worker thread takes each request,
waits for its event (the GPU has reached the boundary; the worker waits, the training stream is never
synchronized), lets a later request the GPU has reached too supersede it (set calls that fell behind are not
replayed), skips a setting the GPU already holds, and calls the backend (NVML set calls block for 10-20 ms,
ml-energy/zeus#29). An error in a set call is raised in the training thread at its next boundary. On exit,
error or signal the queue is drained, the worker stopped and the backend restores the GPU
(freqopt.gpu.nvml.GPUStateGuard).

The worker times every switch it makes (the backend's set calls, wall clock) and, where the GPU's set calls go
through freqoptd, keeps what the daemon timed for the last call of each (its queue wait and the call itself on the
GPU's worker). ``DVFSRuntime.actuation()`` reports them beside the switch latency the plan assumed (the GPU file's
``clock_switch_ms``), and the runtime warns at exit (ActuationWarning) where the median switch took longer: the
plan's requests then land late, and a table found with the measured latency is the one to apply.

On the simulated backend there is no GPU to switch: the worker applies each setting to the simulated GPU, which
only records it (``SimulatedGPU.applied``), and ``step_measurement()`` measures the traced iteration with the
settings the runtime actually asked for, switch latency included, so a table's realizable savings can be measured
without a GPU; it is what a search's validation measures for the same table (freqopt.search.validate).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.workload.fingerprint import check_trace_module, unwrap_module
from freqopt.workload.kernels import Trace
from freqopt.workload.phases import HOOK_WARNING, STEP_MARK, PhaseHooks, phase_spans
from freqopt.search.realize import Realizer
from freqopt.search.schedule import requested_per_phase
from freqopt.tables import ClockTable
from freqopt.apply.transfer import transfer_table

__all__ = ["PhasePlan", "DVFSRuntime", "plan_phases", "ActuationWarning"]

# Switches a runtime must have made before its measured latency is set against the plan's (fewer: no warning).
MIN_SWITCHES_TO_JUDGE = 3
# A switch within this much of the plan's switch latency is on time, s: an NVML set call alone blocks for 10-20 ms
# (ml-energy/zeus#29), so a millisecond is below what would move a plan.
LATE_TOLERANCE_S = 0.001


class ActuationWarning(UserWarning):
    """The runtime's switches took longer than the switch latency its plan assumed (DVFSRuntime.actuation)."""


@dataclass(frozen=True)
class PhasePlan:
    """What the runtime applies: per phase (in trace order) its label, kernel span and the setting requested at its
    start (it lands one switch latency later).

    Attributes:
        labels: the mark that opens each phase ("start" for the kernels before the first mark).
        spans: (first kernel, end kernel) of each phase.
        settings: the setting requested at the start of each phase, shape (P,); the runtime issues a request only
            where it differs from the previous phase's (cyclically).
    """

    labels: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    settings: tuple[ClockSetting, ...]

    def per_kernel(self, phase_settings: list[ClockSetting], n_kernels: int) -> list[ClockSetting]:
        out = [DEFAULT_SETTING] * n_kernels
        for (first, end), setting in zip(self.spans, phase_settings):
            out[first:end] = [setting] * (end - first)
        return out

    @property
    def requests(self) -> tuple[tuple[str, ClockSetting], ...]:
        """The (phase label, setting) of each request one iteration issues, in order: the phases whose requested
        setting differs from the previous phase's (cyclically); () when one setting holds throughout."""
        s = self.settings
        return tuple((label, s[j]) for j, label in enumerate(self.labels) if s[j] != s[j - 1])


def plan_phases(table: ClockTable | None, trace: Trace, backend: Backend) -> PhasePlan:
    """The settings a runtime requests per phase of ``trace`` for ``table`` on ``backend``'s GPU (all default when
    ``table`` is None): the table laid onto the trace (freqopt.apply.transfer.transfer_table), realized per phase
    (freqopt.search.realize.Realizer, weighing phases by ``backend.kernel_times_s`` at the default setting: the
    simulated physics on a simulated GPU, kernels timed on the device on a real one, and switching only where a run
    of phases outlasts the GPU type's clock-switch latency), each switch requested one latency ahead
    (Realizer.requests). The workload is not checked here (DVFSRuntime does), so a table can be planned onto
    another layout's trace.

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
    if table is not None and table.is_phase_schedule:
        return PhasePlan(labels, tuple((a, b) for _, a, b in spans), requested_per_phase(table, labels))
    if table is None:
        per_kernel = [DEFAULT_SETTING] * len(trace)
    else:
        per_kernel = list(Realizer(trace, backend).requests(transfer_table(table, trace).per_kernel()))
    return PhasePlan(labels, tuple((a, b) for _, a, b in spans), tuple(per_kernel[a] for _, a, _ in spans))


_STOP = object()  # the worker's last item


def stop_clock_worker(worker: "ClockWorker", thread) -> None:
    """Let ``worker`` (running on ``thread``) drain what is queued, the latest request only, then stop; waits for
    it up to 30 s. Every runtime calls this on exit, before closing its backend (which restores the GPU)."""
    worker.requests.put(_STOP)
    thread.join(timeout=30)


@dataclass
class ClockWorker:
    """The thread that applies the requested settings (module docstring), fed by ``requests``: (CUDA event or None,
    setting) items, then _STOP.

    Attributes:
        applied: the setting last applied (None: not known yet).
        n_applied, n_skipped, n_superseded: set calls made; requests skipped as the setting held already; requests
            superseded by a later one the GPU had reached before the earlier was applied.
        switch_s: the wall time of each switch applied (the backend's set calls), s.
        daemon_calls: per switch whose set calls went through freqoptd, (queued_s, latency_s) of its last call as
            the daemon timed it (freqopt.gpu.nvml.DaemonSetCalls.last_call).
        error: the first error a set call raised, for the training thread to raise.
    """

    backend: Backend
    requests: queue.Queue = field(default_factory=queue.Queue)
    applied: ClockSetting | None = None
    n_applied: int = 0
    n_skipped: int = 0
    n_superseded: int = 0
    switch_s: list = field(default_factory=list)
    daemon_calls: list = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        item = None
        while True:
            if item is None:
                item = self.requests.get()
            if item is _STOP:
                return
            event, setting = item
            item = None
            try:
                if event is not None:
                    event.synchronize()  # this thread waits for the GPU to reach the boundary, not the training stream
                # Later requests whose boundary the GPU has passed too supersede this one: set calls that fell behind
                # the job are not replayed.
                while item is None:
                    try:
                        later = self.requests.get_nowait()
                    except queue.Empty:
                        break
                    if later is _STOP or (later[0] is not None and not later[0].query()):
                        item = later  # not reached yet (or the end): handled after this one
                    else:
                        setting = later[1]
                        self.n_superseded += 1
                if setting == self.applied:
                    self.n_skipped += 1
                    continue
                started = time.monotonic()
                self.backend.apply(setting)
                self.switch_s.append(time.monotonic() - started)
                last_call = getattr(getattr(self.backend, "device", None), "last_call", None)
                if last_call is not None:
                    self.daemon_calls.append(tuple(last_call))
                self.applied = setting
                self.n_applied += 1
            except BaseException as e:  # surfaced to the training thread at the next boundary
                if self.error is None:
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
            the module it wraps (freqopt.workload.fingerprint.unwrap_module).
        optimizer: a torch.optim.Optimizer whose step marks the optimizer phase, or None (call ``mark_step()``).
        table: the clock table, found for ``trace``'s workload (ClockTable.check_workload); None runs at default
            settings (still counting phases).
        backend: the GPU the job runs on (NVMLBackend), or a simulated one (``backend.simulated``: a SimulatedGPU,
            whose timeline step_measurement reads).
        trace: the trace of the job's workload (trace_iteration), whose marks the hooks follow.
        check_trace: refuse a ``model`` the trace was not recorded from (freqopt.workload.fingerprint); False lets a module
            with the same phase modules follow another module's trace (a small model driving a large model's
            simulated timeline, as the tests do).

    Attributes:
        plan: the settings requested per phase (plan_phases).
        switches: requests issued (settings changed) since entered.

    Raises:
        TableWorkloadError: ``table`` was found for another model, layout, micro-batch or sequence length than
            ``trace``'s workload; the message names ``freqopt transfer``, which lays it onto this one.
        ClockTableError: ``table`` is a pipeline's (granularity "instruction"): freqopt.apply.pipeline_runtime's
            PipelineRuntime applies those.
        TraceMismatchError: ``check_trace`` and the trace is of a module of another structure (a trace recorded
            without a fingerprint is accepted with a TraceFingerprintWarning).
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, *, table: ClockTable | None, backend: Backend,
                 trace: Trace, check_trace: bool = True):  # fmt: skip
        model = unwrap_module(model)
        if check_trace:
            check_trace_module(trace, model)
        if table is not None:
            table.refuse_pipeline("the phase runtime (DVFSRuntime)")
            table.check_workload(trace.workload)
        self.model, self.optimizer, self.backend, self.trace = model, optimizer, backend, trace
        self.simulated = backend.simulated
        self.plan = plan_phases(table, trace, backend)
        self._expected = self.plan.labels
        self._position = 0  # index of the phase the job is in
        self._current = self.plan.settings[-1]  # the setting last requested (a previous step's last, before the first)
        self._requested = list(self.plan.settings)  # the setting requested at each phase of the current step
        self._hooks = PhaseHooks(model, self._on_mark)
        self._handles: list = []
        self._worker = ClockWorker(backend)
        self._thread = threading.Thread(target=self._worker.run, name="freqopt-dvfs", daemon=True)
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
        """At a phase boundary, on the training thread: locate the phase and enqueue its setting if it changed.
        Never waits: no NVML call, no stream synchronization (an event is recorded on the current stream)."""
        if self._worker.error is not None:
            raise self._worker.error
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
            self._worker.requests.put((event, setting))
            self._current = setting
            self.switches += 1

    def mark_step(self) -> None:
        """The optimizer phase begins (called by the optimizer's step pre-hook, or by hand)."""
        self._on_mark(STEP_MARK)

    def actuation(self) -> dict:
        """How long this runtime's switches took, against what its plan assumed.

        Returns:
            {"n_switches", "median_switch_s", "max_switch_s" (wall time of the backend's set calls per switch; None
            before the first), "daemon_median_latency_s", "daemon_median_queued_s" (freqoptd's own timing of the
            last call of each switch, where the GPU is set through it, else None), "assumed_switch_s" (the GPU
            file's clock_switch_ms, which the plan's look-ahead used, s), "late" (the median switch took longer by
            more than LATE_TOLERANCE_S, judged after MIN_SWITCHES_TO_JUDGE switches)}.
        """
        switch_s, daemon = list(self._worker.switch_s), list(self._worker.daemon_calls)
        assumed = self.backend.spec.clock_switch_s
        median = statistics.median(switch_s) if switch_s else None
        return {"n_switches": len(switch_s), "median_switch_s": median, "max_switch_s": max(switch_s, default=None),
                "daemon_median_latency_s": statistics.median(c[1] for c in daemon) if daemon else None,
                "daemon_median_queued_s": statistics.median(c[0] for c in daemon) if daemon else None,
                "assumed_switch_s": assumed,
                "late": len(switch_s) >= MIN_SWITCHES_TO_JUDGE and median > assumed + LATE_TOLERANCE_S}  # fmt: skip

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
        warnings.filterwarnings("ignore", message=HOOK_WARNING, category=UserWarning)
        self._thread.start()
        self._hooks.__enter__()
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self._handles.append(self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.mark_step()))
        # The clocks the steady state starts with, before the first step.
        self._worker.requests.put((None, self._current))
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        engine_step = getattr(self, "_restore_engine", None)
        if engine_step:
            engine_step[0].step = engine_step[1]
        stop_clock_worker(self._worker, self._thread)
        self._warnings.__exit__(*exc)
        self.backend.close()
        report = self.actuation()
        if report["late"]:
            warnings.warn(f"the runtime's {report['n_switches']} switches took a median "
                          f"{report['median_switch_s'] * 1e3:.1f} ms (max {report['max_switch_s'] * 1e3:.1f} ms), "
                          f"longer than the {report['assumed_switch_s'] * 1e3:g} ms switch latency its plan assumed "
                          "(the GPU file's clock_switch_ms), so its switches landed late; search again on a GPU file "
                          "whose clock_switch_ms is what was measured here", ActuationWarning, stacklevel=2)  # fmt: skip
