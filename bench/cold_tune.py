"""A cold tune of one model, timed, and the M maps it made benched.

    python -m bench.cold_tune --name NAME (--shapes FILE [--only GLOB] | --model CONFIG)
                              [--budget-s S] [--reference DB] [--points 24] [--rounds 40]
                              [--placements 2] [--seed 0] [--keep-db PATH] [--out bench/results]

Runs `tuner tune --backend gpu --json` (with `--budget-s` when given) in a
fresh process against an empty database and an empty compile cache, and
records what it took: wall seconds, the seconds spent waiting on compiles
and on measurements, the candidates timed, the families and rungs it
tuned and what the budget left out. Then the `bench.dynamic_m` protocol on
the maps it made, at `--points` log-uniform M per family that no map being
compared was tuned at: with `--reference DB` (a database of the same
families, say a search without a budget), both maps are timed at the same
points in the same rounds beside cuBLAS. `--model` takes what `tuner shapes
--from-model` takes. Writes `<out>/<device-slug>-cold-tune-<name>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench import dynamic_m
from bench.kernels_sm90 import device_slug, geomean
from bench.record import save
from tuner.runtime import dispatch
from tuner.search.ladder import rungs


def cold_tune(shapes: Path, only: str | None, budget_s: float | None, db: Path, cache: Path) -> dict:
    """`tuner tune` from nothing: its `--json` answer, with the wall seconds."""
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", str(shapes), "--backend", "gpu",
           "--db", str(db), "--json"]
    if only:
        cmd += ["--only", only]
    if budget_s:
        cmd += ["--budget-s", str(budget_s)]
    env = dict(os.environ, KERNELS_CACHE_DIR=str(cache))
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    wall = time.monotonic() - started
    return json.loads(done.stdout) | {"wall_s": round(wall, 1)}


def bench_maps(dbs: list[str], shapes: list[str], only: str, points: int, rounds: int, placements: int,
               seed: int) -> list[dict]:
    """`bench.dynamic_m` on each database's maps at the same M points (none
    tuned in any of them), every point's paths in the same rounds: per
    database, the families' points and the geomean of cuBLAS / gemm."""
    warnings.simplefilter("ignore", dispatch.FallbackWarning)
    dev = torch.device("cuda", 0)
    flush = dynamic_m.flush_buffer(dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    fams = dynamic_m.families(shapes, only)
    for db in dbs:
        dynamic_m.compile_choices(db, fams)
    out = [{"db": db, "families": []} for db in dbs]
    for (n, k), (name, listed) in fams.items():
        tuned = set(rungs(listed)).union(*(dynamic_m.tuned_ms(db, n, k) for db in dbs))
        w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
        per_db: list[list[dict]] = [[] for _ in dbs]
        for m in dynamic_m.random_ms(points, seed, tuned):
            x = (torch.randn(m, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
            for got, timed in zip(per_db, dynamic_m.time_paths(x, w, rounds, flush, placements, dbs), strict=True):
                got.append({"m": m, **timed})
        for record, got in zip(out, per_db, strict=True):
            record["families"].append({"name": name, "n": n, "k": k, "points": got,
                                       "geomean": geomean([p["ratio"] for p in got]),
                                       "min": min(p["ratio"] for p in got)})
    for record in out:
        every = [p["ratio"] for f in record["families"] for p in f["points"]]
        record |= {"geomean": geomean(every), "min": min(every), "count": len(every)}
    return out


def reference_problem(reference: str, device: str) -> str | None:
    """Why `reference` cannot stand beside a tune on `device` (None if it
    can): `gemm` serves a map only on the device it was measured on, so the
    maps of another device would all run cuBLAS here."""
    from db.store import Store, StoreError

    try:
        store = Store(reference, writer=False)
    except StoreError as exc:
        return str(exc)
    try:
        devices = {r.family["device"] for r in store.ranges()}
    finally:
        store.close()
    if device not in devices:
        return f"{reference} holds no M map of {device} (its maps are of: {', '.join(sorted(devices)) or 'none'})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="The model's name in the output file.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shapes")
    source.add_argument("--model", help="What `tuner shapes --from-model` takes.")
    parser.add_argument("--only", default=None, help="Only families whose key name matches this glob.")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--reference", default=None, help="A database of the same families to bench beside.")
    parser.add_argument("--points", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--placements", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-db", default=None, help="Copy the tuned database here.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if args.reference and (why := reference_problem(args.reference, torch.cuda.get_device_name(0))):
        parser.error(f"--reference: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        shapes = Path(args.shapes or Path(tmp) / "shapes.txt")
        if args.model:
            subprocess.run([sys.executable, "-m", "tuner.cli", "shapes", "--from-model", args.model, "-o",
                            str(shapes)], check=True, stdout=subprocess.DEVNULL)
        db = Path(tmp) / "cold.db"
        tune = cold_tune(shapes, args.only, args.budget_s, db, Path(tmp) / "cache")
        if args.keep_db:
            shutil.copy(db, args.keep_db)
        dbs = [str(db)] + ([args.reference] if args.reference else [])
        # `bench.dynamic_m` times dense families; grouped (MoE) keys are `bench.grouped`'s.
        dense = dynamic_m.families([str(shapes)], args.only or "*")
        benched = bench_maps(dbs, [str(shapes)], args.only or "*", args.points, args.rounds, args.placements,
                             args.seed) if dense else [{"geomean": None, "min": None, "count": 0} for _ in dbs]
    totals = tune["totals"]
    record = {
        "model": args.name, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "budget_s": args.budget_s, "calibration": tune.get("model"),
        "families": totals["families"], "unreached_families": totals.get("unreached", 0),
        "rungs": totals["rungs_tuned"],
        "unreached_rungs": sum(len(f.get("unreached_m", [])) for f in tune["families"]),
        "wall_s": tune["wall_s"], "tune_s": totals["seconds"],
        "compile_s": tune.get("compile_s"), "measure_s": tune.get("measure_s"), "trials": tune.get("timed"),
        "dynamic_m_geomean": benched[0]["geomean"], "dynamic_m_min": benched[0]["min"],
        "reference_dynamic_m_geomean": benched[1]["geomean"] if len(benched) > 1 else None,
        "reference_dynamic_m_min": benched[1]["min"] if len(benched) > 1 else None,
        "reference": os.path.basename(args.reference) if args.reference else None,
        "points": benched[0]["count"], "rounds": args.rounds, "placements": args.placements,
        "tune": tune["families"], "maps": tune.get("maps"), "bench": benched,
    }
    for b, path in zip(benched, dbs):
        b["db"] = "cold tune" if path == dbs[0] else os.path.basename(path)
    save(record, args.out, f"{device_slug(record['device'])}-cold-tune-{args.name}")


if __name__ == "__main__":
    main()
