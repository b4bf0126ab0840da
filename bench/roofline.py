"""How close cuBLAS runs to the DRAM floor at few rows, per family.

    python -m bench.roofline --shapes FILE [FILE ...] [--only GLOB] [--m 1,8,64,128,256]
                             [--rounds 60] [--out bench/results]

At few rows a GEMM's time is the time to read its weight once: no kernel
of the pool can beat cuBLAS there by more than cuBLAS leaves between itself
and a kernel that only streams the weight. For every family (N, K) of the
shape files this times, as `bench.dynamic_m` does (a CUDA graph of one call,
replayed after a write of twice the L2 size, the graphs taking turns), a
read-only Triton kernel (Triton ships with torch's CUDA builds) that sums
each row of the N x K bf16 weight (the fastest of a few block shapes) and
`torch.mm(x, W.t())` at each `--m`. Writes
`<out>/<device-slug>-roofline.json`: per family the read's time and
bandwidth and, per M, cuBLAS's time, bandwidth and read / cuBLAS time: the
fraction of cuBLAS's time a perfect few-row kernel would still need.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.dynamic_m import capture, families, flush_buffer, m_list, replay_rounds
from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner.backends.measure import trimmed_mean

# (rows, columns, warps) of one program of the read kernel; the fastest wins.
READ_BLOCKS = ((4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8))


@triton.jit
def _row_sums(w_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros((ROWS,), tl.float32)
    for k in range(0, K, COLS):
        cols = k + tl.arange(0, COLS)
        tile = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0)
        acc += tl.sum(tile.to(tl.float32), 1)
    tl.store(out_ptr + rows, acc)


# Every graph of a run stays alive to its end: a run that let each family's
# graphs go met an illegal address in the next family's first cuBLAS graph.
_GRAPHS: list[torch.cuda.CUDAGraph] = []


def _capture(call) -> torch.cuda.CUDAGraph:
    graph = capture(call)
    _GRAPHS.append(graph)
    return graph


def _reads(w: torch.Tensor, sums: torch.Tensor) -> dict[str, torch.cuda.CUDAGraph]:
    n, k = w.shape
    out = {}
    for rows, cols, warps in READ_BLOCKS:
        if n % rows == 0:
            out[f"{rows}x{cols}"] = _capture(
                lambda r=rows, c=cols, nw=warps: _row_sums[(n // r,)](w, sums, k, r, c, num_warps=nw))
    if not out:
        raise ValueError(f"no read block's rows divide the weight's {n} rows")
    return out


def run(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda", 0)
    flush = flush_buffer(dev)
    record = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rounds": args.rounds,
              "families": []}
    for (n, k), (name, _) in families(args.shapes, args.only).items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
        gb = w.numel() * w.element_size() / 1e9
        sums = torch.empty(n, dtype=torch.float32, device=dev)
        reads = _reads(w, sums)
        times = replay_rounds(list(reads.values()), args.rounds, flush)
        block, read_ms = min(zip(reads, map(trimmed_mean, times)), key=lambda r: r[1])
        fam = {"name": name, "n": n, "k": k, "weight_gb": gb, "read_block": block, "read_ms": read_ms,
               "read_tbps": gb / read_ms, "points": []}
        for m in args.m:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            graphs = [_capture(lambda: torch.mm(x, w.t(), out=y)), reads[block]]
            cublas, read = map(trimmed_mean, replay_rounds(graphs, args.rounds, flush))
            fam["points"].append({"m": m, "cublas_ms": cublas, "cublas_tbps": gb / cublas, "read_ms": read,
                                  "read_over_cublas": read / cublas})
            print(f"{name:28s} M={m:5d} cuBLAS {cublas * 1e3:7.1f} us {gb / cublas:4.2f} TB/s"
                  f"  read {read * 1e3:7.1f} us  read/cuBLAS {read / cublas:5.3f}", flush=True)
        record["families"].append(fam)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--only", default="*", help="Only families whose key name matches this glob.")
    parser.add_argument("--m", type=m_list, default=[1, 8, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    record = run(args)
    save(record, args.out, f"{device_slug(record['device'])}-roofline")


if __name__ == "__main__":
    main()
