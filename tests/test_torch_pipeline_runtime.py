"""The DVFS runtime inside torch.distributed.pipelining (issue 37, item 2): two CPU ranks (gloo) train under
TorchPipelineRuntime, each action asking for its planned clock, no set call on the training thread, and the GPU
restored however the runtime exits."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from freqopt.apply.torch_pipeline_runtime import TorchPipelineRuntime, rank_plan
from freqopt.errors import InvalidSettingError
from freqopt.pipeline.schedules import rank_orders

RANK_SCRIPT = Path(__file__).parent / "torch_pipeline_rank.py"
CLOCKS = (1410, 1200, 1005, 810)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(schedule: str, ranks: int, micro_batches: int) -> list[list]:
    """Every instruction a clock, varied by stage, kind and micro-batch: [stage, kind, micro-batch, clock]."""
    kinds = ("forward", "backward", "backward_input", "backward_weight")
    return [[k, kind, m, CLOCKS[(k + kinds.index(kind) + m) % len(CLOCKS)]]
            for order in rank_orders(schedule, ranks, micro_batches) for k, kind, m in order]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v"])
def test_two_cpu_ranks_train_under_the_runtime_each_action_asking_for_its_planned_clock(schedule, tmp_path):
    plan = _plan(schedule, 2, 4)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), "--rank", str(r), "--world", "2", "--port",
                               str(port), "--schedule", schedule, "--plan", str(tmp_path / "plan.json"), "--out",
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    planned = {(k, kind, m): clock for k, kind, m, clock in plan}
    orders = rank_orders(schedule, 2, 4)
    for rank in range(2):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        seen = [tuple(r[:3]) for r in doc["requested"]]
        # Every action of both steps, in the schedule's own order, each asking for its planned clock.
        assert seen == [tuple(i) for i in orders[rank]] * 2
        assert all(r[3] == planned[tuple(r[:3])] for r in doc["requested"])
        asked = [r[3] for r in doc["requested"]]
        assert doc["switches"] == 1 + sum(a != b for a, b in zip(asked, asked[1:]))
        assert not doc["set_on_training_thread"] and doc["applied"] and doc["applied"][-1] == asked[-1]
        assert doc["hooks_left"] == []
    last = json.loads((tmp_path / f"rank{0 if schedule == 'zb-v' else 1}.json").read_text())
    assert len(last["losses"]) == 2


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _Stage:
    """What the runtime hooks on a PipelineStage: its index and the three compute methods."""

    stage_index = 0

    def forward_one_chunk(self, fwd_chunk_id, args=(), kwargs=None):
        return "f"

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return "b"

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return "w"


def test_the_gpu_is_restored_on_success_and_on_an_exception(fake_gpu):
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    for fail in (False, True):
        stage = _Stage()
        backend = NVMLBackend(open_devices()[0], torch_device="cpu")
        try:
            with TorchPipelineRuntime(stage, plan={(0, "forward", 0): 1200, (0, "backward_input", 0): 1005},
                                      backend=backend) as runtime:  # fmt: skip
                assert stage.forward_one_chunk(0, ()) == "f"
                _wait_for(lambda: runtime._worker.n_applied >= 1)  # the worker has locked the forward's clock
                assert stage.backward_one_chunk(0, None, False) == "b"
                assert stage.backward_weight_one_chunk(0) == "w"
                if fail:
                    raise RuntimeError("training failed")
        except RuntimeError:
            assert fail
        assert [r[1] for r in runtime.requested] == ["forward", "backward_input", "backward_weight"]
        assert not runtime._thread.is_alive() and "forward_one_chunk" not in stage.__dict__
        locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
        assert 1200 in locks and set(locks) <= {1200, 1005}
        gpu = fake_gpu.gpus[0]
        assert (gpu.locked_sm_mhz, gpu.locked_mem_mhz, gpu.power_limit_mw) == (None, None, 650_000)


def test_refusals_and_a_plan_from_a_search():
    with pytest.raises(InvalidSettingError, match="^stages must be torch.distributed.pipelining PipelineStages"):
        TorchPipelineRuntime(object(), plan=None, backend=None)
    with pytest.raises(InvalidSettingError, match="^plan keys must be"):
        TorchPipelineRuntime(_Stage(), plan={(0, "sideways", 0): 1200}, backend=None)
    import freqopt

    result = freqopt.search_pipeline("gpt3-small", gpu="a100-sxm4-80gb", layout="pp=2", micro_batches=4,
                                     micro_batch_size=1, seq_len=128, max_slowdown="2%", n_trials=4,
                                     validation_repeats=2, granularities="iteration", schedule="zb-v")  # fmt: skip
    plan = rank_plan(result, 1, "iteration")
    assert set(plan) == {(k, kind, m) for k, kind, m in rank_orders("zb-v", 2, 4)[1]}
    with pytest.raises(InvalidSettingError, match="^rank must be an integer in"):
        rank_plan(result, 2, "iteration")


def test_a_follower_runs_the_plan_that_matches_the_straggler_and_returns_when_it_recovers():
    """Issue 37, item 3's runtime half, with a stand-in reduction: the pace is the maximum of this pipeline's
    fastest-plan time and the straggler's report."""
    from freqopt.apply.torch_pipeline_runtime import StragglerFollower

    straggler = {"report": 1.15}
    follower = StragglerFollower([(1.1, "mid"), (1.0, "fast"), (1.2, "slow")], every_n_steps=2,
                                 reduce_max=lambda mine: max(mine, straggler["report"]))  # fmt: skip
    assert follower.plan == "fast"
    # Its own steps (before the gradient all-reduce) take its plan's time: 1.0 s on "fast".
    assert follower.step_done(1.0) is None and follower.step_done(1.0) == "mid"  # every 2 steps
    # On "mid" its own 1.1 s steps report 1.0 s on its fastest plan; the straggler still sets the pace.
    assert follower.step_done(1.1) is None and follower.step_done(1.1) is None and follower.plan == "mid"
    straggler["report"] = 1.0  # recovered
    follower.step_done(1.1)
    assert follower.step_done(1.1) == "fast" and follower.straggler_time_s == pytest.approx(1.0)
    assert follower.set_straggler_time_s(1.3) == "slow"  # a scheduler that knows the straggler
    # A pipeline that is itself 1.2x slow keeps its fastest plan when it sets the pace.
    own = StragglerFollower([(1.0, "fast"), (1.2, "slow")], every_n_steps=1, reduce_max=lambda mine: mine)
    assert own.step_done(1.2) is None and own.plan == "fast"
    with pytest.raises(InvalidSettingError, match="^plans must be one or more"):
        StragglerFollower([])


@pytest.mark.slow
def test_data_parallel_ranks_learn_the_stragglers_pace_by_an_all_reduce(tmp_path):
    """Two gloo ranks, rank 1 straggling (1.2x) for four steps: after the first reduction rank 0 runs the plan
    predicted for 1.2 s and rank 1 its fastest; once rank 1 recovers rank 0 returns to the fastest."""
    port = _free_port()
    script = Path(__file__).parent / "straggler_rank.py"
    procs = [subprocess.Popen([sys.executable, str(script), "--rank", str(r), "--world", "2", "--port", str(port),
                               "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    chosen = [json.loads((tmp_path / f"follow{r}.json").read_text()) for r in range(2)]
    assert chosen[0] == ["fast", "slow", "slow", "slow", "slow", "fast", "fast", "fast"]
    assert chosen[1] == ["fast"] * 8  # the straggler itself keeps its fastest plan


def test_follow_switches_the_plan_from_the_next_action():
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu

    stage = _Stage()
    with TorchPipelineRuntime(stage, plan={(0, "forward", 0): 1200, (0, "forward", 1): 1200},
                              backend=SimulatedGPU(get_gpu("a100-sxm4-80gb"), noise=False)) as runtime:  # fmt: skip
        stage.forward_one_chunk(0, ())
        runtime.follow({(0, "forward", 1): 1005})
        stage.forward_one_chunk(1, ())
        stage.forward_one_chunk(2, ())  # not in the plan: the default
    assert [r[3].sm_clock_mhz for r in runtime.requested] == [1200, 1005, None]
    with pytest.raises(InvalidSettingError, match="^plan keys must be"):
        runtime.follow({"stage0": 1200})
