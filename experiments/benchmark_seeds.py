"""The benchmark's searches across noise seeds: is a recorded saving the method's, or one seed's luck?

    python experiments/benchmark_seeds.py

`freqopt benchmark` runs one search, whose simulated readings are drawn from one seed (the search's, 0). The sweep it
is judged against is noiseless, so its figure does not depend on the seed, but a search's choices rest on noisy
readings (0.5 % in energy and 0.2 % in time per reading, against a 1 % budget). This script runs the benchmark's
search (the clock granularities from iteration down to kernel, as ``freqopt benchmark`` runs them) on gpt3-xl
(micro-batch 40, sequence 1024) on the RTX 3080 Ti with 100 ms switches, for seeds 0-5 (the simulated GPU's noise and
the samplers), and judges each chosen schedule without noise: its saving and its slowdown (a schedule truly over the
budget is one whose validation was fooled by its readings). Seeds 0-7, each at the default 95 % confidence (issue
35, item 1: the upper confidence bound of a schedule's slowdown, from readings paired with the defaults', held to
the budget, and the chosen schedule confirmed on fresh readings) and at 0.5 (the paired mean alone): what the
promise costs in savings. Writes experiments/benchmark/seeds.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from joblib import Parallel, delayed

HERE = Path(__file__).resolve().parent / "benchmark"
SEEDS = range(8)
CONFIDENCES = (0.95, 0.5)
SETTING = dict(model="gpt3-xl", gpu="rtx3080ti", micro_batch_size=40, seq_len=1024, n_heads=16)


def one(seed: int, confidence: float) -> dict:
    """One search with ``seed`` at ``confidence``: each level's chosen schedule's noiseless saving and slowdown (%),
    its validated saving and its slowdown's upper bound (%), and its cost."""
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.resolve import resolve_gpu, resolve_workload
    from freqopt.search.config import SearchConfig
    from freqopt.search.runner import run_search
    from freqopt.search.study import optuna_logging
    from freqopt.search.validate import Validator
    from freqopt.workload.trace import trace_training_iteration

    trace = trace_training_iteration(resolve_workload(SETTING["model"], micro_batch_size=SETTING["micro_batch_size"],
                                                      seq_len=SETTING["seq_len"], n_heads=SETTING["n_heads"]))  # fmt: skip
    backend = SimulatedGPU(resolve_gpu(SETTING["gpu"]), seed=seed)
    # As freqopt benchmark searches: the realizable schedule only, no free-switching figure (issue 35, item 3).
    config = SearchConfig(max_slowdown=0.01, seed=seed, granularities=("iteration", "pass", "kernel"),
                          free_switching=False, confidence=confidence)  # fmt: skip
    t0 = time.perf_counter()
    with optuna_logging():
        validator = Validator.for_search(trace, backend, config)
        result = run_search(trace, backend, config, validator=validator)
    default = backend.step(trace.kernels)
    out = {"seed": seed, "confidence": confidence,
           "n_measurements": sum(r.n_measurements for r in result.results.values()),
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    for g, r in result.results.items():
        step = backend.step(trace.kernels, list(validator.schedule_of(r.validated)), switching=True)
        bound = result.slowdown_bound_pct(g)
        out[g] = (100 * (1 - step.energy_j / default.energy_j), 100 * (step.time_s / default.time_s - 1),
                  result.energy_saved_pct(g), 0.0 if bound is None else bound)  # fmt: skip
    return out


def main() -> int:
    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.resolve import resolve_gpu, resolve_workload
    from freqopt.workload.trace import trace_training_iteration

    started = time.perf_counter()
    every = Parallel(n_jobs=2)(delayed(one)(s, c) for c in CONFIDENCES for s in SEEDS)
    # The best one clock for the whole step within the budget, without noise: what the sweep's schedule realizes.
    trace = trace_training_iteration(resolve_workload(SETTING["model"], micro_batch_size=SETTING["micro_batch_size"],
                                                      seq_len=SETTING["seq_len"], n_heads=SETTING["n_heads"]))  # fmt: skip
    gpu = SimulatedGPU(resolve_gpu(SETTING["gpu"]))
    default = gpu.step(trace.kernels)
    best = max((100 * (1 - m.energy_j / default.energy_j), sm, mem) for sm, mem in gpu.spec.clock_pairs()
               if (m := gpu.step(trace.kernels, [ClockSetting(sm, mem)] * len(trace))).time_s <= 1.01 * default.time_s)
    lines = ["# The benchmark's search across noise seeds (gpt3-xl, micro-batch 40, on the RTX 3080 Ti, 100 ms switches, "
             "1 % budget)", "",
             f"Produced by `python experiments/benchmark_seeds.py` ({time.strftime('%Y-%m-%d')}, "
             f"{(time.perf_counter() - started) / 60:.0f} min on 2 CPU cores; its docstring says what it does). Each "
             "cell is the level's chosen schedule judged without noise: saved / slowdown (%), and in brackets the "
             "saving its validation measured and the upper bound of its slowdown held to the budget. The best single "
             f"clock for the whole step within the budget, judged the same way, saves {best[0]:.2f} % (SM {best[1]} "
             f"MHz, memory {best[2]} MHz). Before issue 35's item 1 (the mean held to the budget, no pairing, no "
             "confirmation), seeds 0-5 saved 1.21 % on average at the kernel level, and seeds 2 and 3 were truly "
             "1.09 % and 1.04 % slow.", ""]  # fmt: skip
    summary = []
    for confidence in CONFIDENCES:
        runs = [r for r in every if r["confidence"] == confidence]
        lines += [f"## Confidence {100 * confidence:g} %" + (" (the paired mean alone)" if confidence == 0.5 else ""),
                  "", "| seed | iteration | pass | kernel | measurements |", "|---:|---|---|---|---:|"]
        for r in runs:
            cells = [f"{r[g][0]:.2f} / {r[g][1]:.2f} ({r[g][2]:.2f}, bound {r[g][3]:.2f})"
                     for g in ("iteration", "pass", "kernel")]  # fmt: skip
            lines.append(f"| {r['seed']} | {' | '.join(cells)} | {r['n_measurements']} |")
        mean = lambda i: sum(r["kernel"][i] for r in runs) / len(runs)  # noqa: E731
        any_over = sorted({f"seed {r['seed']} {g}" for r in runs for g in ("iteration", "pass", "kernel")
                           if r[g][1] > 1.0 + 1e-9})  # fmt: skip
        line = (f"Kernel level over {len(runs)} seeds: {mean(0):.2f} % saved on average (ratio {mean(0) / best[0]:.3f} "
                f"to the best single clock), {min(r['kernel'][0] for r in runs):.2f} % at worst, at "
                f"{mean(1):.2f} % slowdown on average; truly over the 1 % budget at any level: "
                f"{', '.join(any_over) if any_over else 'none'}; "
                f"{sum(r['n_measurements'] for r in runs) / len(runs):.0f} measurements on average.")  # fmt: skip
        lines += ["", line, ""]
        summary.append((confidence, mean(0)))
    (c1, s1), (c2, s2) = summary
    lines += [f"What the promise costs: the kernel level saves {s1:.2f} % on average at {100 * c1:g} % confidence and "
              f"{s2:.2f} % judged on the paired mean alone ({s1 - s2:+.2f} points).", ""]
    (HERE / "seeds.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
