"""Bring a database's schema to the newest revision (run when a writer opens it).

Several processes may open a database that does not exist yet at the same
moment (`tuner tune` started twice on a fresh file): creating tables and
stamping the Alembic version must then happen once. `init_lock` serialises it
across processes: a lock file beside a SQLite file, a session advisory lock
on PostgreSQL. Optuna's storage creates its own tables on first use and
takes the same lock (`db.store.Store.optuna_storage`).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine

_MIGRATIONS = Path(__file__).with_name("migrations")
# Our Alembic version table: Optuna keeps its own history in `alembic_version`.
VERSION_TABLE = "tuner_alembic_version"
# Any constant of our own: the advisory lock that serialises schema set-up on PostgreSQL.
_PG_LOCK_ID = 0x67656D6D


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@contextmanager
def init_lock(engine: Engine) -> Iterator[None]:
    """Hold the database's set-up lock (see the module doc)."""
    url = engine.url
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        fd = os.open(f"{url.database}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock
    elif url.get_backend_name() == "postgresql":
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({_PG_LOCK_ID})")
            try:
                yield
            finally:
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_PG_LOCK_ID})")
    else:
        yield


def revisions(conn: Connection) -> tuple[str | None, str]:
    """(the database's schema revision, this release's newest)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    return current, head


def upgrade(engine: Engine) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with init_lock(engine), engine.connect() as conn, foreign_keys_off(conn), conn.begin():
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def foreign_keys_off(conn: Connection) -> Iterator[None]:
    """SQLite's foreign key enforcement off for the block, on a connection
    that has not begun a transaction (inside one the pragma does nothing).
    A batch migration recreates a table where SQLite cannot alter it in
    place; dropping the old copy with enforcement on deletes every row that
    references it (winners, trials)."""
    if conn.dialect.name != "sqlite":
        yield
        return
    raw = conn.connection.dbapi_connection  # no autobegin, unlike conn.exec_driver_sql
    raw.execute("PRAGMA foreign_keys=OFF")
    try:
        yield
    finally:
        raw.execute("PRAGMA foreign_keys=ON")
