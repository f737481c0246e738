"""A run's output, checked before any work is done: folders and files proved writable (by writing a file there,
which proves what permission bits cannot), and a run's Optuna storage opened before its output folder is made, so
that a bad argument leaves nothing behind. Errors are freqopt.errors.OutputError, whose messages begin with the
argument's name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from freqopt.errors import OutputError

__all__ = ["check_writable_dir", "check_writable_file", "open_output"]


def check_writable_dir(path: str | Path, *, argument: str = "out") -> Path:
    """Make folder ``path`` (with its parents) and prove it writable by creating and removing a file in it.

    Raises:
        OutputError: ``path`` is a file, or cannot be created or written; the message names ``argument``.
    """
    path = _check_dir_can_be_made(path, argument)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(path, argument, e) from e
    _probe(path, path, argument)
    return path


def _unwritable(path: Path, argument: str, e: OSError) -> OutputError:
    return OutputError(f"{argument} {path}: cannot write there ({e.strerror or e}); choose another directory",
                       argument=argument)  # fmt: skip


def _probe(folder: Path, path: Path, argument: str) -> None:
    """Create and remove a file in ``folder``, which proves what permission bits cannot (a root user, a read-only
    file system); OutputError about ``path`` if that fails."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".freqopt-write-check-"):
            pass
    except OSError as e:
        raise _unwritable(path, argument, e) from e


def _check_dir_can_be_made(path: str | Path, argument: str) -> Path:
    """Check, creating nothing (a file made and removed at once aside), that folder ``path`` exists and is
    writable, or can be made: its nearest existing ancestor is a writable folder. Raises OutputError as
    check_writable_dir."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{argument} {path} is a file; give a directory", argument=argument)
        existing = path.absolute()
        while not existing.exists():
            existing = existing.parent
    except OSError as e:
        raise _unwritable(path, argument, e) from e
    if not existing.is_dir():
        raise OutputError(f"{argument} {path}: cannot write there ({existing} is a file); choose another "
                          "directory", argument=argument)  # fmt: skip
    _probe(existing, path, argument)
    return path


def open_output(out: str | Path | None, storage: str | None, *, argument: str = "out") -> tuple[Path | None, str | None]:
    """Open a run's Optuna storage and make its output folder, in the order that leaves nothing behind when
    either is bad: ``out`` is checked without being made, a given ``storage`` is opened, and only then is ``out``
    made and, when no storage was given, the default one opened in it (journal:OUT/freqopt.journal, absolute:
    freqopt.search.storage.default_storage_url).

    Returns:
        (the folder as a Path, or None without ``out``; the storage URL, None for in memory).

    Raises:
        OutputError: ``out`` is a file, or cannot be made or written (the message names ``argument``).
        StorageError: the storage cannot be opened (freqopt.search.storage.open_storage).
    """
    from freqopt.search.storage import default_storage_url, open_storage

    if out is not None:
        _check_dir_can_be_made(out, argument)
    if storage is not None:
        open_storage(storage)
    if out is not None:
        out = check_writable_dir(out, argument=argument)
        if storage is None:
            storage = default_storage_url(out)
            open_storage(storage)
    return out, storage


def check_writable_file(path: str | Path, *, argument: str) -> Path:
    """Check that file ``path`` can be written before any work is done, so a long run does not fail at its very
    end: by creating (and removing) a file beside it, which proves what permission bits cannot (a root user, a
    read-only or pseudo file system such as /proc). Nothing is left behind.

    Raises:
        OutputError: ``path`` is a directory, or its folder is missing or not writable; the message names
            ``argument``.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputError(f"{argument} {path} is a directory; give a file path", argument=argument)
    if not parent.is_dir():
        raise OutputError(f"{argument} {path}: cannot write there ({parent} is not a directory); create it or "
                          "choose another path", argument=argument)  # fmt: skip
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as e:
        raise OutputError(f"{argument} {path}: cannot write there ({e.strerror or e}); choose a writable path",
                          argument=argument) from e  # fmt: skip
    return path
