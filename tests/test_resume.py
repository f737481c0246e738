"""A search killed at any point and started again with the same command continues from its storage: no finished
measurement is repeated or lost, and the result is the same as an uninterrupted run's (issue 6, item 4)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.search import SearchConfig, run_search


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing in the search can catch it."""


class CountingGPU(SimulatedGPU):
    """A simulated GPU that counts finished measurements and dies when asked for measurement number ``die_at``."""

    def __init__(self, die_at=None):
        # Switches within 1 ms: at the H100's 26 ms the small trace's step could realize one clock only, and its
        # pass level would not be measured.
        super().__init__(dataclasses.replace(get_gpu("h100-sxm"), clock_switch_s=0.001), seed=5)
        self.die_at, self.finished = die_at, 0

    def _count(self):
        if self.die_at is not None and self.finished + 1 == self.die_at:
            raise Crash()
        self.finished += 1

    def measure(self, *args, **kwargs):
        self._count()
        return super().measure(*args, **kwargs)

    def measure_schedule(self, *args, **kwargs):
        self._count()
        return super().measure_schedule(*args, **kwargs)


def _summary(result):
    return {g: (r.units, r.validated, r.predicted, r.ideal, r.n_measurements, r.search_cost_gpu_s)
            for g, r in result.results.items()}  # fmt: skip


CONFIG = dict(max_slowdown=0.02, n_trials_1d=8, granularities=("power-cap", "iteration", "pass"))


@pytest.fixture(scope="module")
def uninterrupted(small_trace, tmp_path_factory):
    gpu = CountingGPU()
    storage = f"sqlite:///{tmp_path_factory.mktemp('whole') / 's.db'}"
    result = run_search(small_trace, gpu, SearchConfig(storage=storage, **CONFIG))
    return result, gpu.finished


STORAGES = {"sqlite": "sqlite:///{tmp}/s.db", "journal": "journal:{tmp}/s.journal"}  # SQLite, and the default


@pytest.mark.slow
@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("die_at", [[1], [7, 30], [12, 13, 40, 30]])
def test_killed_search_resumes_without_repeating_a_measurement(small_trace, tmp_path, uninterrupted, die_at, storage):
    """Die at the given measurement numbers of successive runs (a unit's trial, a finalist's repeat, a
    validation), then finish: the measurements taken add up to the uninterrupted run's and the result is equal."""
    expected, n_expected = uninterrupted
    config = SearchConfig(storage=STORAGES[storage].format(tmp=tmp_path), **CONFIG)
    finished = 0
    for n in die_at:
        gpu = CountingGPU(die_at=n)
        with pytest.raises(Crash):
            run_search(small_trace, gpu, config)
        finished += gpu.finished
    gpu = CountingGPU()
    result = run_search(small_trace, gpu, config)
    assert finished + gpu.finished == n_expected  # none repeated (more) and none lost (it would be re-taken: more)
    # What the killed runs took, the last one read back (the CLI's "resumed: N measurements" line); a fresh run none.
    assert (result.n_stored_measurements, result.n_new_measurements) == (finished, gpu.finished)
    assert expected.n_stored_measurements == 0 and expected.n_new_measurements == n_expected
    assert _summary(result) == _summary(expected)
    assert result.baseline == expected.baseline


@pytest.mark.slow
def test_a_record_torn_by_a_kill_mid_append_is_measured_again(small_trace, tmp_path, uninterrupted):
    """A journal whose last record was cut in the middle (a writer killed inside its append) resumes to the same
    result: the torn operation reads as never written (freqopt.search.storage.JournalFile)."""
    expected, n_expected = uninterrupted
    path = tmp_path / "s.journal"
    config = SearchConfig(storage=f"journal:{path}", **CONFIG)
    gpu = CountingGPU(die_at=20)
    with pytest.raises(Crash):
        run_search(small_trace, gpu, config)
    # The file as a kill in the middle of appending the last measurement's record leaves it: that record's first
    # half, and nothing after it.
    data = path.read_bytes()
    start = data.rindex(b'"user_attr":{"m:')
    start, end = data.rindex(b"\n", 0, start) + 1, data.index(b"\n", start) + 1
    path.write_bytes(data[:(start + end) // 2])
    again = CountingGPU()
    result = run_search(small_trace, again, config)
    assert gpu.finished + again.finished == n_expected + 1  # the torn measurement, taken again
    assert result.n_stored_measurements == gpu.finished - 1
    assert _summary(result) == _summary(expected) and result.baseline == expected.baseline


def _search_command(args, json_path):
    return [sys.executable, "-m", "freqopt.cli", "search", *args, "--out", "out", "--json", str(json_path)]


def _logged_measurements(journal) -> int:
    """Measurements logged in a search's journal file so far (study user attributes, freqopt/search/journal.py,
    one line each in Optuna's journal)."""
    if not journal.exists():
        return 0
    return journal.read_bytes().count(b'"user_attr":{"m:')


@pytest.mark.slow
def test_sigkilled_cli_search_resumes_to_the_same_result(tmp_path, kernel_search_cli):
    """The same command killed (SIGKILL) at several points and run again ends with the uninterrupted run's JSON
    (conftest.kernel_search_cli, in a folder of its own with the same relative --out), in its default storage, the
    journal file, which a kill may leave locked or in the middle of a record."""
    env = {**os.environ, "COLUMNS": "200"}
    killed = tmp_path / "killed"
    killed.mkdir()
    command = _search_command(kernel_search_cli["args"], killed / "r.json")
    kills = 0
    db = killed / "out" / "freqopt.journal"
    for extra_s in (0.0, 1.5, 0.5, 2.5):  # SIGKILL mid-run, at a different point each time
        proc = subprocess.Popen(command, cwd=killed, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        # Kill once this run has logged measurements of its own: a fixed delay can fall inside start-up (importing
        # torch and tracing) on a loaded machine, and then no run is killed mid-search at all.
        before = _logged_measurements(db)
        deadline = time.monotonic() + 300
        while proc.poll() is None and _logged_measurements(db) <= before + 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(extra_s)
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 2, "the search finished before it could be killed twice"
    last = subprocess.run(command, cwd=killed, env=env, check=True, capture_output=True, text=True, timeout=600)
    resumed, uninterrupted = json.loads((killed / "r.json").read_text()), dict(kernel_search_cli["summary"])
    # Measurements the last run took itself: fewer than the whole search's (the killed runs' are read back), and
    # it says how many it read back.
    n_new = resumed.pop("n_new_measurements")
    assert n_new < uninterrupted.pop("n_new_measurements")
    assert f"measurements read back from journal:{db}, {n_new} new" in last.stderr
    assert "resumed:" not in kernel_search_cli["stderr"]
    assert resumed == uninterrupted


def test_sqlite_storage_is_in_write_ahead_log_mode(tmp_path):
    import sqlite3

    import optuna

    from freqopt.search.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    optuna.create_study(study_name="s", storage=storage).set_user_attr("m:x#0", [1.0, 2.0, 0.1, 1980])
    with sqlite3.connect(tmp_path / "s.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert optuna.load_study(study_name="s", storage=storage).user_attrs == {"m:x#0": [1.0, 2.0, 0.1, 1980]}
