"""cuBLAS and `gemm` at few rows against the DRAM floor: the time to read the weight once.

    python -m bench.roofline --shapes FILE [FILE ...] [--only GLOB] [--db DB] [--m 1,4,16,64,128]
                             [--rounds 100] [--suffix NAME] [--out bench/results]

At few rows a GEMM's time is the time to read its N x K bf16 weight once
from DRAM, so no kernel can run faster than the fastest way the device has
of reading those bytes. For every family (N, K) of the shape files (dense
keys named like `--only`) this measures that floor two ways and keeps the
faster (`floor_from`):

- `copy`: a device copy of the weight (`dst.copy_(w)`, same shape and
  dtype), which reads the weight and writes as many bytes, so its read time
  is taken as half its time (`copy_read_us`). It pays one launch and ramp as a
  GEMM does, but halving its time halves those too: for weights of a few
  MB, where they are much of the time, this floor sits below what any
  single kernel can reach (`launch_us`, a graph of a one-element copy, says
  how much a launch costs).
- `read`: a Triton kernel that only streams the weight (a flat view,
  16-byte loads, their magnitudes summed in registers and one float stored
  per program; the sum is checked against torch's),
  the fastest of `READ_VARIANTS` (`read_block`): one block per program
  or a persistent grid of a few programs per SM (the SM count) striding
  over the blocks (`read_kernel_us`).

Then, at each `--m`, `torch.mm(x, W.t())` (cuBLAS, as F.linear calls it) and,
with `--db`, `tuner.gemm(x, W.t())` as `bench.dynamic_m` times it (the
dispatch of DB's maps; `kernel` names the config it ran, "cublas" where its
map or a fallback sends the call to torch), each as a fraction of the
floor: `cublas_of_floor = floor_us / cublas_us`, `gemm_of_floor = floor_us /
gemm_us` (1.0: at the floor). Timing is `bench.dynamic_m`'s: each path is a
CUDA graph of one call, replayed after a write of twice the L2 size (the
weight comes from DRAM), the graphs taking turns round by round; times are
trimmed means (`tuner.backends.measure.trimmed_mean`). A family's first
rounds take the copy, the one-element copy and every read variant; the
fastest variant is the family's read kernel, and it and the copy are
replayed again in every M's rounds (with cuBLAS and gemm): the family's
floor is over all their replays.

Writes `<out>/<device-slug>-roofline[-SUFFIX].json` (`--suffix` names runs
over different databases apart): per family `name`, `n`, `k`, `weight_mb`,
`floor_us`, `floor_from`, `copy_us`, `copy_read_us`, `copy_gbps` (read and
written bytes over the copy's time), `read_kernel_us`, `read_gbps`,
`read_block`, `read_kernels` (every variant's us in the first rounds),
`launch_us`, `floor_gbps`, `one_launch_bound` (the most of the floor a
kernel reaches that pays one launch and reads at the copy's rate), and
`points`: per M `m`, `cublas_us`, `gemm_us`, `gemm_of_floor`,
`cublas_of_floor`, `kernel` and `rel_err` (gemm against cuBLAS); the gemm
fields are null without `--db`. Prints an 80-column table of the same
(a family at a time on stderr as it goes, all of it at the end). Triton
ships with torch's CUDA builds. For instance, the shipped databases
(gunzipped) over the families they tuned:

    python -m bench.roofline --shapes tuner/data/gemma3.txt --only 'gemma3-27b.*' --db GEMMA_DB --suffix gemma3-27b
    python -m tuner.cli shapes --from-model llama-3.1-8b -o llama.txt  # and qwen2.5-7b -o qwen.txt
    python -m bench.roofline --shapes llama.txt qwen.txt --db LLAMA_QWEN_DB --suffix llama-3.1-8b_qwen2.5-7b
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

from bench.dynamic_m import capture, families, flush_buffer, m_list, replay_rounds
from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner.backends.gpu_worker import rel_error
from tuner.backends.measure import trimmed_mean
from tuner.runtime import dispatch

try:  # Triton ships with torch's CUDA builds, not with its CPU-only ones
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

# The read kernel's variants: (elements a program reads per step, warps,
# programs per SM: 0 for one block per program, else a persistent grid of
# that many programs per SM striding over the blocks, eviction policy of
# the loads). 32 elements (four 16-byte loads) or 64 a thread: the
# persistent programs of an SM all fit in its registers at once.
READ_VARIANTS = (
    (4096, 4, 0, ""),
    (8192, 8, 0, ""),
    (8192, 4, 4, ""),
    (8192, 8, 4, ""),
    (8192, 8, 4, "evict_first"),
    (16384, 16, 2, ""),
)
TABLE_WIDTH = 80


def variant_name(block: int, warps: int, per_sm: int, evict: str) -> str:
    grid = f"p{per_sm}" if per_sm else "all"
    return f"b{block}-w{warps}-{grid}" + ("-ef" if evict else "")


def read_grid(numel: int, block: int, per_sm: int, sm_count: int) -> tuple[int, int, int]:
    """(programs, full blocks, start of the partial last block) of the read
    kernel over `numel` elements: one program a block (and one for a partial
    last block) where `per_sm` is 0, else `per_sm` programs an SM, never more
    than there are blocks. The last program reads the partial block."""
    full = numel // block
    blocks = full + (numel % block > 0)
    programs = blocks if per_sm == 0 else min(blocks, per_sm * sm_count)
    return max(programs, 1), full, full * block


if triton is not None:
    @triton.jit
    def _stream_sum(w_ptr, out_ptr, full_blocks, tail_start, numel, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
        """Sum of |w| over the program's blocks, `BLOCK` elements a step,
        into out[program]; the last program adds the partial last block."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for b in range(pid, full_blocks, programs):
            ptrs = w_ptr + tl.cast(b, tl.int64) * BLOCK + offs
            if EVICT_FIRST:
                x = tl.load(ptrs, eviction_policy="evict_first")
            else:
                x = tl.load(ptrs)
            acc += tl.abs(x.to(tl.float32))
        if pid == programs - 1:
            idx = tail_start + offs
            acc += tl.abs(tl.load(w_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32))
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def stream_read(w: torch.Tensor, out: torch.Tensor, block: int, warps: int, per_sm: int, evict: str,
                sm_count: int) -> None:
    """One launch of the read kernel over every element of contiguous `w`;
    `out` (float32, at least as long as the grid) gets one partial sum a
    program: together they sum `w`."""
    programs, full, tail = read_grid(w.numel(), block, per_sm, sm_count)
    _stream_sum[(programs,)](w, out, full, tail, w.numel(), BLOCK=block, EVICT_FIRST=evict == "evict_first",
                                  num_warps=warps)


def choose_floor(copy_us: float, read_us: float) -> tuple[float, str]:
    """The floor and where it came from: the copy's time halved (it reads
    the weight and writes as much) or the read kernel's, the faster."""
    return (copy_us / 2, "copy") if copy_us / 2 <= read_us else (read_us, "read")


def one_launch_bound(floor_us: float, copy_us: float, launch_us: float) -> float:
    """The most of the floor a single kernel can reach that pays one launch
    (`launch_us`) and then reads the weight as fast as the copy moves its
    bytes: the copy's floor halves its launch too, which no kernel can."""
    return floor_us / (launch_us + (copy_us - launch_us) / 2)


def kernel_of(why) -> str:
    """What a `dispatch.explain` answer runs: the config's name, or "cublas"."""
    return why.config_name if why.path == "kernel" and why.config_name else "cublas"


def of_floor(floor_us: float, us: float | None) -> float | None:
    return None if us is None else floor_us / us


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "~"


def table(record: dict) -> list[str]:
    """The record as lines of at most TABLE_WIDTH characters: a line a
    family (weight, floor, where from, copy and read bandwidth), then a line
    an M (times in us, each over the floor, and the kernel `gemm` ran)."""
    lines = [f"{'family':<24} {'MB':>7} {'floor us':>9} {'from':>4} {'copy GB/s':>9} {'read GB/s':>9}"
             f" {'launch us':>9}",
             f"{'M':>5} {'cuBLAS':>8} {'/floor':>6} {'gemm':>8} {'/floor':>6}  kernel (times in us)"]
    for fam in record["families"]:
        lines.append(f"{_cut(fam['name'], 24):<24} {fam['weight_mb']:7.1f} {fam['floor_us']:9.1f}"
                     f" {fam['floor_from']:>4} {fam['copy_gbps']:9.0f} {fam['read_gbps']:9.0f}"
                     f" {fam['launch_us']:9.1f}")
        for p in fam["points"]:
            head = f"{p['m']:>5} {p['cublas_us']:8.1f} {p['cublas_of_floor']:6.3f}"
            if p.get("gemm_us") is None:
                lines.append(head)
                continue
            head += f" {p['gemm_us']:8.1f} {p['gemm_of_floor']:6.3f}  "
            kernel = p["kernel"].removeprefix("sm90-").removeprefix("sm100-")
            lines.append(head + _cut(kernel, TABLE_WIDTH - len(head)))
    return [_cut(line, TABLE_WIDTH) for line in lines]


# Every graph of a run stays alive to its end: a run that let each family's
# graphs go met an illegal address in the next family's first cuBLAS graph.
_GRAPHS: list[torch.cuda.CUDAGraph] = []
# And so does every tensor a graph reads or writes.
_TENSORS: list[torch.Tensor] = []


def _capture(call) -> torch.cuda.CUDAGraph:
    graph = capture(call)
    _GRAPHS.append(graph)
    return graph


def _us(samples: list[float]) -> float:
    return trimmed_mean(samples) * 1e3


def compile_needed(db: str, fams, ms: list[int]) -> int:
    """Compile, in parallel and before timing, the kernels the families'
    maps choose at the M to be timed (`bench.dynamic_m.compile_choices`
    compiles every interval's: most lie above these M)."""
    from db.store import Store
    from kernels.compile import compile_many
    from kernels.space import GemmConfig

    store = Store(db, writer=False)
    try:
        cfgs = {GemmConfig.from_dict(r.config) for n, k in fams for r in store.ranges(n=n, k=k)
                if r.config and any(r.m_lo <= m <= r.m_hi for m in ms)}
    finally:
        store.close()
    return compile_many(sorted(cfgs, key=GemmConfig.name), workers=min(8, os.cpu_count() or 1))


def run(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    flush = flush_buffer(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    record = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "sm_count": sms, "rounds": args.rounds, "db": os.path.basename(args.db) if args.db else None,
              "m": args.m, "families": []}
    fams = families(args.shapes, args.only)
    if not fams:
        raise SystemExit(f"no dense family of {args.shapes} is named like {args.only!r}")
    if args.db:
        dispatch.configure(args.db)
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        print(f"compiled {compile_needed(args.db, fams, args.m)} kernels", file=sys.stderr)
    gen = torch.Generator(device=dev).manual_seed(0)
    print("\n".join(table({"families": []})), file=sys.stderr, flush=True)
    for (n, k), (name, _) in fams.items():
        w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        dst = torch.empty_like(w)
        one, one_dst = w.view(-1)[:1].clone(), torch.empty(1, dtype=w.dtype, device=dev)
        sums = torch.zeros(max(read_grid(w.numel(), v[0], v[2], sms)[0] for v in READ_VARIANTS),
                           dtype=torch.float32, device=dev)
        _TENSORS.extend((w, dst, one, one_dst, sums))
        copy = _capture(lambda: dst.copy_(w))
        launch = _capture(lambda: one_dst.copy_(one))
        reads = {variant_name(*v): _capture(lambda v=v: stream_read(w, sums, *v, sms)) for v in READ_VARIANTS}
        # The read kernel sums the weight's magnitudes: one that skipped a block would show here.
        want = w.abs().sum(dtype=torch.float32).item()
        for variant, graph in reads.items():
            sums.zero_()
            graph.replay()
            got = sums.sum().item()
            if abs(got - want) > 1e-5 * want:
                raise RuntimeError(f"{name}: read kernel {variant} summed {got}, the weight's magnitudes {want}")
        times = replay_rounds([copy, launch, *reads.values()], args.rounds, flush)
        copy_times, launch_us = times[0], _us(times[1])
        read_us = {v: _us(t) for v, t in zip(reads, times[2:])}
        block = min(read_us, key=read_us.get)
        read_times = times[2 + list(reads).index(block)]
        points = []
        for m in args.m:
            x = (torch.randn(m, k, device=dev, generator=gen) / k ** 0.25).to(torch.bfloat16)
            y, y_gemm = (torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(2))
            _TENSORS.extend((x, y, y_gemm))
            graphs = [_capture(lambda: torch.mm(x, w.t(), out=y)), copy, reads[block]]
            point = {"m": m, "kernel": None, "rel_err": None}
            if args.db:
                graphs.append(_capture(lambda: dispatch.gemm(x, w.t(), y_gemm)))
                # Asked after the first call, which built the kernel: a build that failed fell back to torch.
                point["kernel"] = kernel_of(dispatch.explain(x, w.t(), y_gemm))
            got = replay_rounds(graphs, args.rounds, flush)
            copy_times += got[1]
            read_times += got[2]
            point["cublas_us"] = _us(got[0])
            point["gemm_us"] = _us(got[3]) if args.db else None
            if args.db:
                for out, graph in ((y, graphs[0]), (y_gemm, graphs[3])):
                    out.zero_()
                    graph.replay()
                point["rel_err"] = rel_error(y_gemm, y.float())
            points.append(point)
        copy_us, read_kernel_us = _us(copy_times), _us(read_times)
        floor_us, floor_from = choose_floor(copy_us, read_kernel_us)
        for p in points:
            p["cublas_of_floor"] = of_floor(floor_us, p["cublas_us"])
            p["gemm_of_floor"] = of_floor(floor_us, p["gemm_us"])
        fam = {"name": name, "n": n, "k": k, "weight_mb": nbytes / 1e6, "floor_us": floor_us,
               "floor_from": floor_from, "floor_gbps": nbytes / floor_us / 1e3,
               "copy_us": copy_us, "copy_read_us": copy_us / 2, "copy_gbps": 2 * nbytes / copy_us / 1e3,
               "read_kernel_us": read_kernel_us, "read_gbps": nbytes / read_kernel_us / 1e3,
               "read_block": block, "read_kernels": read_us, "launch_us": launch_us,
               "one_launch_bound": one_launch_bound(floor_us, copy_us, launch_us),
               "points": [{key: p[key] for key in ("m", "cublas_us", "gemm_us", "gemm_of_floor",
                                                   "cublas_of_floor", "kernel", "rel_err")} for p in points]}
        record["families"].append(fam)
        for line in table({"families": [fam]})[2:]:
            print(line, file=sys.stderr, flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--only", default="*", help="Only families whose key name matches this glob.")
    parser.add_argument("--db", default=None, help="Time tuner.gemm with this database's choices too.")
    parser.add_argument("--m", type=m_list, default=[1, 4, 16, 64, 128])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--suffix", default="", help="Appended to the JSON file's name: -roofline-SUFFIX.json.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    record = run(args)
    save(record, args.out, f"{device_slug(record['device'])}-roofline" + (f"-{args.suffix}" if args.suffix else ""))
    print("\n".join(table(record)))


if __name__ == "__main__":
    main()
