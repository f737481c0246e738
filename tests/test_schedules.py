"""Pipeline schedules from torch.distributed.pipelining as instruction DAGs (issue 37, item 1), and the planner on
them."""

from __future__ import annotations

import numpy as np
import pytest

from freqopt.errors import InvalidSettingError
from freqopt.pipeline.dag import (ALL_KINDS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SCHEDULES,
                                  Instruction, one_f_one_b, schedule_dag, stage_order)
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.profile import stage_profile_from_rows
from freqopt.pipeline.schedules import TORCH_SCHEDULES, rank_orders

TORCH = [s for s in SCHEDULES if s != "1f1b"]


def replay_s(orders, durations) -> float:
    """The iteration time of per-rank instruction orders replayed as torch.distributed.pipelining's runtime runs
    them, written apart from the DAG: each rank takes its next instruction once that instruction's inputs exist
    (torch's _simulate_comms_compute rule: a forward needs the previous stage's forward of its micro-batch, a
    backward or input-gradient the next stage's, a weight-gradient its own input-gradient) and starts it when the
    rank is free; P2P transfers take no time. Fails on a deadlock."""
    done: dict[tuple[int, str, int], float] = {}
    n_stages = 1 + max(k for order in orders for k, _, _ in order)
    position, free = [0] * len(orders), [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            if position[r] == len(order):
                continue
            k, kind, m = order[position[r]]
            if kind == FORWARD:
                needs = [(k - 1, FORWARD, m)] if k > 0 else []
            elif kind == BACKWARD_WEIGHT:
                needs = [(k, BACKWARD_INPUT, m)]
            else:
                needs = [(k, FORWARD, m)]
                if k < n_stages - 1:
                    upstream = [(k + 1, b, m) for b in (BACKWARD, BACKWARD_INPUT) if (k + 1, b, m) in durations]
                    needs += upstream
            if any(n not in done for n in needs):
                continue
            start = max([free[r]] + [done[n] for n in needs])
            done[(k, kind, m)] = free[r] = start + durations[(k, kind, m)]
            position[r] += 1
            remaining -= 1
            progressed = True
        assert progressed, "the order deadlocks"
    return max(done.values())


@pytest.mark.parametrize("schedule", TORCH)
@pytest.mark.parametrize("ranks,micro_batches", [(2, 4), (4, 8), (3, 6)])
def test_each_schedules_dag_times_an_iteration_as_torchs_order_runs(schedule, ranks, micro_batches):
    """Issue 37's criterion: the DAG's iteration time at fixed instruction times is that of the schedule's own
    action order replayed (torch's rule for when an action may run), for random times."""
    orders = rank_orders(schedule, ranks, micro_batches)
    dag = schedule_dag(schedule, ranks, micro_batches)
    rng = np.random.default_rng(ranks * 100 + micro_batches)
    for _ in range(3):
        per_key = {}
        for inst in dag.instructions:
            key = (inst.stage, inst.kind)
            if key not in per_key:
                per_key[key] = rng.uniform(0.5, 2.0)
        durations = {(i.stage, i.kind, i.micro_batch): per_key[(i.stage, i.kind)] for i in dag.instructions}
        times = np.array([durations[(i.stage, i.kind, i.micro_batch)] for i in dag.instructions])
        assert dag.iteration_time_s(times) == pytest.approx(replay_s(orders, durations), rel=1e-12)
    assert dag.gpus == ranks and dag.n == sum(len(o) for o in orders)
    every = {(i.stage, i.micro_batch) for i in dag.instructions if i.kind == FORWARD}
    assert every == {(k, m) for k in range(dag.stages) for m in range(micro_batches)}


def test_torchs_1f1b_is_deepspeeds_and_torchs_own_dry_run_accepts_every_order():
    """torch's Schedule1F1B orders each rank as DeepSpeed's TrainSchedule does (one_f_one_b, the default); and
    torch's own dry run of each schedule (its communication added: _add_send_recv, _simulate_comms_compute)
    finds no deadlock."""
    from freqopt.pipeline.schedules import torch_rank_orders

    for ranks, m in ((2, 4), (4, 8), (4, 4)):
        torch_orders = torch_rank_orders("1f1b", ranks, m)
        for s in range(ranks - 1):
            assert [Instruction(*a) for a in torch_orders[s]] == stage_order(ranks, m, s)
        # torch 2.13's IR numbers the last rank's forwards 1..M (its runtime loop runs 0..M-1, as DeepSpeed's):
        # freqopt keeps DeepSpeed's order; when torch fixes its IR, this fails and the two can be compared whole.
        last = [Instruction(*a) for a in torch_orders[-1]]
        shifted = [Instruction(i.stage, i.kind, i.micro_batch + (i.kind == FORWARD)) for i in stage_order(ranks, m, ranks - 1)]
        assert last == shifted
        assert rank_orders("1f1b", ranks, m)[-1] == tuple((i.stage, i.kind, i.micro_batch)
                                                          for i in stage_order(ranks, m, ranks - 1))
        a, b = one_f_one_b(ranks, m), schedule_dag("1f1b", ranks, m)
        assert a.instructions == b.instructions and np.array_equal(a.edges, b.edges)
    from torch.distributed.pipelining import schedules as ts

    from freqopt.pipeline.schedules import _StageStandIn, rank_of_stage, stages_per_rank
    import torch

    for schedule in ("gpipe", "interleaved-1f1b", "zb-v"):
        ranks, m = 4, 8
        v = stages_per_rank(schedule)
        order = {}
        for rank in range(ranks):
            mine = [k for k in range(ranks * v) if rank_of_stage(schedule, ranks, k) == rank]
            stand_ins = [_StageStandIn(k, ranks * v, ranks, rank, torch.nn.Identity()) for k in mine]
            cls = getattr(ts, TORCH_SCHEDULES[schedule])
            built = cls(stand_ins[0], m) if v == 1 else cls(stand_ins, m)
            order[rank] = [a for a in built.pipeline_order[rank] if a is not None and str(a)[-1] != "D"]
        compute = {r: [a for a in acts if a.computation_type in (ts.F, ts.B, ts.I, ts.W)] for r, acts in order.items()}
        with_comms = ts._add_send_recv(compute, lambda k: rank_of_stage(schedule, ranks, k), ranks * v)
        simulated = ts._simulate_comms_compute(with_comms, lambda k: rank_of_stage(schedule, ranks, k), ranks * v)
        assert set(simulated) == set(range(ranks))


def test_the_dags_place_model_stages_on_gpus_as_torch_does():
    looped = schedule_dag("interleaved-1f1b", 4, 8)
    assert looped.stages == 8 and looped.gpu_of_stage == (0, 1, 2, 3, 0, 1, 2, 3)
    v = schedule_dag("zb-v", 4, 8)
    assert v.gpu_of_stage == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.kinds == (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    assert schedule_dag("dualpipe-v", 4, 8).kinds == ALL_KINDS
    assert schedule_dag("looped-bfs", 2, 4, virtual_stages=3).stages == 6
    # The blocked power is charged per GPU, not per model stage.
    times, energies = np.ones(looped.n), np.ones(looped.n)
    total = looped.iteration_time_s(times)
    assert looped.iteration_energy_j(times, energies, 10.0) == pytest.approx(looped.n + 10.0 * (4 * total - looped.n))


def test_bad_schedules_are_refused_in_one_line():
    with pytest.raises(InvalidSettingError, match="^schedule 'pipedream' is unknown; known: 1f1b, gpipe"):
        schedule_dag("pipedream", 4, 8)
    with pytest.raises(InvalidSettingError, match="^virtual_stages 3: schedule zb-v runs 2 model stage"):
        schedule_dag("zb-v", 4, 8, virtual_stages=3)
    with pytest.raises(InvalidSettingError, match="^micro_batches 3: .*ScheduleDualPipeV refuses 4 stages x 3 "
                                                  "micro-batches .*: DualPipeV requires at least as many"):
        schedule_dag("dualpipe-v", 4, 3)


def _profile(stages: int, kinds, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for stage in range(stages):
        for kind in kinds:
            scale = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}[kind] * rng.uniform(0.8, 1.3)
            for c in range(3):
                rows.append({"stage": stage, "instruction": kind, "frequency": 1000 + 100 * c,
                             "time": scale * (1.0 + 0.25 * (2 - c)), "energy": scale * (10.0 + 1.5 * c * c)})
    return stage_profile_from_rows(rows)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b", "zb-v"])
def test_the_planner_plans_other_schedules_within_the_deadline(schedule):
    """The planner on a schedule's DAG: a plan within the budget that saves energy, one clock per GPU for the
    stage level, and the profile's stages the model's (several per GPU)."""
    kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if schedule == "zb-v" else (FORWARD, BACKWARD)
    model_stages = 2 if schedule == "gpipe" else 4
    planner = PipelinePlanner(_profile(model_stages, kinds), 4, schedule=schedule, blocking_power_w=5.0)
    assert planner.gpus == 2 and planner.dag.schedule == schedule
    plan = planner.plan(max_slowdown="10%")
    assert plan.time_s <= 1.1 * plan.default_time_s + 1e-9 and plan.energy_j < plan.default_energy_j
    assert planner.evaluate(plan.sm_clock_mhz) == pytest.approx((plan.time_s, plan.energy_j))
    per_gpu = planner.plan_stage_clocks(max_slowdown="10%")
    clocks = {}
    for inst, clock in zip(planner.dag.instructions, per_gpu.sm_clock_mhz):
        clocks.setdefault(planner.dag.gpu_of(inst), set()).add(int(clock))
    assert all(len(c) == 1 for c in clocks.values()) and per_gpu.energy_j >= plan.energy_j - 1e-9


def test_a_profile_without_a_schedules_instructions_is_refused_in_one_line():
    with pytest.raises(InvalidSettingError, match="^stage_profile: schedule zb-v runs backward_input instructions, "
                                                  "which the profile does not give"):
        PipelinePlanner(_profile(4, (FORWARD, BACKWARD)), 4, schedule="zb-v", blocking_power_w=5.0)
    with pytest.raises(InvalidSettingError, match="runs 2 model stages per GPU; the stage profile's 3 stages"):
        PipelinePlanner(_profile(3, (FORWARD, BACKWARD)), 4, schedule="interleaved-1f1b", blocking_power_w=5.0)


@pytest.fixture(scope="module")
def chunk_traces():
    """gpt3-small (micro-batch 1 of 128 tokens) on 2 GPUs, traced as 2 and as 4 model stages."""
    from freqopt.workload.layout import parse_layout
    from freqopt.workload.models import get_workload
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    workload = get_workload("gpt3-small", micro_batch_size=1, seq_len=128, layout=parse_layout("pp=2"))
    return {n: trace_pipeline_stages(workload, model_stages=n) for n in (2, 4)}


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_the_simulated_pipeline_runs_a_schedule_as_its_own_order_times_it(schedule, chunk_traces):
    """Issue 37's criterion on the simulated GPU: each schedule's simulated iteration at a fixed clock is the
    schedule's own action order replayed on the same instruction times, and its energy is the instructions' plus
    every GPU's blocked power while it waits (one StageRun per GPU)."""
    from freqopt.gpu.specs import get_gpu
    from freqopt.pipeline.sim import SimulatedPipeline
    from freqopt.pipeline.schedules import stages_per_rank

    a100 = get_gpu("a100-sxm4-80gb")
    traces = chunk_traces[2 * stages_per_rank(schedule)]
    pipe = SimulatedPipeline(traces, a100, 4, noise=False, optimizer_step=False, schedule=schedule)
    assert pipe.gpus == 2 and pipe.stages == len(traces)
    run = pipe.true_run(1200, switching=False)
    cost = {(i.stage, i.kind): pipe.instruction_cost(i.stage, i.kind, 1200) for i in pipe.dag.instructions}
    durations = {(i.stage, i.kind, i.micro_batch): cost[(i.stage, i.kind)][0] for i in pipe.dag.instructions}
    assert run.time_s == pytest.approx(replay_s(rank_orders(schedule, 2, 4), durations), rel=1e-9)
    times = np.array([cost[(i.stage, i.kind)][0] for i in pipe.dag.instructions])
    energies = np.array([cost[(i.stage, i.kind)][1] for i in pipe.dag.instructions])
    assert run.energy_j == pytest.approx(pipe.dag.iteration_energy_j(times, energies, pipe.blocked_power_w(1200)),
                                         rel=1e-9)  # fmt: skip
    assert len(run.stages) == 2
    with_step = SimulatedPipeline(traces, a100, 4, noise=False, schedule=schedule).true_run(1200, switching=False)
    assert with_step.time_s > run.time_s  # each GPU's optimizer step (its model stages' together) after the last


def test_a_backward_splits_into_its_input_and_weight_gradients(chunk_traces):
    """The zero-bubble schedules' split: the two halves partition the backward; the weight half is the GEMMs
    whose inner dimension is the micro-batch's tokens (dW = dY^T X) and the bias sums, about half the backward's
    GEMM FLOPs; the P2P transfers and fused attention stay with the input gradient."""
    for trace in chunk_traces[4]:
        backward = trace.pass_kernels(BACKWARD)
        inputs, weights = trace.pass_kernels(BACKWARD_INPUT), trace.pass_kernels(BACKWARD_WEIGHT)
        assert sorted(map(id, inputs + weights)) == sorted(map(id, backward))
        assert weights and all(k.name in ("aten.mm", "aten.addmm", "aten.sum", "aten.embedding_dense_backward")
                               for k in weights)  # fmt: skip
        assert not any(k.kind in ("send", "recv", "attention") for k in weights)
        gemm = sum(k.flops for k in backward if k.kind == "gemm")
        if gemm:  # (a stage of the embedding alone has no GEMM)
            assert 0.3 < sum(k.flops for k in weights if k.kind == "gemm") / gemm < 0.7


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_the_pipeline_search_runs_other_schedules_within_the_budget(schedule, tmp_path):
    """Issue 37's criterion: the pipeline search runs interleaved 1F1B and ZB-V on the simulated GPU, every level
    held to the budget at its confidence; each GPU's requests are listed in its own order with the model stage of
    each instruction; no pipeline clock table is written (its format holds 1F1B only)."""
    import freqopt

    result = freqopt.search_pipeline("gpt3-small", gpu="a100-sxm4-80gb", layout="pp=2", micro_batches=4,
                                     micro_batch_size=1, seq_len=128, max_slowdown="2%", n_trials=4,
                                     validation_repeats=2, schedule=schedule, out=tmp_path)  # fmt: skip
    assert result.schedule == schedule and result.dag.schedule == schedule and result.dag.gpus == 2
    for g in result.levels:
        bound = result.slowdown_bound_pct(g)
        assert bound is None or bound <= 2.0 + 1e-9
        assert result.energy_saved_pct(g) >= 0.0
    requests = result.stage_requests()
    assert [r["stage"] for r in requests] == [0, 1]
    assert {i["model_stage"] for i in requests[0]["instructions"]} == {0, 3 if schedule == "zb-v" else 2}
    kinds = {i["kind"] for r in requests for i in r["instructions"]}
    assert kinds == ({"forward", "backward_input", "backward_weight"} if schedule == "zb-v" else {"forward", "backward"})
    assert result.table_path is None and not list(tmp_path.glob("*-instruction.json"))
    with pytest.raises(InvalidSettingError, match=f"^schedule {schedule}: a pipeline clock table holds DeepSpeed's"):
        result.pipeline_doc()


def test_schedule_applies_to_a_pipeline_layout_only(capsys):
    from freqopt.cli import main

    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--schedule", "zb-v"]) != 0
    err = capsys.readouterr().err
    assert "schedule applies to a pipeline layout" in err and len(err.strip().splitlines()) == 1
    profile = "experiments/data/perseus/bloom+a100_sxm_bf16.csv"
    from pathlib import Path

    profile = str(Path(__file__).parents[1] / profile)
    assert main(["plan", "--stage-profile", profile, "--micro-batches", "8", "--schedule", "zb-v",
                 "--virtual-stages", "3", "--gpu", "a100-sxm4-80gb"]) != 0  # fmt: skip
    assert capsys.readouterr().err.startswith("freqopt: error: --virtual-stages 3: schedule zb-v runs 2 model")
