"""A pipeline-parallel training iteration as S simulated GPUs run it: DeepSpeed's 1F1B schedule (or one of
torch.distributed.pipelining's: SimulatedPipeline's ``schedule``, freqopt.pipeline.schedules), P2P waits and the power
each GPU draws while it waits.

One simulated GPU (freqopt.gpu.backends.simulated.SimulatedGPU, its physics) per pipeline stage runs that stage's
instructions (freqopt.pipeline.dag: the forward or backward of one micro-batch; DeepSpeed's non-interleaved 1F1B
``TrainSchedule``) in the stage's order. An instruction is its stage's forward or backward kernels for one
micro-batch (freqopt.workload.pipeline_trace.StageTrace), P2P receives and sends included and timed as the physics
times any collective (a group of two: bytes over the link plus its latency). It is issued as a training step issues
its kernels (``SimulatedGPU.run`` with ``loop=False``: from an idle GPU, host gaps included, the power limit
averaged over its own control windows), so its time and energy at one clock are exactly what
``SimulatedGPU.measure_schedule`` measures for its kernels at that clock: what the instruction-level search measures.

Timeline. Every instruction starts when its DAG predecessors have finished (``PipelineDAG``'s edges: the stage's own
order, the activations from the previous stage, the gradients from the next), so the iteration's instructions end
at the DAG's critical path. Then, once per iteration, each stage runs its optimizer step (``optimizer_step``): the
mixed-precision AdamW of freqopt.workload.models.ops over the stage's parameters, after a barrier at which every
stage has finished its last backward, because DeepSpeed clips the gradients' global norm (``gradient_clipping``,
GPT-3's 1.0), whose squared norm is all-reduced over the model-parallel group, pipeline stages included
(deepspeed.runtime.utils.clip_grad_norm_ with the PipelineParallelGrid's model-parallel group). The iteration ends
when the last stage finishes its step (DeepSpeed's ``train_batch`` then broadcasts the loss from the last stage to
every stage, another barrier), and the next one starts on every stage at once.

Clocks. Each instruction has a setting (an SM clock; the memory clock and power limit stay at the default). When an
instruction's setting differs from the one its stage asked for last, the runtime asks for it at the instruction's
start, without blocking; one runtime thread per stage serves the requests one at a time, each set call taking
``spec.nvml_call_s`` (SetCallQueue: a request waits while the thread is busy, and one still waiting when a newer one
comes is dropped), and a request lands ``spec.clock_switch_s`` after its call starts (SimulatedGPU's switch
latency): until then the GPU keeps the clock it had; a kernel runs at the clock in force when it starts (as
SimulatedGPU._delayed). The measured iteration is the second of two run back to back, so it starts
with the clocks (and switches in flight) the plan leaves at the end of an iteration, as in steady training.
``switching=False`` lands every request at once (the free-switching ideal).

Blocked power. A GPU that is not running an instruction or its optimizer step (waiting on a P2P receive, in the
pipeline's bubbles, at the barriers, until the iteration ends) spins in a NCCL receive kernel that has received
nothing yet: no FLOPs and no bytes, so it draws the GPU's waiting power at the clock in force
(freqopt.gpu.backends.physics.waiting_power_w, ``blocked_power_w``): static plus clock-dependent power. Perseus
measured this power on P2P-blocked GPUs, 83.64 W on an A100 SXM and 70.38 W on an A40 (Chung et al., SOSP'24;
github.com/ml-energy/zeus, branch ``kronos``, lowtime/scripts/perseus.py), which the A100's and A40's GPU files
take as their waiting power at the highest clocks; how much of it falls at a lower clock is
a range (freqopt.gpu.specs.WaitingPower). ``perseus_blocking_power_w`` returns Perseus's constants for the
planner's accounting, which experiments/pipeline/report.md compares. The energy of an iteration is every GPU's
instructions and optimizer step plus its blocked power over the rest of the iteration: with a constant blocked
power and no optimizer step this is Perseus's accounting (PipelineDAG.iteration_energy_j).

Measurements. ``run`` measures one iteration as a real pipeline's would be: each GPU's energy counter carries the
noise of a reading (SimulatedGPU's ENERGY_NOISE_REL, independently per GPU) and the iteration's time that of a
timing (TIME_NOISE_REL), drawn from the seed, the measurement's key and settings and its sample index, so a search
resumed from its storage draws the same noise. ``true_run`` is the noiseless iteration.

Not modelled: the transfer's two ends are timed one after the other (the sender's send, then the receiver's receive,
each its bytes over the link: an upper bound by one transfer, 0.15 ms on an A100 for gpt3-xl's activations); the
data-parallel gradient all-reduce and the tied embedding's all-reduce between the first and last stage (DeepSpeed's
ReduceGrads and ReduceTiedGrads: on the layouts here, dp = 1, and the tied gradient moves 0.2 GB over NVLink in under
1 ms); the power limit's control window spanning an instruction's neighbours; the host's issue of the next
instruction overlapping the current one (each instruction is issued from an idle GPU); activation recomputation.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting, MeasurementProtocol
from freqopt.gpu.backends.physics import KernelPhysics
from freqopt.gpu.backends.simulated import ENERGY_NOISE_REL, TIME_NOISE_REL, SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.pipeline.dag import Instruction, PipelineDAG, schedule_dag
from freqopt.pipeline.profile import MEASURED_BLOCKING_POWER_W
from freqopt.pipeline.runs import PipelineRun, StageRun
from freqopt.pipeline.schedules import stages_per_rank
from freqopt.pipeline.timeline import ClockTimeline
from freqopt.workload.kernels import Kernel

__all__ = ["SimulatedPipeline", "PERSEUS_BLOCKING_POWER_W", "perseus_blocking_power_w",
           "stage_optimizer_kernels"]  # fmt: skip

# P2P-blocking power Perseus measured (W), by GPU type: lowtime/scripts/perseus.py (ml-energy/zeus, branch kronos):
# "Raw P2P blocking power consumption, in Watts. A40: 70.38 W, A100: 83.64 W" (an A100 SXM, Chung et al. SOSP'24).
# The planner's default blocking power, the same figures (freqopt.pipeline.profile).
PERSEUS_BLOCKING_POWER_W = MEASURED_BLOCKING_POWER_W
OPTIMIZER = "optimizer"


def perseus_blocking_power_w(spec: GPUSpec) -> float | None:
    """The P2P-blocking power Perseus measured on this GPU type (W), or None where it measured none."""
    return PERSEUS_BLOCKING_POWER_W.get(spec.name)


def stage_optimizer_kernels(stage_trace) -> tuple[Kernel, ...]:
    """The kernels of one stage's optimizer step: freqopt's mixed-precision AdamW (the same step a whole iteration's
    trace holds: gradient-norm clipping, the fused AdamW, the copy back to BF16) over the stage's ``n_params``
    parameters (one rank's, tensor-parallel sharded), as one flat tensor: the multi-tensor kernels' bytes and FLOPs
    depend on the elements, not on how they are split. The squared norm is all-reduced over the stage's
    tensor-parallel ranks and the pipeline's stages (DeepSpeed's model-parallel group).

    Returns:
        Kernels with pass_name "optimizer", in issue order.
    """
    import torch

    from freqopt.workload.models.ops import MixedPrecisionAdamW
    from freqopt.workload.models.parallel import COMPUTE_STREAM, all_reduce
    from freqopt.workload.trace import KernelRecorder

    layout = stage_trace.workload.layout
    group = layout.tp * layout.pp
    with torch.device("meta"):
        param = torch.nn.Parameter(torch.empty(stage_trace.n_params, dtype=torch.bfloat16))  # (P,)
        param.grad = torch.empty_like(param)

    def reduce_norm(sq_norm):
        return all_reduce(sq_norm, group, layout.dp, COMPUTE_STREAM) if group > 1 else sq_norm

    optimizer = MixedPrecisionAdamW([param], reduce_sq_norm=reduce_norm)
    recorder = KernelRecorder(None, warn=False)
    recorder.pass_name = OPTIMIZER
    with recorder:
        optimizer.step()
    return tuple(recorder.kernels)


class SimulatedPipeline:
    """S simulated GPUs running a pipeline iteration (module docstring): DeepSpeed's 1F1B, or one of
    torch.distributed.pipelining's schedules (``schedule``, freqopt.pipeline.schedules), the instructions of several
    model stages per GPU where the schedule interleaves them.

    Args:
        stage_traces: one StageTrace per stage, stage 0 first (freqopt.workload.pipeline_trace).
        spec: the GPU type of every stage; its ``clock_switch_s`` is read at each run (so
            freqopt.gpu.backends.base.switch_latency and GPUSpec.with_switch_latency apply).
        micro_batches: M, micro-batches per iteration (DeepSpeed's gradient_accumulation_steps).
        seed: seeds the measurement noise.
        noise: False makes ``run`` noiseless (``true_run``).
        optimizer_step: run each stage's optimizer step after the last backward (module docstring); False ends the
            iteration at the instructions' critical path.
        protocol: warm-up and window of a measurement (its GPU-second cost).
        blocked_power_w: a constant blocked power (W) at every clock in place of the physics' (e.g. Perseus's
            measured PERSEUS_BLOCKING_POWER_W), to see how much a figure depends on it; None: the physics'.
        schedule, virtual_stages: the schedule (freqopt.pipeline.dag.SCHEDULES) and, for the looped ones, its
            model stages per GPU; ``stage_traces`` then holds one trace per model stage (S x v: trace_pipeline_stages
            with model_stages), and the zero-bubble schedules run each backward as its input and weight gradients
            (StageTrace.pass_kernels, split_backward). ``stages`` is the model stages, ``gpus`` the GPUs.
        switch_stall_s: how long (s) the GPU stalls when a clock switch lands while it runs an instruction (drawing
            its blocked power), for a sensitivity check: whether a transition pauses the SMs is not in the sources
            (search_spaces/*.toml, [actuation]); 0 (default): the kernels run on at the new clock at once. A switch
            landing while the GPU waits costs nothing extra.

    Raises:
        InvalidSettingError: no stage traces, traces of stages that do not make one pipeline, a non-positive
            micro_batches.
    """

    def __init__(self, stage_traces: Sequence, spec: GPUSpec, micro_batches: int, *, seed: int = 0,
                 noise: bool = True, optimizer_step: bool = True, protocol: MeasurementProtocol | None = None,
                 blocked_power_w: float | None = None, switch_stall_s: float = 0.0, schedule: str = "1f1b",
                 virtual_stages: int | None = None):  # fmt: skip
        check_positive_int("micro_batches", micro_batches)
        if not (isinstance(switch_stall_s, (int, float)) and math.isfinite(switch_stall_s) and switch_stall_s >= 0):
            raise InvalidSettingError(f"switch_stall_s must be a finite number of seconds >= 0, not {switch_stall_s!r}",
                                      argument="switch_stall_s")  # fmt: skip
        self.switch_stall_s = float(switch_stall_s)
        traces = list(stage_traces)
        if not traces:
            raise InvalidSettingError("stage_traces is empty; trace the stages with trace_pipeline_stages",
                                      argument="stage_traces")  # fmt: skip
        if [t.index for t in traces] != list(range(len(traces))) or any(t.stage.stages != len(traces) for t in traces):
            raise InvalidSettingError("stage_traces must be one StageTrace per stage of one pipeline, stage 0 first",
                                      argument="stage_traces")  # fmt: skip
        per_gpu = stages_per_rank(schedule, virtual_stages)
        if len(traces) % per_gpu:
            raise InvalidSettingError(f"stage_traces: schedule {schedule} runs {per_gpu} model stages per GPU; trace "
                                      f"a multiple of {per_gpu} stages (trace_pipeline_stages(model_stages=))",
                                      argument="stage_traces")  # fmt: skip
        self.stage_traces = traces
        self.spec = spec
        self.micro_batches = micro_batches
        self.stages = len(traces)  # model stages (1F1B: one per GPU)
        self.gpus = len(traces) // per_gpu
        self.schedule, self.virtual_stages = schedule, virtual_stages
        self.seed = seed
        self.noise = noise
        self.optimizer_step = optimizer_step
        self.protocol = protocol or MeasurementProtocol()
        if blocked_power_w is not None and not (math.isfinite(blocked_power_w) and blocked_power_w >= 0):
            raise InvalidSettingError(f"blocked_power_w must be a finite number of watts >= 0, not {blocked_power_w!r}",
                                      argument="blocked_power_w")  # fmt: skip
        self.constant_blocked_power_w = blocked_power_w
        self.dag: PipelineDAG = schedule_dag(schedule, self.gpus, micro_batches, virtual_stages=virtual_stages)
        self._gpu = SimulatedGPU(spec, noise=False)
        # Each model stage's instruction kernels by kind; each GPU's optimizer step (its model stages' together).
        self._kernels: dict[tuple[int, str], tuple[Kernel, ...]] = {
            (s, kind): t.pass_kernels(kind) for s, t in enumerate(traces) for kind in self.dag.kinds}
        if optimizer_step:
            for g in range(self.gpus):
                self._kernels[(g, OPTIMIZER)] = tuple(
                    k for s, t in enumerate(traces) if self.dag.stage_gpus[s] == g for k in stage_optimizer_kernels(t))
        self._arrays: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._repeats: dict[tuple, int] = defaultdict(int)

    # -- what each stage runs ----------------------------------------------------------------------------------
    def instruction_kernels(self, stage: int, kind: str) -> tuple[Kernel, ...]:
        """The kernels of one instruction of ``stage`` (kind "forward" or "backward"; "optimizer": its optimizer
        step), in issue order."""
        return self._kernels[(stage, kind)]

    def _prefix(self, stage: int, kind: str, setting: ClockSetting) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of the kernels' times (s) and energies (J) at ``setting``, shape (K + 1,) each."""
        self._check_physics()
        key = (stage, kind, setting)
        arrays = self._arrays.get(key)
        if arrays is None:
            kernels = self._kernels[(stage, kind)]
            if not kernels:  # e.g. a stage without weights' backward_weight: an instruction of no time
                self._arrays[key] = (np.zeros(1), np.zeros(1))
                return self._arrays[key]
            t, e, _ = self._gpu.run(kernels, [setting] * len(kernels), loop=False)
            arrays = (np.concatenate([[0.0], np.cumsum(t)]), np.concatenate([[0.0], np.cumsum(e)]))
            self._arrays[key] = arrays
        return arrays

    def instruction_cost(self, stage: int, kind: str, setting: ClockSetting | int | None = None) -> tuple[float, float]:
        """(time_s, energy_j) of one instruction of ``stage`` at one setting throughout (noiseless): what
        SimulatedGPU.measure_schedule gives its kernels without noise."""
        t, e = self._prefix(stage, kind, _setting(setting))
        return float(t[-1]), float(e[-1])

    def blocked_power_w(self, setting: ClockSetting | int | None = None) -> float:
        """The power (W) a blocked GPU draws at ``setting``'s SM clock (default: the highest): a NCCL receive that
        has received nothing (no FLOPs, no bytes), i.e. the GPU's waiting power at that clock
        (freqopt.gpu.backends.physics.waiting_power_w; module docstring); the constant given as ``blocked_power_w``, if one was."""
        setting = _setting(setting)
        if self.constant_blocked_power_w is not None:
            return float(self.constant_blocked_power_w)
        self._check_physics()
        key = ("blocked", setting)
        if key not in self._arrays:
            setting.check_supported(self.spec)
            waiting = Kernel(name="freqopt.recv", kind="recv", pass_name="forward", flops=0.0, mem_bytes=0.0,
                             dtype="bfloat16", shapes=(), comm_bytes=0.0, group_size=2)  # fmt: skip
            sm, mem = self.spec.resolve_clocks(setting.sm_clock_mhz, setting.mem_clock_mhz)
            physics = KernelPhysics(self.spec, [waiting], np.asarray([mem], dtype=float))
            self._arrays[key] = float(physics.wait_power_w[0, self.spec.sm_clocks_mhz.index(sm)])
        return self._arrays[key]

    def _check_physics(self) -> None:
        """Drop the cached kernel times when ``spec`` was replaced by a GPU type of other physics (a replaced
        switch latency alone keeps them: it does not change a kernel's time at a clock)."""
        if self.spec is self._gpu.spec:
            return
        if dataclasses.replace(self.spec, clock_switch_s=0.0) != dataclasses.replace(self._gpu.spec, clock_switch_s=0.0):
            self._arrays.clear()
        self._gpu.spec = self.spec

    # -- settings ----------------------------------------------------------------------------------------------
    def settings_of(self, settings) -> list[ClockSetting]:
        """One ClockSetting per instruction (dag.instructions order) from: None (the defaults); one setting or SM
        clock (MHz) for every instruction; a sequence of N settings or SM clocks (None: default); or a mapping
        (stage, kind) -> setting or SM clock (every micro-batch alike; missing keys keep the default).

        Raises:
            InvalidSettingError: a sequence of another length, a clock or setting this GPU type does not support.
        """
        n = self.dag.n
        if settings is None or isinstance(settings, (ClockSetting, int)):
            out = [_setting(settings)] * n
        elif isinstance(settings, Mapping):
            out = [_setting(settings.get((i.stage, i.kind))) for i in self.dag.instructions]
        else:
            out = [_setting(s) for s in settings]
            if len(out) != n:
                raise InvalidSettingError(f"settings has {len(out)} entries, not one per instruction ({n}: "
                                          f"{self.stages} stages x {self.micro_batches} micro-batches x "
                                          f"{len(self.dag.kinds)} kinds)", argument="settings")  # fmt: skip
        for s in dict.fromkeys(out):
            s.check_supported(self.spec)
        return out

    # -- the iteration -----------------------------------------------------------------------------------------
    def true_run(self, settings=None, *, switching: bool = True) -> PipelineRun:
        """The noiseless iteration with ``settings`` (settings_of); ``switching=False``: every clock lands at once."""
        per_instruction = self.settings_of(settings)
        latency = self.spec.clock_switch_s if switching else 0.0
        return self._simulate(per_instruction, latency)

    def run(self, settings=None, *, switching: bool = True, key: str = "", sample: int | None = None) -> PipelineRun:
        """Measure one iteration with ``settings`` (settings_of), with the noise of a real measurement unless the
        pipeline was made with ``noise=False`` (module docstring).

        Args:
            settings: per instruction (settings_of).
            switching: clock switches land ``spec.clock_switch_s`` after they are asked for (False: at once).
            key: names what is measured, so that its noise is reproducible.
            sample: which measurement of (key, settings, switching) this is, from 0; None counts this object's
                own calls.

        Returns:
            The iteration: time, energy and each stage's (noisy), the instructions' noiseless timeline, and the
            GPU-seconds the measurement took (S GPUs, each over the protocol's warm-up and window in whole
            iterations: MeasurementProtocol.cost_gpu_s).
        """
        per_instruction = self.settings_of(settings)
        true = self._simulate(per_instruction, self.spec.clock_switch_s if switching else 0.0)
        cost = self.gpus * self.protocol.cost_gpu_s(self.spec.energy_counter_period_s, true.time_s)
        if not self.noise:
            return _replace_cost(true, cost)
        ident = (key, tuple(per_instruction), switching)
        if sample is None:
            sample = self._repeats[ident]
        self._repeats[ident] = sample + 1
        digest = zlib.crc32(repr((key, _digest(per_instruction), switching, sample + 1)).encode())
        rng = np.random.default_rng([self.seed, digest])
        time_s = true.time_s * (1.0 + TIME_NOISE_REL * rng.standard_normal())
        stages = tuple(dataclasses.replace(r, energy_j=r.energy_j * (1.0 + ENERGY_NOISE_REL * rng.standard_normal()))
                       for r in true.stages)  # fmt: skip
        return dataclasses.replace(true, time_s=float(time_s), energy_j=float(sum(r.energy_j for r in stages)),
                                   stages=stages, cost_gpu_s=cost)  # fmt: skip

    def _simulate(self, settings: list[ClockSetting], latency_s: float) -> PipelineRun:
        dag, S = self.dag, self.gpus
        last = {}  # each GPU's setting at the end of the plan: in force when the first iteration starts
        for inst, setting in zip(dag.instructions, settings):
            last[dag.gpu_of(inst)] = setting
        call_s = self.spec.nvml_call_s if latency_s > 0 else 0.0  # free switching: no queue either
        lines = [ClockTimeline(last[s], call_s) for s in range(S)]
        result = None
        for iteration in range(2):  # the first sets the clocks (and switches in flight) the second starts with
            result = self._iteration(settings, lines, latency_s)
            for line in lines:
                line.shifted(result.time_s)
        return result

    def _iteration(self, settings: list[ClockSetting], lines: list[ClockTimeline], latency_s: float) -> PipelineRun:
        """One iteration on the clock timelines ``lines``. Its energy is not PipelineDAG.iteration_energy_j's
        arithmetic but the timeline's: each GPU's blocked power at the clock in force, integrated piece by piece
        between switch landings, plus switch stalls and the optimizer step (module docstring, "Blocked power"); with
        a constant blocked power, no optimizer step and no switching, it is the same accounting."""
        dag, S = self.dag, self.gpus
        n = dag.n
        start, end = np.zeros(n), np.zeros(n)
        energy = np.zeros(n)
        preds = dag.predecessors
        busy_until = [0.0] * S  # each stage's last end
        blocked_j = [0.0] * S
        blocked_s = [0.0] * S
        for j in dag.order:
            inst: Instruction = dag.instructions[j]
            s = dag.gpu_of(inst)
            p = preds[j]
            t0 = float(np.max(end[p])) if len(p) else 0.0
            t0 = max(t0, busy_until[s])
            self._block(s, lines[s], busy_until[s], t0, blocked_j, blocked_s)
            lines[s].request(t0, settings[j], latency_s)
            t1, e = self._execute(inst.stage, inst.kind, lines[s], t0)
            start[j], end[j], energy[j] = t0, t1, e
            busy_until[s] = t1
        instruction_end = max(busy_until)
        opt_j = [0.0] * S
        finish = list(busy_until)
        if self.optimizer_step:
            barrier = instruction_end
            for s in range(S):
                self._block(s, lines[s], busy_until[s], barrier, blocked_j, blocked_s)
                finish[s], opt_j[s] = self._execute(s, OPTIMIZER, lines[s], barrier)
        total = max(finish)
        stages = []
        inst_j = np.zeros(S)
        inst_s = np.zeros(S)
        for j, inst in enumerate(dag.instructions):
            inst_j[dag.gpu_of(inst)] += energy[j]
            inst_s[dag.gpu_of(inst)] += end[j] - start[j]
        for s in range(S):
            self._block(s, lines[s], finish[s], total, blocked_j, blocked_s)
            opt_s = finish[s] - (instruction_end if self.optimizer_step else finish[s])
            stage_energy = inst_j[s] + opt_j[s] + blocked_j[s]
            stages.append(StageRun(stage=s, busy_s=float(inst_s[s] + opt_s), blocked_s=float(blocked_s[s]),
                                   instruction_energy_j=float(inst_j[s]), optimizer_energy_j=float(opt_j[s]),
                                   blocked_energy_j=float(blocked_j[s]), energy_j=float(stage_energy),
                                   n_switches=lines[s].n_requests))  # fmt: skip
        return PipelineRun(time_s=float(total), energy_j=float(sum(r.energy_j for r in stages)), stages=tuple(stages),
                           start_s=start, end_s=end, instruction_time_s=end - start, instruction_energy_j=energy)  # fmt: skip

    def _block(self, s: int, line: ClockTimeline, a: float, b: float, blocked_j: list, blocked_s: list) -> None:
        """Stage s blocked from a to b (s): its blocked power at the clock in force, piece by piece."""
        if b <= a:
            return
        i = line.index_at(a)
        t = a
        while t < b:
            nxt = line.times[i + 1] if i + 1 < len(line.times) else math.inf
            upto = min(b, nxt)
            blocked_j[s] += self.blocked_power_w(line.settings[i]) * (upto - t)
            t = upto
            i += 1
        blocked_s[s] += b - a

    def _execute(self, s: int, kind: str, line: ClockTimeline, t0: float) -> tuple[float, float]:
        """Run one instruction of model stage s (or, kind "optimizer", GPU s's optimizer step) on the GPU whose
        clock line is ``line``, from t0: each kernel at the clock in force when it starts. Returns (end time s,
        energy J)."""
        n_kernels = len(self._kernels[(s, kind)])
        i = line.index_at(t0)
        t, e, k = t0, 0.0, 0
        while k < n_kernels:
            pt, pe = self._prefix(s, kind, line.settings[i])
            nxt = line.times[i + 1] if i + 1 < len(line.times) else math.inf
            # Kernels k.. start at t + pt[j] - pt[k]; those starting before the next landing run at this setting.
            stop = n_kernels if nxt == math.inf else int(np.searchsorted(pt[:n_kernels], nxt - t + pt[k], side="left"))
            stop = max(stop, k)
            t += pt[stop] - pt[k]
            e += pe[stop] - pe[k]
            k = stop
            if k < n_kernels:  # a switch lands mid-instruction: the GPU stalls (switch_stall_s) before going on
                i += 1
                t += self.switch_stall_s
                e += self.blocked_power_w(line.settings[i]) * self.switch_stall_s
        return t, e


def _setting(value) -> ClockSetting:
    """A ClockSetting from a setting, an SM clock in MHz, or None (the default)."""
    if value is None:
        return DEFAULT_SETTING
    if isinstance(value, ClockSetting):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return ClockSetting(sm_clock_mhz=int(value))
    raise InvalidSettingError(f"settings must hold ClockSettings, SM clocks in MHz or None, not {value!r}",
                              argument="settings")  # fmt: skip


def _digest(settings: list[ClockSetting]) -> str:
    import hashlib

    return hashlib.sha1(repr(tuple(settings)).encode()).hexdigest()[:16]


def _replace_cost(run: PipelineRun, cost_gpu_s: float) -> PipelineRun:
    return dataclasses.replace(run, cost_gpu_s=cost_gpu_s)
