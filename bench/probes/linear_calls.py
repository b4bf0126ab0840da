"""What a patched layer's call costs a whole eager decode step: the model's
linear layers are given, step by step, the class of each variant.

    python -m bench.probes.linear_calls [--models llama-3.1-8b,qwen2.5-7b,gemma-3-27b]
                                 [--batches 1,16] [--rounds 700] [--out bench/results]

Each model is built from its shipped config (two decoder layers, random bf16
weights). Every linear layer is prepared as `patch` leaves a layer whose
eager interval lies far from the decode M (M = 4096 only), so a patched call
runs `F.linear` after the interval test. Then, before each decode step, every
linear layer takes the class of one variant (an assignment per layer, made
for every variant alike) and the step is timed on the host clock after a
sync, the variants in a rotating order that also runs reversed:

- `nn.Linear`: the unpatched layer, the baseline (five Python frames a call);
- `subclass`: an `nn.Linear` subclass with no code of its own;
- `patched`: `TunedLinear` as shipped: its own `__call__` makes the bounds
  test and calls `F.linear` (one frame);
- `via_module`: `nn.Module.__call__`, then `TunedLinear.forward` (the
  bounds test, then `F.linear`): the patched call before it had its own.

Per variant: the speedup of a step over `nn.Linear`'s (`paired_speedup`)
and its median time. A second pass wraps every module's call (each class's
own `__call__`) and sums each step's host time per module type, so that it
shows where a variant's step spends more or less: in the linear calls, or
in the modules called after them.

Writes `<out>/<device-slug>-linear-calls.json` ($OUT instead when set).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time

import torch
from torch import nn

from bench.probes.host_path import timed_in_place
from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner.runtime.linears import build_model
from tuner.backends.measure import gc_paused, paired_speedup
from tuner.runtime.patch import TunedLinear


class _Subclass(nn.Linear):
    """No code of its own: only the class differs from nn.Linear."""


class _ViaModule(TunedLinear):
    """nn.Module's call, then the shipped forward (the bounds test, then
    F.linear): how a patched layer was called before it had a call of its own."""

    __call__ = nn.Module.__call__


VARIANTS = {"nn.Linear": nn.Linear, "subclass": _Subclass, "patched": TunedLinear, "via_module": _ViaModule}


def _per_type(acc: dict):
    """Inside the block each module call adds its host ns to `acc[its type's
    name]` (a linear layer's under "linear", whatever its class)."""
    linear = tuple(VARIANTS.values())

    def label(module: nn.Module) -> str:
        return "linear" if isinstance(module, linear) else type(module).__name__

    def add(key: str, ns: int) -> None:
        acc[key] += ns

    # The classes whose own __call__ a module call runs.
    return timed_in_place([(cls, "__call__", label) for cls in (nn.Module, TunedLinear, _ViaModule)], add)


def _steps(model, layers: list, batch: int, rounds: int, per_type: bool) -> dict:
    """{variant: [(step s, {module type: ns})]} over `rounds` rounds of one step per variant."""
    from transformers import StaticCache

    names = list(VARIANTS)
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    cache = StaticCache(config=model.config, max_cache_len=rounds * len(names) + 16)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = iter([torch.tensor([i], device=device) for i in range(rounds * len(names) + 16)])
    acc: dict = collections.defaultdict(int)
    steps: dict = {v: [] for v in names}

    def step(v: str) -> None:
        for layer in layers:
            layer.__class__ = VARIANTS[v]
        model(input_ids=token, past_key_values=cache, cache_position=next(positions))

    with torch.inference_mode(), _per_type(acc) if per_type else contextlib.nullcontext():
        for v in names * 2:  # warm-up
            step(v)
        with gc_paused():
            for r in range(rounds):
                k = r % len(names)
                order = names[k:] + names[:k]
                order = order[::-1] if (r // len(names)) % 2 else order
                for v in order:
                    sync()
                    acc.clear()
                    start = time.perf_counter()
                    step(v)
                    sync()
                    steps[v].append((time.perf_counter() - start, dict(acc), order.index(v) < order.index("nn.Linear")))
    return steps


def bench_model(name: str, batch: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = build_model(name, num_layers=2, device="cuda", dtype=torch.bfloat16)
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for layer in layers:  # as patch leaves a layer whose only interval is far from decode M
        layer.__class__ = TunedLinear
        layer.tuner_launchers, layer.tuner_compiled_spans, layer.tuner_spans = {}, (), ((4096, 4096),)
    plain = _steps(model, layers, batch, rounds, per_type=False)
    typed = _steps(model, layers, batch, rounds, per_type=True)
    base = plain["nn.Linear"]
    record = {"model": name, "batch": batch, "rounds": rounds, "step_us": {}, "speedup": {}, "per_type_us": {}}
    for v in VARIANTS:
        record["step_us"][v] = round(1e6 * statistics.median(s for s, _, _ in plain[v]), 1)
        if v != "nn.Linear":
            est = paired_speedup([(b, s, first) for (b, _, _), (s, _, first) in zip(base, plain[v])])
            record["speedup"][v] = {"speedup": est["speedup"], "log_se": est["log_se"]}
        types = sorted({t for _, acc, _ in typed[v] for t in acc})
        record["per_type_us"][v] = {t: round(statistics.median(acc.get(t, 0) for _, acc, _ in typed[v]) / 1e3, 1)
                                    for t in types}
    print(f"{name} batch {batch}: nn.Linear step {record['step_us']['nn.Linear']:.0f} us; "
          + ", ".join(f"{v} x{e['speedup']:.4f} (2 se {2 * e['log_se']:.4f})" for v, e in record["speedup"].items()),
          flush=True)
    del model
    torch.cuda.empty_cache()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda t: t.split(","), default=["llama-3.1-8b", "qwen2.5-7b", "gemma-3-27b"])
    parser.add_argument("--batches", type=lambda t: [int(b) for b in t.split(",")], default=[1, 16])
    parser.add_argument("--rounds", type=int, default=700, help="Steps per variant and pass.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    import transformers

    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__,
              "models": [bench_model(name, b, args.rounds) for name in args.models for b in args.batches]}
    save(record, os.environ.get("OUT") or args.out, f"{device_slug(torch.cuda.get_device_name())}-linear-calls")


if __name__ == "__main__":
    main()
