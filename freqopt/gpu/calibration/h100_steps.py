"""Calibration of the simulated H100's training step against whole steps measured on a real one
(experiments/data/h100/whole_steps/).

Each file is one training step of freqopt's GPT-3 modules (sequence 2048, bf16, fused attention, vocabulary 50304,
MixedPrecisionAdamW) at the GPU's default settings: time per step (CUDA events), energy per step (the NVML energy
counter), the SM clock sampled meanwhile, and torch.profiler's device time of every CUDA kernel of a step (name,
seconds, launches). The simulated step is ``SimulatedGPU.step`` on the trace of the same workload: the step that
``freqopt profile``, the search's baseline and validation and the runtime all measure. These steps called PyTorch's
``F.scaled_dot_product_attention`` (cuDNN's fused attention on Hopper: their kernel names), so the trace is of the
workload with ``attention="sdpa"`` (``freqopt profile --attention sdpa``); freqopt's GPT-3 modules call
FlashAttention-2 by default, another program, which the H200 timed 1.4-1.6x slower (GPUSpec.attention_rate_rel), so
``freqopt profile`` without ``--attention sdpa`` is no check against these steps.

Two kinds of evidence, fitted in two stages (``fit``):

* **Kernel classes.** ``KERNEL_CLASSES`` pairs each class of traced operators with the CUDA kernels that run it
  (by kernel name); every measured kernel falls in one class or in "other" (memsets, scalar kernels), so the
  classes partition the step's GPU busy time. A class's measured time is its kernels' device time plus
  ``LAUNCH_GAP_S`` per launch (the GPU's own idle between back-to-back kernels, which the simulated kernel's
  ``kernel_fixed_s`` holds); its simulated time is its traced kernels' at the step's mean measured SM clock
  (physics only, no host, no power limit). Stage 1 fits ``CLASS_PARAMETERS`` (memory-bound operators' bandwidth
  relative to a copy's, the row overhead of row-wise kernels, attention's head-dimension and backward rates) to
  the classes of the steps that are not launch-bound.
* **Whole steps.** Stage 2 fits the host's extra time per kernel of a training step (``HOST_SPLIT_US`` scaled by
  one factor) to the steps' time and energy. The launch-bound gpt3-small at micro-batch 1 (GPU busy 10.0 ms of a
  27.6 ms step) pins it; the others barely move with it.

What the data cannot separate is fixed by ``HOST_SPLIT_US`` (the split of the host's work between the passes,
measured on a CPU) and ``LAUNCH_GAP_S``, each with its source. ``residuals`` computes the tables that
experiments/h100_whole_steps.md shows and tests/test_calibration.py holds the committed constants to.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freqopt.gpu.backends.physics import MULTI_TENSOR, MULTI_TENSOR_PREFIXES, KernelPhysics
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel

__all__ = ["WholeStep", "load_steps", "trace_steps", "kernel_class", "measured_classes", "simulated_classes",
           "residuals", "summarize", "fit", "leave_one_out", "with_values", "current_values", "CLASS_PARAMETERS",
           "HOST_PARAMETERS", "HOST_SPLIT_US", "LAUNCH_GAP_S", "KERNEL_CLASSES", "LAUNCH_BOUND"]  # fmt: skip

# (class, does a traced kernel belong to it, CUDA kernel-name pattern of torch.profiler's rows). Patterns are tried
# in order; a measured kernel that matches none is "other" (cuDNN's and cuBLAS's memsets, scalar kernels).
KERNEL_CLASSES: list[tuple[str, object, str]] = [
    ("GEMM", lambda k: k.kind == "gemm", r"^nvjet|splitKreduce"),
    ("attention", lambda k: k.kind == "attention" and not k.name.endswith("_backward"), r"sdpa.*fprop"),
    ("attention backward", lambda k: k.kind == "attention" and k.name.endswith("_backward"),
     r"sdpa.*bprop|cudnn::fusion::"),  # the fused backward and its dO.O and dQ-conversion kernels
    ("multi-tensor (optimizer)", lambda k: k.name.startswith(MULTI_TENSOR_PREFIXES),
     r"multi_tensor_apply_kernel|lpnorm_cleanup"),  # fused AdamW, foreach norm / mul_ / add_ / copy_
    ("cast copy", lambda k: k.name == "aten._to_copy", r"direct_copy_kernel"),  # grad.float(): bf16 -> fp32
    ("bias-gradient sum", lambda k: k.name == "aten.sum", r"reduce_kernel<128, 4"),
    ("layer norm", lambda k: k.name == "aten.native_layer_norm", r"vectorized_layer_norm_kernel"),
    ("layer norm backward", lambda k: k.name == "aten.native_layer_norm_backward",
     r"layer_norm_grad_input|GammaBetaBackward"),
    ("log-softmax", lambda k: k.name.startswith("aten._log_softmax"), r"SoftMax"),
    ("add", lambda k: k.name == "aten.add" and k.dtype == "bfloat16", r"CUDAFunctor_add<c10::BFloat16"),
    ("GELU", lambda k: k.name == "aten.gelu", r"GeluCUDAKernelImpl"),
    ("GELU backward", lambda k: k.name == "aten.gelu_backward", r"GeluBackward"),
    ("loss", lambda k: k.name.startswith("aten.nll_loss"), r"nll_loss|FillFunctor<c10::BFloat16"),
    ("embedding", lambda k: k.kind == "embedding",
     r"embedding|gather_kernel|radix_sort|cub::detail::scan|unique_by_key|sum_and_scatter|compute_grad_weight|"
     r"partial_segment|partials_per_segment|num_of_partial"),
]  # fmt: skip
OTHER = "other"
# The GPU's own idle between two back-to-back kernels, s: the three steps where the host keeps ahead of the GPU
# idle (step time - busy time) / launches = 1.2, 1.8 and 2.0 us (whole_steps/*.json: 1.34 ms over 1087 launches,
# 3.96 over 2254, 6.44 over 3153); their pooled 11.7 ms over 6494 launches. An upper bound (it holds the step's
# start as well).
LAUNCH_GAP_S = 1.8e-6
LAUNCH_BOUND = "gpt3-small-1-2048"  # the launch-bound step: the host's time per kernel, not the kernel classes
# Host time per kernel of a training step beyond a replay's, by pass, up to one factor (fitted): freqopt's GPT-3
# modules with 12 layers at d_model 64, sequence 8, bf16, trained on the CPU (one thread; kernels tiny): 4.42 ms
# forward, 5.93 ms backward, 2.16 ms optimizer (MixedPrecisionAdamW) per step, minimum of 40 steps, over the 151,
# 322 and 209 kernels gpt3-small's trace has in each pass, less the 1.0 us a bare operator call takes there
# (torch.add of two 8-element tensors): what autograd, the modules' Python and the optimizer's add per kernel.
# Measured by experiments/fit_whole_steps.py --measure-host-split; the data cannot split the passes
# (one launch-bound step), so this split is an assumption: the forward's module code costs most per kernel,
# the backward's C++ autograd engine less, the optimizer's list code least.
HOST_SPLIT_US = {"forward": 28.3, "backward": 17.4, "optimizer": 9.3}

# name -> (lower, upper, start). Stage 1 (kernel classes).
CLASS_PARAMETERS: dict[str, tuple[float, float, float]] = {
    f"bw/{MULTI_TENSOR}": (0.3, 1.5, 0.9),
    "bw/aten._to_copy": (0.2, 1.5, 0.6),
    "bw/aten.sum": (0.1, 1.5, 0.5),
    "bw/aten.native_layer_norm_backward": (0.1, 1.5, 0.4),
    "bw/aten.add": (0.5, 2.0, 1.1),
    "row/aten.native_layer_norm": (0.0, 5000.0, 300.0),
    "row/aten.native_layer_norm_backward": (0.0, 5000.0, 300.0),
    "row/aten.sum": (0.0, 5000.0, 300.0),
}
# Operators set with another's bandwidth (the data time them as one class).
_SAME_BANDWIDTH: dict[str, tuple[str, ...]] = {}
# Stage 2 (whole steps): the factor on HOST_SPLIT_US.
HOST_PARAMETERS: dict[str, tuple[float, float, float]] = {"host_split_scale": (0.1, 10.0, 1.5)}
# Attention and log-softmax are the H200's kernel families carried here (experiments/h200_check.py): their classes
# are checks of that carry, not fitted.
FITTED_CLASSES = ("multi-tensor (optimizer)", "cast copy", "bias-gradient sum", "layer norm", "layer norm backward",
                  "add")  # fmt: skip


@dataclass(frozen=True)
class WholeStep:
    """One measured training step (one file of experiments/data/h100/whole_steps).

    Attributes:
        name: the file's stem (``gpt3-small-1-2048``).
        model, micro_batch_size, seq_len: the workload.
        step_s: time per step, s (CUDA events).
        energy_j: energy per step, J (NVML energy counter over the run).
        sm_clock_mhz: mean of the SM clock samples, MHz.
        busy_s: GPU busy time per step, s (torch.profiler: the sum of kernel times).
        kernels: torch.profiler's kernels of one step: (seconds, CUDA kernel name, launches).
    """

    name: str
    model: str
    micro_batch_size: int
    seq_len: int
    step_s: float
    energy_j: float
    sm_clock_mhz: float
    busy_s: float
    kernels: tuple[tuple[float, str, int], ...]

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.step_s

    @property
    def launches(self) -> int:
        return sum(n for _, _, n in self.kernels)


def load_steps(folder: str | Path) -> list[WholeStep]:
    """The measured steps of ``folder`` (experiments/data/h100/whole_steps), sorted by file name."""
    steps = []
    for path in sorted(Path(folder).glob("*.json")):
        d = json.loads(path.read_text())
        steps.append(WholeStep(path.stem, d["model"], int(d["mbs"]), int(d["seq"]), float(d["step_s"]),
                               float(d["energy_j_per_step"]), float(np.mean(d["sm_clock_samples"])),
                               float(d["gpu_time_sum_s"]), tuple((float(s), n, int(c)) for s, n, c in d["top_kernels"])))  # fmt: skip
    return steps


def trace_steps(steps: list[WholeStep]) -> dict[str, list[Kernel]]:
    """Each step's traced kernels, by step name: freqopt.workload.trace of the workload at its micro-batch and sequence
    with attention through PyTorch's SDPA (``get_workload(..., attention="sdpa")``), as these steps ran it (cuDNN's
    kernels: top_kernels' names). The same trace ``freqopt profile --attention sdpa`` simulates, so the two agree."""
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    return {s.name: list(trace_training_iteration(get_workload(s.model, micro_batch_size=s.micro_batch_size,
                                                               seq_len=s.seq_len, attention="sdpa")).kernels)
            for s in steps}  # fmt: skip


def kernel_class(kernel: Kernel) -> str:
    """The KERNEL_CLASSES class of a traced kernel, or "other"."""
    return next((name for name, member, _ in KERNEL_CLASSES if member(kernel)), OTHER)


def _measured_class(cuda_name: str) -> str:
    return next((name for name, _, pattern in KERNEL_CLASSES if re.search(pattern, cuda_name)), OTHER)


def measured_classes(step: WholeStep) -> dict[str, tuple[float, int]]:
    """Class -> (device time per step, s; launches per step) of the step's measured kernels."""
    out: dict[str, list] = {}
    for seconds, name, launches in step.kernels:
        row = out.setdefault(_measured_class(name), [0.0, 0])
        row[0] += seconds
        row[1] += launches
    return {k: (v[0], v[1]) for k, v in out.items()}


def simulated_classes(spec: GPUSpec, kernels: list[Kernel], sm_clock_mhz: float) -> dict[str, tuple[float, int]]:
    """Class -> (simulated time, s; kernels) of traced kernels at the supported SM clock nearest ``sm_clock_mhz``
    and the highest memory clock: the physics alone (KernelPhysics: no host, no power limit)."""
    clock = min(spec.sm_clocks_mhz, key=lambda f: abs(f - sm_clock_mhz))
    one_clock = dataclasses.replace(spec, sm_clocks_mhz=(clock,))
    time_s = KernelPhysics(one_clock, kernels, np.full(len(kernels), float(spec.max_mem_clock_mhz))).time_s[:, 0]
    out: dict[str, list] = {}
    for k, t in zip(kernels, time_s):
        row = out.setdefault(kernel_class(k), [0.0, 0])
        row[0] += float(t)
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def with_values(spec: GPUSpec, values: dict[str, float]) -> GPUSpec:
    """``spec`` with the values of CLASS_PARAMETERS and HOST_PARAMETERS in ``values`` set (others kept)."""
    bandwidth = dict(spec.operator_bandwidth_rel)
    rows = dict(spec.row_overhead_elements)
    fields = {}
    for key, value in values.items():
        if key.startswith("bw/"):
            for name in (key.removeprefix("bw/"), *_SAME_BANDWIDTH.get(key.removeprefix("bw/"), ())):
                bandwidth[name] = value
        elif key.startswith("row/"):
            rows[key.removeprefix("row/")] = value
        elif key == "host_split_scale":
            fields["step_host_s"] = {p: value * us * 1e-6 for p, us in HOST_SPLIT_US.items()}
        else:
            fields[key] = value
    return dataclasses.replace(spec, operator_bandwidth_rel=bandwidth, row_overhead_elements=rows, **fields)


def current_values(spec: GPUSpec) -> dict[str, float]:
    """The committed values of CLASS_PARAMETERS and HOST_PARAMETERS in ``spec`` (NaN where it has none)."""
    out = {}
    for key in CLASS_PARAMETERS:
        if key.startswith("bw/"):
            out[key] = spec.operator_bandwidth_rel.get(key.removeprefix("bw/"), math.nan)
        elif key.startswith("row/"):
            out[key] = spec.row_overhead_elements.get(key.removeprefix("row/"), math.nan)
        else:
            out[key] = getattr(spec, key)
    forward = spec.step_host_s.get("forward")
    out["host_split_scale"] = forward * 1e6 / HOST_SPLIT_US["forward"] if forward is not None else math.nan
    return out


def _class_rows(spec: GPUSpec, step: WholeStep, kernels: list[Kernel]) -> list[dict]:
    measured = measured_classes(step)
    simulated = simulated_classes(spec, kernels, step.sm_clock_mhz)
    rows = []
    for name in [c for c, _, _ in KERNEL_CLASSES] + [OTHER]:
        device_s, launches = measured.get(name, (0.0, 0))
        sim_s, n = simulated.get(name, (0.0, 0))
        with_gaps = device_s + LAUNCH_GAP_S * launches
        row = {"step": step.name, "class": name, "measured_s": device_s, "launches": launches,
               "measured_with_gaps_s": with_gaps, "simulated_s": sim_s, "traced_kernels": n}  # fmt: skip
        if with_gaps > 0 and sim_s > 0:
            row["error_pct"] = 100 * (sim_s / with_gaps - 1)
        rows.append(row)
    return rows


def _step_row(spec: GPUSpec, step: WholeStep, kernels: list[Kernel]) -> dict:
    m = SimulatedGPU(spec, noise=False).step(kernels)
    return {"step": step.name, "time_measured_s": step.step_s, "time_simulated_s": m.time_s,
            "time_error_pct": 100 * (m.time_s / step.step_s - 1), "energy_measured_j": step.energy_j,
            "energy_simulated_j": m.energy_j, "energy_error_pct": 100 * (m.energy_j / step.energy_j - 1),
            "power_measured_w": step.avg_power_w, "power_simulated_w": m.avg_power_w,
            "power_error_pct": 100 * (m.avg_power_w / step.avg_power_w - 1), "clock_measured_mhz": step.sm_clock_mhz,
            "clock_simulated_mhz": m.sm_clock_mhz, "busy_measured_s": step.busy_s, "launches": step.launches,
            "traced_kernels": len(kernels)}  # fmt: skip


def residuals(spec: GPUSpec, steps: list[WholeStep], traces: dict[str, list[Kernel]]) -> dict:
    """{"steps": per step, measured and simulated time, energy, average power and SM clock, errors in % of the
    measured; "classes": per step and KERNEL_CLASSES class, measured (device time, launches, with LAUNCH_GAP_S per
    launch) and simulated time at the step's measured clock, error in %}."""
    return {"steps": [_step_row(spec, s, traces[s.name]) for s in steps],
            "classes": [r for s in steps for r in _class_rows(spec, s, traces[s.name])]}  # fmt: skip


def summarize(result: dict) -> dict:
    """Largest |error| in % of the steps' time, energy and power, and of the fitted classes (FITTED_CLASSES, steps
    other than LAUNCH_BOUND)."""
    out = {key: max(abs(r[f"{key}_error_pct"]) for r in result["steps"]) for key in ("time", "energy", "power")}
    fitted = [r for r in result["classes"] if r["class"] in FITTED_CLASSES and r["step"] != LAUNCH_BOUND]
    out["class"] = max(abs(r["error_pct"]) for r in fitted)
    return out


def fit(spec: GPUSpec, steps: list[WholeStep], traces: dict[str, list[Kernel]], *, max_nfev: int = 200) -> GPUSpec:
    """Stage 1: CLASS_PARAMETERS to the log ratio (in %) of simulated to measured time of FITTED_CLASSES in every
    step but LAUNCH_BOUND; stage 2: HOST_PARAMETERS to the steps' time and energy errors (in %), all four
    (scipy.optimize.least_squares, trust-region reflective). Returns ``spec`` with the fitted values."""
    from scipy.optimize import least_squares

    fitted_steps = [s for s in steps if s.name != LAUNCH_BOUND]

    def stage1(x):
        trial = with_values(spec, dict(zip(CLASS_PARAMETERS, x)))
        out = []
        for s in fitted_steps:
            for r in _class_rows(trial, s, traces[s.name]):
                if r["class"] in FITTED_CLASSES:
                    out.append(100 * math.log(r["simulated_s"] / r["measured_with_gaps_s"]))
        return out

    lower, upper, x0 = (np.array(v) for v in zip(*CLASS_PARAMETERS.values()))
    x = least_squares(stage1, x0, bounds=(lower, upper), x_scale=upper - lower, max_nfev=max_nfev).x
    spec = with_values(spec, dict(zip(CLASS_PARAMETERS, map(float, x))))

    def stage2(x):
        trial = with_values(spec, dict(zip(HOST_PARAMETERS, x)))
        rows = [_step_row(trial, s, traces[s.name]) for s in steps]
        return [r[k] for r in rows for k in ("time_error_pct", "energy_error_pct")]

    lower, upper, x0 = (np.array(v) for v in zip(*HOST_PARAMETERS.values()))
    x = least_squares(stage2, x0, bounds=(lower, upper), diff_step=0.01, max_nfev=max_nfev).x
    return with_values(spec, dict(zip(HOST_PARAMETERS, map(float, x))))


def leave_one_out(spec: GPUSpec, steps: list[WholeStep], traces: dict[str, list[Kernel]], *,
                  max_nfev: int = 200) -> list[dict]:
    """Each step predicted by ``fit`` on the other steps (both stages: the kernel classes and the host's factor):
    the fidelity figure of the whole-step fit, where ``residuals`` of the fit on all four are in-sample. Left out,
    LAUNCH_BOUND has no step to pin the host's factor (the GPU-bound steps barely move with it), so its figure is
    what the fit's start and the other steps make of the host.

    Returns:
        Per step, ``residuals``' step row (measured, simulated, errors in %) of the left-out prediction, with the
        ``host_split_scale`` fitted without it.
    """
    rows = []
    for step in steps:
        fitted = fit(spec, [s for s in steps if s is not step], traces, max_nfev=max_nfev)
        rows.append({**_step_row(fitted, step, traces[step.name]),
                     "host_split_scale": current_values(fitted)["host_split_scale"]})  # fmt: skip
    return rows
