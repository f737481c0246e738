"""Join a running search from another process or machine: ``freqopt.worker.join_search(storage, name)`` claims
the search's tuning units (a pipeline search's: its instruction studies) from its shared Optuna storage and runs
their studies until the search is done (freqopt.search.workers holds the queue, freqopt.pipeline.workers a
pipeline's; one worker per GPU)."""

from __future__ import annotations

import time

from freqopt.errors import InvalidSettingError, StorageError

__all__ = ["join_search"]


def join_search(storage: str, name: str | None = None, *, backend: str | None = None, wait_s: float = 600.0, poll_s: float = 0.5,
                on_join=None, on_unit=None, verbose: bool = False, device: int | None = None):  # fmt: skip
    """Wait for search ``name`` in ``storage`` (None: the one search running there, for a launch script whose
    workers start beside the search and cannot know its name), then serve it (freqopt.search.workers.serve) on this
    machine's GPU.

    Args:
        storage: the search's Optuna storage URL (as ``freqopt search`` printed it).
        name: the search's name (runner.study_prefix of its trace, GPU and seed; printed by ``freqopt search``), or
            None: the only search running in ``storage`` (waiting for one to start).
        backend: "sim" or "nvml"; must be the search's own; None: the search's.
        wait_s: give up after this many seconds with nothing to claim, or with no search of that name (not
            negative).
        poll_s: seconds between looks at the storage.
        on_join: called as on_join(name, job, spec, backend_name, device) once joined (job: the search's published
            dict).
        on_unit: called as on_unit(granularity, unit name) after each unit this worker ran.
        verbose: let Optuna log at INFO (a line per study it creates); by default WARNING, and the caller's
            Optuna verbosity is restored on return (freqopt.search.study.optuna_logging).
        device: the GPU this worker measures on, an index among the visible ones (CUDA_VISIBLE_DEVICES order);
            None: LOCAL_RANK where a launcher set it (torchrun; under Slurm export LOCAL_RANK=$SLURM_LOCALID), else
            0 (freqopt.gpu.backends.local_device). With the simulated GPU every worker has a simulated GPU of its
            own whatever the device.

    Returns:
        freqopt.search.workers.WorkerReport: units run, new measurements, and whether it stopped idle.

    Raises:
        UnknownNameError: unknown backend.
        InvalidSettingError: negative wait_s, a backend other than the search's, or a bad device.
        NVMLError: no visible GPU of index ``device``.
        StorageError: the storage cannot be opened, holds no search ``name`` (with None: no running search)
            within ``wait_s``, holds several running searches where ``name`` is None, or this worker's trace or GPU
            type differs from the search's.
    """
    from freqopt.gpu.backends import check_backend, get_backend, local_device
    from freqopt.gpu.specs import get_gpu
    from freqopt.search.storage import open_storage, study_prefix
    from freqopt.search.study import optuna_logging
    from freqopt.search.workers import check_worker_backend, serve, trace_from_job

    if backend is not None:
        check_backend(backend)
    if wait_s < 0:
        raise InvalidSettingError(f"wait_s must not be negative, not {wait_s:g}", argument="wait_s")
    device = local_device(device)
    opened = open_storage(storage)
    name, job = _wait_for_search(opened, storage, name, wait_s, poll_s)
    backend_name = check_worker_backend(job, backend)
    from freqopt.pipeline.workers import PIPELINE_JOB, serve_pipeline

    if job.get("kind") == PIPELINE_JOB:  # a pipeline search's instruction studies (freqopt.pipeline.workers)
        def ready(spec) -> None:
            if on_join is not None:
                on_join(name, job, spec, backend_name, device)

        with optuna_logging(verbose):
            return serve_pipeline(opened, name, job, idle_s=wait_s, poll_s=poll_s, on_unit=on_unit, on_ready=ready)
    measuring = get_backend(backend_name, get_gpu(job["gpu"]) if backend_name == "sim" else None, seed=job["seed"],
                            device=device)  # fmt: skip
    try:
        trace = trace_from_job(job)
        if job.get("clock_switch_s") is not None:  # the search's switch latency, where it overrode its GPU file's
            measuring.spec = measuring.spec.with_switch_latency(job["clock_switch_s"])
        if study_prefix(trace, measuring.spec, job["seed"]) != name:
            raise StorageError(f"this worker's trace or GPU differs from search {name!r}'s (another freqopt version, "
                               f"or a GPU of type {measuring.spec.name} against the search's {job['gpu']}); run the "
                               "same freqopt on the same GPU type")  # fmt: skip
        if on_join is not None:
            on_join(name, job, measuring.spec, backend_name, device)
        with optuna_logging(verbose):
            return serve(opened, name, trace, measuring, idle_s=wait_s, poll_s=poll_s, on_unit=on_unit)
    finally:
        measuring.close()


def _wait_for_search(opened, storage: str, name: str | None, wait_s: float, poll_s: float) -> tuple[str, dict]:
    """Wait for search ``name`` in the opened storage (None: the one search running there) to be published,
    looking every ``poll_s`` seconds for at most ``wait_s``; ``storage`` is its URL, for the messages.

    Returns:
        (the search's name, its published job dict).

    Raises:
        StorageError: no such search within ``wait_s``, or several running where ``name`` is None.
    """
    from freqopt.search.workers import load_job, running_searches

    started = time.monotonic()
    while name is None:
        running = running_searches(opened)
        if len(running) > 1:
            raise StorageError(f"study must name the search to join: {len(running)} freqopt searches are running in "
                               f"{storage} ({', '.join(running)})", argument="study")  # fmt: skip
        if running:
            name = running[0]
        elif time.monotonic() - started > wait_s:
            raise StorageError(f"no freqopt search is running in {storage} after {wait_s:g} s; start one with "
                               f"`freqopt search --storage {storage}`")  # fmt: skip
        else:
            time.sleep(poll_s)
    while (state := load_job(opened, name)) is None:
        if time.monotonic() - started > wait_s:
            raise StorageError(f"no freqopt search named {name!r} in {storage} after {wait_s:g} s; start it with "
                               f"`freqopt search --storage {storage}` and pass the name it prints")  # fmt: skip
        time.sleep(poll_s)
    return name, state["job"]
