"""Register predictions for issue 23's held-out checks before anyone compares them (2026-11-25).

    python experiments/held_out/predict.py      # about 2 minutes; writes experiments/held_out/*.json

* Perseus's GPT-3 175B A100 sweep (held out: never read here): freqopt's simulated forward + backward of gpt3-175b
  at tp=8, micro-batch 1, sequence 2048 on the A100 SXM4 80GB at every SM clock 870-1410 MHz, 15 MHz apart, each
  the ``freqopt profile --model gpt3-175b --gpu a100-sxm4-80gb --layout tp=8 --micro-batch-size 1 --seq-len 2048
  --sm-clock F`` that the check names (the step does not fit one GPU's memory: profile warns and reports it all the
  same), its time and energy relative to 1410 MHz, and the energy-optimal clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

from freqopt.workload.memory import GPUMemoryWarning
from freqopt.measure.profile import profile

HERE = Path(__file__).resolve().parent
CLOCKS = list(range(870, 1411, 15))


def main() -> int:
    warnings.simplefilter("ignore", GPUMemoryWarning)
    rows = []
    for f in CLOCKS:
        r = profile("gpt3-175b", gpu="a100-sxm4-80gb", layout="tp=8", micro_batch_size=1, seq_len=2048, sm_clock_mhz=f)
        fb = [r.by_pass[p] for p in ("forward", "backward")]
        rows.append({"sm_clock_mhz": f, "time_s": sum(p.time_s for p in fb), "energy_j": sum(p.energy_j for p in fb)})
    top = rows[-1]
    for row in rows:
        row["time_rel"] = row["time_s"] / top["time_s"]
        row["energy_rel"] = row["energy_j"] / top["energy_j"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    doc = {"check": "Perseus gpt3-175b+a100_sxm_bf16 stage sweep (held out), forward + backward, ratios to 1410 MHz",
           "command": "freqopt profile --model gpt3-175b --gpu a100-sxm4-80gb --layout tp=8 --micro-batch-size 1 "
                      "--seq-len 2048 --sm-clock F (by_pass forward + backward)",
           "registered": "2026-11-25", "commit": commit,
           "energy_optimal_sm_clock_mhz": min(rows, key=lambda r: r["energy_j"])["sm_clock_mhz"], "points": rows}
    (HERE / "a100_gpt3_175b_sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"energy-optimal {doc['energy_optimal_sm_clock_mhz']} MHz; " + " ".join(
        f"{r['sm_clock_mhz']}:{r['time_rel']:.3f}/{r['energy_rel']:.3f}" for r in rows[::4]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
