"""Whole pipelines under a power limit: Perseus's Zeus baseline on the A100 PCIe and A40 testbeds, every stage's GPU
at one power limit, against the simulated GPU.

Data: Chung et al., "Perseus: Reducing Energy Bloat in Large Model Training", SOSP'24 artifact (ml-energy/zeus,
branch ``kronos``, ``sosp24_data/zeus/csv/{A100,A40}/zeus_global.csv``; shared/calibration/zeus/sosp24/): per
model, the iteration time (s) and energy (J, all GPUs) of a pipeline of S stages (4 on the A100 PCIe 80GB testbed,
8 on the A40's), M micro-batches, every GPU at the same power limit, 175-300 W (A100) or 125-300 W (A40).

Nothing is fitted on these sweeps: every figure here is predicted, the GPU files' constants coming from other data
(the A40's from Perseus's locked-clock stage sweeps and Zeus's NSDI'23 power-limit sweeps; the A100 PCIe's carried
from the A100 SXM's fit), so each row is a left-out check.

Method (the accounting of Perseus's own emulation, lowtime/scripts/perseus.py in the same branch: the instructions'
energies, and every GPU drawing its P2P-blocking power while it waits). A stage is ``n_layers / S`` transformer
layers of the model (uniform stages; the files' custom partitions differ by a layer or so, and only ratios to the
highest limit are compared) at the file's micro-batch size, traced by freqopt (``SWEEP_MODELS``: what the file does
not say is an assumption stated there). One micro-batch's forward and backward run on the simulated GPU under the
limit, from an idle GPU (SimulatedGPU.step's physics: host gaps at the waiting power, throttling per control
window), giving t(P) and e(P). A 1F1B pipeline of S uniform stages and M micro-batches takes
``T = (M + S - 1) t(P)`` (each GPU computes M micro-batches and waits out S - 1 in the fill and drain) and draws
``E = S (M e(P) + (S - 1) t(P) P_block)`` with P_block the GPU's waiting power at its highest clocks
(freqopt.gpu.backends.physics.waiting_power_w: Perseus's measured P2P-blocking power on the A40, 70.38 W). The
point-to-point sends and the data loader are not modelled: a power limit does not slow them.

Compared, per limit: the time and energy relative to the highest limit the file holds (percentage points), and the
energy-optimal limit (W).
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.specs import GPUSpec, get_gpu

__all__ = ["PipelineSweep", "SweepModel", "SWEEP_MODELS", "TESTBED_GPUS", "load_pipeline_sweeps", "stage_kernels",
           "simulate_sweep", "sweep_errors"]

# The testbed of each file, as freqopt's GPU types (shared/calibration/zeus/README.md).
TESTBED_GPUS = {"a100": "a100-pcie-80gb", "a40": "a40"}


@dataclass(frozen=True)
class SweepModel:
    """How freqopt models one of the files' networks: a GPT-shaped decoder of ``n_layers`` layers (``d_model``,
    ``n_heads``, ``seq_len`` tokens, ``vocab_size``) in bf16; ``assumption`` says what the file does not."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    assumption: str


# The files' transformer decoders. BERT-huge, T5-3B and Wide-ResNet101 are not modelled here (an encoder of unstated
# size, an encoder-decoder, a CNN in a pipeline): their rows say so.
SWEEP_MODELS: dict[str, SweepModel] = {
    "gpt3-xl": SweepModel(24, 2048, 16, 2048, 50257, "GPT-3 XL (Brown et al. 2020, table 2.1), sequence 2048 "
                          "assumed (GPT-3's context; the artifact does not say)"),
    "gpt3-2.7b": SweepModel(32, 2560, 32, 2048, 50257, "GPT-3 2.7B (table 2.1), sequence 2048 assumed"),
    "gpt3-6.7b": SweepModel(32, 4096, 32, 2048, 50257, "GPT-3 6.7B (table 2.1), sequence 2048 assumed"),
    "bloom-3b": SweepModel(30, 2560, 32, 2048, 250880, "BLOOM-3B (BigScience, bigscience/bloom-3b config: 30 layers, "
                           "2560, 32 heads, 250880 tokens), as a GPT decoder (ALiBi's bias ignored), sequence 2048 "
                           "assumed"),
}


@dataclass(frozen=True)
class PipelineSweep:
    """One model's power-limit sweep on one testbed, limits ascending: ``power_limit_w``, ``time_s`` (per
    iteration) and ``energy_j`` (per iteration, all GPUs), each shape (L,)."""

    testbed: str
    model: str
    stages: int
    micro_batch_size: int
    num_microbatches: int
    power_limit_w: np.ndarray
    time_s: np.ndarray
    energy_j: np.ndarray

    @property
    def gpu(self) -> str:
        return TESTBED_GPUS[self.testbed]

    @property
    def label(self) -> str:
        return f"{self.model} pp={self.stages} M={self.num_microbatches} on {self.testbed}"


def load_pipeline_sweeps(folder: str | Path) -> list[PipelineSweep]:
    """Every (testbed, model) sweep of ``folder``'s ``{a100,a40}_zeus_global.csv`` (shared/calibration/zeus/sosp24).

    Raises:
        ValueError: a row whose stages do not all hold one power limit.
    """
    out = []
    for testbed in TESTBED_GPUS:
        path = Path(folder) / f"{testbed}_zeus_global.csv"
        by_model: dict[str, list[dict]] = {}
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                by_model.setdefault(row["model_name"], []).append(row)
        for model, rows in by_model.items():
            stages = int(rows[0]["pp"])
            limits = []
            for r in rows:
                per_stage = {float(r[f"power_limit_{i}"]) for i in range(stages)}
                if len(per_stage) != 1:
                    raise ValueError(f"{path}: {model} holds stages at different limits {sorted(per_stage)}")
                limits.append(per_stage.pop())
            order = np.argsort(limits)
            out.append(PipelineSweep(testbed, model, stages, int(rows[0]["microbatch_size"]),
                                     int(rows[0]["num_microbatches"]), np.array(limits)[order],
                                     np.array([float(r["time"]) for r in rows])[order],
                                     np.array([float(r["energy"]) for r in rows])[order]))  # fmt: skip
    return out


@lru_cache(maxsize=None)
def stage_kernels(model: str, stages: int, micro_batch_size: int) -> tuple:
    """The forward and backward kernels of one micro-batch through one uniform stage of ``model``
    (SWEEP_MODELS): ``n_layers / stages`` layers (rounded up), a vocabulary of 128 keeping the output layer out."""
    from freqopt.workload.models import Workload
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.trace import trace_training_iteration

    m = SWEEP_MODELS[model]
    config = GPTConfig(n_layers=-(-m.n_layers // stages), d_model=m.d_model, n_heads=m.n_heads, vocab_size=128,
                       vocab_multiple=1, seq_len=m.seq_len)  # fmt: skip
    trace = trace_training_iteration(Workload(model, config, micro_batch_size))
    return tuple(k for k in trace.kernels if k.pass_name in ("forward", "backward"))


def simulate_sweep(spec: GPUSpec, sweep: PipelineSweep) -> tuple[np.ndarray, np.ndarray]:
    """(time_s, energy_j) of the pipeline's iteration at each of the sweep's limits, each (L,): the module
    docstring's 1F1B accounting on the simulated GPU (noiseless)."""
    from freqopt.gpu.backends.physics import waiting_power_w
    from freqopt.gpu.backends.simulated import SimulatedGPU

    kernels = stage_kernels(sweep.model, sweep.stages, sweep.micro_batch_size)
    low = float(sweep.power_limit_w.min())
    if low < spec.power_limit_min_w:  # a board that took a limit the file's NVML range does not list
        spec = dataclasses.replace(spec, power_limit_min_w=low)
    gpu = SimulatedGPU(spec, noise=False)
    blocking_w = float(waiting_power_w(spec, spec.max_mem_clock_mhz)[0, -1])
    s, m = sweep.stages, sweep.num_microbatches
    times, energies = [], []
    for limit in sweep.power_limit_w:
        step = gpu.step(kernels, [ClockSetting(power_limit_w=float(limit))] * len(kernels))
        times.append((m + s - 1) * step.time_s)
        energies.append(s * (m * step.energy_j + (s - 1) * step.time_s * blocking_w))
    return np.array(times), np.array(energies)


def sweep_errors(spec: GPUSpec | None, sweep: PipelineSweep) -> dict:
    """Measured against simulated for one sweep (``spec``: default the testbed's GPU file): per limit the time and
    energy relative to the highest limit, their errors (percentage points), and the energy-optimal limits (W).

    Raises:
        UnknownNameError: the testbed's GPU file is missing and no ``spec`` was given.
    """
    spec = get_gpu(sweep.gpu) if spec is None else spec
    sim_t, sim_e = simulate_sweep(spec, sweep)
    tr_m, er_m = sweep.time_s / sweep.time_s[-1], sweep.energy_j / sweep.energy_j[-1]
    tr_s, er_s = sim_t / sim_t[-1], sim_e / sim_e[-1]
    points = [{"power_limit_w": float(p), "time_rel_measured": float(a), "time_rel_simulated": float(b),
               "time_rel_error_pp": float(100 * (b - a)), "energy_rel_measured": float(c),
               "energy_rel_simulated": float(d), "energy_rel_error_pp": float(100 * (d - c))}
              for p, a, b, c, d in zip(sweep.power_limit_w, tr_m, tr_s, er_m, er_s)]  # fmt: skip
    opt_m = float(sweep.power_limit_w[np.argmin(sweep.energy_j)])
    opt_s = float(sweep.power_limit_w[np.argmin(sim_e)])
    return {"sweep": sweep.label, "gpu": spec.name, "points": points,
            "max_abs_time_rel_error_pp": max(abs(p["time_rel_error_pp"]) for p in points),
            "max_abs_energy_rel_error_pp": max(abs(p["energy_rel_error_pp"]) for p in points),
            "energy_optimal_measured_w": opt_m, "energy_optimal_simulated_w": opt_s,
            "energy_optimal_miss_w": opt_s - opt_m}  # fmt: skip
