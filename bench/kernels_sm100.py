"""The Blackwell (sm100) kernel pool: offline compile checks anywhere, correctness and tuning on a B200.

    python -m bench.kernels_sm100 --offline [--workers N] [--out bench/results]
    python -m bench.kernels_sm100 [--keys 27b] [--trials 24] [--budget-s 1800] [--db URL] [--out ...]

`--offline` needs no GPU: it compiles a spread of variants (every scheduler,
CLC depths 1-3 with and without tail cancel, 1-CTA and 2-CTA MMA, clusters
from 1x1 to 4x4, both layouts, fp16/bf16 in, fp32 out, split-K) for sm_100a
and writes `<out>/offline-sm100-variants.json`: per variant the compile
seconds, the PTX checks of `ptx_checks`, registers per thread (from the
cubin) and shared memory per CTA. The CI test of the pool compiles the same
spread and asserts the checks.

On a Blackwell GPU the default run first checks every scheduler against an
fp32 reference on awkward shapes (sizes that are not multiples of any tile,
tiny M, both layouts, fp32 output, split-K), then tunes the Gemma 3 27B keys
with `tuner.search.study` against cuBLAS, and writes `<out>/<device-slug>-sm100.json`
(the correctness results and one record per key) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path

from bench.kernels_sm90 import KEY_SETS, _fmt, _searched, device_slug
from kernels import compile as kc
from kernels import space
from kernels.sm100.clc import TAIL_CANCEL_BURST
from kernels.space import GemmConfig
from tuner.key import Key, Problem

ARCH = "sm100"
SCHEDULERS = space.knobs(ARCH)["scheduler"]
# Threads per CTA: four epilogue warps, the MMA warp, the TMA warp, and the
# scheduler warp of the dynamic schedulers.
_THREADS = {False: 192, True: 224}


def _v(layout="tn", dtype_in="bf16", dtype_out="bf16", **fields) -> kc.Variant:
    return kc.Variant(GemmConfig(arch=ARCH, **fields), dtype_in, dtype_out, layout)


_TWO_CTA = dict(tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2)

# The offline spread: every scheduler; CLC at depths 1-3, with and without
# tail cancel, on clusters of 1, 2, 4, 8 and 16 CTAs; 1-CTA tiles of 64 and
# 128 rows and 2-CTA tiles of 128 and 256; one and two TMEM accumulator
# stages (and four); both layouts; fp16, bf16 and fp32 out; split-K.
OFFLINE_VARIANTS = [
    _v(scheduler="single_tile"),
    _v("nn", scheduler="single_tile", stages=6, **_TWO_CTA),
    _v(scheduler="single_tile", tile_m=64, tile_n=256, stages=4, cluster_n=2),
    _v(scheduler="static_persistent", acc_stages=2, swizzle=4),
    _v("nn", scheduler="static_persistent", tile_m=256, tile_n=256, cluster_m=2, cta_group=2, acc_stages=2),
    _v(scheduler="static_persistent", tile_m=64, tile_n=32, stages=8, acc_stages=4, swizzle=8, raster="n"),
    _v(scheduler="static_persistent", tile_m=128, tile_n=96, cluster_m=2, cta_group=2, cluster_n=2),
    _v(scheduler="static_persistent", split_k=4, tile_m=128, tile_n=64),
    _v(scheduler="dynamic_persistent"),
    _v(scheduler="dynamic_persistent", sched_depth=2, swizzle=2, **_TWO_CTA),
    _v("nn", scheduler="dynamic_persistent", sched_depth=2, tile_n=256, cluster_m=4, acc_stages=2),
    _v(scheduler="dynamic_persistent", tile_m=64, tile_n=128, cluster_m=2, cluster_n=2, stages=6),
    _v(scheduler="dynamic_persistent", dtype_in="fp16", dtype_out="fp32", split_k=2, tile_n=64),
    _v(scheduler="clc", sched_depth=1),
    _v(scheduler="clc", sched_depth=2, acc_stages=2, swizzle=4),
    _v("nn", scheduler="clc", sched_depth=3, tile_m=64, tile_n=192, stages=6, raster="n", swizzle=2),
    _v(scheduler="clc", sched_depth=1, tail_cancel=True),
    _v(scheduler="clc", sched_depth=3, tail_cancel=True, tile_n=256, acc_stages=2, stages=4),
    _v(scheduler="clc", sched_depth=1, **_TWO_CTA),
    _v(scheduler="clc", sched_depth=2, tail_cancel=True, **_TWO_CTA),
    _v("nn", scheduler="clc", sched_depth=3, stages=6, swizzle=8, **_TWO_CTA),
    _v(scheduler="clc", sched_depth=1, cluster_m=2, cluster_n=2),
    _v(scheduler="clc", sched_depth=3, tail_cancel=True, cluster_n=2, **_TWO_CTA),
    _v(scheduler="clc", sched_depth=2, cluster_m=4, tile_n=64, stages=8),
    _v(scheduler="clc", sched_depth=1, tail_cancel=True, cluster_m=4, cluster_n=2, tile_m=128, tile_n=64,
       cta_group=2, stages=8, acc_stages=4),
    _v(scheduler="clc", sched_depth=2, cluster_m=4, cluster_n=4, tile_m=128, tile_n=160, cta_group=2, stages=7),
    _v(scheduler="clc", sched_depth=1, cluster_n=2, tile_m=64, tile_n=64, stages=8),
    _v(scheduler="clc", dtype_in="fp16", dtype_out="fp16", sched_depth=2, tile_n=224),
    _v("nn", scheduler="clc", dtype_out="fp32", sched_depth=1, tail_cancel=True, **_TWO_CTA),
    _v(scheduler="clc", split_k=2, sched_depth=2, tile_m=128, tile_n=128, cluster_m=2, cta_group=2),
]


def _lines_with(ptx: str, needle: str) -> list[str]:
    return [line for line in ptx.splitlines() if needle in line]


def ptx_checks(v: kc.Variant, k: kc.OfflineKernel) -> dict[str, bool]:
    """What the PTX and resources of variant `v` must show (name -> holds)."""
    cfg = v.cfg
    clc = cfg.scheduler == "clc"
    try_cancels = _lines_with(k.ptx, "clusterlaunchcontrol.try_cancel")
    mma = _lines_with(k.ptx, "tcgen05.mma")
    threads = re.search(r"\.reqntid (\d+)", k.ptx)
    return {
        "target sm_100a": ".target sm_100a" in k.ptx,
        "tcgen05.mma": bool(mma),
        f"tcgen05.mma cta_group::{cfg.cta_group}": all(f"cta_group::{cfg.cta_group}" in m for m in mma),
        # One query site for the schedule, plus the unrolled tail burst.
        "try_cancel exactly in clc": len(try_cancels) == (
            (1 + TAIL_CANCEL_BURST * cfg.tail_cancel) if clc else 0),
        # The schedule's query reaches every CTA of a cluster; the tail burst's never leave the issuer.
        "try_cancel multicast iff cluster > 1": sum("multicast::cluster::all" in t for t in try_cancels)
        == (1 if clc and cfg.cluster_size > 1 else 0),
        "query_cancel exactly in clc": ("clusterlaunchcontrol.query_cancel" in k.ptx) == clc,
        # The claim counter's relaxed add: the atomic scheduler's and stream-K's.
        "atom.global.add exactly in dynamic_persistent and stream_k": ("atom.global.add" in k.ptx)
        == (cfg.scheduler in ("dynamic_persistent", "stream_k")),
        "threads per CTA": threads is not None
        and int(threads.group(1)) == _THREADS[cfg.dynamic or cfg.stream_k],
        "registers known": k.registers is not None and 0 < k.registers <= 255,
        "smem within the space's budget": k.smem_bytes <= space.smem_bytes(cfg, v.dtype_in),
    }


def offline(workers: int, out_dir: Path) -> list[dict]:
    """Compile the spread for sm_100a; write and return one record per variant."""
    # Compile seconds are for a cold compile: keep the DSL's own file cache out.
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    started = time.monotonic()
    kernels = kc.compile_offline(OFFLINE_VARIANTS, workers=workers)
    records = []
    for v, k in zip(OFFLINE_VARIANTS, kernels, strict=True):
        checks = ptx_checks(v, k)
        threads = re.search(r"\.reqntid (\d+)", k.ptx)
        records.append({
            "variant": v.key(), "config": v.cfg.to_dict(), "dtype_in": v.dtype_in,
            "dtype_out": v.dtype_out, "layout": v.layout, "compile_s": round(k.seconds, 2),
            "registers": k.registers, "stack_bytes": k.stack_bytes, "smem_bytes": k.smem_bytes,
            "threads": int(threads.group(1)) if threads else None,
            "try_cancel_sites": k.ptx.count("clusterlaunchcontrol.try_cancel"),
            "checks": checks, "ok": all(checks.values()),
        })
    _write_json(out_dir / f"offline-{ARCH}-variants.json", {
        "target": "sm_100a", "dsl_version": version("nvidia-cutlass-dsl"), "workers": workers,
        "wall_s": round(time.monotonic() - started, 1),
        "variants": len(records), "all_ok": all(r["ok"] for r in records), "records": records,
    })
    print(_table(
        ["variant", "compile s", "regs", "stack B", "smem KB", "threads", "try_cancel", "checks"],
        [[r["variant"], r["compile_s"], r["registers"], r["stack_bytes"], round(r["smem_bytes"] / 1024, 1),
          r["threads"],
          r["try_cancel_sites"],
          "ok" if r["ok"] else "FAIL: " + ", ".join(n for n, ok in r["checks"].items() if not ok)]
         for r in records],
    ))
    return records


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in [head, ["---"] * len(head), *rows])


# ---------------------------------------------------------------- on a B200

# Every scheduler, 1-CTA and 2-CTA MMA, multicast clusters, CLC depths and
# tail cancel, checked on each of the awkward problems below.
CORRECTNESS_CONFIGS = [
    GemmConfig(arch=ARCH, scheduler="single_tile"),
    GemmConfig(arch=ARCH, scheduler="single_tile", tile_m=64, tile_n=96, cluster_n=2),
    GemmConfig(arch=ARCH, scheduler="static_persistent", swizzle=4, acc_stages=2),
    GemmConfig(arch=ARCH, scheduler="static_persistent", raster="n", swizzle=2, **_TWO_CTA),
    GemmConfig(arch=ARCH, scheduler="dynamic_persistent", sched_depth=1),
    GemmConfig(arch=ARCH, scheduler="dynamic_persistent", sched_depth=2, cluster_n=2, **_TWO_CTA),
    GemmConfig(arch=ARCH, scheduler="clc", sched_depth=1),
    GemmConfig(arch=ARCH, scheduler="clc", sched_depth=2, swizzle=4, **_TWO_CTA),
    GemmConfig(arch=ARCH, scheduler="clc", sched_depth=3, tail_cancel=True, tile_m=128, tile_n=64,
               cluster_m=2, cluster_n=2, cta_group=2),
    GemmConfig(arch=ARCH, scheduler="clc", sched_depth=2, split_k=2, tile_m=128, tile_n=128),
]
# (M, N, K, layout, dtype_out): ragged edges in every dimension, tiny M.
AWKWARD = [
    (1, 264, 72, "tn", "bf16"),
    (129, 1032, 4104, "tn", "bf16"),
    (1000, 5384, 1032, "nn", "bf16"),
    (3000, 776, 5376, "tn", "fp32"),
    (77, 8192, 5376, "nn", "fp16"),
]


def correctness(backend, device: str) -> list[dict]:
    """Each correctness config on each awkward problem, checked against fp32 by the worker."""
    results = []
    for cfg in CORRECTNESS_CONFIGS:
        for m, n, k, layout, dtype_out in AWKWARD:
            p = Problem(m, n, k, dtype_in="fp16" if dtype_out == "fp16" else "bf16", dtype_out=dtype_out,
                        layout=layout)
            try:
                p.check(cfg)
            except space.InvalidConfig as exc:
                results.append({"config": cfg.name(), "problem": p.label(), "ok": None, "skipped": str(exc)})
                continue
            got = backend.measure(Key(ARCH, device, p), cfg)
            results.append({"config": cfg.name(), "problem": p.label(), "ok": got.ok,
                            "rel_err": got.rel_err, "error": got.error})
            print(f"{cfg.name()} {p.label()}: {'ok' if got.ok else 'FAILED ' + str(got.error)}", file=sys.stderr)
    return results


def tune(args: argparse.Namespace) -> dict:
    from tuner.backends.gpu import GpuBackend

    backend = GpuBackend(ARCH, args.device)
    deadline = time.monotonic() + args.budget_s
    try:
        device = backend.device_name
        checked = correctness(backend, device)
        shapes, ms = KEY_SETS[args.keys]
        keys = [(name, Key(ARCH, device, Problem(m, n, k))) for m in ms for name, (n, k) in shapes.items()]
        records = []
        for i, (name, key) in enumerate(keys):
            t0 = time.monotonic()
            left = max(1.0, (deadline - t0) / (len(keys) - i))
            rec = _searched(backend, key, name, args.trials, left, args.db)
            p = key.problem
            rec = {"name": name, "M": p.m, "N": p.n, "K": p.k, **rec,
                   "speedup": rec["cublas_ms"] / rec["best_ms"] if rec.get("best_ms") else None,
                   "seconds": round(time.monotonic() - t0, 1)}
            records.append(rec)
            print(f"{name} M={p.m}: cuBLAS {rec['cublas_ms']} ms, best {rec['best_ms']} ms "
                  f"({rec['winner']})", file=sys.stderr)
        result = {"device": device, "versions": backend.versions(), "restarts": backend.restarts,
                  "correctness": checked, "keys": records}
    finally:
        backend.close()
    _write_json(Path(args.out) / f"{device_slug(device)}-{ARCH}.json", result)
    print(_table(
        ["key", "M", "N", "K", "cuBLAS ms", "pool ms", "cuBLAS/pool", *SCHEDULERS, "winner"],
        [[r["name"], r["M"], r["N"], r["K"], _fmt(r["cublas_ms"]), _fmt(r["best_ms"]),
          "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
          *(_fmt(r["best_by_scheduler"].get(s)) for s in SCHEDULERS), r["winner"]]
         for r in records],
    ))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="Compile the variant spread for sm_100a, no GPU.")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Offline compile processes.")
    parser.add_argument("--keys", choices=sorted(KEY_SETS), default="27b")
    parser.add_argument("--trials", type=int, default=24, help="Search trials per key.")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="Wall time for the tuning of all keys.")
    parser.add_argument("--db", default=None, help="Database of the search (default: the tuner's).")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.offline:
        offline(args.workers, Path(args.out))
    else:
        tune(args)
