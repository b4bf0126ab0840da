"""One seed 000 launch for a profiler: the K = 32768 problem of `bench.grouped`.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        python -m bench.probes.seed000_profile dynamic_persistent 128 2 1

Arguments: scheduler (or ``cublas`` for the per-group loop), tile_n, cluster_m,
cluster_n, and optionally K. Two launches run inside the profiler range after
five warm-up launches. The ncu reports under `bench/results/logs/ncu/` came
from this script.
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped import _cfg, seed000_problem
from kernels.space import GemmConfig
from tuner.backends import gpu_worker as worker
from tuner.backends.gpu import problem_to_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scheduler")
    parser.add_argument("tile_n", type=int)
    parser.add_argument("cluster_m", type=int)
    parser.add_argument("cluster_n", type=int)
    parser.add_argument("k", type=int, nargs="?", default=32768)
    args = parser.parse_args()
    cfg = None
    if args.scheduler != "cublas":
        cfg = _cfg(args.scheduler, tile_m=128, tile_n=args.tile_n, cluster_m=args.cluster_m, cluster_n=args.cluster_n)
    profiled(problem_to_json(seed000_problem(args.k)), cfg)


def profiled(p: dict, cfg: GemmConfig | None, warmup: int = 5, count: int = 2) -> None:
    """`count` launches of `cfg` (None: cuBLAS) on problem `p` inside the
    profiler range, after `warmup` outside it, on operands the tuner's worker makes."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    args = worker._make_operands(p, gen).args
    launch = worker._baseline_launch(p) if cfg is None else worker._pool_launch(cfg.to_dict(), p)
    for _ in range(warmup):
        launch(*args)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(count):
        launch(*args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
