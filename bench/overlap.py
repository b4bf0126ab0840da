"""Tensor-parallel GEMMs beside the all-reduce they overlap: makespans, cuBLAS against the pool.

    python -m bench.overlap [--gpus 2] [--models gemma-3-27b,llama-3.1-8b] [--m 16,128,2048,8192]
                            [--picks 3] [--budgets 16,32] [--iters 30] [--out DIR]

Tensor parallelism over T GPUs (`--gpus`, one process each, NCCL) shards a
decoder layer's projections (`tp_gemms`): the column-parallel ones (qkv,
gate_up) by N, the row-parallel ones (o, down) by K. Each row-parallel
product ends in an all-reduce of its M x hidden bf16 output, which a
serving engine runs while the next GEMM computes; NCCL's kernels then take
SMs from it, and a persistent kernel that holds every SM makes them wait.
What counts is when both are done.

Per model, projection and M, every rank times, with an all-reduce of the
M x hidden activation launched first on a second stream (`_time`):
`makespan_ms`, from the first launch until both are done; the GEMM's own
time beside it (`ms_beside`) and the all-reduce's (`allreduce_ms_beside`);
and each alone (`ms_alone`, `allreduce_ms_alone`). Candidates
(`candidates`): cuBLAS (`torch.mm`) and the model's `--picks` best pool
configs for the sharded key, each persistent one also on an SM budget of
the device's SMs less each of `--budgets` (the SMs left to NCCL). They take
turns round by round; times are medians of CUDA events on rank 0 (every
rank runs the same work), each output checked against an fp32 product.

Per point `best` (the pool candidate of least makespan), `makespan_speedup`
(cuBLAS's makespan over the best's), `free_best` (the pool candidate
fastest alone) and its makespan speedup; `summary`: their geomeans and
minimums. Writes `<out>/<device-slug>-overlap-tp<T>.json` (`--out`
defaults to $OUT when set, else bench/results).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.kernels_sm90 import ARCH, device_slug, geomean
from bench.record import save
from kernels.space import GemmConfig
from tuner.config_shapes import Attention, DecoderShape
from tuner.backends.collective import free_port, init_rank
from tuner.key import Key, Problem

# Projections whose output is a partial sum over the GPUs (sharded by K).
ROW_PARALLEL = ("o", "down")


def tp_gemms(shape: DecoderShape, tp: int) -> list[tuple[str, int, int]]:
    """(projection, N, K) of one GPU's share of a dense decoder layer at TP = `tp`."""
    if not isinstance(shape.attention, Attention) or shape.experts is not None or not shape.intermediate_size:
        raise ValueError("bench.overlap shards dense decoders of grouped-query attention")
    out = []
    for name, n, k, _, _ in shape.gemms():
        row = name in ROW_PARALLEL
        if (k if row else n) % tp:
            raise ValueError(f"{name} ({n} x {k}) does not shard into {tp} equal parts along {'K' if row else 'N'}")
        out.append((name, n, k // tp) if row else (name, n // tp, k))
    return out


def candidates(key: Key, picks: int, budgets: list[int], sms: int) -> list[GemmConfig]:
    """The model's `picks` best configs for `key`, each persistent one also
    on an SM budget of `sms` less each of `budgets`."""
    from tuner.search.study import model_picks

    out = []
    for cfg in model_picks(key, picks):
        out.append(cfg)
        if cfg.persistent:
            out += [replace(cfg, sm_budget=sms - b) for b in budgets if 0 < b < sms - cfg.cluster_size]
    return list(dict.fromkeys(out))


def summarize(points: list[dict]) -> dict:
    """Geomeans and minimums of the points' makespan speedups (overlap winner and free-GPU winner)."""
    def stats(values: list[float]) -> dict:
        return {"geomean": round(geomean(values), 4),
                "min": round(min(values), 4)}
    return {
        "points": len(points),
        "makespan_speedup": stats([p["makespan_speedup"] for p in points]),
        "free_best_makespan_speedup": stats([p["free_best_makespan_speedup"] for p in points]),
        "best_differs_from_free_best": sum(p["best"] != p["free_best"] for p in points),
    }


def _point(record: dict) -> dict:
    """A point's verdicts from its candidates' medians."""
    cands = record["candidates"]
    pool = [name for name in cands if name != "cublas"]
    best = min(pool, key=lambda c: cands[c]["makespan_ms"])
    free = min(pool, key=lambda c: cands[c]["ms_alone"])
    cublas = cands["cublas"]["makespan_ms"]
    return record | {
        "best": best, "makespan_speedup": round(cublas / cands[best]["makespan_ms"], 4),
        "free_best": free, "free_best_makespan_speedup": round(cublas / cands[free]["makespan_ms"], 4),
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, plan: list, results: dict) -> None:
    from kernels.compile import get_kernel

    init_rank(rank, world, port, rank)
    comm = torch.cuda.Stream()
    out = []
    for model, hidden, name, m, n, k, names in plan:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.25
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.25
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        act = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        runs = {"cublas": lambda: torch.mm(a, w.t(), out=y)}
        for cfg_name in names:
            runner = get_kernel(GemmConfig.from_name(cfg_name), dtype_in="bf16", dtype_out="bf16", layout="tn")
            runs[cfg_name] = lambda r=runner: r(a, w, y)
        ref = a.float() @ w.float().t()
        for label, run in runs.items():
            y.fill_(float("nan"))
            run()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            if not err <= 2e-2:
                raise RuntimeError(f"{model} {name} M={m}: {label} is wrong (relative error {err:.3g})")
        times = {label: {"alone": [], "beside": [], "reduce": [], "span": []} for label in runs}
        reduce_alone = []
        for _ in range(args.iters):
            reduce_alone.append(_time(None, lambda: dist.all_reduce(act), comm)[1])
            for label, run in runs.items():
                times[label]["alone"].append(_time(run, None, comm)[0])
                g, r, span = _time(run, lambda: dist.all_reduce(act), comm)
                times[label]["beside"].append(g)
                times[label]["reduce"].append(r)
                times[label]["span"].append(span)
        record = _point({
            "model": model, "projection": name, "tp": world, "m": m, "n": n, "k": k,
            "allreduce_bytes": act.numel() * act.element_size(), "allreduce_ms_alone": _median(reduce_alone),
            "candidates": {label: {"ms_alone": _median(t["alone"]), "ms_beside": _median(t["beside"]),
                                   "allreduce_ms_beside": _median(t["reduce"]), "makespan_ms": _median(t["span"])}
                           for label, t in times.items()},
        })
        out.append(record)
        if rank == 0:
            print(f"{model} {name} M={m} tp{world}: makespan cuBLAS {record['candidates']['cublas']['makespan_ms']:.3f}"
                  f" ms, best {record['best']} x{record['makespan_speedup']}, fastest alone "
                  f"{record['free_best']} x{record['free_best_makespan_speedup']}", flush=True)
    if rank == 0:
        results["points"] = out
        results["device"] = torch.cuda.get_device_name(0)
        results["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    dist.barrier()
    dist.destroy_process_group()


def _time(gemm, collective, comm: torch.cuda.Stream) -> tuple[float, float, float]:
    """(GEMM ms, collective ms, makespan ms) of one launch of each, the
    collective on `comm` launched first so that its kernels hold SMs when the
    GEMM starts; the makespan runs from before the first launch until both
    are done. Every rank enters aligned (a barrier) and leaves synchronized."""
    dist.barrier()
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    start, end, *marks = (torch.cuda.Event(enable_timing=True) for _ in range(6))
    start.record()
    if collective is not None:
        comm.wait_stream(main)
        with torch.cuda.stream(comm):
            marks[2].record()
            collective()
            marks[3].record()
    if gemm is not None:
        marks[0].record()
        gemm()
        marks[1].record()
    main.wait_stream(comm)
    end.record()
    torch.cuda.synchronize()
    g = marks[0].elapsed_time(marks[1]) if gemm is not None else math.nan
    c = marks[2].elapsed_time(marks[3]) if collective is not None else math.nan
    return g, c, start.elapsed_time(end)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 5)


def main() -> None:
    from kernels.compile import compile_many
    from tuner.runtime.linears import config_path, load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--models", default="gemma-3-27b,llama-3.1-8b", help="Shipped configs or config files.")
    parser.add_argument("--m", default="16,128,2048,8192")
    parser.add_argument("--picks", type=int, default=3, help="The model's best configs timed per point.")
    parser.add_argument("--budgets", default="16,32", help="SMs left free by the budgeted variants.")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus}, but {torch.cuda.device_count()} CUDA devices are visible")
    device = torch.cuda.get_device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    budgets = [int(b) for b in args.budgets.split(",") if b]
    plan = []
    for model in args.models.split(","):
        shape = DecoderShape.from_config(load_config(config_path(model)))
        for name, n, k in tp_gemms(shape, args.gpus):
            for m in (int(v) for v in args.m.split(",")):
                cfgs = candidates(Key(ARCH, device, Problem(m, n, k)), args.picks, budgets, sms)
                plan.append((model, shape.attention.hidden, name, m, n, k, [c.name() for c in cfgs]))
    every = sorted({GemmConfig.from_name(c) for *_, names in plan for c in names}, key=GemmConfig.name)
    print(f"compiled {compile_many(every, workers=max(1, (os.cpu_count() or 2) - 2))} kernels", flush=True)
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args.gpus, free_port(), args, plan, results), nprocs=args.gpus, join=True)
    points = results["points"]
    save({"device": results["device"], "gpus": args.gpus, "nccl": results["nccl"], "iters": args.iters,
          "torch": torch.__version__, "summary": summarize(points), "points": points},
         args.out, f"{device_slug(results['device'])}-overlap-tp{args.gpus}")


if __name__ == "__main__":
    main()
