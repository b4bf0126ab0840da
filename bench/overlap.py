"""A Gemma 3 27B GEMM beside an NCCL all-reduce: cuBLAS vs our static and dynamic schedulers.

    python -m bench.overlap [--gpus 2] [--families down,qkv] [--m 2048,8192] [--iters 40] [--out DIR]

Tensor parallelism runs collectives on another stream while the next GEMM
runs, and NCCL's kernels take SMs from it (seed 003's scenario, with a real
collective instead of a spinning kernel). One process per GPU
(torch.distributed, NCCL). Per GEMM (the shape file's unsharded 27B
projections) and M, every rank times, interleaved round robin:

- each candidate alone (cuBLAS `torch.mm`, the static_persistent and the
  dynamic_persistent config of the tile the H100 tune chose for it, built
  with `kernels.compile.get_kernel`);
- each candidate while R back-to-back all-reduces of an M x 5376 bf16
  activation (the hidden size: what a row-parallel projection reduces) run
  on a second stream, R chosen so that they cover cuBLAS's GEMM alone;
- the all-reduce's own time per call, alone and beside each GEMM.

Times are medians of CUDA-event intervals on rank 0 (every rank runs the
same work). Writes `<out>/<device-slug>-overlap.json` (`--out` defaults to
$OUT when set, else bench/results).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.kernels_sm90 import GEMMA3_27B, device_slug
from bench.record import save

HIDDEN = 5376
# The MMA tile the H100 tune of gemma3.txt chose at M = 8192 (its M maps):
# the same tile under both persistent schedulers, so only the scheduler differs.
TILES = {"qkv": (128, 256), "o": (128, 224), "gate_up": (128, 256), "down": (128, 224)}
SCHEDULERS = ("static_persistent", "dynamic_persistent")


def _configs(family: str):
    from kernels.space import GemmConfig

    tile_m, tile_n = TILES[family]
    return {s: GemmConfig(arch="sm90", scheduler=s, tile_m=tile_m, tile_n=tile_n, stages=4, swizzle=4)
            for s in SCHEDULERS}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    from kernels.compile import get_kernel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    comm = torch.cuda.Stream()
    out = []
    for family in args.families:
        n, k = GEMMA3_27B[family]
        cfgs = _configs(family)
        runners = {s: get_kernel(c, dtype_in="bf16", dtype_out="bf16", layout="tn") for s, c in cfgs.items()}
        for m in args.m:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            act = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            cands = {"cublas": lambda: torch.mm(a, w.t(), out=y)}
            cands |= {s: (lambda r=r: r(a, w, y)) for s, r in runners.items()}
            ref = a.float() @ w.float().t()
            for name, run in cands.items():
                run()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err <= 2e-2:
                    raise RuntimeError(f"{family} M={m}: {name} is wrong (relative error {err:.3g})")
            ar_alone = _median([_time(None, lambda: dist.all_reduce(act), comm)[1] for _ in range(args.iters)])
            alone = {name: [] for name in cands}
            for _ in range(args.iters):
                for name, run in cands.items():
                    alone[name].append(_time(run, None, comm)[0])
            alone = {name: _median(t) for name, t in alone.items()}
            repeat = max(1, math.ceil(alone["cublas"] / ar_alone))

            def reduces() -> None:
                for _ in range(repeat):
                    dist.all_reduce(act)
            beside = {name: ([], []) for name in cands}
            for _ in range(args.iters):
                for name, run in cands.items():
                    g, r = _time(run, reduces, comm)
                    beside[name][0].append(g)
                    beside[name][1].append(r / repeat)
            out.append({
                "family": family, "m": m, "n": n, "k": k, "allreduce_bytes": act.numel() * act.element_size(),
                "allreduce_repeat": repeat, "allreduce_ms_alone": ar_alone,
                "configs": {s: c.name() for s, c in cfgs.items()},
                "candidates": {name: {
                    "ms_alone": alone[name], "ms_beside_allreduce": _median(beside[name][0]),
                    "allreduce_ms_beside": _median(beside[name][1]),
                } for name in cands},
            })
            row = out[-1]["candidates"]
            if rank == 0:
                print(f"{family} M={m}: " + ", ".join(
                    f"{name} {v['ms_alone']:.3f}/{v['ms_beside_allreduce']:.3f} ms" for name, v in row.items())
                    + f"; all-reduce {ar_alone:.3f} ms x{repeat}", flush=True)
    if rank == 0:
        results["points"] = out
        results["device"] = torch.cuda.get_device_name(0)
        results["nccl"] = str(torch.cuda.nccl.version())
    dist.barrier()
    dist.destroy_process_group()


def _time(gemm, collective, comm: torch.cuda.Stream) -> tuple[float, float]:
    """(GEMM ms, collective ms) of one launch of each, the collective on `comm`
    launched first so that its kernels hold SMs when the GEMM starts. Every
    rank enters aligned (a barrier) and leaves synchronized."""
    dist.barrier()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    if collective is not None:
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            events[2].record()
            collective()
            events[3].record()
    if gemm is not None:
        events[0].record()
        gemm()
        events[1].record()
    torch.cuda.synchronize()
    g = events[0].elapsed_time(events[1]) if gemm is not None else math.nan
    c = events[2].elapsed_time(events[3]) if collective is not None else math.nan
    return g, c


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--families", default="down,qkv", help=f"Of {', '.join(GEMMA3_27B)}.")
    parser.add_argument("--m", default="2048,8192")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    args = parser.parse_args()
    args.families = args.families.split(",")
    unknown = [f for f in args.families if f not in GEMMA3_27B]
    if unknown:
        parser.error(f"unknown families {unknown}; expected some of {list(GEMMA3_27B)}")
    args.m = [int(m) for m in args.m.split(",")]
    if torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus}, but {torch.cuda.device_count()} CUDA devices are visible")
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args.gpus, _free_port(), args, results), nprocs=args.gpus, join=True)
    points = results["points"]
    for p in points:
        c = p["candidates"]
        p["dynamic_over_cublas_beside"] = round(
            c["cublas"]["ms_beside_allreduce"] / c["dynamic_persistent"]["ms_beside_allreduce"], 4)
        p["dynamic_over_static_beside"] = round(
            c["static_persistent"]["ms_beside_allreduce"] / c["dynamic_persistent"]["ms_beside_allreduce"], 4)
    save({"device": results["device"], "gpus": args.gpus, "nccl": results["nccl"], "iters": args.iters,
          "torch": torch.__version__, "points": points}, args.out, f"{device_slug(results['device'])}-overlap")


if __name__ == "__main__":
    main()
