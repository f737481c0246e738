"""Many workers, one search (issue 6, item 5): `freqopt worker` processes join a search through its Optuna
storage (a real PostgreSQL server on loopback, and a journal file), and `--jobs` runs units in joblib processes.
The result is the one-process result, and every measurement is taken exactly once across all processes."""

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


def _search_with_workers(tmp_path, storage, one_process, n_workers=2):
    workers = [
        subprocess.Popen(_freqopt("worker", "--storage", storage, "--study", one_process["name"], "--wait-s", "300",
                                  "--json", f"w{k}.json"), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for k in range(n_workers)
    ]
    leader = subprocess.run(_freqopt("search", *one_process["args"], "--storage", storage, "--out", "out", "--json", "r.json"),
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=1200)  # fmt: skip
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
    assert sum(r["units"] for r in reports) > 0, "no worker got a unit: the test did not exercise sharing"
    return reports


def test_workers_share_a_search_through_postgresql(tmp_path, one_process):
    with server() as url:
        _search_with_workers(tmp_path, url, one_process)


def test_workers_share_a_search_through_a_journal_file(tmp_path, one_process):
    _search_with_workers(tmp_path, f"journal:{tmp_path / 'journal.log'}", one_process)


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


@pytest.mark.parametrize("args, message", [
    (["--storage", "journal:{tmp}/none.log", "--study", "nothing", "--wait-s", "0"], "no freqopt search named"),
    (["--storage", "sqlite:///{tmp}/missing/x.db", "--study", "s"], "cannot open Optuna storage"),
    (["--storage", "journal:{tmp}/none.log", "--study", "s", "--backend", "gpu9"], "unknown backend"),
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
