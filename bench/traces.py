"""The seeds' pictures on our GPU: traced launches, static against dynamic.

- seed 000: four problems of 1024 x 1024 with K = 1024, 32768, 1024, 32768
  (the grouped kernel's "k" form), 128x192 tiles on 2x1 clusters, the
  scheduler the only change (the pair `bench.grouped` measures);
- seed 003: 8192 x 8192 x 8192 with 20 SMs held by a spinning kernel,
  128x256 tiles on 2x1 clusters (the pair `bench.imbalance` measures).

Writes, per trace, `<device>-trace-<name>.json` (records and summary) and
its timeline, tiles-per-SM and SM-idle pictures into `--out` (default
bench/results), and prints one line per trace.

    python -m bench.traces [--out DIR]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kernels.space import GemmConfig
from tuner.key import Key, Problem
from tuner.observe.trace import run, summarise, write

TRACES = {
    "seed000-static": (Problem(1024, 1024, 32768, groups=4, group_k=(1024, 32768, 1024, 32768)),
                       "sm90-static_persistent-t128x192-c2x1-s4-w1m"),
    "seed000-dynamic": (Problem(1024, 1024, 32768, groups=4, group_k=(1024, 32768, 1024, 32768)),
                        "sm90-dynamic_persistent-t128x192-c2x1-s4-w1m-d1"),
    "seed003-static": (Problem(8192, 8192, 8192, carveout=20), "sm90-static_persistent-t128x256-c2x1-s4-w8m"),
    "seed003-dynamic": (Problem(8192, 8192, 8192, carveout=20), "sm90-dynamic_persistent-t128x256-c2x1-s4-w8m-d1"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    for name, (problem, config) in TRACES.items():
        trace = run(Key("sm90", device, problem), GemmConfig.from_name(config))
        write(trace, args.out, f"{slug}-trace-{name}")
        s = summarise(trace)
        print(f"{name}: {s['tiles_in_problem']}/{trace.tiles} tiles on {s['sms_used']} SMs, "
              f"span {s['span_us']:.1f} us, SM idle {s['idle_us_total']:.0f} us, "
              f"claims {s['claims']} (median {s['claim_ns_median']} ns)")


if __name__ == "__main__":
    main()
