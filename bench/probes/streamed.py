"""The weight-streaming kernels at few rows against the DRAM floor, cuBLAS and given configs.

    python -m bench.probes.streamed --shapes FILE [FILE ...] [--only GLOB] [--m 1,16,64]
                                    [--configs NAME,...] [--rounds 40] [--out FILE]

No search and no database: for every dense family (N, K) of the shape
files and every M, the swap_ab stream-K configs (`streamed`: each SM an
equal contiguous share of the weight's k-blocks) of 64- and 128-row weight
tiles, k-blocks of 64 and 128, either L2 hint, clusters of 1 (and of 2
along the weight), the deepest ring each fits, time beside cuBLAS, a device copy of the weight
(its half is the floor, as `bench.roofline` takes it) and `--configs`
(e.g. the winners a database stores there) where their tile's activation
rows fit M (M to twice M). Timing is `bench.roofline`'s:
CUDA graphs of one call replayed after an L2 flush, in rounds of at most
six graphs (cuBLAS and the copy in each), trimmed means. A config whose
output differs from cuBLAS's by more than 2e-2 (relative) stops the run.
Prints one line per family and M, writes every time as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.dynamic_m import capture, families, flush_buffer, m_list, replay_rounds
from kernels.compile import compile_many, get_kernel
from bench.kernels_sm90 import max_stages
from kernels.space import GemmConfig, InvalidConfig, check_problem
from tuner.backends.gpu_worker import rel_error
from tuner.backends.measure import trimmed_mean

# Graphs a round replays: their orders cycle through every permutation.
ROUND_GRAPHS = 6


def streamed(m: int) -> list[GemmConfig]:
    """The weight-streaming configs for M activation rows, each at its deepest ring."""
    rows = 8 if m <= 8 else -(-m // 16) * 16
    shapes = [(tile_m, tile_k, hint, 1) for tile_m in (64, 128) for tile_k in (64, 128)
              for hint in ("normal", "b_first")]
    shapes += [(tile_m, 128, "b_first", 2) for tile_m in (64, 128)]
    out = []
    for tile_m, tile_k, hint, cluster_m in shapes:
        fields = dict(scheduler="stream_k", tile_m=tile_m, tile_n=rows, tile_k=tile_k, l2_hint=hint,
                      cluster_m=cluster_m, swap_ab=True)
        stages = max_stages(**fields)
        if stages is not None:
            out.append(GemmConfig(**fields, stages=stages))
    return out


def _us(samples: list[float]) -> float:
    return trimmed_mean(samples) * 1e3


def run(args) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    flush = flush_buffer(dev)
    given = [GemmConfig.from_name(name) for name in args.configs.split(",") if name]
    fams = families(args.shapes, args.only)
    cfgs = sorted({c for m in args.m for c in streamed(m)} | set(given), key=GemmConfig.name)
    print(f"compiled {compile_many(cfgs, workers=max(1, (os.cpu_count() or 2) - 2))} kernels", file=sys.stderr)
    record = {"device": torch.cuda.get_device_name(dev), "rounds": args.rounds, "m": args.m, "families": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    keep = []  # every tensor a graph touches outlives the graphs
    for (n, k), (name, _) in fams.items():
        w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
        dst = torch.empty_like(w)
        keep += [w, dst]
        copy = capture(lambda: dst.copy_(w))
        fam = {"name": name, "n": n, "k": k, "weight_mb": w.numel() * 2 / 1e6, "points": []}
        copies = []
        for m in args.m:
            x = (torch.randn(m, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
            ref = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            keep += [x, ref]
            cublas = capture(lambda: torch.mm(x, w.t(), out=ref))
            want = x.float() @ w.float().t()
            runnable = []
            # A given config runs where its tile's activation rows fit M snugly.
            for cfg in [*streamed(m), *(g for g in given if m <= g.m_rows <= 2 * max(m, 8))]:
                try:
                    check_problem(cfg, m, n, k)
                except InvalidConfig:
                    continue
                runnable.append(cfg)
            graphs = {}
            for cfg in runnable:
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                keep.append(out)
                runner = get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
                graphs[cfg.name()] = capture(lambda runner=runner, out=out: runner(x, w, out))
                err = rel_error(out, want)
                if err > 2e-2:
                    raise SystemExit(f"{cfg.name()} at {(m, n, k)}: relative error {err}")
            names = list(graphs)
            times: dict[str, list[float]] = {"cublas": []}
            step = ROUND_GRAPHS - 2
            for i in range(0, len(names), step):
                chunk = names[i:i + step]
                got = replay_rounds([cublas, copy, *(graphs[c] for c in chunk)], args.rounds, flush)
                times["cublas"] += got[0]
                copies += got[1]
                for c, t in zip(chunk, got[2:], strict=True):
                    times[c] = t
            fam["points"].append({"m": m, "us": {c: _us(t) for c, t in times.items()}})
        fam["floor_us"] = _us(copies) / 2
        for p in fam["points"]:
            us = p["us"]
            p["of_floor"] = {c: fam["floor_us"] / t for c, t in us.items()}
            best_streamed = min((c for c in us if c.startswith("sm90-stream_k") and "-ab" in c),
                                key=us.get, default=None)
            best_given = min((c for c in us if c in {g.name() for g in given}), key=us.get, default=None)
            print(f"{name[:24]:24} m={p['m']:<4} floor {fam['floor_us']:7.1f} us  cublas "
                  f"{p['of_floor']['cublas']:.3f}  streamed {p['of_floor'].get(best_streamed, 0):.3f}"
                  f"  given {p['of_floor'].get(best_given, 0):.3f}", flush=True)
            print(f"    {best_streamed}  |  {best_given}", flush=True)
        record["families"].append(fam)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--only", default="*")
    parser.add_argument("--m", type=m_list, default=[1, 16, 64])
    parser.add_argument("--configs", default="", help="comma-separated config names timed beside")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    args = parser.parse_args()
    record = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
