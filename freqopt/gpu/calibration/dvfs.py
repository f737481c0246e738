"""The DVFS power model fitted on measured sweeps of transformer training work at locked SM clocks.

Source: Perseus's artifact (Chung et al., "Perseus: Reducing Energy Bloat in Large Model Training", SOSP 2024;
github.com/ml-energy/zeus, branch ``kronos``, ``sosp24_data/emulation/stage_profile/``; copied into
experiments/data/perseus/). Each file holds the time and energy of the forward and the backward of one micro-batch
through one pipeline stage of a large transformer at every SM clock 15 MHz apart: BLOOM 176B on an A100 SXM
(855-1410 MHz) and BLOOM 176B and GPT-3 175B on an A40 (855-1740 MHz). They are the only public measurements of
the power curve away from the default clocks, which no read-only GPU shows.

Method. Each stage is modelled as freqopt kernels (``STAGES``; what the files do not give, the layers per stage,
tensor-parallel degree and micro-batch, is an assumption stated there) and run on the simulated GPU at every
measured clock (``SimulatedGPU.run``, one pass from an idle GPU, under the board's power limit). What is compared is
the forward + backward's time and energy relative to the top clock, which depend little on the exact shapes, and
the top clock's average power. ``fit`` is a least-squares fit (scipy.optimize.least_squares) of the power model's
voltage curve and power terms (``FIT_PARAMETERS``) to those; ``residuals`` gives the table
experiments/dvfs_fit.md shows and tests/test_calibration.py holds the committed constants to.

The GPT-3 175B A100 sweep of the same artifact is held out as a check: nothing here reads it.
"""

from __future__ import annotations

import csv
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import GPUSpec, PowerModel
from freqopt.workload.kernels import Kernel

__all__ = ["Stage", "Sweep", "STAGES", "FIT_PARAMETERS", "load_sweep", "stage_kernels", "simulate_sweep",
           "simulate_stage", "residuals", "summarize", "fit", "with_values", "values_of", "TIME_PARAMETERS"]


@dataclass(frozen=True)
class Stage:
    """One measured pipeline stage and how freqopt models it.

    Attributes:
        name: ``<model>+<gpu>`` as the artifact names the file.
        file: the sweep's file name in experiments/data/perseus/.
        gpu: freqopt's GPU type.
        d_model, n_heads, n_layers: the transformer layers of one stage (no embedding, no output layer: the files'
            stages 1-6 equal stage 0, so stage 0 is a middle stage of the same layers).
        tp: tensor-parallel degree whose shards one GPU runs.
        micro_batch_size, seq_len: sequences and tokens per micro-batch.
        collectives: whether the tensor-parallel all-reduces are part of the measured time.
        power_limit_w: the boards' power limit during the sweep.
        assumption: what of the above the files do not say, and why the value was chosen.
    """

    name: str
    file: str
    gpu: str
    d_model: int
    n_heads: int
    n_layers: int
    tp: int
    micro_batch_size: int
    seq_len: int
    collectives: bool
    power_limit_w: float
    assumption: str


# BLOOM 176B: 70 layers, d_model 14336, 112 heads, sequence 2048 (BigScience, arXiv 2211.05100, table 3).
# GPT-3 175B: 96 layers, d_model 12288, 96 heads, sequence 2048 (Brown et al. 2020, table 2.1).
# Perseus runs 8 pipeline stages (shared/calibration/perseus/README.md): 9 BLOOM layers or 12 GPT-3 layers per stage.
# The artifact's emulation (evaluation.ipynb, "Large-Scale Emulation", branch kronos) sets tp, pp = 8, 8 and a global
# batch of 1536 split as 1536 // M pipelines of M micro-batches: tensor parallel 8 and micro-batch 1 are its own
# figures. It also multiplies the files' time by 10 (and energy by 10 x tp) to get a stage's, so the files hold
# about a tenth of a stage's work; with a stage's mix of kernels, that leaves the ratios to the top clock compared
# here as a stage's. Absolute times are not compared.
STAGES: dict[str, Stage] = {
    "bloom+a100": Stage(
        "bloom+a100", "bloom+a100_sxm_bf16.csv", "a100-sxm4-80gb", 14336, 112, 9, 8, 1, 2048, True, 500.0,
        "9 layers (70 over 8 stages; stage 7 is the shorter one), tensor parallel 8 on NVLink (the all-reduces "
        "included) and micro-batch 1, the artifact's own emulation figures (evaluation.ipynb: tp, pp = 8, 8; a "
        "global batch of 1536 over 1536 // M pipelines of M micro-batches). Power limit 500 W: the "
        "stage averages 467 W at 1410 MHz, above the 400 W of the standard A100 80GB SXM, so these are the 500 W "
        "boards (NVIDIA A100 data sheet: the HGX A100 80GB custom-thermal SKU supports up to 500 W)"),
    "bloom+a40": Stage(
        "bloom+a40", "bloom+a40_bf16.csv", "a40", 14336, 112, 9, 8, 1, 2048, True, 300.0,
        "as the A100's stage (9 layers, tp=8, micro-batch 1, the artifact's figures), its all-reduces over PCIe "
        "included: with the A40's "
        "throttle under its 300 W limit they are what leaves half of the measured time independent of the SM clock "
        "(1.37x the time at 855 MHz against 1.02x at 1455), where the A100's NVLink leaves a sixth; the A40's GEMM "
        "efficiency and PCIe all-reduce efficiency, assumed in its file, are fitted with the power model. Power "
        "limit 300 W (the A40's default and maximum)"),
    "gpt3-175b+a40": Stage(
        "gpt3-175b+a40", "gpt3-175b+a40_bf16.csv", "a40", 12288, 96, 12, 8, 1, 2048, True, 300.0,
        "12 layers (96 over 8 stages), tp=8 with its all-reduces over PCIe, micro-batch 1, as the BLOOM stage on "
        "the A40; power limit 300 W"),
}

# name -> (lower, upper): the power model's voltage curve and its static, clock-tree and activity terms. The
# memory terms are not fitted: the sweeps hold the memory clock, so they cannot separate them from the constant.
FIT_PARAMETERS: dict[str, tuple[float, float]] = {
    "p_const_w": (0.0, 300.0),
    "p_leak_w": (0.0, 300.0),
    "p_sm_clock_w": (0.0, 400.0),
    "p_sm_active_w": (20.0, 1500.0),
    "v_min_rel": (0.3, 0.98),
    "f_knee_rel": (0.3, 0.95),  # f_knee_mhz over the GPU's highest SM clock
}
# Time-model figures that a GPU type's file only assumes, fitted where a sweep pins them (the A40: how much of a
# stage's time does not scale with the SM clock: the all-reduces over PCIe against the GEMMs).
TIME_PARAMETERS: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.4, 0.95),
    "link_efficiency": (0.2, 1.0),
    # The bytes per SM clock the SMs move to and from memory (GPUSpec.l2_bytes_per_clock): what slows a memory-bound
    # kernel at low SM clocks. Not published for most dies; 512-4096 B per clock spans the L2 bandwidths measured on
    # Volta to Hopper by microbenchmarks (Jia et al. 2018-2019: V100 ~2.2 TB/s at 1.38 GHz, ~1600 B per clock)
    # with a factor of about 3 either way (assumed).
    "l2_bytes_per_clock": (512.0, 4096.0),
}


@dataclass(frozen=True)
class Sweep:
    """A stage's forward + backward at each locked SM clock, shapes (F,), clocks ascending."""

    sm_clock_mhz: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray


def load_sweep(path: str | Path, stage: int = 0) -> Sweep:
    """The sweep of pipeline stage ``stage`` in a Perseus stage-profile CSV (``#`` lines are comments).

    Raises:
        ValueError: the file holds no row of that stage, or a clock lacks its forward or backward.
    """
    rows = [r for r in csv.DictReader(line for line in Path(path).read_text().splitlines()
                                      if not line.startswith("#")) if int(r["stage"]) == stage]  # fmt: skip
    if not rows:
        raise ValueError(f"{path} holds no row of stage {stage}")
    by_clock: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
    for r in rows:
        by_clock[int(r["frequency"])][r["instruction"]] = (float(r["time"]), float(r["energy"]))
    clocks = sorted(by_clock)
    for f in clocks:
        if set(by_clock[f]) != {"forward", "backward"}:
            raise ValueError(f"{path}: stage {stage} at {f} MHz lacks its forward or backward")
    both = np.array([np.add(by_clock[f]["forward"], by_clock[f]["backward"]) for f in clocks])  # (F, 2)
    return Sweep(np.array(clocks, dtype=float), both[:, 0], both[:, 1])


@lru_cache(maxsize=None)
def stage_kernels(name: str) -> tuple[Kernel, ...]:
    """The forward and backward kernels of one GPU of ``STAGES[name]`` (freqopt's GPT-3 layers at the stage's
    shapes; a vocabulary of 128 keeps the output layer negligible), collectives dropped where the stage says the
    measured time does not include them."""
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import Workload
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.trace import trace_training_iteration

    s = STAGES[name]
    config = GPTConfig(n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads, vocab_size=128, vocab_multiple=1,
                       seq_len=s.seq_len)  # fmt: skip
    trace = trace_training_iteration(Workload(name, config, s.micro_batch_size, Layout(tp=s.tp)))
    return tuple(k for k in trace.kernels if k.pass_name in ("forward", "backward")
                 and (s.collectives or not k.is_collective))  # fmt: skip


def simulate_sweep(spec: GPUSpec, kernels: tuple[Kernel, ...], sm_clocks_mhz: np.ndarray,
                   power_limit_w: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """(time_s, energy_j, time-weighted mean SM clock in MHz), each (F,): the kernels at each locked SM clock under
    ``power_limit_w``, issued once from an idle GPU (SimulatedGPU.run, loop=False, noiseless)."""
    if power_limit_w > spec.power_limit_max_w:
        spec = dataclasses.replace(spec, power_limit_max_w=power_limit_w)
    gpu = SimulatedGPU(spec)
    out = []
    for f in sm_clocks_mhz:
        t, e, c = gpu.run(kernels, [ClockSetting(int(f), None, power_limit_w)] * len(kernels), loop=False)
        out.append((t.sum(), e.sum(), np.average(c, weights=t)))
    return tuple(np.array(col) for col in zip(*out))  # type: ignore[return-value]


def simulate_stage(spec: GPUSpec, stage: Stage, sweep: Sweep) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """simulate_sweep of the stage's kernels at the sweep's clocks under the stage's power limit."""
    return simulate_sweep(spec, stage_kernels(stage.name), sweep.sm_clock_mhz, stage.power_limit_w)


def with_values(spec: GPUSpec, values: dict[str, float]) -> GPUSpec:
    """``spec`` with the fields in ``values`` replaced: the power model's (``f_knee_rel`` as f_knee_mhz over the
    highest SM clock), ``link_efficiency`` of the interconnect, and GPUSpec's own (``gemm_efficiency``)."""
    values = dict(values)
    if "f_knee_rel" in values:
        values["f_knee_mhz"] = values.pop("f_knee_rel") * spec.max_sm_clock_mhz
    power = {k: values.pop(k) for k in list(values) if k in PowerModel.__dataclass_fields__}
    link = {k: values.pop(k) for k in list(values) if k == "link_efficiency"}
    return dataclasses.replace(spec, power_model=dataclasses.replace(spec.power_model, **power),
                               interconnect=dataclasses.replace(spec.interconnect, **link), **values)


def values_of(spec: GPUSpec, names: Sequence[str]) -> dict[str, float]:
    """The fields ``names`` of ``spec`` as ``with_values`` takes them (its inverse): the power model's
    (``f_knee_rel`` as f_knee_mhz over the highest SM clock), ``link_efficiency`` of the interconnect, and
    GPUSpec's own (``gemm_efficiency``, ``l2_bytes_per_clock``); in the order of ``names``."""
    out = {}
    for name in names:
        if name == "f_knee_rel":
            out[name] = spec.power_model.f_knee_mhz / spec.max_sm_clock_mhz
        elif name == "link_efficiency":
            out[name] = spec.interconnect.link_efficiency
        elif name in PowerModel.__dataclass_fields__:
            out[name] = getattr(spec.power_model, name)
        else:
            out[name] = getattr(spec, name)
    return {k: float(v) for k, v in out.items()}


def residuals(spec: GPUSpec, stage: Stage, sweep: Sweep) -> dict:
    """Measured against simulated for one stage: per clock the time and energy ratios to the top clock and their
    errors (percentage points), the top clock's average power, and the energy-optimal clocks."""
    sim_t, sim_e, sim_c = simulate_stage(spec, stage, sweep)
    tr_m, er_m = sweep.time_s / sweep.time_s[-1], sweep.energy_j / sweep.energy_j[-1]
    tr_s, er_s = sim_t / sim_t[-1], sim_e / sim_e[-1]
    points = [{"sm_clock_mhz": int(f), "time_rel_measured": float(a), "time_rel_simulated": float(b),
               "time_rel_error_pp": float(100 * (b - a)), "energy_rel_measured": float(c),
               "energy_rel_simulated": float(d), "energy_rel_error_pp": float(100 * (d - c)),
               "simulated_sm_clock_mhz": float(g)}
              for f, a, b, c, d, g in zip(sweep.sm_clock_mhz, tr_m, tr_s, er_m, er_s, sim_c)]  # fmt: skip
    return {
        "stage": stage.name, "gpu": spec.name, "points": points,
        "top_power_measured_w": float(sweep.energy_j[-1] / sweep.time_s[-1]),
        "top_power_simulated_w": float(sim_e[-1] / sim_t[-1]),
        "top_time_measured_s": float(sweep.time_s[-1]), "top_time_simulated_s": float(sim_t[-1]),
        "energy_optimal_measured_mhz": int(sweep.sm_clock_mhz[np.argmin(sweep.energy_j)]),
        "energy_optimal_simulated_mhz": int(sweep.sm_clock_mhz[np.argmin(sim_e)]),
    }  # fmt: skip


def summarize(result: dict) -> dict:
    """The worst absolute time and energy ratio errors (pp), the top power's error (%) and the optimum's miss (MHz)."""
    pts = result["points"]
    return {
        "max_abs_time_rel_error_pp": max(abs(p["time_rel_error_pp"]) for p in pts),
        "max_abs_energy_rel_error_pp": max(abs(p["energy_rel_error_pp"]) for p in pts),
        "top_power_error_pct": 100 * (result["top_power_simulated_w"] / result["top_power_measured_w"] - 1),
        "energy_optimal_miss_mhz": result["energy_optimal_simulated_mhz"] - result["energy_optimal_measured_mhz"],
    }


def fit(spec: GPUSpec, stages: list[tuple[Stage, Sweep]], *, power_parameters: tuple[str, ...] = tuple(FIT_PARAMETERS),
        time_parameters: tuple[str, ...] = (),
        top_power_weight: float = 0.5, max_nfev: int = 200) -> tuple[GPUSpec, object]:  # fmt: skip
    """Fit the ``power_parameters`` named (of ``FIT_PARAMETERS``; the others keep ``spec``'s values), and the
    ``time_parameters`` named (of ``TIME_PARAMETERS``), to the stages' time and energy ratios (one residual per
    clock and ratio, in fractions) and their top-clock average power (relative, weighted ``top_power_weight``).

    Returns:
        (the fitted spec, scipy's OptimizeResult).
    """
    from scipy.optimize import least_squares

    bounds = {**{n: FIT_PARAMETERS[n] for n in power_parameters}, **{n: TIME_PARAMETERS[n] for n in time_parameters}}
    names = list(bounds)
    lower = np.array([bounds[n][0] for n in names])
    upper = np.array([bounds[n][1] for n in names])
    pm = spec.power_model
    start = {**dataclasses.asdict(pm), "f_knee_rel": pm.f_knee_mhz / spec.max_sm_clock_mhz,
             "gemm_efficiency": spec.gemm_efficiency, "link_efficiency": spec.interconnect.link_efficiency}
    x0 = np.clip([start[n] for n in names], lower + 1e-9, upper - 1e-9)

    def fun(x):
        candidate = with_values(spec, dict(zip(names, x)))
        out = []
        for stage, sweep in stages:
            t, e, _ = simulate_stage(candidate, stage, sweep)
            out.append(t / t[-1] - sweep.time_s / sweep.time_s[-1])
            out.append(e / e[-1] - sweep.energy_j / sweep.energy_j[-1])
            out.append([top_power_weight * ((e[-1] / t[-1]) / (sweep.energy_j[-1] / sweep.time_s[-1]) - 1)])
        return np.concatenate(out)

    result = least_squares(fun, x0, bounds=(lower, upper), x_scale=(upper - lower) / 10, max_nfev=max_nfev)
    return with_values(spec, dict(zip(names, result.x))), result
