"""Read-only check of freqopt's NVML path on a real GPU, and of the simulated GPU against it. Changes no setting.

    python experiments/device_readonly.py          # on a machine with an NVIDIA GPU; writes experiments/device/

Everything goes through a device opened read-only (freqopt.nvml.NVMLDevice refuses every set and reset call
before NVML sees it), so this is safe on a shared GPU. It records:

1. discovery: the GPU's NVML name and UUID, the search_spaces/ file it matches, its supported clocks and
   power-limit range, as NVML reports them;
2. the energy counter: its update period, detected by polling while the GPU replays a large GEMM;
3. kernel replay timing: each kernel class of one gpt3-small training iteration (micro-batch 4, sequence 2048)
   replayed at the GPU's current clocks, time by CUDA events and energy by the counter, beside the simulated
   GPU's prediction for the same kernels at the clocks the GPU was seen running.
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

OUT = Path(__file__).resolve().parent / "device"


def main() -> int:
    import numpy as np
    import torch

    from freqopt.backends.base import DEFAULT_SETTING, ClockSetting, MeasurementProtocol
    from freqopt.backends.nvml import NVMLBackend
    from freqopt.backends.simulated import SimulatedGPU
    from freqopt.models import get_workload
    from freqopt.nvml import open_devices
    from freqopt.search.units import partition
    from freqopt.tables import atomic_write_text
    from freqopt.trace import trace_training_iteration

    device = open_devices(read_only=True)[0]
    spec = device.spec()
    found = {
        "nvml_name": device.name, "uuid": device.uuid, "matched": spec.name,
        "sm_clocks_mhz": [spec.sm_clocks_mhz[0], spec.sm_clocks_mhz[-1], len(spec.sm_clocks_mhz)],
        "mem_clocks_mhz": list(spec.mem_clocks_mhz),
        "power_limit_w": {"min": spec.power_limit_min_w, "max": spec.power_limit_max_w,
                          "default": spec.power_limit_default_w, "current": device.power_limit_w()},
        "clocks_now_mhz": {"sm": device.sm_clock_mhz(), "mem": device.mem_clock_mhz()},
    }  # fmt: skip
    print(json.dumps(found, indent=1))
    protocol = MeasurementProtocol(warmup_s=0.5, min_window_s=1.0, min_counter_updates=10)
    backend = NVMLBackend(device, torch_device="cuda:0", protocol=protocol)
    trace = trace_training_iteration(get_workload("gpt3-small"))
    sim = SimulatedGPU(spec, noise=False)
    rows = []
    with backend:
        for unit in partition(trace, "kernel"):
            kernels = unit.kernels(trace)
            measured = backend.measure(kernels, DEFAULT_SETTING)  # the first call also detects the counter period
            observed = int(round(measured.sm_clock_mhz))
            nearest = min(spec.sm_clocks_mhz, key=lambda f: abs(f - observed))
            predicted = sim.true_measure(kernels, ClockSetting(nearest, device.mem_clock_mhz()))
            first = kernels[0]
            rows.append({
                "unit": unit.name, "kind": first.kind, "n_kernels": len(kernels), "sm_clock_mhz_seen": observed,
                "time_s": measured.time_s, "energy_j": measured.energy_j,
                "sim_time_s": predicted.time_s, "sim_energy_j": predicted.energy_j,
            })  # fmt: skip
            print(f"{first.kind:14s} {len(kernels):4d} kernels: {1e6 * measured.time_s:10.1f} us measured, "
                  f"{1e6 * predicted.time_s:10.1f} us simulated, {measured.avg_power_w:6.0f} W measured, "
                  f"{predicted.avg_power_w:6.0f} W simulated", flush=True)
    ratio_t = np.array([r["sim_time_s"] / r["time_s"] for r in rows])
    weights = np.array([r["time_s"] for r in rows])
    summary = {
        "when_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": found,
        "counter_period_s": backend.counter_period_s,
        "time_ratio_sim_over_measured": {"median": float(np.median(ratio_t)),
                                         "time_weighted_mean": float(np.average(ratio_t, weights=weights))},
        "iteration_time_s": {"measured_sum": float(weights.sum()),
                             "simulated_sum": float(sum(r["sim_time_s"] for r in rows))},
        "units": rows,
    }  # fmt: skip
    OUT.mkdir(exist_ok=True)
    atomic_write_text(OUT / "readonly.json", json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "units"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
