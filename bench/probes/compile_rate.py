"""How fast the host compiles pool kernels, alone and with every core busy.

    python -m bench.probes.compile_rate [--workers 1,4,14]

Compiles the model's picks for a few 27B keys into an empty cache, once per
worker count (a fresh cache each): a first round starts the pool's
processes, a second is timed as the steady rate (configs per second, and
seconds per config in one process). A cold tune compiles a few hundred configs; whether
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
    parser.add_argument("--workers", default="1,4,14")
    args = parser.parse_args()
    from tuner.key import Key, Problem
    from tuner.search.study import model_picks

    cfgs = []
    for m in (1, 16, 128, 512, 2048, 8192):
        for n, k in ((8192, 5376), (43008, 5376)):
            cfgs += [c for c in model_picks(Key("sm90", "x", Problem(m, n, k)), 8) if c not in cfgs]
    out = []
    for workers in map(int, args.workers.split(",")):
        os.environ["KERNELS_CACHE_DIR"] = tempfile.mkdtemp()
        import kernels.compile as kc

        # The pool's processes start (and import the DSL) on a first round;
        # the second round is the steady rate a tune sees.
        rounds = []
        for batch in (cfgs[:workers], cfgs[workers: workers + max(2, 2 * workers)]):
            started = time.perf_counter()
            kc.compile_many(batch, workers=workers)
            rounds.append((len(batch), time.perf_counter() - started))
        (n0, s0), (n1, s1) = rounds
        out.append({"workers": workers, "first_round": {"configs": n0, "wall_s": round(s0, 2)},
                    "steady": {"configs": n1, "wall_s": round(s1, 2), "configs_per_s": round(n1 / s1, 2),
                               "s_per_config_per_worker": round(s1 * workers / n1, 2)}})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
