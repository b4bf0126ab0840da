"""Time a fixed set of sm90 pool variants against cuBLAS on the Gemma 3 27B keys.

    python -m bench.probes.sm90_variants [--m 128,512,2048,8192] [--configs NAME,...] [--cold] [--out FILE]

No search: every key times the same hand-picked variants (whole-K tiles,
in-kernel split-K and the stream-K scheduler on the same tiles), interleaved with cuBLAS through `GpuBackend.remeasure`
(CUDA graphs over L2-cold rotated operands, medians, correctness checked on
first use; with --cold, as the M maps are validated: each call alone after
an L2 flush). Prints one markdown row per key: cuBLAS, the best whole-K
variant, the best split-K variant, the best stream-K variant and the best of all, with the geometric
means of cuBLAS / pool over the keys, and writes every timing as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.kernels_sm90 import ARCH, GEMMA3_27B, GEMMA3_M, geomean
from kernels.space import GemmConfig, InvalidConfig, check_problem
from tuner.key import Key, Problem

_STATIC, _DYNAMIC = "static_persistent", "dynamic_persistent"
WHOLE_K = (
    GemmConfig(scheduler=_STATIC, tile_m=128, tile_n=192, stages=4),
    GemmConfig(scheduler=_STATIC, tile_m=128, tile_n=256, stages=4),
    GemmConfig(scheduler=_DYNAMIC, tile_m=128, tile_n=256, stages=4, cluster_m=2),
)
SPLIT_K = tuple(
    GemmConfig(scheduler=_STATIC, tile_m=128, tile_n=tn, stages=4 if tn > 128 else 6, split_k=s)
    for tn, s in ((192, 2), (256, 2), (128, 2), (192, 4), (256, 4))
)
STREAM_K = tuple(
    GemmConfig(scheduler="stream_k", tile_m=tm, tile_n=tn, stages=st, swizzle=4, cluster_m=cm)
    for tm, tn, st, cm in ((128, 128, 6, 1), (128, 192, 4, 1), (128, 256, 4, 1), (128, 256, 4, 2), (64, 256, 5, 1),
                           (256, 128, 3, 2), (256, 96, 3, 2), (256, 128, 3, 1))
)
VARIANTS = (*WHOLE_K, *SPLIT_K, *STREAM_K)
FAMILIES = ("whole-K", "split-K", "stream-K")
# Above this M every key has tiles enough for the whole device without splitting K.
SPLIT_K_MAX_M = 2048


def family(name: str) -> str:
    cfg = GemmConfig.from_name(name)
    return "stream-K" if cfg.stream_k else "split-K" if cfg.split_k > 1 else "whole-K"


def _runs(cfg: GemmConfig, p: Problem) -> bool:
    if cfg.split_k > 1 and p.m > SPLIT_K_MAX_M:
        return False
    try:
        check_problem(cfg, p.m, p.n, p.k)
    except InvalidConfig:
        return False
    return True


def run(ms: list[int], out: Path, variants: tuple[GemmConfig, ...] = VARIANTS, cold: bool = False) -> list[dict]:
    from kernels.compile import compile_many
    from tuner.backends.gpu import GpuBackend

    compile_many(list(variants), workers=16)
    records = []
    with GpuBackend(ARCH) as backend:
        for m in ms:
            for name, (n, k) in GEMMA3_27B.items():
                p = Problem(m, n, k)
                cfgs = [c for c in variants if _runs(c, p)]
                got = backend.remeasure(Key(ARCH, backend.device_name, p), [None, *cfgs], cold=cold)
                times = {c.name(): g.ms for c, g in zip(cfgs, got[1:]) if g.ok}
                errors = {c.name(): g.error for c, g in zip(cfgs, got[1:]) if not g.ok}
                rec = {"name": name, "M": m, "N": n, "K": k, "cublas_ms": got[0].ms, "pool_ms": times,
                       "errors": errors, "device": backend.device_name}
                records.append(rec)
                print(_row(rec), file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(markdown(records))
    return records


def _best(rec: dict, families: tuple[str, ...] = FAMILIES) -> float | None:
    return min((ms for cfg, ms in rec["pool_ms"].items() if family(cfg) in families), default=None)


def _row(rec: dict) -> str:
    cells = [rec["name"], rec["M"], rec["N"], rec["K"], rec["cublas_ms"],
             *(_best(rec, (f,)) for f in FAMILIES), _best(rec)]
    return "| " + " | ".join("-" if c is None else f"{c:.4f}" if isinstance(c, float) else str(c)
                             for c in cells) + " |"


def markdown(records: list[dict]) -> str:
    head = ["key", "M", "N", "K", "cuBLAS ms", *(f"{f} ms" for f in FAMILIES), "pool ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_row(r) for r in records]
    for label, families in (("whole-K", FAMILIES[:1]), ("whole-K or split-K", FAMILIES[:2]), ("pool", FAMILIES)):
        ratios = [r["cublas_ms"] / b for r in records if (b := _best(r, families))]
        lines.append(f"geometric mean cuBLAS/{label} {geomean(ratios):.3f} over {len(ratios)} keys")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default=",".join(map(str, GEMMA3_M)), help="Comma-separated M values.")
    parser.add_argument("--configs", default="",
                        help="Comma-separated config names to time instead of the built-in variants.")
    parser.add_argument("--cold", action="store_true", help="Time each call alone after an L2 flush.")
    parser.add_argument("--out", default="sm90-variants.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    chosen = tuple(GemmConfig.from_name(n) for n in args.configs.split(",") if n) or VARIANTS
    run([int(m) for m in args.m.split(",")], Path(args.out), chosen, cold=args.cold)
