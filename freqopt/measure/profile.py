"""``freqopt profile``: one training iteration's time, energy, average power, FLOPs and a breakdown by kernel kind.

On the simulated GPU (``SimulatedGPU``) the iteration is traced (freqopt.workload.trace) and run once, noiselessly, at one
setting for the whole step: the GPU's defaults, or the locked SM clock, memory clock and power limit asked for
(``SimulatedGPU.run(kernels, [setting] * K, loop=False)``: one step issued from an idle GPU, the step that
``SimulatedGPU.step`` and so the search's baseline and validation and the runtime measure). Per-kernel time and
energy are summed by ``Kernel.kind`` and by ``Kernel.pass_name`` (forward, backward, optimizer; a collective counts
in the pass it is issued in).

On a real GPU (``NVMLBackend``) the model trains for real, read-only: profile reads the backend's energy counter
(``Backend.energy_j``) and never applies a setting (it refuses one). After a few warm-up steps, steps run until the
window spans at least ``MIN_WINDOW_S`` and ``MIN_COUNTER_UPDATES`` updates of the energy counter (its period is
detected by polling, freqopt.gpu.replay.detect_counter_period); time per step comes from CUDA events (perf_counter on
the CPU), energy per step from the nvmlDeviceGetTotalEnergyConsumption delta. The measurement is set beside the
simulated GPU's prediction for the same GPU type (the backend's spec) and the same trace. Then two more steps run
under torch.profiler (the first warms it up), and what it recorded of the second is compared, kind by kind, with
the trace (freqopt.measure.profiler_compare.profiled_kinds; ProfilerRow, profiled_kinds and STEP_LABEL are re-exported here).

Before any of that, the step's memory is estimated (freqopt.workload.memory: weights, gradients, optimizer state and the
activations saved for backward, on one rank) and a step that does not fit the GPU's memory is refused
(check_gpu_memory; StepMemory, estimate_step_memory and check_gpu_memory are re-exported here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Trace
from freqopt.workload.memory import (StepMemory, check_gpu_memory, check_step_fits,
                                     estimate_step_memory)  # fmt: skip
from freqopt.workload.models import Workload, build_model
from freqopt.measure.profile_checks import check_profile_arguments
from freqopt.measure.profiler_compare import STEP_LABEL, ProfilerRow, compare_with_profiler, profiled_kinds
from freqopt.workload.trace import trace_training_iteration

__all__ = ["KindFigures", "PassFigures", "ProfilerRow", "ProfileReport", "profile", "simulate_iteration",
           "simulate_by_kind", "profiled_kinds",
           "check_device", "MIN_WINDOW_S", "MIN_COUNTER_UPDATES", "STEP_LABEL", "StepMemory", "estimate_step_memory",
           "check_gpu_memory", "HOST_BOUND_SHARE"]

MIN_WINDOW_S = 1.0  # the measured window lasts at least this long, s
MIN_COUNTER_UPDATES = 5  # ... and spans at least this many energy-counter periods
COUNTER_DETECTION_S = 1.0  # polling time to find the counter's period (10 updates at the slowest documented 100 ms)
N_BATCHES = 4  # distinct synthetic batches, made on the device before any step is timed
# A step whose GPU waits on the host this share of its time or more is host-bound (ProfileReport.host_bound) and tells
# the host's speed (ProfileReport.host_scale). A threshold chosen here, not measured: at a fifth of the step the host
# sets a visible part of its time.
HOST_BOUND_SHARE = 0.2


@dataclass(frozen=True)
class KindFigures:
    """One kernel kind's share of an iteration on the simulated GPU: its kernels' busy time, not the time the GPU
    waits for the host before them (ProfileReport.waiting_s holds that).

    Attributes:
        time_s: wall time its kernels run, s (communication overlapped with compute: only the exposed part); the
            GPU's waiting for the host before them (SimulatedGPU.run_with_waiting's wait_s) excluded.
        energy_j: their energy while they run, J (the waiting's energy, at the GPU's waiting power, excluded).
        n_kernels: kernels of this kind in the trace.
        flops: their FLOPs (``Kernel.flops``).
        mem_bytes: the bytes they move to and from device memory (``Kernel.mem_bytes``).
    """

    time_s: float
    energy_j: float
    n_kernels: int
    flops: float = 0.0
    mem_bytes: float = 0.0

    @property
    def bandwidth_tb_s(self) -> float:
        """mem_bytes / time_s, TB/s (1e12 bytes/s), on busy time; 0 for no time."""
        return self.mem_bytes / self.time_s / 1e12 if self.time_s > 0 else 0.0

    @property
    def tflop_s(self) -> float:
        """flops / time_s, TFLOP/s, on busy time; 0 for no time."""
        return self.flops / self.time_s / 1e12 if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class PassFigures:
    """One pass's share (forward, backward or optimizer, ``Kernel.pass_name``) of an iteration on the simulated GPU.

    Attributes:
        time_s: wall time its kernels run, s (as KindFigures.time_s: waiting for the host excluded; a collective
            counts in the pass it is issued in).
        energy_j: their energy while they run, J.
        waiting_s: time the GPU waits for the host to issue this pass's kernels, s.
        waiting_energy_j: the GPU's energy meanwhile (its waiting power), J.
    """

    time_s: float
    energy_j: float
    waiting_s: float = 0.0
    waiting_energy_j: float = 0.0


@dataclass(frozen=True)
class ProfileReport:
    """One training iteration of one GPU (one rank of the workload's layout).

    Attributes:
        model, gpu, backend: the workload's model, the GPU type (search_spaces/ name), "sim" or "nvml".
        time_s, energy_j: per iteration, s and J: the simulated GPU's (sim) or measured per step (nvml).
        flops: FLOPs of the traced iteration (``Trace.total_flops``).
        by_kind: kind -> the simulated GPU's figures, in first-seen order: kernel (busy) time and energy, the
            waiting for the host excluded; with ``waiting_s`` and ``waiting_energy_j`` they sum to ``time_s`` and
            ``energy_j`` on sim, with ``predicted_waiting`` to ``predicted`` on nvml (NVML cannot split energy by
            kernel).
        by_pass: pass (forward, backward, optimizer) -> the simulated GPU's figures, in issue order; their busy
            figures sum as ``by_kind``'s do, their waiting ones to ``waiting_s`` and ``waiting_energy_j`` on sim (to
            ``predicted_waiting`` on nvml).
        setting: sim: the one setting the whole step ran at (None fields: the GPU's defaults); None on nvml, which
            measures at the GPU's current settings and sets nothing (``predicted`` is at the defaults).
        predicted: nvml only: the simulated GPU's iteration at default settings for the same trace.
        device: nvml only: where the model trained ("cuda", "cpu").
        n_steps, window_s, counter_period_s: nvml only: steps in the measured window, its length (s), the energy
            counter's detected update period (s).
        profiler_by_kind: nvml only: kind -> ProfilerRow.
        profiler_time: nvml only: what ``ProfilerRow.measured_time_s`` is ("cuda device time" or "cpu time").
        memory: the step's memory on one rank (freqopt.workload.memory.estimate_step_memory, in the dtype the step runs in:
            BF16 on a GPU, FP32 when an nvml profile trains on the CPU).
        gpu_memory_gb: the GPU type's memory (GPUSpec.memory_gb), GB; None where its file does not say.
        host: the host the simulated figures were issued by (freqopt.gpu.host: the GPU file's, or one given).
        waiting_s: per iteration, s, the GPU waiting on the host to issue its kernels: sim, the simulated GPU's
            (SimulatedGPU.waiting); nvml, the measured step less torch.profiler's kernel time (cuda device time
            only, else None). A host-bound step shows slow kernels in neither ``by_kind`` nor ``profiler_by_kind``:
            it shows here.
        waiting_energy_j: sim only: the energy the GPU draws while it waits (its waiting power,
            SimulatedGPU.run_with_waiting), J; None on nvml, whose counter cannot split the step's energy.
        predicted_waiting: nvml only: the simulated GPU's waiting for the host in ``predicted`` (time_s, energy_j).
        host_scale: nvml only, where the GPU waited on the host at least HOST_BOUND_SHARE of the step: the factor on
            ``host``'s times that makes the simulated step as long as the measured one (a bisection on
            HostSpec.scaled): your machine's host against the shipped one, to pass on as
            ``get_host(host).scaled(host_scale)`` (``freqopt search --host`` takes a host file); else None.
    """

    model: str
    gpu: str
    backend: str
    time_s: float
    energy_j: float
    flops: float
    by_kind: dict[str, KindFigures]
    by_pass: dict[str, PassFigures] = dataclasses.field(default_factory=dict)
    setting: ClockSetting | None = DEFAULT_SETTING
    predicted: Measurement | None = None
    device: str | None = None
    n_steps: int | None = None
    window_s: float | None = None
    counter_period_s: float | None = None
    profiler_by_kind: dict[str, ProfilerRow] | None = None
    profiler_time: str | None = None
    memory: StepMemory | None = None
    gpu_memory_gb: float | None = None
    host: str | None = None
    waiting_s: float | None = None
    host_scale: float | None = None
    waiting_energy_j: float | None = None
    predicted_waiting: Measurement | None = None

    @property
    def waiting_share(self) -> float | None:
        """``waiting_s`` over the iteration's time (0-1), or None."""
        return None if self.waiting_s is None else self.waiting_s / self.time_s

    @property
    def host_bound(self) -> bool:
        """The GPU waits for the host at least HOST_BOUND_SHARE of the step: the host, not the kernels, sets the
        step's time (and a lower clock costs it little)."""
        return self.waiting_share is not None and self.waiting_share >= HOST_BOUND_SHARE

    @property
    def kernel_time_s(self) -> float | None:
        """The step's time less its waiting for the host (the GPU busy running kernels), s; None where the waiting
        is not known (nvml on the CPU)."""
        return None if self.waiting_s is None else self.time_s - self.waiting_s

    @property
    def kernel_energy_j(self) -> float | None:
        """The step's energy less the energy drawn while waiting for the host, J; None where not known (nvml)."""
        return None if self.waiting_energy_j is None else self.energy_j - self.waiting_energy_j

    def waiting_line(self) -> str | None:
        """One sentence on the GPU's waiting for the host: its share of the step, its time and (sim) energy, whose
        figure it is, and, where the step is host-bound (``host_bound``), that the host sets the step's time; None
        where the waiting is not known."""
        if self.waiting_s is None:
            return None
        whose = ("measured: the step less torch.profiler's kernel time" if self.backend == "nvml"
                 else f"simulated, host {self.host}")  # fmt: skip
        line = (f"the GPU waits for the host {100 * self.waiting_share:.0f} % of the step "
                f"({1e3 * self.waiting_s:.2f} ms of {1e3 * self.time_s:.2f} ms")  # fmt: skip
        if self.waiting_energy_j is not None:
            line += (f"; {self.waiting_energy_j:.3g} J of {self.energy_j:.3g} J at its waiting power, "
                     f"{100 * self.waiting_energy_j / self.energy_j:.0f} %")  # fmt: skip
        line += f"; {whose})"
        if self.host_bound:
            line += (": the step is host-bound; its kernels run "
                     f"{1e3 * self.kernel_time_s:.2f} ms, and the host, not they, sets the step's time")  # fmt: skip
        return line

    def describe(self) -> str:
        """The report as text: the headline (time, energy, power, FLOPs), the waiting for the host, memory, and one
        line per kernel kind and per pass with busy time, energy and, for kinds, bandwidth and FLOP rate on busy
        time. What ``str(report)`` prints."""
        where = (f"NVML, trained on {self.device}, {self.n_steps} steps" if self.backend == "nvml" else
                 f"simulated, {'default settings' if self.setting == DEFAULT_SETTING else self.setting.label()}")
        lines = [f"{self.model}, one training iteration on {self.gpu} ({where}): {1e3 * self.time_s:.3f} ms, "
                 f"{self.energy_j:.3f} J, {self.avg_power_w:.1f} W, {self.flops / 1e12:.4g} TFLOP"]  # fmt: skip
        waiting = self.waiting_line()
        if waiting is not None:
            lines.append(waiting)
        if self.memory is not None:
            lines.append(f"memory per rank (estimated, {self.memory.dtype}): {self.memory.describe()}")
        prediction = " (simulated)" if self.backend == "nvml" else ""
        lines.append(f"kernel time by kind{prediction}, waiting for the host excluded:")
        for kind, f in self.by_kind.items():
            lines.append(f"  {kind:<14} {f.n_kernels:>6} kernels {1e3 * f.time_s:10.3f} ms {f.energy_j:10.3f} J "
                         f"{f.bandwidth_tb_s:7.3f} TB/s {f.tflop_s:8.2f} TFLOP/s")  # fmt: skip
        lines.append(f"by pass{prediction} (kernel time; waiting for the host):")
        for name, f in self.by_pass.items():
            lines.append(f"  {name:<14} {1e3 * f.time_s:10.3f} ms {f.energy_j:10.3f} J; waiting "
                         f"{1e3 * f.waiting_s:.3f} ms {f.waiting_energy_j:.3f} J")  # fmt: skip
        if self.predicted is not None:
            p = self.predicted
            lines.append(f"predicted (simulated, default settings): {1e3 * p.time_s:.3f} ms, {p.energy_j:.3f} J; "
                         f"measured / predicted: time {self.time_s / p.time_s:.3f}, energy "
                         f"{self.energy_j / p.energy_j:.3f}")  # fmt: skip
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        waiting = "None" if self.waiting_s is None else f"{self.waiting_s:.6g}"
        return (f"ProfileReport(model={self.model!r}, gpu={self.gpu!r}, backend={self.backend!r}, "
                f"time_s={self.time_s:.6g}, energy_j={self.energy_j:.6g}, waiting_s={waiting}, "
                f"kinds={len(self.by_kind)})")  # fmt: skip

    @property
    def avg_power_w(self) -> float:
        """energy_j / time_s, W."""
        return self.energy_j / self.time_s

    def summary(self) -> dict:
        """The JSON document: {"model", "gpu", "backend", "setting": {"sm_clock_mhz", "mem_clock_mhz",
        "power_limit_w"} (MHz, MHz, W; null: the GPU's default; the whole "setting" null on nvml), "time_s",
        "energy_j", "avg_power_w", "flops", "by_kind": {KIND: {"time_s", "energy_j", "n_kernels", "flops",
        "mem_bytes", "bandwidth_tb_s", "tflop_s"}} (kernel busy time: waiting for the host excluded), "by_pass":
        {"forward"|"backward"|"optimizer": {"time_s", "energy_j", "waiting_s", "waiting_energy_j"}}, "host",
        "waiting_s", "waiting_energy_j", "waiting_share" (0-1), "host_bound", "kernel_time_s", "kernel_energy_j",
        "host_scale" (ProfileReport's attributes and properties; null where not known)}; on nvml also "measured"
        {"time_s", "energy_j", "avg_power_w", "device", "n_steps", "window_s", "counter_period_s"}, "predicted"
        {"time_s", "energy_j", "avg_power_w", "waiting_s", "waiting_energy_j"},
        "measured_over_predicted" {"time", "energy", "avg_power"}, "profiler_time" and "profiler_by_kind" {KIND:
        {"traced_n_kernels", "predicted_time_s", "profiled_n_kernels", "measured_time_s"}}; and "memory"
        {"weights_gb", "gradients_gb", "optimizer_gb", "activations_gb", "total_gb", "gpu_gb", "dtype"} (GB:
        1e9 bytes, one rank; gpu_gb None where the GPU type's memory is not known)."""
        setting = None if self.setting is None else dataclasses.asdict(self.setting)
        doc = {"model": self.model, "gpu": self.gpu, "backend": self.backend, "setting": setting,
               "time_s": self.time_s, "energy_j": self.energy_j, "avg_power_w": self.avg_power_w, "flops": self.flops,
               "by_kind": {kind: {**vars(f), "bandwidth_tb_s": f.bandwidth_tb_s, "tflop_s": f.tflop_s}
                           for kind, f in self.by_kind.items()},
               "by_pass": {name: vars(f) for name, f in self.by_pass.items()}, "host": self.host,
               "waiting_s": self.waiting_s, "waiting_energy_j": self.waiting_energy_j,
               "waiting_share": self.waiting_share, "host_bound": self.host_bound, "kernel_time_s": self.kernel_time_s,
               "kernel_energy_j": self.kernel_energy_j, "host_scale": self.host_scale}  # fmt: skip
        if self.memory is not None:
            doc["memory"] = {**self.memory.summary(), "gpu_gb": self.gpu_memory_gb, "dtype": self.memory.dtype}
        if self.predicted is not None:
            p = self.predicted
            doc["measured"] = {"time_s": self.time_s, "energy_j": self.energy_j, "avg_power_w": self.avg_power_w,
                               "device": self.device, "n_steps": self.n_steps, "window_s": self.window_s,
                               "counter_period_s": self.counter_period_s}  # fmt: skip
            doc["predicted"] = {"time_s": p.time_s, "energy_j": p.energy_j, "avg_power_w": p.avg_power_w}
            if self.predicted_waiting is not None:
                doc["predicted"]["waiting_s"] = self.predicted_waiting.time_s
                doc["predicted"]["waiting_energy_j"] = self.predicted_waiting.energy_j
            doc["measured_over_predicted"] = {"time": self.time_s / p.time_s, "energy": self.energy_j / p.energy_j,
                                              "avg_power": self.avg_power_w / p.avg_power_w}  # fmt: skip
        if self.profiler_by_kind is not None:
            doc["profiler_time"] = self.profiler_time
            doc["profiler_by_kind"] = {kind: vars(r) for kind, r in self.profiler_by_kind.items()}
        return doc


def simulate_iteration(trace: Trace, gpu, setting: ClockSetting = DEFAULT_SETTING
                       ) -> tuple[Measurement, Measurement, dict[str, KindFigures], dict[str, PassFigures]]:
    """The trace's iteration on ``gpu`` (a SimulatedGPU) at ``setting`` for every kernel, issued once from an idle
    GPU (``SimulatedGPU.run_with_waiting(kernels, [setting] * K, loop=False)``, noiseless): the step
    ``SimulatedGPU.step`` measures, and so what the search's validation measures for that one setting over the
    whole step.

    Returns:
        (the iteration: time_s, energy_j, time-weighted mean SM clock; the GPU's waiting for the host in it:
        time_s, energy_j (SimulatedGPU.waiting); kind -> KindFigures in first-seen order; pass -> PassFigures in
        issue order). The breakdowns hold the kernels' busy time and energy, the waiting before each kernel taken
        out: with the waiting they sum to the iteration.

    Raises:
        InvalidSettingError: clocks or a power limit the GPU type does not support (GPUSpec.check_clocks,
            check_power_limit).
    """
    kernels = trace.kernels
    time_s, energy_j, clocks, wait_s, wait_j = gpu.run_with_waiting(kernels, [setting] * len(kernels),
                                                                    loop=False)  # (K,) each  # fmt: skip
    busy_s, busy_j = time_s - wait_s, energy_j - wait_j
    flops = np.array([k.flops for k in kernels], dtype=float)
    mem_bytes = np.array([k.mem_bytes for k in kernels], dtype=float)

    def split(labels: list[str]):
        labels = np.array(labels)
        for label in dict.fromkeys(labels.tolist()):
            yield label, labels == label

    by_kind = {kind: KindFigures(float(busy_s[m].sum()), float(busy_j[m].sum()), int(m.sum()),
                                 float(flops[m].sum()), float(mem_bytes[m].sum()))
               for kind, m in split([k.kind for k in kernels])}  # fmt: skip
    by_pass = {name: PassFigures(float(busy_s[m].sum()), float(busy_j[m].sum()), float(wait_s[m].sum()),
                                 float(wait_j[m].sum()))
               for name, m in split([k.pass_name for k in kernels])}  # fmt: skip
    total = Measurement(float(time_s.sum()), float(energy_j.sum()),
                        sm_clock_mhz=float(np.average(clocks, weights=time_s)))  # fmt: skip
    return total, Measurement(float(wait_s.sum()), float(wait_j.sum())), by_kind, by_pass


def simulate_by_kind(trace: Trace, gpu) -> tuple[Measurement, dict[str, KindFigures]]:
    """``simulate_iteration`` at the GPU's default settings, without the waiting and the breakdown by pass."""
    total, _, by_kind, _ = simulate_iteration(trace, gpu)
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
        raise InvalidSettingError(f"device {device!r} is not a torch device; pass 'cuda' or 'cpu'",
                                  argument="device") from e  # fmt: skip
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise InvalidSettingError(f"device {device!r}: profile trains on 'cuda' (the GPU NVML measures) or 'cpu'",
                                  argument="device")  # fmt: skip
    from freqopt.apply.train_checks import check_training_device

    check_training_device(device)  # a CUDA build of torch that sees a GPU
    if parsed.index not in (None, 0):
        raise InvalidSettingError(f"device {device!r}: NVML measures the first visible GPU; pass device 'cuda' and "
                                  "choose the GPU with CUDA_VISIBLE_DEVICES", argument="device")  # fmt: skip
    return device


def profile(workload: Workload | str | Trace, backend: Backend | str = "sim", *, gpu=None, device: str | None = None,
            steps: int = 10, warmup_steps: int = 3, seed: int = 0, micro_batch_size: int | None = None,
            seq_len: int | None = None, n_heads: int | None = None, vocab_multiple: int | None = None,
            layout=None, sm_clock_mhz: int | None = None, mem_clock_mhz: int | None = None,
            power_limit_w: float | None = None, host=None) -> ProfileReport:  # fmt: skip
    """Profile one training iteration of ``workload`` (module docstring).

    Args:
        workload: a model name (freqopt.workload.models.list_models) or a Workload; on a real GPU a single-GPU layout.
            Or a Trace (freqopt.trace_step of the user's own training step, or freqopt.trace_training_iteration):
            its kernels are simulated as traced (simulated GPU only; no overrides; no memory estimate for a traced
            step, whose model freqopt cannot rebuild).
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
        sm_clock_mhz, mem_clock_mhz, power_limit_w: simulated GPU only: the locked SM clock (MHz), memory clock
            (MHz) and power limit (W) the whole step runs at; None keeps the GPU's default (boost clocks under the
            default power limit, the highest memory clock). The step is the one the search's validation measures
            for that setting (``SimulatedGPU.step(kernels, [setting] * K)``).
        host: the host that issues the kernels (freqopt.gpu.host: a HostSpec, or a host's name or TOML path), in
            place of the GPU file's: the simulated step's on sim, the one ``host_scale`` is measured against on nvml.

    Returns:
        ProfileReport (``waiting_s``: the GPU waiting on the host; on nvml ``host_scale`` where the step is
        host-bound).

    Raises:
        UnknownNameError: unknown model, GPU type, host or backend.
        InvalidSettingError: a pipeline layout (pp > 1, Layout.refuse_pipeline), a bad override, a non-positive
            ``steps``, a negative ``warmup_steps``, a ``device`` with the simulated GPU or one the model cannot train on (check_device), a layout of more than one
            rank on a real GPU, or a step that does not fit the real GPU's memory (check_gpu_memory; not checked
            when an nvml profile trains on the CPU); ``sm_clock_mhz``, ``mem_clock_mhz`` or ``power_limit_w`` on nvml
            (profile only reads a real GPU), or clocks or a power limit the GPU type does not support
            (GPUSpec.check_clocks, check_power_limit: the message lists the supported range); a Trace with an
            override (micro_batch_size, ...) or on nvml.
        NVMLError, GPUPermissionError: the real GPU cannot be opened or read.

    Warns:
        GPUMemoryWarning: on the simulated GPU, a step that does not fit one GPU's memory (check_gpu_memory's
            message): it is profiled all the same, as a what-if (one pipeline stage of gpt3-175b, say, profiled as
            the whole model's ratios to the top clock).
    """
    from freqopt.resolve import open_backend, resolve_trace_or_workload

    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    # Those that need no model built first, in the order they always had (check_profile_arguments, which the command
    # line runs before it imports PyTorch), then the model's and the device's.
    checked = check_profile_arguments(workload, backend, gpu=gpu, device=device, steps=steps,
                                      warmup_steps=warmup_steps, sm_clock_mhz=sm_clock_mhz,
                                      mem_clock_mhz=mem_clock_mhz, power_limit_w=power_limit_w, host=host, **sizes)  # fmt: skip
    traced, workload = resolve_trace_or_workload(workload, **sizes)
    backend, real, setting = checked.backend, checked.real, checked.setting
    if real:
        device = check_device(device or "cuda")
    measuring, opened = open_backend(backend, checked.spec, seed=seed, read_only=backend == "nvml")
    try:
        memory = None
        if traced is None:  # a traced step's model cannot be rebuilt to estimate its memory
            memory = _step_memory(workload, measuring, real=real, device=device)
        if not real:
            return _profile_simulated(workload, traced, measuring, setting, memory)
        # The GPU is only read, through the backend's energy counter (Backend.energy_j); nothing is applied, and a
        # backend the caller opened is left as it was opened.
        report = _profile_real(workload, measuring, device, steps, warmup_steps, seed)
        return dataclasses.replace(report, memory=memory, gpu_memory_gb=measuring.spec.memory_gb)
    finally:
        if opened:
            measuring.close()


def _profile_simulated(workload: Workload, traced: Trace | None, measuring: Backend, setting: ClockSetting,
                       memory: StepMemory | None) -> ProfileReport:  # fmt: skip
    """The step on the simulated GPU at ``setting`` for every kernel (simulate_iteration): ``traced`` as it was
    traced, else ``workload``'s iteration traced here."""
    setting.check_supported(measuring.spec)  # before tracing, which takes a while on large models
    trace = traced if traced is not None else trace_training_iteration(workload)
    total, waiting, by_kind, by_pass = simulate_iteration(trace, measuring, setting)
    return ProfileReport(workload.model, measuring.spec.name, measuring.name, total.time_s, total.energy_j,
                         trace.total_flops, by_kind, by_pass, setting, memory=memory,
                         gpu_memory_gb=measuring.spec.memory_gb, host=measuring.spec.host,
                         waiting_s=waiting.time_s, waiting_energy_j=waiting.energy_j)  # fmt: skip


def _step_memory(workload: Workload, measuring: Backend, *, real: bool, device: str | None) -> StepMemory:
    """The step's memory on one rank (estimate_step_memory: BF16 on a GPU, FP32 when an nvml profile trains on the
    CPU); one that does not fit the GPU's memory is refused on a real GPU and warned of on the simulated one
    (check_step_fits; an nvml profile training on the CPU is not held to the GPU's memory)."""
    on_gpu = not real or torch.device(device).type == "cuda"
    memory = estimate_step_memory(workload, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if on_gpu:
        check_step_fits(workload, measuring.spec, simulated=not real, what="profiled anyway", memory=memory)
    return memory


class _Trainer:
    """The real training step: the model in bf16 on CUDA (float32 on the CPU), MixedPrecisionAdamW as the trace
    models it, synthetic tokens from the model's vocabulary with the next tokens as targets."""

    def __init__(self, workload: Workload, device: str, seed: int):
        from freqopt.workload.models.ops import MixedPrecisionAdamW

        self.cuda = torch.device(device).type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.device = device
        torch.manual_seed(seed)
        config = workload.config
        self.model = build_model(config, device=device, dtype=self.dtype)
        self.optimizer = MixedPrecisionAdamW(self.model.parameters())
        generator = torch.Generator().manual_seed(seed + 1)
        from freqopt.apply.train import synthetic_batch

        # Made before any timing, so no step pays for the host-to-device copy.
        self.batches = [synthetic_batch(workload, generator, device) for _ in range(N_BATCHES)]
        self.n = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def step(self, label: str | None = None) -> None:
        """One training step (forward, backward, optimizer), then wait for the device, as a loop reading its loss."""
        from freqopt.workload.phases import quiet_backward_hooks

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
    """The energy counter's update period, s: polled (freqopt.gpu.replay.detect_counter_period) from a thread while
    training steps keep the GPU busy; the GPU type's documented period if the counter barely moved. Cached on the
    backend, as its own measurements cache it."""
    from freqopt.gpu.replay import detect_counter_period

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
    from freqopt.gpu.backends.simulated import SimulatedGPU

    trainer = _Trainer(workload, device, seed)
    trace = trace_training_iteration(workload, dtype=trainer.dtype)  # what the GPU runs: same model, same dtype
    predicted, predicted_waiting, by_kind, by_pass = simulate_iteration(trace, SimulatedGPU(backend.spec, noise=False))
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
    rows = compare_with_profiler(trainer.step, by_kind, cuda=trainer.cuda)
    step_s = window_s / n
    waiting_s = scale = None
    if trainer.cuda:
        waiting_s = max(step_s - sum(r.measured_time_s for r in rows.values()), 0.0)
        if waiting_s >= HOST_BOUND_SHARE * step_s:
            scale = fit_host_scale(trace, backend.spec, step_s)
    return ProfileReport(workload.model, backend.spec.name, "nvml", step_s, energy_j / n, trace.total_flops,
                         by_kind, by_pass, None, predicted=predicted, device=device, n_steps=n, window_s=window_s,
                         counter_period_s=period_s, profiler_by_kind=rows,
                         profiler_time="cuda device time" if trainer.cuda else "cpu time", host=backend.spec.host,
                         waiting_s=waiting_s, host_scale=scale, predicted_waiting=predicted_waiting)  # fmt: skip


def fit_host_scale(trace: Trace, spec, step_s: float, *, bounds: tuple[float, float] = (0.1, 20.0)) -> float | None:
    """The factor on ``spec``'s host (freqopt.gpu.host.HostSpec.scaled) that makes the simulated step of ``trace``
    (SimulatedGPU.step at default settings) last ``step_s``: bisection (scipy.optimize.brentq) on the factor; None
    where no factor in ``bounds`` does (a step the GPU, not the host, sets the pace of)."""
    from scipy.optimize import brentq

    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.host import get_host

    host = get_host(spec.host)
    kernels = list(trace.kernels)

    def gap(factor: float) -> float:
        return SimulatedGPU(spec.with_host(host.scaled(factor)), noise=False).step(kernels).time_s - step_s

    low, high = bounds
    if gap(low) > 0 or gap(high) < 0:
        return None
    return float(brentq(gap, low, high, xtol=1e-4))


