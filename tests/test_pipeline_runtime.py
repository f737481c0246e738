"""The pipeline runtime on one engine (issue 24, item 4): each forward and backward pass of DeepSpeed's 1F1B
TrainSchedule asks for its stage's clock without waiting, hooked on that engine instance only, counted per
iteration, and the GPU restored however the runtime exits.

The engine here is DeepSpeed's own dispatch (PipelineEngine._exec_schedule, which looks up the instance's
_INSTRUCTION_MAP for each instruction) over DeepSpeed's own TrainSchedule, without the model, processes and
transfers around it: those run in tests/test_pipeline_train.py."""

from __future__ import annotations

import threading

import pytest

from freqopt.errors import ClockTableError, FreqoptError, InvalidSettingError
from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import Layout
from freqopt.workload.models import get_workload
from freqopt.workload.pipeline_trace import trace_pipeline_stages
from freqopt.apply.pipeline_runtime import PipelineRuntime, pipeline_schedules, stage_schedule

from pipeline_tables import make_table

schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

H100 = get_gpu("h100-sxm")


def _record(name):
    def execute(self, **kwargs):
        self.executed.append(name)

    return execute


class Engine:
    """What PipelineRuntime relies on of a PipelineEngine: stage_id, num_stages, micro_batches, train_batch running
    DeepSpeed's TrainSchedule through PipelineEngine._exec_schedule (its own code), eval_batch its
    InferenceSchedule. Every instruction executed is recorded by its class name."""

    _exec_schedule = PipelineEngine._exec_schedule
    _INSTRUCTION_MAP = {cls: _record(cls.__name__) for cls in (
        schedule.OptimizerStep, schedule.ReduceGrads, schedule.ReduceTiedGrads, schedule.LoadMicroBatch,
        schedule.ForwardPass, schedule.BackwardPass, schedule.SendActivation, schedule.RecvActivation,
        schedule.SendGrad, schedule.RecvGrad)}  # fmt: skip

    def __init__(self, stage: int, stages: int, micro_batches: int, schedule_class=schedule.TrainSchedule):
        self.stage_id, self.num_stages, self.micro_batches = stage, stages, micro_batches
        self.schedule_class, self.executed = schedule_class, []

    def _reserve_pipe_buffers(self, num_buffers):
        pass

    def train_batch(self, data_iter=None):
        self._exec_schedule(self.schedule_class(micro_batches=self.micro_batches, stages=self.num_stages,
                                                stage_id=self.stage_id))  # fmt: skip
        return 1.0

    def eval_batch(self, data_iter=None):
        self._exec_schedule(schedule.InferenceSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                                       stage_id=self.stage_id))  # fmt: skip


class GatedSetGPU(SimulatedGPU):
    """A simulated GPU whose set call blocks until ``gate`` opens, recording the calling threads and the calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.threads, self.finished = threading.Event(), [], []

    def apply(self, setting):
        self.threads.append(threading.get_ident())
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the gate never opened")
        self.finished.append(setting)
        super().apply(setting)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("timed out")


@pytest.fixture(scope="module")
def table():
    return make_table(stages=3, micro_batches=5, max_slowdown=0.03)[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_pass_asks_for_its_stages_clock_in_1f1b_order_without_waiting(table, stage):
    """The first set call (the clock asked for on entering) blocks until the test opens the gate, after three
    whole iterations: had a pass waited for a clock change, the iterations could not have finished first."""
    engine = Engine(stage, 3, 5)
    gpu = GatedSetGPU(H100, noise=False)
    plan = stage_schedule(table, stage)
    with PipelineRuntime(engine, table=table, backend=gpu) as runtime:
        try:
            _wait_for(lambda: gpu.threads)  # the worker is inside the set call
            for _ in range(3):
                engine.train_batch()
            assert runtime.requested == [tuple(plan)] * 3  # every pass's setting, in the stage's 1F1B order
            assert gpu.finished == [] and threading.get_ident() not in gpu.threads
            passes = plan * 3
            # The first pass's clock is asked for on entering, then one request wherever the clock changes.
            assert runtime.switches == sum(a != b for a, b in zip(passes, passes[1:])) > 0
            assert runtime._worker.requests.qsize() == runtime.switches  # queued behind the stuck call
        finally:
            gpu.gate.set()
    assert gpu.finished[-1] == plan[-1]  # the worker drained the queue to the latest request
    assert engine.executed.count("ForwardPass") == engine.executed.count("BackwardPass") == 3 * 5
    assert "_INSTRUCTION_MAP" not in engine.__dict__ and "train_batch" not in engine.__dict__  # unhooked


def test_the_hooks_are_the_engine_instances_own(table):
    hooked, other = Engine(0, 3, 5), Engine(0, 3, 5)
    class_map = dict(Engine._INSTRUCTION_MAP)
    with PipelineRuntime(hooked, table=table, backend=SimulatedGPU(H100)) as runtime:
        other.train_batch()  # not hooked: asks for nothing
        assert runtime.requested == [] and Engine._INSTRUCTION_MAP == class_map
        assert hooked._INSTRUCTION_MAP is not Engine._INSTRUCTION_MAP
        hooked.eval_batch()  # an evaluation's forward passes are not the plan's
        assert runtime.requested == []
        hooked.train_batch()
        assert runtime.requested == [tuple(stage_schedule(table, 0))]
    assert Engine._INSTRUCTION_MAP == class_map


@pytest.mark.slow
def test_another_micro_batch_count_follows_the_re_planned_schedule(table):
    engine = Engine(1, 3, 6)
    with PipelineRuntime(engine, table=table, backend=SimulatedGPU(H100)) as runtime:
        engine.train_batch()
        engine.micro_batches = 5  # DeepSpeed's set_train_batch_size changes it between iterations
        engine.train_batch()
    assert runtime.requested == [tuple(pipeline_schedules(table, 6)[1]), tuple(stage_schedule(table, 1))]


def test_an_engine_out_of_step_with_the_plan_is_stopped(table):
    """An engine that runs another schedule than 1F1B (here DeepSpeed's inference schedule inside train_batch: all
    forwards, no backward) is stopped at the first pass the plan does not expect."""
    engine = Engine(0, 3, 5, schedule_class=schedule.InferenceSchedule)
    with pytest.raises(FreqoptError, match=r"stage 0: the engine ran a forward pass as pass 4 of a training iteration "
                                           r"where DeepSpeed's 1F1B schedule of 3 stages and 5 micro-batches has "
                                           r"B0@s0; the pipeline runtime is out of step"):  # fmt: skip
        with PipelineRuntime(engine, table=table, backend=SimulatedGPU(H100)):
            engine.train_batch()
    assert "train_batch" not in engine.__dict__


def test_refusals(table):
    with pytest.raises(ClockTableError, match="plans a pipeline of 3 stages, not 4: .*layout pp=4.*'instruction'"):
        PipelineRuntime(Engine(0, 4, 5), table=table, backend=SimulatedGPU(H100))
    from freqopt.tables import ClockTable

    iteration = ClockTable({"granularity": "iteration", "entries": []}, source="it.json")
    with pytest.raises(ClockTableError, match="it.json is a table of granularity 'iteration'; a pipeline .* applies an "
                                              "instruction-level table"):  # fmt: skip
        PipelineRuntime(Engine(0, 3, 5), table=iteration, backend=SimulatedGPU(H100))
    with pytest.raises(InvalidSettingError, match="engine must be a DeepSpeed PipelineEngine .*, not object"):
        PipelineRuntime(object(), table=table, backend=SimulatedGPU(H100))


def test_no_table_keeps_the_default_clocks(table):
    engine = Engine(2, 3, 5)
    gpu = GatedSetGPU(H100)
    gpu.gate.set()
    with PipelineRuntime(engine, table=None, backend=gpu) as runtime:
        engine.train_batch()
    assert runtime.requested == [(DEFAULT_SETTING,) * 10] and runtime.switches == 0 and gpu.finished == [DEFAULT_SETTING]


def test_the_gpu_is_restored_on_success_and_on_an_exception(table, fake_gpu):
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    plan = stage_schedule(table, 0)
    for fail in (False, True):
        engine = Engine(0, 3, 5)
        backend = NVMLBackend(open_devices()[0], torch_device="cpu")
        with pytest.raises(RuntimeError) if fail else _nothing():
            with PipelineRuntime(engine, table=table, backend=backend) as runtime:
                engine.train_batch()
                engine.train_batch()
                if fail:
                    raise RuntimeError("training failed")
        assert not runtime._thread.is_alive() and runtime._worker.error is None
        locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
        assert locks and set(locks) <= {s.sm_clock_mhz for s in plan}
        gpu = fake_gpu.gpus[0]
        assert (gpu.locked_sm_mhz, gpu.locked_mem_mhz, gpu.power_limit_mw) == (None, None, 650_000)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_set_call_that_fails_stops_training_at_the_next_pass(table):
    class FailingGPU(SimulatedGPU):
        def apply(self, setting):
            raise InvalidSettingError("the GPU refused the clock")

    engine = Engine(0, 3, 5)
    runtime = PipelineRuntime(engine, table=table, backend=FailingGPU(H100))
    with pytest.raises(InvalidSettingError, match="the GPU refused the clock"):
        with runtime:
            _wait_for(lambda: runtime._worker.error is not None)  # the entry request failed on the worker
            engine.train_batch()


def test_the_simulated_step_is_the_simulated_pipeline_at_the_requested_clocks(table):
    """step_measurement: the iteration the search validates on (SimulatedPipeline, noiseless, switches landing one
    latency late) with this rank's requested clocks and the table's on the others, stage by stage in 1F1B order;
    the latency counts (the same clocks landing at once give another iteration), and the table's clocks save
    energy against the default ones."""
    from freqopt.pipeline.sim import SimulatedPipeline

    workload = get_workload("gpt3-small", micro_batch_size=1, seq_len=16, layout=Layout(pp=3))
    traces = trace_pipeline_stages(workload)
    sim = SimulatedGPU(H100, noise=False)
    engine = Engine(1, 3, 5)
    with PipelineRuntime(engine, table=table, backend=sim, stage_traces=traces) as runtime:
        engine.train_batch()
        with_table = runtime.step_measurement()
        runtime.use_table = False
        engine.train_batch()
        default = runtime.step_measurement()
    pipeline = SimulatedPipeline(traces, H100, 5, noise=False)
    schedules = pipeline_schedules(table)
    position, per_instruction = [0, 0, 0], []
    for inst in pipeline.dag.instructions:
        per_instruction.append(schedules[inst.stage][position[inst.stage]])
        position[inst.stage] += 1
    expected = pipeline.true_run(per_instruction)
    assert (with_table.time_s, with_table.energy_j) == pytest.approx((expected.time_s, expected.energy_j), rel=1e-12)
    at_once = pipeline.true_run(per_instruction, switching=False)
    assert (at_once.time_s, at_once.energy_j) != pytest.approx((expected.time_s, expected.energy_j), rel=1e-9)
    assert default.energy_j > with_table.energy_j
    assert runtime.requested[1] == (DEFAULT_SETTING,) * 10
    with pytest.raises(TypeError, match="for the simulated backend with stage_traces"):
        PipelineRuntime(Engine(1, 3, 5), table=table, backend=sim).step_measurement()
    assert {s.sm_clock_mhz for s in stage_schedule(table, 1)} != {ClockSetting().sm_clock_mhz}


@pytest.mark.slow
def test_a_straggler_follower_moves_the_engine_to_the_plan_that_ends_with_the_straggler(table):
    """straggler_schedules: the table's own plan first, then slower plans of the same fronts, each predicted to
    fit its slowdown and to take less energy (the planner's own figures); a StragglerFollower over them, told the
    slowest pipeline is 1.2x this one, makes follow() run the 1.2x plan from the next iteration, whose simulated
    step then ends within 1.2x and takes less energy; when the straggler recovers it is the table's plan again.
    compute_time_s is the iteration's time up to DeepSpeed's ReduceGrads, measured on the host here."""
    from freqopt.apply.pipeline_runtime import straggler_schedules
    from freqopt.apply.torch_pipeline_runtime import StragglerFollower

    plans = straggler_schedules(table, slowdowns=(0.1, 0.2))
    assert [len(p[1]) for p in plans] == [3, 3] + [3] and plans[0][1] == pipeline_schedules(table)
    own_s = plans[0][0]
    assert own_s < plans[1][0] <= 1.1 * own_s * (1 + 1e-9) < plans[2][0] <= 1.2 * own_s * (1 + 1e-9)
    assert plans[2][1] != plans[1][1] != plans[0][1]

    pace = {"max": 0.0}  # the other pipelines' slowest report
    follower = StragglerFollower(plans, every_n_steps=2, reduce_max=lambda mine: max(mine, pace["max"]))
    workload = get_workload("gpt3-small", micro_batch_size=1, seq_len=16, layout=Layout(pp=3))
    engine = Engine(1, 3, 5)
    steps = []
    with PipelineRuntime(engine, table=table, backend=SimulatedGPU(H100, noise=False),
                         stage_traces=trace_pipeline_stages(workload)) as runtime:  # fmt: skip
        assert runtime.compute_time_s is None
        for step in range(8):
            engine.train_batch()
            steps.append((runtime.requested[-1], runtime.step_measurement()))
            assert runtime.compute_time_s > 0
            pace["max"] = 1.2 * steps[0][1].time_s if 2 <= step < 5 else 0.0  # a straggler for steps 2-4
            chosen = follower.step_done(steps[-1][1].time_s)  # this pipeline's own (simulated) time
            if chosen is not None:
                runtime.follow(chosen)
    table_plan, slow_plan = tuple(plans[0][1][1]), tuple(plans[2][1][1])
    # Reductions after steps 1, 3, 5, 7: the straggler is seen at step 3's (steps 4-5 follow it), gone at step 5's.
    assert [r for r, _ in steps] == [table_plan] * 4 + [slow_plan] * 2 + [table_plan] * 2
    fast, slow = steps[0][1], steps[4][1]
    assert slow.time_s <= 1.2 * fast.time_s and slow.energy_j < fast.energy_j
    with pytest.raises(InvalidSettingError, match="schedules must hold 3 lists"):
        runtime.follow(plans[0][1][:2])
    with pytest.raises(InvalidSettingError, match="slowdowns must be fractions > 0"):
        straggler_schedules(table, slowdowns=(-0.1,))
