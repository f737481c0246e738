"""Files written whole or not at all: a temporary file in the target's folder, then an atomic rename, so a reader
never sees half a file (every file freqopt writes goes through ``atomic_write_bytes`` or ``atomic_write_text``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from freqopt.errors import OutputError

__all__ = ["atomic_write_bytes", "atomic_write_text"]


def _umask() -> int:
    """The process's file-mode creation mask.

    Read from the ``Umask:`` line of /proc/self/status (Linux 4.7 and later, proc(5)), which changes nothing.
    Elsewhere os.umask, which has no read-only form, is set and put back: a thread of the same process creating a
    file in that instant would get mode 022's permissions.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic rename, so a reader
    never sees half a file. The file's mode is what the umask gives a new file (0644 under the usual 022), as any
    other tool's output.

    Raises:
        OutputError: the folder cannot be written.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's file is 0600; a file written in place would honour the umask
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}; choose a writable path") from e


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically (atomic_write_bytes).

    Raises:
        OutputError: the folder cannot be written.
    """
    atomic_write_bytes(path, text.encode("utf-8"))
