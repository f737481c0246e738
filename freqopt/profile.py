"""``freqopt profile``: one training iteration's time, energy, average power, FLOPs and a breakdown by kernel kind.

On the simulated GPU (``SimulatedGPU``) the iteration is traced (freqopt.trace) and run once at the GPU's default
settings, noiselessly (``SimulatedGPU.run(..., loop=False)``: one step issued from an idle GPU); per-kernel time and
energy are summed by ``Kernel.kind``.

On a real GPU (``NVMLBackend``) the model trains for real, read-only: profile reads the backend's energy counter
(``Backend.energy_j``) and never applies a setting. After a few warm-up steps, steps run until the
window spans at least ``MIN_WINDOW_S`` and ``MIN_COUNTER_UPDATES`` updates of the energy counter (its period is
detected by polling, freqopt.replay.detect_counter_period); time per step comes from CUDA events (perf_counter on
the CPU), energy per step from the nvmlDeviceGetTotalEnergyConsumption delta. The measurement is set beside the
simulated GPU's prediction for the same GPU type (the backend's spec) and the same trace. Then two more steps run
under torch.profiler (the first warms it up), and what it recorded of the second is compared, kind by kind, with
the trace (``profiled_kinds``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from freqopt.backends.base import DEFAULT_SETTING, Backend, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.kernels import Trace
from freqopt.models import Workload, build_model
from freqopt.trace import _KINDS, _NOT_KERNELS, trace_training_iteration

__all__ = ["KindFigures", "ProfilerRow", "ProfileReport", "profile", "simulate_by_kind", "profiled_kinds",
           "check_device", "MIN_WINDOW_S", "MIN_COUNTER_UPDATES", "STEP_LABEL"]

MIN_WINDOW_S = 1.0  # the measured window lasts at least this long, s
MIN_COUNTER_UPDATES = 5  # ... and spans at least this many energy-counter periods
COUNTER_DETECTION_S = 1.0  # polling time to find the counter's period (10 updates at the slowest documented 100 ms)
STEP_LABEL = "freqopt.profile.step"  # torch.profiler label around the profiled training step
N_BATCHES = 4  # distinct synthetic batches, made on the device before any step is timed
# Operators that only bookkeep or hand back their input (when nothing needs converting): no kernel, as the tracer
# never sees them either (below the dispatch level it records, or returning their input).
_BOOKKEEPING = {"to", "resize_", "detach_", "item", "_local_scalar_dense", "is_nonzero", "result_type"}
_OPERATOR = re.compile(r"^(aten|freqopt)::(\w+)$")


@dataclass(frozen=True)
class KindFigures:
    """One kernel kind's share of an iteration on the simulated GPU.

    Attributes:
        time_s: wall time its kernels add to the iteration, s (communication overlapped with compute: only the
            exposed part; idle time waiting for the host, where the GPU type models it, included).
        energy_j: their energy, J.
        n_kernels: kernels of this kind in the trace.
    """

    time_s: float
    energy_j: float
    n_kernels: int


@dataclass(frozen=True)
class ProfilerRow:
    """One kernel kind, the trace against torch.profiler on the real device (one training step each).

    Attributes:
        traced_n_kernels: kernels of this kind in the trace.
        predicted_time_s: the simulated GPU's time for them, s.
        profiled_n_kernels: profiled operators of this kind that did device work (each is what the tracer counts as
            one kernel; on a GPU one operator may launch several CUDA kernels).
        measured_time_s: their time, s: CUDA device time on a GPU, CPU time on the CPU (each operator's, what
            runs beneath it included).
    """

    traced_n_kernels: int
    predicted_time_s: float
    profiled_n_kernels: int
    measured_time_s: float


@dataclass(frozen=True)
class ProfileReport:
    """One training iteration of one GPU (one rank of the workload's layout).

    Attributes:
        model, gpu, backend: the workload's model, the GPU type (search_spaces/ name), "sim" or "nvml".
        time_s, energy_j: per iteration, s and J: the simulated GPU's (sim) or measured per step (nvml).
        flops: FLOPs of the traced iteration (``Trace.total_flops``).
        by_kind: kind -> the simulated GPU's figures, in first-seen order; they sum to ``time_s`` and ``energy_j``
            on sim, to ``predicted`` on nvml (NVML cannot split energy by kernel).
        predicted: nvml only: the simulated GPU's iteration at default settings for the same trace.
        device: nvml only: where the model trained ("cuda", "cpu").
        n_steps, window_s, counter_period_s: nvml only: steps in the measured window, its length (s), the energy
            counter's detected update period (s).
        profiler_by_kind: nvml only: kind -> ProfilerRow.
        profiler_time: nvml only: what ``ProfilerRow.measured_time_s`` is ("cuda device time" or "cpu time").
    """

    model: str
    gpu: str
    backend: str
    time_s: float
    energy_j: float
    flops: float
    by_kind: dict[str, KindFigures]
    predicted: Measurement | None = None
    device: str | None = None
    n_steps: int | None = None
    window_s: float | None = None
    counter_period_s: float | None = None
    profiler_by_kind: dict[str, ProfilerRow] | None = None
    profiler_time: str | None = None

    @property
    def avg_power_w(self) -> float:
        """energy_j / time_s, W."""
        return self.energy_j / self.time_s

    def summary(self) -> dict:
        """The JSON document: {"model", "gpu", "backend", "time_s", "energy_j", "avg_power_w", "flops", "by_kind":
        {KIND: {"time_s", "energy_j", "n_kernels"}}}; on nvml also "measured" {"time_s", "energy_j", "avg_power_w",
        "device", "n_steps", "window_s", "counter_period_s"}, "predicted" {"time_s", "energy_j", "avg_power_w"},
        "measured_over_predicted" {"time", "energy", "avg_power"}, "profiler_time" and "profiler_by_kind" {KIND:
        {"traced_n_kernels", "predicted_time_s", "profiled_n_kernels", "measured_time_s"}}."""
        doc = {"model": self.model, "gpu": self.gpu, "backend": self.backend, "time_s": self.time_s,
               "energy_j": self.energy_j, "avg_power_w": self.avg_power_w, "flops": self.flops,
               "by_kind": {kind: vars(f) for kind, f in self.by_kind.items()}}  # fmt: skip
        if self.predicted is not None:
            p = self.predicted
            doc["measured"] = {"time_s": self.time_s, "energy_j": self.energy_j, "avg_power_w": self.avg_power_w,
                               "device": self.device, "n_steps": self.n_steps, "window_s": self.window_s,
                               "counter_period_s": self.counter_period_s}  # fmt: skip
            doc["predicted"] = {"time_s": p.time_s, "energy_j": p.energy_j, "avg_power_w": p.avg_power_w}
            doc["measured_over_predicted"] = {"time": self.time_s / p.time_s, "energy": self.energy_j / p.energy_j,
                                              "avg_power": self.avg_power_w / p.avg_power_w}  # fmt: skip
        if self.profiler_by_kind is not None:
            doc["profiler_time"] = self.profiler_time
            doc["profiler_by_kind"] = {kind: vars(r) for kind, r in self.profiler_by_kind.items()}
        return doc


def simulate_by_kind(trace: Trace, gpu) -> tuple[Measurement, dict[str, KindFigures]]:
    """The trace's iteration on ``gpu`` (a SimulatedGPU) at default settings, issued once from an idle GPU
    (``SimulatedGPU.run(kernels, [DEFAULT_SETTING] * K, loop=False)``, noiseless).

    Returns:
        (the iteration: time_s, energy_j, time-weighted mean SM clock; kind -> KindFigures in first-seen order,
        summing to the iteration).
    """
    kernels = trace.kernels
    time_s, energy_j, clocks = gpu.run(kernels, [DEFAULT_SETTING] * len(kernels), loop=False)  # (K,) each
    kinds = np.array([k.kind for k in kernels])
    by_kind = {}
    for kind in dict.fromkeys(kinds.tolist()):
        mask = kinds == kind
        by_kind[kind] = KindFigures(float(time_s[mask].sum()), float(energy_j[mask].sum()), int(mask.sum()))
    total = Measurement(float(time_s.sum()), float(energy_j.sum()),
                        sm_clock_mhz=float(np.average(clocks, weights=time_s)))  # fmt: skip
    return total, by_kind


def check_device(device: str) -> str:
    """``device`` if the model can train there while NVML measures the first visible GPU: "cpu", or "cuda"/"cuda:0"
    on a CUDA build of torch that sees a GPU.

    Raises:
        InvalidSettingError: another device type, a CPU-only torch, no visible GPU, or a CUDA index other than 0.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidSettingError(f"device {device!r} is not a torch device; pass 'cuda' or 'cpu'") from e
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise InvalidSettingError(f"device {device!r}: profile trains on 'cuda' (the GPU NVML measures) or 'cpu'")
    from freqopt.train import check_training_device

    check_training_device(device)  # a CUDA build of torch that sees a GPU
    if parsed.index not in (None, 0):
        raise InvalidSettingError(f"device {device!r}: NVML measures the first visible GPU; pass device 'cuda' and "
                                  "choose the GPU with CUDA_VISIBLE_DEVICES")  # fmt: skip
    return device


def profile(workload: Workload | str, backend: Backend | str = "sim", *, gpu=None, device: str | None = None,
            steps: int = 10, warmup_steps: int = 3, seed: int = 0, micro_batch_size: int | None = None,
            seq_len: int | None = None, n_heads: int | None = None, vocab_multiple: int | None = None,
            layout=None) -> ProfileReport:  # fmt: skip
    """Profile one training iteration of ``workload`` (module docstring).

    Args:
        workload: a model name (freqopt.models.list_models) or a Workload; on a real GPU a single-GPU layout.
        backend: "sim" or a simulated backend (``backend.simulated``: traced and simulated; ``device``, ``steps``'
            count and ``seed`` unused), or "nvml" or an NVMLBackend (trained and measured at the GPU's current
            settings, read-only: a name opens the GPU read-only, and however a backend was opened, profile only
            reads its energy counter (Backend.energy_j) and never applies a setting). A name is opened and closed
            here.
        gpu: GPU type name or GPUSpec: the simulated one (default h100-sxm), or what the real GPU must be.
        device: nvml only: where the model trains, default "cuda"; "cpu" trains on the CPU while the counter of the
            first visible GPU is read (for tests with a stand-in NVML).
        steps: nvml: the fewest steps in the measured window; more run until it spans ``MIN_WINDOW_S`` and
            ``MIN_COUNTER_UPDATES`` counter periods.
        warmup_steps: nvml: untimed steps first (allocator, cuBLAS heuristics, clocks ramping up).
        seed: nvml: seed of the weights and the synthetic tokens.
        micro_batch_size, seq_len, n_heads, vocab_multiple, layout: get_workload overrides, model names only.

    Returns:
        ProfileReport.

    Raises:
        UnknownNameError: unknown model, GPU type or backend.
        InvalidSettingError: a bad override, a non-positive ``steps``, a negative ``warmup_steps``, a ``device``
            with the simulated GPU or one the model cannot train on (check_device), or a layout of more than one
            rank on a real GPU.
        NVMLError, GPUPermissionError: the real GPU cannot be opened or read.
    """
    from freqopt.resolve import open_backend, resolve_backend, resolve_gpu, resolve_workload

    workload = resolve_workload(workload, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    spec = resolve_gpu(gpu)
    backend = resolve_backend(backend)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidSettingError(f"steps must be a positive integer, not {steps!r}")
    if warmup_steps < 0:
        raise InvalidSettingError(f"warmup_steps must not be negative, not {warmup_steps}")
    real = not backend.simulated if isinstance(backend, Backend) else backend == "nvml"
    if real:
        device = check_device(device or "cuda")
        if workload.layout.world_size > 1:
            raise InvalidSettingError(f"profile on a real GPU trains one GPU; pass a single-GPU layout, not "
                                      f"{workload.layout} (the simulated GPU profiles one rank of any layout)")  # fmt: skip
    elif device is not None:
        raise InvalidSettingError("device applies to backend nvml; the simulated GPU trains nothing")
    measuring, opened = open_backend(backend, spec, seed=seed, read_only=backend == "nvml")
    try:
        if not real:
            trace = trace_training_iteration(workload)
            total, by_kind = simulate_by_kind(trace, measuring)
            return ProfileReport(workload.model, measuring.spec.name, measuring.name, total.time_s, total.energy_j,
                                 trace.total_flops, by_kind)  # fmt: skip
        # The GPU is only read, through the backend's energy counter (Backend.energy_j); nothing is applied, and a
        # backend the caller opened is left as it was opened.
        return _profile_real(workload, measuring, device, steps, warmup_steps, seed)
    finally:
        if opened:
            measuring.close()


class _Trainer:
    """The real training step: the model in bf16 on CUDA (float32 on the CPU), MixedPrecisionAdamW as the trace
    models it, synthetic tokens from the model's vocabulary with the next tokens as targets."""

    def __init__(self, workload: Workload, device: str, seed: int):
        from freqopt.models.ops import MixedPrecisionAdamW

        self.cuda = torch.device(device).type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.device = device
        torch.manual_seed(seed)
        config = workload.config
        self.model = build_model(config, device=device, dtype=self.dtype)
        self.optimizer = MixedPrecisionAdamW(self.model.parameters())
        generator = torch.Generator().manual_seed(seed + 1)
        from freqopt.train import synthetic_batch

        # Made before any timing, so no step pays for the host-to-device copy.
        self.batches = [synthetic_batch(workload, generator, device) for _ in range(N_BATCHES)]
        self.n = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def step(self, label: str | None = None) -> None:
        """One training step (forward, backward, optimizer), then wait for the device, as a loop reading its loss."""
        from freqopt.phases import quiet_backward_hooks

        idx, targets = self.batches[self.n % len(self.batches)]
        self.n += 1
        with torch.profiler.record_function(label) if label else contextlib.nullcontext():
            loss = self.model(idx, targets)
            with quiet_backward_hooks():
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.sync()


def _counter_period_s(backend: Backend, trainer: _Trainer) -> float:
    """The energy counter's update period, s: polled (freqopt.replay.detect_counter_period) from a thread while
    training steps keep the GPU busy; the GPU type's documented period if the counter barely moved. Cached on the
    backend, as its own measurements cache it."""
    from freqopt.replay import detect_counter_period

    if backend.counter_period_s is not None:
        return backend.counter_period_s
    found: list[float] = []

    def poll() -> None:
        try:
            found.append(detect_counter_period(backend.energy_j, duration_s=COUNTER_DETECTION_S))
        except RuntimeError:
            pass

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    while poller.is_alive():
        trainer.step()
    poller.join()
    backend.counter_period_s = found[0] if found else backend.spec.energy_counter_period_s
    return backend.counter_period_s


def _profile_real(workload: Workload, backend: Backend, device: str, steps: int, warmup_steps: int,
                  seed: int) -> ProfileReport:  # fmt: skip
    from freqopt.backends.simulated import SimulatedGPU

    trainer = _Trainer(workload, device, seed)
    trace = trace_training_iteration(workload, dtype=trainer.dtype)  # what the GPU runs: same model, same dtype
    predicted, by_kind = simulate_by_kind(trace, SimulatedGPU(backend.spec, noise=False))
    for _ in range(warmup_steps):
        trainer.step()
    period_s = _counter_period_s(backend, trainer)  # its steps warm up too
    need_s = max(MIN_WINDOW_S, MIN_COUNTER_UPDATES * period_s)
    trainer.sync()
    energy_before = backend.energy_j()
    if trainer.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    n = 0
    while n < steps or time.perf_counter() - t0 < need_s:
        trainer.step()
        n += 1
    if trainer.cuda:
        end.record()
        trainer.sync()
    wall_s = time.perf_counter() - t0
    energy_j = backend.energy_j() - energy_before
    window_s = start.elapsed_time(end) / 1000.0 if trainer.cuda else wall_s
    rows = _compare_with_profiler(trainer, by_kind)
    return ProfileReport(workload.model, backend.spec.name, "nvml", window_s / n, energy_j / n, trace.total_flops,
                         by_kind, predicted=predicted, device=device, n_steps=n, window_s=window_s,
                         counter_period_s=period_s, profiler_by_kind=rows,
                         profiler_time="cuda device time" if trainer.cuda else "cpu time")  # fmt: skip


def _compare_with_profiler(trainer: _Trainer, by_kind: dict[str, KindFigures]) -> dict[str, ProfilerRow]:
    """Two steps under torch.profiler (the first warms the profiler up, the second is recorded), compared by kind
    with the trace."""
    from torch.profiler import ProfilerActivity, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.cuda else [])
    with torch.profiler.profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                                acc_events=True) as prof:  # fmt: skip
        for _ in range(2):
            trainer.step(STEP_LABEL)
            prof.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = prof.events()
    seen = profiled_kinds(events, device_time=trainer.cuda)
    rows = {}
    for kind in dict.fromkeys([*by_kind, *seen]):
        traced = by_kind.get(kind, KindFigures(0.0, 0.0, 0))
        n, time_s = seen.get(kind, (0, 0.0))
        rows[kind] = ProfilerRow(traced.n_kernels, traced.time_s, n, time_s)
    return rows


def _overloads(op: str) -> list:
    """The functional (not out=) overloads of aten ``op``; [] for an unknown name."""
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return []
    found = []
    for name in packet.overloads():
        if name == "out" or name.endswith("_out"):
            continue
        try:
            found.append(getattr(packet, name))
        except (AttributeError, RuntimeError):
            pass
    return found


@lru_cache(maxsize=None)
def _is_view(op: str) -> bool:
    """Whether aten ``op`` is a view (OpOverload.is_view, the tracer's test) in every functional overload."""
    overloads = _overloads(op)
    return bool(overloads) and all(o.is_view for o in overloads)


@lru_cache(maxsize=None)
def _decomposes(op: str) -> bool:
    """Whether aten ``op`` is CompositeImplicitAutograd in every functional overload (aten::linear, matmul,
    layer_norm, cross_entropy_loss, to, reshape): decomposed before a TorchDispatchMode sees it, so the tracer sees
    the operators it calls instead, never it."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    overloads = _overloads(op)
    try:
        return bool(overloads) and all(o.has_kernel_for_dispatch_key(key) for o in overloads)
    except RuntimeError:
        return False


def profiled_kinds(events, *, device_time: bool, label: str = STEP_LABEL) -> dict[str, tuple[int, float]]:
    """Kernel kinds of the operators torch.profiler recorded inside ``label`` (a record_function around the step),
    counted as freqopt.trace counts what it traces.

    The tracer sees operators at the level a TorchDispatchMode sees them: below autograd, after the
    CompositeImplicitAutograd decompositions. So, walking the profiler's operator tree: an ``aten::`` operator that
    decomposes (aten::linear, matmul, layer_norm, to) is looked through; a view, an allocation (the tracer's
    _NOT_KERNELS) or bookkeeping is skipped; any other ``aten::OP`` or ``freqopt::OP`` is one kernel, of kind
    freqopt.trace._KINDS[OP] (keyed by the overload packet's name: "aten::addmm" -> "gemm"), else "elementwise",
    and what runs beneath it is its own work (``freqopt::flash_attention_backward``'s matmuls, ``aten::embedding``'s
    index_select, the per-tensor loops of ``aten::_foreach_mul_`` on the CPU). Non-operator events (autograd nodes)
    are looked through. A kernel counts if it did work: on a GPU, device time (``device_time_total`` > 0); on the
    CPU, CPU time. Events of other threads (the autograd engine's, on CUDA) count when they fall inside the label's
    time range.

    Args:
        events: ``torch.profiler.profile(...).events()``.
        device_time: count and time by device time (a CUDA run) rather than CPU time.

    Returns:
        kind -> (kernels, their time in s: each operator's device time, or its CPU time, children included), in
        first-seen order.
    """
    cpu_events = [e for e in events if getattr(e, "device_type", None) in (None, torch.autograd.DeviceType.CPU)]
    windows = [(e.time_range.start, e.time_range.end) for e in cpu_events if e.name == label]
    if not windows:
        return {}
    inside = [e for e in cpu_events if e.name != label
              and any(a <= e.time_range.start and e.time_range.end <= b for a, b in windows)]  # fmt: skip
    ids = {id(e) for e in inside}
    roots = [e for e in inside if e.cpu_parent is None or id(e.cpu_parent) not in ids]
    found: dict[str, list] = {}

    def visit(e) -> None:
        match = _OPERATOR.match(e.name)
        if match is None or (match.group(1) == "aten" and _decomposes(match.group(2))):
            for child in e.cpu_children:
                visit(child)
            return
        namespace, op = match.groups()
        if op in _NOT_KERNELS or op in _BOOKKEEPING or (namespace == "aten" and _is_view(op)):
            return
        seconds = (e.device_time_total if device_time else e.cpu_time_total) * 1e-6
        if seconds > 0:
            entry = found.setdefault(_KINDS.get(op, "elementwise"), [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    for root in roots:
        visit(root)
    return {kind: (n, seconds) for kind, (n, seconds) in found.items()}
