"""An Optuna storage URL checked without opening it (nor importing Optuna, SQLAlchemy or PyTorch), so that a search,
a transfer or a worker refuses a wrong ``--storage`` at once, before the seconds those imports take;
freqopt.search.storage.open_storage opens it and runs the same checks first.

URLs (freqopt.search.storage.open_storage): ``journal:PATH`` (an Optuna journal file), or an SQLAlchemy URL
``dialect[+driver]://...`` (sqlite:///path.db, postgresql+psycopg://user@host/db, mysql+pymysql://...).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

from freqopt.errors import MissingDependencyError, StorageError, install_hint

__all__ = ["check_storage_url", "storage_file", "missing_driver_error", "POSTGRES_INSTALL", "URL_EXAMPLES"]

URL_EXAMPLES = "journal:path/to/freqopt.journal, sqlite:///path/to/freqopt.db or postgresql+psycopg://user@host/db"
# What installs the PostgreSQL driver (pyproject.toml's ``postgres`` extra: psycopg).
POSTGRES_INSTALL = install_hint("postgres")

# SQLAlchemy's built-in dialects -> {driver: the module it imports (its DBAPI)}, the dialect's default driver under
# None; from SQLAlchemy 2.0's dialect modules (sqlalchemy/dialects/*/*.py, each driver's ``import_dbapi``).
_DRIVERS: dict[str, dict[str | None, str]] = {
    "sqlite": {None: "sqlite3", "pysqlite": "sqlite3", "aiosqlite": "aiosqlite", "pysqlcipher": "sqlcipher3"},
    "postgresql": {None: "psycopg2", "psycopg2": "psycopg2", "psycopg": "psycopg", "psycopg2cffi": "psycopg2cffi",
                   "pg8000": "pg8000", "asyncpg": "asyncpg"},
    "mysql": {None: "MySQLdb", "mysqldb": "MySQLdb", "pymysql": "pymysql", "mysqlconnector": "mysql.connector",
              "asyncmy": "asyncmy", "aiomysql": "aiomysql", "mariadbconnector": "mariadb"},
    "mariadb": {None: "MySQLdb", "mysqldb": "MySQLdb", "pymysql": "pymysql", "mariadbconnector": "mariadb"},
}  # fmt: skip
# SQLAlchemy 2.0's built-in dialects (sqlalchemy/dialects/__init__.py's __all__); others come from packages that
# register them under the "sqlalchemy.dialects" entry-point group.
_BUILT_IN_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
# What installs each driver module (pip package), where its name is not the module's.
_PACKAGES = {"psycopg": "psycopg[binary]", "MySQLdb": "mysqlclient", "mysql.connector": "mysql-connector-python"}
_SCHEME = re.compile(r"^([A-Za-z0-9_]+)(?:\+([A-Za-z0-9_]+))?://")


def _cannot_open(url: str, reason: str) -> StorageError:
    """The one-line error of a storage URL that cannot be opened (open_storage's wording)."""
    return StorageError(f"cannot open Optuna storage {url!r} ({reason}); give a URL like {URL_EXAMPLES}")


def missing_driver_error(url: str, module: str) -> MissingDependencyError:
    """The error for ``url`` whose database driver ``module`` is not installed: it names what installs it
    (for PostgreSQL, freqopt's ``postgres`` extra: POSTGRES_INSTALL)."""
    if url.startswith("postgresql"):  # freqopt's extra installs psycopg; another driver is the user's choice
        package = shlex.quote(_PACKAGES.get(module, module))
        install = POSTGRES_INSTALL if module == "psycopg" else \
            f"{POSTGRES_INSTALL}, and write postgresql+psycopg://...; or pip install {package}"
    else:
        install = f"pip install {shlex.quote(_PACKAGES.get(module, module))}"
    return MissingDependencyError(f"Optuna storage {url!r} needs the database driver {module}, which is not "
                                  f"installed: {install}")


def storage_file(url: str | None) -> Path | None:
    """The file a storage URL keeps its studies in, where it is one: ``journal:PATH``'s PATH, an SQLite URL's
    database file (as given, not resolved); None for a server's database, in memory, or no URL."""
    if url is None:
        return None
    if url.startswith("journal:"):
        path = url.removeprefix("journal:").removeprefix("//")
        return Path(path).expanduser() if path else None
    match = _SCHEME.match(url)
    if match is None or match.group(1) != "sqlite":
        return None
    database = url[match.end():].split("?", 1)[0]
    # sqlite:///relative.db and sqlite:////absolute.db (SQLAlchemy: the path follows the third slash)
    database = database[1:] if database.startswith("/") else database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def check_storage_url(url: str | None) -> None:
    """Check that ``url`` could be opened, without opening it or making anything: a known form, a dialect SQLAlchemy
    has or an installed package registers, the driver of a built-in dialect installed (found, not imported), the
    folder of a journal or SQLite file present. Another driver, or a registered third-party dialect, is loaded
    through SQLAlchemy (importing it) to find out.

    Raises:
        StorageError: not a URL of a known form, no file after ``journal:``, an unknown dialect, or the folder of
            the file missing.
        MissingDependencyError: the database driver is not installed; the message says what installs it
            (PostgreSQL: POSTGRES_INSTALL).
    """
    if url is None:
        return
    if not isinstance(url, str):
        raise _cannot_open(repr(url), "not a string")
    if url.startswith("journal:"):
        if storage_file(url) is None:
            raise _cannot_open(url, "no file after journal:")
    else:
        match = _SCHEME.match(url)
        if match is None:
            raise _cannot_open(url, "not journal:PATH nor a database URL dialect://...")
        dialect, driver = match.group(1), match.group(2)
        module = _DRIVERS.get(dialect, {}).get(driver)
        if dialect not in _BUILT_IN_DIALECTS and not _registered(dialect, driver):
            raise _cannot_open(url, f"no database dialect {dialect!r}: SQLAlchemy has none, and no installed package "
                                    "registers one")  # fmt: skip
        if module is None:
            _check_through_sqlalchemy(url)
        elif importlib.util.find_spec(module.split(".")[0]) is None:
            raise missing_driver_error(url, module)
    path = storage_file(url)
    if path is not None and not path.parent.is_dir():
        raise _cannot_open(url, f"no folder {str(path.parent)!r}")


def _registered(dialect: str, driver: str | None) -> bool:
    """Whether an installed package registers SQLAlchemy dialect ``dialect`` (or ``dialect.driver``): the
    "sqlalchemy.dialects" entry points SQLAlchemy loads third-party dialects from (read, not imported)."""
    from importlib.metadata import entry_points

    names = {e.name for e in entry_points(group="sqlalchemy.dialects")}
    return dialect in names or f"{dialect}.{driver}" in names


def _check_through_sqlalchemy(url: str) -> None:
    """SQLAlchemy's own check of a dialect freqopt does not list: load it and import its driver."""
    import sqlalchemy

    try:
        dialect = sqlalchemy.engine.make_url(url).get_dialect()
    except Exception as e:  # ArgumentError (not a URL), NoSuchModuleError (no such dialect)
        raise _cannot_open(url, str(e).splitlines()[0] or type(e).__name__) from None
    try:
        dialect.import_dbapi()
    except ImportError as e:
        raise missing_driver_error(url, e.name or str(e)) from None
