"""The simulated V100's GEMMs and convolutions against Baidu's DeepBench on a real V100.

DeepBench (baidu-research/DeepBench, commit da81ba7, ``results/train/DeepBench_NV_V100.xlsx``; copied unchanged from
shared/calibration/deepbench-v100 to experiments/data/deepbench_v100) timed, one shape at a time on one V100 of a
DGX-1 (CUDA 10.1, cuDNN 7.6.2): dense GEMMs (M, N, K, transposes) and convolutions (W, H, C, N, K, S, R, padding,
strides; forward, data gradient and weight gradient), in fp32 and with 16-bit inputs and 32-bit accumulation
(``fp16_mixed.csv``). Each row becomes freqopt Kernels (``load_points``) as its tracer records the same call: a GEMM
is ``aten.mm`` of (M, K) by (K, N), ``2 M N K`` FLOPs, its operands and output in bytes; a convolution is
``aten.convolution`` and its two gradients on an NCHW input (N, C, H, W) and a weight (K, C, R, S), ``2 N K C R S P Q``
FLOPs each (P x Q the output DeepBench states), reading the input it touches, the weight and the output. A 16-bit row
runs on tensor cores (``Kernel.tensor_core``), an fp32 one on CUDA cores.

**Which V100, at which clocks.** The sheet names a DGX-1 (``specs.csv``), whose V100s are SXM2 boards: the points are
simulated on ``v100-sxm2`` at its highest clocks (1530 MHz, 877 MHz memory) without a power limit, as
freqopt.gpu.calibration.h200 simulates the H200's short timed loops. Assumed: DeepBench does not state the clocks;
a DGX-1 boosts to 1530 MHz under a short benchmark's load.

**What is fitted** (``PARAMS``, scipy.optimize.least_squares on the log ratio of predicted to measured time, within
bounds): the GEMM model's ``gemm_efficiency`` and ``gemm_k_overhead`` and ``conv_efficiency_rel`` by direction (and
of the few-channel forward and weight gradient: DeepSpeech's and OCR's 1-channel input layers). freqopt's physics
applies the K overhead and the convolution factors to tensor-core kernels only
(freqopt.gpu.backends.physics.gemm_efficiency): an fp32 kernel runs at ``gemm_efficiency`` of the CUDA-core peak
whatever its shape or direction, so the fp32 families say how far that simple model is from cuBLAS's and cuDNN's
fp32 kernels, and pull on ``gemm_efficiency`` with the rest. Each family's fidelity is judged leave one shape out
(``leave_one_out``: refit without the shape's kernels, predict them).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from freqopt.gpu.backends.physics import KernelPhysics
from freqopt.gpu.calibration.h200 import current_values, with_values
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel

__all__ = ["DeepBenchPoint", "DATA_DIR", "GPU", "PARAMS", "FAMILIES", "load_points", "predict_s", "errors_pct",
           "family_errors", "fit", "leave_one_out"]

DATA_DIR = Path(__file__).resolve().parents[3] / "experiments" / "data" / "deepbench_v100"
GPU = "v100-sxm2"  # a DGX-1's V100 (specs.csv); the module docstring
SHEETS = {"fp32": "fp32.csv", "fp16": "fp16_mixed.csv"}
DIRECTIONS = (("forward", "aten.convolution"), ("input", "aten.convolution_backward_input"),
              ("weight", "aten.convolution_backward_weight"))  # fmt: skip
FAMILIES = tuple(f"{kind} {precision}" for precision in SHEETS for kind in
                 ("gemm", "conv forward", "conv input", "conv weight"))  # fmt: skip
# parameter (h200.with_values's keys) -> (lower, upper): efficiencies within physics (at most the peak), the
# K overhead within a tile's few hundred elements, the convolution factors as the H200's fit bounds them.
PARAMS = {
    "gemm_efficiency": (0.2, 1.0),
    "gemm_k_overhead": (0.0, 2048.0),
    "gemm_fixed_us": (0.0, 50.0),
    "conv/forward": (0.1, 2.0),
    "conv/input": (0.1, 2.0),
    "conv/weight": (0.1, 2.0),
    "conv/forward_small_channels": (0.02, 2.0),
    "conv/weight_small_channels": (0.02, 2.0),
    "conv/forward_cuda_cores": (0.1, 3.0),
    "conv/input_cuda_cores": (0.1, 3.0),
    "conv/weight_cuda_cores": (0.1, 3.0),
    "conv/forward_3x3": (0.2, 4.0),
    "conv/input_3x3": (0.2, 4.0),
    "conv/weight_3x3": (0.2, 4.0),
    "conv/forward_3x3_cuda_cores": (0.2, 4.0),
    "conv/input_3x3_cuda_cores": (0.2, 4.0),
    "conv/weight_3x3_cuda_cores": (0.2, 4.0),
}
_ITEMSIZE = {"fp32": 4, "fp16": 2}
_DTYPE = {"fp32": "float32", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class DeepBenchPoint:
    """One DeepBench timing: ``family`` (one of FAMILIES), ``shape`` (the row's label, shared by a convolution's three
    directions: what leave-one-out leaves out), the Kernel freqopt times for it and the measured time, s."""

    family: str
    shape: str
    kernel: Kernel
    measured_s: float


def _sections(path: Path) -> dict[str, list[list[str]]]:
    """A sheet's rows by section ("gemm", "conv"): the rows after each section's header with a source in column 1."""
    out: dict[str, list[list[str]]] = {"gemm": [], "conv": []}
    section = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            head = row[0].strip() if row else ""
            if head:
                section = {"Dense Matrix Multiplication": "gemm", "Convolution": "conv"}.get(head)
                continue
            if section and len(row) > 2 and row[1].strip() and row[2].strip() not in ("", "W"):
                out[section].append(row)
    return out


def _gemm_point(row: list[str], precision: str) -> DeepBenchPoint:
    m, n, k = (int(row[i]) for i in (2, 3, 4))
    size = _ITEMSIZE[precision]
    kernel = Kernel("aten.mm", "gemm", "forward", 2.0 * m * n * k, float((m * k + k * n + m * n) * size),
                    _DTYPE[precision], ((m, k), (k, n)), tensor_core=precision == "fp16")  # fmt: skip
    shape = f"{precision} gemm {row[1]} {m}x{n}x{k} {row[5]}{row[6]}"
    return DeepBenchPoint(f"gemm {precision}", shape, kernel, float(row[8]) * 1e-3)


def _conv_points(row: list[str], precision: str) -> list[DeepBenchPoint]:
    w, h, c, n, k, s, r, pad_w, pad_h, stride_w, stride_h = (int(row[i]) for i in range(2, 13))
    p, q = int(row[17]), int(row[18])  # output width and height
    size = _ITEMSIZE[precision]
    flops = 2.0 * n * k * c * r * s * p * q
    touched = n * c * min(h * w, p * q * r * s)  # a strided window reads only the input it touches
    nbytes = float((touched + k * c * r * s + n * k * p * q) * size)
    x, weight, y = (n, c, h, w), (k, c, r, s), (n, k, q, p)
    shape = (f"{precision} conv {row[1]} {c}->{k} {s}x{r}/{stride_w}x{stride_h} pad {pad_w}x{pad_h} at {w}x{h} "
             f"batch {n}")  # fmt: skip
    out = []
    for (direction, name), column in zip(DIRECTIONS, (13, 14, 15)):
        cell = row[column].strip()
        if not cell or cell.startswith("N/A"):  # DeepBench skips the data gradient of input layers
            continue
        shapes = (x, weight) if direction == "forward" else (y, x, weight)
        kernel = Kernel(name, "gemm", "forward" if direction == "forward" else "backward", flops, nbytes,
                        _DTYPE[precision], shapes, tensor_core=precision == "fp16")  # fmt: skip
        out.append(DeepBenchPoint(f"conv {direction} {precision}", shape, kernel, float(cell) * 1e-3))
    return out


def load_points(data_dir: str | Path = DATA_DIR) -> list[DeepBenchPoint]:
    """Every GEMM and convolution timing of DeepBench's V100 sheets in ``data_dir`` (fp32.csv, fp16_mixed.csv), as
    DeepBenchPoints (the module docstring says how a row becomes kernels).

    Raises:
        FileNotFoundError: a sheet is missing.
    """
    points: list[DeepBenchPoint] = []
    for precision, name in SHEETS.items():
        sections = _sections(Path(data_dir) / name)
        points += [_gemm_point(row, precision) for row in sections["gemm"]]
        for row in sections["conv"]:
            points += _conv_points(row, precision)
    return points


def _at_top_clock(spec: GPUSpec) -> GPUSpec:
    return dataclasses.replace(spec, sm_clocks_mhz=(spec.max_sm_clock_mhz,))


def predict_s(spec: GPUSpec, points: Sequence[DeepBenchPoint]) -> np.ndarray:
    """The simulated time of each point's kernel, s, shape (P,): freqopt.gpu.backends.physics.KernelPhysics at the
    highest SM and memory clocks, no power limit, no host."""
    if not points:
        return np.zeros(0)
    top = _at_top_clock(spec)
    mem = np.full(len(points), float(spec.max_mem_clock_mhz))
    return KernelPhysics(top, [p.kernel for p in points], mem).time_s[:, -1]


def errors_pct(spec: GPUSpec, points: Sequence[DeepBenchPoint]) -> np.ndarray:
    """Signed error of each point's predicted time in % of the measured, shape (P,)."""
    measured = np.array([p.measured_s for p in points])
    return 100.0 * (predict_s(spec, points) / measured - 1.0)


def family_errors(spec: GPUSpec, points: Sequence[DeepBenchPoint] | None = None) -> dict[str, float]:
    """Mean absolute % time error per family (FAMILIES: "gemm fp32", "conv forward fp16", ...) of ``spec``'s
    predictions of DeepBench's V100 timings (``points``; default ``load_points()``), the values in ``spec`` held:
    a fidelity figure of the GPU file as it stands (in-sample for a spec fitted on these points; ``leave_one_out``
    gives the out-of-sample one). Cheap: one KernelPhysics evaluation of ~900 kernels at one clock.

    Raises:
        FileNotFoundError: ``points`` is None and the sheets are missing.
    """
    points = load_points() if points is None else points
    err = np.abs(errors_pct(spec, points))
    return {f: float(np.mean([e for e, p in zip(err, points) if p.family == f])) for f in FAMILIES
            if any(p.family == f for p in points)}  # fmt: skip


def _exercised(points: Sequence[DeepBenchPoint]) -> list[str]:
    """The PARAMS some point's time depends on: the K overhead and the convolution factors only on tensor cores."""
    from freqopt.gpu.backends.physics import conv_channels, conv_is_3x3_stride1

    used = {"gemm_efficiency", "gemm_fixed_us"}
    for p in points:
        conv = p.family.startswith("conv")
        direction = p.family.split()[1] if conv else ""
        cores = "" if p.kernel.tensor_core else "_cuda_cores"
        if p.kernel.tensor_core:
            used.add("gemm_k_overhead")
        if not conv:
            continue
        used.add(f"conv/{direction}{cores}")
        if conv_is_3x3_stride1(p.kernel):
            used.add(f"conv/{direction}_3x3{cores}")
        if p.kernel.tensor_core and conv_channels(p.kernel)[0] != conv_channels(p.kernel)[1]:
            used.add(f"conv/{direction}_small_channels")
    return [k for k in PARAMS if k in used]


def fit(spec: GPUSpec, points: Sequence[DeepBenchPoint], *, max_nfev: int = 60) -> tuple[GPUSpec, dict[str, float]]:
    """``spec`` with PARAMS fitted to ``points`` (the ones some point exercises; the rest held), and the fitted
    values: scipy.optimize.least_squares (trust-region reflective, within PARAMS' bounds) on the log ratio of
    predicted to measured time in %, at most ``max_nfev`` evaluations (the solver stops on work, not time)."""
    names = _exercised(points)
    start = current_values(spec, names)
    lo = np.array([PARAMS[k][0] for k in names])
    hi = np.array([PARAMS[k][1] for k in names])
    x0 = np.clip([0.5 if math.isnan(start[k]) else start[k] for k in names], lo + 1e-9, hi - 1e-9)
    measured = np.array([p.measured_s for p in points])

    def fun(x):
        return 100.0 * np.log(predict_s(with_values(spec, dict(zip(names, x))), points) / measured)

    result = least_squares(fun, x0, bounds=(lo, hi), x_scale=np.maximum(np.abs(x0), 1e-3), max_nfev=max_nfev,
                           diff_step=1e-4)  # fmt: skip
    values = dict(zip(names, (float(v) for v in result.x)))
    return with_values(spec, values), values


def leave_one_out(spec: GPUSpec, points: Sequence[DeepBenchPoint], *, max_nfev: int = 60,
                  shapes: Sequence[str] | None = None) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Leave one shape out: for each shape (``shapes``, default every point's), fit on the other shapes' points
    (``fit``) and predict the shape's. Returns (one row per left-out point: family, shape, measured_s,
    predicted_s, error_pct; one row per fold: shape and the fitted values)."""
    shapes = list(dict.fromkeys(p.shape for p in points)) if shapes is None else list(shapes)
    rows, folds = [], []
    for shape in shapes:
        held = [p for p in points if p.shape == shape]
        fitted, values = fit(spec, [p for p in points if p.shape != shape], max_nfev=max_nfev)
        for p, t in zip(held, predict_s(fitted, held)):
            rows.append({"family": p.family, "shape": shape, "measured_s": p.measured_s, "predicted_s": float(t),
                         "error_pct": 100.0 * (float(t) / p.measured_s - 1.0)})  # fmt: skip
        folds.append({"shape": shape, **values})
    return rows, folds
