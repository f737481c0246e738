"""The default storage, an Optuna journal file under a flock (issue 25, item 2): a writer killed while holding
its lock does not block the next one, a record torn by a killed writer does not break the file, and processes
appending at once lose nothing."""

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest

from freqopt.errors import StorageError
from freqopt.search.storage import JournalFileFlock, cut_unfinished_line, default_storage_url, open_storage

HOLD = """
import sys, time
from freqopt.search.storage import JournalFileFlock
lock = JournalFileFlock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _holder(path):
    """A process that takes the journal's lock and keeps it; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_a_sigkilled_writer_holding_the_lock_does_not_block_the_next(tmp_path):
    path = tmp_path / "j.journal"
    path.touch()
    holder = _holder(path)
    try:
        # While the holder lives, the lock is exclusive: another process's writer waits, then gives up clearly.
        with pytest.raises(StorageError, match="another process has held the lock of journal .* for 0 s"):
            JournalFileFlock(str(path), timeout_s=0.3).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        lock = JournalFileFlock(str(path), timeout_s=5)
        started = time.monotonic()
        assert lock.acquire()
        assert time.monotonic() - started < 1  # at once: no grace period to wait out
        lock.release()
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.journal"]  # no lock file left behind


def test_the_lock_excludes_threads_of_one_process(tmp_path):
    """Two lock objects on one file in one process (two storages: the search and a worker's heartbeat) exclude
    each other (flock locks belong to open file descriptions, not processes)."""
    path = tmp_path / "j.journal"
    path.touch()
    first, second = JournalFileFlock(str(path)), JournalFileFlock(str(path), timeout_s=0.2)
    first.acquire()
    with pytest.raises(StorageError):
        second.acquire()
    first.release()
    assert second.acquire()
    second.release()


def _torn(path, keep_of_last: float):
    """Cut ``path`` inside its last line, as a writer killed in the middle of its append leaves it."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = start + max(1, int((len(data) - start) * keep_of_last))
    path.write_bytes(data[:cut])
    return data[start:]


@pytest.mark.parametrize("keep_of_last", [0.1, 0.5, 0.99])
def test_a_torn_final_record_does_not_break_reopening(tmp_path, keep_of_last):
    path = tmp_path / "j.journal"
    url = f"journal:{path}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    for k in range(5):
        study.set_user_attr(f"m:x#{k}", [k, 2.0 * k])
    torn = _torn(path, keep_of_last)
    assert b'"m:x#4"' in torn and not path.read_bytes().endswith(b"\n")
    # Reopened: the torn record reads as never written.
    study = optuna.load_study(study_name="s", storage=open_storage(url))
    assert set(study.user_attrs) == {f"m:x#{k}" for k in range(4)}
    study.set_user_attr("m:x#4", [4, 8.0])  # the resumed writer takes it again
    study.set_user_attr("m:x#5", [5, 10.0])
    lines = path.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") and json.loads(line) for line in lines)  # the fragment was cut, no line spoiled
    again = optuna.load_study(study_name="s", storage=open_storage(url))
    assert again.user_attrs == {f"m:x#{k}": [k, 2.0 * k] for k in range(6)}


def test_cut_unfinished_line(tmp_path):
    path = tmp_path / "f"
    for content, cut, left in [(b"", 0, b""), (b"a\n", 0, b"a\n"), (b"a\nbc", 2, b"a\n"), (b"abc", 3, b""),
                               (b"a\n" + b"x" * 200_000, 200_000, b"a\n")]:  # fmt: skip
        path.write_bytes(content)
        fd = os.open(path, os.O_RDWR)
        try:
            assert cut_unfinished_line(fd) == cut
        finally:
            os.close(fd)
        assert path.read_bytes() == left


APPEND = """
import sys, threading, optuna
from freqopt.search.storage import open_storage
url, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def write(thread):
    study = optuna.load_study(study_name="s", storage=open_storage(url))  # a storage (and lock) per thread
    for k in range(n):
        study.set_user_attr(f"m:{who}-{thread}#{k}", [k])
threads = [threading.Thread(target=write, args=(t,)) for t in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


@pytest.mark.slow
def test_processes_appending_at_once_lose_nothing(tmp_path):
    url, n = f"journal:{tmp_path / 'j.journal'}", 150
    optuna.create_study(study_name="s", storage=open_storage(url))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", APPEND, url, str(p), str(n)], env=env) for p in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    attrs = optuna.load_study(study_name="s", storage=open_storage(url)).user_attrs
    assert attrs == {f"m:{p}-{t}#{k}": [k] for p in range(3) for t in range(2) for k in range(n)}


def test_the_default_storage_is_a_journal_unless_an_earlier_sqlite_search_is_there(tmp_path):
    from freqopt.api import open_output

    out, url = open_output(tmp_path / "new", None)
    assert url == f"journal:{(tmp_path / 'new' / 'freqopt.journal').resolve()}" and (out / "freqopt.journal").exists()
    old = tmp_path / "old"
    optuna.create_study(study_name="s", storage=open_storage(f"sqlite:///{old.mkdir() or old / 'freqopt.db'}"))
    # A folder where a search began before the journal was the default resumes it from there.
    assert open_output(old, None)[1] == f"sqlite:///{old.resolve() / 'freqopt.db'}"
    assert default_storage_url(tmp_path / "new") == url  # once a journal is there, it stays
    assert open_output(tmp_path / "x", "sqlite:///" + str(tmp_path / "given.db"))[1].startswith("sqlite:")


def test_a_journal_storage_can_be_pickled(tmp_path):
    """As Optuna's JournalStorage can (joblib sends storages to its processes): the copy appends to the same file."""
    import pickle

    storage = open_storage(f"journal:{tmp_path / 'j.journal'}")
    optuna.create_study(study_name="s", storage=storage).set_user_attr("a", 1)
    copy = pickle.loads(pickle.dumps(storage))
    optuna.load_study(study_name="s", storage=copy).set_user_attr("b", 2)
    assert optuna.load_study(study_name="s", storage=storage).user_attrs == {"a": 1, "b": 2}


def test_journal_appends_without_waiting_for_the_disk_and_others_read_them(tmp_path, monkeypatch):
    """JournalFile.append_logs writes each batch under the lock with no fsync; a second storage opened on the same
    file (another process's view) reads every record."""
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    url = f"journal:{tmp_path / 'freqopt.journal'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    for x in range(3):
        trial = study.ask()
        study.tell(trial, float(x))
    assert synced == []
    again = optuna.load_study(study_name="s", storage=open_storage(url))
    assert [t.value for t in again.trials] == [0.0, 1.0, 2.0]
    assert (tmp_path / "freqopt.journal").read_bytes().endswith(b"\n")
