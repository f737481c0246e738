"""A pipeline search's instruction studies shared with ``freqopt worker`` processes.

The instruction level's fronts are one Optuna study per (model stage, instruction kind) (freqopt.pipeline.search,
"Instruction level"); the studies do not couple, so they can run on as many GPUs at once. With a persistent storage
(anything but None or Optuna's in-memory storage) the leader publishes the pipeline as a job, under the study-name
prefix of its fronts (fronts_prefix): the workload, the GPU type and its switch latency, the seed, the partition,
the schedule and the micro-batch count, which rebuild the same simulated pipeline in another process. Each study becomes an item of a queue study (freqopt.search.workers.UnitQueue, the one-GPU
search's: exclusive claims, heartbeats, a lost owner's item failed and resumed by the leader). The leader claims and
runs items as the workers do; once none is left or held by a live owner, it reads every study back in order.

A study is the same whoever runs it (its trials seeded by index, the simulated noise by sample, every measurement
logged once: freqopt.search.journal), so the fronts, and the plans and tables made from them, do not depend on how
many workers joined, and no measurement is taken twice. The pipeline search runs on the simulated GPU only: each
worker measures on a simulated GPU of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from freqopt.errors import StorageError
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import GPUSpec
from freqopt.pipeline.config import PipelineSearchConfig
from freqopt.pipeline.dag import ALL_KINDS, PipelineDAG
from freqopt.pipeline.sim import SimulatedPipeline
from freqopt.search.study import UnitSearch, search_unit
from freqopt.search.workers import (UnitQueue, UnitWork, WorkerReport, finish_job, is_persistent, publish_job_doc,
                                    serve)  # fmt: skip

__all__ = ["PIPELINE_JOB", "pipeline_study_prefix", "fronts_prefix", "instruction_keys", "SharedStudies",
           "share_instruction_studies", "instruction_studies", "pipeline_job", "pipeline_from_job", "serve_pipeline"]

PIPELINE_JOB = "pipeline"  # the job's "kind": a pipeline search's instruction studies (a one-GPU search's has none)
GRANULARITY = "instruction"


def pipeline_study_prefix(workload, spec: GPUSpec, partition_method: str, seed: int) -> str:
    """A study-name prefix unique to the workload (model, sizes, micro-batch, layout), the stages' partition, the GPU
    type (all its constants, the switch latency included) and the seed; not the micro-batch count, which only the
    iteration level's and the validations' names hold (the instruction fronts do not depend on it)."""
    ident = f"{workload.model}|{workload.config}|{workload.micro_batch_size}|{workload.layout!r}|{partition_method}|{spec!r}|{seed}"
    layout = workload.layout
    return (f"{workload.model}-dp{layout.dp}tp{layout.tp}pp{layout.pp}-{spec.name}-"
            f"{hashlib.sha1(ident.encode()).hexdigest()[:8]}")


def fronts_prefix(workload, spec: GPUSpec, partition_method: str, seed: int, model_stages: int) -> str:
    """The instruction studies' name prefix: pipeline_study_prefix, marked ``-xN`` where the workload was traced as
    N model stages on fewer GPUs (a schedule with several stages per GPU: other instructions). It names the job
    ``freqopt worker`` processes join (freqopt.pipeline.workers)."""
    prefix = pipeline_study_prefix(workload, spec, partition_method, seed)
    return prefix if model_stages == workload.layout.pp else f"{prefix}-x{model_stages}"


def instruction_keys(dag: PipelineDAG) -> list[tuple[int, str]]:
    """The (model stage, instruction kind) of every instruction study, in the order the search runs and reads
    them: by stage, then forward, backward (ZB schedules: input and weight gradients)."""
    return sorted({(i.stage, i.kind) for i in dag.instructions}, key=lambda key: (key[0], ALL_KINDS.index(key[1])))


def instruction_work(prefix: str, spec: GPUSpec, config: PipelineSearchConfig) -> UnitWork:
    """What every instruction study is given, whoever runs it: a whole-step study (each measurement the
    instruction's kernels as the pipeline issues them) at the GPU's highest memory clock, slack 3x the budget (at
    least 5 %)."""
    return UnitWork(prefix=prefix, granularity=GRANULARITY, space="clocks", n_trials=config.n_trials,
                    finalist_repeats=config.finalist_repeats, finalist_slowdown=max(0.05, 3 * config.max_slowdown),
                    seed=config.seed, whole_step=True, mem_clock_mhz=spec.max_mem_clock_mhz)  # fmt: skip


def _run_study(pipeline: SimulatedPipeline, gpu: SimulatedGPU, work: UnitWork, key: tuple[int, str],
               storage) -> UnitSearch:  # fmt: skip
    """Run, resume or read back the study of one (stage, kind)."""
    stage, kind = key
    unit = f"stage{stage}.{kind}"
    return search_unit(gpu, pipeline.instruction_kernels(stage, kind), name=unit,
                       study_name=f"{work.prefix}-{work.granularity}-{unit}", storage=storage, space=work.space,
                       n_trials=work.n_trials, finalist_repeats=work.finalist_repeats,
                       finalist_slowdown=work.finalist_slowdown, seed=work.seed, whole_step=work.whole_step,
                       mem_clock_mhz=work.mem_clock_mhz)  # fmt: skip


def pipeline_job(pipeline: SimulatedPipeline, spec: GPUSpec, config: PipelineSearchConfig,
                 partition_method: str) -> dict:  # fmt: skip
    """What a worker needs to rebuild ``pipeline``'s instructions (JSON-serializable)."""
    w = pipeline.stage_traces[0].workload
    return {"kind": PIPELINE_JOB, "model": w.model, "config": dataclasses.asdict(w.config),
            "micro_batch_size": w.micro_batch_size, "layout": w.layout.to_kwargs(), "gpu": spec.name,
            "backend": "sim", "seed": config.seed, "clock_switch_s": spec.clock_switch_s,
            "partition_method": partition_method, "model_stages": pipeline.stages,
            "micro_batches": pipeline.micro_batches, "schedule": config.schedule,
            "virtual_stages": config.virtual_stages}  # fmt: skip


def pipeline_from_job(job: dict) -> tuple[SimulatedPipeline, GPUSpec, str]:
    """The leader's simulated pipeline, traced again from its job (pipeline_job).

    Returns:
        (the pipeline, its GPU type with the search's switch latency, the fronts' study-name prefix).
    """
    from freqopt.gpu.specs import get_gpu
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import Workload, config_from_dict
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    workload = Workload(job["model"], config_from_dict(job["model"], job["config"]), job["micro_batch_size"],
                        Layout(**job["layout"]))  # fmt: skip
    spec = get_gpu(job["gpu"]).with_switch_latency(job["clock_switch_s"])
    stage_traces = trace_pipeline_stages(workload, partition_method=job["partition_method"],
                                         model_stages=job["model_stages"])  # fmt: skip
    pipeline = SimulatedPipeline(stage_traces, spec, job["micro_batches"], seed=job["seed"], schedule=job["schedule"],
                                 virtual_stages=job["virtual_stages"])  # fmt: skip
    return pipeline, spec, fronts_prefix(workload, spec, job["partition_method"], job["seed"], pipeline.stages)


@dataclass(frozen=True)
class SharedStudies:
    """A pipeline search's instruction studies, published for workers (share_instruction_studies).

    Attributes:
        queue: the queue study of one item per (stage, kind), instruction_keys order.
        resumed: whether the storage held this job already (a resumed search: what is read back is an earlier
            run's); False: a new one, whose read-back measurements are its workers'.
    """

    queue: UnitQueue
    resumed: bool


def share_instruction_studies(pipeline: SimulatedPipeline, spec: GPUSpec, config: PipelineSearchConfig, prefix: str,
                              storage, *, partition_method: str) -> SharedStudies | None:  # fmt: skip
    """Publish the pipeline as a job and its instruction studies as a queue, so that workers rebuild the pipeline
    and take studies while this process validates the default iteration and searches the iteration level (module
    docstring). None where ``storage`` is not persistent (nothing to share).

    Args:
        pipeline, spec, config: the search's simulated pipeline, GPU type and settings.
        prefix: the fronts' study-name prefix (fronts_prefix): the job's name, which workers join by.
        storage: the opened Optuna storage, None for in memory.
        partition_method: how the stages were partitioned (the job's, for the workers' traces).
    """
    if not is_persistent(storage):
        return None
    resumed = publish_job_doc(storage, prefix, pipeline_job(pipeline, spec, config, partition_method))
    n = len(instruction_keys(pipeline.dag))
    return SharedStudies(UnitQueue.create(storage, instruction_work(prefix, spec, config), range(n), [()] * n), resumed)


def instruction_studies(pipeline: SimulatedPipeline, spec: GPUSpec, config: PipelineSearchConfig, prefix: str,
                        storage, shared: SharedStudies | None = None, *,
                        on_study: Callable[[int, int], None] | None = None) -> list[UnitSearch]:  # fmt: skip
    """Every instruction study of ``pipeline``, in instruction_keys order: run here, or, where ``shared``, claimed
    from its queue as the workers claim theirs and the workers' read back once none is left or held by a live
    worker (module docstring); the job is then marked done, which stops its workers.

    Args:
        pipeline, spec, config: the search's simulated pipeline, GPU type and settings.
        prefix: the fronts' study-name prefix (fronts_prefix).
        storage: the opened Optuna storage, None for in memory.
        shared: share_instruction_studies' handle, None to run every study here.
        on_study: called as on_study(done, total) after each study this process ran or read back.
    """
    work = instruction_work(prefix, spec, config)
    gpu = SimulatedGPU(spec, seed=config.seed)
    keys = instruction_keys(pipeline.dag)
    done: dict[int, UnitSearch] = {}

    def run(i: int) -> None:
        done[i] = _run_study(pipeline, gpu, work, keys[i], storage)
        if on_study is not None:
            on_study(len(done), len(keys))

    if shared is not None:
        while (claimed := shared.queue.claim()) is not None:
            with shared.queue.owning(claimed[1]):
                run(claimed[0])
        shared.queue.settle()  # the items workers hold: wait for them, or take them over if their worker is gone
    for i in range(len(keys)):  # the workers' studies read back (or resumed), in order
        if i not in done:
            run(i)
    if shared is not None:
        finish_job(storage, prefix)
    return [done[i] for i in range(len(keys))]


def serve_pipeline(storage, name: str, job: dict, *, idle_s: float, poll_s: float = 0.5,
                   on_unit: Callable[[str, str], None] | None = None,
                   on_ready: Callable[[GPUSpec], None] | None = None,
                   on_idle: Callable[[float], None] | None = None) -> WorkerReport:  # fmt: skip
    """Claim and run instruction studies of pipeline search ``name`` (its job: pipeline_job) until it is done, or
    until nothing was claimable for ``idle_s`` seconds, on a simulated GPU of this worker's own.

    Args:
        storage: the search's opened Optuna storage.
        name: the search's name (fronts_prefix; the job's study).
        job: its published job.
        idle_s, poll_s: give up after ``idle_s`` s with nothing to claim; look every ``poll_s`` s.
        on_unit: called as on_unit("instruction", study name) after each study this worker ran.
        on_ready: called as on_ready(spec) once the pipeline is rebuilt, before the first claim.
        on_idle: called as on_idle(idle_s) every 10 s with nothing to claim (freqopt.search.workers.serve).

    Raises:
        StorageError: this freqopt rebuilds another pipeline from the job (another version).
    """
    pipeline, spec, prefix = pipeline_from_job(job)
    if prefix != name:
        raise StorageError(f"this worker's pipeline differs from search {name!r}'s (another freqopt version?); run "
                           "the same freqopt as the search")  # fmt: skip
    if on_ready is not None:
        on_ready(spec)
    gpu = SimulatedGPU(spec, seed=job["seed"])
    keys = instruction_keys(pipeline.dag)

    def run_claimed(work: UnitWork, i: int, warm: Sequence) -> tuple[str, UnitSearch]:
        stage, kind = keys[i]
        return f"stage{stage}.{kind}", _run_study(pipeline, gpu, work, keys[i], storage)

    return serve(storage, name, None, gpu, idle_s=idle_s, poll_s=poll_s, on_unit=on_unit, run_claimed=run_claimed,
                 on_idle=on_idle)
