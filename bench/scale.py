"""One worker against two (`tuner tune --devices 0,1`) on the Gemma 3 27B keys: wall times and winners.

    python -m bench.scale warm    [--work DIR]              # fill the compile cache (a throw-away tune)
    python -m bench.scale tune    [--work DIR] [--run one two]  # 1 worker, then 2, a database each
    python -m bench.scale compare [--work DIR] [--out DIR]  # both runs' winners re-measured on GPU 0

Three steps, each well under ten minutes on an H100 / H200. Compiling is
most of a cold tune, and the compile cache on disk is shared by every
worker of a host: `warm` compiles what the tunes will ask for (a tune into a
database thrown away afterwards), so that both timed runs start from the same
warm cache and measure tuning, not compiling. Both timed runs go through
`--devices` (1 worker: `--devices 0`), so they differ only in the worker count.
`--run` takes the runs one at a time (a call each, where a call's time is
limited) or in another order; each run's time is added to the step's record.

`compare` opens both databases and, for every key both stored a winner for,
re-measures the two winners interleaved (`GpuBackend.remeasure`) on GPU 0;
at the shape file's listed M it compares the two M maps' choices the same
way, cold (one call after an L2 flush, the latency `gemm` serves). The
acceptance: two workers in <= 0.6x the wall time of one, and every pair of
re-measured times within 3 %. Writes `<out>/<device-slug>-scale.json`
(`--out` defaults to $OUT when set, else bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.kernels_sm90 import device_slug
from bench.record import save

ROOT = Path(__file__).resolve().parents[1]
SHAPES, ONLY = "gemma3.txt", "gemma3-27b.*"
LISTED_M = (1, 16, 128, 512, 2048, 8192)
WALL_RATIO_MAX = 0.6
AGREEMENT = 0.03
# The timed runs: their names and the devices each tunes on.
RUNS = {"one": "0", "two": "0,1"}


def _tune(db: Path, devices: str) -> dict:
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", SHAPES, "--only", ONLY, "--backend", "gpu",
           "--devices", devices, "--db", str(db), "--json"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}")
    summary = json.loads(done.stdout)
    return {"devices": devices, "wall_s": round(wall, 2), "workers": summary["workers"]}


def warm(work: Path) -> None:
    db = work / "warm.db"
    db.unlink(missing_ok=True)
    print(json.dumps(_tune(db, "0")))
    db.unlink()


def tune(work: Path, names: list[str]) -> None:
    """The runs `names` ("one", "two") in that order, each added to tune.json."""
    path = work / "tune.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    for name in names:
        db = work / f"{name}.db"
        db.unlink(missing_ok=True)
        runs[name] = _tune(db, RUNS[name])
        print(json.dumps({name: runs[name]}), file=sys.stderr)
        path.write_text(json.dumps(runs, indent=1))


def compare(work: Path, out: str) -> None:
    from db.store import Store
    from kernels.space import GemmConfig
    from tuner.backends.gpu import GpuBackend
    from tuner.key import Key, Problem
    from tuner.runtime.lookup import lookup

    runs = json.loads((work / "tune.json").read_text())
    one, two = Store(str(work / "one.db"), writer=False), Store(str(work / "two.db"), writer=False)
    backend = GpuBackend("sm90", 0)

    def cfg(stored: dict | None) -> GemmConfig | None:  # None: cuBLAS
        return GemmConfig.from_dict(stored) if stored else None

    winners = []
    theirs = {_key_id(w.key): w for w in two.winners(limit=100_000, backend="gpu")}
    for w in one.winners(limit=100_000, backend="gpu"):
        other = theirs.get(_key_id(w.key))
        if other is None:
            continue
        key = Key(w.key["arch"], w.key["device"], Problem(**{
            f: tuple(v) if f == "group_k" else v for f, v in w.key.items() if f not in ("arch", "device")}))
        winners.append(_pair(backend, key, cfg(w.config), cfg(other.config), w.config_name, other.config_name))
    choices = []
    for fam in {(w.key["n"], w.key["k"]) for w in one.winners(limit=100_000, backend="gpu")}:
        for m in LISTED_M:
            key = Key("sm90", backend.device_name, Problem(m, *fam))
            a, b = lookup(one, key), lookup(two, key)
            if a is None or b is None:
                continue
            choices.append(_pair(backend, key, cfg(a.config), cfg(b.config), a.config_name, b.config_name,
                                 cold=True))
    backend.close()
    worst = max(abs(p["ratio"] - 1) for p in winners + choices)
    wall_ratio = runs["two"]["wall_s"] / runs["one"]["wall_s"]
    record = {
        "device": backend.device_name, "shapes": SHAPES, "only": ONLY, "runs": runs,
        "wall_ratio_two_over_one": round(wall_ratio, 3),
        "winners": winners, "map_choices": choices,
        "same_winner": sum(p["same"] for p in winners), "same_choice": sum(p["same"] for p in choices),
        "worst_disagreement": round(worst, 4),
        "pass": {"wall_ratio": wall_ratio <= WALL_RATIO_MAX, "agreement": worst <= AGREEMENT},
    }
    save(record, out, f"{device_slug(backend.device_name)}-scale")


def _key_id(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


def _pair(backend, key, a, b, a_name: str, b_name: str, *, cold: bool = False) -> dict:
    """The two runs' choices for `key` timed interleaved (once when they are the same)."""
    same = a_name == b_name
    measured = backend.remeasure(key, [a] if same else [a, b], cold=cold)
    if not all(m.ok for m in measured):
        raise RuntimeError(f"{key.study_name()}: re-measuring failed: {[m.error for m in measured]}")
    ms = [m.ms for m in measured] * (2 if same else 1)
    return {"key": key.problem.label(), "one": a_name, "two": b_name, "same": same,
            "one_ms": ms[0], "two_ms": ms[1], "ratio": round(ms[1] / ms[0], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("warm", "tune", "compare"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "gemm-scale"),
                        help="Databases and the tune step's times (kept between the steps).")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    parser.add_argument("--run", nargs="+", choices=tuple(RUNS), default=list(RUNS),
                        help="The tune step's runs, in order (default: both).")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    steps = {"warm": lambda: warm(work), "tune": lambda: tune(work, args.run),
             "compare": lambda: compare(work, args.out)}
    steps[args.step]()


if __name__ == "__main__":
    main()
