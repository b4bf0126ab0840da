"""A throw-away PostgreSQL server for the tests: `initdb` and `pg_ctl` in a
temporary directory, listening only on a unix socket there (on a free port
number, so the socket name cannot clash with another server's).

Without the server binaries or psycopg the tests that need it are skipped,
naming what is missing; with TUNER_TEST_POSTGRES=require (CI sets it) they
fail instead, so a CI run cannot pass without having run them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

REQUIRE_ENV = "TUNER_TEST_POSTGRES"
# initdb refuses to run as root: as root the server runs as this user.
_SERVER_USER = "postgres"


class PostgresServer:
    def __init__(self) -> None:
        self.bin = _binaries()
        self.dir = Path(tempfile.mkdtemp(prefix="tuner-pg-"))
        self.port = _free_port()
        self._as = _run_as()
        if self._as is not None:
            os.chown(self.dir, self._as.pw_uid, self._as.pw_gid)
        data = self.dir / "data"
        self._run(self.bin["initdb"], "-D", str(data), "-U", "tuner", "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")
        self._run(self.bin["pg_ctl"], "-D", str(data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                  "-o", f"-k {self.dir} -p {self.port} -c listen_addresses='' -c fsync=off "
                        "-c max_connections=200", "start")
        self._data = data

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://tuner@/{database}?host={self.dir}&port={self.port}"

    def new_database(self) -> str:
        """A fresh empty database on this server; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host=str(self.dir), port=self.port, user="tuner", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run(self.bin["pg_ctl"], "-D", str(self._data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, *cmd: str) -> None:
        prefix = []
        if self._as is not None:
            prefix = ["setpriv", f"--reuid={self._as.pw_uid}", f"--regid={self._as.pw_gid}", "--clear-groups"]
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, cwd=self.dir)
        if done.returncode != 0:
            log = self.dir / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}{tail}")


def unavailable() -> str | None:
    """Why a server cannot be started here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    try:
        _binaries()
    except FileNotFoundError as exc:
        return str(exc)
    if os.geteuid() == 0 and (_run_as() is None or shutil.which("setpriv") is None):
        return f"running as root, and no {_SERVER_USER!r} user or no setpriv to run the server as it"
    return None


def start_or_skip() -> PostgresServer:
    reason = unavailable()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "require":
            pytest.fail(f"{REQUIRE_ENV}=require but PostgreSQL is unavailable: {reason}")
        pytest.skip(f"no PostgreSQL server for the tests: {reason}")
    return PostgresServer()


def _binaries() -> dict[str, str]:
    found = {name: shutil.which(name) for name in ("initdb", "pg_ctl")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise FileNotFoundError(f"PostgreSQL server binaries not on PATH: {', '.join(missing)} "
                                "(install the PostgreSQL server and put its bin directory on PATH)")
    return found


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(_SERVER_USER)
    except KeyError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
