"""Heavy and light MoE groups merged vs plain group order, on the skewed 64-expert keys.

    python -m bench.probes.group_order [--out bench/results]

`kernels.grouped` merges the tiles of heavy groups (B reused from L2, bound
by the tensor cores) with those of light ones (B streamed from DRAM). This
times both orders for a few fixed configs on the skewed 64-expert keys of
`bench.grouped`, the only MoE keys with both classes: plain group order is
the same kernel built with `LIGHT_ROWS` = 0 (every non-empty group heavy,
`plain_group_order`), in a child process with its own compile cache.
Median of CUDA-graph replays; one operand set (the 1.9 GB of expert weights
overflow L2 anyway).
Writes `<out>/<device-slug>-group-order.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.grouped import MOE_KEYS, _cfg
from bench.kernels_sm90 import device_slug
from tuner.backends.gpu_worker import DEFAULT_GROUP_SKEW
from tuner.backends.gpu import problem_to_json
from tuner.key import Problem

CONFIGS = (
    _cfg("dynamic_persistent", tile_m=128, tile_n=256, cluster_m=2, swizzle=4),
    _cfg("dynamic_persistent", tile_m=128, tile_n=256, cluster_n=2),
    _cfg("single_tile", tile_m=128, tile_n=256),
    _cfg("single_tile", tile_m=128, tile_n=256, cluster_n=2),
)
ORDERS = ("merged", "group")
_SAMPLES = 20


def plain_group_order() -> None:
    """Build this process's grouped kernels in plain group order, into a compile cache of their own."""
    import kernels.group_table
    from kernels.compile import cache_dir

    kernels.group_table.LIGHT_ROWS = 0
    os.environ["KERNELS_CACHE_DIR"] = str(cache_dir() / "group-order")


def _time_order(order: str) -> list[dict]:
    import torch

    from tuner.backends import gpu_worker as worker

    if order == "group":
        plain_group_order()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    records = []
    for g, m, n, k in MOE_KEYS:
        if g != 64:
            continue
        p = problem_to_json(Problem(m, n, k, groups=g)) | {"skew": DEFAULT_GROUP_SKEW}
        ops = worker._make_operands(p, gen)
        for cfg in CONFIGS:
            timer = worker._Timer(worker._pool_launch(cfg.to_dict(), p), [ops])
            events = [timer.sample() for _ in range(_SAMPLES)]
            torch.cuda.synchronize()
            ms = statistics.median(timer.per_launch(e) for e in events)
            records.append({"order": order, "experts": g, "M": m, "N": n, "K": k, "skew": DEFAULT_GROUP_SKEW,
                            "config": cfg.name(), "ms": ms, "tflops": 2 * m * n * k / ms / 1e9})
        del ops
    return records


def run(out_dir: Path) -> list[dict]:
    import torch

    records = []
    for order in ORDERS:
        # One process per order: compiled kernels stay loaded for the life of a process.
        child = subprocess.run([sys.executable, "-m", "bench.probes.group_order", "--child", order],
                               check=True, capture_output=True, text=True)
        records += json.loads(child.stdout)
    device = torch.cuda.get_device_name()
    out = out_dir / f"{device_slug(device)}-group-order.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "records": records}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return records


def markdown(records: list[dict]) -> str:
    group = {(r["N"], r["K"], r["config"]): r["ms"] for r in records if r["order"] == "group"}
    lines = ["| N | K | config | group order ms | merged ms | speedup |", "|---|---|---|---|---|---|"]
    for r in records:
        if r["order"] == "merged":
            base = group[(r["N"], r["K"], r["config"])]
            lines.append(f"| {r['N']} | {r['K']} | {r['config']} | {base:.3f} | {r['ms']:.3f} | {base / r['ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--child", choices=ORDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_time_order(args.child)))
        return
    print(markdown(run(Path(args.out))))


if __name__ == "__main__":
    main()
