"""Tune the Gemma 3 27B GEMM keys on a Hopper GPU against cuBLAS.

    python -m bench.kernels_sm90 [--keys 27b] [--trials 14] [--budget-s 480] [--db URL] [--reuse]
                                 [--out bench/results]

Every key is tuned exactly as `tuner tune --backend gpu` tunes it
(`tuner.search.study.tune_key`): the analytic model's best configs of each
scheduler, compiled in parallel up front, then Optuna's TPE; the best config
is tried under every scheduler, and the two best pool configs and cuBLAS are
re-measured interleaved. Writes `<out>/<device-slug>-sm90.json` (one record
per key: cuBLAS and best pool time from that interleaved run, the best time
of each scheduler, the winner and its tile) and prints a markdown table with
the geometric means of cuBLAS / pool and cuBLAS / dispatch (pool or cuBLAS,
whichever won).

Each capability earns its place per key: for the new tile shapes (tile_n
not a multiple of 32, or tile_m 192), pingpong consumers and the stream-K
scheduler, the best measured config with it and the best without it are
re-measured interleaved; the table names the keys where it wins and by how
much. The best tuning-trial time of each consumer mode is reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from kernels import space
from tuner.key import Key, Problem

ARCH = "sm90"
# Gemma 3 27B projections as (N, K) of y = x @ W.T: hidden 5376, 32 query
# heads and 16 KV heads of 128, MLP 21504 (tuner/data/gemma3.txt derives them).
GEMMA3_27B = {"qkv": (8192, 5376), "o": (5376, 4096), "gate_up": (43008, 5376), "down": (5376, 21504)}
GEMMA3_M = (128, 512, 2048, 8192)
KEY_SETS = {"27b": (GEMMA3_27B, GEMMA3_M)}
SCHEDULERS = space.knobs(ARCH)["scheduler"]
BASELINE = "cublas"


def device_slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def max_stages(**fields) -> int | None:
    """Deepest mainloop ring the shared memory allows for this tile (None: no valid config)."""
    for stages in sorted(space.knobs(ARCH)["stages"], reverse=True):
        if space.is_valid({"arch": ARCH, **fields, "stages": stages}):
            return stages
    return None


def _searched(backend, key: Key, name: str, trials: int, seconds: float | None, db: str | None,
              reuse: bool = False) -> dict:
    """Tune `key` through the search (or, with `reuse`, take its current winner); the winner's record."""
    from db.store import Store
    from tuner.search.study import Budget, tune_key

    store = Store(db)
    try:
        w = tune_key(key, backend, store, Budget(trials=trials, seconds=seconds), name=name,
                     force=not reuse).winner
        env_id = store.environment(backend.name, key.arch, key.device, backend.versions())
        trials_ = store.trials(store.key_id(key.to_dict(), name), env_id)
    finally:
        store.close()
    pool = {s: ms for s, ms in w.best_by_scheduler.items() if s != BASELINE}
    best_sched = min(pool, key=pool.get) if pool else None
    tile = f"{w.config['tile_m']}x{w.config['tile_n']}" if w.config else None
    return {"cublas_ms": w.baseline_ms, "best_ms": pool[best_sched] if pool else None,
            "best_scheduler": best_sched, "dispatch_ms": w.ms, "winner": w.config_name,
            "winner_config": w.config, "winner_tile": tile, "best_by_scheduler": pool,
            "measured": w.trials, **_capabilities(backend, key, trials_)}


def new_tile(config: dict) -> bool:
    """Whether a config's tile is one the pool gained with the tiles that fit
    the problem (tile_n not a multiple of 32, or tile_m 192)."""
    return config["tile_m"] == 192 or config["tile_n"] % 32 != 0


def _consumer(config: dict) -> str:
    # Configs stored before the knob existed are cooperative.
    return config.get("consumer", "cooperative")


# Capabilities that must earn their place: name -> whether a config has it.
CAPABILITIES = {
    "new_tiles": new_tile,
    "pingpong": lambda c: _consumer(c) == "pingpong",
    "stream_k": lambda c: c["scheduler"] == "stream_k",
}


def _capabilities(backend, key: Key, trials_) -> dict:
    """Per capability, the best measured config with it and without it, all
    re-measured in one interleaved run (pingpong's pair is also the best
    time of each consumer mode)."""
    from kernels.space import GemmConfig

    ranked = sorted((t for t in trials_ if t.ok and t.config), key=lambda t: t.ms)
    sides = {}
    for cap, has in CAPABILITIES.items():
        sides[cap] = {with_: next((t for t in ranked if has(t.config) == with_), None) for with_ in (True, False)}
    present = {t.config_name: t for pair in sides.values() for t in pair.values() if t is not None}
    again = backend.remeasure(key, [GemmConfig.from_dict(t.config) for t in present.values()]) if present else []
    times = {name: m.ms for name, m in zip(present, again, strict=True) if m.ok}
    out = {}
    for cap, pair in sides.items():
        for with_, t in pair.items():
            label = f"{cap}_{'with' if with_ else 'without'}"
            out[f"{label}_config"] = t.config_name if t else None
            out[f"{label}_ms"] = times.get(t.config_name) if t else None
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from tuner.backends.gpu import GpuBackend

    backend = GpuBackend(ARCH, args.device)
    shapes, ms = KEY_SETS[args.keys]
    keys = [(name, Key(ARCH, backend.device_name, Problem(m, n, k)))
            for m in ms for name, (n, k) in shapes.items()]
    deadline = time.monotonic() + args.budget_s
    records = []
    try:
        for i, (name, key) in enumerate(keys):
            p = key.problem
            t0 = time.monotonic()
            left = max(10.0, (deadline - t0) / (len(keys) - i))
            rec = {"name": name, "M": p.m, "N": p.n, "K": p.k, "groups": p.groups,
                   "dtype": p.dtype_in, "layout": p.layout,
                   **_searched(backend, key, name, args.trials, left, args.db, args.reuse)}
            rec["seconds"] = round(time.monotonic() - t0, 1)
            records.append(rec)
            print(f"{name} M={p.m}: cuBLAS {_fmt(rec['cublas_ms'])} ms, pool {_fmt(rec['best_ms'])} ms, "
                  f"winner {rec['winner']} ({rec['seconds']} s)", file=sys.stderr)
        for rec in records:
            rec.update(device=backend.device_name, versions=backend.versions(), restarts=backend.restarts)
    finally:
        backend.close()
    if records:
        out = Path(args.out) / f"{device_slug(records[0]['device'])}-{ARCH}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(markdown(records))
    return records


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def gain(r: dict, cap: str) -> float | None:
    """Best time without capability `cap` / best time with it (> 1: it wins)."""
    without, with_ = r.get(f"{cap}_without_ms"), r.get(f"{cap}_with_ms")
    return without / with_ if without and with_ else None


def best_by_consumer(r: dict) -> dict[str, float | None]:
    """Best re-measured time of each consumer mode: pingpong's with/without pair."""
    return {"cooperative": r.get("pingpong_without_ms"), "pingpong": r.get("pingpong_with_ms")}


CONSUMERS = space.knobs(ARCH)["consumer"]


def markdown(records: list[dict]) -> str:
    head = ["key", "M", "N", "K", "cuBLAS ms", "pool ms", "cuBLAS/pool", *SCHEDULERS, *CONSUMERS, "tile",
            *(f"{c} gain" for c in CAPABILITIES), "dispatch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        by = r.get("best_by_scheduler") or {}
        by_consumer = best_by_consumer(r)
        ratio = r["cublas_ms"] / r["best_ms"] if r.get("best_ms") else None
        gains = [gain(r, c) for c in CAPABILITIES]
        cells = [r["name"], r["M"], r["N"], r["K"], _fmt(r["cublas_ms"]), _fmt(r["best_ms"]),
                 "-" if ratio is None else f"{ratio:.3f}", *(_fmt(by.get(s)) for s in SCHEDULERS),
                 *(_fmt(by_consumer.get(c)) for c in CONSUMERS), r.get("winner_tile") or "-",
                 *("-" if g is None else f"{g:.3f}" for g in gains), r["winner"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    pool = [r["cublas_ms"] / r["best_ms"] for r in records if r.get("best_ms")]
    dispatch = [r["cublas_ms"] / r["dispatch_ms"] for r in records]
    lines.append("")
    lines.append(f"geometric mean cuBLAS/pool {geomean(pool):.3f} over {len(pool)} keys "
                 f"(worst {min(pool, default=math.nan):.3f}); cuBLAS/dispatch {geomean(dispatch):.3f}, "
                 f"worst key {min(dispatch, default=math.nan):.3f}")
    for cap in CAPABILITIES:
        wins = [f"{r['name']} M={r['M']} x{gain(r, cap):.3f} ({r[f'{cap}_with_config']})"
                for r in records if (gain(r, cap) or 0) > 1]
        lines.append(f"{cap} beats the best config without it on {len(wins)} of {len(records)} keys"
                     + (": " + "; ".join(wins) if wins else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", choices=sorted(KEY_SETS), default="27b")
    parser.add_argument("--trials", type=int, default=14, help="Measured trials per key.")
    parser.add_argument("--budget-s", type=float, default=480.0, help="Wall time for all keys.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--db", default=None, help="Database for the studies (default: the tuner's).")
    parser.add_argument("--reuse", action="store_true",
                        help="Report a key's current winner in --db instead of tuning it again.")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
