"""The simulated pipeline (freqopt.pipeline.sim): S simulated GPUs running a 1F1B iteration (issue 24, item 2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.physics import KernelPhysics, SetCallQueue
from freqopt.gpu.backends.simulated import SimulatedGPU
from conftest import INSTANT_HOST
from freqopt.gpu.specs import get_gpu
from freqopt.pipeline.dag import KINDS
from freqopt.pipeline.realize import realize_requests
from freqopt.pipeline.sim import SimulatedPipeline, perseus_blocking_power_w
from freqopt.workload.layout import parse_layout
from freqopt.workload.models import get_workload
from freqopt.workload.pipeline_trace import trace_pipeline_stages

# The pipeline mechanics on a GPU-bound tiny model: an instant host (conftest.INSTANT_HOST).
A100 = get_gpu("a100-sxm4-80gb").with_host(INSTANT_HOST)
M = 4


@pytest.fixture(scope="module")
def stages():
    """gpt3-small in 3 stages (the embedding makes stage 0 lighter), micro-batch 2 of 256 tokens."""
    return trace_pipeline_stages(get_workload("gpt3-small", micro_batch_size=2, seq_len=256, layout=parse_layout("pp=3")))


def _pipe(stages, **kwargs) -> SimulatedPipeline:
    return SimulatedPipeline(stages, A100, M, noise=False, **kwargs)


def _mixed(pipe: SimulatedPipeline) -> list[int]:
    """A plan with every clock different somewhere: per instruction, one of four clocks."""
    clocks = [1410, 1230, 1050, 870]
    return [clocks[(3 * inst.stage + 2 * inst.micro_batch + (inst.kind == "backward")) % 4]
            for inst in pipe.dag.instructions]  # fmt: skip


def test_iteration_time_is_the_critical_path_of_the_instructions(stages):
    pipe = _pipe(stages, optimizer_step=False)
    clocks = _mixed(pipe)
    run = pipe.true_run(clocks, switching=False)
    # Each instruction takes what its kernels take at its clock, issued as measure_schedule issues them ...
    gpu = SimulatedGPU(A100, noise=False)
    for i, (inst, clock) in enumerate(zip(pipe.dag.instructions, clocks)):
        kernels = pipe.instruction_kernels(inst.stage, inst.kind)
        expected = gpu.step(kernels, [ClockSetting(sm_clock_mhz=clock)] * len(kernels))
        assert run.instruction_time_s[i] == pytest.approx(expected.time_s, rel=1e-12)
        assert run.instruction_energy_j[i] == pytest.approx(expected.energy_j, rel=1e-12)
    # ... starts when its DAG predecessors end, and the iteration ends at the critical path.
    assert run.start_s == pytest.approx(pipe.dag.start_times_s(run.instruction_time_s), abs=1e-12)
    assert run.time_s == pytest.approx(pipe.dag.iteration_time_s(run.instruction_time_s), rel=1e-12)


def test_the_optimizer_step_follows_a_barrier_after_the_last_backward(stages):
    with_step, without = _pipe(stages), _pipe(stages, optimizer_step=False)
    a, b = with_step.true_run(), without.true_run()
    steps = [with_step.instruction_cost(s, "optimizer")[0] for s in range(len(stages))]
    assert a.time_s == pytest.approx(b.time_s + max(steps), rel=1e-12)
    assert all(k.pass_name == "optimizer" for k in with_step.instruction_kernels(0, "optimizer"))
    # AdamW over the stage's parameters moves at least its master weights, moments and gradients (4 B each, r+w).
    moved = sum(k.mem_bytes for k in with_step.instruction_kernels(1, "optimizer"))
    assert moved >= 4 * 2 * 3 * stages[1].n_params


def test_energy_is_the_instructions_plus_blocked_power_while_idle(stages):
    pipe = _pipe(stages, optimizer_step=False)
    for setting in (None, 1050):  # one clock throughout: the blocked power is that clock's
        run = pipe.true_run(setting)
        power = pipe.blocked_power_w(setting)
        for r in run.stages:
            assert r.busy_s + r.blocked_s == pytest.approx(run.time_s, rel=1e-12)
            assert r.blocked_energy_j == pytest.approx(power * r.blocked_s, rel=1e-12)
            assert r.energy_j == pytest.approx(r.instruction_energy_j + r.blocked_energy_j, rel=1e-12)
        # With a constant blocked power and no optimizer step this is Perseus's accounting.
        assert run.energy_j == pytest.approx(
            pipe.dag.iteration_energy_j(run.instruction_time_s, run.instruction_energy_j, power), rel=1e-12)
    # Blocked power is the GPU's waiting power at the clock: a receive with no FLOPs and no bytes (issue 36, item 2).
    physics = KernelPhysics(A100, stages[0].kernels[:1], np.asarray([A100.max_mem_clock_mhz], dtype=float))
    assert pipe.blocked_power_w() == pytest.approx(physics.wait_power_w[0, -1])
    assert pipe.blocked_power_w(1050) < pipe.blocked_power_w(1230) < pipe.blocked_power_w()
    # At the highest clock it is the A100 file's waiting power, Perseus's measured 83.64 W (taken from the measurement:
    # provenance, not a check), not the loaded power model's baseline (147 W before issue 36; since issue 56's joint
    # fit, which holds that baseline to the same measurement, 83.1 W: within 2 % of it, and not the same figure).
    assert pipe.blocked_power_w() == pytest.approx(83.64, rel=1e-9)
    assert physics.baseline_power_w[0, -1] == pytest.approx(83.64, rel=0.02)
    assert physics.baseline_power_w[0, -1] != pytest.approx(83.64, rel=1e-6)
    assert perseus_blocking_power_w(A100) == 83.64 and perseus_blocking_power_w(get_gpu("h100-sxm")) is None
    # Perseus's constant in place of the physics': the same accounting with 83.64 W at every clock.
    perseus = _pipe(stages, optimizer_step=False, blocked_power_w=83.64)
    run = perseus.true_run(_mixed(perseus), switching=False)
    assert perseus.blocked_power_w(870) == perseus.blocked_power_w() == 83.64
    assert run.energy_j == pytest.approx(
        perseus.dag.iteration_energy_j(run.instruction_time_s, run.instruction_energy_j, 83.64), rel=1e-12)
    with pytest.raises(InvalidSettingError, match="blocked_power_w must be a finite number of watts"):
        _pipe(stages, blocked_power_w=-1.0)


def test_slowing_one_stage_changes_only_what_it_should(stages):
    pipe = _pipe(stages)
    base = pipe.true_run()
    slow = pipe.true_run({(0, kind): 870 for kind in KINDS})
    on0 = np.array([inst.stage == 0 for inst in pipe.dag.instructions])
    # Stage 0's instructions take longer and less energy; nobody else's instructions change.
    assert np.all(slow.instruction_time_s[on0] > base.instruction_time_s[on0] * 1.1)
    assert np.all(slow.instruction_energy_j[on0] < base.instruction_energy_j[on0])
    assert slow.instruction_time_s[~on0] == pytest.approx(base.instruction_time_s[~on0], rel=1e-12)
    assert slow.instruction_energy_j[~on0] == pytest.approx(base.instruction_energy_j[~on0], rel=1e-12)
    # Stage 0's forward of micro-batch 0 starts the pipeline and its last backward ends it: the iteration is longer.
    assert slow.time_s > base.time_s
    # The other stages wait longer (blocked) for stage 0, at their own (default) blocked power.
    for s in (1, 2):
        assert slow.stages[s].busy_s == pytest.approx(base.stages[s].busy_s, rel=1e-12)
        assert slow.stages[s].blocked_s > base.stages[s].blocked_s
        assert slow.stages[s].blocked_power_w == pytest.approx(pipe.blocked_power_w(), rel=1e-12)
        assert slow.stages[s].n_switches == 0
    assert slow.stages[0].n_switches == 0  # one clock throughout its stage: nothing to switch


def test_a_switch_lands_one_latency_after_the_instruction_that_asks_for_it(stages):
    pipe = _pipe(stages)
    dag = pipe.dag
    first = next(i for i, inst in enumerate(dag.instructions) if inst.stage == 0)  # F0 on stage 0
    last = max(i for i, inst in enumerate(dag.instructions) if inst.stage == 0)
    plan = [None] * dag.n
    plan[first] = 870  # F0 asks for 870 MHz; the stage returns to the default at its next instruction
    fast, slow = pipe.instruction_cost(0, "forward"), pipe.instruction_cost(0, "forward", 870)
    free = pipe.true_run(plan, switching=False)
    assert free.instruction_time_s[first] == pytest.approx(slow[0], rel=1e-12)
    # A latency of half the instruction: its first half at the default, the rest at 870 MHz (set calls that take
    # no time, so that the two requests one instruction apart do not queue: test_set_calls_are_served_one_at_a_time).
    half = dataclasses.replace(pipe.spec.with_switch_latency(fast[0] / 2), nvml_call_s=0.0)
    pipe.spec = half
    mid = pipe.true_run(plan)
    assert fast[0] < mid.instruction_time_s[first] < slow[0]
    assert mid.stages[0].n_switches == 2
    # A latency longer than the iteration: the measured iteration runs on the clock the last instruction left.
    pipe.spec = A100.with_switch_latency(10.0)
    late = pipe.true_run(plan)
    assert late.instruction_time_s[first] == pytest.approx(fast[0], rel=1e-12)
    plan[last] = 870  # the stage now ends on 870 MHz: F0's request changes nothing, and 870 stays in force
    assert pipe.true_run(plan).instruction_time_s[first] == pytest.approx(slow[0], rel=1e-12)


def test_set_calls_are_served_one_at_a_time_and_a_waiting_one_is_superseded():
    q = SetCallQueue(0.020)
    assert q.submit(0.000) == (0.000, False)  # served at once
    assert q.submit(0.005) == (0.020, False)  # waits for the call before
    assert q.submit(0.010) == (0.020, True)  # still waiting at 0.010: the one before is dropped, this takes its turn
    assert q.submit(0.050) == (0.050, False)  # the thread is free again at 0.040
    q.shift(0.050)
    assert q.submit(0.010) == (pytest.approx(0.020), False)  # busy until 0.070, 0.020 on the new origin
    free = SetCallQueue(0.0)  # calls that take no time: every request served as it is made
    assert [free.submit(t) for t in (0.0, 0.0, 0.001)] == [(0.0, False), (0.0, False), (0.001, False)]


def test_a_stage_switching_faster_than_its_set_calls_lands_its_requests_late(stages):
    pipe = _pipe(stages)
    first = next(i for i, inst in enumerate(pipe.dag.instructions) if inst.stage == 0)
    plan = [None] * pipe.dag.n
    plan[first] = 870  # F0 asks for 870 MHz and the next instruction for the default, well under 20 ms later
    quick = dataclasses.replace(A100.with_switch_latency(0.0001), nvml_call_s=0.0)
    queued = dataclasses.replace(quick, nvml_call_s=A100.nvml_call_s)
    pipe.spec = quick
    free_calls = pipe.true_run(plan)
    pipe.spec = queued
    one_thread = pipe.true_run(plan)
    # Served at once, 870 MHz holds F0 only (it lands 0.1 ms into it). With one thread whose calls take 20 ms, the
    # return to the default, asked for one instruction later, waits for the thread and lands 20 ms on, past the
    # iteration's end: F0 of the next iteration finds 870 MHz still in force and its stage's other instructions
    # run at it too, until the queued return lands.
    fast, slow = pipe.instruction_cost(0, "forward"), pipe.instruction_cost(0, "forward", 870)
    assert fast[0] < free_calls.instruction_time_s[first] < slow[0]
    assert one_thread.instruction_time_s[first] == pytest.approx(slow[0], rel=1e-9)
    on_stage_0 = [i for i, inst in enumerate(pipe.dag.instructions) if inst.stage == 0 and i != first]
    assert one_thread.instruction_time_s[on_stage_0].sum() > free_calls.instruction_time_s[on_stage_0].sum() * 1.05
    # Each iteration's one switch served on stage 0 is the queued return to the default (F0's request only drops the
    # one left waiting by the iteration before, which that iteration counted): one switch, as with free calls two.
    assert one_thread.stages[0].n_switches == 1 and free_calls.stages[0].n_switches == 2


def test_measurements_are_noisy_reproducible_and_cost_gpu_time(stages):
    pipe = SimulatedPipeline(stages, A100, M, seed=3)
    true = pipe.true_run(1230)
    a, b = pipe.run(1230, key="x", sample=0), pipe.run(1230, key="x", sample=1)
    assert pipe.run(1230, key="x", sample=0).energy_j == a.energy_j  # the same sample draws the same noise
    assert a.energy_j != b.energy_j and a.time_s != b.time_s
    for m in (a, b):
        assert m.energy_j == pytest.approx(true.energy_j, rel=0.03)
        assert m.time_s == pytest.approx(true.time_s, rel=0.01)
        assert m.cost_gpu_s >= len(stages) * (pipe.protocol.warmup_s + true.time_s)
    assert true.cost_gpu_s == 0.0


def test_bad_settings_are_refused(stages):
    pipe = _pipe(stages)
    with pytest.raises(InvalidSettingError, match="settings has 3 entries, not one per instruction"):
        pipe.true_run([1410, 1410, 1410])
    with pytest.raises(InvalidSettingError, match="does not support SM 1411 MHz"):
        pipe.true_run(1411)
    with pytest.raises(InvalidSettingError, match="stage_traces must be one StageTrace per stage"):
        SimulatedPipeline(stages[1:], A100, M)


def test_realized_requests_keep_the_plan_in_time_despite_the_switch_latency(stages):
    pipe = _pipe(stages)
    dag = pipe.dag
    plan = _mixed(pipe)
    times = np.array([pipe.instruction_cost(i.stage, i.kind, c)[0] for i, c in zip(dag.instructions, plan)])
    assert realize_requests(dag, plan, times, 0.0) == plan  # no latency: the plan itself
    tail = pipe.true_run().time_s - dag.iteration_time_s([pipe.instruction_cost(i.stage, i.kind)[0]
                                                          for i in dag.instructions])  # fmt: skip
    planned = pipe.true_run(plan, switching=False)
    for latency in (0.002, 0.02, 0.17):
        pipe.spec = A100.with_switch_latency(latency)
        requests = realize_requests(dag, plan, times, latency, tail_s=tail)
        assert all(r >= min(plan) for r in requests)
        realized = pipe.true_run(requests)
        as_planned = pipe.true_run(plan)  # the plan asked for at each instruction's own start
        assert realized.time_s <= planned.time_s * 1.002  # no instruction slower than planned (timeline: +-0.2 %)
        if latency >= 0.02:
            assert as_planned.time_s > realized.time_s


def test_a_switch_stall_delays_the_instruction_it_lands_in(stages):
    # Issue 34's sensitivity: a switch that also pauses the GPU. It lands mid-instruction (half of F0's time after
    # F0 asks for it), so F0 takes the stall longer and draws the blocked power meanwhile; the default iteration,
    # which never switches, is unchanged.
    dag = _pipe(stages).dag
    first = next(i for i, inst in enumerate(dag.instructions) if inst.stage == 0)
    plan = [None] * dag.n
    plan[first] = 870
    runs = {}
    for stall_s in (0.0, 1e-3):
        pipe = _pipe(stages, switch_stall_s=stall_s)
        # Calls that take no time, so that the two requests one instruction apart do not queue.
        pipe.spec = dataclasses.replace(A100.with_switch_latency(pipe.instruction_cost(0, "forward")[0] / 2),
                                        nvml_call_s=0.0)
        runs[stall_s] = (pipe.true_run(plan), pipe.true_run())
    (plain, default), (stalled, default_stalled) = runs[0.0], runs[1e-3]
    assert stalled.instruction_time_s[first] == pytest.approx(plain.instruction_time_s[first] + 1e-3, rel=1e-9)
    power = _pipe(stages).blocked_power_w(870)
    assert stalled.instruction_energy_j[first] == pytest.approx(plain.instruction_energy_j[first] + power * 1e-3,
                                                                rel=1e-9)  # fmt: skip
    assert default_stalled.time_s == default.time_s and default_stalled.energy_j == default.energy_j
    with pytest.raises(InvalidSettingError, match="^switch_stall_s"):
        _pipe(stages, switch_stall_s=-1.0)
