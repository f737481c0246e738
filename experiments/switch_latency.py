"""How much of each granularity's saving survives the clock-switch latency (issue 22): realizable, validated savings
at 1, 6, 20 and 100 ms (and at each GPU file's own value) for gpt3-small and gpt3-xl on the simulated H100 at a 1 %
budget, and for Spaan et al.'s configuration on the simulated RTX 3080 Ti at 30 %.

    python experiments/switch_latency.py           # the full study; writes experiments/switch_latency/
    python experiments/switch_latency.py --quick   # gpt3-small only, 2 latencies, few trials, into a temporary folder

Every search is freqopt.search with ``switch_latency_ms`` in place of the GPU file's value, over the granularities
iteration, pass, kernel and phase; every figure is validated (the whole iteration measured with the schedule as a
runtime realizes it: each switch lands the latency late, and a switch is made only into a run of phases at least
that long). The kernel level's free-switching figure (the same schedule with instant switches) is beside them: what
per-kernel clocks would save were switching free, as Spaan et al. 2026 measured it.

Where the latencies come from (search_spaces/*.toml, [actuation] and sources.actuation; checked against the files
below): 1 ms, the low end of the "1-500 ms" that Lei et al. 2026 quote from Velicka et al.'s 2025 study; 6 ms,
Velicka et al. 2025 on a GH200 (the low end of the H100's clock_switch_range_ms); 20 ms, the slow end of the 10-20 ms
an NVML set call blocks its caller (ml-energy/zeus#29; nvml_call_ms); 100 ms, Spaan et al. 2026 through nvidia-smi on
an RTX 3080 Ti (its clock_switch_ms). Each GPU's own effective value (the H100's cautious 26 ms) is added.

The studies are kept in experiments/switch_latency/studies.db: a rerun resumes from it (each latency is a GPU type of
its own there, so its studies are its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import optuna

import freqopt
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import get_workload
from freqopt.files import atomic_write_text

OUT = Path(__file__).resolve().parent / "switch_latency"
GRANULARITIES = ("iteration", "pass", "kernel", "phase")
LATENCIES_MS = (1.0, 6.0, 20.0, 100.0)
# Each configuration: (label, model, get_workload overrides, GPU type, budget).
CONFIGS = (
    ("gpt3-small", "gpt3-small", {}, "h100-sxm", 0.01),
    ("gpt3-xl", "gpt3-xl", {}, "h100-sxm", 0.01),
    ("gpt3-xl, Spaan et al. 2026", "gpt3-xl", {"micro_batch_size": 40, "seq_len": 1024, "n_heads": 16}, "rtx3080ti",
     0.30),
)


def latency_sources() -> dict[float, str]:
    """Each latency's source, with the figures read back from the GPU files they come from (so a changed file
    fails here rather than mislabelling the table)."""
    h100, rtx = get_gpu("h100-sxm"), get_gpu("rtx3080ti")
    sources = {
        1.0: "low end of the 1-500 ms Lei et al. 2026 quote from Velicka et al. 2025 (search_spaces/*.toml, "
             "sources.actuation)",
        1e3 * h100.clock_switch_range_s[0]: "Velicka et al. 2025, about 6 ms on a GH200 (h100-sxm.toml, low end of "
                                            "clock_switch_range_ms)",
        1e3 * h100.nvml_call_s: "slow end of the 10-20 ms an NVML set call blocks its caller, ml-energy/zeus#29 "
                                "(h100-sxm.toml nvml_call_ms)",
        1e3 * rtx.clock_switch_s: "Spaan et al. 2026 through nvidia-smi on an RTX 3080 Ti (rtx3080ti.toml "
                                  "clock_switch_ms)",
    }  # fmt: skip
    assert sorted(round(k, 9) for k in sources) == list(LATENCIES_MS), f"the GPU files moved: {sorted(sources)}"
    return {round(k, 9): v for k, v in sources.items()}


def latencies_for(gpu: str, quick: bool) -> list[float]:
    """The study's latencies, ms, with the GPU file's own effective value added where it is not among them."""
    own = round(1e3 * get_gpu(gpu).clock_switch_s, 9)
    chosen = (LATENCIES_MS[0], LATENCIES_MS[-1]) if quick else LATENCIES_MS
    return sorted(set(chosen) | ({own} if not quick else set()))


def run(out: Path, quick: bool) -> dict:
    sources = latency_sources()
    out.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{out / 'studies.db'}"
    configs = CONFIGS[:1] if quick else CONFIGS
    results: dict = {"granularities": list(GRANULARITIES), "latency_sources_ms": {}, "configs": {}}
    for label, model, sizes, gpu, budget in configs:
        spec = get_gpu(gpu)
        own = round(1e3 * spec.clock_switch_s, 9)
        sizes = {**sizes, **({"seq_len": 128, "micro_batch_size": 1} if quick else {})}
        workload = get_workload(model, **sizes)
        entry = {"model": model, "gpu": gpu, "max_slowdown_pct": 100 * budget, "micro_batch_size":
                 workload.micro_batch_size, "seq_len": workload.config.seq_len, "n_heads": workload.config.n_heads,
                 "gpu_clock_switch_ms": own, "gpu_clock_switch_range_ms": [1e3 * v for v in spec.clock_switch_range_s],
                 "gpu_mem_clock_lock": spec.mem_clock_lock, "by_latency_ms": {}}  # fmt: skip
        for latency_ms in latencies_for(gpu, quick):
            results["latency_sources_ms"][str(latency_ms)] = sources.get(
                latency_ms, f"{gpu}.toml clock_switch_ms: the GPU file's effective value (sources.actuation)")
            started = time.monotonic()
            print(f"{label} on {gpu}, {latency_ms:g} ms switches ...", flush=True)
            result = freqopt.search(workload, max_slowdown=budget, gpu=gpu, granularity=GRANULARITIES,
                                    storage=storage, seed=0, n_trials=4 if quick else None,
                                    switch_latency_ms=latency_ms)  # fmt: skip
            doc = result.summary()
            entry["baseline"] = doc["baseline"]
            entry["by_latency_ms"][str(latency_ms)] = {
                "results": {g: {k: r[k] for k in ("energy_saved_pct", "slowdown_pct", "ideal_energy_saved_pct",
                                                   "ideal_slowdown_pct", "n_settings", "n_measurements")}
                            for g, r in doc["results"].items()},
                "n_new_measurements": doc["n_new_measurements"], "wall_s": time.monotonic() - started}  # fmt: skip
        results["configs"][label] = entry
    return results


def _cell(r: dict) -> str:
    return f"{r['energy_saved_pct']:.2f} / {r['slowdown_pct']:+.2f}"


def report(results: dict) -> str:
    lines = ["# Realizable savings against the clock-switch latency (issue 22)", "",
             "Produced by `python experiments/switch_latency.py`. Each cell: energy saved (%) / slowdown (%) against "
             "default clocks, validated on the whole iteration with the schedule as a runtime realizes it at that "
             "switch latency (simulated GPU). \"kernel, free switching\": the kernel level's schedule with instant "
             "switches (Spaan et al.'s setting). Latency sources: see the list below the tables.", ""]  # fmt: skip
    for label, c in results["configs"].items():
        latencies = list(c["by_latency_ms"])
        lines += [f"## {label} on {c['gpu']}, budget {c['max_slowdown_pct']:g} %", "",
                  f"micro-batch {c['micro_batch_size']}, sequence {c['seq_len']}, {c['n_heads']} heads; baseline "
                  f"{c['baseline']['time_s']:.4f} s and {c['baseline']['energy_j']:.2f} J per iteration. The GPU "
                  f"file's latency: {c['gpu_clock_switch_ms']:g} ms (plausible {c['gpu_clock_switch_range_ms'][0]:g}-"
                  f"{c['gpu_clock_switch_range_ms'][1]:g} ms); memory clock: {c['gpu_mem_clock_lock']}.", "",
                  "| granularity | " + " | ".join(f"{float(l):g} ms" for l in latencies) + " |",
                  "|---|" + "---:|" * len(latencies)]  # fmt: skip
        for g in results["granularities"]:
            lines.append(f"| {g} | " + " | ".join(_cell(c["by_latency_ms"][l]["results"][g]) for l in latencies) + " |")
        free = [c["by_latency_ms"][l]["results"]["kernel"] for l in latencies]
        lines.append("| kernel, free switching | " + " | ".join(
            "-" if r["ideal_energy_saved_pct"] is None else
            f"{r['ideal_energy_saved_pct']:.2f} / {r['ideal_slowdown_pct']:+.2f}" for r in free) + " |")  # fmt: skip
        lines.append("")
    lines += ["## Sources of the latencies", ""]
    lines += [f"- {float(l):g} ms: {s}" for l, s in sorted(results["latency_sources_ms"].items(), key=lambda x: float(x[0]))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt3-small only (sequence 128, micro-batch 1), 1 and "
                        "100 ms, 4 trials per unit, into a temporary folder (or --out)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="folder of the storage, results.json and report.md")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.gettempdir()) / "freqopt-switch-latency-quick" if args.quick else OUT)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.monotonic()
    results = run(out, args.quick)
    results["wall_s"] = time.monotonic() - started
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(out / "report.md", report(results))
    print(report(results))
    print(f"written to {out} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
