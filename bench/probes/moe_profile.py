"""Launches of the skewed 64-expert MoE key for a profiler, merged or plain group order.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum \
        python -m bench.probes.moe_profile merged

For the N = 7168, K = 2048 key of `bench.grouped` (skewed routing; with
``merged`` also the balanced one), one launch inside the profiler range per
config after three warm-up launches. ``group`` builds the kernels in plain
group order (`bench.probes.group_order.plain_group_order`). The reports
`bench/results/logs/ncu/ncu-moe-*.txt` came from this script.
"""

from __future__ import annotations

import argparse

import torch

from bench.probes.group_order import ORDERS, plain_group_order
from bench.grouped import _cfg
from tuner.backends.gpu_worker import DEFAULT_GROUP_SKEW, group_bounds

CONFIGS = (
    _cfg("single_tile", tile_m=128, tile_n=256),
    _cfg("dynamic_persistent", tile_m=128, tile_n=256, swizzle=4),
)
_EXPERTS, _ROWS, _N, _K = 64, 16384, 7168, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("order", choices=ORDERS)
    args = parser.parse_args()
    from kernels import compile as kc

    if args.order == "group":
        plain_group_order()
    bounds = group_bounds(_ROWS, _EXPERTS, DEFAULT_GROUP_SKEW)
    routings = {"skewed": [hi - lo for lo, hi in zip(bounds, bounds[1:])]}
    if args.order == "merged":
        routings["balanced"] = [_ROWS // _EXPERTS] * _EXPERTS
    b = torch.randn(_EXPERTS, _N, _K, device="cuda").mul_(_K ** -0.25).bfloat16()
    for name, sizes in routings.items():
        a = torch.randn(_ROWS, _K, device="cuda").mul_(_K ** -0.25).bfloat16()
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        out = torch.empty(_ROWS, _N, device="cuda", dtype=torch.bfloat16)
        for cfg in CONFIGS:
            run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn", grouped="rows")
            for _ in range(3):
                run(a, b, offs, out)
            torch.cuda.synchronize()
            print(f"PROFILE {args.order} {name} {cfg.name()}", flush=True)
            torch.cuda.profiler.start()
            run(a, b, offs, out)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
