"""Does a power cap beside locked clocks beat either alone? (issue 13, item 2). A noiseless oracle.

    python experiments/cap_with_clocks.py            # writes experiments/cap_with_clocks/report.md and .json

For each setting below, the whole training step is measured on the simulated GPU without noise
(SimulatedGPU.step: issued from an idle GPU as a training loop issues it, the step the search validates) at every combination of: SM clock (every ``SM_STEP``-th supported clock: all), memory
clock (every supported one), and power limit (the default, every ``CAP_STEP_W`` W from the GPU's minimum to
its maximum, and every ``FINE_CAP_STEP_W`` W in the top ``FINE_RANGE_W`` W, where a limit binds on the GEMMs
only: a 25 W grid misses the small caps that help). Each setting holds for the whole iteration, as the iteration level applies it. The best
energy saving within the 1 % slowdown budget is reported for the power limit alone (clocks at default), the
clocks alone (default limit) and both together. A search can do no better than this oracle within its space,
so where "both" does not beat the better of the other two, a power-limit dimension beside the clocks would
spend measurements for nothing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import freqopt
from freqopt.gpu.backends.base import ClockSetting
from freqopt.workload.models import get_workload
from freqopt.workload.trace import trace_training_iteration

HERE = Path(__file__).resolve().parent / "cap_with_clocks"
SETTINGS = [  # model, GPU, micro-batch, sequence: the main job, the transfer study's source, Spaan et al.'s
    ("gpt3-small", "h100-sxm", 4, 2048),
    ("gpt3-xl", "h100-sxm", 4, 2048),
    ("gpt3-xl", "rtx3080ti", 40, 1024),
]
MAX_SLOWDOWN = 0.01
SM_STEP = 1  # every supported SM clock (15 MHz apart on both GPUs)
CAP_STEP_W = 25
FINE_CAP_STEP_W, FINE_RANGE_W = 5, 100  # within 100 W of the maximum, where a limit binds only on the GEMMs


def sweep(model: str, gpu: str, micro_batch_size: int, seq_len: int) -> dict:
    trace = trace_training_iteration(get_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len))
    backend = freqopt.get_backend("sim", freqopt.get_gpu(gpu))
    spec = backend.spec
    base = backend.step(trace.kernels)
    lo, hi = int(spec.power_limit_min_w), int(spec.power_limit_max_w)
    caps = [None] + sorted(set(range(lo, hi + 1, CAP_STEP_W)) | set(range(hi - FINE_RANGE_W, hi + 1, FINE_CAP_STEP_W)))
    clocks = [None] + [(sm, mem) for mem in spec.mem_clocks_mhz for sm in spec.sm_clocks_mhz[::SM_STEP]
                       if spec.supports(sm, mem)]  # fmt: skip
    best: dict[str, dict] = {}
    n = 0
    for pair in clocks:
        for cap in caps:
            kind = {(True, True): "default", (True, False): "power limit", (False, True): "clocks"}.get(
                (pair is None, cap is None), "both")
            if kind == "default":
                continue
            sm, mem = pair if pair else (None, None)
            m = backend.step(trace.kernels, [ClockSetting(sm, mem, None if cap is None else float(cap))] * len(trace))
            n += 1
            slowdown = m.time_s / base.time_s - 1
            saved = 1 - m.energy_j / base.energy_j
            if slowdown <= MAX_SLOWDOWN and saved > best.get(kind, {}).get("energy_saved_pct", 0.0) / 100:
                best[kind] = {"energy_saved_pct": 100 * saved, "slowdown_pct": 100 * slowdown, "sm_clock_mhz": sm,
                              "mem_clock_mhz": mem, "power_limit_w": cap}  # fmt: skip
    return {"model": model, "gpu": gpu, "micro_batch_size": micro_batch_size, "seq_len": seq_len,
            "baseline": {"time_s": base.time_s, "energy_j": base.energy_j}, "n_settings": n, "best": best}


def _cell(best: dict, kind: str) -> str:
    b = best.get(kind)
    if b is None:
        return "nothing saves energy within budget"
    where = ", ".join(f"{label} {b[k]:g}" for k, label in (("sm_clock_mhz", "SM"), ("mem_clock_mhz", "mem"),
                                                           ("power_limit_w", "limit W")) if b[k] is not None)  # fmt: skip
    return f"{b['energy_saved_pct']:.2f} % at {b['slowdown_pct']:+.2f} % ({where})"


def main() -> int:
    HERE.mkdir(exist_ok=True)
    start = time.time()
    results = []
    for s in SETTINGS:
        results.append(sweep(*s))
        print(f"{s}: {results[-1]['best']}", file=sys.stderr)
    lines = ["# A power cap beside locked clocks (issue 13, item 2): a noiseless oracle", "",
             f"Produced by `python experiments/cap_with_clocks.py` ({time.time() - start:.0f} s on 2 cores). The whole "
             "iteration measured without noise on the simulated GPU at every combination of SM clock (every "
             f"{'' if SM_STEP == 1 else 'other ' if SM_STEP == 2 else f'{SM_STEP}th '}supported clock), memory clock and power limit (the "
             f"default, every {CAP_STEP_W} W from the minimum to the maximum and every {FINE_CAP_STEP_W} W in the top "
             f"{FINE_RANGE_W} W), one setting for the whole "
             f"iteration. Best energy saving within a {MAX_SLOWDOWN:.0%} slowdown:", "",
             "| model | GPU | settings measured | power limit alone | clocks alone | both |", "|---|---|---:|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} (micro-batch {r['micro_batch_size']}, sequence {r['seq_len']}) | {r['gpu']} | "
                     f"{r['n_settings']} | {_cell(r['best'], 'power limit')} | {_cell(r['best'], 'clocks')} | "
                     f"{_cell(r['best'], 'both')} |")
    gains = [r["best"].get("both", {}).get("energy_saved_pct", 0.0)
             - max(r["best"].get(k, {}).get("energy_saved_pct", 0.0) for k in ("power limit", "clocks"))
             for r in results]  # fmt: skip
    lines += ["", f"Largest gain of both over the better one alone: {max(gains):.2f} points."]
    (HERE / "report.md").write_text("\n".join(lines) + "\n")
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
