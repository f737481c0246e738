"""The simulated H200 checked on a real one (issue 49): kernel families fitted on the H200's kernels by shape and judged
leave one shape out, carried to the H100, and the H200's whole steps, profile and waiting power side by side.

    python experiments/h200_check.py           # fit, write the GPU and host files, the report and its residuals
    python experiments/h200_check.py --check   # the committed constants' residuals only (nothing written)

Data in experiments/data/h200/ (a real H200, read-only, default settings, 2026-11-28: README there). Method, points and
what is assumed: freqopt/gpu/calibration/h200.py. What it writes:

* search_spaces/h200-sxm.toml: the kernel families fitted here (``kernel_families``); what the H200 measured of its own
  (``idle``, ``model``: its idle power and a copy's bandwidth; ``waiting_power``); what it carries from the H100, the
  same GH100 die (``power_model``: the H100's fitted power model with the H200's memory terms; ``memory_bound``:
  the H100's memory-bound kernel model, fitted on its whole steps); and ``provenance``;
* search_spaces/h100-sxm.toml: the families carried to the H100 (``kernel_families``: attention, convolutions, batch
  norm, cross-entropy; not the GEMMs, whose carry the H100's measured steps refute: the report says by how much)
  and its ``provenance``;
* search_spaces/hosts/h200-node.toml: the host of the H200's machine, the H100's host scaled by one factor fitted on
  the H200's whole steps (judged leaving each step out);
* experiments/h200_check.md and experiments/h200_check_residuals.json (guarded by tests/test_calibration.py).

The H100's own fits read what this writes (experiments/calibrate_h100.py, experiments/fit_whole_steps.py) and this
reads theirs (the carried power and memory-bound models), so it runs them in turn until the fitted families stop
moving, and their files, reports and residuals are rewritten on the way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from freqopt.files import atomic_write_text
from freqopt.gpu.backends.base import DEFAULT_SETTING
from freqopt.gpu.backends.physics import KernelPhysics, waiting_power_w
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.calibration import h100_steps
from freqopt.gpu.calibration import h200 as cal
from freqopt.gpu.host import get_host, hosts_dir
from freqopt.gpu.specs import get_gpu, replace_toml_block, search_spaces_dir

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "h200"
H100_STEPS = HERE / "data" / "h100" / "whole_steps"
RESIDUALS = HERE / "h200_check_residuals.json"
REPORT = HERE / "h200_check.md"
WRITER = "experiments/h200_check.py"
GPU, REFERENCE, HOST, REFERENCE_HOST = "h200-sxm", "h100-sxm", "h200-node", "h100-node"
# HBM's DRAM energy per bit with its interface, as the H100's file assumes it (O'Connor et al. 2017, "Fine-Grained
# DRAM", MICRO: 3.9 pJ/bit for HBM2): the memory's share of a copy's power at full bandwidth.
DRAM_PJ_PER_BIT = 3.9
# nvidia-smi -q's "GPU Memory Power Readings" average on the H200 (experiments/data/h200/nvidia-smi-q.txt, before the
# run, the board at 85 W): memory power with no traffic, as the H100's file reads its own (40.2 W).
MEM_IDLE_POWER_W = 42.11
# The kernel-family keys each GPU file's block holds: the H200 all it fits; the H100 what carries (module docstring).
BOARD_ONLY = ("layer_norm_bandwidth_rel", "row/aten.native_layer_norm")  # the H100 fits its own on its whole steps
NOT_CARRIED = ("gemm_efficiency", "gemm_epilogue_rel", "gemm_fixed_us", "gemm_unclocked_share", *BOARD_ONLY)
# The other GPU types (other dies) carry what no measurement of theirs covers and a CNN needs: the convolutions'
# efficiency by direction relative to their own GEMM model, and batch norm's bandwidth relative to their copy's.
OTHER_GPUS = ("a100-sxm4-80gb", "a40", "rtx-a4000", "rtx3080ti", "v100-pcie", "v100-sxm2", "a100-pcie-80gb", "p100-pcie",
              "quadro-rtx6000")
CARRIED_TO_OTHERS = ("conv/", "bw/aten.native_batch_norm")
STEP_TARGET_PCT, FAMILY_TARGET_PCT, H100_TARGET_PCT, WAIT_TARGET_PCT = 10.0, 15.0, 5.0, 10.0
MAX_ROUNDS, CONVERGED_REL = 6, 1e-4  # the fixed point of the H200's and the H100's fits (run)


def _clear() -> None:
    get_gpu.cache_clear()
    get_host.cache_clear()


def _experiment(name: str):
    """experiments/<name>.py as a module (the H100's own fit scripts, run in turn with this one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_freqopt_experiment_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- data ---------------------------------------------------------------------------------------------------------
def load_points() -> list[cal.KernelPoint]:
    return (cal.load_atlas(DATA / "kernel_atlas.json") + cal.load_convolutions(DATA / "convolutions.json")
            + cal.load_replayed(DATA / "device_check.json") + cal.load_replayed_gemms(DATA / "device_check.json")
            + [cal.load_sustained_gemm(DATA / "waiting_power.json")])  # fmt: skip


def waiting_states() -> dict[str, dict]:
    return {s["state"]: s for s in json.loads((DATA / "waiting_power.json").read_text())["states"]}


def copy_bandwidth_gbs() -> float:
    """The 1 GiB device-to-device copy's bandwidth, GB/s: reads and writes 2 GiB per repetition."""
    state = next(s for s in waiting_states().values() if s["state"].startswith("device-to-device copy"))
    return 2 * 2**30 * state["steps"] / state["seconds"] / 1e9


def device_check() -> dict:
    return json.loads((DATA / "device_check.json").read_text())


# -- what the H200 measured of its own, and what it carries from the H100 -------------------------------------------
def write_measured_and_carried(text: str) -> str:
    """The H200 file's idle, model, waiting_power, power_model and memory_bound blocks (module docstring)."""
    h100 = get_gpu(REFERENCE)
    states = waiting_states()
    p_mem = fit_copy_power(lambda watts: _copy_spec(h100, watts))
    idle = states["idle, no CUDA context"]
    context = states["idle, CUDA context open"]
    copy_gbs = copy_bandwidth_gbs()
    mem_eff = copy_gbs / _file_table(GPU, "rates")["mem_bandwidth_gbs"]
    blocks = {
        "idle": [f"idle_power_w = {idle['power_w']:.4g}  # measured: idle without a CUDA context at {idle['sm_mhz_median']} "
                 "MHz, 6 s (experiments/data/h200/waiting_power.json)"],
        "model": [f"mem_efficiency = {mem_eff:.4g}  # measured: a 1 GiB device-to-device copy moved {copy_gbs:.0f} GB/s "
                  "of the 4800 (waiting_power.json: 2 GiB a repetition)",
                  f"kernel_fixed_us = {h100.kernel_fixed_s * 1e6:g}  # carried from h100-sxm (assumed there)",
                  "gemm_efficiency = 0.75  # unused: [kernel_families] sets the GEMMs (the loader needs a value)"],
        "waiting_power": [
            "[waiting_power]",
            "# A GPU waiting with nothing to run at the highest clocks, and the share of that which falls with the SM clock's",
            "# V^2 f (freqopt.gpu.specs.WaitingPower; sources.waiting_power).",
            f"top_clocks_w = {context['power_w']:.4g}  # measured: idle with a CUDA context open, SM held at 1980 MHz, 6 s",
            f"clock_share = {_clock_share(h100):.3g}  # carried from h100-sxm: its power model's clock-dependent share of the baseline"],  # fmt: skip
        "power_model": [
            "# Carried from h100-sxm (the same GH100 die; its power model fitted on a real H100: experiments/h100_calibration.md)",
            f"# with this board's memory: p_mem_clock_w from nvidia-smi's 'GPU Memory Power Readings' ({MEM_IDLE_POWER_W} W,",
            f"# experiments/data/h200/nvidia-smi-q.txt); p_mem_active_w fitted on the 1 GiB copy's {_copy_watts():.1f} W",
            f"# ({p_mem / (8 * 4800e9) * 1e12:.2f} pJ/bit at 4800 GB/s; the H100's file assumes {DRAM_PJ_PER_BIT}: carried, the copy",
            f"# would draw {_copy_with(h100, None):.0f} W).",
            "[power_model]",
            *(f"{k} = {v:.6g}" for k, v in dataclasses.asdict(_carried_power(h100, p_mem)).items())],
        "memory_bound": [
            "# Carried from h100-sxm: its memory-bound kernels' bandwidth relative to a copy's and its row overheads, fitted on",
            "# torch.profiler's device time of whole steps on a real H100 (experiments/h100_whole_steps.md); the same die, so",
            "# relative to this board's copy. [kernel_families] sets what the H200 measured of its own over these.",
            "[operator_bandwidth_rel]", *(f'"{k}" = {v:.4g}' for k, v in sorted(_file_table(REFERENCE, "operator_bandwidth_rel").items())),
            "", "[row_overhead_elements]", *(f'"{k}" = {v:.4g}' for k, v in sorted(_file_table(REFERENCE, "row_overhead_elements").items()))],
    }  # fmt: skip
    for marker, body in blocks.items():
        text = replace_toml_block(text, marker, body, writer=WRITER)
    return text


def _copy_spec(h100, p_mem_active_w):
    """The H200 as far as a copy sees it: the H100 with this board's bandwidth, memory clocks and copy efficiency, and
    the carried power model with ``p_mem_active_w``."""
    return dataclasses.replace(h100, mem_bandwidth_gbs=_file_table(GPU, "rates")["mem_bandwidth_gbs"],
                               mem_clocks_mhz=(2201, 3201), mem_efficiency=copy_bandwidth_gbs() / _file_table(GPU, "rates")["mem_bandwidth_gbs"],
                               power_model=_carried_power(h100, p_mem_active_w))  # fmt: skip


def _copy_watts() -> float:
    return next(s for s in waiting_states().values() if s["state"].startswith("device-to-device"))["power_w"]


def _copy_with(h100, p_mem_active_w) -> float:
    return SimulatedGPU(_copy_spec(h100, p_mem_active_w), noise=False).true_measure([copy_kernel()], DEFAULT_SETTING).avg_power_w


def _file_table(gpu: str, table: str) -> dict[str, float]:
    """A table as the GPU file states it, without [kernel_families]'s overrides."""
    from freqopt.gpu.search_spaces import tomllib

    with (search_spaces_dir() / f"{gpu}.toml").open("rb") as f:
        return {k: float(v) for k, v in tomllib.load(f).get(table, {}).items()}


def _clock_share(h100) -> float:
    pm = h100.power_model
    return (pm.p_leak_w + pm.p_sm_clock_w) / (pm.p_const_w + pm.p_leak_w + pm.p_sm_clock_w + pm.p_mem_clock_w)


def _carried_power(h100, p_mem_active_w: float | None = None):
    """The H100's power model with this board's memory terms: ``p_mem_active_w`` given (fitted on the copy), else the
    H100's energy per bit at this board's bandwidth (the carried prediction)."""
    active = DRAM_PJ_PER_BIT * 1e-12 * 8 * 4800e9 if p_mem_active_w is None else p_mem_active_w
    return dataclasses.replace(h100.power_model, p_mem_clock_w=MEM_IDLE_POWER_W, p_mem_active_w=active)


def copy_kernel():
    from freqopt.workload.kernels import Kernel

    elements = 2**30 // 2
    return Kernel("aten.copy_", "memcpy", "forward", 0.0, float(2 * 2**30), "bfloat16", ((elements,), (elements,)))


def fit_copy_power(spec_without: callable) -> float:
    """p_mem_active_w such that the simulated 1 GiB copy draws what the H200's did (its DRAM power at full bandwidth:
    the one memory-bound power the board measured; brentq)."""
    from scipy.optimize import brentq

    measured = next(s for s in waiting_states().values() if s["state"].startswith("device-to-device"))["power_w"]

    def gap(watts):
        return SimulatedGPU(spec_without(watts), noise=False).true_measure([copy_kernel()], DEFAULT_SETTING).avg_power_w - measured

    return float(brentq(gap, 0.0, 600.0, xtol=1e-3))


# -- kernel families ------------------------------------------------------------------------------------------------
def family_keys() -> list[str]:
    return [k for f in cal.FAMILIES for k in f.parameters]


def families_block(values: dict[str, float], *, carried: bool, other_die: bool = False) -> list[str]:
    """A GPU file's [kernel_families] block from fitted values: all of them for the H200, the carried ones for the H100
    (``carried``), the convolutions and batch norm for another die (``other_die``)."""
    keys = [k for k in values if not (carried and k in NOT_CARRIED) and not (other_die and not k.startswith(CARRIED_TO_OTHERS))]
    scalars = {k: v for k, v in values.items() if k in keys and "/" not in k and not k.startswith("attention_fixed")}
    origin = ("carried from h200-sxm (another die: assumed to hold here; fitted there on a real H200's kernels by "
              "shape: experiments/h200_check.md)" if other_die else
              "carried from h200-sxm (the same GH100 die; fitted there on a real H200's kernels by shape: "
              "experiments/h200_check.md)" if carried else
              "fitted on a real H200's kernels by shape, each family judged leave one shape out (experiments/h200_check.md)")
    lines = [f"# The kernel model's families, {origin}; method: freqopt/gpu/calibration/h200.py.", "[kernel_families]"]
    if other_die:
        lines.append("# (only the convolutions and batch norm: the GEMM model and the rest are this GPU's own)")
    lines += [f"{k} = {v:.6g}" for k, v in scalars.items()]
    if "attention_fixed_forward_us" in keys:
        lines.append(f"attention_fixed_us = [{values['attention_fixed_forward_us']:.4g}, {values['attention_fixed_backward_us']:.4g}]")
    for prefix, table, note in (("rate/", "attention_rate_rel", "FlashAttention-2 (freqopt's models) against cuDNN's fused attention (PyTorch's default SDPA)"),
                                ("conv/", "conv_efficiency_rel", "cuDNN's implicit GEMMs by direction, against the GEMM model"),
                                ("bw/", "operator_bandwidth_rel", "bandwidth relative to a copy's"),
                                ("row/", "row_overhead_elements", "c0 of a row-wise kernel over rows of C elements: C / (C + c0), relative to 768")):  # fmt: skip
        entries = {k.removeprefix(prefix): v for k, v in values.items() if k in keys and k.startswith(prefix)}
        if entries:
            lines += ["", f"[kernel_families.{table}]", f"# {note}", *(f'"{k}" = {v:.6g}' for k, v in entries.items())]
    return lines


PROVENANCE = {
    GPU: {
        "gemm": "measured: cuBLAS GEMMs by shape, gpt3-small's GEMMs replayed, a 6 s 8192^3 GEMM on a real H200 (experiments/h200_check.md)",
        "attention": "measured: SDPA (cuDNN) forward and backward by shape, FlashAttention-2 at gpt3-small's shape, on a real H200",
        "convolution": "measured: ResNet-50's convolutions by direction on a real H200",
        "memory_bound": "carried from h100-sxm (fitted on its whole steps), but layer norm's forward, RMS norm and a copy's bandwidth measured on a real H200",
        "cross_entropy": "measured: cross-entropy with an fp32 upcast over 32k-152k vocabularies on a real H200",
        "batch_norm": "measured: ResNet-50's batch norm + ReLU on a real H200",
        "power": "carried from h100-sxm (its power model, fitted on a real H100), with this board's memory power (idle reading; DRAM power fitted on a 1 GiB copy); checked on the sustained GEMM and the steps",
        "waiting_power": "measured: idle with a CUDA context open on a real H200 (121.5 W)",
        "host": "measured: h200-node, the H100's host scaled by one factor fitted on the H200's whole steps",
    },
    REFERENCE: {
        "gemm": "measured: microbenchmarks and replayed classes on a real H100 (experiments/h100_calibration.md); the H200's GEMM model does not carry (experiments/h200_check.md)",
        "attention": "carried from h200-sxm (cuDNN's SDPA and FlashAttention-2 by shape); checked on the H100's whole steps",
        "convolution": "carried from h200-sxm (relative to this GPU's own GEMM model; no H100 convolution measured)",
        "memory_bound": "measured: whole steps on a real H100 (experiments/h100_whole_steps.md)",
        "cross_entropy": "carried from h200-sxm (log-softmax forward and backward); checked on the H100's whole steps",
        "batch_norm": "carried from h200-sxm",
        "power": "measured: fitted on a real H100 at default settings (experiments/h100_calibration.md)",
        "waiting_power": "measured: the power model's baseline, fitted on idle readings with a CUDA context (119-128 W)",
        "host": "measured: h100-node, fitted on the H100's launch-bound replays and whole step",
    },
}  # fmt: skip


def provenance_block(gpu: str) -> list[str]:
    return ["# What each family of this GPU's simulated figures rests on: measured, carried from another GPU, or assumed.",
            "[provenance]", *(f'{k} = "{v}"' for k, v in PROVENANCE[gpu].items())]  # fmt: skip


# -- the host -------------------------------------------------------------------------------------------------------
def step_traces() -> dict[tuple[str, int], list]:
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    out = {}
    for row in device_check()["training_steps"]:
        key = (row["model"], row["micro_batch_size"])
        out[key] = list(trace_training_iteration(get_workload(row["model"], micro_batch_size=row["micro_batch_size"],
                                                              seq_len=row["seq_len"])).kernels)  # fmt: skip
    return out


def steps_with_host(spec, traces, scale: float) -> list[dict]:
    host = get_host(REFERENCE_HOST).scaled(scale, name=HOST)
    gpu = SimulatedGPU(spec.with_host(host), noise=False)
    rows = []
    for row in device_check()["training_steps"]:
        kernels = traces[(row["model"], row["micro_batch_size"])]
        m, w = gpu.step(kernels), gpu.waiting(kernels)
        meas = row["measured"]
        rows.append({"step": f"{row['model']} micro-batch {row['micro_batch_size']}", "kernels": len(kernels),
                     "time_measured_s": meas["time_s"], "time_simulated_s": m.time_s,
                     "time_before_s": row["predicted"]["time_s"], "energy_measured_j": meas["energy_j"],
                     "energy_simulated_j": m.energy_j, "energy_before_j": row["predicted"]["energy_j"],
                     "time_error_pct": 100 * (m.time_s / meas["time_s"] - 1),
                     "energy_error_pct": 100 * (m.energy_j / meas["energy_j"] - 1),
                     "time_before_error_pct": 100 * (row["predicted"]["time_s"] / meas["time_s"] - 1),
                     "energy_before_error_pct": 100 * (row["predicted"]["energy_j"] / meas["energy_j"] - 1),
                     "waiting_s": w.time_s, "clock_simulated_mhz": m.sm_clock_mhz})  # fmt: skip
    return rows


def fit_host(spec, traces, *, leave_out: str | None = None) -> float:
    """The factor on the H100's host that fits the steps' times (least squares of the log ratio), all of them or
    all but ``leave_out``."""
    from scipy.optimize import minimize_scalar

    def cost(scale):
        rows = [r for r in steps_with_host(spec, traces, scale) if r["step"] != leave_out]
        return sum(math.log(r["time_simulated_s"] / r["time_measured_s"]) ** 2 for r in rows)

    return float(minimize_scalar(cost, bounds=(0.5, 3.0), method="bounded", options={"xatol": 1e-4}).x)


def write_host(scale: float, rows_loo: list[dict]) -> None:
    ref = get_host(REFERENCE_HOST)
    host = ref.scaled(scale, name=HOST)
    loo = ", ".join(f"{r['step']} {r['scale']:.3f}" for r in rows_loo)
    text = "\n".join([
        "# The host of the machine the H200 of experiments/data/h200 was measured in (driver 580.159.04, CUDA 13, PyTorch",
        "# 2.11, Python 3.12; read-only, 2026-11-28), in us per kernel.",
        "",
        "[host]",
        f'description = "the server of the measured H200 (PyTorch 2.11, CUDA 13): {scale:.4g}x the H100 server\'s times"',
        f"# BEGIN replay (written by {WRITER}; edit there)",
        f"# {REFERENCE_HOST}'s x {scale:.4g}, the factor fitted on this H200's whole steps (experiments/h200_check.md)",
        f"issue_us = {host.issue_us:.6g}", f"gemm_issue_us = {host.gemm_issue_us:.6g}", "# END replay", "",
        f"# BEGIN step (written by {WRITER}; edit there)", "[step_us]",
        *(f"{p} = {v:.6g}" for p, v in host.step_us.items()), "# END step", "",
        "[sources]",
        f'scale = "experiments/h200_check.py: one factor on {REFERENCE_HOST}\'s figures, fitted (least squares of the log '
        "time ratio) on the five whole steps of experiments/data/h200/device_check.json with the H200's kernel model; "
        f'left out one step at a time it is {loo}"', ""])  # fmt: skip
    atomic_write_text(hosts_dir() / f"{HOST}.toml", text)


# -- checks ---------------------------------------------------------------------------------------------------------
def profile_by_kind(spec) -> list[dict]:
    """gpt3-small at micro-batch 4: device_check's torch.profiler time by kind beside the simulated kernels' (at the
    highest clocks, no host, no power limit), with 1.8 us per launch added to the measured (the GPU's idle between
    back-to-back kernels, which a simulated kernel's fixed time holds: h100_steps.LAUNCH_GAP_S)."""
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_training_iteration

    doc = device_check()["profile"]
    kernels = list(trace_training_iteration(get_workload("gpt3-small", micro_batch_size=4, seq_len=2048)).kernels)
    time_s = KernelPhysics(spec, kernels, np.full(len(kernels), float(spec.max_mem_clock_mhz))).time_s[:, -1]
    sim: dict[str, float] = {}
    for k, t in zip(kernels, time_s):
        sim[k.kind] = sim.get(k.kind, 0.0) + float(t)
    rows = []
    for kind, m in doc["profiler_by_kind"].items():
        rows.append({"kind": kind, "measured_s": m["measured_time_s"], "launches": m["profiled_n_kernels"],
                     "measured_with_gaps_s": m["measured_time_s"] + h100_steps.LAUNCH_GAP_S * m["profiled_n_kernels"],
                     "before_s": m["predicted_time_s"], "simulated_s": sim.get(kind, 0.0),
                     "traced_kernels": m["traced_n_kernels"]})  # fmt: skip
    return rows


def power_checks(spec) -> list[dict]:
    """Measured board powers beside the simulated: the waiting GPU (the value the H100's carried power model predicts,
    before this board's measurement replaced it), a 1 GiB copy, the sustained 8192^3 GEMM (its clock too)."""
    states = waiting_states()
    rows = []
    carried_wait = float(waiting_power_w(dataclasses.replace(spec, waiting_power=get_gpu(REFERENCE).waiting_power,
                                                             power_model=_carried_power(get_gpu(REFERENCE))),
                                         spec.max_mem_clock_mhz)[0, -1])  # fmt: skip
    context = states["idle, CUDA context open"]["power_w"]
    rows.append({"check": "waiting with a context open, 1980 MHz: the H100's power model carried (a prediction)",
                 "measured_w": context, "simulated_w": carried_wait})
    rows.append({"check": "waiting with a context open, 1980 MHz: this file (set from the measurement, not a check)",
                 "measured_w": context, "simulated_w": float(waiting_power_w(spec, spec.max_mem_clock_mhz)[0, -1])})
    gpu = SimulatedGPU(spec, noise=False)
    rows.append({"check": "1 GiB device-to-device copy: the H100's DRAM energy per bit carried (a prediction)",
                 "measured_w": _copy_watts(), "simulated_w": _copy_with(get_gpu(REFERENCE), None)})
    m = gpu.true_measure([copy_kernel()], DEFAULT_SETTING)
    rows.append({"check": "1 GiB device-to-device copy: this file (p_mem_active_w fitted on it, not a check)",
                 "measured_w": _copy_watts(), "simulated_w": m.avg_power_w})
    gemm = cal.load_sustained_gemm(DATA / "waiting_power.json")
    state = next(s for s in states.values() if s["state"].startswith("bf16 GEMM"))
    m = gpu.true_measure(list(gemm.kernels), DEFAULT_SETTING)
    rows.append({"check": "bf16 GEMM 8192^3 sustained 6 s", "measured_w": state["power_w"], "simulated_w": m.avg_power_w,
                 "clock_measured_mhz": float(state["sm_mhz_median"]), "clock_simulated_mhz": m.sm_clock_mhz,
                 "time_measured_s": gemm.measured_s, "time_simulated_s": m.time_s})  # fmt: skip
    for r in rows:
        r["error_pct"] = 100 * (r["simulated_w"] / r["measured_w"] - 1)
    return rows


def h100_carry(values: dict[str, float]) -> dict:
    """The H100's whole steps with its committed spec (the carried families in), and with the H200's GEMM model carried
    too: what refutes that carry. Class errors at each step's measured mean clock, as h100_steps computes them."""
    spec = get_gpu(REFERENCE)
    steps = h100_steps.load_steps(H100_STEPS)
    traces = h100_steps.trace_steps(steps)
    gemm = {k: values[k] for k in NOT_CARRIED if k.startswith("gemm_")}
    with_gemm = cal.with_values(dataclasses.replace(spec, gemm_k_overhead=0.0), gemm)
    out = {}
    for label, s in (("committed", spec), ("with the H200's GEMM model", with_gemm)):
        res = h100_steps.residuals(s, steps, traces)
        out[label] = {"steps": res["steps"], "classes": [r for r in res["classes"] if r["class"] in
                      ("GEMM", "attention", "attention backward", "log-softmax")]}  # fmt: skip
    return out


# -- report ---------------------------------------------------------------------------------------------------------
def family_summary(rows: list[dict]) -> dict:
    judged = [r for r in rows if not r["alone"]]
    errors = [abs(r["error_pct"]) for r in judged]
    return {"points": len(rows), "judged": len(judged), "mean_abs_pct": float(np.mean(errors)) if errors else math.nan,
            "max_abs_pct": float(np.max(errors)) if errors else math.nan,
            "over_15_pct": sum(e > FAMILY_TARGET_PCT for e in errors)}  # fmt: skip


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if x is not None and not (isinstance(x, float) and math.isnan(x)) else ""


def report(result: dict, elapsed_s: float) -> str:
    fams, steps, host = result["families"], result["steps"], result["host"]
    lines = ["# The simulated H200 against a real one (issue 49)", "",
             f"Written by `python experiments/h200_check.py` ({elapsed_s / 60:.0f} min on 2 cores, {result['date']}); "
             "data in [data/h200/](data/h200/README.md) (a real H200, read-only, default settings, 2026-11-28); method, "
             "points and what is assumed in `freqopt/gpu/calibration/h200.py`. Errors are the simulated GPU's, in % of "
             "the measured value. 'Before' is the simulated `h200-sxm` of cd5ee2c, as device_check.json recorded it.", "",
             "## Kernel families, each judged on the shapes it was not fitted on", "",
             "Each family's constants (and, where a timing is bound by the measuring loop's host, that host time: "
             "a property of the measuring machine, never written to a GPU file) are fitted on all its shapes but one, "
             "which is then predicted; the table gives the mean and largest |error| over the family's shapes so "
             f"predicted (target: within {FAMILY_TARGET_PCT:g} %). A shape that alone exercises a constant (ResNet's "
             "3-channel stem; FlashAttention-2, replayed at one shape) has no such figure and is left out of them.", "",
             "| family | shapes | judged | mean \\|error\\| (%) | largest \\|error\\| (%) | over 15 % | fitted here |",
             "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, fam in fams.items():
        s = fam["summary"]
        params = ", ".join(f"{k} {v:.4g}" for k, v in fam["values"].items()) or "none (a check of the carried model)"
        lines.append(f"| {name} | {s['points']} | {s['judged']} | {_f(s['mean_abs_pct'])} | {_f(s['max_abs_pct'])} | "
                     f"{s['over_15_pct']} | {params} |")
    lines += ["", "The measuring loops' host time per call, fitted with the families (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in result["harness_us"].items()) + ".", ""]
    lines += _why_harness(result)
    lines += ["", "### Every shape", ""]
    for name, fam in fams.items():
        lines += [f"**{name}**", "", "| shape | measured (us) | left out (us) | error (%) | fitted on all (us) | bound by |",
                  "|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in fam["rows"]:
            lines.append(f"| {r['label']} | {r['measured_s'] * 1e6:.1f} | {r['predicted_s'] * 1e6:.1f} | "
                         f"{'' if r['alone'] else _f(r['error_pct'], '{:+.1f}')} | {r['in_sample_s'] * 1e6:.1f} | "
                         f"{'its own constant' if r['alone'] else r['bound']} |")
        lines.append("")
    lines += ["## Whole training steps", "",
              "device_check's steps (freqopt's GPT-3 modules, bf16, sequence 2048, MixedPrecisionAdamW; CUDA events and "
              "the energy counter, the loop synchronizing every 4 steps) beside `SimulatedGPU.step` at default settings "
              f"(target: within {STEP_TARGET_PCT:g} % in time and energy). The host is {HOST}: {REFERENCE_HOST}'s times x "
              f"{host['scale']:.4g}, the one factor fitted on these five steps' times; 'left out' refits it without the "
              "step and predicts that step, the figure to judge it by.", "",
              "| step | kernels | time measured (ms) | simulated (ms) | error (%) | left out (%) | before (%) | "
              "energy measured (J) | simulated (J) | error (%) | left out (%) | before (%) | GPU waiting (ms) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    loo = {r["step"]: r for r in host["leave_one_out"]}
    for r in steps:
        lo = loo[r["step"]]
        lines.append(f"| {r['step']} | {r['kernels']} | {r['time_measured_s'] * 1e3:.1f} | {r['time_simulated_s'] * 1e3:.1f} | "
                     f"{r['time_error_pct']:+.1f} | {lo['time_error_pct']:+.1f} | {r['time_before_error_pct']:+.1f} | "
                     f"{r['energy_measured_j']:.2f} | {r['energy_simulated_j']:.2f} | {r['energy_error_pct']:+.1f} | "
                     f"{lo['energy_error_pct']:+.1f} | {r['energy_before_error_pct']:+.1f} | {r['waiting_s'] * 1e3:.1f} |")
    worst_t = max(abs(r["time_error_pct"]) for r in steps)
    worst_e = max(abs(r["energy_error_pct"]) for r in steps)
    worst_lt = max(abs(r["time_error_pct"]) for r in host["leave_one_out"])
    worst_le = max(abs(r["energy_error_pct"]) for r in host["leave_one_out"])
    mb = {r["step"]: r for r in steps}
    one, four = mb.get("gpt3-small micro-batch 1"), mb.get("gpt3-small micro-batch 4")
    lines += ["", f"Largest |error|: time {worst_t:.1f} %, energy {worst_e:.1f} % (the host fitted on all five); left out: "
              f"time {worst_lt:.1f} %, energy {worst_le:.1f} %."]  # fmt: skip
    if one and four:
        lines.append(f"gpt3-small at micro-batch 1 took {one['time_measured_s'] * 1e3:.1f} ms a step and at micro-batch 4 "
                     f"{four['time_measured_s'] * 1e3:.1f} ms, on the same kernels' host work: a host model with a time "
                     "per kernel (any such model) gives both one host time, so the two bound each other; the fitted "
                     "factor sits between them.")  # fmt: skip
    lines += ["", "## gpt3-small's profiled step by kind", "",
              "torch.profiler's device time by kind (device_check.json's profile; the kinds are its own mapping of CUDA "
              "kernel names, so the casts the trace calls memcpy land elsewhere there: compare the totals) against the "
              "traced kernels at the highest clocks.", "",
              "| kind | measured + 1.8 us a launch (ms) | launches | simulated (ms) | traced kernels | before (ms) |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["profile"]:
        lines.append(f"| {r['kind']} | {r['measured_with_gaps_s'] * 1e3:.3f} | {r['launches']} | {r['simulated_s'] * 1e3:.3f} | "
                     f"{r['traced_kernels']} | {r['before_s'] * 1e3:.3f} |")
    tot = {k: sum(r[k] for r in result["profile"]) for k in ("measured_with_gaps_s", "simulated_s", "before_s")}
    lines.append(f"| total | {tot['measured_with_gaps_s'] * 1e3:.3f} | | {tot['simulated_s'] * 1e3:.3f} | | {tot['before_s'] * 1e3:.3f} |")
    lines += ["", "## Power", "", "| check | measured (W) | simulated (W) | error (%) | clock measured / simulated (MHz) |",
              "|---|---:|---:|---:|---|"]  # fmt: skip
    for r in result["power"]:
        clocks = f"{r['clock_measured_mhz']:.0f} / {r['clock_simulated_mhz']:.0f}" if "clock_measured_mhz" in r else ""
        lines.append(f"| {r['check']} | {r['measured_w']:.1f} | {r['simulated_w']:.1f} | {r['error_pct']:+.1f} | {clocks} |")
    lines += ["", f"The waiting power is judged by the first row, the H100's power model carried to this board before its "
              f"measurement (target: within {WAIT_TARGET_PCT:g} % of 121.5 W); the file then takes the measured value, so "
              "the second row is no check.", "", "## Carried to the H100", "",
              "The H100 is the same GH100 die: attention, convolutions, batch norm and cross-entropy carry (relative "
              "figures; memory-bound times scale with each board's copy bandwidth). Its whole steps with the committed "
              f"h100-sxm (target: within {H100_TARGET_PCT:g} %), and with the H200's GEMM model carried as well:", "",
              "| spec | step | time error (%) | energy error (%) | clock measured / simulated (MHz) |", "|---|---|---:|---:|---|"]  # fmt: skip
    for label, block in result["h100"].items():
        for r in block["steps"]:
            lines.append(f"| {label} | {r['step']} | {r['time_error_pct']:+.1f} | {r['energy_error_pct']:+.1f} | "
                         f"{r['clock_measured_mhz']:.0f} / {r['clock_simulated_mhz']:.0f} |")
    lines += ["", "Kernel classes at each step's measured mean clock (h100_steps: torch.profiler's device time + 1.8 us a "
              "launch):", "", "| spec | step | class | error (%) |", "|---|---|---|---:|"]
    for label, block in result["h100"].items():
        for r in block["classes"]:
            lines.append(f"| {label} | {r['step']} | {r['class']} | {_f(r.get('error_pct'), '{:+.1f}')} |")
    lines += ["", "The H200's GEMM model does not carry: at the H100 steps' sampled clocks it is slower than the H100's "
              "measured GEMMs (the GEMM rows above), and the whole steps move past the target. The atlas records no "
              "clock per shape, so its GEMM efficiency at 1980 MHz rests on the assumption that its short loops did not "
              "throttle; the H100 keeps its own GEMM model, fitted on microbenchmarks at measured clocks.", ""]
    return "\n".join(lines) + "\n"


def _why_harness(result) -> list[str]:
    per = {r["kind"]: 1e6 * r["measured_s"] / r["launches"] for r in result["profile"] if r["launches"]}
    atlas = {r["label"]: r["measured_s"] for r in result["families"]["memory-bound backward"]["rows"]}
    adds = [v for k, v in atlas.items() if k.startswith("add ")]
    add_fwd = {r["label"]: r["measured_s"] for r in result["families"]["memory-bound forward"]["rows"]}
    return ["Why a host time: each atlas timing is the mean of 20 calls in a Python loop, so it cannot be shorter than "
            "the host's time per call. The data do not say how a backward was timed; they read as a loop of forward "
            "and backward less the loop of the forward (freqopt.gpu.calibration.h200.predict), and that reading is "
            f"what the add's backward needs: its gradient needs no kernel of its own, yet it took {1e6 * min(adds):.0f}-"
            f"{1e6 * max(adds):.0f} us at every width, and {1e6 * atlas['add 8192x4096']:.0f} us at 4096 columns, where "
            f"the forward alone took {1e6 * add_fwd['add 8192x4096']:.0f}. Inside a training step the same narrow "
            "kernels run far faster than these loops (torch.profiler's device time below: the elementwise kernels of "
            f"gpt3-small average {per['elementwise']:.0f} us, the normalizations {per['normalization']:.0f}), so the "
            "simulated kernels are not slowed to match the loops; the memory-bound backward family is a check of the "
            "carried kernel model, most of its shapes bound by the loop's host."]


# -- main -----------------------------------------------------------------------------------------------------------
def fitted_values(spec) -> dict[str, float]:
    return cal.current_values(spec, family_keys())


def run(write: bool) -> dict:
    started = time.time()
    path = search_spaces_dir() / f"{GPU}.toml"
    if write:
        if not (hosts_dir() / f"{HOST}.toml").is_file():  # first run: the reference's figures until the fit below
            write_host(1.0, [])
        atomic_write_text(path, write_measured_and_carried(path.read_text()))
        _clear()
    points = load_points()
    if write:
        # The H100's own fits take the families carried to it, and the H200 carries the H100's power and memory-bound
        # models from them: fit in turn until the families stop moving (a fixed point, so the files agree).
        previous = None
        for round_ in range(1, MAX_ROUNDS + 1):
            spec, _ = cal.fit(dataclasses.replace(get_gpu(GPU), gemm_k_overhead=0.0), points)
            values = fitted_values(spec)
            for gpu, carried in ((GPU, False), (REFERENCE, True)):
                p = search_spaces_dir() / f"{gpu}.toml"
                text = replace_toml_block(p.read_text(), "kernel_families", families_block(values, carried=carried),
                                          writer=WRITER)  # fmt: skip
                text = replace_toml_block(text, "provenance", provenance_block(gpu), writer=WRITER)
                atomic_write_text(p, text)
            for gpu in OTHER_GPUS:
                p = search_spaces_dir() / f"{gpu}.toml"
                atomic_write_text(p, replace_toml_block(p.read_text(), "kernel_families",
                                                        families_block(values, carried=True, other_die=True),
                                                        writer=WRITER))  # fmt: skip
            _clear()
            _experiment("calibrate_h100").main([], quiet=True)
            _experiment("fit_whole_steps").main([], quiet=True)
            _clear()
            atomic_write_text(path, write_measured_and_carried(path.read_text()))
            _clear()
            moved = max((abs(values[k] / previous[k] - 1) for k in values if previous and previous[k]), default=math.inf)
            print(f"round {round_}: the families moved {moved:.2e} (relative) since the last", flush=True)
            if moved < CONVERGED_REL:
                break
            previous = values
    spec = get_gpu(GPU)
    values = fitted_values(spec)
    _, harness = cal.fit(spec, points, harness_only=True)  # the committed constants held
    families = {}
    for family in cal.FAMILIES:
        if not any(p.family == family.name for p in points):
            continue
        rows = cal.leave_one_out(spec, points, family.name, harness)
        families[family.name] = {"values": {k: values[k] for k in family.parameters}, "rows": rows,
                                 "summary": family_summary(rows)}  # fmt: skip
    traces = step_traces()
    scale = fit_host(spec, traces)
    loo = []
    for row in steps_with_host(spec, traces, scale):
        s = fit_host(spec, traces, leave_out=row["step"])
        left = next(r for r in steps_with_host(spec, traces, s) if r["step"] == row["step"])
        loo.append({"step": row["step"], "scale": s, "time_error_pct": left["time_error_pct"],
                    "energy_error_pct": left["energy_error_pct"]})
    if write:
        write_host(scale, loo)
        get_host.cache_clear()
        get_gpu.cache_clear()
        spec = get_gpu(GPU)
    committed = spec.host_issue_s * 1e6 / get_host(REFERENCE_HOST).issue_us if spec.host == HOST else scale
    result = {"date": time.strftime("%Y-%m-%d"), "families": families, "harness_us": harness,
              "steps": steps_with_host(spec, traces, committed),
              "host": {"scale": scale, "leave_one_out": loo}, "profile": profile_by_kind(spec),
              "power": power_checks(spec), "h100": h100_carry(values)}  # fmt: skip
    result["elapsed_s"] = time.time() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print the committed constants' residuals; write nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the committed residuals (h200_check_residuals.json); fit nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        result = json.loads(RESIDUALS.read_text())
        atomic_write_text(REPORT, report(result, result["elapsed_s"]))
        return 0
    result = run(write=not args.check)
    summary = {name: fam["summary"] for name, fam in result["families"].items()}
    summary["steps"] = {r["step"]: (round(r["time_error_pct"], 1), round(r["energy_error_pct"], 1)) for r in result["steps"]}
    print(json.dumps(summary, indent=1))
    if not args.check:
        atomic_write_text(RESIDUALS, json.dumps(result, indent=1, default=float) + "\n")
        atomic_write_text(REPORT, report(result, result["elapsed_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
