"""How fast the host compiles pool kernels, alone and with every core busy.

    python -m bench.probes.compile_rate [--configs 28] [--workers 1,4,14]

Compiles the model's picks for a few 27B keys into an empty cache, once per
worker count (a fresh cache each), and prints seconds per config and
configs per second. A cold tune compiles a few hundred configs; whether
that is bound by the compilers' throughput or by their latency on a key's
critical path is what this tells apart.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=28)
    parser.add_argument("--workers", default="1,4,14")
    args = parser.parse_args()
    from tuner.key import Key, Problem
    from tuner.search.study import model_picks

    cfgs = []
    for m in (1, 128, 2048, 8192):
        for n, k in ((8192, 5376), (43008, 5376)):
            cfgs += [c for c in model_picks(Key("sm90", "x", Problem(m, n, k)), 8) if c not in cfgs]
    cfgs = cfgs[: args.configs]
    out = []
    for workers in map(int, args.workers.split(",")):
        os.environ["KERNELS_CACHE_DIR"] = tempfile.mkdtemp()
        import kernels.compile as kc

        batch = cfgs[: max(4, workers * 2)]
        started = time.perf_counter()
        kc.compile_many(batch, workers=workers)
        wall = time.perf_counter() - started
        out.append({"workers": workers, "configs": len(batch), "wall_s": round(wall, 2),
                    "configs_per_s": round(len(batch) / wall, 2)})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
