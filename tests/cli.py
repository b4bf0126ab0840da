"""The `tuner` command line run as a shell script runs it: a subprocess
whose output is piped (no terminal, no colour forced)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TERMINAL_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def tuner(*args, db, check=True, columns: int = 200, **kw) -> subprocess.CompletedProcess:
    """`tuner ARGS --db DB`; a failure raises with both streams when `check`."""
    cmd = [sys.executable, "-m", "tuner.cli", *args, "--db", str(db)]
    env = {k: v for k, v in os.environ.items() if k not in _TERMINAL_ENV}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**env, "COLUMNS": str(columns)}, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
