"""Grouped GEMM on Hopper: static vs dynamic scheduling, and MoE keys against torch.

    python -m bench.grouped [--part seed000 moe models] [--skews 0 1] [--tokens 2048] [--out bench/results]

(a) seed000: four problems of 1024 x 1024 with K = 1024, K, 1024, K packed
    along K, K from 1024 to 32768. Same config for both schedulers (128 x 128
    and 128 x 192 tiles, with and without clusters), the scheduler the only
    change; the per-group cuBLAS loop for reference. Static persistence deals
    the long-K tiles of groups 1 and 3 to the same CTAs; the dynamic scheduler
    hands each to a free CTA.
(b) moe: MoE keys (8 and 64 experts, hidden sizes 2048 to 7168), balanced
    (skew 0) and skewed (`tuner.backends.gpu_worker.DEFAULT_GROUP_SKEW`) routing, one
    with SMs held by another kernel. Each key is tuned as `tuner tune` does
    (`--trials` measured configs, a few hand-picked tiles among the first),
    and its best pool config re-measured interleaved with `torch._grouped_mm`
    and with a loop of cuBLAS calls, one per expert.
(c) models: the routed experts' keys of Qwen3-30B-A3B, Mixtral 8x7B and
    DeepSeek-V3 (at 4 and 8 local experts: expert parallelism over 64 and
    32 GPUs), as `tuner shapes --from-config` writes them for `--tokens`
    tokens, at each of `--skews`, tuned and timed as in (b).

Every point has `speedup_vs_grouped_mm` and `speedup_vs_loop` (torch's, or
the cuBLAS loop's, time over ours; seed 000: the faster scheduler's), and
`summary` their geomeans and minimums over the records in the file.

All times come from `tuner.backends.gpu.GpuBackend` (CUDA graph replays, operands
rotated through more than L2). Writes `<out>/<device-slug>-grouped.json`,
replacing the records of the parts (and MoE skews) it ran and keeping the
rest, so the parts may run in separate processes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from bench.kernels_sm90 import ARCH, device_slug, max_stages
from db.store import Store
from kernels.space import GemmConfig
from tuner.backends.gpu_worker import CUBLAS_LOOP, DEFAULT_GROUP_SKEW
from tuner.backends.gpu import GpuBackend
from tuner.key import Key, Problem
from tuner.search.study import Budget, tune_key

CONFIGS = Path(__file__).parent / "configs"

SEED000_K = [2 ** e for e in range(10, 16)]
# 128 x 128 tiles give 64 per group: two waves on 132 SMs, the case where
# static persistence stacks two long-K tiles on 60 CTAs (128 x 192: 48 per
# group, 12 CTAs). With every long tile running at once, the dynamic
# scheduler's 128 x 128 tiles read A and B from L2 at its peak (ncu: 86 %
# L2 throughput without a cluster), so the clusters, which multicast A or B
# to their CTAs, are the lever. A 2 x 2 cluster is not: 30 fit on an H100,
# fewer than the 32 long cluster tiles.
SEED000_TILES = (
    dict(tile_m=128, tile_n=128),
    dict(tile_m=128, tile_n=128, cluster_m=2),
    dict(tile_m=128, tile_n=128, cluster_n=2),
    dict(tile_m=128, tile_n=128, cluster_m=2, cluster_n=2),
    dict(tile_m=128, tile_n=192),
    dict(tile_m=128, tile_n=192, cluster_m=2),
    dict(tile_m=128, tile_n=192, cluster_n=2),
    # Each group's K in two slices (reduced in the kernel): the long groups'
    # 128 x 256 tiles become twice as many units, enough to fill the device,
    # and a wide tile reads fewer operand bytes per MMA than 128 x 128.
    dict(tile_m=128, tile_n=256, cluster_m=2, split_k=2),
    dict(tile_m=128, tile_n=256, split_k=2),
)
# (experts, routed rows, N, K): up and down projections of two MoE sizes.
MOE_KEYS = [
    (8, 16384, 4096, 2048),
    (8, 16384, 2048, 4096),
    (64, 16384, 7168, 2048),
    (64, 16384, 2048, 7168),
]
HELD_SMS = 20
# The 64-expert keys are L2-bound (ncu: 90 % L2 throughput with 128 x 256
# tiles): a 1 x 2 cluster, multicasting A to both CTAs, halves A's L2 reads.
MOE_TILES = (
    dict(tile_m=128, tile_n=256, cluster_m=2, swizzle=4),
    dict(tile_m=128, tile_n=224, cluster_m=2, swizzle=4),
    dict(tile_m=128, tile_n=256, swizzle=4),
    dict(tile_m=128, tile_n=128, cluster_n=2, swizzle=4),
    dict(tile_m=128, tile_n=256, cluster_n=2),
)
_SCHEDULERS = ("static_persistent", "dynamic_persistent")
# (config in bench/configs, expert parallelism) of part "models".
MODEL_CONFIGS = (("qwen3-30b-a3b", 1), ("mixtral-8x7b", 1), ("deepseek-v3", 64), ("deepseek-v3", 32))
MODEL_SKEWS = (0.0, 0.8, 1.2)


def _cfg(scheduler: str, **tile) -> GemmConfig:
    fields = dict(arch=ARCH, **tile)
    return GemmConfig(scheduler=scheduler, stages=max_stages(scheduler="dynamic_persistent", **fields), **fields)


def _tflops(p: Problem, ms: float | None) -> float | None:
    return None if not ms else p.flops / ms / 1e9


def seed000_problem(k: int) -> Problem:
    """Seed 000's four problems with long-K length `k`, packed along K."""
    return Problem(1024, 1024, k, groups=4, group_k=(1024, k, 1024, k))


def seed000(backend: GpuBackend) -> list[dict]:
    records = []
    for tile in SEED000_TILES:
        records += _seed000_tile(backend, *(_cfg(s, **tile) for s in _SCHEDULERS))
    return records


def _seed000_tile(backend: GpuBackend, static: GemmConfig, dynamic: GemmConfig) -> list[dict]:
    records = []
    for k in SEED000_K:
        p = seed000_problem(k)
        res = backend.remeasure(Key(ARCH, backend.device_name, p), [static, dynamic, None])
        rec = {"part": "seed000", "K": k, "config": static.name()}
        for label, r in zip(("static", "dynamic", "cublas_loop"), res, strict=True):
            rec[f"{label}_ms"] = r.ms if r.ok else None
            rec[f"{label}_tflops"] = _tflops(p, r.ms if r.ok else None)
            if not r.ok:
                rec[f"{label}_error"] = r.error
        if rec["static_ms"] and rec["dynamic_ms"]:
            rec["dynamic_over_static"] = rec["static_ms"] / rec["dynamic_ms"]
        ours = min(filter(None, (rec["static_ms"], rec["dynamic_ms"])), default=None)
        if ours and rec["cublas_loop_ms"]:
            rec["speedup_vs_loop"] = rec["cublas_loop_ms"] / ours
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr)
    return records


def _moe_problems() -> list[tuple[Problem, float]]:
    out = [(Problem(m, n, k, groups=g), skew) for g, m, n, k in MOE_KEYS for skew in (0.0, DEFAULT_GROUP_SKEW)]
    g, m, n, k = MOE_KEYS[0]
    return out + [(Problem(m, n, k, groups=g, carveout=HELD_SMS), DEFAULT_GROUP_SKEW)]


def model_problems(tokens: int) -> list[tuple[str, Problem]]:
    """(name, problem) of the routed experts' keys of MODEL_CONFIGS at `tokens` tokens."""
    from tuner.config_shapes import DecoderShape

    out = []
    for name, ep in MODEL_CONFIGS:
        shape = DecoderShape.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))
        for gemm, n, k, groups, per_token in shape.gemms(ep):
            if groups > 1:
                out.append((f"{name}.{gemm}" + (f" ep{ep}" if ep > 1 else ""),
                            Problem(tokens * per_token, n, k, groups=groups)))
    return out


def moe(device: int, trials: int, skews: list[float], part: str = "moe", tokens: int = 2048) -> list[dict]:
    records = []
    seeds = [_cfg(s, **tile) for tile in MOE_TILES for s in _SCHEDULERS]
    problems = model_problems(tokens) if part == "models" else [("", p) for p, _ in _moe_problems()]
    with tempfile.TemporaryDirectory() as tmp:
        for skew in skews:
            # Keys do not name the routing: each skew tunes into its own database.
            store = Store(f"sqlite:///{tmp}/{part}-skew{skew}.db")
            try:
                with GpuBackend(ARCH, device, group_skew=skew) as backend:
                    for name, p in problems:
                        if part == "models" or (p, skew) in _moe_problems():
                            rec = _moe_key(backend, store, Key(ARCH, backend.device_name, p), skew, seeds, trials)
                            records.append({"part": part, **({"key": name} if name else {}), **rec})
                            print(json.dumps(records[-1]), file=sys.stderr)
            finally:
                store.close()
    return records


def _moe_key(backend: GpuBackend, store: Store, key: Key, skew: float, seeds: list[GemmConfig],
             trials: int) -> dict:
    """Tune `key` as `tuner tune` does (the hand-picked tiles measured first), then
    time the best pool config interleaved with torch._grouped_mm and the cuBLAS loop."""
    p = key.problem
    rec = {"experts": p.groups, "M": p.m, "N": p.n, "K": p.k, "skew": skew, "held_sms": p.carveout}
    tuned = tune_key(key, backend, store, Budget(trials=trials), seeds=seeds).winner
    env_id = store.environment(backend.name, key.arch, key.device, backend.versions())
    pool = [t for t in store.trials(store.key_id(key.to_dict()), env_id) if t.ok and t.config]
    if not pool:
        rec["error"] = "no pool config ran"
        return rec
    best = GemmConfig.from_dict(min(pool, key=lambda t: t.ms).config)
    res, torch_mm, loop = backend.remeasure(key, [best, None, CUBLAS_LOOP])
    rec.update(config=best.name(), trials=tuned.trials, pool_ms=res.ms, grouped_mm_ms=torch_mm.ms,
               cublas_loop_ms=loop.ms if loop.ok else None)
    if res.ok and torch_mm.ok:
        rec["speedup_vs_grouped_mm"] = torch_mm.ms / res.ms
    if res.ok and loop.ok:
        rec["speedup_vs_loop"] = loop.ms / res.ms
    return rec


def summary(records: list[dict]) -> dict:
    """Geomean and least of each speedup over the records that have it;
    seed 000's a point per K, its best tile's (the one a tune would pick)."""
    best: dict[int, dict] = {}
    for r in records:
        if r["part"] == "seed000" and r.get("speedup_vs_loop"):
            if r["K"] not in best or r["speedup_vs_loop"] > best[r["K"]]["speedup_vs_loop"]:
                best[r["K"]] = r
    points = [r for r in records if r["part"] != "seed000"] + list(best.values())
    out = {}
    for field in ("speedup_vs_grouped_mm", "speedup_vs_loop"):
        values = [r[field] for r in points if r.get(field)]
        if values:
            out[field] = {"geomean": geomean(values), "min": min(values), "points": len(values)}
    return out


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def markdown(records: list[dict]) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = []
    seed = [r for r in records if r["part"] == "seed000"]
    if seed:
        lines += ["| static config | K | static TFLOP/s | dynamic TFLOP/s | dynamic / static | cuBLAS loop TFLOP/s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {r['K']} | {f(r['static_tflops'], '.1f')} | {f(r['dynamic_tflops'], '.1f')} | "
                  f"{f(r.get('dynamic_over_static'))} | {f(r['cublas_loop_tflops'], '.1f')} |" for r in seed]
    moe_recs = [r for r in records if r["part"] != "seed000"]
    if moe_recs:
        lines += ["", "| key | experts | M | N | K | skew | held SMs | pool ms | torch._grouped_mm ms | speedup "
                  "| cuBLAS loop ms | speedup | config |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.get('key', '-')} | {r['experts']} | {r['M']} | {r['N']} | {r['K']} | {r['skew']} | "
                  f"{r['held_sms']} | {f(r.get('pool_ms'), '.4f')} | {f(r.get('grouped_mm_ms'), '.4f')} | "
                  f"{f(r.get('speedup_vs_grouped_mm'))} | {f(r.get('cublas_loop_ms'), '.4f')} | "
                  f"{f(r.get('speedup_vs_loop'))} | {r.get('config', r.get('error', '-'))} |" for r in moe_recs]
    for field, s in summary(records).items():
        lines.append(f"\n{field}: geomean {f(s['geomean'])}, least {f(s['min'])} over {s['points']} points")
    return "\n".join(lines)


def _run_part(record: dict) -> tuple:
    return record["part"], record.get("skew")


def run(args: argparse.Namespace) -> list[dict]:
    records, device_name, versions = [], None, {}
    if "seed000" in args.part:
        with GpuBackend(ARCH, args.device) as backend:
            device_name, versions = backend.device_name, backend.versions()
            records += seed000(backend)
    if "moe" in args.part:
        records += moe(args.device, args.trials, args.skews or [0.0, DEFAULT_GROUP_SKEW])
    if "models" in args.part:
        records += moe(args.device, args.trials, args.skews or list(MODEL_SKEWS), part="models", tokens=args.tokens)
    if records:
        if device_name is None:
            with GpuBackend(ARCH, args.device) as backend:
                device_name, versions = backend.device_name, backend.versions()
        out = Path(args.out) / f"{device_slug(device_name)}-grouped.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        ran = {_run_part(r) for r in records}
        kept = [r for r in json.loads(out.read_text())["records"] if _run_part(r) not in ran] if out.exists() else []
        records = sorted(kept + records, key=lambda r: r["part"] != "seed000")
        out.write_text(json.dumps({"device": device_name, "versions": versions, "summary": summary(records),
                                   "records": records}, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(markdown(records))
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=("seed000", "moe", "models"), default=["seed000", "moe"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--trials", type=int, default=24, help="Measured trials per MoE key.")
    parser.add_argument("--skews", type=float, nargs="+", default=None,
                        help="Zipf exponents of the routing (default: 0 and 1 for part moe, which runs only "
                             "those, and 0, 0.8 and 1.2 for part models).")
    parser.add_argument("--tokens", type=int, default=2048, help="Part models: tokens routed (rows = top-k x tokens).")
    args = parser.parse_args(argv)
    if "moe" in args.part and args.skews and set(args.skews) - {0.0, DEFAULT_GROUP_SKEW}:
        parser.error(f"--skews: part moe runs 0 and {DEFAULT_GROUP_SKEW} only")
    return args


if __name__ == "__main__":
    run(parse_args())
