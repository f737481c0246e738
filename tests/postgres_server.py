"""A throwaway PostgreSQL server for the multi-worker tests: the ``pgserver`` package (PostgreSQL's own binaries in a
wheel, started in a temporary data directory on a Unix socket; it switches to an unprivileged user itself where the
tests run as root, which PostgreSQL refuses), reached through the ``psycopg`` driver, as a user's
``--storage postgresql+psycopg://...`` is. It starts in about a second and is deleted on exit.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def server(database: str = "freqopt") -> Iterator[str]:
    """Start a server, create ``database``, yield its SQLAlchemy URL (postgresql+psycopg://...); stop the server
    and delete its data on exit."""
    if "XDG_RUNTIME_DIR" not in os.environ:
        # pgserver keeps its locks in the user's runtime folder, looked up as it is imported; platformdirs warns
        # where none is set (CI, containers) and falls back to a folder of its own: name that one ourselves.
        runtime = os.path.join(tempfile.gettempdir(), f"freqopt-runtime-{os.getuid()}")
        os.makedirs(runtime, exist_ok=True)
        os.chmod(runtime, 0o700)  # what platformdirs asks of a runtime folder
        os.environ["XDG_RUNTIME_DIR"] = runtime
    import pgserver

    home = tempfile.mkdtemp(prefix="freqopt-pg-")
    try:
        pg = pgserver.get_server(home, cleanup_mode="delete")
        try:
            pg.psql(f"CREATE DATABASE {database};")
            yield pg.get_uri(database).replace("postgresql://", "postgresql+psycopg://", 1)
        finally:
            pg.cleanup()
    finally:
        shutil.rmtree(home, ignore_errors=True)
