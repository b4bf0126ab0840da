"""Where an eager linear call's host time goes: a patched layer's kernel path
against `F.linear`, per call, on the layers of models patched from a database.

    python -m bench.probes.host_path --db DB [--models llama-3.1-8b,gemma-3-27b,qwen2.5-7b]
                              [--layers 2] [--batches 30] [--steps 150] [--out bench/results]

Each model is built from its shipped config (two decoder layers, random bf16
weights) and patched (`tuner.patch`). For every distinct (weight shape, M) of
a layer with an eager kernel interval, at the interval's least M, with an
input of (1, M, features) as a model passes it, each way of making the
product is called in batches of 20 with no sync inside a batch (so the
batch's wall time is the host's; the device's queue does not fill), the
ways interleaved batch by batch, the fastest batch per way counting:

- `F.linear`: what an unpatched layer's forward calls;
- `nn.Linear`: an unpatched layer called as a module (adds `nn.Module.__call__`);
- `patched`: the patched layer called as a module, taking its kept kernel;
- `kept_path`: the patched layer's kernel path alone (`TunedLinear._tuned`);
- `runner`: the compiled kernel alone on the weight and a given output;
- `empty`, `view`: one output allocation, one view of the input (the tensor
  ops the kept path adds to the runner).

Also records what `patch` measured the kernel path to add (`host_costs`).

Then the same calls inside the model's own forward (`--steps` eager decode
steps at batch 1 into a static KV cache, the collector paused), where the
host's caches hold the rest of the forward's code too: each linear layer's
call (`nn.Module.__call__` of an `nn.Linear`, a patched layer's own
`__call__`), a patched layer's kernel path (`_tuned`) and the runner are
timed in place (their methods wrapped for the run, every one alike), with the
step's enqueue and whole time, for the model unpatched, patched (every
kernel interval `patch` kept, no `check`) and patched with no eager
interval left (every call through `F.linear` behind the interval test).

Writes `<out>/<device-slug>-host-path.json` ($OUT instead when set).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from bench.kernels_sm90 import device_slug
from bench.record import save
from kernels import compile as kernels_compile
from tuner import unpatch
from tuner.runtime import dispatch
from tuner import patch
from tuner.runtime.linears import build_model
from tuner.backends.measure import gc_paused
from tuner.runtime.patch import TunedLinear, host_costs, host_us_per_call

_CALLS = 20


def _layer_paths(layer: TunedLinear, m: int) -> dict | None:
    """The ways of one product (module doc), or None if no kernel is kept at M."""
    w = layer.weight
    x = torch.randn(1, m, layer.in_features, device=w.device, dtype=w.dtype)
    layer._tuned(x)  # gemm decides, builds and the layer keeps the runner
    run = layer.tuner_launchers.get(m)
    if run is None:
        return None
    out = torch.empty(m, layer.out_features, device=w.device, dtype=w.dtype)
    plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device=w.device, dtype=w.dtype)
    plain.weight = w
    return {
        "F.linear": lambda: F.linear(x, w), "nn.Linear": lambda: plain(x), "patched": lambda: layer(x),
        "kept_path": lambda: layer._tuned(x), "runner": lambda: run(x[0], w, out),
        "empty": lambda: torch.empty((m, layer.out_features), dtype=w.dtype, device=w.device),
        "view": lambda: x.view(-1, layer.in_features),
    }


# What `_in_forward` times in place: (class, method, the label of a call on
# an instance, or None for calls not timed). nn.Linear's call is
# nn.Module's, shared by every module.
_IN_PLACE = ((torch.nn.Module, "__call__", lambda m: "nn.Linear call" if type(m) is torch.nn.Linear else None),
             (TunedLinear, "__call__", lambda m: "patched call"), (TunedLinear, "_tuned", lambda m: "kernel_path"),
             (kernels_compile._Runner, "__call__", lambda m: "runner"))


@contextlib.contextmanager
def timed_in_place(methods, record):
    """Inside the block each (class, method name, label) of `methods` times
    its calls on the host clock: `record(label(instance), ns)` after each
    call whose label is not None. The class's own methods come back after."""
    def timed(fn, label):
        def call(self, *args, **kwargs):
            key = label(self)
            if key is None:
                return fn(self, *args, **kwargs)
            start = time.perf_counter_ns()
            out = fn(self, *args, **kwargs)
            record(key, time.perf_counter_ns() - start)
            return out
        return call

    saved = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in methods]
    try:
        for cls, attr, label in methods:
            setattr(cls, attr, timed(cls.__dict__[attr], label))
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


def _in_forward(model, steps: int) -> dict:
    """Per call kind inside `steps` decode steps: calls a step, median us; and the step's times."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=steps + 8)
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    positions = [torch.tensor([i], device="cuda") for i in range(steps + 8)]
    calls, enqueue, whole = collections.defaultdict(list), [], []
    with torch.no_grad():
        for i in range(8):  # warm-up: kernels decided, built and kept
            model(input_ids=token, past_key_values=cache, cache_position=positions[i])
        with gc_paused(), timed_in_place(_IN_PLACE, lambda key, ns: calls[key].append(ns)):
            for i in range(8, steps + 8):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(input_ids=token, past_key_values=cache, cache_position=positions[i])
                queued = time.perf_counter()
                torch.cuda.synchronize()
                enqueue.append(queued - start)
                whole.append(time.perf_counter() - start)
    return {"step_enqueue_us": round(1e6 * statistics.median(enqueue), 1),
            "step_us": round(1e6 * statistics.median(whole), 1),
            "calls": {label: {"per_step": len(ns) / steps, "median_us": round(statistics.median(ns) / 1e3, 2)}
                      for label, ns in sorted(calls.items())}}


def bench_model(name: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = build_model(name, num_layers=args.layers, device="cuda", dtype=torch.bfloat16)
    in_forward = {"unpatched": _in_forward(model, args.steps)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shapes left to cuBLAS are not what this measures
        patch(model)
    in_forward["patched"] = _in_forward(model, args.steps)
    rows, seen = [], set()
    with torch.no_grad():
        for path, layer in model.named_modules():
            if type(layer) is not TunedLinear or not layer.tuner_spans:
                continue
            m = layer.tuner_spans[0][0]
            if (layer.weight.shape, m) in seen:
                continue
            seen.add((layer.weight.shape, m))
            paths = _layer_paths(layer, m)
            if paths is None:
                continue
            us = host_us_per_call(paths, batches=args.batches, calls=_CALLS)
            us = {name: round(v, 2) for name, v in us.items()}
            rows.append({"layer": path, "n": layer.out_features, "k": layer.in_features, "m": m, "host_us": us})
            print(f"{name} {path} {layer.out_features}x{layer.in_features} M={m}: "
                  + ", ".join(f"{p} {v:.1f}" for p, v in us.items()), flush=True)
    for layer in model.modules():
        if type(layer) is TunedLinear:
            layer.tuner_spans = ()
    in_forward["patched, no eager interval"] = _in_forward(model, args.steps)
    unpatch(model)
    in_forward["unpatched again"] = _in_forward(model, args.steps)
    for variant, got in in_forward.items():
        print(f"{name} decode step, {variant}: enqueue {got['step_enqueue_us']:.0f} us, whole {got['step_us']:.0f} us; "
              + ", ".join(f"{label} {c['per_step']:.0f}x {c['median_us']:.1f}" for label, c in got["calls"].items()),
              flush=True)
    return {"model": name, "layers": rows, "decode_step_in_place": in_forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--models", type=lambda t: t.split(","), default=["llama-3.1-8b", "gemma-3-27b", "qwen2.5-7b"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--steps", type=int, default=150, help="Decode steps timed in place per variant.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    dispatch.configure(args.db)
    models = [bench_model(name, args) for name in args.models]
    eager, compiled = host_costs()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls_per_batch": _CALLS,
              "batches": args.batches, "patch_host_costs_us": {"eager": eager, "compiled": compiled},
              "models": models}
    save(record, os.environ.get("OUT") or args.out, f"{device_slug(torch.cuda.get_device_name())}-host-path")


if __name__ == "__main__":
    main()
