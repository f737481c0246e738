"""A throwaway PostgreSQL server on loopback for the multi-worker tests, from Debian's packages.

If no server binaries are installed, they are installed with apt-get (root only); the server runs as the
``postgres`` user that the Debian package creates (PostgreSQL refuses to run as root), with its data and socket in
a temporary directory, trust authentication, listening on 127.0.0.1 at a free port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def install() -> Path:
    """The server's bin directory, installing Debian's postgresql package first if needed.

    Raises:
        RuntimeError: not installed and cannot be (not root, or no apt-get).
    """
    bindir = _bindir()
    if bindir is not None:
        return bindir
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError("PostgreSQL is not installed and these tests need it: run `apt-get install postgresql` "
                           "as root (Debian), then run the tests again")  # fmt: skip
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "postgresql"], check=True, env=env,
                   capture_output=True)  # fmt: skip
    bindir = _bindir()
    if bindir is None:
        raise RuntimeError("apt-get installed postgresql but no initdb was found under /usr/lib/postgresql")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(database: str = "freqopt") -> Iterator[str]:
    """Start a server, create ``database``, yield its SQLAlchemy URL; stop and delete it on exit."""
    bindir = install()
    root = os.geteuid() == 0
    as_owner = ["runuser", "-u", "postgres", "--"] if root else []
    home = Path(tempfile.mkdtemp(prefix="freqopt-pg-"))
    if root:
        shutil.chown(home, "postgres")
    port = _free_port()
    data = home / "data"
    try:
        subprocess.run(as_owner + [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True)  # fmt: skip
        options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(as_owner + [str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(home / "log"),
                                   "-w", "start"], check=True, capture_output=True)  # fmt: skip
        try:
            subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database],
                           check=True, capture_output=True)  # fmt: skip
            yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{database}"
        finally:
            subprocess.run(as_owner + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                           capture_output=True)  # fmt: skip
    finally:
        shutil.rmtree(home, ignore_errors=True)
