"""``freqopt train``: train a model on synthetic tokens under the DVFS runtime and report time and energy per step.

On the simulated backend the model trains for real on this machine's CPU (a small configuration), the runtime
follows its phases through the module hooks, and each step's GPU time and energy come from the simulated GPU
running the traced iteration with the settings the runtime asked for (switch latency included). On the nvml
backend the model trains on the GPU and steps are measured in blocks long enough for the energy counter
(CUDA-event time, counter-delta energy). With a layout of more than one rank the job runs under DeepSpeed
(ZeRO stage 0 data parallelism, AutoTP tensor parallelism), started with DeepSpeed's launcher.

``compare``: blocks of steps alternate between the table and the default settings, so both see the same
conditions; the measured saving is the difference of their mean energy per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from freqopt.backends.base import Backend, Measurement
from freqopt.models import Workload, build_model
from freqopt.phases import quiet_backward_hooks
from freqopt.runtime import DVFSRuntime, plan_phases
from freqopt.tables import ClockTable
from freqopt.trace import trace_training_iteration

__all__ = ["StepRecord", "TrainReport", "train"]


@dataclass(frozen=True)
class StepRecord:
    """One step: with the table or not, its GPU time and energy (per step; a block's mean on a real GPU)."""

    step: int
    with_table: bool
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class TrainReport:
    steps: tuple[StepRecord, ...]
    loss_first: float
    loss_last: float
    switches_per_step: float

    def mean(self, with_table: bool) -> Measurement | None:
        rows = [s for s in self.steps if s.with_table == with_table]
        if not rows:
            return None
        return Measurement(sum(r.time_s for r in rows) / len(rows), sum(r.energy_j for r in rows) / len(rows))

    def summary(self) -> dict:
        on, off = self.mean(True), self.mean(False)
        doc = {"steps": [vars(s) for s in self.steps], "loss_first": self.loss_first, "loss_last": self.loss_last,
               "switches_per_step": self.switches_per_step}  # fmt: skip
        for name, m in (("with_table", on), ("default", off)):
            if m is not None:
                doc[name] = {"time_s_per_step": m.time_s, "energy_j_per_step": m.energy_j}
        if on is not None and off is not None:
            doc["energy_saved_pct"] = 100.0 * (1.0 - on.energy_j / off.energy_j)
            doc["slowdown_pct"] = 100.0 * (on.time_s / off.time_s - 1.0)
        return doc


def _blocks(steps: int, compare: bool, has_table: bool) -> list[bool]:
    """Per step, whether the table is applied: all steps, or (compare) alternating blocks of a quarter each."""
    if not compare:
        return [has_table] * steps
    block = max(1, steps // 4)
    return [(i // block) % 2 == 0 for i in range(steps)]


def train(workload: Workload, backend: Backend, *, table: ClockTable | None, steps: int, compare: bool = False,
          device: str = "cpu", seed: int = 0, on_step=None) -> TrainReport:  # fmt: skip
    """Train ``workload`` for ``steps`` steps on synthetic tokens under the DVFS runtime (module docstring).

    Args:
        workload: model, micro-batch and layout (a layout of more than one rank needs the DeepSpeed launcher's
            environment: RANK, WORLD_SIZE).
        backend: SimulatedGPU or NVMLBackend; closed (GPU restored) when training ends, however it ends.
        table: the clock table, or None for default settings.
        steps: training steps.
        compare: alternate blocks with and without the table.
        device: where the model trains ("cuda" with the nvml backend).
        on_step: called with each StepRecord (progress).

    Returns:
        TrainReport.
    """
    torch.manual_seed(seed)
    layout = workload.layout
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    trace = trace_training_iteration(workload)
    model = build_model(workload.config, device=device, dtype=torch.float32)
    engine = None
    if layout.world_size > 1:
        import deepspeed

        from freqopt.deepspeed_profile import deepspeed_config

        deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
        config = deepspeed_config(workload.micro_batch_size, layout.tp)
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        runtime = DVFSRuntime.for_deepspeed(engine, table=table, backend=backend, trace=trace)
        data_rank = int(os.environ.get("RANK", "0")) // layout.tp
    else:
        model = model.to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
        runtime = DVFSRuntime(model, optimizer, table=table, backend=backend, trace=trace)
        data_rank = 0
    generator = torch.Generator().manual_seed(seed + 1000 * data_rank)
    schedule = _blocks(steps, compare, table is not None)
    table_plan, default_plan = runtime.plan, plan_phases(None, trace, backend.spec)
    records, losses = [], []
    with runtime:
        for i, with_table in enumerate(schedule):
            runtime.plan = table_plan if with_table else default_plan
            # Synthetic tokens; the targets are the next tokens, as in language-model training.
            tokens = torch.randint(0, workload.config.vocab_size,
                                   (workload.micro_batch_size, workload.config.seq_len + 1), generator=generator)
            idx, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
            started = time.perf_counter()
            energy_before = None if runtime.simulated else backend.device.energy_j()
            if engine is not None:
                loss = engine(idx, targets)
                with quiet_backward_hooks():
                    engine.backward(loss)
                engine.step()
            else:
                loss = model(idx, targets)
                with quiet_backward_hooks():
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if runtime.simulated:
                m = runtime.step_measurement()
                record = StepRecord(i, with_table, m.time_s, m.energy_j)
            else:
                torch.cuda.synchronize()
                record = StepRecord(i, with_table, time.perf_counter() - started,
                                    backend.device.energy_j() - energy_before)  # fmt: skip
            records.append(record)
            if on_step:
                on_step(record)
    return TrainReport(tuple(records), losses[0], losses[-1], runtime.switches / max(steps, 1))
