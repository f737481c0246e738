"""Many processes, one search: a granularity's tuning units are a work queue in the search's Optuna storage.

The leader (``freqopt search`` with persistent storage) publishes the job (workload, GPU type, backend, seed) as
user attributes of study ``<prefix>`` and, for each granularity, enqueues one WAITING trial per tuning unit in a
queue study. A process claims a unit by moving its trial to RUNNING with BaseStorage.set_trial_state_values,
which Optuna's storages make exclusive (RDB storages under a row lock, the journal under its file lock: exactly
one claimant gets True), runs the unit's study (search_unit) and completes the trial. While it works, a thread
stamps the trial with a heartbeat; a unit whose owner stopped stamping (or whose process on this host is gone) is
failed, and the leader resumes that unit's study itself.

A unit's study is the same whoever runs it (its trials are seeded by index, its noise by sample index, and every
measurement is logged once: freqopt.search.journal), so the result does not depend on how many workers joined,
and no measurement is lost or taken twice. Locally, the leader runs its share of the units in ``n_jobs``
processes with joblib.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from freqopt.gpu.backends.base import Backend, ClockSetting
from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Trace
from freqopt.search.journal import digest
from freqopt.search.study import UnitSearch, search_unit
from freqopt.search.units import TuningUnit

__all__ = ["UnitWork", "UnitQueue", "WorkerReport", "publish_job", "publish_job_doc", "finish_job", "load_job",
           "trace_from_job", "run_unit", "serve", "is_persistent", "HEARTBEAT_S", "STALE_S"]

HEARTBEAT_S = 5.0  # how often an owner stamps its unit
STALE_S = 60.0  # a unit not stamped for this long has lost its owner

_JOB, _STATE, _QUEUE, _WORK = "freqopt_job", "freqopt_state", "freqopt_queue", "freqopt_work"


def is_persistent(storage) -> bool:
    """Whether other processes can see ``storage`` (anything but None or Optuna's in-memory storage)."""
    return storage is not None and not isinstance(storage, optuna.storages.InMemoryStorage)


@dataclass(frozen=True)
class UnitWork:
    """How one granularity's units are searched: the arguments of search_unit that every process must share."""

    prefix: str
    granularity: str
    space: str
    n_trials: int
    finalist_repeats: int
    finalist_slowdown: float
    seed: int
    constrained: bool = False
    spread: bool = True
    whole_step: bool = False  # the unit is the whole iteration: measured as the training step (search_unit)
    mem_clock_mhz: int | None = None  # the memory clock, fixed for the job (search_unit); None: searched
    share_families: bool = False  # kernel level: a family of kernel classes is one unit (units.search_units)
    patience: int | None = None  # stop a study once this many trials in a row left its front as it was
    edge_slowdown: float | None = None  # the whole iteration's budget: measure its edge (search_unit)
    unsearched: tuple[str, ...] = ()  # units measured only at the default and their warm starts (no GP trials)

    def study_name(self, unit: TuningUnit) -> str:
        return f"{self.prefix}-{self.granularity}-{hashlib.sha1(unit.name.encode()).hexdigest()[:10]}"


def run_unit(trace: Trace, backend: Backend, work: UnitWork, unit: TuningUnit, storage,
             warm_start: Sequence[ClockSetting] = ()) -> UnitSearch:  # fmt: skip
    """Run (or resume, or read back) one unit's study (one of ``work.unsearched``: its default and warm starts
    only, measured and offered as the allocator's options)."""
    return search_unit(
        backend, unit.kernels(trace), name=unit.name, study_name=work.study_name(unit), storage=storage,
        space=work.space, n_trials=0 if unit.name in work.unsearched else work.n_trials,
        finalist_repeats=work.finalist_repeats, finalist_slowdown=work.finalist_slowdown, seed=work.seed,
        warm_start=list(warm_start), constrained=work.constrained,
        spread=work.spread and unit.name not in work.unsearched, whole_step=work.whole_step, mem_clock_mhz=work.mem_clock_mhz,
        patience=work.patience, edge_slowdown=work.edge_slowdown,
    )  # fmt: skip


# -- the job: what a worker needs to rebuild the search ---------------------------------------------------------
def _job_study(storage, prefix: str) -> optuna.Study:
    return optuna.create_study(study_name=prefix, storage=storage, load_if_exists=True)


def publish_job(storage, prefix: str, trace: Trace, backend: Backend, seed: int) -> bool:
    """Record the search's workload, GPU type (and the clock-switch latency it searches with), backend kind and seed,
    and mark it running. Returns whether the storage held the search already (a run of it that was stopped, or one
    that finished): the search resumes."""
    w = trace.workload
    job = {
        "model": w.model, "config": dataclasses.asdict(w.config), "micro_batch_size": w.micro_batch_size,
        "layout": w.layout.to_kwargs(), "mode": trace.meta.get("mode", "train"), "gpu": backend.spec.name,
        "backend": backend.name, "seed": seed,
        "clock_switch_s": backend.spec.clock_switch_s,  # a search may override its GPU file's (switch_latency)
    }  # fmt: skip
    return publish_job_doc(storage, prefix, job)


def publish_job_doc(storage, prefix: str, job: dict) -> bool:
    """Record ``job`` (a JSON-serializable dict that lets a worker rebuild the search: publish_job's, or a pipeline
    search's, freqopt.pipeline.workers.pipeline_job) as search ``prefix``'s and mark it running. Returns whether the
    storage held the search already (the search resumes)."""
    study = _job_study(storage, prefix)
    resumed = _JOB in study.user_attrs
    study.set_user_attr(_JOB, job)
    study.set_user_attr(_STATE, "running")
    return resumed


def finish_job(storage, prefix: str) -> None:
    _job_study(storage, prefix).set_user_attr(_STATE, "done")


def load_job(storage, prefix: str) -> dict | None:
    """The job's attributes (job, state, current queue), or None if no search of that name has started."""
    try:
        attrs = optuna.load_study(study_name=prefix, storage=storage).user_attrs
    except KeyError:  # no such study yet
        return None
    if _JOB not in attrs:
        return None
    return {"job": attrs[_JOB], "state": attrs.get(_STATE), "queue": attrs.get(_QUEUE)}


def running_searches(storage) -> list[str]:
    """The names of the searches in ``storage`` that have started and not finished (publish_job, finish_job)."""
    names = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if _JOB in attrs and attrs.get(_STATE) == "running":
            names.append(summary.study_name)
    return sorted(names)


def trace_from_job(job: dict) -> Trace:
    """The leader's trace, traced again from the job's workload."""
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import Workload, config_from_dict
    from freqopt.workload.trace import trace_iteration

    config = config_from_dict(job["model"], job["config"])
    workload = Workload(job["model"], config, job["micro_batch_size"], Layout(**job["layout"]))
    return trace_iteration(workload, job["mode"])


# -- the queue ------------------------------------------------------------------------------------------------
def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_alive(trial: optuna.trial.FrozenTrial, now: float) -> bool:
    """A RUNNING unit's owner is alive if it stamped the unit within STALE_S and, on this host, its process runs."""
    stamped = trial.user_attrs.get("alive_at")
    if stamped is None:  # claimed a moment ago, not stamped yet
        stamped = trial.datetime_start.timestamp() if trial.datetime_start else now
    if now - stamped > STALE_S or trial.user_attrs.get("owner") == _owner():  # not the asking process's own
        return False
    host, _, pid = str(trial.user_attrs.get("owner", "")).rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
    return True


class UnitQueue:
    """One granularity's units as trials of a queue study: WAITING (to do), RUNNING (claimed), COMPLETE (done),
    FAIL (owner lost; the leader resumes the unit)."""

    def __init__(self, storage, name: str):
        self.storage, self.name = storage, name
        self.study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True)

    @classmethod
    def create(cls, storage, work: UnitWork, units: Sequence[int],
               warm_start: Sequence[Sequence[ClockSetting]]) -> UnitQueue:  # fmt: skip
        """The queue of this work on ``units`` (indices into the granularity's partition), each with its warm
        starts, created if new and published as the job's current queue."""
        name = f"{work.prefix}-{work.granularity}-queue-{digest((work, tuple(units), tuple(map(tuple, warm_start))))[:10]}"
        queue = cls(storage, name)
        if not queue.study.get_trials(deepcopy=False):
            queue.study.set_user_attr(_WORK, dataclasses.asdict(work))
            for i, warm in zip(units, warm_start):
                warm_attr = [[w.sm_clock_mhz, w.mem_clock_mhz, w.power_limit_w] for w in warm]
                queue.study.enqueue_trial({}, user_attrs={"unit": i, "warm_start": warm_attr})
        _job_study(storage, work.prefix).set_user_attr(_QUEUE, name)
        return queue

    @property
    def work(self) -> UnitWork:
        stored = dict(self.study.user_attrs[_WORK])  # JSON in the storage: a tuple comes back as a list
        return UnitWork(**{**stored, "unsearched": tuple(stored.get("unsearched", ()))})

    def _items(self, states=None) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def claim(self, unit: int | None = None) -> tuple[int, int, list[ClockSetting]] | None:
        """Claim ``unit`` (or the first waiting unit): (unit index, queue trial id, warm starts), or None if it is
        (they are all) taken."""
        for trial in self._items(states=(TrialState.WAITING,)):
            if unit is not None and trial.user_attrs["unit"] != unit:
                continue
            try:
                won = self.storage.set_trial_state_values(trial._trial_id, state=TrialState.RUNNING)
            except UpdateFinishedTrialError:
                won = False
            if won:
                self.storage.set_trial_user_attr(trial._trial_id, "owner", _owner())
                self.storage.set_trial_user_attr(trial._trial_id, "alive_at", time.time())
                warm = [ClockSetting(*w) for w in trial.user_attrs["warm_start"]]
                return trial.user_attrs["unit"], trial._trial_id, warm
            if unit is not None:
                return None
        return None

    @contextmanager
    def owning(self, trial_id: int) -> Iterator[None]:
        """Stamp the claimed unit every HEARTBEAT_S while the body runs; complete it if the body returns."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    self.storage.set_trial_user_attr(trial_id, "alive_at", time.time())
                except Exception:  # a lost connection must not kill the work; the next beat retries
                    pass

        thread = threading.Thread(target=beat, name="freqopt-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        except BaseException:  # an error or an interrupt: give the unit up at once (its study resumes it)
            stop.set()
            thread.join()
            self.storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
            raise
        stop.set()
        thread.join()
        self.storage.set_trial_state_values(trial_id, state=TrialState.COMPLETE, values=[0.0])

    def settle(self, poll_s: float = 0.5, on_wait: Callable[[int], None] | None = None) -> None:
        """Wait until no unit is held by a live owner; units whose owner is gone are failed (and so left to the
        caller to resume)."""
        while True:
            now = time.time()
            running = self._items(states=(TrialState.RUNNING,))
            live = 0
            for trial in running:
                if _owner_alive(trial, now):
                    live += 1
                else:
                    try:
                        self.storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
                    except UpdateFinishedTrialError:  # it finished meanwhile
                        pass
            if not live:
                return
            if on_wait:
                on_wait(live)
            time.sleep(poll_s)

    def done_units(self) -> set[int]:
        return {t.user_attrs["unit"] for t in self._items(states=(TrialState.COMPLETE,))}


def check_worker_backend(job: dict, backend_name: str | None) -> str:
    """The backend a worker must use: the leader's.

    Raises:
        InvalidSettingError: told to use another.
    """
    if backend_name is not None and backend_name != job["backend"]:
        raise InvalidSettingError(f"the search measures with backend {job['backend']!r}; a worker must too "
                           f"(give no backend, or {job['backend']!r}, not {backend_name!r})")  # fmt: skip
    return job["backend"]


IDLE_NOTICE_S = 10.0  # serve calls on_idle at least this often while it waits with nothing to claim


@dataclass
class WorkerReport:
    """What a worker did: units it ran, measurements it took (not read back), and whether it stopped idle."""

    units: int = 0
    n_new_measurements: int = 0
    idle_timeout: bool = False


def serve(storage, prefix: str, trace: Trace | None, backend: Backend, *, idle_s: float, poll_s: float = 0.5,
          on_unit: Callable[[str, str], None] | None = None,
          run_claimed: Callable[[UnitWork, int, list[ClockSetting]], tuple[str, UnitSearch]] | None = None,
          on_idle: Callable[[float], None] | None = None) -> WorkerReport:  # fmt: skip
    """Claim and run units of search ``prefix`` until it is done, or until nothing was claimable for ``idle_s``.

    Args:
        storage: the search's Optuna storage.
        prefix: the search's name (runner.study_prefix of its trace, GPU and seed).
        trace, backend: the search's trace (trace_from_job) and this worker's GPU.
        on_unit: called as on_unit(granularity, unit name) after each unit this worker ran.
        run_claimed: runs a claimed unit as run_claimed(work, unit index, warm starts) -> (unit name, its
            UnitSearch); None: a one-GPU search's unit of ``trace`` (run_unit). A pipeline search's workers give
            their own (freqopt.pipeline.workers.serve_pipeline; ``trace`` None).
        on_idle: called as on_idle(idle_s) every IDLE_NOTICE_S (10 s) while nothing is claimable and the search is
            not done (``idle_s``: seconds since the last unit ended, or since the worker started).
    """
    from freqopt.search.units import search_units

    units: dict[str, list[TuningUnit]] = {}

    def run_trace_unit(work: UnitWork, i: int, warm: list[ClockSetting]) -> tuple[str, UnitSearch]:
        unit = units.setdefault(work.granularity, search_units(trace, work.granularity, work.share_families))[i]
        return unit.name, run_unit(trace, backend, work, unit, storage, warm)

    run_claimed = run_claimed or run_trace_unit
    report = WorkerReport()
    idle_since = noticed = time.monotonic()
    while True:
        state = load_job(storage, prefix)
        if state and state["queue"]:
            queue = UnitQueue(storage, state["queue"])
            claimed = queue.claim()
            if claimed is not None:
                i, trial_id, warm = claimed
                work = queue.work
                with queue.owning(trial_id):
                    name, result = run_claimed(work, i, warm)
                report.units += 1
                report.n_new_measurements += result.n_new_measurements
                if on_unit:
                    on_unit(work.granularity, name)
                idle_since = time.monotonic()
                continue
        if state and state["state"] == "done":
            return report
        if time.monotonic() - idle_since > idle_s:
            report.idle_timeout = True
            return report
        if on_idle is not None and time.monotonic() - max(noticed, idle_since) >= IDLE_NOTICE_S:
            noticed = time.monotonic()
            on_idle(noticed - idle_since)
        time.sleep(poll_s)
