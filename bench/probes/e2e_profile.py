"""Where a patched forward's time goes: one prefill case of a model under
torch.profiler, with its linear layers as they are and with given configs
wired into given (N, K) at the case's M.

    python -m bench.probes.e2e_profile --model gemma-3-27b --prefill 4x1024 \\
        --kernel 21504x5376=sm90-stream_k-t128x256-c2x1-s4-w4m \\
        --kernel 5376x21504=sm90-static_persistent-t128x224-c1x2-s4-w4m \\
        [--layers 2] [--rounds 30] [--out bench/results]

No database: each config is compiled and called by the layers of its
weight shape in place of `F.linear` (eager), so the profile shows the
kernels in the model's own context, apart from the dispatch's decisions.
Reports, per variant (unpatched, patched):

- the forward's wall time, median of `--rounds` alternating forwards, each
  timed on the host clock after a sync (as `bench.e2e` times a prefill);
- the device time per kernel over one profiled forward, summed by name;

and each configured GEMM alone at the case's M against `torch.mm`: CUDA
events around one call after an L2 flush (the tuner's protocol), and after
the flush and a copy into A (the previous op wrote A), and back to back
with neither, medians.
Writes `<out>/<device-slug>-e2e-profile-<model>-<batch>x<seq>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.dynamic_m import flush_buffer
from bench.e2e import _pairs, _rel_err, _timed
from bench.kernels_sm90 import device_slug
from kernels.compile import get_kernel
from kernels.space import GemmConfig
from tuner.runtime.linears import build_model

TOP = 12  # kernels listed per variant


def _kernel(text: str) -> tuple[tuple[int, int], GemmConfig]:
    shape, _, name = text.partition("=")
    try:
        n, k = (int(v) for v in shape.split("x"))
        return (n, k), GemmConfig.from_name(name)
    except ValueError as exc:  # InvalidConfig included
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxK=CONFIG_NAME ({exc})") from exc


def _wire(model: torch.nn.Module, runners: dict) -> int:
    """Route every nn.Linear whose (N, K) has a runner through it; returns how many."""
    wired = 0
    for layer in model.modules():
        runner = runners.get((layer.out_features, layer.in_features)) if isinstance(layer, torch.nn.Linear) else None
        if runner is None:
            continue

        def forward(x, layer=layer, runner=runner):
            x2 = x.reshape(-1, layer.in_features)
            if not x2.is_contiguous():
                return F.linear(x, layer.weight, layer.bias)
            out = torch.empty(x2.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
            runner(x2, layer.weight, out)
            return out.view(*x.shape[:-1], layer.out_features)
        layer.forward = forward
        wired += 1
    return wired


def _kernel_times(fn) -> list[tuple[str, int, float]]:
    """(kernel name, calls, device us) of one call of `fn`, largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


def _alone(m: int, n: int, k: int, runner, rounds: int) -> dict:
    """Median us of one call, the config against torch.mm, after an L2
    flush ("cold", the tuner's protocol) and after the flush and a kernel
    that writes A ("a_written", as in a forward, where the previous op
    produced A), and with neither ("hot": back to back)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a_src = a.clone()
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flush = flush_buffer(torch.device("cuda", 0))
    paths = {"kernel": lambda: runner(a, w, out), "cublas": lambda: torch.mm(a, w.t(), out=out)}
    got = {}
    for state in ("cold", "a_written", "hot"):
        times = {p: [] for p in paths}
        for r in range(rounds):
            for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                if state != "hot":
                    flush.fill_(r)
                if state == "a_written":
                    a.copy_(a_src)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                paths[p]()
                end.record()
                end.synchronize()
                times[p].append(1e3 * start.elapsed_time(end))
        got[state] = {p: statistics.median(t) for p, t in times.items()}
    return got


def run(args: argparse.Namespace) -> dict:
    (batch, seq), = args.prefill
    m = batch * seq
    runners = {nk: get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn") for nk, cfg in args.kernel}
    torch.manual_seed(0)
    models = {"unpatched": build_model(args.model, num_layers=args.layers, device="cuda", dtype=torch.bfloat16)}
    models["patched"] = build_model(args.model, num_layers=args.layers, device="cuda", dtype=torch.bfloat16)
    models["patched"].load_state_dict(models["unpatched"].state_dict())
    wired = _wire(models["patched"], runners)
    ids = torch.randint(0, models["unpatched"].config.get_text_config().vocab_size, (batch, seq), device="cuda")
    record = {"device": torch.cuda.get_device_name(), "model": args.model, "layers": args.layers,
              "batch": batch, "seq": seq, "wired_layers": wired,
              "kernels": {f"{n}x{k}": cfg.name() for (n, k), cfg in args.kernel}, "variants": {}}
    with torch.inference_mode():
        fns = {v: (lambda model=model: model(input_ids=ids, logits_to_keep=1, use_cache=False).logits)
               for v, model in models.items()}
        record["rel_err"] = _rel_err(fns["patched"](), fns["unpatched"]())
        wall = {v: [] for v in fns}
        for r in range(args.rounds):
            for v in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                wall[v].append(1e3 * _timed(fns[v]))
        for v, fn in fns.items():
            rows = _kernel_times(fn)
            record["variants"][v] = {"forward_ms": statistics.median(wall[v]),
                                     "device_ms": sum(r[2] for r in rows) / 1e3,
                                     "kernels": [{"name": name, "calls": calls, "us": us} for name, calls, us in rows]}
    record["alone"] = {f"{n}x{k}": _alone(m, n, k, runners[(n, k)], args.rounds) for (n, k), _ in args.kernel}
    return record


def report(record: dict) -> str:
    lines = [f"{record['model']} prefill {record['batch']}x{record['seq']}, "
             f"{record['wired_layers']} layers wired, rel. err {record['rel_err']:.1e}"]
    for v, r in record["variants"].items():
        lines.append(f"{v}: forward {r['forward_ms']:.3f} ms, device {r['device_ms']:.3f} ms")
        for row in r["kernels"][:TOP]:
            lines.append(f"  {row['us']:10.1f} us {row['calls']:4d}x  {row['name'][:56]}")
    for nk, states in record["alone"].items():
        for state, t in states.items():
            lines.append(f"alone {nk} {state}: kernel {t['kernel']:.1f} us, cuBLAS {t['cublas']:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prefill", type=_pairs, required=True, help="one batch x seq")
    parser.add_argument("--kernel", type=_kernel, action="append", required=True, help="NxK=CONFIG_NAME")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if len(args.prefill) != 1:
        parser.error("--prefill takes one batch x seq")
    record = run(args)
    print(report(record))
    out = Path(os.environ.get("OUT") or args.out)
    out.mkdir(parents=True, exist_ok=True)
    b, s = record["batch"], record["seq"]
    path = out / f"{device_slug(record['device'])}-e2e-profile-{os.path.basename(args.model)}-{b}x{s}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
