"""Tune the Gemma 3 27B GEMM keys on a Hopper GPU against cuBLAS.

    python -m bench.kernels_sm90 [--keys 27b] [--trials 12] [--budget-s 480] [--out bench/results]
                                 [--search --db URL]

By default each key gets a fixed candidate list reasoned from its shape (a
few tiles per scheduler, see `candidates`), measured with the gpu backend;
the best candidate and cuBLAS are then re-measured interleaved. With
`--search` the key is tuned by `tuner.search.tune_key` (Optuna) instead.
Writes `<out>/<device-slug>-sm90.json` (one record per key) and prints a
markdown table.
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
from kernels.space import GemmConfig, InvalidConfig
from tuner.gpu import GpuBackend
from tuner.key import Key, Problem

ARCH = "sm90"
# Gemma 3 27B projections as (N, K) of y = x @ W.T: hidden 5376, 32 query
# heads and 16 KV heads of 128, MLP 21504.
GEMMA3_27B = {"qkv": (8192, 5376), "o": (5376, 4096), "gate_up": (43008, 5376), "down": (5376, 21504)}
GEMMA3_M = (128, 512, 2048, 8192)
KEY_SETS = {"27b": (GEMMA3_27B, GEMMA3_M)}
SCHEDULERS = space.knobs(ARCH)["scheduler"]


def device_slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def gemma_keys(device: str, which: str = "27b") -> list[tuple[str, Key]]:
    shapes, ms = KEY_SETS[which]
    return [
        (name, Key(ARCH, device, Problem(m, n, k)))
        for m in ms for name, (n, k) in shapes.items()
    ]


def max_stages(**fields) -> int | None:
    """Deepest mainloop ring the shared memory allows for this tile (None: no valid config)."""
    for stages in sorted(space.knobs(ARCH)["stages"], reverse=True):
        if space.is_valid({"arch": ARCH, **fields, "stages": stages}):
            return stages
    return None


def _shapes_for(p: Problem) -> list[dict]:
    """Tile / cluster / split-K shapes worth trying for `p`, best guess first.

    Small M: the grid is short of 132 SMs, so narrow tiles (64 rows), split-K
    on long K and wide N tiles compete. Large M: 128x256 / 256x128 tiles (two
    consumer warpgroups, 128 accumulators per thread) with 2-CTA clusters
    that multicast the shared operand.
    """
    if p.m <= 128:
        shapes = [dict(tile_m=64, tile_n=128), dict(tile_m=64, tile_n=256),
                  dict(tile_m=128, tile_n=128, split_k=2), dict(tile_m=128, tile_n=64, cluster_n=2)]
    elif p.m <= 512:
        shapes = [dict(tile_m=128, tile_n=128), dict(tile_m=128, tile_n=256),
                  dict(tile_m=64, tile_n=256), dict(tile_m=128, tile_n=128, cluster_n=2)]
    else:
        shapes = [dict(tile_m=128, tile_n=256, cluster_m=2), dict(tile_m=256, tile_n=128, cluster_n=2),
                  dict(tile_m=128, tile_n=256), dict(tile_m=256, tile_n=128, cluster_m=2)]
    if p.m <= 512 and p.k >= 16384:
        shapes.insert(1, dict(tile_m=128, tile_n=128, split_k=4))
    return shapes


def candidates(p: Problem, limit: int) -> list[GemmConfig]:
    """Up to `limit` configs for `p`, taken round robin over the schedulers."""
    swizzle = 1 if p.m <= 512 else 8
    per_sched: dict[str, list[GemmConfig]] = {s: [] for s in SCHEDULERS}
    for shape in _shapes_for(p):
        for sched in SCHEDULERS:
            fields = dict(arch=ARCH, scheduler=sched, swizzle=1 if sched == "single_tile" else swizzle,
                          **shape)
            stages = max_stages(**fields)
            if stages is None:
                continue
            try:
                cfg = GemmConfig(**fields, stages=stages)
                space.check_problem(cfg, p.m, p.n, p.k, p.groups, p.dtype_in, p.dtype_out, p.layout)
            except InvalidConfig:
                continue
            per_sched[sched].append(cfg)
    # A deeper atomic-scheduler prefetch for the first guess: hides the
    # atomic's latency at the cost of balance (seed 000).
    if per_sched["dynamic_persistent"]:
        first = per_sched["dynamic_persistent"][0]
        per_sched["dynamic_persistent"].insert(1, GemmConfig(**{**first.to_dict(), "sched_depth": 2}))
    out: list[GemmConfig] = []
    for i in range(max(map(len, per_sched.values()))):
        for sched in SCHEDULERS:
            if i < len(per_sched[sched]) and len(out) < limit:
                out.append(per_sched[sched][i])
    return out


def _fixed(backend: GpuBackend, key: Key, limit: int, deadline: float) -> dict:
    base = backend.baseline(key)
    if not base.ok:
        raise RuntimeError(f"{key.study_name()}: cuBLAS baseline failed: {base.error}")
    measured: list[tuple[GemmConfig, float]] = []
    errors: list[str] = []
    skipped = 0
    for cfg in candidates(key.problem, limit):
        if time.monotonic() > deadline:
            skipped += 1
            continue
        m = backend.measure(key, cfg)
        if m.ok:
            measured.append((cfg, m.ms))
        else:
            errors.append(f"{cfg.name()}: {m.error}")
    best_by_scheduler: dict[str, float] = {}
    for cfg, ms in measured:
        best_by_scheduler[cfg.scheduler] = min(ms, best_by_scheduler.get(cfg.scheduler, math.inf))
    record = {"cublas_ms": base.ms, "best_ms": None, "best_config": None, "best_config_name": None,
              "best_by_scheduler": dict(sorted(best_by_scheduler.items())),
              "measured": len(measured), "failed": len(errors), "skipped": skipped,
              "errors": errors[:5]}
    if measured:
        best_cfg = min(measured, key=lambda pair: pair[1])[0]
        again = backend.remeasure(key, [best_cfg, None])
        if again[0].ok and again[1].ok:
            record.update(best_ms=again[0].ms, cublas_ms=again[1].ms)
        else:
            record["best_ms"] = min(ms for _, ms in measured)
        record.update(best_config=best_cfg.to_dict(), best_config_name=best_cfg.name())
    return record


def _searched(backend: GpuBackend, key: Key, name: str, trials: int, seconds: float | None,
              db: str | None) -> dict:
    from db.store import Store
    from tuner.search import Budget, tune_key

    store = Store(db)
    try:
        w = tune_key(key, backend, store, Budget(trials=trials, seconds=seconds), name=name,
                     force=True).winner
    finally:
        store.close()
    pool = w.config is not None
    return {"cublas_ms": w.baseline_ms, "best_ms": w.ms if pool else None,
            "best_config": w.config, "best_config_name": w.config_name if pool else None,
            "best_by_scheduler": {s: ms for s, ms in w.best_by_scheduler.items() if s != "cublas"},
            "measured": w.trials}


def run(args: argparse.Namespace) -> list[dict]:
    backend = GpuBackend(ARCH, args.device)
    started = time.monotonic()
    deadline = started + args.budget_s
    records = []
    try:
        keys = gemma_keys(backend.device_name, args.keys)
        if not args.search:
            todo = {c for _, key in keys for c in candidates(key.problem, args.trials)}
            prep = backend.prepare(sorted(todo, key=GemmConfig.name))
            if not prep.ok:
                print(f"precompile failed (configs compile one by one): {prep.error}", file=sys.stderr)
        for name, key in keys:
            p = key.problem
            t0 = time.monotonic()
            if args.search:
                left = max(1.0, (deadline - time.monotonic()) / max(1, len(keys) - len(records)))
                rec = _searched(backend, key, name, args.trials, left, args.db)
            else:
                rec = _fixed(backend, key, args.trials, deadline)
            rec = {"name": name, "M": p.m, "N": p.n, "K": p.k, "groups": p.groups,
                   "dtype": p.dtype_in, "layout": p.layout, **rec,
                   "speedup": rec["cublas_ms"] / rec["best_ms"] if rec.get("best_ms") else None,
                   "seconds": round(time.monotonic() - t0, 1)}
            records.append(rec)
            print(f"{name} M={p.m}: cuBLAS {rec['cublas_ms']:.4f} ms, best "
                  f"{_fmt(rec['best_ms'])} ms ({rec.get('best_config_name')})", file=sys.stderr)
        for rec in records:
            rec.update(device=backend.device_name, versions=backend.versions(),
                       mode="search" if args.search else "fixed", restarts=backend.restarts)
    finally:
        backend.close()
    out = Path(args.out) / f"{device_slug(records[0]['device'])}-{ARCH}.json" if records else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(markdown(records))
    return records


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def markdown(records: list[dict]) -> str:
    head = ["key", "M", "N", "K", "cuBLAS ms", "best ms", "speedup", *SCHEDULERS, "best config"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        by = r.get("best_by_scheduler") or {}
        cells = [r["name"], r["M"], r["N"], r["K"], _fmt(r["cublas_ms"]), _fmt(r["best_ms"]),
                 "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
                 *(_fmt(by.get(s)) for s in SCHEDULERS), r.get("best_config_name") or "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", choices=sorted(KEY_SETS), default="27b")
    parser.add_argument("--trials", type=int, default=12, help="Configs measured per key.")
    parser.add_argument("--budget-s", type=float, default=480.0, help="Wall time for all keys.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--search", action="store_true", help="Tune with tuner.search instead of the fixed list.")
    parser.add_argument("--db", default=None, help="Database for --search (default: the tuner's).")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
