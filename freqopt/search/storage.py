"""Where a search keeps its studies: the Optuna storage, the study names and the validation log."""

from __future__ import annotations

import hashlib
import time

from freqopt.errors import StorageError
from freqopt.workload.kernels import Trace
from freqopt.search.journal import MeasurementLog

__all__ = ["open_storage", "study_prefix", "validation_log"]


def open_storage(url: str | None):
    """The Optuna storage at ``url``, opened once and shared by every study of a search.

    URLs: None (in memory); an SQLAlchemy URL for optuna.storages.RDBStorage (sqlite:///path.db,
    postgresql+psycopg2://user@host/db, mysql+pymysql://...; SQLite waits up to 60 s for another process's
    lock); or journal:PATH for optuna.storages.JournalStorage on a JournalFileBackend (an append-only file that
    several processes share through its lock; no server needed).

    Raises:
        StorageError: the URL cannot be opened (unknown scheme, missing folder, unreachable server).
    """
    import optuna
    import sqlalchemy

    if url is None:
        return None
    try:
        if url.startswith("journal:"):
            path = url.removeprefix("journal:").removeprefix("//")
            if not path:
                raise ValueError("no file after journal:")
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(path))
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
    except Exception as e:  # SQLAlchemy, the drivers and the file system raise many kinds; all mean "cannot open"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StorageError(
            f"cannot open Optuna storage {url!r} ({reason}); give a URL like sqlite:///path/to/freqopt.db, "
            "postgresql+psycopg2://user@host/db or journal:path/to/journal.log"
        ) from e


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
    import optuna

    return MeasurementLog(optuna.create_study(study_name=f"{prefix}-validation", storage=storage, load_if_exists=True))


_STORAGES: dict[str, object] = {}


def _storage_here(url: str):
    """``url`` opened once per process (joblib workers open their own connection)."""
    if url not in _STORAGES:
        _STORAGES[url] = open_storage(url)
    return _STORAGES[url]
