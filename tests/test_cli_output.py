"""What the CLI prints for a person and for a script: `tune` piped (a line a
family, a totals line, nothing to do on a rerun, `--json`), `show` when it
cuts at --limit, `serve` saying where it listens and what it serves."""

import json
import queue
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.cli import ROOT, tuner as run_tuner

SHAPES = "1,16 1024 1024 name=a\n64 2048 1024 name=b\n"
# A family line, e.g. "a  9 rungs tuned, map 2 spans, best 1.14x, 0.4 s".
FAMILY = re.compile(r"^(\S+)  (\d+) rungs? tuned, map (\d+) spans?, best \d+\.\d\dx, \d+(\.\d)? s$")


def tuner(*args, db, check=True):
    return run_tuner(*args, db=db, check=check, columns=80)


def count(db, sql):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database tuned from SHAPES, and that first run's output."""
    d = tmp_path_factory.mktemp("out")
    shapes = d / "s.txt"
    shapes.write_text(SHAPES)
    db = d / "t.db"
    first = tuner("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "3", db=db)
    return shapes, db, first


def copy(tuned, tmp_path):
    shapes, db, _ = tuned
    mine = tmp_path / "t.db"
    shutil.copy(db, mine)
    return shapes, mine


def test_piped_tune_prints_a_line_a_family_and_the_totals_and_nothing_else(tuned):
    _, db, first = tuned
    assert first.stdout == ""  # the maps are `show --family`'s; stdout is --json's
    err = first.stderr
    assert "\x1b" not in err and "\r" not in err  # no redraws, no colour
    lines = err.splitlines()
    assert len(lines) == 3, err
    families = [FAMILY.match(line) for line in lines[:2]]
    assert all(families), lines
    assert [f.group(1) for f in families] == ["a", "b"]
    rungs = sum(int(f.group(2)) for f in families)
    assert rungs == count(db, "select count(*) from tuner_winners")
    assert re.fullmatch(rf"3 keys, 2 families \(2 tuned\), {rungs} rungs tuned, \d+(\.\d)? s", lines[2]), lines
    assert max(map(len, lines)) <= 80


def test_a_rerun_with_everything_current_says_nothing_to_do(tuned, tmp_path):
    shapes, db = copy(tuned, tmp_path)
    trials = count(db, "select count(*) from tuner_trials")
    proc = tuner("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "3", db=db)
    assert (proc.stdout, proc.stderr) == ("", "nothing to do: 2 families current (3 keys)\n")
    assert count(db, "select count(*) from tuner_trials") == trials


def test_a_new_family_is_told_and_the_current_ones_only_counted(tuned, tmp_path):
    shapes, db = copy(tuned, tmp_path)
    more = tmp_path / "more.txt"
    more.write_text(shapes.read_text() + "8 512 1024 name=c\n")
    lines = tuner("tune", "--shapes", str(more), "--backend", "model", "--trials", "3", db=db).stderr.splitlines()
    assert len(lines) == 2 and FAMILY.match(lines[0]).group(1) == "c", lines
    assert re.fullmatch(r"4 keys, 3 families \(1 tuned, 2 current\), \d+ rungs tuned, \d+(\.\d)? s", lines[1])


def test_tune_json_is_the_run_summary_with_its_maps(tuned, tmp_path):
    shapes, db = copy(tuned, tmp_path)
    proc = tuner("tune", "--shapes", str(shapes), "--backend", "model", "--only", "a", "--revalidate", "--json",
                 db=db)
    run = json.loads(proc.stdout)
    [family] = run["families"]
    assert family["name"] == "a" and family["state"] == "remapped" and family["tuned_m"] == []
    assert family["spans"] >= 1 and family["rungs"] >= 5 and family["seconds"] >= 0
    assert run["totals"] == {**run["totals"], "keys": 2, "families": 1, "tuned": 0, "remapped": 1, "current": 0,
                             "lost": 0, "rungs_tuned": 0}
    assert [m["name"] for m in run["maps"]] == ["a"] and len(run["maps"][0]["ranges"]) == family["spans"]
    [line, _] = proc.stderr.splitlines()
    assert re.fullmatch(rf"a  map measured again: {family['spans']} spans?, best \d\.\d\dx, \d+(\.\d)? s", line), line


def test_show_says_how_many_it_cut_in_the_table_and_in_json(tuned):
    _, db, _ = tuned
    total = count(db, "select count(*) from tuner_winners")
    assert total > 3
    lines = tuner("show", "--limit", "3", db=db).stdout.splitlines()
    cut = f"showing 3 of {total} winners (--limit 3; --limit {total} shows all)"
    assert lines[0] == cut and lines[-1] == cut
    shown = json.loads(tuner("show", "--limit", "3", "--json", db=db).stdout)
    assert (shown["total"], shown["shown"], shown["limit"], len(shown["items"])) == (total, 3, 3, 3)
    # Uncut: the count alone.
    assert tuner("show", db=db).stdout.splitlines()[0] == f"{total} winners"
    whole = json.loads(tuner("show", "--json", db=db).stdout)
    assert whole["total"] == whole["shown"] == len(whole["items"]) == total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_says_where_it_listens_and_which_database_at_once(tuned):
    _, db, _ = tuned
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "serve", "--port", str(port), "--db", str(db)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        # Piped, and read while it runs: flushed, not held in a buffer until exit.
        first, second = lines.get(timeout=60), lines.get(timeout=10)
        assert first.startswith(f"serving http://127.0.0.1:{port} (API docs at /docs"), first
        assert second.strip() == f"database sqlite:///{db.resolve()}", second
        # Listening once it says so.
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_on_a_port_in_use_is_a_one_line_error(tuned):
    _, db, _ = tuned
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        proc = tuner("serve", "--port", str(port), db=db, check=False)
    assert time.monotonic() - started < 60
    assert proc.returncode == 2
    text = (proc.stdout + proc.stderr).strip()
    assert len(text.splitlines()) == 1 and "cannot listen" in text and str(port) in text, text


def test_family_lines_read_as_sentences_and_fit_80_columns():
    from tuner.search.progress import FamilyRecord

    tuned = FamilyRecord("gemma3-27b.qkv", "tuned", rungs=31, tuned_m=list(range(31)), spans=7, best_speedup=1.2149,
                         seconds=12.3)
    assert tuned.line() == "gemma3-27b.qkv  31 rungs tuned, map 7 spans, best 1.21x, 12 s"
    some = FamilyRecord("o", "tuned", rungs=9, tuned_m=[48], spans=1, best_speedup=None, seconds=0.42)
    assert some.line("gpu1 ") == "gpu1 o  1 of 9 rungs tuned, map 1 span, 0.4 s"
    again = FamilyRecord("o", "remapped", rungs=9, spans=3, best_speedup=1.0, seconds=40)
    assert again.line() == "o  map measured again: 3 spans, best 1.00x, 40 s"
    assert FamilyRecord("o", "lost", seconds=700).line().startswith("o  lost its lease after 700 s")
    long = FamilyRecord("a-very-long-model-name-of-many-words-70b.layers.mlp.gate_up_proj", "tuned", rungs=14,
                        tuned_m=list(range(14)), spans=4, best_speedup=1.1, seconds=300)
    head, body = long.line("gpu3 ").split("\n")
    assert head == "gpu3 " + long.name and body == "    14 rungs tuned, map 4 spans, best 1.10x, 300 s"
    assert FamilyRecord.from_json(long.to_json()) == long and "worker" not in long.to_json()


def test_a_family_two_workers_report_counts_once(capsys):
    from rich.console import Console

    from tuner.search.progress import WAIT_NOTE_S, FamilyRecord, Report

    report = Report(Console(file=sys.stderr, force_terminal=False))
    with report:
        report.wait("gpu1 ", None)  # a short wait is no news when piped
        report.family(FamilyRecord("a", "tuned", rungs=3, tuned_m=[1, 2, 3], spans=1, seconds=1), "gpu0 ")
        report.family(FamilyRecord("a", "current", rungs=3, seconds=0.1), "gpu1 ")
        report.family(FamilyRecord("b", "lost", seconds=5), "gpu0 ")
        report.family(FamilyRecord("b", "tuned", rungs=2, tuned_m=[4, 8], spans=2, seconds=2), "gpu1 ")
        report._waiting["gpu0 "] = time.monotonic() - WAIT_NOTE_S  # a long one is
        report.wait("gpu0 ", None)
        report.wait("gpu0 ", None)
    report.totals(5)
    lines = capsys.readouterr().err.splitlines()
    assert [r.state for r in report.records] == ["tuned", "tuned"]
    assert lines[-1].startswith("5 keys, 2 families (2 tuned), 5 rungs tuned, ")
    assert lines.count("gpu0 waiting: the families left are held by other processes") == 1
    assert not any(line.startswith("gpu1 waiting") or line.startswith("gpu1 a") for line in lines)
