"""Calibration of the simulated H100 against read-only measurements of a real one (experiments/data/h100/).

The measurements were taken at the GPU's default settings (700 W limit, boost clocks, memory 2619 MHz), so they
pin what the GPU does there: how fast each kind of kernel runs, what it draws, and at which clock the firmware
holds it under the 700 W limit. Each *point* is a list of kernels replayed in a loop, with what the GPU measured
(time per repetition, average power, and the mean SM clock where the GPU throttled). The points:

* microbenchmarks (``microbenchmarks.json``): bf16 GEMMs 1024-8192 square and the GPT-3 Small MLP shape, a
  256 Mi-element copy, tanh-GELU, layer norm, causal SDPA forward, each one operator in a Python loop;
* kernel classes of a gpt3-small iteration replayed by freqopt's NVML backend (``kernel_classes_replayed.json``):
  the GEMM classes and the attention forward ran as themselves; every other class ran as a device copy of its
  bytes, so it is a copy point (that is what the GPU ran). Left out: the attention backward (replayed through
  PyTorch's math path, which freqopt's attention does not take), the two vocabulary GEMMs whose N = 50257 is not a
  multiple of 8 (cuBLAS's unaligned fallback, 4.5x slower; freqopt pads the vocabulary to 50304), and copies of
  1-100 MB, which a replay loop runs from L2 (``L2_RESIDENT_BYTES``);
* idle with a CUDA context at 1980 MHz (two readings, 119.5 and 128.5 W) and idle at 405 MHz without one
  (``nvidia-smi-q.txt``: 71.6 W instantaneous) pin the board's baseline power at two clocks.

What these cannot separate is fixed by assumption, each stated in ``ASSUMED`` with its source.

The fit (``fit``) is a least-squares fit (scipy.optimize.least_squares) of ``FIT_PARAMETERS`` to the points'
relative errors in time, power and throttled clock; ``residuals`` computes the table that
experiments/h100_calibration.md shows and tests/test_calibration.py holds the committed constants to.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freqopt.gpu.backends.base import DEFAULT_SETTING
from freqopt.gpu.backends.simulated import KernelPhysics, SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.workload.kernels import Kernel
from freqopt.workload.models.sdpa import SDPA_KERNEL_NAMES

# PyTorch's default SDPA (cuDNN's fused attention on Hopper with PyTorch 2.11), the kernel the attention points ran:
# named as the tracer names a user's F.scaled_dot_product_attention (freqopt.workload.models.sdpa).
SDPA_ATTENTION = SDPA_KERNEL_NAMES

__all__ = ["Point", "load_points", "residuals", "summarize", "fit", "FIT_PARAMETERS", "ASSUMED", "with_values",
           "voltage_floor_from"]

BF16_BYTES = 2
# Copy-replayed classes carry only their simulated time as the replaying freqopt computed it (its version in
# experiments/data/h100/README.md); their bytes are recovered from it by that version's roofline (DRAM-bound:
# t = bytes / (3352 GB/s x 0.9) + 4 us, its h100-sxm.toml).
_OLD_STREAM_BPS, _OLD_FIXED_S = 3352e9 * 0.9, 4e-6
IDLE_CONTEXT_W = (119.47898898396062 + 128.451840689106) / 2  # microbenchmarks.json "idle", two readings
IDLE_405_MHZ_W = 71.58  # nvidia-smi-q.txt: Instantaneous Power Draw at 405 MHz, no context
# A copy replayed over and over on the same two buffers runs from the 50 MB L2 once both fit there: the replayed
# classes moving 1-100 MB ran at up to 3.3 TB/s, above HBM3's 3.35 TB/s peak at 89 % efficiency, and drew less.
# Such points say nothing of DRAM streaming and are left out; below 1 MB a copy is launch-bound (host points).
L2_RESIDENT_BYTES = (1e6, 100e6)
# Vocabulary GEMMs with a dimension of 50257 (not a multiple of 8): cuBLAS's unaligned path, excluded.
_UNALIGNED = ("8192x768,768x50257", "8192x50257,50257x768")

# name -> (lower, upper, start). Time: GEMM and attention efficiency, streaming bandwidth, layer norm's, the
# host's issue times. Power: the baseline's constant and clock-tree terms, SM activity, memory activity, the
# voltage curve, on-chip streaming, and the SM power of transcendental, layer-norm and attention kernels.
FIT_PARAMETERS: dict[str, tuple[float, float, float]] = {
    "gemm_efficiency": (0.6, 1.0, 0.92),
    "gemm_k_overhead": (0.0, 1500.0, 150.0),
    "gemm_fixed_us": (0.0, 20.0, 5.0),
    "mem_efficiency": (0.7, 1.0, 0.89),
    "layer_norm_bandwidth_rel": (0.2, 1.0, 0.45),
    "host_issue_us": (2.0, 20.0, 8.0),
    "host_gemm_issue_us": (2.0, 30.0, 15.0),
    "p_const_w": (0.0, 150.0, 55.0),
    "p_sm_clock_w": (0.0, 300.0, 30.0),
    "p_sm_active_w": (100.0, 1500.0, 700.0),
    "p_sm_stream_w": (0.0, 700.0, 250.0),
    "v_min_rel": (0.4, 0.95, 0.65),
    "f_knee_mhz": (600.0, 1700.0, 1000.0),
    "p_sfu_w": (0.0, 900.0, 250.0),
    "p_norm_w": (0.0, 900.0, 150.0),
    "p_attention_w": (0.0, 900.0, 150.0),
}
# What read-only data at default settings cannot separate, and where the value comes from.
ASSUMED: dict[str, tuple[float, str]] = {
    "p_mem_clock_w": (40.2, "memory power at 2619 MHz with no traffic: nvidia-smi's 'GPU Memory Power Readings' "
                            "average (40.2 W, nvidia-smi-q.txt, taken while the board averaged 116 W: an upper "
                            "bound); memory power against SM power is not otherwise separable at one memory clock"),
    "p_mem_active_w": (104.6, "DRAM power at full bandwidth: 3.9 pJ/bit (HBM2 with its interface, O'Connor et al. "
                               "2017, 'Fine-Grained DRAM', MICRO) x 3352 GB/s; the rest of a copy's power above idle "
                               "is on-chip (L2, crossbar, load/store: p_sm_stream_w, fitted) and scales with the SM "
                               "clock's V^2 f. Readings at one SM clock cannot split the two"),
    "p_leak_w": (0.0, "leakage folded into the constant and clock-tree terms: two idle readings cannot separate "
                      "a voltage-linear term from a V^2 f one"),
    "power_window_s": (0.00436959, "the power limit's control window, from the V100 fit (experiments/calibrate.py)"),
    "kernel_fixed_us": (4.0, "launch and tail latency per kernel on the GPU (assumed, as before)"),
    "mem_clock_1593": (1593.0, "power and bandwidth at the 1593 MHz memory clock scale with the clock, as the "
                               "power model's m/m_max terms say: never measured (locking it would change the GPU)"),
}
_MODEL_KEYS = ("gemm_efficiency", "gemm_k_overhead", "gemm_fixed_us", "mem_efficiency", "layer_norm_bandwidth_rel")
_HOST_KEYS = {"host_issue_us": "host_issue_s", "host_gemm_issue_us": "host_gemm_issue_s"}


@dataclass(frozen=True)
class Point:
    """One measured loop of kernels.

    Attributes:
        name: where it comes from (``micro/gemm_bf16_8192``, ``replay/<kernel class>``, ``idle/...``).
        kernels: one repetition; empty for an idle point (then the GPU's baseline power at ``idle_clock_mhz``).
        time_s: measured time per repetition, s (None for idle points).
        power_w: measured average power, W.
        sm_clock_mhz: measured mean SM clock where the power limit throttled it (clock-event reason 4), else None.
        idle_clock_mhz: the SM clock of an idle point.
    """

    name: str
    kernels: tuple[Kernel, ...]
    time_s: float | None
    power_w: float
    sm_clock_mhz: float | None = None
    idle_clock_mhz: int | None = None


def _gemm(m: int, k: int, n: int, name: str = "aten.mm", pass_name: str = "forward") -> Kernel:
    shapes = ((m, k), (k, n)) if name == "aten.mm" else ((n,), (m, k), (k, n))
    nbytes = BF16_BYTES * (m * k + k * n + m * n + (n if name == "aten.addmm" else 0))
    return Kernel(name, "gemm", pass_name, 2.0 * m * k * n, float(nbytes), "bfloat16", shapes, tensor_core=True)


def _copy(nbytes: float) -> Kernel:
    elements = max(int(nbytes // (2 * BF16_BYTES)), 1)
    return Kernel("aten.copy_", "memcpy", "forward", 0.0, float(nbytes), "bfloat16", ((elements,), (elements,)))


def _micro_kernel(r: dict) -> Kernel:
    name = r["name"]
    if name.startswith("gemm_bf16_"):
        dims = name.removeprefix("gemm_bf16_").split("x")
        m, k, n = (int(dims[0]),) * 3 if len(dims) == 1 else map(int, dims)
        return _gemm(m, k, n)
    elements = r["mem_bytes"] // (2 * BF16_BYTES)
    if name.startswith("copy_"):
        return _copy(r["mem_bytes"])
    if name.startswith("gelu_"):
        return Kernel("aten.gelu", "elementwise", "forward", 0.0, float(r["mem_bytes"]), "bfloat16", ((elements,),))
    if name.startswith("layernorm_"):
        rows, width = map(int, name.removeprefix("layernorm_bf16_").split("x"))
        return Kernel("aten.native_layer_norm", "normalization", "forward", 0.0, float(r["mem_bytes"]), "bfloat16",
                      ((rows, width), (width,), (width,)))  # fmt: skip
    if name.startswith("sdpa_causal_"):
        b, nh, t, hs = map(int, name.removeprefix("sdpa_causal_").split("x"))
        # The tracer's count, 4 b nh t^2 hs (q k^T and p v, causal masking not discounted); the file's "flops"
        # field halves it. F.scaled_dot_product_attention on this H100 (PyTorch 2.11) runs cuDNN's fused kernel
        # (the whole steps' torch.profiler names: cudnn_generated_fort_native_sdpa_sm90_flash_*).
        return Kernel(SDPA_ATTENTION[0], "attention", "forward", 4.0 * b * nh * t * t * hs,
                      float(r["mem_bytes"]), "bfloat16", ((b, nh, t, hs),) * 3, tensor_core=True, causal=True)  # fmt: skip
    raise ValueError(f"no kernel for microbenchmark {name!r}")


def _replay_kernel(unit: dict) -> Kernel | None:
    """The kernel that the replaying NVML backend ran for one kernel of a replayed class; None if excluded."""
    pass_name, rest = unit["unit"].split("/", 1)
    kind, name, dtype, shapes = rest.split("|")[:4]
    if kind == "gemm":
        if any(s in shapes for s in _UNALIGNED):
            return None
        dims = [tuple(map(int, s.split("x"))) for s in shapes.split(",") if s]
        if name == "aten.addmm":
            dims = dims[1:]
        (m, k), (_, n) = dims
        return _gemm(m, k, n, name, pass_name)
    if kind == "attention":
        if name.endswith("_backward"):
            return None
        b, nh, t, hs = map(int, shapes.split(",")[0].split("x"))
        flops = 4.0 * b * nh * t * t * hs
        # Replayed by a freqopt whose freqopt.flash_attention ran F.scaled_dot_product_attention on CUDA: cuDNN's
        # kernel on this H100 (78.7 us at gpt3-small's shape, as cuDNN's on the H200, 80.7; FlashAttention-2 took
        # 128 us there: experiments/h200_check.md).
        return Kernel(SDPA_ATTENTION[0], "attention", pass_name, flops, 4.0 * BF16_BYTES * b * nh * t * hs, dtype,
                      ((b, nh, t, hs),) * 3, tensor_core=True, causal=True)  # fmt: skip
    per_kernel_s = unit["sim_time_s"] / unit["n_kernels"]
    nbytes = max(per_kernel_s - _OLD_FIXED_S, 0.0) * _OLD_STREAM_BPS
    if L2_RESIDENT_BYTES[0] <= nbytes < L2_RESIDENT_BYTES[1]:
        return None
    return _copy(nbytes)


def load_points(folder: str | Path) -> list[Point]:
    """The calibration points of ``folder`` (experiments/data/h100): microbenchmarks, replayed classes, idle."""
    folder = Path(folder)
    points = []
    for r in json.loads((folder / "microbenchmarks.json").read_text())["results"]:
        if r["name"] == "idle":
            continue
        throttled = 4 in r.get("reasons_seen", [])
        points.append(Point(f"micro/{r['name']}", (_micro_kernel(r),), r["time_per_op_s"], r["avg_power_w"],
                            r["sm_clock_mhz_mean"] if throttled else None))  # fmt: skip
    for unit in json.loads((folder / "kernel_classes_replayed.json").read_text())["units"]:
        kernel = _replay_kernel(unit)
        if kernel is None:
            continue
        n = unit["n_kernels"]
        clock = unit["sm_clock_mhz_seen"]
        points.append(Point(f"replay/{unit['unit']}", (kernel,) * n, unit["time_s"], unit["energy_j"] / unit["time_s"],
                            float(clock) if clock < 1980 else None))  # fmt: skip
    points.append(Point("idle/context at 1980 MHz", (), None, IDLE_CONTEXT_W, idle_clock_mhz=1980))
    points.append(Point("idle/no context at 405 MHz", (), None, IDLE_405_MHZ_W, idle_clock_mhz=405))
    return points


def with_values(spec: GPUSpec, values: dict[str, float]) -> GPUSpec:
    """``spec`` with fitted (FIT_PARAMETERS) and assumed (ASSUMED) values set."""
    pm_fields = {f.name for f in dataclasses.fields(spec.power_model)}
    pm = {k: v for k, v in values.items() if k in pm_fields}
    pm.update(p_mem_clock_w=ASSUMED["p_mem_clock_w"][0], p_mem_active_w=ASSUMED["p_mem_active_w"][0],
              p_leak_w=ASSUMED["p_leak_w"][0],
              power_window_s=ASSUMED["power_window_s"][0])  # fmt: skip
    model = {k: values[k] for k in _MODEL_KEYS if k in values and k != "gemm_fixed_us"}
    if "gemm_fixed_us" in values:
        model["gemm_fixed_s"] = values["gemm_fixed_us"] * 1e-6
    host = {field: values[k] * 1e-6 for k, field in _HOST_KEYS.items() if k in values}
    return dataclasses.replace(spec, power_model=dataclasses.replace(spec.power_model, **pm),
                               kernel_fixed_s=ASSUMED["kernel_fixed_us"][0] * 1e-6, **model, **host)  # fmt: skip


def current_values(spec: GPUSpec) -> dict[str, float]:
    """The committed values of FIT_PARAMETERS in ``spec``."""
    out = {}
    for k in FIT_PARAMETERS:
        if k in _HOST_KEYS:
            out[k] = getattr(spec, _HOST_KEYS[k]) * 1e6
        elif k == "gemm_fixed_us":
            out[k] = spec.gemm_fixed_s * 1e6
        elif hasattr(spec.power_model, k):
            out[k] = getattr(spec.power_model, k)
        else:
            out[k] = getattr(spec, k)
    return out


def voltage_floor_from(reference: GPUSpec, *, with_knee: bool = False, target: GPUSpec | None = None) -> dict[str, float]:
    """The voltage curve's floor of ``reference`` (``v_min_rel``, a fraction of the top clock's voltage), to hold
    fixed in ``fit``; with ``with_knee``, also its knee at the same fraction of ``target``'s highest SM clock.

    Why: every point here lies at 1335-1980 MHz (the GPU's default settings). They pin the voltage curve's slope
    there, not how far down it goes: the floor and the knee trade off along one line. A measured sweep of another
    GPU pins the floor. The fit carries the floor of the A100's fit on Perseus's BLOOM stage sweep
    (experiments/fit_dvfs.py, experiments/dvfs_fit.md), the only fitted curve not held at its bounds (the A40's
    floor sits at its lower bound, its clock ratios pinned by the time model's split instead). The A100's knee
    does not carry: its steeper rise to the top clock puts the H100's launch-bound whole step (gpt3-small at
    micro-batch 1, at 1980 MHz) 12 % high in energy (``python experiments/calibrate_h100.py --carry-knee``).

    Returns:
        ``{"v_min_rel": float}`` (and ``"f_knee_mhz"`` with ``with_knee``), to pass as ``fit(..., fixed=...)``.

    Raises:
        ValueError: ``with_knee`` without ``target``.
    """
    pm = reference.power_model
    out = {"v_min_rel": pm.v_min_rel}
    if with_knee:
        if target is None:
            raise ValueError("with_knee needs the target GPU, whose highest SM clock places the knee")
        out["f_knee_mhz"] = pm.f_knee_mhz / reference.max_sm_clock_mhz * target.max_sm_clock_mhz
    return out


def residuals(spec: GPUSpec, points: list[Point]) -> list[dict]:
    """Per point: measured and simulated time, power and (throttled) clock, and errors in % of the measured."""
    gpu = SimulatedGPU(spec, noise=False)
    rows = []
    for p in points:
        row = {"point": p.name, "power_measured_w": p.power_w}
        if not p.kernels:
            mem = np.array([spec.max_mem_clock_mhz], dtype=float)
            probe = Kernel("idle", "memcpy", "forward", 0.0, 0.0, "bfloat16", ())
            base = KernelPhysics(spec, [probe], mem).baseline_power_w[0, spec.sm_clocks_mhz.index(p.idle_clock_mhz)]
            row.update(power_simulated_w=float(base), power_error_pct=100 * (float(base) / p.power_w - 1))
            rows.append(row)
            continue
        m = gpu.true_measure(list(p.kernels), DEFAULT_SETTING)
        row.update(time_measured_s=p.time_s, time_simulated_s=m.time_s, time_error_pct=100 * (m.time_s / p.time_s - 1),
                   power_simulated_w=m.avg_power_w, power_error_pct=100 * (m.avg_power_w / p.power_w - 1))  # fmt: skip
        if p.sm_clock_mhz is not None:
            row.update(clock_measured_mhz=p.sm_clock_mhz, clock_simulated_mhz=m.sm_clock_mhz,
                       clock_error_pct=100 * (m.sm_clock_mhz / p.sm_clock_mhz - 1))  # fmt: skip
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Largest and root-mean-square |error| in % for time, power and clock, over the rows that have them."""
    out = {}
    for key in ("time_error_pct", "power_error_pct", "clock_error_pct"):
        errors = [r[key] for r in rows if key in r]
        out[key] = {"max_abs": max(map(abs, errors)), "rms": math.sqrt(sum(e * e for e in errors) / len(errors)),
                    "n": len(errors)}  # fmt: skip
    return out


def fit(spec: GPUSpec, points: list[Point], *, fixed: dict[str, float] | None = None, max_nfev: int = 300) -> GPUSpec:
    """Least-squares fit of FIT_PARAMETERS (bounds and starts there) to the points' errors in time (log ratio),
    power and throttled clock, each in % (scipy.optimize.least_squares, trust-region reflective).

    Args:
        fixed: FIT_PARAMETERS held at the values given instead of fitted (the voltage curve's shape carried from a
            measured sweep of another GPU: experiments/calibrate_h100.py says which and why).

    Raises:
        ValueError: ``fixed`` names a constant that is not in FIT_PARAMETERS.
    """
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    if unknown := sorted(set(fixed) - set(FIT_PARAMETERS)):
        raise ValueError(f"fixed names {unknown}, which are not fitted constants; choose from {list(FIT_PARAMETERS)}")
    names = [n for n in FIT_PARAMETERS if n not in fixed]
    lower, upper, x0 = (np.array(v) for v in zip(*(FIT_PARAMETERS[n] for n in names)))

    def fun(x):
        rows = residuals(with_values(spec, {**fixed, **dict(zip(names, x))}), points)
        out = []
        for r in rows:
            if "time_error_pct" in r:
                out.append(100 * math.log(r["time_simulated_s"] / r["time_measured_s"]))
            out.append(r["power_error_pct"])
            if "clock_error_pct" in r:
                out.append(r["clock_error_pct"])
        return out

    # Steps of 1 %: the power limit's clock steps make the error piecewise constant at finer steps.
    result = least_squares(fun, x0, bounds=(lower, upper), diff_step=0.01, x_scale=upper - lower, max_nfev=max_nfev)
    return with_values(spec, {**fixed, **dict(zip(names, map(float, result.x)))})
