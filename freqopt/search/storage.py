"""Where a search keeps its studies: the Optuna storage, the study names and the validation log."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file

from freqopt.errors import StorageError
from freqopt.search.journal import MeasurementLog
from freqopt.storage_url import URL_EXAMPLES, check_storage_url, missing_driver_error
from freqopt.workload.kernels import Trace

__all__ = ["open_storage", "default_storage_url", "JournalFile", "JournalFileFlock", "cut_unfinished_line",
           "study_prefix", "validation_log", "DEFAULT_JOURNAL", "LOCK_TIMEOUT_S"]

DEFAULT_JOURNAL = "freqopt.journal"  # the default storage's file in a search's output folder
_LEGACY_SQLITE = "freqopt.db"  # an older default: still used when a folder holds one and no journal
LOCK_TIMEOUT_S = 60.0  # how long a writer waits for another process's lock, as SQLite's busy timeout (open_storage)


def default_storage_url(out) -> str:
    """The storage a search in folder ``out`` uses when none is given: ``journal:OUT/freqopt.journal`` (absolute).

    A folder that holds an SQLite ``freqopt.db`` and no journal (a search begun by a freqopt whose default storage
    was SQLite) keeps ``sqlite:///OUT/freqopt.db``, so that the same command resumes that search.
    """
    out = Path(out).resolve()
    if (out / _LEGACY_SQLITE).exists() and not (out / DEFAULT_JOURNAL).exists():
        return f"sqlite:///{out / _LEGACY_SQLITE}"
    return f"journal:{out / DEFAULT_JOURNAL}"


def open_storage(url: str | None):
    """The Optuna storage at ``url``, opened once and shared by every study of a search.

    URLs: None (in memory); journal:PATH for optuna.storages.JournalStorage on a JournalFile (an append-only
    file that the processes of one machine share through its lock; no server needed; the default of a search
    with an output folder, default_storage_url); or an SQLAlchemy URL for optuna.storages.RDBStorage
    (sqlite:///path.db, postgresql+psycopg://user@host/db, mysql+pymysql://...; SQLite waits up to 60 s for
    another process's lock), which a database server shares across machines.

    Raises:
        StorageError: the URL cannot be opened (unknown scheme, missing folder, unreachable server).
        MissingDependencyError: the database driver is not installed; the message names what installs it
            (PostgreSQL: freqopt's ``postgres`` extra, psycopg; freqopt.storage_url.check_storage_url).
    """
    if url is None:
        return None
    check_storage_url(url)  # the checks that need nothing opened, as the command line runs them before any import
    try:
        if url.startswith("journal:"):
            path = url.removeprefix("journal:").removeprefix("//")
            if not path:
                raise ValueError("no file after journal:")
            return optuna.storages.JournalStorage(JournalFile(path))
        import sqlalchemy  # only for a database URL: half a second of imports that a journal does without

        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        for attempt in range(5):
            try:
                storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
                if url.startswith("sqlite"):
                    sqlalchemy.event.listen(storage.engine, "connect", _sqlite_write_ahead_log)
                    storage.engine.dispose()  # connections opened while creating the tables get it too
                return storage
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):  # processes creating a new
                # database's tables at once collide ("duplicate key", "relation already exists"): the tables exist now
                if attempt == 4:
                    raise
                time.sleep(0.5 * (attempt + 1))
    except ImportError as e:  # a driver that check_storage_url found but that fails to import (a broken install)
        raise missing_driver_error(url, e.name or str(e)) from e
    except Exception as e:  # SQLAlchemy, the drivers and the file system raise many kinds; all mean "cannot open"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StorageError(f"cannot open Optuna storage {url!r} ({reason}); give a URL like {URL_EXAMPLES}") from e


class JournalFileFlock(BaseJournalFileLock):
    """An exclusive flock(2) on the journal file itself: a lock that a killed process cannot leave held.

    Optuna's own journal locks (JournalFileSymlinkLock, JournalFileOpenLock in
    optuna/storages/journal/_file.py) are files that exist while the lock is held: a writer killed between
    creating and removing one (SIGKILL) leaves it behind, and every other writer then waits out a 30 s grace
    period before breaking it. A flock belongs to an open file description, and the kernel releases it when the
    description's last descriptor is closed, which includes the process dying (flock(2) man page), so the next
    writer gets the lock at once, and no lock file is ever left behind. Each acquire opens a descriptor of its
    own: flocks on two descriptions of one file exclude each other even within one process, so processes and
    threads sharing a storage (the workers' heartbeat thread) are both serialized. On NFS, Linux emulates flock
    with POSIX byte-range locks (flock(2), NOTES).

    Optuna 5.0 defines the interface (acquire, release) as BaseJournalFileLock in that private module;
    JournalFileBackend only calls it around each append.

    Args:
        path: the journal file (it must exist; JournalFileBackend creates it).
        timeout_s: how long acquire() waits for a lock that another live process holds.
        on_acquire: called with the locked descriptor (open for reading and writing) each time the lock is taken,
            before the caller's work (JournalFile mends a torn final record there).

    Raises (acquire):
        StorageError: another process held the lock for ``timeout_s`` (a stopped or hung process).
    """

    def __init__(self, path: str, timeout_s: float = LOCK_TIMEOUT_S, on_acquire=None):
        self.path, self.timeout_s, self.on_acquire = path, timeout_s, on_acquire
        self._fd: int | None = None
        self._thread_lock = threading.Lock()  # guards _fd between threads sharing this object

    def __getstate__(self) -> dict:  # JournalStorage pickles its backend (to joblib processes): not held there
        return {"path": self.path, "timeout_s": self.timeout_s, "on_acquire": self.on_acquire}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def acquire(self) -> bool:
        self._thread_lock.acquire()
        fd = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._flock(fd)
            if self.on_acquire is not None:
                self.on_acquire(fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            self._thread_lock.release()
            raise
        self._fd = fd
        return True

    def _flock(self, fd: int) -> None:
        deadline, sleep_s = time.monotonic() + self.timeout_s, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:  # EWOULDBLOCK: another description holds it
                pass
            if time.monotonic() > deadline:
                raise StorageError(f"another process has held the lock of journal {self.path} for "
                                   f"{self.timeout_s:.0f} s; stop or resume that process, or give another storage")
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, 0.05)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                os.close(fd)  # closing the description's only descriptor releases its flock
        finally:
            self._thread_lock.release()


class JournalFile(JournalFileBackend):
    """Optuna's JournalFileBackend under a JournalFileFlock that mends a record torn by a killed writer.

    Optuna appends each batch of operations as JSON lines with one write and an fsync, under the lock
    (JournalFileBackend.append_logs, optuna/storages/journal/_file.py). A writer killed inside that write can
    leave a prefix of it (Linux ends a write to a regular file early, between pages, when a fatal signal is
    pending: generic_perform_write, mm/filemap.c), and the file then ends in part of a line. Optuna's reader
    skips an unfinished last line (JournalFileBackend.read_logs), so such a file opens and reads as if the torn
    record had never been written; but the next append would go after the fragment, the two would read as one
    undecodable line, and every later read of the file would raise. So each time the lock is taken, before
    Optuna appends, the file is cut back to its last complete line: every writer appends under the lock, so an
    unfinished line seen while holding it is a dead writer's. The torn operation is lost as if never written; its
    writer died before the write returned, so nothing acted on it (MeasurementLog logs a measurement before the
    search uses it: a resumed search takes it again, with the same sample index).

    Args:
        path: the journal file; created if missing (its folder must exist).
        timeout_s: JournalFileFlock's wait for another process's lock.
    """

    def __init__(self, path: str, timeout_s: float = LOCK_TIMEOUT_S):
        super().__init__(path, lock_obj=JournalFileFlock(path, timeout_s, on_acquire=cut_unfinished_line))

    def append_logs(self, logs: list[dict]) -> None:
        """JournalFileBackend.append_logs (the same lock, the same JSON lines in one write) without its fsync.

        A search appends after every measurement, and an fsync each time waited for the disk: 2,000 of them, a
        sixth of the main job's time on a busy machine. A write that returned is the operating system's to keep:
        it survives the process being killed (SIGKILL included) and is what every other process reading the file
        sees; only a power loss may lose the last records, which a resumed search measures again (the file is cut
        back to its last complete line: cut_unfinished_line). This is the durability the SQLite storage has in
        write-ahead-log mode with synchronous=NORMAL (_sqlite_write_ahead_log).
        """
        text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
        with get_lock_file(self._lock), open(self._file_path, "ab") as f:
            f.write(text.encode("utf-8"))


def cut_unfinished_line(fd: int) -> int:
    """Truncate the file open as ``fd`` (for writing) after its last newline, if anything follows it; returns the
    bytes cut (0: none). Only safe while no one else may append (JournalFile calls it under the journal's lock)."""
    end = os.fstat(fd).st_size
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":  # the common case: one byte read
        return 0
    position, keep = end, 0
    while position > 0:  # the last newline, reading backwards
        start = max(0, position - 65536)
        newline = os.pread(fd, position - start, start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        position = start
    os.ftruncate(fd, keep)
    os.fsync(fd)
    return end - keep


def _sqlite_write_ahead_log(dbapi_connection, _connection_record) -> None:
    """SQLite in write-ahead-log mode with ``synchronous=NORMAL`` (https://www.sqlite.org/wal.html).

    A search commits after every measurement (thousands of small transactions). In SQLite's default mode each
    commit waits for the disk (fsync), which cost 7 of the main job's 50.6 s (experiments/search_speed); in WAL
    mode with NORMAL synchronization a commit is an append to the log, synchronized at checkpoints. A committed
    measurement survives the process being killed (SIGKILL included: the log is the operating system's to
    write); only a power loss may lose the last few, which a resumed search measures again. Readers no longer
    block the writer, so processes sharing the file wait less for its lock.
    """
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def study_prefix(trace: Trace, spec, seed: int) -> str:
    """A study-name prefix unique to the workload (model, micro-batch, layout, mode), the GPU type (with all its constants, so a recalibrated GPU
    does not resume studies measured under the old ones) and the seed, so one storage can hold many searches."""
    w = trace.workload
    ident = f"{w.model}|{w.config}|{w.micro_batch_size}|{w.layout!r}|{trace.meta.get('mode', 'train')}|{spec!r}|{seed}"
    layout = "" if w.layout.is_single_gpu else f"-dp{w.layout.dp}tp{w.layout.tp}"
    return f"{w.model}{layout}-{spec.name}-{hashlib.sha1(ident.encode()).hexdigest()[:8]}"


def validation_log(storage, prefix: str) -> MeasurementLog:
    """The log of a search's whole-iteration measurements: study ``<prefix>-validation`` in ``storage``."""
    return MeasurementLog(optuna.create_study(study_name=f"{prefix}-validation", storage=storage, load_if_exists=True))


_STORAGES: dict[str, object] = {}


def storage_here(url: str):
    """``url`` opened once per process (joblib workers open their own connection)."""
    if url not in _STORAGES:
        _STORAGES[url] = open_storage(url)
    return _STORAGES[url]
