"""Join a running search from another process or machine: ``freqopt.worker.join_search(storage, name)`` claims
the search's tuning units (a pipeline search's: its instruction studies) from its shared Optuna storage and runs
their studies until the search is done (freqopt.search.workers holds the queue, freqopt.pipeline.workers a
pipeline's; one worker per GPU)."""

from __future__ import annotations

import shlex
import time

from freqopt.errors import InvalidSettingError, StorageError

__all__ = ["join_search", "IDLE_S", "WAIT_NOTICE_S"]

IDLE_S = 600.0  # a joined worker gives up after this long with nothing to claim, unless wait_s says otherwise
WAIT_NOTICE_S = 10.0  # while waiting for a search to appear, on_wait is called at least this often


def join_search(storage: str, name: str | None = None, *, backend: str | None = None, wait_s: float | None = None,
                poll_s: float = 0.5, on_join=None, on_unit=None, on_wait=None, on_idle=None, verbose: bool = False,
                device: int | None = None):  # fmt: skip
    """Join search ``name`` in ``storage`` (None: the one search running there), then serve it
    (freqopt.search.workers.serve) on this machine's GPU.

    A storage that holds no such search (a journal or SQLite file that does not exist, which is never made here, or
    a database without it) is refused at once, unless ``wait_s`` is given: then the worker waits up to ``wait_s``
    for the search to appear, as the workers of a launch script started beside their search do.

    Args:
        storage: the search's Optuna storage URL (as ``freqopt search`` printed it).
        name: the search's name (runner.study_prefix of its trace, GPU and seed; printed by ``freqopt search``), or
            None: the only search running in ``storage``.
        backend: "sim" or "nvml"; must be the search's own; None: the search's.
        wait_s: wait this long (s, not negative, from when the worker is ready: its modules loaded) for the search
            to appear, and once joined give up after this long with nothing to claim; None: refuse a storage
            without the search at once, and give up after IDLE_S (600 s) with nothing to claim.
        poll_s: seconds between looks at the storage.
        on_join: called as on_join(name, job, spec, backend_name, device) once joined (job: the search's published
            dict).
        on_unit: called as on_unit(granularity, unit name) after each unit this worker ran.
        on_wait: called as on_wait(what, waited_s) every WAIT_NOTICE_S (10 s) while waiting for the search to
            appear (``what``: what it waits for, one line).
        on_idle: called as on_idle(idle_s) every 10 s while, joined, it has nothing to claim and the search is not
            done (freqopt.search.workers.serve; ``idle_s``: seconds idle so far, of at most wait_s or IDLE_S).
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
        StorageError: the storage cannot be opened; holds no search ``name`` (with None: no running search), at
            once or after ``wait_s``; holds several running searches where ``name`` is None; or this worker's
            trace or GPU type differs from the search's.
        MissingDependencyError: the storage's database driver is not installed (freqopt.storage_url).
    """
    from freqopt.gpu.backends import check_backend, local_device
    from freqopt.storage_url import check_storage_url

    # The checks that need neither Optuna nor PyTorch first, so that a wrong argument is refused at once.
    if backend is not None:
        check_backend(backend)
    if wait_s is not None and not wait_s >= 0:
        raise InvalidSettingError(f"wait_s must not be negative, not {wait_s:g}", argument="wait_s")
    device = local_device(device)
    check_storage_url(storage)
    if wait_s is None:  # a missing file is refused before the imports; one to wait for is waited for after them,
        _wait_for_file(storage, name, wait_s, poll_s, on_wait, time.monotonic())  # so that the worker is ready

    from freqopt.gpu.backends import get_backend
    from freqopt.gpu.specs import get_gpu
    from freqopt.search.storage import open_storage, study_prefix
    from freqopt.search.study import optuna_logging
    from freqopt.search.workers import check_worker_backend, serve, trace_from_job

    started = time.monotonic()  # wait_s counts from here: the worker is ready to join
    _wait_for_file(storage, name, wait_s, poll_s, on_wait, started)
    opened = open_storage(storage)
    name, job = _wait_for_search(opened, storage, name, wait_s, poll_s, on_wait, started)
    idle_s = IDLE_S if wait_s is None else wait_s
    backend_name = check_worker_backend(job, backend)
    from freqopt.pipeline.workers import PIPELINE_JOB, serve_pipeline

    if job.get("kind") == PIPELINE_JOB:  # a pipeline search's instruction studies (freqopt.pipeline.workers)
        def ready(spec) -> None:
            if on_join is not None:
                on_join(name, job, spec, backend_name, device)

        with optuna_logging(verbose):
            return serve_pipeline(opened, name, job, idle_s=idle_s, poll_s=poll_s, on_unit=on_unit, on_ready=ready,
                                  on_idle=on_idle)
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
            return serve(opened, name, trace, measuring, idle_s=idle_s, poll_s=poll_s, on_unit=on_unit,
                         on_idle=on_idle)
    finally:
        measuring.close()


def _what(name: str | None) -> str:
    """The search a worker waits for, in words."""
    return "a freqopt search" if name is None else f"freqopt search {name!r}"


def _no_search(name: str | None) -> str:
    """The start of the message for a storage without the search: "no freqopt search is running in" (no name) or
    "no freqopt search named NAME in"; the storage follows."""
    return "no freqopt search is running in" if name is None else f"no freqopt search named {name!r} in"


def _start_hint(storage: str, waited: bool) -> str:
    """What to do about a storage without the search: check the URL, start the search first, or (where the worker
    did not wait) let a worker started beside its search wait for it."""
    url = shlex.quote(storage)  # a URL with ? or & runs as printed in a shell
    hint = (f"check the URL, or start the search first (`freqopt search --model gpt3-small --max-slowdown 1% --storage "
            f"{url}`, with your model and budget) and join it with the name it prints")
    return hint if waited else hint + f"; a worker started beside its search waits for it with --wait-s: `freqopt " \
                                      f"worker --storage {url} --wait-s 600`"


def _waiter(storage: str, wait_s: float | None, poll_s: float, on_wait, started: float):
    """A function wait(what, missing) for the wait loops: where ``wait_s`` is None, raises at once that ``missing``;
    else raises once ``wait_s`` has passed since ``started``, and until then calls on_wait(what, waited_s) at once and
    every WAIT_NOTICE_S, and sleeps ``poll_s``."""
    notices = [-float("inf")]

    def wait(what: str, missing: str) -> None:
        waited = time.monotonic() - started
        if wait_s is None or waited >= wait_s:
            after = "" if wait_s is None else f" after {wait_s:g} s"
            raise StorageError(f"{missing}{after}: {_start_hint(storage, wait_s is not None)}")
        if on_wait is not None and time.monotonic() - notices[0] >= WAIT_NOTICE_S:
            notices[0] = time.monotonic()
            on_wait(what, waited)
        time.sleep(poll_s)

    return wait


def _wait_for_file(storage: str, name: str | None, wait_s: float | None, poll_s: float, on_wait,
                   started: float) -> None:  # fmt: skip
    """Wait for a journal or SQLite storage's file to exist (never making it: a worker is not where a search
    begins); nothing for a server's database."""
    from freqopt.storage_url import storage_file

    path = storage_file(storage)
    wait = _waiter(storage, wait_s, poll_s, on_wait, started)
    while path is not None and not path.exists():
        wait(f"{_what(name)} to create {path}",
             f"{_no_search(name)} {storage} (no file {str(path)!r})")


def _wait_for_search(opened, storage: str, name: str | None, wait_s: float | None, poll_s: float, on_wait,
                     started: float) -> tuple[str, dict]:  # fmt: skip
    """Search ``name`` in the opened storage (None: the one search running there), waiting for it to be published
    where ``wait_s`` allows (join_search); ``storage`` is its URL, for the messages.

    Returns:
        (the search's name, its published job dict).

    Raises:
        StorageError: no such search (at once, or within ``wait_s``), or several running where ``name`` is None.
    """
    from freqopt.search.workers import load_job, running_searches

    wait = _waiter(storage, wait_s, poll_s, on_wait, started)
    while name is None:
        running = running_searches(opened)
        if len(running) > 1:
            raise StorageError(f"study must name the search to join: {len(running)} freqopt searches are running in "
                               f"{storage} ({', '.join(running)})", argument="study")  # fmt: skip
        if running:
            name = running[0]
        else:
            wait(f"a freqopt search to start in {storage}", f"{_no_search(name)} {storage}")
    while (state := load_job(opened, name)) is None:
        wait(f"freqopt search {name!r} to start in {storage}", f"{_no_search(name)} {storage}")
    return name, state["job"]
