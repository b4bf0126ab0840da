"""`gemm` against cuBLAS at M values the ladders did not tune, per family.

    python -m bench.dynamic_m --db DB --shapes FILE [FILE ...] [--only GLOB] [--points 64] [--seed 0]
                              [--m M,M,...] [--rounds 60] [--placements 3] [--out bench/results]

For every family (N, K) of the shape files, tuned beforehand into DB with
`tuner tune --backend gpu` (ladders on), times `tuner.gemm(x, W.t())`
against `F.linear(x, W)` at `--points` M values drawn log-uniformly from 1 to
8192 with a fixed seed, skipping every M the family has a winner at, and at
the ladder's rungs (the listed M and the powers of two). `--m` times the
M values given instead of random ones (JSON key `chosen`, file
`...-dynamic-m-chosen.json`): a second look,
with more rounds, at points a run found close. Each path is
captured in a CUDA graph of one call (so the host's dispatch cost, which
`bench.dispatch` reports, does not blur device time)
and timed with CUDA events around one replay after a write of twice the L2
size (the operands come from DRAM, as in a model's forward); the paths
(and a second capture of cuBLAS, the bench's floor: `cublas_again`) take
turns replay by replay, `--rounds` each, over `--placements` copies of the
input and output (`time_pair`); times are trimmed means
(`tuner.backends.measure.trimmed_mean`, as the tuner's validation uses), the ratio a
trimmed mean of the rounds' paired log ratios. Writes `<out>/<device-slug>-dynamic-m.json`: per family and M the
times, cuBLAS / gemm, cuBLAS / cuBLAS again, the path `gemm` took and the
interval of the map behind it; per family and overall the geometric mean,
the worst ratio and the floor's range.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import math
import random
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner.runtime import dispatch
from tuner.search.ladder import rungs
from tuner.backends.measure import trimmed_mean
from tuner.shapes import parse_shapes

M_MAX = 8192
WARMUP_S = 0.1


def random_ms(count: int, seed: int, exclude: set[int]) -> list[int]:
    """`count` distinct M, log-uniform on [1, M_MAX], none in `exclude`."""
    rng = random.Random(seed)
    out: set[int] = set()
    while len(out) < count:
        m = round(math.exp(rng.uniform(0.0, math.log(M_MAX))))
        if m not in exclude:
            out.add(m)
    return sorted(out)


def m_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def families(paths: list[str], only: str) -> dict[tuple[int, int], tuple[str, list[int]]]:
    """(N, K) -> (name, listed M) over the shape files' dense keys named like `only`."""
    out: dict[tuple[int, int], tuple[str, list[int]]] = {}
    for path in paths:
        for e in parse_shapes(path):
            p = e.problem
            if p.groups == 1 and not p.carveout and fnmatch.fnmatchcase(e.name, only):
                out.setdefault((p.n, p.k), (e.name, []))[1].append(p.m)
    return out


def time_pair(x: torch.Tensor, w: torch.Tensor, rounds: int, flush: torch.Tensor,
              placements: int = 1) -> dict:
    """ms of cuBLAS (F.linear's product) and of gemm on cold-L2 operands,
    their ratio, and the ratio of cuBLAS to a second capture of itself
    (`time_paths` with the database `dispatch` reads now)."""
    return time_paths(x, w, rounds, flush, placements)[0]


def time_paths(x: torch.Tensor, w: torch.Tensor, rounds: int, flush: torch.Tensor,
               placements: int = 1, dbs: list[str] | None = None) -> list[dict]:
    """ms of cuBLAS (F.linear's product) and of gemm on cold-L2 operands,
    their ratio, and the ratio of cuBLAS to a second capture of itself; with
    `dbs`, one gemm per database (each captured with `dispatch` reading it,
    all replayed in the same rounds), a dict each.

    Ratios are taken round by round (the replays of one round share the
    clocks and the DRAM state) and averaged as a trimmed mean of log ratios;
    the order cycles through every permutation, so a place in the round
    weighs on each graph alike, where a ratio of two trimmed means keeps
    the drift between rounds in it. The second cuBLAS graph is the bench's
    floor: two captures of one call can differ (where torch's cuBLAS
    workspace stands at capture time picks the algorithm), and a gemm that
    runs cuBLAS is such a second capture.

    With `placements` > 1 the input and output are copied to that many
    addresses, the rounds taking them in turn: at a few microseconds a
    product's time depends on where its operands lie (cuBLAS / our kernel
    read 0.96 on one pair of a 3072 x 3072 weight and its 5-row input out
    of 16, 1.04-1.05 on the others), as in a model, whose activations land where the
    allocator puts them. The ratio is over all rounds; `worst_placement`
    is the least of the placements' own ratios.
    """
    graphs, operands = [], []  # the graphs read and write the operands: they must outlive them
    paths = dbs or [None]
    size = len(paths) + 2
    for _ in range(placements):
        xp = x.clone()
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        operands += [xp, out]

        def cublas(xp=xp, out=out):
            return torch.mm(xp, w.t(), out=out)
        graphs.append(capture(cublas))
        for db in paths:
            if db is not None:
                dispatch.configure(db)
            graphs.append(capture(lambda xp=xp, out=out: dispatch.gemm(xp, w.t(), out)))
        graphs.append(capture(cublas))
    times = replay_rounds(graphs, rounds, flush, placements=placements)

    def logs(p: int, other: int) -> list[float]:
        return [math.log(c / o) for c, o in zip(times[size * p], times[size * p + other], strict=True)]

    def ratio(samples: list[float]) -> float:
        return math.exp(trimmed_mean(samples))
    every = range(placements)
    again = ratio([v for p in every for v in logs(p, size - 1)])
    return [{
        "cublas_ms": trimmed_mean([t for p in every for t in times[size * p]]),
        "gemm_ms": trimmed_mean([t for p in every for t in times[size * p + i]]),
        "ratio": ratio([v for p in every for v in logs(p, i)]),
        "cublas_again": again,
        "worst_placement": min(ratio(logs(p, i)) for p in every),
    } for i in range(1, size - 1)]


def flush_buffer(dev: torch.device) -> torch.Tensor:
    """A buffer of twice the L2 size: writing it leaves no operand in L2."""
    return torch.empty(2 * torch.cuda.get_device_properties(dev).L2_cache_size // 4, dtype=torch.float32,
                       device=dev)


def capture(call) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `call`, run once first (a gemm decides and builds,
    Triton compiles, before capture)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def replay_rounds(graphs: list[torch.cuda.CUDAGraph], rounds: int, flush: torch.Tensor,
                  placements: int = 1) -> list[list[float]]:
    """ms of every replay of each graph, each after a write of `flush`, the
    graphs taking turns in every order in turn (a place in the round weighs
    on each graph alike). With `placements` > 1 the graphs are that many
    equal groups and a round replays one group, the groups in turn."""
    size = len(graphs) // placements
    orders = list(itertools.permutations(range(size)))
    # A GPU's first calls after a pause run slow, a ramp interleaving does
    # not cancel (the measurements are at the tuner's own warm-up,
    # `tuner.backends.gpu_worker.IDLE_S`): rounds run untimed for WARMUP_S first.
    started = time.perf_counter()
    while time.perf_counter() - started < WARMUP_S:
        for graph in graphs:
            flush.add_(1)
            graph.replay()
        torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in graphs]
    for r in range(rounds):
        base = r % placements * size
        for i in orders[r // placements % len(orders)]:
            flush.add_(1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[base + i].replay()
            end.record()
            end.synchronize()
            times[base + i].append(start.elapsed_time(end))
    return times


def compile_choices(db: str, fams) -> int:
    """Compile every kernel the families' maps choose, in parallel, before timing."""
    from db.store import Store
    from kernels.compile import compile_many
    from kernels.space import GemmConfig

    store = Store(db, writer=False)
    cfgs = {GemmConfig.from_dict(r.config) for n, k in fams for r in store.ranges(n=n, k=k) if r.config}
    store.close()
    return compile_many(sorted(cfgs, key=GemmConfig.name), workers=8)


def tuned_ms(db: str, n: int, k: int) -> set[int]:
    """Every M the family has a winner at: the ladder's rungs and the ones filled in between."""
    from db.store import Store

    store = Store(db, writer=False)
    try:
        return {w.key["m"] for w in store.winners(limit=10_000, n=n, k=k, groups=1)}
    finally:
        store.close()


def check(x: torch.Tensor, w: torch.Tensor) -> float:
    want = F.linear(x.float(), w.float())
    got = dispatch.gemm(x, w.t()).float()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


def summary(points: list[dict]) -> dict:
    ratios = [p["ratio"] for p in points]
    again = [p["cublas_again"] for p in points]
    return {"geomean": math.exp(statistics.fmean(map(math.log, ratios))), "min": min(ratios),
            "worst_placement": min(p["worst_placement"] for p in points),
            "cublas_again_range": [min(again), max(again)],
            "kernel_share": sum(p["path"] == "kernel" for p in points) / len(points), "count": len(ratios)}


def run(args: argparse.Namespace) -> dict:
    dispatch.configure(args.db)
    warnings.simplefilter("ignore", dispatch.FallbackWarning)
    dev = torch.device("cuda", 0)
    flush = flush_buffer(dev)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    record = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "seed": args.seed,
              "rounds": args.rounds, "placements": args.placements, "families": []}
    all_sampled, all_rungs = [], []
    sample = "chosen" if args.m else "random"
    fams = families(args.shapes, args.only)
    print(f"compiled {compile_choices(args.db, fams)} kernels", file=sys.stderr)
    for (n, k), (name, listed) in fams.items():
        ladder = rungs(listed)
        tuned = set(ladder) | tuned_ms(args.db, n, k)
        w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
        fam = {"name": name, "n": n, "k": k, "rungs": ladder, sample: [], "at_rungs": []}
        for kind, ms in ((sample, args.m or random_ms(args.points, args.seed, tuned)), ("at_rungs", ladder)):
            for m in ms:
                x = (torch.randn(m, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
                why = dispatch.explain(x, w.t())
                err = check(x, w)
                fam[kind].append({
                    "m": m, **time_pair(x, w, args.rounds, flush, args.placements),
                    "path": why.path, "config": why.config_name, "interval": why.interval,
                    "rel_err": err,
                })
        fam["summary"] = {sample: summary(fam[sample]), "at_rungs": summary(fam["at_rungs"])}
        s = fam["summary"]
        print(f"{name:22s} {sample} geomean {s[sample]['geomean']:.3f} min {s[sample]['min']:.3f}"
              f" | rungs geomean {s['at_rungs']['geomean']:.3f} min {s['at_rungs']['min']:.3f}"
              f" | cuBLAS/cuBLAS {s[sample]['cublas_again_range'][0]:.3f}-{s[sample]['cublas_again_range'][1]:.3f}",
              file=sys.stderr)
        all_sampled += fam[sample]
        all_rungs += fam["at_rungs"]
        record["families"].append(fam)
    record["summary"] = {sample: summary(all_sampled), "at_rungs": summary(all_rungs)}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--only", default="*", help="Only families whose key name matches this glob.")
    parser.add_argument("--points", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--m", type=m_list, default=None, help="Comma-separated M to time instead of random ones.")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--placements", type=int, default=3,
                        help="Addresses of each point's input and output the rounds take in turn.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    record = run(args)
    save(record, args.out, f"{device_slug(record['device'])}-dynamic-m" + ("-chosen" if args.m else ""))


if __name__ == "__main__":
    main()
