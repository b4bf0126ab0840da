"""Static vs dynamic scheduling when another kernel holds SMs (seed 003), on Hopper.

    python -m bench.imbalance [--sms 0 20 40 60] [--out bench/results]

For each problem and each number of held SMs, a spinning kernel on a second
stream holds that many SMs (`tuner.backends.carveout`) while the GEMM runs. The static
persistent kernel launches one CTA per SM and deals tiles out in advance, so
the CTAs that wait for a held SM leave their tiles for a second, mostly empty
wave; the dynamic (atomic counter) kernel hands tiles to whichever CTA is
free. Same tile for both, re-measured interleaved with cuBLAS. Writes
`<out>/<device-slug>-imbalance.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.kernels_sm90 import ARCH, GEMMA3_27B, device_slug, max_stages
from kernels.space import GemmConfig
from tuner.backends.carveout import expected_slowdown
from tuner.backends.gpu import GpuBackend
from tuner.key import Key, Problem

PROBLEMS = {"square_8192": (8192, 8192, 8192), "gemma27b_down_8192": (8192, *GEMMA3_27B["down"])}
# Tiles shared by both schedulers: the large-M choices of the Gemma bench.
TILES = (dict(tile_m=128, tile_n=256, cluster_m=2), dict(tile_m=128, tile_n=256))


def pairs() -> list[tuple[GemmConfig, GemmConfig]]:
    """(static, dynamic) configs that differ only in the scheduler."""
    out = []
    for tile in TILES:
        fields = dict(arch=ARCH, swizzle=8, **tile)
        stages = max_stages(scheduler="dynamic_persistent", **fields)
        out.append(tuple(GemmConfig(scheduler=s, stages=stages, **fields)
                         for s in ("static_persistent", "dynamic_persistent")))
    return out


def run(args: argparse.Namespace) -> list[dict]:
    backend = GpuBackend(ARCH, args.device)
    records = []
    try:
        for name, (m, n, k) in PROBLEMS.items():
            for sms in args.sms:
                key = Key(ARCH, backend.device_name, Problem(m, n, k, carveout=sms))
                rec = {"problem": name, "M": m, "N": n, "K": k, "held_sms": sms,
                       "expected_slowdown": expected_slowdown(sms, backend.sm_count) if sms else 1.0}
                best: dict[str, tuple[float, GemmConfig]] = {}
                errors = []
                for pair in pairs():
                    for cfg in pair:
                        got = backend.measure(key, cfg)
                        if got.ok and got.ms < best.get(cfg.scheduler, (float("inf"),))[0]:
                            best[cfg.scheduler] = (got.ms, cfg)
                        elif not got.ok:
                            errors.append(f"{cfg.name()}: {got.error}")
                finalists = [best[s][1] for s in ("static_persistent", "dynamic_persistent") if s in best]
                again = backend.remeasure(key, [*finalists, None])
                for cfg, res in zip([*finalists, None], again, strict=True):
                    label = "cublas" if cfg is None else cfg.scheduler.split("_")[0]
                    rec[f"{label}_ms"] = res.ms if res.ok else None
                    if cfg is not None:
                        rec[f"{label}_config"] = cfg.name()
                    if not res.ok:
                        errors.append(f"{label}: {res.error}")
                if rec.get("static_ms") and rec.get("dynamic_ms"):
                    rec["static_over_dynamic"] = rec["static_ms"] / rec["dynamic_ms"]
                rec["errors"] = errors[:4]
                records.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "errors"}), file=sys.stderr)
        for rec in records:
            rec.update(device=backend.device_name, versions=backend.versions())
    finally:
        backend.close()
    if records:
        out = Path(args.out) / f"{device_slug(records[0]['device'])}-imbalance.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(markdown(records))
    return records


def markdown(records: list[dict]) -> str:
    head = ["problem", "held SMs", "ideal slowdown", "cuBLAS ms", "static ms", "dynamic ms", "static / dynamic"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, spec=".4f"):
        return "-" if x is None else format(x, spec)

    for r in records:
        lines.append("| " + " | ".join([
            r["problem"], str(r["held_sms"]), f(r["expected_slowdown"], ".2f"), f(r.get("cublas_ms")),
            f(r.get("static_ms")), f(r.get("dynamic_ms")), f(r.get("static_over_dynamic"), ".2f"),
        ]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", type=int, nargs="+", default=[0, 20, 40, 60])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--device", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
