"""One eager decode step of a model, patched and unpatched, side by side:
what a patched layer changes where no kernel of ours runs.

    python -m bench.probes.decode_step DB [MODEL] [BATCH]     # default llama-3.1-8b, 1

The model (`transformers`, shipped config, two decoder layers, random bf16
weights) in more copies: `patched` (`tuner.patch` on DB, as a user runs
it, no `check`), `nowhere` (patched, every layer's intervals moved where no
call reaches), `eagerless` (patched, eager intervals emptied: what `check`
leaves a layer kept for compiled graphs), `plain2` (a second unpatched
copy: the floor two copies of one code measure apart), and, for the layers
`patch` takes, `swapped` (their class swapped, `nn.Linear`'s forward) and
`instance` (`nn.Linear`, the patched forward's cuBLAS path without its
interval test as an instance attribute). Printed:
the patched layers and their intervals; the Python calls of one step
(`sys.setprofile`), plain against patched, and where they differ; the CUDA
kernels of one step (profiler), likewise; then each copy's steps paired
with the first unpatched copy's (1500 pairs, alternating which goes first,
each timed on the host clock between syncs), twice over, as the speedup
over it with two standard errors.
"""

from __future__ import annotations

import collections
import copy
import math
import statistics
import sys
import time
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tuner.runtime import dispatch
from tuner import patch
from tuner.runtime.linears import build_model
from tuner.backends.measure import gc_paused
from tuner.runtime.patch import TunedLinear

_PAIRS, _REFILL = 1500, 60  # paired steps per variant; steps between cache refills
_NOWHERE = ((1 << 30, 1 << 30),)
_VARIANTS = ("plain2", "swapped", "instance", "nowhere", "eagerless", "patched")


class _Swapped(nn.Linear):
    """`nn.Linear` under another class, as `patch` swaps it, keeping `nn.Linear`'s forward."""


def _lean(self, input):
    """The patched forward's cuBLAS path without its interval test."""
    p = self._parameters
    return F.linear(input, p["weight"], p["bias"])


def main() -> None:
    warnings.simplefilter("ignore")
    dispatch.configure(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.manual_seed(0)
    base = build_model(name, num_layers=2, device="cuda", dtype=torch.bfloat16)
    vocab = base.config.get_text_config().vocab_size
    copies = {"plain": base, **{v: copy.deepcopy(base) for v in _VARIANTS}}
    for v in ("patched", "nowhere", "eagerless"):
        patch(copies[v])
    for name_, layer in copies["patched"].named_modules():
        if type(layer) is TunedLinear:
            copies["swapped"].get_submodule(name_).__class__ = _Swapped
            twin = copies["instance"].get_submodule(name_)
            twin.forward = types.MethodType(_lean, twin)
    for layer in copies["nowhere"].modules():
        if type(layer) is TunedLinear:
            layer.tuner_spans = layer.tuner_compiled_spans = _NOWHERE
    for layer in copies["eagerless"].modules():
        if type(layer) is TunedLinear:
            layer.tuner_spans = ()
    print("patched layers:", {n: (m.tuner_spans, m.tuner_compiled_spans) for n, m in
                              copies["patched"].named_modules() if type(m) is TunedLinear})
    from transformers import StaticCache

    prompt = torch.randint(0, vocab, (batch, 128), device="cuda")
    token = torch.randint(0, vocab, (batch, 1), device="cuda")
    caches = {v: StaticCache(config=m.config, max_cache_len=256) for v, m in copies.items()}
    position = torch.tensor([128], device="cuda")

    def prefill(v):
        caches[v].reset()
        copies[v](input_ids=prompt, past_key_values=caches[v], cache_position=torch.arange(128, device="cuda"),
                  logits_to_keep=1)

    def step(v):
        return copies[v](input_ids=token, past_key_values=caches[v], cache_position=position).logits

    def timed(v):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(v)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        for v in copies:
            prefill(v), step(v), step(v)
        torch.cuda.synchronize()
        _differ("python calls per step", _python_calls(step, "plain"), _python_calls(step, "patched"))
        _differ("kernels per step", _kernels(step, "plain"), _kernels(step, "patched"))
        for v in copies:
            prefill(v)
        for other in _VARIANTS * 2:
            logs = []
            with gc_paused():
                for r in range(_PAIRS):
                    if r % _REFILL == 0:  # a StaticCache counts the positions written
                        prefill("plain"), prefill(other)
                    if r % 2:
                        a, b = timed("plain"), timed(other)
                    else:
                        b, a = timed(other), timed("plain")
                    logs.append(math.log(a / b))
            mu, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
            print(f"{other:8s} speedup over plain x{math.exp(mu):.4f} (2 se {2 * se:.4f})")


def _python_calls(step, v) -> collections.Counter:
    calls = collections.Counter()

    def seen(frame, event, arg):
        if event == "call":
            calls[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[f"C:{getattr(arg, '__qualname__', arg)}"] += 1
    sys.setprofile(seen)
    step(v)
    sys.setprofile(None)
    torch.cuda.synchronize()
    return calls


def _kernels(step, v) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(v)
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _differ(what: str, plain: collections.Counter, patched: collections.Counter) -> None:
    print(f"{what}: plain {sum(plain.values())} patched {sum(patched.values())}")
    for key in sorted(plain.keys() | patched.keys(), key=lambda k: -abs(patched[k] - plain[k])):
        if patched[key] != plain[key]:
            print(f"  {patched[key] - plain[key]:+4d} {key[:120]}")


if __name__ == "__main__":
    main()
