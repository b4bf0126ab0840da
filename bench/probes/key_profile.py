"""Launches of one dense key for a profiler: a pool config or cuBLAS.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats \
        python -m bench.probes.key_profile 512 5376 4096 sm90-static_persistent-t128x176-c1x1-s5-w4m

Arguments: M, N, K (bf16 in and out, B an nn.Linear weight) and a config
name (`GemmConfig.name`) or ``cublas``. Two launches run inside the profiler
range after five warm-up launches (`bench.probes.seed000_profile.profiled`).
"""

from __future__ import annotations

import argparse

from bench.probes.seed000_profile import profiled
from kernels.space import GemmConfig
from tuner.backends.gpu import problem_to_json
from tuner.key import Problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("m", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("config", help="a config name, or cublas")
    args = parser.parse_args()
    cfg = None if args.config == "cublas" else GemmConfig.from_name(args.config)
    profiled(problem_to_json(Problem(args.m, args.n, args.k)), cfg)


if __name__ == "__main__":
    main()
