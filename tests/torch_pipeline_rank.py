"""One rank of a torch.distributed.pipelining pipeline of small linear stages on a CPU (gloo), trained under
freqopt's TorchPipelineRuntime with a plan per instruction, for tests/test_torch_pipeline_runtime.py:

    python tests/torch_pipeline_rank.py --rank R --world 2 --port P --schedule 1f1b --plan PLAN.json --out DIR

The rank's GPU is a simulated one whose set call records the thread that makes it (the training thread must
never); two training steps of 4 micro-batches. Writes rank{R}.json: the actions the runtime saw with the clock
each asked for, the settings the worker applied, whether any set call ran on the training thread, the hooks
left after exit (none), and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

WIDTH, MICRO_BATCHES = 16, 4
SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1), "interleaved-1f1b":
             ("ScheduleInterleaved1F1B", 2), "zb-v": ("ScheduleZBVZeroBubble", 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)

    from torch.distributed.pipelining import PipelineStage, schedules

    from freqopt.apply.torch_pipeline_runtime import TorchPipelineRuntime
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu
    from freqopt.pipeline.schedules import rank_of_stage

    class RecordingGPU(SimulatedGPU):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.calls = []  # (thread id, SM clock)

        def apply(self, setting):
            self.calls.append((threading.get_ident(), setting.sm_clock_mhz))
            super().apply(setting)

    cls_name, v = SCHEDULES[args.schedule]
    n_stages = args.world * v
    torch.manual_seed(0)
    mine = [k for k in range(n_stages) if rank_of_stage(args.schedule, args.world, k) == args.rank]
    stages = [PipelineStage(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()), k, n_stages,
                            torch.device("cpu")) for k in mine]  # fmt: skip
    loss_fn = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    cls = getattr(schedules, cls_name)
    schedule = cls(stages[0], MICRO_BATCHES, loss_fn=loss_fn) if v == 1 else cls(stages, MICRO_BATCHES, loss_fn=loss_fn)
    plan = {(s, kind, m): clock for s, kind, m, clock in json.loads(Path(args.plan).read_text())}
    gpu = RecordingGPU(get_gpu("a100-sxm4-80gb"), noise=False)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    losses = []
    with TorchPipelineRuntime(stages, plan=plan, backend=gpu) as runtime:
        for _ in range(2):
            kwargs = {}
            if any(s.is_first for s in stages):
                kwargs["args"] = (x,)
            if any(s.is_last for s in stages):
                out_losses = []
                kwargs.update(target=y, losses=out_losses)
            schedule.step(*kwargs.pop("args", ()), **kwargs)
            if any(s.is_last for s in stages):
                losses.append(float(sum(out_losses)))
    main_thread = threading.get_ident()
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps({
        "stages": mine,
        "requested": [[s, kind, m, setting.sm_clock_mhz] for s, kind, m, setting in runtime.requested],
        "applied": [clock for _, clock in gpu.calls],
        "set_on_training_thread": any(t == main_thread for t, _ in gpu.calls),
        "hooks_left": [name for s in stages for name in ("forward_one_chunk", "backward_one_chunk",
                                                          "backward_weight_one_chunk") if name in s.__dict__],
        "switches": runtime.switches, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
