"""One data-parallel rank of tests/test_torch_pipeline_runtime.py's straggler test: a StragglerFollower whose pace
is all-reduced over gloo. Each rank's own step takes its plan's time (fast 1.0 s, mid 1.1, slow 1.2), rank 1's 1.2x
that for its first four steps (a straggler that then recovers); writes follow{R}.json: the plan chosen after each
step.

    python tests/straggler_rank.py --rank R --world 2 --port P --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    from freqopt.apply.torch_pipeline_runtime import StragglerFollower

    follower = StragglerFollower([(1.0, "fast"), (1.1, "mid"), (1.2, "slow")], every_n_steps=2)
    chosen = []
    plan_time = {"fast": 1.0, "mid": 1.1, "slow": 1.2}
    for step in range(8):
        slowness = 1.2 if (args.rank == 1 and step < 4) else 1.0  # rank 1 straggles, then recovers
        follower.step_done(plan_time[follower.plan] * slowness)  # its own time, before the gradient all-reduce
        chosen.append(follower.plan)
    Path(args.out, f"follow{args.rank}.json").write_text(json.dumps(chosen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
