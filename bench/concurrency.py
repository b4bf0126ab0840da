"""Concurrent `tuner tune` processes on one fresh SQLite file (model backend, CPU).

    python -m bench.concurrency [--reps 20] [--processes 4] [--out bench/results]

Each repetition starts `--processes` tuners at once on a database file that
does not exist yet and checks: every process exits 0, no config is measured
twice for a key (one process per family, by lease), and every stored winner
is the best verified trial of its key, and the lease history shows no two
owners of a family at once. Writes `<out>/cpu-concurrency.json`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text

from bench.record import save
from db.engine import resolve_url

ROOT = Path(__file__).resolve().parents[1]
SHAPES = "1,16 1024 1024 name=a\n64 2048 1024 name=b\n8 512 2048 name=c\n"


def race(shapes: Path, db: Path, processes: int, trials: int = 4) -> list[subprocess.CompletedProcess]:
    """Start `processes` tuners on `shapes` into `db` at once; their results."""
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", str(shapes), "--backend", "model",
           "--trials", str(trials), "--db", str(db)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(processes)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def violations(db: Path | str) -> list[str]:
    """What breaks the rules in the database `db` (a SQLite path or a URL):
    a config measured twice for one key, a key without a winner, a winner
    slower than the key's best verified trial (the model is deterministic:
    the interleaved re-measure gives the trials' own times), or two owners
    holding one lease at once by its history (`lease_overlaps`)."""
    engine = create_engine(resolve_url(str(db)))
    try:
        with engine.connect() as con:
            twice = con.execute(text(
                "select key_id, config_name, count(*) from tuner_trials group by key_id, env_id, config_name"
                " having count(*) > 1")).all()
            worse = con.execute(text(
                "select w.key_id, w.ms, min(t.ms) from tuner_winners w join tuner_trials t"
                " on t.key_id = w.key_id and t.env_id = w.env_id and t.ok group by w.key_id, w.ms"
                " having abs(w.ms - min(t.ms)) > 1e-12")).all()
            keys = con.execute(text("select count(*) from tuner_keys")).scalar()
            winners = con.execute(text("select count(*) from tuner_winners")).scalar()
            events = con.execute(text(
                "select name, owner, event, previous from tuner_lease_events order by id")).all()
    finally:
        engine.dispose()
    out = [f"key {k}: {c} measured {n} times" for k, c, n in twice]
    out += [f"key {k}: winner {w} ms, best trial {b} ms" for k, w, b in worse]
    if winners != keys:
        out.append(f"{winners} winners for {keys} keys")
    return out + lease_overlaps(events)


def lease_overlaps(events) -> list[str]:
    """Replay a lease history ((name, owner, event, previous) rows, in order):
    a lease taken while held, taken over from someone other than its holder,
    or released by a non-holder means two owners held it at once."""
    holder: dict[str, str | None] = {}
    out = []
    for name, owner, event, previous in events:
        held = holder.get(name)
        if event == "take" and held is not None:
            out.append(f"{owner} took {name!r} while {held} held it")
        elif event == "takeover" and held != previous:
            out.append(f"{owner} took {name!r} over from {previous}, but {held} held it")
        elif event == "release" and held != owner:
            out.append(f"{owner} released {name!r}, held by {held}")
        if event in ("take", "takeover"):
            holder[name] = owner
        elif event == "release":
            holder[name] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    reps = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            shapes, db = Path(tmp) / "s.txt", Path(tmp) / "fresh.db"
            shapes.write_text(SHAPES)
            started = time.perf_counter()
            results = race(shapes, db, args.processes)
            reps.append({
                "exit_codes": [r.returncode for r in results], "violations": violations(db),
                "tracebacks": sum("Traceback" in r.stderr for r in results),
                "seconds": round(time.perf_counter() - started, 2),
            })
        print(f"rep {rep}: {reps[-1]}", file=sys.stderr)
    ok = all(set(r["exit_codes"]) == {0} and not r["violations"] and not r["tracebacks"] for r in reps)
    save({"host_cpus": os.cpu_count(), "processes": args.processes, "shapes": SHAPES, "all_ok": ok,
          "reps": reps}, args.out, "cpu-concurrency")


if __name__ == "__main__":
    main()
