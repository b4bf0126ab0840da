"""What a patched layer costs where it runs cuBLAS: eager forwards of a
model whose linear layers are `TunedLinear` with intervals the forward never
falls in, against the same model unpatched.

    python -m bench.probes.patch_overhead [--model qwen2.5-7b] [--layers 2] [--prefill 1x512]
                                   [--rounds 300] [--db DB] [--compiled] [--out bench/results]

Two copies of the model (`transformers`, shipped config, random bf16
weights). Per variant of the second copy's bias-free linear layers:

- `plain`: left as they are (two copies of one code: the bench's floor);
- `tuned`: `TunedLinear` with an interval no call of the forward reaches,
  so every call takes `F.linear` after the layer's interval test;
- `patch` (with `--db`): `tuner.patch` as a user runs it on that database.

Forwards of the two copies alternate (`bench.e2e._paired`), then again with
the copies' roles swapped, as bench.e2e pairs them. Reported per variant:
its speed over the unpatched copy (`paired_speedup`, +- 2 se) and, per
forward, the host's time to enqueue it (the call's return, before the sync)
and the whole forward (after the sync), medians. A forward whose enqueue
time is its whole time waits on the host, where a layer's extra Python is
the cost.

With `--compiled` both copies run under `torch.compile` (each half from an
empty dynamo cache), where a layer's interval test is traced away and only
its guards are left.

Writes `<out>/<device-slug>-patch-overhead[-compiled].json` ($OUT instead when set).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

from bench.e2e import VARIANTS, _paired, _pairs
from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner.runtime.linears import build_model
from tuner.backends.measure import paired_speedup
from tuner import unpatch
from tuner.runtime import dispatch
from tuner import patch
from tuner.runtime.patch import TunedLinear

_NOWHERE = ((1 << 30, 1 << 30),)  # an interval no forward of this bench reaches


def _set(model: nn.Module, variant: str) -> int:
    """Turn `model`'s linear layers into `variant`; returns how many are `TunedLinear`."""
    unpatch(model)
    if variant == "patch":
        patch(model)
    elif variant == "tuned":
        for layer in model.modules():
            if isinstance(layer, nn.Linear) and layer.bias is None:
                layer.__class__ = TunedLinear
                layer.tuner_spans = layer.tuner_compiled_spans = _NOWHERE
                layer.tuner_launchers = {}
    return sum(type(m) is TunedLinear for m in model.modules())


def _forward(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(host seconds to enqueue one forward, seconds to its end)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    model(input_ids=ids, logits_to_keep=1, use_cache=False)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    return queued - start, time.perf_counter() - start


def measure(models: list[nn.Module], variant: str, ids: torch.Tensor, rounds: int, compiled: bool = False) -> dict:
    """`variant` on one copy against the other left plain, both ways round."""
    pairs, enqueue, whole = [], {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    for half, lead in enumerate((VARIANTS, VARIANTS[::-1])):
        roles = dict(zip(VARIANTS, models if half == 0 else models[::-1], strict=True))
        layers = _set(roles["patched"], variant)
        _set(roles["unpatched"], "plain")
        if compiled:
            torch._dynamo.reset()
            roles = {v: torch.compile(m) for v, m in roles.items()}

        def trial(order):
            s = {}
            for v in order:
                s[v] = _forward(roles[v], ids)
                enqueue[v].append(s[v][0])
                whole[v].append(s[v][1])
            return [(s["unpatched"][1], s["patched"][1], order[0] == "patched")]
        pairs += _paired(trial, rounds // 2, lead)
    _set(models[0], "plain")
    _set(models[1], "plain")
    est = paired_speedup(pairs)
    return {"variant": variant, "layers": layers, "speedup": est["speedup"], "log_se": est["log_se"],
            "enqueue_us": {v: 1e6 * statistics.median(t) for v, t in enqueue.items()},
            "forward_us": {v: 1e6 * statistics.median(t) for v, t in whole.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefill", type=_pairs, default=_pairs("1x512"), help="one batch x seq")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--db", default=None, help="Also time `tuner.patch` on this database.")
    parser.add_argument("--compiled", action="store_true", help="Both copies under torch.compile.")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if len(args.prefill) != 1:
        parser.error("--prefill takes one batch x seq")
    (batch, seq), = args.prefill
    torch.manual_seed(0)
    model = build_model(args.model, num_layers=args.layers, device="cuda", dtype=torch.bfloat16)
    models = [model, copy.deepcopy(model)]
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (batch, seq), device="cuda")
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "layers": args.layers, "prefill": f"{batch}x{seq}", "rounds": args.rounds,
              "mode": "compiled" if args.compiled else "eager", "variants": []}
    variants = ("plain", "tuned", "patch") if args.db else ("plain", "tuned")
    if args.db:
        dispatch.configure(args.db)
    with torch.inference_mode():
        for variant in variants * 2:
            record["variants"].append(measure(models, variant, ids, args.rounds, args.compiled))
            r = record["variants"][-1]
            print(f"{variant:6s} {r['layers']} layers: x{r['speedup']:.4f} (2 se {2 * r['log_se']:.4f}) "
                  f"enqueue {r['enqueue_us']['patched']:.0f} / {r['enqueue_us']['unpatched']:.0f} us, "
                  f"forward {r['forward_us']['patched']:.0f} / {r['forward_us']['unpatched']:.0f} us")
    stem = f"{device_slug(torch.cuda.get_device_name())}-patch-overhead" + ("-compiled" if args.compiled else "")
    save(record, os.environ.get("OUT") or args.out, stem)


if __name__ == "__main__":
    main()
