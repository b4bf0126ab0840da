"""Where the database lives and how we connect to it.

The embedded default is a SQLite file at `default_url()`; `--db URL` or the
TUNER_DB environment variable points elsewhere (another file, or PostgreSQL
for several tuning hosts). SQLite runs in WAL mode with a busy timeout, and
every write transaction starts with BEGIN IMMEDIATE: a deferred transaction
that reads first and then writes can fail at once with "database is locked"
when another process committed in between, whatever the timeout.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

ENV_VAR = "TUNER_DB"
BUSY_TIMEOUT_S = 60


def default_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "gemm-tuner" / "tuner.db"


def default_url() -> str:
    return f"sqlite:///{default_path()}"


def resolve_url(url: str | None = None) -> str:
    """`url`, else $TUNER_DB, else the default file. A bare path means a SQLite file;
    a `postgresql://` URL is driven by psycopg (v3)."""
    url = url or os.environ.get(ENV_VAR) or default_url()
    if "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().resolve()}"
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        # A plain PostgreSQL URL gets the driver the `postgres` extra installs
        # (SQLAlchemy's default for the scheme is psycopg2).
        url = f"postgresql+psycopg{sep}{rest}"
    return url


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for other databases and in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def writable(url: str) -> bool:
    """Whether opening `url` for writing can work: for a SQLite file, that it
    (or, before it exists, its directory) may be written."""
    path = sqlite_path(url)
    if path is None:
        return True
    if path.exists():
        return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    return not path.parent.exists() or os.access(path.parent, os.W_OK)


def engine_kwargs(url: str) -> dict:
    """Keyword arguments for create_engine, shared with Optuna's storage engine."""
    if make_url(url).get_backend_name() == "sqlite":
        # isolation_level=None hands transaction control to the listeners below.
        return {"connect_args": {"timeout": BUSY_TIMEOUT_S, "isolation_level": None}}
    return {"pool_pre_ping": True}


def make_engine(url: str, *, writer: bool = True) -> Engine:
    """An engine for `url`. Readers (the HTTP service, `show`, `gemm`) keep
    SQLite's deferred BEGIN so that they never wait behind a writer under WAL,
    and open the file read-only: they work on a read-only file or directory."""
    path = sqlite_path(url)
    if path is not None and writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    if path is not None and not writer:
        # A WAL database read where nothing may be written (a read-only file
        # or directory) cannot get its shared-memory file: open it immutable,
        # which no writer can contradict there.
        url = f"sqlite:///file:{path}?mode=ro{'' if writable(url) else '&immutable=1'}&uri=true"
    engine = create_engine(url, **engine_kwargs(url))
    configure(engine, writer=writer)
    return engine


def configure(engine: Engine, *, writer: bool = True) -> None:
    """Attach the SQLite transaction handling to `engine` (ours or Optuna's)."""
    if engine.dialect.name != "sqlite":
        return
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"
    event.listen(engine, "connect", _writer_pragmas if writer else _reader_pragmas)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql(begin))


def _writer_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    _reader_pragmas(dbapi_conn, _record)
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _reader_pragmas(dbapi_conn, _record) -> None:
    # Nothing here writes: a reader may hold a read-only file.
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
    cur.close()

