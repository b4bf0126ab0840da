"""The tuning loop end to end through the real CLI, a real SQLite file and the model backend."""

import hashlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import ROOT, tuner
from tuner.backends.model import PER_TRIAL_ENV
from tuner.search.ladder import rungs

def count(db, table):
    con = sqlite3.connect(db)
    try:
        return con.execute(f"select count(*) from {table}").fetchone()[0]
    finally:
        con.close()


def winner_ms(db, n, k) -> set[int]:
    con = sqlite3.connect(db)
    try:
        return {m for (m,) in con.execute(
            "select k.m from tuner_winners w join tuner_keys k on k.id = w.key_id where k.n = ? and k.k = ?", (n, k))}
    finally:
        con.close()


def assert_ladder(db, n, k, ladder):
    """The family's winners are its ladder's rungs plus midpoints of its gaps (fill rungs)."""
    ms = winner_ms(db, n, k)
    assert set(ladder) <= ms
    assert ms - set(ladder) <= {round(math.sqrt(lo * hi)) for lo, hi in zip(ladder, ladder[1:])}


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


SMALL = "1,128 4096 4096 name=a\n512 2048 1024 name=b\n"


def test_tune_then_rerun_redoes_nothing(tmp_path):
    shapes = tmp_path / "s.txt"
    shapes.write_text(SMALL)
    db = tmp_path / "t.db"
    proc = tuner("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "12", db=db)
    assert proc.stdout == ""  # the maps are `show --family`'s
    assert [line.split("  ")[0] for line in proc.stderr.splitlines()[:2]] == ["a", "b"]
    maps = tuner("show", "--family", db=db).stdout
    assert "a: N=4096 K=4096" in maps and "b: N=2048 K=1024" in maps
    # Ladders: every power of two up to 128 (family a) and up to 512 (family b),
    # and the probe points of gaps next to a rung a kernel won.
    assert_ladder(db, 4096, 4096, rungs([1, 128]))
    assert_ladder(db, 2048, 1024, rungs([512]))
    trials, ranges = count(db, "tuner_trials"), count(db, "tuner_m_ranges")
    tuner("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "12", db=db)
    assert (count(db, "tuner_trials"), count(db, "tuner_m_ranges")) == (trials, ranges)


BAD_LINES = [
    ("4096 4096", "missing"),
    ("0 4096 4096", "positive"),
    ("-5 4096 4096", "positive"),
    ("12.5 4096 4096", "integer"),
    ("16 4096 4100", "multiple of 8"),
    ("16 4096 4096 dtype=fp8", "dtype"),
]


@pytest.mark.parametrize("line, words", BAD_LINES)
def test_bad_shape_line_fails_with_file_line_and_leaves_db_untouched(tmp_path, line, words):
    good = tmp_path / "good.txt"
    good.write_text("16 1024 1024\n")
    db = tmp_path / "t.db"
    tuner("tune", "--shapes", str(good), "--backend", "model", "--trials", "4", db=db)
    before = digest(db)
    bad = tmp_path / "bad.txt"
    bad.write_text(f"# header\n16 1024 1024\n{line}\n")
    proc = tuner("tune", "--shapes", str(bad), "--backend", "model", db=db, check=False)
    assert proc.returncode == 2
    text = " ".join((proc.stdout + proc.stderr).split())
    assert f"{bad}:3:" in text
    assert words in text.lower()
    assert digest(db) == before


def test_sigkill_mid_key_then_rerun_finishes_and_keeps_trials(tmp_path, monkeypatch):
    # The model searched as the GPU backend is: one Optuna trial at a time in
    # the database (a bulk model search stores a key only once it is done).
    monkeypatch.setenv(PER_TRIAL_ENV, "1")
    shapes = tmp_path / "s.txt"
    shapes.write_text("1,16,128,512,2048 8192 8192\n")
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", str(shapes), "--backend", "model",
           "--trials", "40", "--no-ladder"]
    # A model-backend trial runs for milliseconds: the kill must land while one
    # is RUNNING for the recovery to be tested, so try a few fresh databases.
    for attempt in range(5):
        db = tmp_path / f"t{attempt}.db"
        proc = subprocess.Popen([*cmd, "--db", str(db)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if _safe_count(db, "tuner_trials") >= 60 and _states(db).get("RUNNING"):
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if _states(db).get("RUNNING"):
            break
    kept = _safe_count(db, "tuner_trials")
    winners_before = _safe_count(db, "tuner_winners")
    assert kept >= 60 and winners_before < 5, "the kill must land in the middle of the file"
    assert _states(db).get("RUNNING") == 1, "no kill landed inside a trial"
    tuner("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "40", "--no-ladder", db=db)
    assert count(db, "tuner_winners") == 5
    assert count(db, "tuner_trials") >= kept
    # The trial that was running when the process died is closed, not left RUNNING.
    states = _states(db)
    assert "RUNNING" not in states and states.get("FAIL", 0) >= 1, states


def _states(db) -> dict:
    try:
        con = sqlite3.connect(db)
        try:
            return dict(con.execute("select state, count(*) from trials group by state").fetchall())
        finally:
            con.close()
    except sqlite3.OperationalError:
        return {}


def _safe_count(db, table):
    try:
        return count(db, table)
    except sqlite3.OperationalError:
        return 0


def test_two_processes_on_one_sqlite_file(tmp_path):
    shapes = tmp_path / "s.txt"
    shapes.write_text("1,16,128,512 4096 4096\n64 1024 8192\n")
    db = tmp_path / "t.db"
    tuner("tune", "--shapes", str(tmp_path / "s.txt"), "--backend", "model", "--trials", "1", "--no-ladder",
          db=db, check=False)  # creates the schema; the two below race on everything else
    for table in ("tuner_winners",):
        con = sqlite3.connect(db)
        con.execute(f"delete from {table}")
        con.commit()
        con.close()
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", str(shapes), "--backend", "model",
           "--trials", "30", "--force", "--no-ladder", "--db", str(db)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "locked" not in (out + err)
    assert count(db, "tuner_winners") == 5


def test_sm100_picks_dynamic_scheduler_on_imbalance_and_show_explains(tmp_path):
    shapes = tmp_path / "s.txt"
    shapes.write_text(
        "1024 1024 1024,32768,1024,32768 groups=4 name=seed000\n"
        "2560 2560 4096 held=20 name=held\n"
    )
    db = tmp_path / "t.db"
    tuner("tune", "--shapes", str(shapes), "--backend", "model", "--arch", "sm100", "--trials", "24",
          "--no-ladder", db=db)
    con = sqlite3.connect(db)
    rows = con.execute(
        "select k.name, w.scheduler, w.best_by_scheduler from tuner_winners w join tuner_keys k on k.id = w.key_id"
    ).fetchall()
    assert len(rows) == 2
    for name, sched, _ in rows:
        assert sched in ("clc", "dynamic_persistent"), (name, sched)
    shown = json.loads(tuner("show", "--arch", "sm100", "--json", db=db).stdout)["items"]
    for w in shown:
        assert {"static_persistent", "dynamic_persistent", "clc", "single_tile"} <= set(w["best_by_scheduler"])


def test_only_restricts_keys_by_name_glob(tmp_path):
    db = tmp_path / "t.db"
    out = tuner("tune", "--shapes", "gemma3.txt", "--only", "gemma3-27b.o", "--backend", "model",
                "--trials", "4", db=db).stderr
    assert_ladder(db, 5376, 4096, rungs([8192]))  # M = 1 to 8192: every power of two
    assert count(db, "tuner_winners") == len(winner_ms(db, 5376, 4096))
    assert "gemma3-27b.o" in out and "gemma3-1b" not in out
    proc = tuner("tune", "--shapes", "gemma3.txt", "--only", "nope*", db=db, check=False)
    assert proc.returncode == 2 and "no key" in proc.stdout + proc.stderr


def test_help_fits_80_columns_when_piped_and_cuts_no_summary():
    def help_of(*args):
        proc = subprocess.run([sys.executable, "-m", "tuner.cli", *args, "--help"], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "COLUMNS": "80"}, check=True)
        return proc.stdout

    top = help_of()
    listed = top.split("Commands:")[1]
    commands = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert "tune" in commands and "show" in commands
    assert "..." not in listed  # every command's summary whole
    for text in [top, *(help_of(c) for c in commands)]:
        assert max(map(len, text.splitlines())) <= 80, text


def test_tune_under_a_time_budget_ends_near_it_and_says_what_it_left_on_cublas(tmp_path, monkeypatch):
    shapes = tmp_path / "s.txt"
    shapes.write_text("1,512 4096 4096 name=small\n1,512 14336 4096 name=wide\n1,512 4096 14336 name=deep\n")
    monkeypatch.setenv("TUNER_MODEL_PER_TRIAL", "1")  # a trial at a time, as a GPU tune stores them
    proc = tuner("tune", "--shapes", str(shapes), "--backend", "model", "--budget-s", "1", "--json",
                 db=tmp_path / "t.db", columns=80)
    out = json.loads(proc.stdout)
    states = {f["name"]: f["state"] for f in out["families"]}
    assert set(states) == {"small", "wide", "deep"}
    left = [f for f in out["families"] if f["state"] == "unreached" or f["unreached_m"]]
    assert left, out["families"]
    assert out["totals"]["seconds"] < 8
    # Where each tuned family's time went, stage by stage (a deadline's order).
    for f in out["families"]:
        if f["state"] == "tuned":
            assert list(f["stages"]) == ["ladder", "fill", "deepen", "map"] and sum(f["stages"].values()) <= 8
    # The person reading stderr is told the same, in 80 columns.
    lines = proc.stderr.splitlines()
    assert any("not reached in the time budget" in line or "out of time" in line for line in lines)
    assert all(len(line) <= 80 for line in lines)
