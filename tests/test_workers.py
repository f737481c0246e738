"""Many workers, one search (issue 6, item 5; issue 38, item 1): `freqopt worker` processes join a search through its
Optuna storage (a real PostgreSQL server that pgserver starts, and a journal file), one of them killed mid-study, and
`--jobs` runs units in joblib processes. The result is the one-process result, and every measurement is taken
exactly once across all processes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.search.workers import UnitQueue, UnitWork

from postgres_server import server

ENV = {**os.environ, "COLUMNS": "200"}


def _freqopt(*args):
    return [sys.executable, "-m", "freqopt.cli", *args]


def _results(path):
    """The search's JSON without what depends on which process measured what."""
    summary = json.loads(path.read_text())
    return summary["results"], summary["baseline"], summary.pop("n_new_measurements")


@pytest.fixture(scope="module")
def one_process(kernel_search_cli):
    """The search run by one process alone (conftest.kernel_search_cli), and its name (printed for workers)."""
    name = kernel_search_cli["stderr"].split("--study ")[1].split()[0]
    summary = dict(kernel_search_cli["summary"])
    n_new = summary.pop("n_new_measurements")
    assert n_new > 0 and summary["results"]["kernel"]["n_measurements"] > 0
    return {"results": summary["results"], "baseline": summary["baseline"], "n_new": n_new, "name": name,
            "args": kernel_search_cli["args"]}  # fmt: skip


def _ready(worker: subprocess.Popen) -> None:
    """Wait until ``worker`` says it waits for the search (its first notice, once its imports are done)."""
    seen = []
    for line in worker.stderr:
        seen.append(line)
        if line.startswith("waiting for "):
            return
    raise AssertionError(f"the worker ended before it waited for the search: {''.join(seen)[-2000:]}")


# Whether a worker gets a unit before the leader has run them all is a race on a 2-core machine (the workers trace
# the job while the leader, its trace at hand, runs the units): a scenario whose workers got nothing is run again,
# from a fresh storage, up to this many times in all. Every run is held to the one-process result.
SHARING_TRIES = 3


def _search_with_workers(tmp_path, storage, one_process, n_workers=2):
    """The first worker names the search; the others join the one running in the storage (no --study), as the
    workers of a launch script do. ``storage``: an Optuna storage URL, or a callable of the try's folder that makes a
    fresh one for each try (SHARING_TRIES)."""
    for attempt in range(SHARING_TRIES if callable(storage) else 1):
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        reports = _search_with_workers_once(folder, storage(folder) if callable(storage) else storage, one_process,
                                            n_workers)  # fmt: skip
        if sum(r["units"] for r in reports) > 0:
            return reports
    raise AssertionError(f"no worker got a unit in {attempt + 1} tries: the test did not exercise sharing")


def _search_with_workers_once(tmp_path, storage, one_process, n_workers):
    workers = [
        subprocess.Popen(_freqopt("worker", "--storage", storage, *(["--study", one_process["name"]] if k == 0 else []),
                                  "--wait-s", "300", "--json", f"w{k}.json"), cwd=tmp_path, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for k in range(n_workers)
    ]
    for w in workers:  # each ready, polling the storage, before the search starts: a search that outruns the
        _ready(w)  # workers' imports would run every unit itself
    # The leader at the lowest CPU priority: its search is fast enough to run every unit itself while the workers,
    # ready, still join and trace; the figures do not depend on who ran which unit (asserted below).
    leader = subprocess.run(_freqopt("search", *one_process["args"], "--storage", storage, "--out", "out", "--json", "r.json"),
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=1200,
                            preexec_fn=lambda: os.nice(19))  # fmt: skip
    assert leader.returncode == 0, leader.stderr
    for w in workers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    reports = [json.loads((tmp_path / f"w{k}.json").read_text()) for k in range(n_workers)]
    results, baseline, n_new = _results(tmp_path / "r.json")
    # Same quality as one worker: the very same result.
    assert results == one_process["results"] and baseline == one_process["baseline"]
    # Nothing lost or duplicated: the measurements taken across all processes are the one-process run's.
    assert n_new + sum(r["n_new_measurements"] for r in reports) == one_process["n_new"]
    assert all(not r["idle_timeout"] for r in reports)
    if sum(r["units"] for r in reports) > 0:
        # A fresh search: what it read back is the workers' work, not a resumed run's.
        assert "shared with workers: " in leader.stderr and "resumed" not in leader.stderr, leader.stderr
    return reports


@pytest.mark.slow
def test_workers_share_a_search_through_postgresql(tmp_path, one_process):
    with server() as url:
        _search_with_workers(tmp_path, url, one_process)


def _records_by_owner(url: str, name: str, traces: dict) -> dict[int, tuple[int, bool]]:
    """Per process id: the measurements recorded in the studies of every unit it claimed in search ``name``, and
    whether it holds a unit now (RUNNING) with at least one measurement in it. ``traces`` caches the search's trace
    (traced again from its job, as a worker does) between calls."""
    import socket

    import optuna

    from freqopt.search.units import search_units
    from freqopt.search.workers import UnitQueue, load_job, trace_from_job

    storage = optuna.storages.RDBStorage(url)
    if name not in traces:
        state = load_job(storage, name)
        if state is None:
            return {}
        traces[name] = trace_from_job(state["job"])
    host = socket.gethostname()
    owned: dict[int, tuple[int, bool]] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if "-queue-" not in summary.study_name:
            continue
        queue = UnitQueue(storage, summary.study_name)
        units = search_units(traces[name], queue.work.granularity, queue.work.share_families)
        for trial in queue.study.get_trials(deepcopy=False):
            owner_host, _, pid = str(trial.user_attrs.get("owner", "")).rpartition(":")
            if owner_host != host or not pid.isdigit():
                continue
            try:
                study = optuna.load_study(study_name=queue.work.study_name(units[trial.user_attrs["unit"]]),
                                          storage=storage)  # fmt: skip
            except KeyError:  # claimed, its study not made yet
                continue
            n = sum(key.startswith("m:") for key in study.user_attrs)
            total, busy = owned.get(int(pid), (0, False))
            owned[int(pid)] = (total + n, busy or (trial.state == optuna.trial.TrialState.RUNNING and n > 0))
    return owned


@pytest.mark.slow
def test_three_workers_and_one_killed_mid_study_through_postgresql(tmp_path, one_process):
    """Three workers on a PostgreSQL storage; the first of them seen holding a unit with measurements in it is
    frozen (SIGSTOP, so that what it recorded can be counted before anyone takes its unit over) and killed
    (SIGKILL). The search still ends with the one-process tables, and the measurements taken by the leader, the two
    survivors and the killed worker before it died add up to the one-process run's: none taken twice, none lost."""
    with server() as url:
        workers = [
            subprocess.Popen(_freqopt("worker", "--storage", url, "--study", one_process["name"], "--wait-s", "300",
                                      "--json", f"w{k}.json", "--device", str(k)), cwd=tmp_path, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
            for k in range(3)
        ]
        leader = subprocess.Popen(_freqopt("search", *one_process["args"], "--storage", url, "--out", "out", "--json",
                                           "r.json"), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        by_pid, killed, killed_records, traces = {w.pid: k for k, w in enumerate(workers)}, None, None, {}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and leader.poll() is None and killed is None:
            busy = [pid for pid, (_, holds) in _records_by_owner(url, one_process["name"], traces).items()
                    if holds and pid in by_pid]  # fmt: skip
            if busy:
                killed = by_pid[busy[0]]
                workers[killed].send_signal(signal.SIGSTOP)
                killed_records, _ = _records_by_owner(url, one_process["name"], traces)[busy[0]]
                workers[killed].send_signal(signal.SIGKILL)
                workers[killed].wait()
            time.sleep(0.1)
        out, err = leader.communicate(timeout=1200)
        assert leader.returncode == 0, err
        assert killed_records, "no worker was seen holding a unit with a measurement: nothing was killed mid-study"
        survivors = []
        for k, w in enumerate(workers):
            if k != killed:
                _, werr = w.communicate(timeout=120)
                assert w.returncode == 0, werr
                survivors.append(json.loads((tmp_path / f"w{k}.json").read_text()))
    results, baseline, n_new = _results(tmp_path / "r.json")
    assert results == one_process["results"] and baseline == one_process["baseline"]
    assert n_new + sum(r["n_new_measurements"] for r in survivors) + killed_records == one_process["n_new"]


@pytest.mark.slow
def test_workers_share_a_search_through_a_journal_file(tmp_path, one_process):
    _search_with_workers(tmp_path, lambda folder: f"journal:{folder / 'journal.log'}", one_process)


@pytest.mark.slow
def test_jobs_run_units_in_parallel_with_the_same_result(tmp_path, one_process):
    proc = subprocess.run(_freqopt("search", *one_process["args"], "--jobs", "2", "--out", "out", "--json", "r.json"),
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results, baseline, n_new = _results(tmp_path / "r.json")
    assert results == one_process["results"] and baseline == one_process["baseline"]
    assert n_new == one_process["n_new"]  # the joblib processes' measurements, returned to the leader


def test_a_killed_workers_unit_is_taken_over(tmp_path):
    """A unit held by a process that is gone is failed by settle() and offered to the caller to resume."""
    import optuna

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log")))
    work = UnitWork("p", "kernel", "clocks", 4, 0, 0.05, 0)
    queue = UnitQueue.create(storage, work, [0, 1, 2], [[], [ClockSetting(1500, None, None)], []])
    assert queue.work == work
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    claimed = queue.claim(1)
    assert claimed == (1, claimed[1], [ClockSetting(1500, None, None)])
    assert queue.claim(1) is None  # exclusive
    storage.set_trial_user_attr(claimed[1], "owner", f"{os.uname().nodename}:{dead.pid}")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    started = time.monotonic()
    queue.settle(poll_s=0.05)
    assert time.monotonic() - started < 5  # a dead process on this host is seen at once, not after STALE_S
    assert queue.done_units() == set()
    assert [t.state for t in queue.study.get_trials()] == [optuna.trial.TrialState.WAITING,
                                                           optuna.trial.TrialState.FAIL,
                                                           optuna.trial.TrialState.WAITING]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--storage", "journal:{tmp}/none.log", "--study", "nothing", "--wait-s", "0"], "no freqopt search named"),
    (["--storage", "sqlite:///{tmp}/missing/x.db", "--study", "s"], "cannot open Optuna storage"),
    (["--storage", "journal:{tmp}/none.log", "--study", "s", "--backend", "gpu9"], "unknown backend"),
    (["--storage", "journal:{tmp}/none.log", "--wait-s", "0"], "no freqopt search is running in journal:"),
    (["--storage", "journal:{tmp}/none.log", "--study", "s", "--device", "-1"], "--device must be a GPU index >= 0"),
])  # fmt: skip
def test_worker_bad_input_is_one_line(tmp_path, args, message):
    proc = subprocess.run(_freqopt("worker", *[a.format(tmp=tmp_path) for a in args]), capture_output=True,
                          text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_worker_must_measure_with_the_searchs_backend():
    from freqopt.errors import InvalidSettingError
    from freqopt.search.workers import check_worker_backend

    assert check_worker_backend({"backend": "sim"}, None) == "sim"
    with pytest.raises(InvalidSettingError, match="not .nvml."):
        check_worker_backend({"backend": "sim"}, "nvml")


def test_a_worker_measures_on_the_gpu_it_is_given_or_its_local_rank(fake_gpu, monkeypatch):
    """--device, else LOCAL_RANK (torchrun; SLURM_LOCALID under Slurm), else 0: an index among the visible GPUs; one
    that is not visible, or a LOCAL_RANK that is not an index, is refused in one line."""
    from freqopt.errors import InvalidSettingError
    from freqopt.gpu.backends import get_backend, local_device
    from freqopt.gpu.nvml import NVMLError

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_device() == 0 and local_device(3) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_device() == 2 and local_device(0) == 0
    with pytest.raises(NVMLError, match="device 2 is not visible: 1 GPU"):
        get_backend("nvml", None)  # LOCAL_RANK 2 on a machine with one GPU
    backend = get_backend("nvml", None, device=0)
    assert backend.device.uuid == "GPU-test"
    backend.close()
    assert get_backend("sim", None).simulated  # each process its own simulated GPU, whatever the rank
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(InvalidSettingError, match="LOCAL_RANK must be an integer >= 0, not 'x'"):
        local_device()
    with pytest.raises(InvalidSettingError, match="device must be a GPU index >= 0"):
        local_device(-1)


@pytest.mark.slow
def test_optuna_dashboard_serves_a_freqopt_search(tmp_path):
    """docs/search.md's `optuna-dashboard OUT/freqopt.journal` (or the search's --storage URL): optuna-dashboard's own
    storage lookup opens a freqopt search's journal and its API lists the search's studies with their trials (the
    WSGI app the dashboard serves, called in-process)."""
    import io

    import freqopt
    import optuna_dashboard

    result = freqopt.search("gpt3-small", max_slowdown="2%", granularity="iteration", micro_batch_size=1, seq_len=64,
                            n_trials=3, out=tmp_path / "out")  # fmt: skip
    app = optuna_dashboard.wsgi(str(tmp_path / "out" / "freqopt.journal"))

    def get(path):
        status = []
        body = app({"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "SERVER_NAME": "localhost",
                    "SERVER_PORT": "8080", "wsgi.input": io.BytesIO(), "wsgi.url_scheme": "http",
                    "SERVER_PROTOCOL": "HTTP/1.1"}, lambda s, headers, exc=None: status.append(s))  # fmt: skip
        return status[0], json.loads(b"".join(body))

    status, listing = get("/api/studies")
    assert status.startswith("200")
    names = {s["study_name"]: s["study_id"] for s in listing["study_summaries"]}
    units = [n for n in result.results["iteration"].study_names if n in names]
    assert units, names
    status, study = get(f"/api/studies/{names[units[0]]}")
    assert status.startswith("200") and len(study["trials"]) >= 3


def test_a_worker_without_a_name_refuses_to_pick_among_several_running_searches(tmp_path):
    import optuna

    from freqopt.errors import StorageError
    from freqopt.search.workers import _JOB, _STATE, running_searches
    from freqopt.worker import join_search

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log")))
    for name, state in (("a", "running"), ("b", "running"), ("c", "done")):
        study = optuna.create_study(study_name=name, storage=storage)
        study.set_user_attr(_JOB, {"model": "gpt3-small"})
        study.set_user_attr(_STATE, state)
    optuna.create_study(study_name="not-a-search", storage=storage)
    assert running_searches(storage) == ["a", "b"]
    with pytest.raises(StorageError, match=r"study must name the search to join: 2 freqopt searches are running in "
                                           r".* \(a, b\)"):  # fmt: skip
        join_search(f"journal:{tmp_path / 'j.log'}", wait_s=0)


# Micro-batch 8 of 1024 tokens: instructions long enough that the GPU, not the host issuing their kernels, sets their
# pace (freqopt.gpu.host), so the planner has clocks to choose.
PIPELINE = ["search", "--model", "gpt3-small", "--micro-batch-size", "8", "--seq-len", "1024", "--gpu", "a100-sxm4-80gb",
            "--layout", "pp=4", "--micro-batches", "4", "--max-slowdown", "5%", "--trials", "10",
            "--switch-latency-ms", "0.2"]  # fmt: skip


def _pipeline_results(path):
    """A pipeline search's JSON without what depends on which process measured what, or on the wall clock."""
    summary = json.loads(path.read_text())
    for level in summary["results"].values():
        level.pop("search_wall_s")
    return summary["results"], summary["baseline"], summary.pop("n_new_measurements")


@pytest.mark.slow
def test_workers_take_a_pipeline_searchs_instruction_studies(tmp_path):
    """Issue 38, item 1: a pipeline search publishes its instruction studies (one per stage and pass) as a queue
    from its start; two workers rebuild the pipeline from the job and take studies while the leader validates the
    default and searches the iteration level. The result is the one-process result, every measurement taken once."""
    alone = subprocess.run(_freqopt(*PIPELINE, "--out", "alone", "--json", "alone.json"), cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    name = alone.stderr.split("--study ")[1].split()[0]
    results, baseline, n_new = _pipeline_results(tmp_path / "alone.json")
    assert set(results) == {"iteration", "stage", "instruction"} and n_new > 0

    for attempt in range(SHARING_TRIES):  # a try whose workers got no study is run again (SHARING_TRIES)
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        if _pipeline_with_workers(folder, name, results, baseline, n_new, tmp_path / "alone"):
            return
    raise AssertionError(f"no worker got a study in {SHARING_TRIES} tries: the test did not exercise sharing")


def _pipeline_with_workers(folder, name, results, baseline, n_new, alone) -> bool:
    """One try of the pipeline search shared with two workers in ``folder``, held to the one-process run's
    results, measurements and tables; whether a worker took a study."""
    storage = f"journal:{folder / 'shared.log'}"
    workers = [subprocess.Popen(_freqopt("worker", "--storage", storage, *(["--study", name] if k == 0 else []),
                                         "--wait-s", "300", "--json", f"w{k}.json"), cwd=folder, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
               for k in range(2)]
    for w in workers:  # each polling the storage before the search starts
        _ready(w)
    leader = subprocess.run(_freqopt(*PIPELINE, "--storage", storage, "--out", "out", "--json", "r.json"), cwd=folder,
                            env=ENV, capture_output=True, text=True, timeout=1200,
                            preexec_fn=lambda: os.nice(19))  # fmt: skip
    assert leader.returncode == 0, leader.stderr
    assert f"freqopt worker --storage {storage} --study {name}" in leader.stderr, leader.stderr
    for w in workers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    reports = [json.loads((folder / f"w{k}.json").read_text()) for k in range(2)]
    shared_results, shared_baseline, leader_new = _pipeline_results(folder / "r.json")
    assert shared_results == results and shared_baseline == baseline
    assert leader_new + sum(r["n_new_measurements"] for r in reports) == n_new
    shared = sum(r["units"] for r in reports) > 0
    assert not shared or ("shared with workers: " in leader.stderr and "resumed" not in leader.stderr), leader.stderr
    # The tables are the one process's (their creation time and storage aside).
    tables = [json.loads(next(d.glob("*-instruction.json")).read_text()) for d in (folder / "out", alone)]
    for table in tables:
        table["provenance"].pop("created_utc"), table["provenance"].pop("storage")
    assert tables[0] == tables[1]
    return shared
