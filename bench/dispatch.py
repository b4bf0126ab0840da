"""Host cost of `tuner.gemm` on a decided key against calling the kernel's runner directly.

    python -m bench.dispatch [--m 128] [--n 256] [--k 256] [--calls 100] [--rounds 200] [--out bench/results]

Stores a winner for the exact key (the arch's default static-persistent
config, under this process's versions) in a temporary database, points
`tuner.runtime.dispatch` at it and makes one call so the decision is cached and the
kernel built. Then, for each way of launching the same product, times
`--rounds` batches of `--calls` back-to-back calls on the host
(perf_counter around the batch, the GPU drained between batches so the
launch queue never blocks the host) and reports the median, 10th and 90th
percentile per call, in microseconds:

- runner: the compiled kernel's runner, called directly;
- gemm_out: `gemm(a, b, out)` (the decision is a dict lookup);
- gemm: `gemm(a, b)`, which also allocates the output;
- op: `torch.ops.gemm_tuner.gemm`, what a compiled graph calls (adds the
  op dispatcher);
- torch: `torch.mm(a, b, out=out)` (cuBLAS), for scale.

The shape is small so every call is launch-bound: GPU time per call (CUDA
events over a batch) is recorded too. Writes
`<out>/<device-slug>-dispatch.json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.kernels_sm90 import device_slug
from bench.record import save
from db.store import Store
from kernels import space
from tuner.runtime import dispatch
from tuner.backends.gpu_worker import versions
from tuner.key import Key, Problem

_ARCHS = {9: "sm90", 10: "sm100"}


def host_us(fn, calls: int, rounds: int) -> dict:
    """Per-call host time of `fn` over `rounds` batches of `calls` calls."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    q = statistics.quantiles(per_call, n=10)
    return {"median_us": round(statistics.median(per_call), 3), "p10_us": round(q[0], 3), "p90_us": round(q[-1], 3)}


def device_us(fn, calls: int) -> float:
    """GPU time per call over one batch (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / calls * 1e3, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.dispatch needs a CUDA device")

    major, minor = torch.cuda.get_device_capability()
    arch = _ARCHS.get(major)
    if arch is None:
        sys.exit(f"no kernel pool for compute capability {major}.{minor}")
    device = torch.cuda.get_device_name()
    cfg = space.defaults(arch)["static_persistent"]
    key = Key(arch, device, Problem(args.m, args.n, args.k))
    current = versions(device)

    a = torch.randn(args.m, args.k, device="cuda").to(torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda").to(torch.bfloat16)
    b = w.t()
    out = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)

    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "winners.db")
        store = Store(db)
        env = store.environment("gpu", arch, device, current)
        store.set_winner(
            store.key_id(key.to_dict(), "bench"), env, config_name=cfg.name(), scheduler=cfg.scheduler,
            config=cfg.to_dict(), ms=1.0, baseline_ms=1.0, best_by_scheduler={}, trials=1,
        )
        store.close()
        dispatch.configure(db)
        with warnings.catch_warnings():
            warnings.simplefilter("error", dispatch.FallbackWarning)
            dispatch.gemm(a, b, out)
        why = dispatch.explain(a, b, out)
        if why.path != "kernel":
            sys.exit(f"gemm does not run the tuned kernel: {why.reason}")

        from kernels.compile import get_kernel

        runner = get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
        ways = {
            "runner": lambda: runner(a, w, out),
            "gemm_out": lambda: dispatch.gemm(a, b, out),
            "gemm": lambda: dispatch.gemm(a, b),
            "op": lambda: torch.ops.gemm_tuner.gemm(a, b, None),
            "torch": lambda: torch.mm(a, b, out=out),
        }
        results = {}
        for name, fn in ways.items():
            results[name] = {**host_us(fn, args.calls, args.rounds), "device_us": device_us(fn, args.calls)}
        dispatch.configure(None)

    overhead = results["gemm_out"]["median_us"] - results["runner"]["median_us"]
    record = {
        "device": device, "arch": arch, "versions": current, "shape": [args.m, args.n, args.k],
        "dtype": "bf16", "layout": "tn", "config": cfg.name(), "calls": args.calls, "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results,
        "gemm_overhead_us": round(overhead, 3),
    }
    save(record, args.out, f"{device_slug(device)}-dispatch")
    return record


if __name__ == "__main__":
    main()
